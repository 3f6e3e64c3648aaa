//! Active health probes of one backend: liveness, loaded models, and load gauges.
//!
//! `GET /health` says whether the server is up (200), loading its model (503) or broken;
//! `GET /v1/models` which models it serves now; `GET /metrics` its queue, running batch, KV-cache
//! usage and KV capacity. Each request has its own timeout; the three run one after another on one
//! backend (the caller probes several backends at once, within the six-connection limit).

pub use coordinator_protocol::messages::ProbeReport;
use coordinator_protocol::timed_fetch::{fetch_with_timeout, with_timeout};

use routing_core::scrape::parse_vllm_metrics;
use serde::Deserialize;
use std::time::Duration;
use worker::{Date, Headers, Method, Request, RequestInit};

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
    init.with_method(Method::Get).with_headers(headers);
    Request::new_with_init(url, &init).ok()
}

async fn get_text(
    url: &str,
    api_key: Option<&str>,
    timeout: Duration,
) -> Result<(u16, String), String> {
    let req = get(url, api_key).ok_or_else(|| format!("bad probe URL {url}"))?;
    let (mut resp, _abort) = fetch_with_timeout(req, timeout, None)
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status_code();
    let text = with_timeout(resp.text(), timeout)
        .await
        .ok_or("body timed out")?
        .map_err(|e| e.to_string())?;
    Ok((status, text))
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
    match get_text(&format!("{base_url}/health"), api_key, timeout).await {
        Ok((200, _)) => report.result.ok = true,
        Ok((503, _)) => {
            report.health_status = Some(503);
            report.result.loading = true;
        }
        Ok((status, _)) => {
            report.health_status = Some(status);
            report.error = Some(format!("/health answered {status}"));
        }
        Err(e) => report.error = Some(format!("/health: {e}")),
    }
    if report.result.ok {
        report.health_status = Some(200);
        match get_text(&format!("{base_url}/v1/models"), api_key, timeout).await {
            Ok((200, body)) => {
                if let Ok(list) = serde_json::from_str::<ModelList>(&body) {
                    let models: Vec<String> = list.data.into_iter().map(|m| m.id).collect();
                    report.result.models = Some(models.clone());
                    report.models = Some(models);
                }
            }
            // The server is up but refuses the gateway's key: it cannot serve our traffic.
            Ok((status @ (401 | 403), _)) => {
                report.result.ok = false;
                report.error = Some(format!(
                    "/v1/models answered {status}: the backend rejects the configured api_key"
                ));
            }
            _ => {}
        }
        if let Ok((200, body)) = get_text(&format!("{base_url}/metrics"), api_key, timeout).await {
            report.metrics = parse_vllm_metrics(&body);
            report.metrics.apply_to(&mut report.result);
        }
    }
    report.duration_ms = Date::now().as_millis().saturating_sub(started);
    report
}
