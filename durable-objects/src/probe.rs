//! Active health probes of one backend: liveness, loaded models, and load gauges.
//!
//! `GET /health` says whether the server is up (200), loading its model (503) or broken;
//! `GET /v1/models` which models it serves now; `GET /metrics` its queue, running batch, KV-cache
//! usage and KV capacity. Each request has its own timeout; the three run one after another on one
//! backend (the caller probes several backends at once, within the six-connection limit).
//!
//! This file does the fetching: redirects are not followed, and every body is read with a bound
//! (1 MiB for `/metrics`, 64 KiB for the others), so a backend cannot make the pool read without
//! end. What the answers mean (a 3xx or a login page makes a backend unhealthy, ...) is
//! `routing_core::coordinator::probe_answers`'.

use coordinator_protocol::timed_fetch::{fetch_with_timeout, with_timeout};
use futures_util::StreamExt;
use routing_core::coordinator::probe_answers::ProbeAnswer;
use routing_core::coordinator::ProbeReport;
use std::time::Duration;
use worker::{Date, Headers, Method, Request, RequestInit, RequestRedirect};

/// Most of a `/metrics` page read.
const MAX_METRICS_BYTES: usize = 1024 * 1024;

/// Most of a `/health` or `/v1/models` answer read.
const MAX_PROBE_BYTES: usize = 64 * 1024;

fn get(url: &str, api_key: Option<&str>) -> Option<Request> {
    let headers = Headers::new();
    if let Some(key) = api_key {
        headers
            .set("authorization", &format!("Bearer {key}"))
            .ok()?;
    }
    let mut init = RequestInit::new();
    init.with_method(Method::Get)
        .with_headers(headers)
        .with_redirect(RequestRedirect::Manual);
    Request::new_with_init(url, &init).ok()
}

async fn get_text(
    url: &str,
    api_key: Option<&str>,
    timeout: Duration,
    limit: usize,
) -> Result<ProbeAnswer, String> {
    let req = get(url, api_key).ok_or_else(|| format!("bad probe URL {url}"))?;
    let (mut resp, abort) = fetch_with_timeout(req, timeout, None)
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status_code();
    let content_type = resp
        .headers()
        .get("content-type")
        .ok()
        .flatten()
        .unwrap_or_default()
        .to_ascii_lowercase();
    let body = match with_timeout(read_bounded(&mut resp, limit), timeout).await {
        Some(body) => body,
        None => Err("body timed out".to_string()),
    };
    // Whatever was not read is not wanted: close the request.
    abort.abort();
    Ok(ProbeAnswer {
        status,
        content_type,
        body: body?,
    })
}

/// Reads a body up to `limit` bytes; a longer one is refused.
async fn read_bounded(resp: &mut worker::Response, limit: usize) -> Result<String, String> {
    let mut out = Vec::new();
    let Ok(mut stream) = resp.stream() else {
        return Ok(String::new());
    };
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        if out.len() + chunk.len() > limit {
            return Err(format!("body over {limit} bytes"));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Probes one backend.
pub async fn probe_backend(
    base_url: &str,
    api_key: Option<&str>,
    timeout: Duration,
) -> ProbeReport {
    let started = Date::now().as_millis();
    let mut report = ProbeReport {
        at_ms: started,
        ..ProbeReport::default()
    };
    let get_path = |path: &str, limit: usize| {
        let url = format!("{base_url}{path}");
        async move { get_text(&url, api_key, timeout, limit).await }
    };
    if report.read_health(get_path("/health", MAX_PROBE_BYTES).await.map(|a| a.status)) {
        report.read_models(get_path("/v1/models", MAX_PROBE_BYTES).await);
        report.read_metrics(get_path("/metrics", MAX_METRICS_BYTES).await);
    }
    report.duration_ms = Date::now().as_millis().saturating_sub(started);
    report
}
