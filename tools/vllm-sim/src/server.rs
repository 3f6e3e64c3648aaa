//! The HTTP server: accepts connections, routes requests, and applies what sits in front of the
//! OpenAI handlers — the loading phase, the API key, injected faults — plus the endpoints that are not
//! OpenAI's: `/health`, `/metrics`, `/version` and the sim's own `/sim/faults` and `/sim/info`.
//!
//! Which OpenAI routes exist depends on the model's task, as vLLM 0.34 registers routers by
//! supported task (`vllm/entrypoints/launchers/api_server/routers.py`): a generate model has
//! `/v1/chat/completions` and `/v1/completions`, an embedding model `/v1/embeddings`; any other
//! path is FastAPI's `404 {"detail":"Not Found"}`. While loading, vLLM 0.34's socket is bound but
//! not listening, so connections are refused: the sim closes its listener for a loading phase
//! started at run time (`loading_s`) and drops requests on connections opened before, unless the
//! `loading_answers_503` fault asks for the older 503 answers.
//!
//! As in vLLM, only `/v1/*` paths require the API key. Generation requests read their body, then wait
//! out `first_byte_delay_ms`, then hang, get 429 or an injected error, or are served; a served
//! non-streamed answer may then be cut in half (`truncate_body`). A request whose body holds the
//! `poison_marker` gets vLLM's 500 after those. A `login_page` or `redirect_to` fault answers
//! every request but `/sim/*` before anything else.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;

use crate::api;
use crate::body::{self, SimBody};
use crate::config::{Task, VLLM_VERSION};
use crate::error::ApiError;
use crate::faults::{FaultUpdate, FrontDoor, LOGIN_PAGE_HTML};
use crate::metrics::render;
use crate::state::AppState;

/// Largest request body accepted.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// How long a hanging request waits before its connection is dropped.
const HANG_FOR: Duration = Duration::from_secs(3600);

/// Hyper's error type for a connection we drop on purpose.
#[derive(Debug)]
pub struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped (simulated)")
    }
}

impl std::error::Error for Dropped {}

