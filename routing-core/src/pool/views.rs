//! What crosses the pool's boundary: the [`Grant`] and its [`CandidateView`]s going out, a
//! [`ProbeResult`] coming in, the [`BackendView`] listings show and the [`BackendSnapshot`] the
//! Durable Object persists. The scraped figures are [`crate::backend::scrape`]'s.

use crate::backend::breaker::{BreakerSnapshot, BreakerState};
use crate::backend::health::HealthState;
use crate::backend::scrape::{ScrapedGauges, VllmMetrics};
use crate::backend::time_model::TimingView;
use crate::backend::{BackendId, Capacity, Lifecycle};
use crate::policy::{DecisionKind, PolicyKind};
use crate::pool::lease::LeaseId;
use crate::request::role::Role;
use serde::{Deserialize, Serialize};
use std::fmt;

/// One backend in a grant: what the Worker needs to call it.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CandidateView {
    /// The backend's id.
    pub id: BackendId,
    /// Its base URL.
    pub url: String,
    /// Its API key, for the Worker's `Authorization` header (never logged: `Debug` hides it).
    pub api_key: Option<String>,
    /// Its role.
    pub role: Role,
}

impl Default for CandidateView {
    fn default() -> Self {
        CandidateView {
            id: BackendId::default(),
            url: String::new(),
            api_key: None,
            role: Role::Mixed,
        }
    }
}

impl fmt::Debug for CandidateView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CandidateView")
            .field("id", &self.id)
            .field("url", &self.url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("role", &self.role)
            .finish()
    }
}

/// A granted lease and the ranked candidates.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Grant {
    /// The lease to release (or reassign) later.
    pub lease_id: LeaseId,
    /// The chosen backend (`candidates[0]`).
    pub backend: BackendId,
    /// Candidates best first; the first is the choice, the rest are fallbacks for a retry
    /// before the first byte. For a disaggregated pair these are the prefill backends.
    pub candidates: Vec<CandidateView>,
    /// Decode backends, best first, for a disaggregated pair; empty otherwise.
    pub decode_candidates: Vec<CandidateView>,
    /// The policy that decided.
    pub policy: PolicyKind,
    /// Why the first candidate was chosen.
    pub decision: Option<DecisionKind>,
    /// Leading prompt blocks the chosen backend probably holds.
    pub cached_blocks: u32,
    /// When the lease expires unless released.
    pub deadline_ms: u64,
    /// The time model's predicted time to first token on the chosen backend, in whole ms (the
    /// Worker shows it as `x-gateway-predicted-ttft-ms`, to set against what was measured).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_ttft_ms: Option<u32>,
    /// What the router weighed: the chosen backend's predicted time to first token and the best
    /// alternative's (the Worker shows it as `x-gateway-route-receipt` and logs it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub receipt: Option<RouteReceipt>,
    /// The pool's time card, at most a quarter second old, so the Worker's copy of the pools it
    /// uses is as fresh as its last grant (the directory's copy covers the others).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub card: Option<Box<crate::region::TimeCard>>,
    /// The granting shard's roster number ([`crate::pool::Pool::roster`]): when it differs from
    /// the one an isolate last heard, a backend left service meanwhile, and the isolate's guesses
    /// (`ROUTE_AHEAD`) forget every backend of the pool (0 is left out).
    #[serde(skip_serializing_if = "is_zero_u32")]
    pub roster: u32,
    /// When the stream becomes overdue without a first token, in ms after the grant
    /// (`crate::pool::evidence`): the Worker tells the pool then if none came. Left out for a
    /// request that does not stream, or with lease evidence off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_token_due_ms: Option<u32>,
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

/// A decision's compact receipt: what the time model predicted for the backend chosen and for the
/// best alternative (the other eligible backend with the lowest predicted time to first token),
/// to set against what was measured. Times in whole milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RouteReceipt {
    /// The chosen backend's predicted time to first token.
    pub predicted_ttft_ms: u32,
    /// The best alternative, if another backend was eligible.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alt: Option<BackendId>,
    /// Its predicted time to first token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alt_predicted_ttft_ms: Option<u32>,
    /// Streams lease evidence found queued on the chosen backend beyond its last scrape, when its
    /// prediction counted any (`crate::pool::evidence`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_by_leases: Option<u32>,
    /// The same for the best alternative.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alt_queued_by_leases: Option<u32>,
}

impl RouteReceipt {
    /// The header form, `backend=<id>;predicted_ttft_ms=<n>;alt=<id>;alt_predicted_ttft_ms=<n>`
    /// (the `alt` pair left out when no other backend was eligible), then
    /// `;queued_by_leases=<n>` and `;alt_queued_by_leases=<n>` when a prediction counted streams
    /// that lease evidence found queued (`crate::pool::evidence`) rather than a scrape.
    pub fn header_value(&self, backend: &BackendId) -> String {
        let mut s = format!(
            "backend={};predicted_ttft_ms={}",
            backend.0, self.predicted_ttft_ms
        );
        if let (Some(alt), Some(ms)) = (&self.alt, self.alt_predicted_ttft_ms) {
            s.push_str(&format!(";alt={};alt_predicted_ttft_ms={ms}", alt.0));
        }
        if let Some(n) = self.queued_by_leases {
            s.push_str(&format!(";queued_by_leases={n}"));
        }
        if let Some(n) = self.alt_queued_by_leases {
            s.push_str(&format!(";alt_queued_by_leases={n}"));
        }
        s
    }
}

