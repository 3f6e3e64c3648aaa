//! Stage 1 of a completion request, its intake: who asks ([`Caller`]: a hop from the edge Worker,
//! else the client's key and its admission identity), then what it asks ([`Intake`]: the body
//! read once, its routing features, the client headers sent upstream, the charge to the client's
//! rate limits and whether the stream's usage event is asked for on the client's behalf).

use crate::clients::keys::{self, ClientKey};
use crate::platform::http;
use crate::platform::settings::Settings;
use crate::request::hop::{self, HopContext};
use crate::request::{admission, context, passthrough};
use coordinator_protocol::ApiError;
use routing_core::admission::AdmissionRequest;
use routing_core::request::endpoint::Endpoint;
use routing_core::request::prompt::{endpoint_features, RequestFeatures};
use routing_core::stream::resume::{check_request, NotResumable};
use serde_json::Value;
use worker::{Context, Env, Request};

/// Who asks: what the edge decided (a hop), else the client's key, and the tenant, priority and
/// wait limit the pools' queues see.
pub(super) struct Caller {
    /// A request the edge Worker handed over (regional role only): keys, limits and the pool
    /// order were decided there.
    pub(super) hop_in: Option<HopContext>,
    /// The client's key (none through a hop, or without keys).
    pub(super) key: Option<ClientKey>,
    /// The admission identity sent with each lease call.
    pub(super) who: AdmissionRequest,
}

impl Caller {
    /// The hop's context, else the client key checked and the admission identity read.
    pub(super) async fn identify(
        req: &Request,
        env: &Env,
        ctx: &Context,
    ) -> Result<Caller, ApiError> {
        let hop_in = hop::incoming(req, env)?;
        let key = match hop_in {
            Some(_) => None,
            None => keys::identify(req, env, ctx).await?,
        };
        let who = match &hop_in {
            Some(h) => h.who.clone(),
            None => admission::admission_request(req, key.as_ref(), &admission::tenant_salt(env))?,
        };
        Ok(Caller { hop_in, key, who })
    }
}

/// What the request asks, read once: every later stage reads it, none reads the body again.
pub(super) struct Intake {
    /// The body to send upstream (the client's, or rewritten once: transfer params dropped,
    /// usage asked for).
    pub(super) body: Vec<u8>,
    /// The request's routing features.
    pub(super) features: RequestFeatures,
    /// Whether a broken stream may be resumed (decided from the parsed body).
    pub(super) resumable: Result<(), NotResumable>,
    /// The client headers the backend gets.
    pub(super) forwarded_headers: Vec<(String, String)>,
    /// What the client's rate limits are charged: an estimate, settled with the real usage.
    pub(super) charge: Option<hop::Charge>,
    /// Whether the gateway asked for the stream's usage event and the client did not.
    pub(super) strip_usage_event: bool,
}

/// Reads the body (at most `MAX_BODY_BYTES`) and everything decided from it.
pub(super) async fn read(
    req: &mut Request,
    env: &Env,
    endpoint: Endpoint,
    request_id: &str,
    settings: &Settings,
    caller: &Caller,
) -> Result<Intake, ApiError> {
    let body = http::read_body_limited(req, settings.max_body_bytes).await?;
    let (parsed, body, mut features) = parse(req, endpoint, body, settings)?;
    features.request_id = request_id.to_string();
    // Decided from the body read once here: whether a broken stream may be resumed, and the
    // client headers the backend gets.
    let resumable = check_request(&parsed, endpoint);
    let mut forwarded_headers =
        context::forwarded_headers(req, settings.features.routing_header.as_deref())?;
    passthrough::forward_content_type(endpoint, req, &mut forwarded_headers);
    let charge = charge_for(env, caller, &features);
    // A stored response is followed up and retrieved only with the key that made it (a hop
    // carries the edge's key hash in its charge).
    if features.is_stateful() {
        features.owner = charge.as_ref().map(|c| c.client.clone());
    }
    // Streams report usage only when asked: ask, and take the event out again if the client didn't.
    // The Responses and Messages streams always report usage: nothing to ask for.
    let generating_stream = features.stream && endpoint.is_generation();
    let (body, strip_usage_event) = match (&caller.hop_in, generating_stream) {
        (Some(h), _) => (body, h.strip_usage_event),
        (None, true) => context::ask_for_usage(parsed, body)?,
        (None, false) => (body, false),
    };
    Ok(Intake {
        body,
        features,
        resumable,
        forwarded_headers,
        charge,
        strip_usage_event,
    })
}

/// The body parsed (JSON, or the audio routes' multipart form) and its routing features: the
/// parsed body (`Null` for a form), the body to send (a client's `kv_transfer_params` dropped)
/// and the features.
fn parse(
    req: &Request,
    endpoint: Endpoint,
    mut body: Vec<u8>,
    settings: &Settings,
) -> Result<(Value, Vec<u8>, RequestFeatures), ApiError> {
    // Read in place: `Headers::clone` would copy them into a new platform object.
    let headers = req.headers();
    let header = |name: &str| headers.get(name).ok().flatten();
    let (parsed, features) = match endpoint.is_multipart() {
        // The audio routes' forms: `model` and `stream` read from the buffered body (passthrough.rs).
        true => (
            Value::Null,
            passthrough::multipart_features(endpoint, &body, &header),
        ),
        false => {
            let mut parsed: Value = serde_json::from_slice(&body).map_err(|e| {
                ApiError::bad_request(format!("request body is not valid JSON: {e}"))
            })?;
            if !parsed.is_object() {
                return Err(ApiError::bad_request("request body must be a JSON object"));
            }
            // vLLM does not authenticate `kv_transfer_params`: only the gateway's own
            // disaggregated prefill/decode sets them, never a client.
            if context::drop_transfer_params(&mut parsed) {
                body =
                    serde_json::to_vec(&parsed).map_err(|e| ApiError::internal(e.to_string()))?;
            }
            let features = endpoint_features(endpoint, &parsed, &header, &settings.features);
            (parsed, features)
        }
    };
    let features = features.map_err(|e| {
        let err = ApiError::bad_request(e.to_string()).with_code(e.code());
        match e.param() {
            Some(p) => err.with_param(p),
            None => err,
        }
    })?;
    Ok((parsed, body, features))
}

/// What the client's rate limits are charged: the edge's charge through a hop, else an estimate
/// (prompt plus `max_tokens`) for a keyed client.
fn charge_for(env: &Env, caller: &Caller, features: &RequestFeatures) -> Option<hop::Charge> {
    match (&caller.hop_in, &caller.key) {
        (Some(h), _) => h.charge.clone(),
        (None, Some(key)) => Some(hop::Charge::at_edge(
            env,
            &key.hash,
            u64::from(features.prompt_tokens) + u64::from(features.max_tokens),
        )),
        (None, None) => None,
    }
}
