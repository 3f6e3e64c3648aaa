//! The bodies of every call between the Worker and the Durable Objects, one struct per message
//! (the acquire call, the hottest, has its own module: [`crate::acquire`]). Each [`crate::Route`]
//! names its request and answer here.

use routing_core::admission::Ticket;
use routing_core::backend::{BackendId, BackendPatch};
use routing_core::history::HistoryReport;
use routing_core::lease::{LeaseId, LeaseTerms};
use routing_core::outcome::Outcome;
use routing_core::policy::PolicyKind;
use routing_core::pool::{BackendView, ProbeResult};
use routing_core::rate_limit::RateLimits;
use routing_core::scrape::VllmMetrics;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Header carrying the pool's name on every call to a pool coordinator (a Durable Object does not
/// know the name it was addressed by).
pub const POOL_HEADER: &str = "x-gateway-pool";
/// Header of a granted acquire: milliseconds the request waited in the pool's queue.
pub const QUEUE_WAIT_HEADER: &str = "x-gateway-queue-wait-ms";
/// Header of a request refused or dropped by admission control: the drop reason.
pub const QUEUE_DROP_HEADER: &str = "x-gateway-queue-drop";
/// The name a pool gets when a registration names none.
pub const DEFAULT_POOL: &str = "default";

// ---- The request path: leases --------------------------------------------------------------

/// `202` answer of `POST /acquire`: the request waits in the pool's queue; ask again with the
/// ticket (within a few seconds, or the pool counts the client as gone).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Queued {
    /// The wait's handle.
    pub ticket: Ticket,
    /// Requests waiting in the pool's queue.
    pub queue_length: usize,
}

/// `POST /dequeue`: the client of a queued request left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DequeueRequest {
    /// The wait's handle.
    pub ticket: Ticket,
}

/// The answer to `POST /dequeue`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DequeueAnswer {
    /// Whether the ticket was still waiting.
    pub dequeued: bool,
}

/// `POST /reassign`: the lease's backend failed before the first byte; move it to `to`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReassignRequest {
    /// The lease.
    pub lease_id: LeaseId,
    /// The next candidate.
    pub to: BackendId,
    /// How the failed attempt ended (fed to the failed backend's breaker).
    pub failure: Outcome,
    /// The lease as the Worker knows it (its `backend` is the one that failed), so a pool that
    /// lost the lease counts it again and moves it rather than refusing the retry.
    #[serde(default)]
    pub terms: Option<LeaseTerms>,
    /// The request's prompt-prefix block hashes, recorded on `to` once it takes the request.
    #[serde(default, with = "routing_core::block_hash_encoding")]
    pub block_hashes: Vec<u64>,
    /// The failed backend answered 404: it does not serve this model (any more).
    #[serde(default)]
    pub missing_model: Option<String>,
}

/// `POST /prefill_done`: the prefill stage of a disaggregated request ended with `outcome`; the
/// prefill share ends now and the lease goes on with its decode share.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrefillDone {
    /// The lease.
    pub lease_id: LeaseId,
    /// How the prefill stage ended (fed to the prefill backend's breaker and statistics).
    pub outcome: Outcome,
    /// The prefill backend.
    #[serde(default)]
    pub backend: Option<BackendId>,
}

/// The answer to `POST /prefill_done`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillDoneAnswer {
    /// Whether the lease's prefill share ended now (false: it had already, or the lease is gone).
    pub ended: bool,
}

/// `POST /renew`: the request is still running; push the lease's deadline out. A pool that lost
/// the lease (it expired, or the Durable Object restarted) counts it again from `terms`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RenewRequest {
    /// The lease.
    pub lease_id: LeaseId,
    /// The lease as the Worker knows it (`backend`: the one serving the request now).
    pub terms: LeaseTerms,
}

/// The answer to `POST /renew`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RenewAnswer {
    /// The lease's new deadline.
    pub deadline_ms: u64,
    /// Whether the pool had lost the lease and counted it again.
    pub reestablished: bool,
}

/// `POST /release`: the request ended.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReleaseRequest {
    /// The lease.
    pub lease_id: LeaseId,
    /// How it ended.
    pub outcome: Outcome,
    /// The backend that served it last (only its persisted state can have changed).
    #[serde(default)]
    pub backend: Option<BackendId>,
}

/// The answer to `POST /release`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReleaseAnswer {
    /// Whether the lease was live (false: it had expired or been released already).
    pub released: bool,
}

// ---- Backends (the admin API) --------------------------------------------------------------

