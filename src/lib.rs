//! The edge Worker's entry points: the fetch handler with its route table, and the cron trigger.
//! Each route's handler is its module's: `request/completion/` (the OpenAI completion endpoints,
//! the request path, in `request/`), `operator/models.rs`, `operator/admin.rs`,
//! `operator/metrics.rs`, `operator/dashboard.rs`. The other folders: `clients/` (client keys and
//! their token reservations) and `platform/` (Durable Object calls, HTTP helpers and the clock,
//! settings, bearer checks). The routing decisions live in `routing-core`; the pools' state in the
//! Durable Objects of `durable-objects/`.

mod clients;
mod operator;
mod platform;
mod request;

// Re-exported so the Durable Object classes are part of this Worker's wasm module.
pub use gateway_durable_objects::directory::GatewayDirectory;
pub use gateway_durable_objects::pool_coordinator::PoolCoordinator;
pub use gateway_durable_objects::rate_limiter::ClientRateLimiter;

use clients::keys;
use coordinator_protocol::call::EnsureProbeAlarm;
use coordinator_protocol::ApiError;
use operator::{admin, dashboard, metrics, models};
use platform::do_client::{self, To};
use platform::{auth, http};
use request::completion;
use routing_core::request::endpoint::Endpoint;
use serde_json::json;
use worker::*;

#[event(fetch)]
async fn fetch(req: Request, env: Env, ctx: Context) -> Result<Response> {
    let request_id = http::request_id(&req);
    let path = req.path();
    let result = route(req, &env, &ctx, &request_id).await;
    let resp = match result {
        Ok(resp) => resp,
        Err(e) => {
            // Proxied requests log when their stream ends; refusals log here, one line each.
            let line = json!({ "event": "request", "request_id": request_id, "path": path, "status": e.status, "error": e.code });
            console_log!("{line}");
            // Anthropic's SDKs read errors in Anthropic's shape.
            if request::api_errors::anthropic_path(&path) {
                request::api_errors::anthropic_response(&e)?
            } else {
                e.to_response()?
            }
        }
    };
    // The proxy sets the id on its responses itself.
    if resp.headers().get("x-request-id").ok().flatten().as_deref() == Some(&request_id) {
        return Ok(resp);
    }
    // Responses relayed from a Durable Object have immutable headers: copy them.
    let headers = Headers::new();
    for (k, v) in resp.headers().entries() {
        headers.append(&k, &v)?;
    }
    headers.set("x-request-id", &request_id)?;
    Ok(resp.with_headers(headers))
}

#[event(scheduled)]
async fn scheduled(_event: ScheduledEvent, env: Env, _ctx: ScheduleContext) {
    match do_client::list_pools(&env).await {
        Ok(list) => {
            for pool in list {
                if let Err(e) =
                    do_client::call(&env, To::Pool(&pool.name, 0), &EnsureProbeAlarm).await
                {
                    console_error!("cron: pool {}: {e}", pool.name);
                }
            }
        }
        Err(e) => console_error!("cron: cannot list pools: {e}"),
    }
}

async fn route(
    req: Request,
    env: &Env,
    ctx: &Context,
    request_id: &str,
) -> std::result::Result<Response, ApiError> {
    let path = req.path();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let method = req.method();
    match segments.as_slice() {
        ["healthz"] => match method {
            Method::Get | Method::Head => Ok(Response::from_json(
                &json!({ "status": "ok", "version": env!("CARGO_PKG_VERSION") }),
            )?),
            m => Err(ApiError::method_not_allowed(m.as_ref(), &path)),
        },
        ["metrics"] => {
            if method != Method::Get {
                return Err(ApiError::method_not_allowed(method.as_ref(), &path));
            }
            auth::require_metrics(&req, env)?;
            metrics::handle(env).await
        }
        ["dashboard", rest @ ..] => dashboard::serve(&method, &path, rest),
        ["admin", rest @ ..] => {
            auth::require_admin(&req, env)?;
            admin::handle(req, env, rest).await
        }
        ["v1", "models"] => {
            if method != Method::Get {
                return Err(ApiError::method_not_allowed(method.as_ref(), &path));
            }
            keys::require_client(&req, env, ctx).await?;
            models::list_models(env).await
        }
        ["v1", "chat", "completions"] => {
            completion::handle(req, env, ctx, Endpoint::Chat, request_id).await
        }
        ["v1", "completions"] => {
            completion::handle(req, env, ctx, Endpoint::Completions, request_id).await
        }
        ["v1", "embeddings"] => {
            completion::handle(req, env, ctx, Endpoint::Embeddings, request_id).await
        }
        // Pass-through routes by model (issue 43): vLLM's own routes, each sent to a backend
        // serving the model and its task (`request/passthrough.rs`).
        ["tokenize" | "detokenize" | "rerank" | "score" | "pooling" | "classify"]
        | ["v1", "rerank" | "score"]
        | ["v2", "rerank"]
        | ["v1", "audio", "transcriptions" | "translations"] => {
            match Endpoint::passthrough_for_path(&path) {
                Some(endpoint) => completion::handle(req, env, ctx, endpoint, request_id).await,
                None => Err(ApiError::not_found(format!("Unknown route {path}."))),
            }
        }
        // The Responses API and Anthropic Messages: routed as chat is.
        ["v1", "responses"] => {
            completion::handle(req, env, ctx, Endpoint::Responses, request_id).await
        }
        // A stored response: to the backend holding it (`request/stored_responses.rs`).
        ["v1", "responses", id] => {
            use request::stored_responses::{handle, Action};
            handle(req, env, ctx, id, Action::Response, request_id).await
        }
        ["v1", "responses", id, "cancel"] => {
            use request::stored_responses::{handle, Action};
            handle(req, env, ctx, id, Action::Cancel, request_id).await
        }
        ["v1", "messages"] => {
            completion::handle(req, env, ctx, Endpoint::Messages, request_id).await
        }
        ["v1", "messages", "count_tokens"] => {
            completion::handle(req, env, ctx, Endpoint::MessagesCountTokens, request_id).await
        }
        _ => Err(ApiError::not_found(format!("Unknown route {path}."))),
    }
}
