//! The messages the Worker and the Durable Objects exchange.
//!
//! Rust Durable Objects are reached over `stub.fetch`, so every call is an HTTP request to an
//! internal URL with a JSON body. This module names those routes and their bodies in one place, so
//! the two sides cannot drift apart.

use serde::{Deserialize, Serialize};

/// Base of the internal URLs used to reach a Durable Object (the host is never resolved).
pub const INTERNAL_ORIGIN: &str = "https://do.internal";

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

/// The name a pool gets when a registration names none.
pub const DEFAULT_POOL: &str = "default";

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

/// Header carrying the pool's name on every call to a pool coordinator (a Durable Object does not
/// know the name it was addressed by).
pub const POOL_HEADER: &str = "x-gateway-pool";

/// `POST /reassign`: the lease's backend failed before the first byte; move it to `to`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReassignRequest {
    /// The lease.
    pub lease_id: routing_core::lease::LeaseId,
    /// The next candidate.
    pub to: routing_core::backend::BackendId,
    /// How the failed attempt ended (fed to the failed backend's breaker).
    pub failure: routing_core::outcome::Outcome,
    /// The lease as the Worker knows it (its `backend` is the one that failed), so a pool that
    /// lost the lease counts it again and moves it rather than refusing the retry.
    #[serde(default)]
    pub terms: Option<routing_core::lease::LeaseTerms>,
    /// The request's prompt-prefix block hashes, recorded on `to` once it takes the request.
    #[serde(default)]
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
    pub lease_id: routing_core::lease::LeaseId,
    /// How the prefill stage ended (fed to the prefill backend's breaker and statistics).
    pub outcome: routing_core::outcome::Outcome,
    /// The prefill backend.
    #[serde(default)]
    pub backend: Option<routing_core::backend::BackendId>,
}

/// `POST /renew`: the request is still running; push the lease's deadline out. A pool that lost
/// the lease (it expired, or the Durable Object restarted) counts it again from `terms`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RenewRequest {
    /// The lease.
    pub lease_id: routing_core::lease::LeaseId,
    /// The lease as the Worker knows it (`backend`: the one serving the request now).
    pub terms: routing_core::lease::LeaseTerms,
}

/// The answer to `POST /renew`.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    pub lease_id: routing_core::lease::LeaseId,
    /// How it ended.
    pub outcome: routing_core::outcome::Outcome,
    /// The backend that served it last (only its persisted state can have changed).
    #[serde(default)]
    pub backend: Option<routing_core::backend::BackendId>,
}

/// `POST /acquire`: a request's routing features, plus who is asking when admission control may
/// queue it (without `admission`, the pool never queues the request).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AcquireRequest {
    /// What routing needs to know about the request.
    #[serde(flatten)]
    pub features: routing_core::prompt::RequestFeatures,
    /// Tenant, priority, wait limit, and the ticket of a wait in progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<routing_core::admission::AdmissionRequest>,
}

/// `202` answer of `POST /acquire`: the request waits in the pool's queue; ask again with the
/// ticket (within a few seconds, or the pool counts the client as gone).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Queued {
    /// The wait's handle.
    pub ticket: routing_core::admission::Ticket,
    /// Requests waiting in the pool's queue.
    pub queue_length: usize,
}

/// `POST /dequeue`: the client of a queued request left.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DequeueRequest {
    /// The wait's handle.
    pub ticket: routing_core::admission::Ticket,
}

/// Header of a granted acquire: milliseconds the request waited in the pool's queue.
pub const QUEUE_WAIT_HEADER: &str = "x-gateway-queue-wait-ms";
/// Header of a request refused or dropped by admission control: the drop reason.
pub const QUEUE_DROP_HEADER: &str = "x-gateway-queue-drop";
