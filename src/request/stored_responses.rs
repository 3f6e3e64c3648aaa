//! `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and `DELETE /v1/responses/{id}`:
//! calls about a stored Responses API response, which lives in the memory of the one vLLM server
//! that made it. The pool recorded that server when the response was made (its id came back with
//! the lease's release, `routing_core::pool::responses`); every stateful Responses call goes to a
//! pool's shard 0 (`routing_core::pool::shard::shard_of_request`), so this asks each pool's shard 0
//! which backend holds the id and sends the call there, as the client sent it (its query string
//! too: `?stream=true&starting_after=N` replays a background response's events). An id no pool
//! can place is a 404 `response_not_found` naming it; the call never goes to another backend.
//!
//! vLLM 0.34 serves `GET` and `POST .../cancel` but no `DELETE` on a response: its answer to one
//! is FastAPI's 405, and the gateway answers the same 405 itself rather than pretend to delete.
//! No lease is taken: these calls compute nothing on the backend.

use crate::clients::keys;
use crate::platform::do_client::{self, call, To};
use crate::platform::http;
use coordinator_protocol::messages::{ResponseHolder, ResponseHolderAnswer};
use coordinator_protocol::ApiError;
use futures_util::future::{select, Either};
use routing_core::pool::responses::MAX_ID_BYTES;
use std::time::Duration;
use worker::*;

/// How long the backend may take to start answering.
const TIMEOUT: Duration = Duration::from_secs(30);

/// What the client asked of the stored response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `/v1/responses/{id}`, by its method.
    Response,
    /// `/v1/responses/{id}/cancel`.
    Cancel,
}

/// Serves one call about the stored response `id`.
pub async fn handle(
    req: Request,
    env: &Env,
    ctx: &Context,
    id: &str,
    action: Action,
    request_id: &str,
) -> std::result::Result<Response, ApiError> {
    let path = req.path();
    let method = req.method();
    let upstream_method = match (action, &method) {
        (Action::Response, Method::Get) => Method::Get,
        (Action::Cancel, Method::Post) => Method::Post,
        (Action::Response, Method::Delete) => {
            // vLLM 0.34 has no DELETE for a stored response (FastAPI answers 405): neither
            // has the gateway.
            return Err(ApiError::method_not_allowed("DELETE", &path).with_header("allow", "GET"));
        }
        (_, m) => return Err(ApiError::method_not_allowed(m.as_ref(), &path)),
    };
    // Only the key that made a response finds it.
    let owner = keys::require_client(&req, env, ctx).await?;
    if !valid_id(id) {
        return Err(ApiError::bad_request(
            "The response id must be 1 to 256 letters, digits, `_` or `-`.",
        )
        .with_param("response_id"));
    }
    let pools = do_client::list_pools_cached(env, ctx).await?;
    for pool in &pools {
        let asked = ResponseHolder {
            id: id.to_string(),
            owner: owner.clone(),
        };
        let holder = match call(env, To::Pool(&pool.name, 0), &asked).await {
            Ok(ResponseHolderAnswer { holder: Some(h) }) => h,
            Ok(ResponseHolderAnswer { holder: None }) => continue,
            Err(e) => {
                console_error!("pool {} did not say where response {id} is: {e}", pool.name);
                continue;
            }
        };
        let query = req.url().ok().and_then(|u| u.query().map(str::to_string));
        let suffix = match action {
            Action::Response => "",
            Action::Cancel => "/cancel",
        };
        let mut url = format!("{}/v1/responses/{id}{suffix}", holder.url);
        if let Some(q) = query.filter(|q| !q.is_empty()) {
            url.push('?');
            url.push_str(&q);
        }
        let headers = Headers::new();
        headers.set(
            "x-request-id",
            &format!("{request_id}-{}", http::random_hex(4)),
        )?;
        headers.set("accept", "application/json, text/event-stream")?;
        if let Some(key) = &holder.api_key {
            headers.set("authorization", &format!("Bearer {key}"))?;
        }
        let mut init = RequestInit::new();
        init.with_method(upstream_method.clone())
            .with_headers(headers)
            .with_redirect(RequestRedirect::Manual);
        let upstream = Request::new_with_init(&url, &init)?;
        let abort = AbortController::default();
        let signal = abort.signal();
        let sending = Fetch::Request(upstream);
        let fetch = Box::pin(sending.send_with_signal(&signal));
        let timer = Box::pin(Delay::from(TIMEOUT));
        let resp = match select(fetch, timer).await {
            Either::Left((Ok(resp), _)) => resp,
            Either::Left((Err(e), _)) => {
                console_error!("backend {} failed on response {id}: {e}", holder.id.0);
                return Err(ApiError::bad_gateway(format!(
                    "The backend holding response `{id}` could not be reached."
                )));
            }
            Either::Right(_) => {
                abort.abort();
                return Err(ApiError::gateway_timeout(format!(
                    "The backend holding response `{id}` did not answer within {} s.",
                    TIMEOUT.as_secs()
                )));
            }
        };
        let out = Headers::new();
        if let Some(t) = resp.headers().get("content-type")? {
            out.set("content-type", &t)?;
        }
        out.set("x-gateway-pool", &pool.name)?;
        out.set("x-gateway-backend", &holder.id.0)?;
        out.set("x-request-id", request_id)?;
        let status = resp.status_code();
        let line = serde_json::json!({
            "event": "request", "request_id": request_id, "path": path,
            "pool": pool.name, "backend": holder.id.0, "status": status,
        });
        console_log!("{line}");
        return Ok(resp.with_headers(out));
    }
    Err(ApiError::response_not_found(id, "response_id"))
}

/// Whether `id` can be a backend's response id (and is safe in a URL path as it is).
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
