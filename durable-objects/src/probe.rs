//! Active health probes of one backend: liveness, loaded models, and load gauges.
//!
//! `GET /health` says whether the server is up (200), loading its model (503) or broken;
//! `GET /v1/models` which models it serves now; `GET /metrics` its queue, running batch, KV-cache
//! usage and KV capacity. Each request has its own timeout; the three run one after another on one
//! backend (the caller probes several backends at once, within the six-connection limit).
//!
//! Only real answers count: redirects are not followed (a backend that answers 3xx is unhealthy,
//! with the reason in its probe report), a 200 `/v1/models` that is not a model list (a login
//! page) makes the backend unhealthy too, and every body is read with a bound (1 MiB for
//! `/metrics`, 64 KiB for the others), so a backend cannot make the pool read without end.

use coordinator_protocol::timed_fetch::{fetch_with_timeout, with_timeout};
use routing_core::coordinator::ProbeReport;

use futures_util::StreamExt;
use routing_core::backend::scrape::parse_vllm_metrics;
use serde::Deserialize;
use std::time::Duration;
use worker::{Date, Headers, Method, Request, RequestInit, RequestRedirect};

/// Most of a `/metrics` page read.
const MAX_METRICS_BYTES: usize = 1024 * 1024;

/// Most of a `/health` or `/v1/models` answer read.
const MAX_PROBE_BYTES: usize = 64 * 1024;

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

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

/// What one probe request got: its status, its content type and its body (read up to `limit`).
struct Answer {
    status: u16,
    content_type: String,
    body: String,
}

async fn get_text(
    url: &str,
    api_key: Option<&str>,
    timeout: Duration,
    limit: usize,
) -> Result<Answer, String> {
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
    Ok(Answer {
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

/// Why a 3xx answer makes the backend unusable, for its probe report.
fn redirected(path: &str, status: u16) -> String {
    format!("{path} answered a {status} redirect; the gateway follows no redirects, so register the URL the backend really serves on")
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
    let health_url = format!("{base_url}/health");
    let health = get_text(&health_url, api_key, timeout, MAX_PROBE_BYTES);
    match health.await.map(|a| a.status) {
        Ok(200) => report.result.ok = true,
        Ok(503) => {
            report.health_status = Some(503);
            report.result.loading = true;
        }
        Ok(status @ 300..=399) => {
            report.health_status = Some(status);
            report.error = Some(redirected("/health", status));
        }
        Ok(status) => {
            report.health_status = Some(status);
            report.error = Some(format!("/health answered {status}"));
        }
        Err(e) => report.error = Some(format!("/health: {e}")),
    }
    if report.result.ok {
        report.health_status = Some(200);
        let models_url = format!("{base_url}/v1/models");
        let models = get_text(&models_url, api_key, timeout, MAX_PROBE_BYTES);
        match models.await {
            Ok(Answer {
                status: 200,
                body,
                content_type,
            }) => match serde_json::from_str::<ModelList>(&body) {
                Ok(list) => {
                    let models: Vec<String> = list.data.into_iter().map(|m| m.id).collect();
                    report.result.models = Some(models.clone());
                    report.models = Some(models);
                }
                // A login page or anything else that is not vLLM: not a backend to route to.
                Err(_) => {
                    report.result.ok = false;
                    let shown: String = content_type.chars().take(64).collect();
                    report.error = Some(format!(
                        "/v1/models answered 200 with something that is not a model list (content type {})",
                        if shown.is_empty() { "none" } else { &shown }
                    ));
                }
            },
            Ok(Answer {
                status: status @ 300..=399,
                ..
            }) => {
                report.result.ok = false;
                report.error = Some(redirected("/v1/models", status));
            }
            // The server is up but refuses the gateway's key: it cannot serve our traffic.
            Ok(Answer {
                status: status @ (401 | 403),
                ..
            }) => {
                report.result.ok = false;
                report.error = Some(format!(
                    "/v1/models answered {status}: the backend rejects the configured api_key"
                ));
            }
            _ => {}
        }
        let metrics_url = format!("{base_url}/metrics");
        let metrics = get_text(&metrics_url, api_key, timeout, MAX_METRICS_BYTES);
        if let Ok(Answer {
            status: 200, body, ..
        }) = metrics.await
        {
            report.metrics = parse_vllm_metrics(&body);
            report.metrics.apply_to(&mut report.result);
        }
    }
    report.duration_ms = Date::now().as_millis().saturating_sub(started);
    report
}
