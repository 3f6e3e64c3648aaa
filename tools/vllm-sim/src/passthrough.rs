//! vLLM 0.34's routes beside the OpenAI completion ones, registered by the model's task as
//! `vllm/entrypoints/launchers/api_server/routers.py` does: `/tokenize` and `/detokenize` on every
//! server (`vllm/entrypoints/serve/tokenize/`); `/pooling` for embed and classify models, `/classify`
//! for classify models, `/score` `/v1/score` `/rerank` `/v1/rerank` `/v2/rerank` for embed models
//! and classify models with one label (`vllm/entrypoints/pooling/factories.py`,
//! `enable_scoring_api`); `/v1/audio/transcriptions` and `/v1/audio/translations` for transcription
//! models (`vllm/entrypoints/speech_to_text/factories.py`). A route the task lacks is FastAPI's
//! `404 {"detail":"Not Found"}`. As in vLLM, the API key guards the `/v1` and `/v2` paths only
//! (`vllm/entrypoints/serve/middleware/authenticate.py`), and only POST is routed.

use hyper::body::Incoming;
use hyper::{Method, Request, Response};

use crate::body::SimBody;
use crate::config::Task;
use crate::error::ApiError;
use crate::state::AppState;

/// Every path this module answers (registered or not for the server's task).
const ROUTES: [&str; 11] = [
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
];

/// Whether `path` is one of this module's routes.
pub fn is_route(path: &str) -> bool {
    ROUTES.contains(&path)
}

/// Whether a server of `task` with `num_labels` labels registers `path`.
pub fn registered(task: Task, num_labels: u32, path: &str) -> bool {
    let scoring = task == Task::Embed || (task == Task::Classify && num_labels == 1);
    match path {
        "/tokenize" | "/detokenize" => true,
        "/pooling" => matches!(task, Task::Embed | Task::Classify),
        "/classify" => task == Task::Classify,
        "/score" | "/v1/score" | "/rerank" | "/v1/rerank" | "/v2/rerank" => scoring,
        "/v1/audio/transcriptions" | "/v1/audio/translations" => task == Task::Transcription,
        _ => false,
    }
}

/// Answers one of [`ROUTES`].
pub async fn serve(
    state: &AppState,
    request: Request<Incoming>,
    path: &str,
    method: &Method,
) -> Result<Response<SimBody>, ApiError> {
    crate::server::guard(state, &request, path)?;
    if !registered(state.config.task(), state.config.num_labels, path) {
        return Err(ApiError::RouteNotFound);
    }
    let hidden = matches!(path, "/tokenize" | "/detokenize")
        && state
            .faults
            .lock()
            .map(|f| f.settings.tokenize_not_found)
            .unwrap_or(false);
    if hidden {
        return Err(ApiError::RouteNotFound);
    }
    if method != Method::POST {
        return Err(ApiError::MethodNotAllowed);
    }
    let content_type = request
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let bytes = crate::server::read_body(request).await?;
    let decision = state.fault_decision();
    if !decision.first_byte_delay.is_zero() {
        tokio::time::sleep(decision.first_byte_delay).await;
    }
    match decision.reject {
        Some(429) => return Err(ApiError::RateLimited),
        Some(status) => return Err(ApiError::Injected(status)),
        None => {}
    }
    match path {
        "/tokenize" => crate::tokenize::tokenize(state, &bytes),
        "/detokenize" => crate::tokenize::detokenize(state, &bytes),
        "/pooling" => crate::pooling::pooling(state, &bytes).await,
        "/classify" => crate::pooling::classify(state, &bytes).await,
        "/score" | "/v1/score" => crate::pooling::score(state, &bytes).await,
        "/v1/audio/transcriptions" => {
            crate::audio::speech_to_text(state, &content_type, &bytes, true).await
        }
        "/v1/audio/translations" => {
            crate::audio::speech_to_text(state, &content_type, &bytes, false).await
        }
        _ => crate::pooling::rerank(state, &bytes).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_follow_the_task_as_in_vllm_0_34() {
        for p in ["/tokenize", "/detokenize"] {
            for t in [
                Task::Generate,
                Task::Embed,
                Task::Classify,
                Task::Transcription,
            ] {
                assert!(registered(t, 1, p));
            }
        }
        assert!(!registered(Task::Generate, 1, "/v1/rerank"));
        assert!(!registered(Task::Generate, 1, "/pooling"));
        assert!(registered(Task::Embed, 1, "/v2/rerank") && registered(Task::Embed, 1, "/score"));
        assert!(!registered(Task::Embed, 1, "/classify"));
        assert!(
            registered(Task::Classify, 1, "/rerank") && registered(Task::Classify, 1, "/classify")
        );
        // A classifier with several labels is no cross-encoder: no scoring API.
        assert!(
            !registered(Task::Classify, 3, "/v1/score")
                && registered(Task::Classify, 3, "/classify")
        );
        assert!(registered(Task::Transcription, 1, "/v1/audio/translations"));
        assert!(!registered(Task::Generate, 1, "/v1/audio/transcriptions"));
        assert!(!registered(Task::Transcription, 1, "/pooling"));
        assert!(ROUTES.iter().all(|p| is_route(p)) && !is_route("/v1/chat/completions"));
    }
}