/// Registration of a backend, as posted to `POST /admin/backends`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct BackendRegistration {
    /// Base URL of the vLLM server, `http(s)://host:port`, without credentials.
    pub url: String,
    /// Pool (regional GPU group) the backend belongs to; default `default`.
    #[serde(default)]
    pub pool: Option<String>,
    /// Region of the pool, such as `us-east`.
    #[serde(default)]
    pub region: Option<String>,
    /// Models the backend serves; probes refresh this list.
    #[serde(default)]
    pub models: Vec<String>,
    /// Relative weight for weighted policies and ring virtual nodes; default 1.
    #[serde(default)]
    pub weight: Option<u32>,
    /// `mixed` (default), `prefill` or `decode`.
    #[serde(default)]
    pub role: Option<String>,
    /// Bearer key the gateway sends to this backend; stored, never returned.
    #[serde(default)]
    pub api_key: Option<String>,
    /// Capacity hint: maximum concurrent sequences (vLLM `--max-num-seqs`).
    #[serde(default)]
    pub max_num_seqs: Option<u32>,
    /// Capacity hint: KV-cache blocks (vLLM `num_gpu_blocks`).
    #[serde(default)]
    pub kv_blocks: Option<u64>,
    /// Capacity hint: tokens per KV block.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Caller-chosen id; derived from the URL when absent.
    #[serde(default)]
    pub id: Option<String>,
}

/// Body of `PATCH /backends/{id}`: spec changes plus drain / undrain. The Worker forwards the
/// admin's JSON as written (after parsing it as this struct): `BackendPatch` tells an absent
/// `api_key` from a `null` one and never serialises the key, so re-encoding would lose both.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AdminPatch {
    /// Spec changes.
    #[serde(flatten)]
    pub patch: BackendPatch,
    /// `true` drains the backend, `false` puts it back in service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drain: Option<bool>,
}

/// What one probe round found out about a backend, kept for the admin view and metrics.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProbeReport {
    /// When the probe started (ms since the epoch).
    pub at_ms: u64,
    /// How long the whole probe took.
    pub duration_ms: u64,
    /// HTTP status of `/health`, if it answered.
    pub health_status: Option<u16>,
    /// Why the probe failed, if it did.
    pub error: Option<String>,
    /// Models listed by `/v1/models`.
    pub models: Option<Vec<String>>,
    /// Gauges read from `/metrics`.
    pub metrics: VllmMetrics,
    /// The result fed to the pool.
    pub result: ProbeResult,
}

/// A backend as the admin API shows it: the core's view plus the last probe report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdminBackend {
    /// The routing core's view.
    #[serde(flatten)]
    pub view: BackendView,
    /// The last probe's findings.
    pub last_probe: Option<ProbeReport>,
    /// A `DELETE` waits for the backend's drain to finish.
    pub delete_pending: bool,
}

/// The answer to `GET /backends`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BackendList {
    /// Always `list`.
    pub object: String,
    /// The pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Its backends.
    pub data: Vec<AdminBackend>,
}

/// The answer to `DELETE /backends/{id}` and `DELETE /keys/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeleteAnswer {
    /// What was (or will be) deleted.
    pub id: String,
    /// Whether it is gone now (a backend with requests in flight drains first).
    pub deleted: bool,
    /// `draining` while a backend's deletion waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// Requests still in flight on a draining backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leases_in_flight: Option<u32>,
}

/// The answer to `GET /models`: models some ready, healthy backend serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelsAnswer {
    /// Sorted, without duplicates.
    pub models: Vec<String>,
}

// ---- The pool as a whole -------------------------------------------------------------------

/// The answer to `GET /state` (and `POST /probe/now`): the pool at a glance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolSummary {
    /// Pool name.
    pub pool: String,
    /// Region from the pool's settings (empty until set).
    pub region: String,
    /// Routing policy.
    pub policy: PolicyKind,
    /// Registered backends.
    pub backends: usize,
    /// Backends ready and healthy.
    pub ready_backends: usize,
    /// Live leases.
    pub in_flight: usize,
    /// Tokens of the live leases.
    pub in_flight_tokens: u64,
    /// Backends' scraped waiting queues, summed.
    pub waiting: f64,
    /// Backends' scraped running batches, summed.
    pub running: f64,
    /// New work goes to another pool when there is one.
    pub saturated: bool,
    /// Admission control's queue.
    pub queue: QueueSummary,
    /// The autoscaling signal.
    pub autoscaling: Autoscaling,
    /// Leases moved to another backend after a failure.
    pub retries: u64,
    /// Acquires refused so that a further pool takes them.
    pub spills: u64,
    /// When the last probe round ended.
    pub last_probe_ms: Option<u64>,
    /// Probe rounds since the object started.
    pub probe_rounds: u64,
    /// Retries the retry budget refused.
    pub retry_budget_exhausted: u64,
}

/// The autoscaling part of [`PoolSummary`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Autoscaling {
    /// The waiting-per-replica target.
    pub target_waiting_per_replica: f64,
    /// Replicas an autoscaler should aim for.
    pub desired_replicas: u64,
}

