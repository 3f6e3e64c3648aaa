//! One proxied request as every stage sees it: [`RequestContext`], built once when a pool grants
//! the request its lease and shared (`Rc`) by the proxy (`forward/proxy.rs`), the attempts
//! (`forward/attempts.rs`), the lease guard (`lease/lease_guard.rs`) and a stream's resumption
//! (`forward/resume.rs`), which outlive the handler in `wait_until`. What each of them changes
//! stays its own: the grant and its candidates, the guard's record, the body sent upstream.
//!
//! Also what the Worker does to a client's request on its way upstream: the client headers it
//! forwards, and asking a stream for its usage event ([`ask_for_usage`]).

use crate::platform::settings::Settings;
use coordinator_protocol::ApiError;
use routing_core::request::endpoint::Endpoint;
use routing_core::request::prompt::RequestFeatures;
use routing_core::stream::resume::NotResumable;
use serde_json::{json, Value};
use std::rc::Rc;
use worker::{AbortSignal, Env, Request};

/// Client request headers forwarded upstream (an allow-list: hop-by-hop headers, credentials,
/// cookies and platform headers never pass, and neither does an unbounded header set). The
/// gateway sets `content-type`, `x-request-id` and the backend's own `authorization` itself; the
/// configured routing-key header is forwarded too.
pub(crate) const FORWARDED_REQUEST_HEADERS: [&str; 10] = [
    "accept",
    // Anthropic's Messages API: the version and beta features the client speaks.
    "anthropic-version",
    "anthropic-beta",
    "user-agent",
    "traceparent",
    "tracestate",
    "baggage",
    "x-session-id",
    "x-user-id",
    "x-tenant-id",
];

/// Longest client header value forwarded.
pub(crate) const MAX_FORWARDED_HEADER_BYTES: usize = 1024;

/// What every stage of one proxied request reads and none changes.
pub(crate) struct RequestContext {
    /// Worker environment (pool, rate-limiter and backend calls).
    pub(crate) env: Env,
    /// The endpoint the client called (the upstream path, what a resumption continues).
    pub(crate) endpoint: Endpoint,
    /// The request id, forwarded and echoed.
    pub(crate) request_id: String,
    /// This isolate's request-path settings (timeouts, retries, resumptions).
    pub(crate) settings: Rc<Settings>,
    /// The request's routing features: model, stream flag, token estimates, prefix-block hashes.
    pub(crate) features: RequestFeatures,
    /// Whether the gateway asked for the stream's usage event and the client did not.
    pub(crate) strip_usage_event: bool,
    /// Whether the request's body allows a broken stream to be resumed (decided from the body the
    /// features were read from: it is not parsed again).
    pub(crate) resumable: Result<(), NotResumable>,
    /// The pool that granted the lease.
    pub(crate) pool: String,
    /// The pool's coordinator shard that granted it (every later call of the lease goes there).
    pub(crate) shard: u32,
    /// Why the Worker asked this pool (`nearest`, `home`, `faster`, `anchor_full`, `spill`).
    pub(crate) pool_choice: &'static str,
    /// The request's deadlines, on one timer (its lease calls, renewals, attempts, watchdog).
    pub(crate) deadlines: crate::platform::http::Deadlines,
    /// The client headers forwarded upstream ([`forwarded_headers`]).
    pub(crate) forwarded_headers: Vec<(String, String)>,
    /// The client's abort signal: a hang-up aborts the upstream fetches.
    pub(crate) client_signal: AbortSignal,
    /// Resolves when the client hangs up (`lease_guard::hang_up`).
    pub(crate) hung_up: js_sys::Promise,
}

impl RequestContext {
    /// The model asked for.
    pub(crate) fn model(&self) -> &str {
        &self.features.model
    }

    /// Whether the client asked for a stream.
    pub(crate) fn stream(&self) -> bool {
        self.features.stream
    }
}

/// The allow-listed client headers (and the configured routing-key header) sent upstream, each
/// at most [`MAX_FORWARDED_HEADER_BYTES`] long. Read before the pool is asked: a routing-key
/// header name the platform refuses fails the request before it holds a lease.
pub(crate) fn forwarded_headers(
    client: &Request,
    routing_header: Option<&str>,
) -> Result<Vec<(String, String)>, ApiError> {
    let mut out = Vec::new();
    for name in FORWARDED_REQUEST_HEADERS
        .iter()
        .copied()
        .chain(routing_header)
    {
        if let Some(value) = client
            .headers()
            .get(name)
            .map_err(ApiError::from)?
            .filter(|v| v.len() <= MAX_FORWARDED_HEADER_BYTES)
        {
            out.push((name.to_string(), value));
        }
    }
    Ok(out)
}

/// Takes a client's `kv_transfer_params` out of its body (vLLM trusts them: they name remote
/// blocks and engines to pull from); says whether there were any. Only the gateway's own
/// prefill/decode requests carry them (`proxy.rs`).
pub(crate) fn drop_transfer_params(parsed: &mut Value) -> bool {
    parsed
        .as_object_mut()
        .is_some_and(|obj| obj.remove("kv_transfer_params").is_some())
}

/// Makes a streamed request ask for the usage event (`stream_options.include_usage`). Returns the
/// body to send upstream and whether the event must be taken out again (the client did not ask).
/// vLLM's `continuous_usage_stats` only applies with `include_usage`, so a client that set it
/// without asking for usage gets neither, as before.
pub(crate) fn ask_for_usage(mut parsed: Value, body: Vec<u8>) -> Result<(Vec<u8>, bool), ApiError> {
    let asked = parsed
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true);
    if asked {
        return Ok((body, false));
    }
    let Some(obj) = parsed.as_object_mut() else {
        return Ok((body, false));
    };
    let options = obj.entry("stream_options").or_insert_with(|| json!({}));
    if !options.is_object() {
        *options = json!({});
    }
    if let Some(o) = options.as_object_mut() {
        o.insert("include_usage".into(), Value::Bool(true));
        o.remove("continuous_usage_stats");
    }
    let bytes = serde_json::to_vec(&parsed).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((bytes, true))
}
