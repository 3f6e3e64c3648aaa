//! The bodies of every call between the Worker and the Durable Objects, one struct per message
//! (the acquire call, the hottest, has its own module: [`crate::acquire`]). Which message goes to
//! which [`crate::Route`], and what answers it, is [`crate::call`]'s.

use routing_core::admission::Ticket;
use routing_core::backend::{BackendId, BackendPatch, BackendSpec};
use routing_core::coordinator::history::HistoryReport;
use routing_core::coordinator::reassign::FailedAttempt;
use routing_core::coordinator::ProbeReport;
use routing_core::policy::PolicyKind;
use routing_core::pool::lease::{LeaseId, LeaseTerms};
use routing_core::pool::{BackendView, CandidateView, Refusal};
use routing_core::region::TimeCard;
use routing_core::request::rate_limit::{Left, RateLimits};
use routing_core::stream::outcome::Outcome;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub use crate::names::{
    DEFAULT_POOL, POOL_BINDING, POOL_HEADER, QUEUE_DROP_HEADER, QUEUE_WAIT_HEADER, SHARD_HEADER,
};

/// The Durable Object name of shard `shard` of `pool`: the pool's own name for shard 0 (so a pool
/// keeps its object and state when it gains shards), `pool#k` for the others (`#` is not allowed in
/// pool names, so no pool's object is another's shard).
pub fn shard_object_name(pool: &str, shard: u32) -> String {
    if shard == 0 {
        pool.to_string()
    } else {
        format!("{pool}#{shard}")
    }
}

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

/// `POST /reassign`: the lease's backend failed before the first byte; move it to the next
/// candidate. The body is the core's own account of the failed attempt.
pub type ReassignRequest = FailedAttempt;

/// The answer to `POST /reassign`.
#[derive(Debug, Clone, PartialEq)]
pub enum ReassignAnswer {
    /// The lease moved to this candidate.
    Moved(CandidateView),
    /// It did not move (the retry budget is spent, or the candidate cannot take it).
    Refused(Refusal),
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
    /// The stream's first token, in ms after the request began, when the Worker saw it since the
    /// last renewal (lease evidence: `routing_core::pool::evidence`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token_ms: Option<u64>,
    /// The stream had no first token by the time its grant said it was due
    /// (`Grant::first_token_due_ms`): this renewal is early, to say so.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub overdue: bool,
}

/// The answer to `POST /renew`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RenewAnswer {
    /// The lease's new deadline.
    pub deadline_ms: u64,
    /// Whether the pool had lost the lease and counted it again.
    pub reestablished: bool,
    /// The pool's time card, on the answer to a renewal that said its stream was overdue: it
    /// counts the queue that stream is in, so the isolate's next choice between pools sees it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub card: Option<Box<routing_core::region::TimeCard>>,
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

/// `POST /responses/holder`: which backend of the pool shard holds a stored Responses API
/// response (`GET /v1/responses/{id}` and its cancel go there).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResponseHolder {
    /// The response id.
    pub id: String,
    /// The hash of the asking client's key (`None` without client keys): only the key that made
    /// a response finds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// The answer to `POST /responses/holder`: the backend to call, or `None` when the response is
/// lost (never recorded, expired, or its backend left the pool or is down).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseHolderAnswer {
    /// The backend holding the response.
    pub holder: Option<CandidateView>,
}

/// `POST /release_batch`: several requests of one shard ended, each released as by `/release`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReleaseBatch {
    /// The releases, in the order they were queued.
    pub releases: Vec<ReleaseRequest>,
}

/// The answer to `POST /release_batch`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReleaseBatchAnswer {
    /// For each release in order, whether its lease was live.
    pub released: Vec<bool>,
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

impl AdminBackend {
    /// Adds another coordinator shard's requests in flight on the same backend (everything else,
    /// health, breaker and probes, is shard 0's).
    pub fn add_shard(&mut self, other: &AdminBackend) {
        let (v, o) = (&mut self.view, &other.view);
        v.leases_in_flight = v.leases_in_flight.saturating_add(o.leases_in_flight);
        v.inflight_prompt_tokens = v
            .inflight_prompt_tokens
            .saturating_add(o.inflight_prompt_tokens);
        v.inflight_output_tokens = v
            .inflight_output_tokens
            .saturating_add(o.inflight_output_tokens);
    }
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
    /// The LoRA adapters among them, with their base model and path (sorted, without duplicates).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<routing_core::coordinator::AdapterCard>,
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
    /// The pool's jurisdiction (from the directory; the admin listing fills it in).
    #[serde(default)]
    pub jurisdiction: String,
    /// The pool's latest time card as the Worker routes on it (from the directory; the admin
    /// listing fills it in).
    #[serde(default)]
    pub time_card: Option<TimeCard>,
}