/// Accepts connections forever, one task per connection (HTTP/1.1 with keep-alive). A loading
/// phase started at run time closes the listener (connections are refused) until it ends, unless
/// the `loading_answers_503` fault is set.
pub async fn serve(listener: TcpListener, state: Arc<AppState>) {
    let mut listener = Some(listener);
    loop {
        if let Some(until) = state
            .loading_until()
            .filter(|_| !state.loading_answers_503())
        {
            listener = None;
            tokio::time::sleep_until(until.into()).await;
            continue;
        }
        let Some(open) = listener.as_ref() else {
            match crate::launch::bind(&state.config.host, state.config.port).await {
                Ok(l) => listener = Some(l),
                Err(e) => {
                    eprintln!("vllm-sim: cannot listen again after loading: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            continue;
        };
        let accepted = tokio::select! {
            accepted = open.accept() => accepted,
            () = state.loading_started.notified() => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Usually EMFILE under extreme load: back off instead of spinning.
                eprintln!("vllm-sim: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let state = state.clone();
                async move { handle(state, request).await }
            });
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Answers one request; `Err` drops the connection.
pub async fn handle(
    state: Arc<AppState>,
    request: Request<Incoming>,
) -> Result<Response<SimBody>, Dropped> {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    if !path.starts_with("/sim/") && state.is_loading() && !state.loading_answers_503() {
        // A connection opened before the loading phase: the server it reached is gone.
        return Err(Dropped);
    }
    if !path.starts_with("/sim/") {
        if let Some(door) = front_door(&state) {
            return Ok(door);
        }
    }
    let response = match (path.as_str(), &method) {
        ("/health", &Method::GET) => health(&state),
        ("/metrics", &Method::GET) => metrics(&state),
        // vllm/entrypoints/serve/instrumentator/basic.py: the vLLM version the sim behaves as.
        ("/version", &Method::GET) => body::json(StatusCode::OK, &json!({"version": VLLM_VERSION})),
        ("/sim/faults", &Method::GET) => faults(&state),
        ("/sim/faults", &Method::POST) => match read_body(request).await {
            Ok(bytes) => update_faults(&state, &bytes),
            Err(e) => e.into_response(),
        },
        ("/sim/info", &Method::GET) => info(&state),
        ("/health" | "/metrics" | "/version" | "/sim/faults" | "/sim/info", _) => {
            ApiError::MethodNotAllowed.into_response()
        }
        // vLLM's own routes by task: tokenize, pooling, scoring, audio (`passthrough.rs`).
        (p, _) if crate::passthrough::is_route(p) => {
            match crate::passthrough::serve(&state, request, &path, &method).await {
                Ok(response) => response,
                Err(ApiError::Disconnect) => return Err(Dropped),
                Err(e) => e.into_response(),
            }
        }
        (p, _) if p.starts_with("/v1/") => match v1(&state, request, &path, &method).await {
            Ok(response) => response,
            Err(ApiError::Disconnect) => return Err(Dropped),
            // vLLM's Anthropic router answers its errors in Anthropic's shape.
            Err(e) if crate::messages::is_messages_path(&path) => {
                crate::messages::error_response(e)
            }
            Err(e) => e.into_response(),
        },
        _ => ApiError::RouteNotFound.into_response(),
    };
    Ok(response)
}

/// What every API route checks first, as vLLM does: a loading server answers nothing, and with
/// `--api-key` the `/v1` and `/v2` routes need the bearer key (the root routes, `/tokenize` and
/// the like, do not).
pub(crate) fn guard<B>(state: &AppState, request: &Request<B>, path: &str) -> Result<(), ApiError> {
    if state.is_loading() {
        return Err(ApiError::Loading);
    }
    if let Some(key) = &state.config.api_key {
        let guarded = path.starts_with("/v1") || path.starts_with("/v2");
        let authorized = request
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.strip_prefix("Bearer ") == Some(key.as_str()));
        if guarded && !authorized {
            return Err(ApiError::Unauthorized);
        }
    }
    Ok(())
}

/// The OpenAI routes, behind loading, the API key and faults.
async fn v1(
    state: &AppState,
    request: Request<Incoming>,
    path: &str,
    method: &Method,
) -> Result<Response<SimBody>, ApiError> {
    guard(state, &request, path)?;
    // Routes registered for the model's task; the others are not found, whatever the method.
    let generation = match state.config.task() {
        Task::Generate => {
            matches!(path, "/v1/chat/completions" | "/v1/completions")
                || crate::responses::is_generation_path(path)
                || crate::messages::is_messages_path(path)
        }
        Task::Embed => path == "/v1/embeddings",
        Task::Classify | Task::Transcription => false,
    };
    // `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: the stored responses.
    if let Some(answer) = crate::responses::stored_route(state, path, method) {
        return answer;
    }
    match (path, method) {
        ("/v1/models", &Method::GET) => return Ok(api::models(state)),
        ("/v1/models", _) => return Err(ApiError::MethodNotAllowed),
        (_, &Method::POST) if generation => {}
        _ if generation => return Err(ApiError::MethodNotAllowed),
        _ => return Err(ApiError::RouteNotFound),
    }
    let unrouted = state
        .faults
        .lock()
        .map(|f| f.settings.route_not_found)
        .unwrap_or(false);
    if unrouted {
        return Err(ApiError::RouteNotFound);
    }
    let request_id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let bytes = read_body(request).await?;
    if let Some(id) = &request_id {
        if generation && !state.take_request_id(id) {
            return Err(ApiError::BadRequest(format!(
                "Request id {id} already running."
            )));
        }
    }

    let decision = state.fault_decision();
    if !decision.first_byte_delay.is_zero() {
        tokio::time::sleep(decision.first_byte_delay).await;
    }
    if decision.hang {
        tokio::time::sleep(HANG_FOR).await;
        return Err(ApiError::Disconnect);
    }
    match decision.reject {
        Some(429) => return Err(ApiError::RateLimited),
        Some(status) => return Err(ApiError::Injected(status)),
        None => {}
    }
    let poisoned = state
        .faults
        .lock()
        .map(|f| f.settings.poisons(&bytes))
        .unwrap_or(false);
    if poisoned {
        return Err(ApiError::Injected(500));
    }
    let response = match path {
        "/v1/chat/completions" => {
            api::chat_completions(state, &bytes, request_id.as_deref(), &decision).await
        }
        "/v1/completions" => {
            api::completions(state, &bytes, request_id.as_deref(), &decision).await
        }
        "/v1/responses" => crate::responses::create(state, &bytes, &decision).await,
        "/v1/messages" => crate::messages::create(state, &bytes, &decision).await,
        "/v1/messages/count_tokens" => crate::messages::count_tokens(state, &bytes),
        _ => api::embeddings(state, &bytes).await,
    }?;
    if decision.truncate_body && response.status() == StatusCode::OK {
        return Ok(body::truncate(response));
    }
    Ok(response)
}

pub(crate) async fn read_body(request: Request<Incoming>) -> Result<Bytes, ApiError> {
    match Limited::new(request.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) => Err(ApiError::BadRequest(format!(
            "could not read the request body: {e}"
        ))),
    }
}

/// The answer of a `login_page` or `redirect_to` fault, if one is set.
fn front_door(state: &AppState) -> Option<Response<SimBody>> {
    let door = state.faults.lock().ok()?.settings.front_door()?;
    Some(match door {
        FrontDoor::LoginPage => body::full(
            StatusCode::OK,
            "text/html; charset=utf-8",
            LOGIN_PAGE_HTML.to_string(),
        ),
        FrontDoor::Redirect(url) => {
            let mut response = body::empty(StatusCode::TEMPORARY_REDIRECT);
            if let Ok(location) = hyper::header::HeaderValue::from_str(&url) {
                response
                    .headers_mut()
                    .insert(hyper::header::LOCATION, location);
            }
            response
        }
    })
}

/// `GET /health`: 200 with an empty body, 503 while loading or when failing on purpose.
fn health(state: &AppState) -> Response<SimBody> {
    let failing = state
        .faults
        .lock()
        .map(|f| f.settings.health_fail)
        .unwrap_or(false);
    if state.is_loading() || failing {
        body::empty(StatusCode::SERVICE_UNAVAILABLE)
    } else {
        body::empty(StatusCode::OK)
    }
}

fn metrics(state: &AppState) -> Response<SimBody> {
    let text = match state.metrics.lock() {
        Ok(m) => render(&state.metrics_info, &m),
        Err(_) => String::new(),
    };
    body::full(
        StatusCode::OK,
        "text/plain; version=0.0.4; charset=utf-8",
        text,
    )
}

fn faults(state: &AppState) -> Response<SimBody> {
    let Ok(f) = state.faults.lock() else {
        return ApiError::EngineGone.into_response();
    };
    let loading_remaining_s = f
        .loading_until
        .map(|until| {
            until
                .saturating_duration_since(Instant::now())
                .as_secs_f64()
        })
        .unwrap_or(0.0);
    body::json(
        StatusCode::OK,
        &json!({"settings": f.settings, "loading_remaining_s": loading_remaining_s}),
    )
}

fn update_faults(state: &AppState, bytes: &[u8]) -> Response<SimBody> {
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        bytes
    };
    let update: FaultUpdate = match serde_json::from_slice(bytes) {
        Ok(u) => u,
        Err(e) => {
            return ApiError::BadRequest(format!("invalid fault settings: {e}")).into_response()
        }
    };
    let settings = match update.settings() {
        Ok(s) => s,
        Err(e) => return ApiError::BadRequest(e.to_string()).into_response(),
    };
    let mut loading = false;
    if let Ok(mut f) = state.faults.lock() {
        f.settings = settings;
        if let Some(s) = update.loading_s {
            f.loading_until = Some(Instant::now() + Duration::from_secs_f64(s));
            loading = s > 0.0 && !f.settings.loading_answers_503;
        }
    }
    if loading {
        // The accept loop closes the listener; this answer still goes out on its connection.
        state.loading_started.notify_one();
    }
    if update.crash {
        eprintln!("vllm-sim: crashing on request (POST /sim/faults {{\"crash\": true}})");
        tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            std::process::exit(1);
        });
        return body::json(StatusCode::OK, &json!({"crashing": true}));
    }
    faults(state)
}

fn info(state: &AppState) -> Response<SimBody> {
    let c = &state.config;
    body::json(
        StatusCode::OK,
        &json!({
            "models": c.models,
            "role": c.role.as_str(),
            "engine_id": state.transfer.engine_id,
            "max_num_seqs": c.max_num_seqs(),
            "max_num_batched_tokens": c.max_num_batched_tokens(),
            "kv_blocks": c.kv_blocks,
            "block_size": c.block_size,
            "max_model_len": c.max_model_len,
            "spec_tokens": c.spec_tokens,
            "prefill_us_per_token": c.prefill_us_per_token,
            "decode_ms_per_step": c.decode_ms_per_step,
            "decode_ms_per_seq": c.decode_ms_per_seq,
            "time_scale": c.time_scale,
            "seed": c.seed,
            "version": env!("CARGO_PKG_VERSION"),
            "vllm_version": VLLM_VERSION,
            "task": format!("{:?}", c.task()).to_lowercase(),
            "gpu_profile": format!("{:?}", c.gpu_profile).to_lowercase(),
        }),
    )
}