/// One health probe's findings, as the Durable Object's alarm gathers them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProbeResult {
    /// `/health` answered 200.
    pub ok: bool,
    /// `/health` answered 503: the server is loading its model.
    pub loading: bool,
    /// Model ids from `/v1/models`, if fetched.
    pub models: Option<Vec<String>>,
    /// What `/metrics` said (flattened: the JSON keeps one flat object).
    #[serde(flatten)]
    pub metrics: VllmMetrics,
    /// The scrape did not report the backend's load: `/metrics` gave no page, or one without
    /// vLLM's load series (`--disable-log-stats`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub load_unknown: bool,
    /// `/health` could not be reached at all (connection refused, reset, timeout): what vLLM
    /// 0.34 does while it loads its model (it listens only once loaded).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unreachable: bool,
}

impl VllmMetrics {
    /// Copies the page's figures into a probe result.
    pub fn apply_to(&self, probe: &mut ProbeResult) {
        probe.metrics = self.clone();
    }
}

/// A backend as listings show it: its spec without the API key, and its live state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendView {
    /// Id.
    pub id: BackendId,
    /// Pool name.
    pub pool: String,
    /// Base URL.
    pub url: String,
    /// Region.
    pub region: String,
    /// Models as registered.
    pub models: Vec<String>,
    /// Models it lists: the probe's `/v1/models` answer when known, else `models` (routed to only
    /// while it is up: `backend::serving`).
    pub served_models: Vec<String>,
    /// Weight.
    pub weight: u32,
    /// Role.
    pub role: Role,
    /// Whether an API key is stored (the key itself is never shown).
    pub has_api_key: bool,
    /// Capacity in effect (registered hints overridden by scraped values).
    pub capacity: Capacity,
    /// Lifecycle.
    pub lifecycle: Lifecycle,
    /// Probe health.
    pub health: HealthState,
    /// Breaker state (as of the last request or [`Pool::expire`](super::Pool::expire) call).
    pub breaker: BreakerState,
    /// End of the breaker's cooldown when open.
    pub breaker_open_until_ms: u64,
    /// End of a 429 saturation mark.
    pub saturated_until_ms: u64,
    /// Live leases.
    pub leases_in_flight: u32,
    /// Uncached prompt tokens of live leases.
    pub inflight_prompt_tokens: u64,
    /// Expected output tokens of live leases.
    pub inflight_output_tokens: u64,
    /// Load by the cost model, a fraction of capacity.
    pub load: f64,
    /// Prefix-affinity entries held for it.
    pub affinity_blocks: u64,
    /// When it was added.
    pub added_ms: u64,
    /// When its last probe result arrived.
    pub last_probe_ms: Option<u64>,
    /// Scraped gauges.
    pub scraped: ScrapedGauges,
    /// Its last scrape reported no load (no `vllm:*` series): priced as the most loaded known
    /// backend until a scrape reports it again.
    pub load_unknown: bool,
    /// The backend's time model: learned rates and its prefill backlog.
    pub timing: TimingView,
}

/// What the Durable Object persists of a backend's state besides its spec, so that a restart
/// neither forgets an open breaker nor takes healthy backends out of rotation until the next probe.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendSnapshot {
    /// The backend.
    pub id: BackendId,
    /// Its lifecycle.
    pub lifecycle: Lifecycle,
    /// Its probe health.
    pub health: HealthState,
    /// Its breaker.
    pub breaker: BreakerSnapshot,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;
    use crate::pool::test_support::pool_with;

    #[test]
    fn probe_results_stay_one_flat_json_object() {
        let old = r#"{"ok":true,"loading":false,"models":["m"],"waiting":2.0,"running":1.0,"kv_usage":0.5,"kv_blocks":64,"block_size":16,"tpot_seconds_sum":1.5,"tpot_count":10.0}"#;
        let probe: ProbeResult = serde_json::from_str(old).unwrap();
        assert_eq!(probe.metrics.gauges.waiting, Some(2.0));
        assert_eq!(probe.metrics.gauges.kv_blocks, Some(64));
        assert_eq!(probe.metrics.tpot_count, Some(10.0));
        let back = serde_json::to_value(&probe).unwrap();
        let old = serde_json::from_str::<serde_json::Value>(old).unwrap();
        for (k, v) in old.as_object().unwrap() {
            assert_eq!(&back[k], v, "{k}");
        }
        let mut copy = ProbeResult::default();
        probe.metrics.apply_to(&mut copy);
        assert_eq!(copy.metrics, probe.metrics);
        let partial: ProbeResult = serde_json::from_str(r#"{"ok":true}"#).unwrap();
        assert_eq!(partial.metrics, VllmMetrics::default());
    }

    #[test]
    fn views_and_debug_never_show_the_key() {
        let pool = pool_with(PolicyKind::LeastLoad, 1);
        let view = pool.backend(&"b0".into()).unwrap();
        let json = serde_json::to_string(&view).unwrap();
        assert!(!json.contains("key-b0"));
        assert!(view.has_api_key);
        let g = Grant {
            candidates: vec![CandidateView {
                api_key: Some("key-b0".into()),
                ..CandidateView::default()
            }],
            ..Grant::default()
        };
        assert!(!format!("{g:?}").contains("key-b0"));
        assert!(!format!("{pool:?}").contains("key-b0"));
    }
}
