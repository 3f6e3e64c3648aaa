//! What a probe's three answers say about a backend: the rules of reading `GET /health`,
//! `GET /v1/models` and `GET /metrics` into a [`ProbeReport`]. The pool's Durable Object fetches
//! them (with their bounds and timeouts, redirects not followed) and hands each answer here.
//!
//! `/health` 200 is up, 503 is a server loading its model, a 3xx is a redirect the gateway will not
//! follow (unhealthy, with the reason), anything else is down. Only an up server's models and
//! metrics are asked for: a 200 `/v1/models` that is not a model list (a login page) and a 401/403
//! (the server refuses the configured key) make it unhealthy, a 3xx too; a `/metrics` page is read
//! when it answered 200.

use super::probes::{AdapterCard, ProbeReport};
use crate::backend::scrape::parse_vllm_metrics;
use serde::Deserialize;

/// One probe request's answer: its status, its content type (lower case) and its body as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProbeAnswer {
    /// HTTP status.
    pub status: u16,
    /// The `content-type` header, lower case (empty without one).
    pub content_type: String,
    /// The body, as far as it was read.
    pub body: String,
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
    /// A LoRA adapter's base model (vLLM lists adapters with one).
    #[serde(default)]
    parent: Option<String>,
    #[serde(default)]
    root: Option<String>,
}

/// Why a 3xx answer makes the backend unusable, for its probe report.
fn redirected(path: &str, status: u16) -> String {
    format!("{path} answered a {status} redirect; the gateway follows no redirects, so register the URL the backend really serves on")
}

impl ProbeReport {
    /// Reads `/health`'s answer (`Err`: why none came). Returns whether the server is up, so
    /// that its models and metrics are asked for next.
    pub fn read_health(&mut self, answer: Result<u16, String>) -> bool {
        match answer {
            Ok(200) => {
                self.result.ok = true;
                self.health_status = Some(200);
            }
            Ok(503) => {
                self.health_status = Some(503);
                self.result.loading = true;
            }
            Ok(status @ 300..=399) => {
                self.health_status = Some(status);
                self.error = Some(redirected("/health", status));
            }
            Ok(status) => {
                self.health_status = Some(status);
                self.error = Some(format!("/health answered {status}"));
            }
            Err(e) => {
                self.error = Some(format!("/health: {e}"));
                self.result.unreachable = true;
            }
        }
        self.result.ok
    }

    /// Reads `/v1/models`' answer: the models it serves now, or why it is not a backend to route
    /// to. An answer that did not come, or another status, leaves the report as it was.
    pub fn read_models(&mut self, answer: Result<ProbeAnswer, String>) {
        match answer {
            Ok(ProbeAnswer {
                status: 200,
                body,
                content_type,
            }) => match serde_json::from_str::<ModelList>(&body) {
                Ok(list) => {
                    self.adapters = list
                        .data
                        .iter()
                        .filter_map(|m| {
                            Some(AdapterCard {
                                id: m.id.clone(),
                                parent: m.parent.clone()?,
                                root: m.root.clone(),
                            })
                        })
                        .collect();
                    let models: Vec<String> = list.data.into_iter().map(|m| m.id).collect();
                    self.result.models = Some(models.clone());
                    self.models = Some(models);
                }
                // A login page or anything else that is not vLLM: not a backend to route to.
                Err(_) => {
                    self.result.ok = false;
                    let shown: String = content_type.chars().take(64).collect();
                    self.error = Some(format!(
                        "/v1/models answered 200 with something that is not a model list (content type {})",
                        if shown.is_empty() { "none" } else { &shown }
                    ));
                }
            },
            Ok(ProbeAnswer {
                status: status @ 300..=399,
                ..
            }) => {
                self.result.ok = false;
                self.error = Some(redirected("/v1/models", status));
            }
            // The server is up but refuses the gateway's key: it cannot serve our traffic.
            Ok(ProbeAnswer {
                status: status @ (401 | 403),
                ..
            }) => {
                self.result.ok = false;
                self.error = Some(format!(
                    "/v1/models answered {status}: the backend rejects the configured api_key"
                ));
            }
            _ => {}
        }
    }

    /// Reads `/metrics`' answer: the gauges routing uses, when the page came with a 200. A page
    /// without vLLM's load series, or no page, leaves the backend's load unknown.
    pub fn read_metrics(&mut self, answer: Result<ProbeAnswer, String>) {
        if let Ok(ProbeAnswer {
            status: 200, body, ..
        }) = answer
        {
            self.metrics = parse_vllm_metrics(&body);
            self.metrics.apply_to(&mut self.result);
        }
        self.result.load_unknown = !self.metrics.has_load();
    }
}

#[cfg(test)]
#[path = "probe_answers_tests.rs"]
mod tests;
