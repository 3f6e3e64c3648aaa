//! Helpers the admission tests share: a queue configuration, request features, a waiting request
//! and serving in order.

use super::{AdmissionConfig, AdmissionQueue, Ticket, Waiting};
use crate::request::prompt::{request_features, FeatureConfig, RequestFeatures};
use serde_json::json;

pub(crate) const Q: u64 = 100;

pub(crate) fn config() -> AdmissionConfig {
    AdmissionConfig {
        enabled: true,
        quantum_tokens: Q,
        ..AdmissionConfig::default()
    }
}

pub(crate) fn features(text: &str, max_tokens: u32) -> RequestFeatures {
    let body = json!({"model": "llama", "max_tokens": max_tokens,
                      "messages": [{"role": "user", "content": text}]});
    request_features(&body, &|_| None, &FeatureConfig::default()).unwrap()
}

/// A waiting request of `cost` tokens (all of them output tokens: an empty-ish prompt).
pub(crate) fn waiting(ticket: Ticket, tenant: &str, priority: i32, cost: u64, at: u64) -> Waiting {
    Waiting {
        ticket,
        tenant: tenant.into(),
        priority,
        cost,
        arrived_ms: at,
        deadline_ms: at + 60_000,
        features: features(&format!("request {ticket}"), 8),
    }
}

/// Serves `n` requests in order (always the planned head) and returns their tickets.
pub(crate) fn serve(q: &mut AdmissionQueue, n: usize) -> Vec<Ticket> {
    let mut plan = Vec::new();
    let mut served = Vec::new();
    for _ in 0..n {
        q.plan(1, Q, &mut plan);
        let Some(&(t, in_turn)) = plan.first() else {
            break;
        };
        assert!(in_turn);
        q.take(t, true, Q as i64).unwrap();
        served.push(t);
    }
    served
}