impl PoolSummary {
    /// Adds another coordinator shard's load and counters: requests in flight, its queue, retries
    /// and spills. The fleet's state (backends, scraped gauges, probes, autoscaling) is shard 0's.
    pub fn add_shard(&mut self, other: &PoolSummary) {
        self.in_flight += other.in_flight;
        self.in_flight_tokens += other.in_flight_tokens;
        self.retries += other.retries;
        self.spills += other.spills;
        self.retry_budget_exhausted += other.retry_budget_exhausted;
        let (q, o) = (&mut self.queue, &other.queue);
        q.length += o.length;
        for (band, n) in &o.by_priority {
            *q.by_priority.entry(band.clone()).or_default() += n;
        }
        q.tenants += o.tenants;
        q.oldest_wait_ms = q.oldest_wait_ms.max(o.oldest_wait_ms);
        q.waiting_tokens += o.waiting_tokens;
        q.admitted += o.admitted;
        q.queued += o.queued;
        q.reentered += o.reentered;
        for (reason, n) in &o.dropped {
            *q.dropped.entry(reason.clone()).or_default() += n;
        }
    }
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

// ---- Between coordinator shards ----------------------------------------------------------

/// The answer to `POST /shard/load` (body: a `routing_core::pool::shard::LoadReport`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReportAnswer {
    /// Whether the report counts (false: one shard, the receiver's own, or older than one held).
    pub accepted: bool,
}

/// `POST /shard/probes`: shard 0's probe round, for a sibling to apply (probing runs once per
/// pool).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProbeRound {
    /// Each probed backend and what its probe found.
    pub reports: Vec<(BackendId, ProbeReport)>,
}

/// `POST /shard/registry`: shard 0's backends, for a sibling to match (after the pool's shard
/// count changed, so a new shard knows every backend). Carries the backends' API keys: a call
/// between Durable Objects only, never relayed to a client.
#[derive(Clone, Default, Serialize, Deserialize)]
pub struct ShardRegistry {
    /// Every backend's spec, and whether it is drained or draining.
    pub backends: Vec<(BackendSpec, bool)>,
    /// Backends whose `DELETE` waits for their drain.
    pub pending_delete: Vec<BackendId>,
}

/// The answer to `POST /shard/probes` and `POST /shard/registry`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardAck {
    /// Backends the call changed.
    pub applied: usize,
}

// ---- The directory -------------------------------------------------------------------------

/// The directory's answer to a pool's published time card.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CardAnswer {
    /// Whether the directory knows the pool (a card of an unknown pool is dropped).
    pub known: bool,
}

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
    /// Coordinator shards new requests go to (its `shards` setting; 1 when never set).
    #[serde(default = "one_shard")]
    pub shards: u32,
    /// Shard objects the pool has ever had (the most `shards` ever set): a shard retired by a
    /// smaller count still releases the leases it granted, so admin changes, listings and metrics
    /// cover it.
    #[serde(default = "one_shard")]
    pub shard_objects: u32,
    /// Jurisdiction of the pool's GPUs (for example `eu`); empty when none is set.
    #[serde(default)]
    pub jurisdiction: String,
    /// Jurisdictions that may serve the requests whose nearest pool this is (empty: any).
    #[serde(default)]
    pub residency: Vec<String>,
    /// The pool's latest time card (shard 0's), as the directory last heard it; kept in the
    /// directory's memory only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub card: Option<TimeCard>,
}

impl PoolEntry {
    /// Every shard object of the pool, current and retired.
    pub fn all_shards(&self) -> u32 {
        self.shards.max(self.shard_objects).max(1)
    }
}

fn one_shard() -> u32 {
    1
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
    /// The jurisdictions the key's requests may be served in (empty: wherever the pools allow).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub residency: Vec<String>,
}

/// Body of `PATCH /keys/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct KeyPatch {
    /// New admission priority.
    pub priority: Option<i32>,
    /// New jurisdictions (an empty list lifts the restriction).
    pub residency: Option<Vec<String>>,
}

/// The answer to `PATCH /keys/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyPatchAnswer {
    /// The key.
    pub id: String,
    /// Its priority now.
    pub priority: i32,
    /// Its jurisdictions now.
    #[serde(default)]
    pub residency: Vec<String>,
}

// ---- Client rate limits --------------------------------------------------------------------

/// Body of `POST /take`: charge a request's estimate against the client's buckets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TakeRequest {
    /// The client's limits.
    pub limits: RateLimits,
    /// Tokens the request is charged.
    pub tokens: u64,
    /// Charge it whatever the buckets hold, never refusing: a request already served ahead of
    /// its charge's answer that the limiter refused (`RATE_LIMIT_AHEAD`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// Answer of `POST /take` when the request was admitted (or forced): what the client's limited
/// buckets hold after it, for the isolate's [`routing_core::request::rate_limit::LimitAheadBook`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Taken {
    /// Requests and tokens left of the minute's allowance.
    pub left: Left,
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
mod tests;