/// The admission queue as `GET /admin/pools/{pool}` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueSummary {
    /// Admission control is on.
    pub enabled: bool,
    /// Requests waiting.
    pub length: usize,
    /// Requests waiting per priority band.
    pub by_priority: BTreeMap<String, usize>,
    /// Tenants with requests waiting.
    pub tenants: usize,
    /// How long the oldest waiting request has waited, ms.
    pub oldest_wait_ms: Option<u64>,
    /// Tokens of the waiting requests.
    pub waiting_tokens: u64,
    /// Requests admitted (at once or after waiting).
    pub admitted: u64,
    /// Requests that waited.
    pub queued: u64,
    /// Waits that re-entered with a ticket the pool had forgotten.
    pub reentered: u64,
    /// Requests dropped, by reason.
    pub dropped: BTreeMap<String, u64>,
}

/// `GET /admin/pools/{pool}`: the summary and the settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolDetail {
    /// The summary.
    #[serde(flatten)]
    pub summary: PoolSummary,
    /// The settings.
    pub config: crate::settings::PoolSettings,
}

/// The answer to `GET /history`: the pool's last hour, minute by minute.
#[derive(Debug, Clone, Serialize)]
pub struct PoolHistory {
    /// Pool name.
    pub pool: String,
    /// The minutes.
    #[serde(flatten)]
    pub report: HistoryReport,
}

/// The answer to `POST /probe/ensure`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlarmAnswer {
    /// Whether the probe alarm was armed already.
    pub alarm_was_armed: bool,
}

// ---- The directory -------------------------------------------------------------------------

/// A pool as the directory knows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PoolEntry {
    /// Pool name (also the Durable Object name).
    pub name: String,
    /// Region, such as `us-east`; empty when unknown.
    #[serde(default)]
    pub region: String,
    /// Durable Object location hint (for example `enam`), used when the pool is first addressed.
    #[serde(default)]
    pub location_hint: Option<String>,
}

/// A client API key as stored: never the key itself, only its hash.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StoredKey {
    /// Public id, used to revoke the key.
    pub id: String,
    /// Operator's label.
    pub name: String,
    /// Hex SHA-256 of the key.
    pub hash: String,
    /// When it was minted (ms since the epoch).
    pub created_ms: u64,
    /// Admission priority of the key's requests (higher is served first; default 0).
    #[serde(default)]
    pub priority: i32,
}

/// Body of `PATCH /keys/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct KeyPatch {
    /// New admission priority.
    pub priority: Option<i32>,
}

/// The answer to `PATCH /keys/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyPatchAnswer {
    /// The key.
    pub id: String,
    /// Its priority now.
    pub priority: i32,
}

// ---- Client rate limits --------------------------------------------------------------------

/// Body of `POST /take`: charge a request's estimate against the client's buckets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TakeRequest {
    /// The client's limits.
    pub limits: RateLimits,
    /// Tokens the request is charged.
    pub tokens: u64,
}

/// Body of `POST /settle`: correct an admitted request's charge with what it really used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SettleRequest {
    /// The client's limits.
    pub limits: RateLimits,
    /// Tokens charged at admission.
    pub reserved: u64,
    /// Tokens the request really used.
    pub actual: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reassign_carries_its_hashes_compactly_and_back() {
        let req = ReassignRequest {
            lease_id: 7,
            to: BackendId("b-2".into()),
            failure: Outcome::default(),
            terms: None,
            block_hashes: vec![1, u64::MAX, 42],
            missing_model: None,
        };
        let text = serde_json::to_string(&req).unwrap();
        assert!(
            text.contains(r#""block_hashes":"AQAAAAAAAAD//////////yoAAAAAAAAA""#),
            "{text}"
        );
        let back: ReassignRequest = serde_json::from_str(&text).unwrap();
        assert_eq!(back.block_hashes, req.block_hashes);
        let without: ReassignRequest =
            serde_json::from_str(r#"{"lease_id":7,"to":"b-2","failure":{"kind":"timeout"}}"#)
                .unwrap();
        assert!(without.block_hashes.is_empty());
    }

    #[test]
    fn small_answers_are_small() {
        let release = serde_json::to_string(&ReleaseAnswer { released: true }).unwrap();
        assert_eq!(release, r#"{"released":true}"#);
        let delete = DeleteAnswer {
            id: "b".into(),
            deleted: true,
            status: None,
            leases_in_flight: None,
        };
        assert_eq!(
            serde_json::to_string(&delete).unwrap(),
            r#"{"id":"b","deleted":true}"#
        );
    }

    #[test]
    fn an_admin_patch_keeps_drain_apart_from_the_spec() {
        let p: AdminPatch = serde_json::from_str(r#"{"weight":3,"drain":true}"#).unwrap();
        assert_eq!((p.patch.weight, p.drain), (Some(3), Some(true)));
        let again: AdminPatch = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!((again.patch.weight, again.drain), (Some(3), Some(true)));
    }
}
