//! The pool: one group of vLLM servers and every routing decision about them.
//!
//! This is the facade the pool's Durable Object calls. It owns the backend registry, each
//! backend's health and circuit breaker, the routing policy (and its hash ring), the
//! prefix-affinity table and the live leases. The Durable Object persists what [`Pool`] hands it
//! ([`BackendSpec`], [`PoolConfig`], [`BackendSnapshot`]) and rebuilds the pool from them after a
//! restart; leases and affinity are memory only.
//!
//! A request's life: the Worker computes [`RequestFeatures`]; [`Pool::acquire`] filters the
//! backends (served model, role, lifecycle, health, breaker, saturation), fills in the cost model,
//! lets the policy rank them and grants a lease on the first; the Worker calls the backend, walks
//! to the next candidate with [`Pool::reassign`] if it fails before the first byte, and finally
//! [`Pool::release`]s the lease with the [`Outcome`], which feeds the breaker and the statistics.
//! [`Pool::expire`] ends leases nobody released, and [`Pool::next_deadline`] says when to call it.

use crate::admission::{has_room, AdmissionConfig};
use crate::affinity::PrefixAffinity;
use crate::backend::{BackendId, BackendKey, BackendPatch, BackendSpec, Capacity, Lifecycle, Role};
use crate::breaker::{Admission, BreakerConfig, BreakerSnapshot, BreakerState, CircuitBreaker};
use crate::cost::{backend_load, cache_benefit, InFlight};
use crate::health::{Health, HealthConfig, HealthState, HealthTransition, ProbeVerdict};
use crate::held_blocks::HeldBlocks;
use crate::lease::{Lease, LeaseId, LeaseShare, LeaseTable, LeaseTerms, MAX_LEASE_ID};
use crate::metrics::{BackendStats, PoolStats};
use crate::outcome::{Outcome, OutcomeKind};
use crate::policy::{
    self, CacheAwareConfig, Candidate, ConsistentHashConfig, DecisionInput, DecisionKind,
    PolicyKind, PredictedLatencyConfig, RoutingPolicy, NO_CANDIDATE,
};
use crate::prompt::{RequestFeatures, DEFAULT_BLOCK_TOKENS};
use crate::random::RandomSource;
use crate::ring::{key_hash, RingMember};
use crate::shard::{LoadReport, ShardLoad, SiblingLoads, SIBLING_ECHO};
use crate::time_model::{
    room_wait_ms, BackendTiming, Observation, OutputRatio, SharePrediction, TimeModelConfig,
    TimingView,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use xxhash_rust::xxh3::xxh3_64;

/// A pool's configuration, persisted by the Durable Object and changed through the admin API.
/// Every field has a default, so partial JSON works.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolConfig {
    /// The routing policy (default `cache_aware`).
    pub policy: PolicyKind,
    /// The pool's region (free text, e.g. `us-east`; default empty).
    pub region: String,
    /// Candidates in a grant: the choice plus fallbacks (default 3, 1 to 16).
    pub max_candidates: usize,
    /// Tokens per prefix block; must match the Worker's `FeatureConfig::block_tokens`
    /// (default 16).
    pub block_tokens: usize,
    /// A lease expires this long after it was granted or last renewed, unless released (default
    /// 60,000 ms). The Worker renews a live request's lease several times per period, so this
    /// bounds how long the load of a request whose Worker died stays counted, not how long a
    /// request may run.
    pub lease_ttl_ms: u64,
    /// Weight of the scraped waiting queue in a backend's load (default 1.0).
    pub queue_weight: f64,
    /// Global bound on prefix-affinity entries (default 1,000,000, about 48 MB).
    pub affinity_max_entries: usize,
    /// consistent_hash knobs.
    pub consistent_hash: ConsistentHashConfig,
    /// cache_aware (and disaggregated prefill) knobs.
    pub cache_aware: CacheAwareConfig,
    /// predicted_latency knobs.
    pub predicted_latency: PredictedLatencyConfig,
    /// The time model's starting rates and learning ([`crate::time_model`]).
    pub time_model: TimeModelConfig,
    /// Circuit-breaker thresholds and timings.
    pub breaker: BreakerConfig,
    /// Health-probe thresholds.
    pub health: HealthConfig,
    /// Admission control: backend capacity and the queue ([`crate::admission`]).
    pub admission: AdmissionConfig,
}

/// Fewest output tokens between two scrapes for their time per token to teach the time model.
const MIN_SCRAPED_TOKENS: f64 = 50.0;

/// Most candidates a grant can carry.
pub const MAX_CANDIDATES: usize = 16;

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            policy: PolicyKind::default(),
            region: String::new(),
            max_candidates: 3,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            lease_ttl_ms: 60_000,
            queue_weight: 1.0,
            affinity_max_entries: 1_000_000,
            consistent_hash: ConsistentHashConfig::default(),
            cache_aware: CacheAwareConfig::default(),
            predicted_latency: PredictedLatencyConfig::default(),
            time_model: TimeModelConfig::default(),
            breaker: BreakerConfig::default(),
            health: HealthConfig::default(),
            admission: AdmissionConfig::default(),
        }
    }
}

impl PoolConfig {
    /// Checks every knob's range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |m: &str| Err(ConfigError(m.to_string()));
        if self.max_candidates == 0 || self.max_candidates > MAX_CANDIDATES {
            return fail("max_candidates must be between 1 and 16");
        }
        if self.block_tokens == 0 || self.block_tokens > 4096 {
            return fail("block_tokens must be between 1 and 4096");
        }
        if self.lease_ttl_ms < 1_000 {
            return fail("lease_ttl_ms must be at least 1000");
        }
        if !(self.queue_weight.is_finite() && self.queue_weight >= 0.0) {
            return fail("queue_weight must be a finite number at least 0");
        }
        if self.affinity_max_entries > 100_000_000 {
            return fail("affinity_max_entries must be at most 100,000,000");
        }
        self.consistent_hash.validate().map_err(ConfigError)?;
        self.cache_aware.validate().map_err(ConfigError)?;
        self.predicted_latency.validate().map_err(ConfigError)?;
        self.time_model.validate().map_err(ConfigError)?;
        self.breaker.validate().map_err(ConfigError)?;
        if self.health.failure_threshold == 0 || self.health.success_threshold == 0 {
            return fail("health thresholds must be at least 1");
        }
        self.admission.validate().map_err(ConfigError)?;
        Ok(())
    }

    fn limit(&self) -> usize {
        self.max_candidates.clamp(1, MAX_CANDIDATES)
    }

    fn block_tokens(&self) -> usize {
        self.block_tokens.max(1)
    }
}

/// An invalid [`PoolConfig`], with the reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid pool configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Errors of the registry and lease operations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "error", rename_all = "snake_case")]
pub enum PoolError {
    /// No backend has this id.
    UnknownBackend {
        /// The id asked for.
        id: BackendId,
    },
    /// A backend with this id already exists.
    DuplicateBackend {
        /// The id asked for.
        id: BackendId,
    },
    /// The spec or patch is invalid.
    InvalidSpec {
        /// Why.
        reason: String,
    },
    /// The lifecycle change is not allowed.
    InvalidTransition {
        /// Current lifecycle.
        from: Lifecycle,
        /// Requested lifecycle.
        to: Lifecycle,
    },
    /// No live lease has this id (released, expired or never granted).
    UnknownLease {
        /// The id asked for.
        lease_id: LeaseId,
    },
    /// The backend cannot take the request now (not ready, unhealthy, breaker open, saturated).
    BackendUnavailable {
        /// The backend.
        id: BackendId,
    },
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::UnknownBackend { id } => write!(f, "no backend `{id}`"),
            PoolError::DuplicateBackend { id } => write!(f, "backend `{id}` already exists"),
            PoolError::InvalidSpec { reason } => write!(f, "invalid backend: {reason}"),
            PoolError::InvalidTransition { from, to } => write!(
                f,
                "cannot move a backend from {} to {}",
                from.as_str(),
                to.as_str()
            ),
            PoolError::UnknownLease { lease_id } => write!(f, "no live lease {lease_id}"),
            PoolError::BackendUnavailable { id } => write!(f, "backend `{id}` is unavailable"),
        }
    }
}

impl std::error::Error for PoolError {}

/// Why no lease was granted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "error", rename_all = "snake_case")]
pub enum AcquireError {
    /// No backend in the pool serves the model (the Worker answers 404 `model_not_found`).
    ModelNotFound {
        /// The model asked for.
        model: String,
    },
    /// Backends serve the model but none can take a request now (the Worker answers 503 with
    /// `Retry-After`).
    NoBackendAvailable {
        /// Seconds until a breaker cooldown or saturation mark ends (at least 1).
        retry_after_s: u64,
    },
    /// Backends serve the model and are up, but every one is at its admission capacity (only with
    /// admission control on: the request may wait in the pool's queue).
    AtCapacity,
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AcquireError::ModelNotFound { model } => {
                write!(f, "the model `{model}` does not exist in this pool")
            }
            AcquireError::NoBackendAvailable { retry_after_s } => write!(
                f,
                "no backend is available for this model; retry after {retry_after_s} s"
            ),
            AcquireError::AtCapacity => f.write_str("every backend for this model is at capacity"),
        }
    }
}

impl std::error::Error for AcquireError {}

/// Seconds suggested to retry after when no breaker or saturation mark says better (a backend
/// that is pending, loading or unhealthy waits for the next probe).
pub const DEFAULT_RETRY_AFTER_S: u64 = 5;

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
    /// `vllm:num_requests_waiting`.
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running`.
    pub running: Option<f64>,
    /// `vllm:gpu_cache_usage_perc` (or `kv_cache_usage_perc`), 0 to 1.
    pub kv_usage: Option<f64>,
    /// `num_gpu_blocks` from `vllm:cache_config_info`.
    pub kv_blocks: Option<u64>,
    /// `block_size` from `vllm:cache_config_info`.
    pub block_size: Option<u32>,
    /// Cumulative sum of `vllm:time_per_output_token_seconds`.
    pub tpot_seconds_sum: Option<f64>,
    /// Cumulative count of `vllm:time_per_output_token_seconds`.
    pub tpot_count: Option<f64>,
}

/// Gauges scraped from a backend's `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ScrapedGauges {
    /// Requests waiting in vLLM's queue.
    pub waiting: Option<f64>,
    /// Requests running.
    pub running: Option<f64>,
    /// KV-cache usage, 0 to 1.
    pub kv_usage: Option<f64>,
    /// KV blocks reported by the server.
    pub kv_blocks: Option<u64>,
    /// Block size reported by the server.
    pub block_size: Option<u32>,
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
    /// Models routed to it: the probe's `/v1/models` answer when known, else `models`.
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
    /// Breaker state (as of the last request or [`Pool::expire`] call).
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

/// One registered backend and its live state.
#[derive(Debug, Clone)]
pub(crate) struct BackendEntry {
    pub(crate) key: BackendKey,
    pub(crate) spec: BackendSpec,
    pub(crate) lifecycle: Lifecycle,
    pub(crate) health: Health,
    pub(crate) breaker: CircuitBreaker,
    pub(crate) in_flight: InFlight,
    pub(crate) probed_models: Option<Vec<String>>,
    pub(crate) scraped: ScrapedGauges,
    pub(crate) added_ms: u64,
    pub(crate) stats: BackendStats,
    /// Learned rates and the virtual prefill queue.
    pub(crate) timing: BackendTiming,
    /// Sequences the last scrape found running, and waiting, beyond the gateway's own leases
    /// (other clients of the same server).
    pub(crate) external_running: f64,
    pub(crate) external_waiting: f64,
    /// The previous scrape's time-per-output-token sum and count, for the rate between scrapes.
    pub(crate) tpot_scraped: Option<(f64, f64)>,
    /// Sibling coordinator shards' load on the backend, with their backlog as of `remote_at_ms`
    /// (zero with one shard).
    pub(crate) remote: ShardLoad,
    pub(crate) remote_at_ms: u64,
    /// This shard's own in-flight leases when it last reported (see [`BackendEntry::all_in_flight`]).
    pub(crate) reported: InFlight,
    /// Prompt blocks the live leases hold here.
    pub(crate) held: HeldBlocks,
}

impl BackendEntry {
    fn serves(&self, model: &str) -> bool {
        match &self.probed_models {
            Some(models) if !models.is_empty() => models.iter().any(|m| m == model),
            _ => self.spec.models.iter().any(|m| m == model),
        }
    }

    pub(crate) fn capacity(&self) -> Capacity {
        let mut c = self.spec.capacity;
        if let Some(blocks) = self.scraped.kv_blocks.filter(|&b| b > 0) {
            c.kv_blocks = blocks;
        }
        if let Some(size) = self.scraped.block_size.filter(|&s| s > 0) {
            c.block_size = size;
        }
        c
    }

    /// What is in flight on the backend: this coordinator's leases and its sibling shards'.
    ///
    /// Siblings count as of their last report, plus what they probably placed since: each of this
    /// shard's own placements since its last report is assumed to have `echo` twins among its
    /// siblings (`echo` = (shards - 1) × [`SIBLING_ECHO`]). See [`crate::shard`].
    pub(crate) fn all_in_flight(&self, echo: f64) -> InFlight {
        let mut all = self.in_flight;
        let remote = self.remote.in_flight();
        let grown = |now: u64, then: u64| (now.saturating_sub(then) as f64 * echo) as u64;
        all.leases = all
            .leases
            .saturating_add(remote.leases)
            .saturating_add(grown(
                u64::from(self.in_flight.leases),
                u64::from(self.reported.leases),
            ) as u32);
        all.prompt_tokens = all
            .prompt_tokens
            .saturating_add(remote.prompt_tokens)
            .saturating_add(grown(
                self.in_flight.prompt_tokens,
                self.reported.prompt_tokens,
            ));
        all.output_tokens = all
            .output_tokens
            .saturating_add(remote.output_tokens)
            .saturating_add(grown(
                self.in_flight.output_tokens,
                self.reported.output_tokens,
            ));
        all
    }

    /// Sibling shards' prefill backlog on the backend, drained to `now_ms`.
    fn remote_backlog_ms(&self, now_ms: u64) -> f64 {
        (self.remote.backlog_ms - now_ms.saturating_sub(self.remote_at_ms) as f64).max(0.0)
    }

    pub(crate) fn load(&self, queue_weight: f64, echo: f64) -> f64 {
        let c = self.capacity();
        backend_load(
            &self.all_in_flight(echo),
            c.capacity_tokens(),
            self.scraped.waiting.unwrap_or(0.0),
            c.max_num_seqs,
            queue_weight,
        )
    }

    /// Sequences decoding (or about to) on the backend: its leases plus other clients' running ones.
    fn running(&self, echo: f64) -> f64 {
        f64::from(self.all_in_flight(echo).leases) + self.external_running
    }

    fn available(&self, now_ms: u64, breaker: &BreakerConfig) -> bool {
        self.lifecycle == Lifecycle::Ready
            && self.health.is_serving()
            && self.breaker.would_admit(now_ms, breaker)
            && !self.breaker.is_saturated(now_ms)
    }

    fn retry_after_ms(&self, now_ms: u64, breaker: &BreakerConfig) -> u64 {
        if self.lifecycle == Lifecycle::Ready && self.health.is_serving() {
            self.breaker
                .retry_after_ms(now_ms, breaker)
                .unwrap_or(DEFAULT_RETRY_AFTER_S * 1000)
        } else {
            DEFAULT_RETRY_AFTER_S * 1000
        }
    }

    fn candidate_view(&self) -> CandidateView {
        CandidateView {
            id: self.spec.id.clone(),
            url: self.spec.url.clone(),
            api_key: self.spec.api_key.clone(),
            role: self.spec.role,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Slot {
    generation: u32,
    entry: Option<BackendEntry>,
}

/// Reusable buffers for [`Pool::acquire`], so a decision allocates little.
#[derive(Debug, Default)]
struct Scratch {
    lengths: Vec<u32>,
    primary: Vec<Candidate>,
    decode: Vec<Candidate>,
    mixed: Vec<Candidate>,
    slot_index: Vec<u32>,
    order: Vec<usize>,
    decode_order: Vec<usize>,
}

/// One pool of backends and its routing state.
pub struct Pool {
    name: String,
    config: PoolConfig,
    policy: Box<dyn RoutingPolicy>,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    index: HashMap<BackendId, u32>,
    leases: LeaseTable,
    affinity: PrefixAffinity,
    pub(crate) stats: PoolStats,
    scratch: Scratch,
    /// Real over requested output length, learned from usage.
    output_ratio: OutputRatio,
    /// Mean uncached prompt tokens per granted request (prices scraped waiting requests).
    mean_uncached_tokens: f64,
    /// The latest time the pool was told (views show the prefill backlog as of then).
    now_hint_ms: u64,
    /// Slots where a lease share ended since [`Pool::take_freed`] (admission control only).
    freed: Vec<u32>,
    /// This coordinator's shard index, and its siblings' load reports when the pool has several.
    shard: u32,
    shards: u32,
    siblings: Option<SiblingLoads>,
    /// When the siblings' load was last summed into the entries.
    siblings_summed_ms: u64,
    /// Each live lease's prompt blocks and the backend holding them.
    lease_blocks: HashMap<LeaseId, (BackendKey, Vec<u64>)>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.name)
            .field("policy", &self.config.policy)
            .field("backends", &self.index.len())
            .field("leases", &self.leases.len())
            .field("affinity_entries", &self.affinity.len())
            .finish()
    }
}

impl Pool {
    /// An empty pool. The configuration is used as given; validate untrusted input with
    /// [`PoolConfig::validate`] first ([`Pool::set_config`] does). Out-of-range values never make
    /// the pool panic; they are clamped where they would.
    pub fn new(name: &str, config: PoolConfig) -> Pool {
        let policy = policy::build(
            config.policy,
            &config.consistent_hash,
            &config.cache_aware,
            &config.predicted_latency,
        );
        let affinity = PrefixAffinity::new(config.affinity_max_entries);
        Pool {
            name: name.to_string(),
            config,
            policy,
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: HashMap::new(),
            leases: LeaseTable::new(),
            affinity,
            stats: PoolStats::default(),
            scratch: Scratch::default(),
            output_ratio: OutputRatio::default(),
            mean_uncached_tokens: 0.0,
            now_hint_ms: 0,
            freed: Vec::new(),
            shard: 0,
            shards: 1,
            siblings: None,
            siblings_summed_ms: 0,
            lease_blocks: HashMap::new(),
        }
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The configuration in effect.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Validates and applies a new configuration. A new policy starts fresh (its ring rebuilt);
    /// live leases keep their deadlines; a smaller affinity bound evicts at once.
    pub fn set_config(&mut self, config: PoolConfig) -> Result<(), ConfigError> {
        config.validate()?;
        let block_tokens_changed = config.block_tokens != self.config.block_tokens;
        self.config = config;
        self.policy = policy::build(
            self.config.policy,
            &self.config.consistent_hash,
            &self.config.cache_aware,
            &self.config.predicted_latency,
        );
        self.members_changed();
        self.affinity
            .set_max_entries(self.config.affinity_max_entries);
        if block_tokens_changed {
            for slot in 0..self.slots.len() {
                self.sync_affinity_capacity(slot as u32);
            }
        }
        Ok(())
    }

    /// Registers a backend, `pending` until its first successful probe.
    pub fn add_backend(&mut self, spec: BackendSpec, now_ms: u64) -> Result<BackendId, PoolError> {
        spec.validate()
            .map_err(|reason| PoolError::InvalidSpec { reason })?;
        if self.index.contains_key(&spec.id) {
            return Err(PoolError::DuplicateBackend { id: spec.id });
        }
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot::default());
                (self.slots.len() - 1) as u32
            }
        };
        let id = spec.id.clone();
        let s = &mut self.slots[slot as usize];
        s.entry = Some(BackendEntry {
            key: BackendKey {
                slot,
                generation: s.generation,
            },
            spec,
            lifecycle: Lifecycle::Pending,
            health: Health::default(),
            breaker: CircuitBreaker::new(),
            in_flight: InFlight::default(),
            probed_models: None,
            scraped: ScrapedGauges::default(),
            added_ms: now_ms,
            stats: BackendStats::default(),
            timing: BackendTiming::default(),
            external_running: 0.0,
            external_waiting: 0.0,
            tpot_scraped: None,
            remote: ShardLoad::default(),
            remote_at_ms: 0,
            reported: InFlight::default(),
            held: HeldBlocks::default(),
        });
        self.index.insert(id.clone(), slot);
        self.sync_affinity_capacity(slot);
        self.members_changed();
        Ok(id)
    }

    /// Removes a backend: it leaves the ring at once and its affinity entries are purged. Its
    /// live leases stay in the lease table until released or expired, and then touch nothing.
    pub fn remove_backend(
        &mut self,
        id: &BackendId,
        _now_ms: u64,
    ) -> Result<BackendSpec, PoolError> {
        let slot = self.slot_of(id)?;
        self.index.remove(id);
        let s = &mut self.slots[slot as usize];
        let entry = s.entry.take();
        s.generation = s.generation.wrapping_add(1);
        self.free_slots.push(slot);
        self.affinity.remove_backend(slot);
        self.members_changed();
        entry
            .map(|e| e.spec)
            .ok_or_else(|| PoolError::UnknownBackend { id: id.clone() })
    }

    /// Applies a partial update to a backend's spec.
    pub fn update_backend(
        &mut self,
        id: &BackendId,
        patch: &BackendPatch,
        _now_ms: u64,
    ) -> Result<BackendView, PoolError> {
        let slot = self.slot_of(id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(id))?;
        let next = patch
            .apply(&entry.spec)
            .map_err(|reason| PoolError::InvalidSpec { reason })?;
        let weight_changed = next.weight != entry.spec.weight;
        entry.spec = next;
        self.sync_affinity_capacity(slot);
        if weight_changed {
            self.members_changed();
        }
        self.view(slot).ok_or_else(|| unknown(id))
    }

    /// Drains or undrains a backend.
    ///
    /// `draining` is allowed from pending or ready (a backend without leases goes straight to
    /// `drained`); `ready` is allowed from draining or drained and gives `pending` if the backend
    /// is not healthy; setting the current state is a no-op. Everything else is refused:
    /// `pending -> ready` only happens on a successful probe, `drained` only when the last lease
    /// ends.
    pub fn set_lifecycle(
        &mut self,
        id: &BackendId,
        to: Lifecycle,
        _now_ms: u64,
    ) -> Result<Lifecycle, PoolError> {
        let slot = self.slot_of(id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(id))?;
        let from = entry.lifecycle;
        let next = match (from, to) {
            _ if from == to => from,
            (Lifecycle::Pending | Lifecycle::Ready, Lifecycle::Draining) => {
                if entry.in_flight.leases == 0 {
                    Lifecycle::Drained
                } else {
                    Lifecycle::Draining
                }
            }
            (Lifecycle::Drained, Lifecycle::Draining) => Lifecycle::Drained,
            (Lifecycle::Draining | Lifecycle::Drained, Lifecycle::Ready) => {
                if entry.health.is_serving() {
                    Lifecycle::Ready
                } else {
                    Lifecycle::Pending
                }
            }
            _ => return Err(PoolError::InvalidTransition { from, to }),
        };
        entry.lifecycle = next;
        Ok(next)
    }

    /// Applies one probe result: health transitions, `pending -> ready` on the first success,
    /// served models and scraped gauges.
    pub fn record_probe(
        &mut self,
        id: &BackendId,
        probe: &ProbeResult,
        now_ms: u64,
    ) -> Result<Option<HealthTransition>, PoolError> {
        let slot = self.slot_of(id)?;
        let health_config = self.config.health;
        let time_model = self.config.time_model;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(id))?;
        let verdict = if probe.loading {
            ProbeVerdict::Loading
        } else if probe.ok {
            ProbeVerdict::Up
        } else {
            ProbeVerdict::Down
        };
        let transition = entry.health.record(verdict, &health_config, now_ms);
        if entry.lifecycle == Lifecycle::Pending && entry.health.is_serving() {
            entry.lifecycle = Lifecycle::Ready;
        }
        if probe.ok {
            if let Some(models) = &probe.models {
                let models: Vec<String> =
                    models.iter().filter(|m| !m.is_empty()).cloned().collect();
                entry.probed_models = Some(models);
            }
        }
        let finite = |x: Option<f64>| x.filter(|v| v.is_finite() && *v >= 0.0);
        let scraped = &mut entry.scraped;
        scraped.waiting = finite(probe.waiting).or(scraped.waiting);
        scraped.running = finite(probe.running).or(scraped.running);
        scraped.kv_usage = finite(probe.kv_usage).or(scraped.kv_usage);
        // What the server runs beyond the gateway's own leases is someone else's traffic.
        if probe.running.is_some() || probe.waiting.is_some() {
            let (running, waiting) = (
                scraped.running.unwrap_or(0.0),
                scraped.waiting.unwrap_or(0.0),
            );
            let ours = f64::from(entry.in_flight.leases) + f64::from(entry.remote.leases);
            let external = (running + waiting - ours).max(0.0);
            entry.external_waiting = external.min(waiting);
            entry.external_running = external - entry.external_waiting;
        }
        // vLLM's own measure of its decode speed since the last scrape, at its current batch.
        if let (Some(sum), Some(count)) = (probe.tpot_seconds_sum, probe.tpot_count) {
            if let Some((last_sum, last_count)) = entry.tpot_scraped {
                let tokens = count - last_count;
                if tokens >= MIN_SCRAPED_TOKENS && sum >= last_sum {
                    let tpot_ms = (sum - last_sum) / tokens * 1000.0;
                    let running = scraped.running.unwrap_or(1.0);
                    entry.timing.learn_tpot(&time_model, tpot_ms, running);
                }
            }
            entry.tpot_scraped = Some((sum, count));
        }
        let before = (scraped.kv_blocks, scraped.block_size);
        scraped.kv_blocks = probe.kv_blocks.filter(|&b| b > 0).or(scraped.kv_blocks);
        scraped.block_size = probe.block_size.filter(|&b| b > 0).or(scraped.block_size);
        if (scraped.kv_blocks, scraped.block_size) != before {
            self.sync_affinity_capacity(slot);
        }
        Ok(transition)
    }

    /// Chooses backends for a request and grants a lease on the first.
    ///
    /// Also expires overdue leases first, so their load does not distort the decision. Open
    /// breakers whose cooldown has passed admit their half-open trials here. With admission
    /// control on, backends at capacity are skipped (overcommitted as configured for an empty
    /// queue); see [`Pool::acquire_within`].
    pub fn acquire(
        &mut self,
        features: &RequestFeatures,
        now_ms: u64,
        rng: &mut dyn RandomSource,
    ) -> Result<Grant, AcquireError> {
        let admission = self.config.admission;
        let headroom = admission.enabled.then_some(admission.overcommit);
        self.acquire_within(features, now_ms, rng, headroom)
    }

    /// [`Pool::acquire`] with an explicit capacity rule: `headroom` `None` ignores capacity;
    /// `Some(h)` skips backends without room `h` over capacity ([`has_room`]), and when that
    /// leaves none, answers [`AcquireError::AtCapacity`].
    pub fn acquire_within(
        &mut self,
        features: &RequestFeatures,
        now_ms: u64,
        rng: &mut dyn RandomSource,
        headroom: Option<f64>,
    ) -> Result<Grant, AcquireError> {
        self.now_hint_ms = self.now_hint_ms.max(now_ms);
        self.expire_leases(now_ms);
        self.refresh_siblings(now_ms);
        let echo = self.echo();
        let block_tokens = if features.block_tokens > 0 {
            features.block_tokens as usize
        } else {
            self.config.block_tokens()
        };
        let pair_policy =
            self.config.policy == PolicyKind::Disaggregated && features.role_hint.is_none();
        let output_tokens = features.max_tokens;
        let queue_weight = self.config.queue_weight;
        let breaker_config = self.config.breaker;
        let time_model = self.config.time_model;
        let expected_output = self.output_ratio.expected(output_tokens);
        let mean_uncached = self.mean_uncached_tokens;

        let scratch = &mut self.scratch;
        self.affinity
            .match_lengths(&features.block_hashes, &mut scratch.lengths);
        scratch.primary.clear();
        scratch.decode.clear();
        scratch.mixed.clear();
        let mut model_known = false;
        let mut at_capacity = false;
        let mut retry_ms: Option<u64> = None;
        // The backend with the longest match most likely served this conversation's previous
        // turn, so it also holds that turn's answer, which the gateway never sees: credit it with
        // an answer's worth of cached tokens.
        let longest = scratch.lengths.iter().copied().max().unwrap_or(0);
        let answer_credit = expected_output as u64;
        for (slot, s) in self.slots.iter().enumerate() {
            let Some(entry) = &s.entry else { continue };
            if !entry.serves(&features.model) {
                continue;
            }
            model_known = true;
            let role = entry.spec.role;
            let wanted = match features.role_hint {
                Some(hint) => role == hint,
                None => pair_policy || role == Role::Mixed,
            };
            if !wanted {
                continue;
            }
            if !entry.available(now_ms, &breaker_config) {
                let wait = entry.retry_after_ms(now_ms, &breaker_config);
                retry_ms = Some(retry_ms.map_or(wait, |r| r.min(wait)));
                continue;
            }
            let backend_capacity = entry.capacity();
            let capacity = backend_capacity.capacity_tokens();
            let cached_blocks = scratch.lengths.get(slot).copied().unwrap_or(0);
            let cached_tokens = (u64::from(cached_blocks) * block_tokens as u64)
                .min(u64::from(features.prompt_tokens));
            let mut uncached = u64::from(features.prompt_tokens) - cached_tokens;
            if cached_blocks > 0 && cached_blocks == longest {
                uncached = uncached.saturating_sub(answer_credit).max(1);
            }
            if let Some(headroom) = headroom {
                let tokens = uncached + u64::from(output_tokens);
                if !has_room(
                    &entry.all_in_flight(echo),
                    &backend_capacity,
                    tokens,
                    headroom,
                ) {
                    at_capacity = true;
                    continue;
                }
            }
            let external_queue_ms = if entry.external_waiting > 0.0 {
                entry.external_waiting
                    * mean_uncached
                    * entry.timing.prefill_ms_per_token(&time_model)
            } else {
                0.0
            } + entry.remote_backlog_ms(now_ms);
            let mut predicted = entry.timing.predict(
                &time_model,
                if role == Role::Decode { 0 } else { uncached },
                expected_output,
                entry.running(echo),
                external_queue_ms,
                now_ms,
            );
            let in_flight = &entry.all_in_flight(echo);
            // The gateway's count misses prefixes that running requests share (only the first,
            // cold request counted them); vLLM's own usage at the last probe sees every pinned
            // block.
            let scraped_tokens = entry
                .scraped
                .kv_usage
                .map_or(0, |u| (u.clamp(0.0, 1.0) * capacity as f64) as u64);
            // Prompt memory: the distinct blocks this coordinator's leases hold, or their
            // uncached tokens (with the siblings'), whichever is more.
            let held_tokens = entry.held.distinct() as u64 * block_tokens as u64;
            let prompt_memory = held_tokens
                .saturating_add(entry.remote.prompt_tokens)
                .max(in_flight.prompt_tokens);
            let room_wait = room_wait_ms(
                (prompt_memory + (in_flight.output_tokens as f64 * self.output_ratio.get()) as u64)
                    .max(scraped_tokens),
                // Memory for the prompt is needed wherever it is cached, except for the blocks
                // running requests hold already.
                (u64::from(features.prompt_tokens).saturating_sub(
                    entry
                        .held
                        .held_prefix(&features.block_hashes, cached_blocks as usize)
                        as u64
                        * block_tokens as u64,
                )) + expected_output as u64,
                capacity,
                in_flight.leases,
                backend_capacity.max_num_seqs,
                predicted.decode_ms,
                (
                    entry.scraped.waiting.unwrap_or(0.0),
                    entry.scraped.running.unwrap_or(0.0),
                ),
            );
            predicted.ttft_ms += room_wait;
            let candidate = Candidate {
                slot: slot as u32,
                weight: entry.spec.weight,
                leases: in_flight.leases,
                load: entry.load(queue_weight, echo),
                request_load: (u64::from(features.prompt_tokens) + u64::from(output_tokens)) as f64
                    / capacity.max(1) as f64,
                benefit: cache_benefit(cached_tokens, capacity),
                cached_blocks,
                ttft_ms: predicted.ttft_ms,
                decode_ms: predicted.decode_ms,
                harm_ms: predicted.harm_ms,
                wait_ms: room_wait + external_queue_ms,
            };
            let list = match (pair_policy, role) {
                (true, Role::Prefill) => &mut scratch.primary,
                (true, Role::Decode) => &mut scratch.decode,
                (true, Role::Mixed) => &mut scratch.mixed,
                (false, _) => &mut scratch.primary,
            };
            list.push(candidate);
        }
        let paired = pair_policy && !scratch.primary.is_empty() && !scratch.decode.is_empty();
        if pair_policy && !paired {
            std::mem::swap(&mut scratch.primary, &mut scratch.mixed);
            scratch.decode.clear();
        }
        if scratch.primary.is_empty() && at_capacity {
            return Err(AcquireError::AtCapacity);
        }
        if scratch.primary.is_empty() {
            let err = if model_known {
                AcquireError::NoBackendAvailable {
                    retry_after_s: retry_ms
                        .map_or(DEFAULT_RETRY_AFTER_S, |ms| ms.div_ceil(1000))
                        .clamp(1, 3600),
                }
            } else {
                AcquireError::ModelNotFound {
                    model: features.model.clone(),
                }
            };
            self.stats.acquire_errors
                [matches!(err, AcquireError::NoBackendAvailable { .. }) as usize] += 1;
            return Err(err);
        }

        let limit = self.config.limit();
        scratch.slot_index.clear();
        scratch.slot_index.resize(self.slots.len(), NO_CANDIDATE);
        for (i, c) in scratch.primary.iter().enumerate() {
            scratch.slot_index[c.slot as usize] = i as u32;
        }
        let key_hash = features.routing_key.as_deref().map(key_hash);
        let input = DecisionInput {
            candidates: &scratch.primary,
            slot_index: &scratch.slot_index,
            key_hash,
            limit,
        };
        let decision = self.policy.rank(&input, rng, &mut scratch.order);
        if scratch.order.is_empty() {
            scratch.order.push(0);
        }
        scratch.decode_order.clear();
        if paired {
            scratch.slot_index.fill(NO_CANDIDATE);
            for (i, c) in scratch.decode.iter().enumerate() {
                scratch.slot_index[c.slot as usize] = i as u32;
            }
            let decode_input = DecisionInput {
                candidates: &scratch.decode,
                slot_index: &scratch.slot_index,
                key_hash,
                limit,
            };
            self.policy
                .rank_decode(&decode_input, rng, &mut scratch.decode_order);
            if scratch.decode_order.is_empty() {
                scratch.decode_order.push(0);
            }
        }

        let chosen = scratch.primary[scratch.order[0]];
        let cached_tokens = (u64::from(chosen.cached_blocks) * block_tokens as u64)
            .min(u64::from(features.prompt_tokens));
        let uncached = u64::from(features.prompt_tokens) - cached_tokens;
        self.mean_uncached_tokens += (uncached as f64 - self.mean_uncached_tokens) * 0.05;
        let primary_output = if paired { 1 } else { u64::from(output_tokens) };
        let decode_slot = paired.then(|| scratch.decode[scratch.decode_order[0]].slot);
        let no_backend = AcquireError::NoBackendAvailable {
            retry_after_s: DEFAULT_RETRY_AFTER_S,
        };
        let Some(mut primary) = self.admit(chosen.slot, uncached, primary_output, now_ms) else {
            return Err(no_backend);
        };
        primary.predicted.add_wait(chosen.wait_ms);
        let decode = match decode_slot {
            Some(slot) => {
                let prompt = u64::from(features.prompt_tokens);
                match self.admit(slot, prompt, u64::from(output_tokens), now_ms) {
                    Some(share) => Some(share),
                    None => {
                        self.unshare(&primary, OutcomeKind::Cancelled, 0, now_ms);
                        return Err(no_backend);
                    }
                }
            }
            None => None,
        };

        let lease_id = loop {
            let id = rng.next_u64() & MAX_LEASE_ID;
            if id != 0 && !self.leases.contains(id) {
                break id;
            }
        };
        let deadline_ms = now_ms.saturating_add(self.config.lease_ttl_ms);
        let lease = Lease {
            id: lease_id,
            request_id: features.request_id.clone(),
            prompt_tokens: features.prompt_tokens,
            max_tokens: features.max_tokens,
            stream: features.stream,
            primary,
            decode,
            acquired_ms: now_ms,
            deadline_ms,
        };
        // The id was checked to be free just above.
        let _ = self.leases.insert(lease);

        let views = |list: &[Candidate], order: &[usize], slots: &[Slot]| -> Vec<CandidateView> {
            order
                .iter()
                .filter_map(|&i| list.get(i))
                .filter_map(|c| slots[c.slot as usize].entry.as_ref())
                .map(BackendEntry::candidate_view)
                .collect()
        };
        let scratch = &self.scratch;
        let candidates = views(&scratch.primary, &scratch.order, &self.slots);
        let decode_candidates = views(&scratch.decode, &scratch.decode_order, &self.slots);
        self.affinity.record(chosen.slot, &features.block_hashes);
        self.hold_blocks(lease_id, chosen.slot, features.block_hashes.clone());
        self.stats.record_decision(self.config.policy, decision);
        self.stats.prompt_blocks += features.block_hashes.len() as u64;
        self.stats.cached_blocks += u64::from(chosen.cached_blocks);
        Ok(Grant {
            lease_id,
            backend: candidates.first().map(|c| c.id.clone()).unwrap_or_default(),
            candidates,
            decode_candidates,
            policy: self.config.policy,
            decision: Some(decision),
            cached_blocks: chosen.cached_blocks,
            deadline_ms,
        })
    }

    /// Counts a new lease share on `slot`, through its breaker.
    /// Returns `None` if the slot is empty or its breaker refuses (callers checked both before).
    fn admit(
        &mut self,
        slot: u32,
        prompt_tokens: u64,
        output_tokens: u64,
        now_ms: u64,
    ) -> Option<LeaseShare> {
        let breaker_config = self.config.breaker;
        let time_model = self.config.time_model;
        let echo = self.echo();
        let entry = self.entry_mut(slot)?;
        let trial = entry.breaker.admit(now_ms, &breaker_config)? == Admission::Trial;
        // A decode server pulls the prompt's KV cache instead of computing it.
        let prefill = if entry.spec.role == Role::Decode {
            0
        } else {
            prompt_tokens
        };
        let predicted = entry
            .timing
            .admit(&time_model, prefill, entry.running(echo), now_ms);
        entry.in_flight.add(prompt_tokens, output_tokens);
        entry.stats.requests += 1;
        Some(LeaseShare {
            backend: entry.key,
            prompt_tokens,
            output_tokens,
            trial,
            predicted,
        })
    }

    /// Makes this pool one of `shards` coordinator shards (index `me`), whose siblings report their
    /// load every `exchange_ms`; one shard (the default) is the exact single coordinator.
    pub fn set_shard(&mut self, me: u32, shards: u32, exchange_ms: u64) {
        self.shard = me;
        self.shards = shards.max(1);
        self.siblings = (shards > 1).then(|| SiblingLoads::new(me, exchange_ms));
        for s in self.slots.iter_mut() {
            if let Some(e) = s.entry.as_mut() {
                e.remote = ShardLoad::default();
            }
        }
    }

    /// This shard's load on every busy backend, for its siblings.
    pub fn load_report(&mut self, now_ms: u64) -> LoadReport {
        for s in self.slots.iter_mut() {
            if let Some(e) = s.entry.as_mut() {
                e.reported = e.in_flight;
            }
        }
        LoadReport::new(
            self.shard,
            now_ms,
            self.entries().map(|e| {
                let f = e.in_flight;
                let load = ShardLoad {
                    leases: f.leases,
                    prompt_tokens: f.prompt_tokens,
                    output_tokens: f.output_tokens,
                    backlog_ms: e.timing.backlog_ms(now_ms),
                };
                (e.spec.id.clone(), load)
            }),
        )
    }

    /// Takes a sibling shard's load report into account from now on. Returns false if it was
    /// ignored (one shard, this shard's own report, or older than the one held).
    pub fn accept_load_report(&mut self, report: LoadReport, now_ms: u64) -> bool {
        let Some(siblings) = self.siblings.as_mut() else {
            return false;
        };
        let accepted = siblings.accept(report);
        if accepted {
            self.sum_siblings(now_ms);
        }
        accepted
    }

    /// Twins each own placement since the last report is assumed to have among the siblings.
    fn echo(&self) -> f64 {
        f64::from(self.shards - 1) * SIBLING_ECHO
    }

    /// Re-sums the siblings' load once per exchange interval, so stale reports stop counting.
    fn refresh_siblings(&mut self, now_ms: u64) {
        let interval = self.siblings.as_ref().map(SiblingLoads::exchange_ms);
        if interval.is_some_and(|ms| now_ms >= self.siblings_summed_ms + ms) {
            self.sum_siblings(now_ms);
        }
    }

    fn sum_siblings(&mut self, now_ms: u64) {
        let Some(siblings) = self.siblings.as_ref() else {
            return;
        };
        for s in self.slots.iter_mut() {
            if let Some(e) = s.entry.as_mut() {
                e.remote = ShardLoad::default();
                e.remote_at_ms = now_ms;
            }
        }
        let (slots, index) = (&mut self.slots, &self.index);
        siblings.for_each_total(now_ms, |id, load| {
            if let Some(e) = index
                .get(id)
                .and_then(|&i| slots[i as usize].entry.as_mut())
            {
                e.remote = load;
            }
        });
        self.siblings_summed_ms = now_ms;
    }

    /// Moves a lease to another backend after its backend failed before the first byte (the
    /// Worker's retry on the next candidate). The failure is recorded on the old backend's
    /// breaker; the counters move with the lease; the new backend is admitted through its
    /// breaker. If the new backend cannot take it, nothing changes and
    /// [`PoolError::BackendUnavailable`] is returned (the Worker may try the next candidate).
    /// The one exception is a retry on the same backend whose recorded failure opens its
    /// breaker: the failure stands, the lease ends, and `BackendUnavailable` is returned.
    pub fn reassign(
        &mut self,
        lease_id: LeaseId,
        to: &BackendId,
        failure: &Outcome,
        now_ms: u64,
    ) -> Result<CandidateView, PoolError> {
        let lease = self
            .leases
            .get(lease_id)
            .ok_or(PoolError::UnknownLease { lease_id })?;
        let (acquired_ms, prompt_tokens, output) = (
            lease.acquired_ms,
            u64::from(lease.prompt_tokens),
            if lease.decode.is_some() {
                1
            } else {
                u64::from(lease.max_tokens)
            },
        );
        let old = lease.primary;
        let slot = self.slot_of(to)?;
        let breaker_config = self.config.breaker;
        let target = self.entry_mut(slot).ok_or_else(|| unknown(to))?;
        if !target.available(now_ms, &breaker_config) {
            return Err(PoolError::BackendUnavailable { id: to.clone() });
        }
        let blocks = self.lease_blocks.get(&lease_id).map(|(_, b)| b.clone());
        self.settle(&old, failure, lease_id, acquired_ms, now_ms);
        let share = self.admit(slot, prompt_tokens, output, now_ms);
        if let (Some(_), Some(blocks)) = (&share, blocks) {
            self.hold_blocks(lease_id, slot, blocks);
        }
        let Some(share) = share else {
            // Retrying on the backend that just failed can open its breaker: the lease has
            // nowhere to go, so it ends here (its decode share too) rather than leak.
            if let Some(lease) = self.leases.remove(lease_id) {
                if let Some(decode) = &lease.decode {
                    self.unshare(decode, OutcomeKind::Cancelled, lease_id, now_ms);
                }
            }
            return Err(PoolError::BackendUnavailable { id: to.clone() });
        };
        let view = self
            .entry(slot)
            .map(BackendEntry::candidate_view)
            .unwrap_or_default();
        if let Some(lease) = self.leases.get_mut(lease_id) {
            lease.primary = share;
        }
        Ok(view)
    }

    /// Ends a lease with its outcome. Returns `false` (and changes nothing) if the lease is not
    /// live: already released, expired, or unknown, so a double release is harmless.
    ///
    /// The outcome feeds the breaker of the lease's backend (both backends of a pair) and the
    /// statistics; 4xx, cancellations and 429s never count as failures.
    pub fn release(&mut self, lease_id: LeaseId, outcome: &Outcome, now_ms: u64) -> bool {
        let Some(lease) = self.leases.remove(lease_id) else {
            self.stats.unknown_releases += 1;
            return false;
        };
        if outcome.kind.is_success() && lease.decode.is_none() {
            self.learn(&lease, outcome, now_ms);
        }
        self.settle(&lease.primary, outcome, lease_id, lease.acquired_ms, now_ms);
        if let Some(decode) = &lease.decode {
            self.settle(decode, outcome, lease_id, lease.acquired_ms, now_ms);
        }
        true
    }

    /// Ends the prefill stage of a disaggregated lease: the prefill share is settled with the
    /// prefill's own `outcome` (so only its failures count against the prefill backend) and taken
    /// off the counters at once; the lease goes on with its decode share alone, which the final
    /// release settles. Returns `false` (and changes nothing) if the lease is not live or has no
    /// decode share.
    pub fn finish_prefill(&mut self, lease_id: LeaseId, outcome: &Outcome, now_ms: u64) -> bool {
        let Some(lease) = self.leases.get(lease_id) else {
            return false;
        };
        let Some(decode) = lease.decode else {
            return false;
        };
        let (prefill, acquired_ms) = (lease.primary, lease.acquired_ms);
        self.settle(&prefill, outcome, lease_id, acquired_ms, now_ms);
        if let Some(lease) = self.leases.get_mut(lease_id) {
            lease.primary = decode;
            lease.decode = None;
        }
        true
    }

    /// Extends a live lease's deadline to `lease_ttl_ms` from now (the Worker's heartbeat while
    /// its request runs). Returns the new deadline, or [`PoolError::UnknownLease`].
    pub fn renew(&mut self, lease_id: LeaseId, now_ms: u64) -> Result<u64, PoolError> {
        let deadline_ms = now_ms.saturating_add(self.config.lease_ttl_ms);
        if self.leases.set_deadline(lease_id, deadline_ms) {
            Ok(deadline_ms)
        } else {
            Err(PoolError::UnknownLease { lease_id })
        }
    }

    /// Counts a request again whose lease the pool lost (it expired while the request still
    /// ran, or the Durable Object restarted): a lease with the same id on the backend the Worker
    /// says serves it, counted in full (its cache hits are unknown) and not gated by the breaker
    /// (the request is already running there). A live lease is just renewed. Returns the deadline.
    pub fn readmit(
        &mut self,
        lease_id: LeaseId,
        terms: &LeaseTerms,
        now_ms: u64,
    ) -> Result<u64, PoolError> {
        if let Ok(deadline_ms) = self.renew(lease_id, now_ms) {
            return Ok(deadline_ms);
        }
        if lease_id == 0 || lease_id > MAX_LEASE_ID {
            return Err(PoolError::UnknownLease { lease_id });
        }
        let slot = self.slot_of(&terms.backend)?;
        let entry = self
            .entry_mut(slot)
            .ok_or_else(|| unknown(&terms.backend))?;
        let (prompt_tokens, output_tokens) =
            (u64::from(terms.prompt_tokens), u64::from(terms.max_tokens));
        entry.in_flight.add(prompt_tokens, output_tokens);
        let primary = LeaseShare {
            backend: entry.key,
            prompt_tokens,
            output_tokens,
            trial: false,
            // Nothing was predicted for it: it teaches the time model nothing.
            predicted: SharePrediction::default(),
        };
        let deadline_ms = now_ms.saturating_add(self.config.lease_ttl_ms);
        let lease = Lease {
            id: lease_id,
            request_id: terms.request_id.clone(),
            prompt_tokens: terms.prompt_tokens,
            max_tokens: terms.max_tokens,
            stream: terms.stream,
            primary,
            decode: None,
            acquired_ms: now_ms,
            deadline_ms,
        };
        // `renew` failed just above, so the id is free.
        let _ = self.leases.insert(lease);
        Ok(deadline_ms)
    }

    /// Records that backend `id` now holds a request's prompt prefix: after a retry, the backend
    /// that served the request, not the one first chosen, is where the next turn should go.
    pub fn record_prefix(&mut self, id: &BackendId, block_hashes: &[u64]) -> Result<(), PoolError> {
        let slot = self.slot_of(id)?;
        self.affinity.record(slot, block_hashes);
        Ok(())
    }

    /// Backend `id` answered that it does not serve `model` (404: the model was unloaded): stop
    /// routing the model there until its next probe reports its models again. A backend whose
    /// only model it was keeps its list (an empty list means "as registered"); the caller should
    /// probe it soon. Returns whether the model was removed.
    pub fn forget_model(&mut self, id: &BackendId, model: &str) -> Result<bool, PoolError> {
        let slot = self.slot_of(id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(id))?;
        let mut served = match &entry.probed_models {
            Some(m) if !m.is_empty() => m.clone(),
            _ => entry.spec.models.clone(),
        };
        let before = served.len();
        served.retain(|m| m != model);
        if served.len() == before || served.is_empty() {
            return Ok(false);
        }
        entry.probed_models = Some(served);
        Ok(true)
    }

    /// Teaches the time model what a successful request measured: its backend's rates, and the
    /// pool's ratio of real to requested output.
    fn learn(&mut self, lease: &Lease, outcome: &Outcome, now_ms: u64) {
        let seen = Observation {
            ttfb_ms: outcome.ttfb_ms,
            duration_ms: now_ms.saturating_sub(lease.acquired_ms),
            completion_tokens: outcome.completion_tokens,
            streamed: lease.stream,
        };
        if let Some(tokens) = outcome.completion_tokens {
            self.output_ratio.observe(tokens, lease.max_tokens);
        }
        let time_model = self.config.time_model;
        if let Some(entry) = self.entry_for_key_mut(lease.primary.backend) {
            entry
                .timing
                .learn(&time_model, &lease.primary.predicted, &seen);
        }
    }

    /// Ends every lease past its deadline, as if cancelled (nobody is blamed), and moves open
    /// breakers whose cooldown has passed to half-open. Returns how many leases expired.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        self.now_hint_ms = self.now_hint_ms.max(now_ms);
        for s in &mut self.slots {
            if let Some(e) = &mut s.entry {
                e.breaker.refresh(now_ms);
            }
        }
        self.expire_leases(now_ms)
    }

    /// Ends every lease past its deadline; see [`Pool::expire`].
    fn expire_leases(&mut self, now_ms: u64) -> usize {
        if self.leases.next_deadline().is_none_or(|d| d > now_ms) {
            return 0;
        }
        let expired = self.leases.take_expired(now_ms);
        for lease in &expired {
            for share in std::iter::once(&lease.primary).chain(lease.decode.as_ref()) {
                if let Some(entry) = self.entry_for_key_mut(share.backend) {
                    entry.stats.expired += 1;
                }
                self.unshare(share, OutcomeKind::Cancelled, lease.id, now_ms);
            }
        }
        self.stats.leases_expired += expired.len() as u64;
        expired.len()
    }

    /// The earliest deadline of a live lease, for the Durable Object's alarm.
    pub fn next_deadline(&self) -> Option<u64> {
        self.leases.next_deadline()
    }

    /// Live leases counted on existing backends (a removed backend's leases are not counted).
    pub fn in_flight_total(&self) -> u64 {
        self.entries().map(|e| u64::from(e.in_flight.leases)).sum()
    }

    /// Live leases, including those on backends removed since.
    pub fn live_leases(&self) -> usize {
        self.leases.len()
    }

    /// Checks that every backend's in-flight counters equal the sum of its live lease shares
    /// (used by tests and property tests; cheap enough for a debug endpoint).
    pub fn check_counters(&self) -> Result<(), String> {
        for s in &self.slots {
            let Some(e) = &s.entry else { continue };
            let mut expected = InFlight::default();
            for lease in self.leases.iter() {
                for share in std::iter::once(&lease.primary).chain(lease.decode.as_ref()) {
                    if share.backend == e.key {
                        expected.add(share.prompt_tokens, share.output_tokens);
                    }
                }
            }
            if expected != e.in_flight {
                return Err(format!(
                    "backend {}: counters {:?}, live leases {:?}",
                    e.spec.id, e.in_flight, expected
                ));
            }
        }
        Ok(())
    }

    /// A backend's in-flight counters.
    pub fn in_flight(&self, id: &BackendId) -> Option<InFlight> {
        let slot = *self.index.get(id)?;
        self.entry(slot).map(|e| e.in_flight)
    }

    /// The live lease `lease_id`.
    pub fn lease(&self, lease_id: LeaseId) -> Option<&Lease> {
        self.leases.get(lease_id)
    }

    /// Iterates over the live leases.
    pub fn leases(&self) -> impl Iterator<Item = &Lease> {
        self.leases.iter()
    }

    /// The prefix-affinity table.
    pub fn affinity(&self) -> &PrefixAffinity {
        &self.affinity
    }

    /// Backends where a lease ended since the last call, oldest first (admission control on).
    pub fn take_freed(&mut self) -> Vec<BackendId> {
        let slots = std::mem::take(&mut self.freed);
        slots
            .into_iter()
            .filter_map(|slot| self.entry(slot).map(|e| e.spec.id.clone()))
            .collect()
    }

    /// Leading blocks of `block_hashes` that backend `id` probably holds.
    pub fn cached_blocks_on(&self, id: &BackendId, block_hashes: &[u64]) -> u32 {
        let Some(&slot) = self.index.get(id) else {
            return 0;
        };
        let mut lengths = Vec::new();
        self.affinity.match_lengths(block_hashes, &mut lengths);
        lengths.get(slot as usize).copied().unwrap_or(0)
    }

    /// A backend's spec as registered (API key included: for the Durable Object's own use, to
    /// persist it and to authenticate probes; never for views).
    pub fn spec(&self, id: &BackendId) -> Option<&BackendSpec> {
        let slot = *self.index.get(id)?;
        self.entry(slot).map(|e| &e.spec)
    }

    /// A backend's listing.
    pub fn backend(&self, id: &BackendId) -> Option<BackendView> {
        self.view(*self.index.get(id)?)
    }

    /// Every backend's listing, in slot order.
    pub fn backends(&self) -> impl Iterator<Item = BackendView> + '_ {
        (0..self.slots.len()).filter_map(|slot| self.view(slot as u32))
    }

    /// Number of registered backends.
    pub fn backend_count(&self) -> usize {
        self.index.len()
    }

    /// One backend's persistent state (what a request's ending may have changed).
    pub fn snapshot(&self, id: &BackendId) -> Option<BackendSnapshot> {
        let e = self.entry(*self.index.get(id)?)?;
        Some(BackendSnapshot {
            id: e.spec.id.clone(),
            lifecycle: e.lifecycle,
            health: e.health.state,
            breaker: e.breaker.snapshot(),
        })
    }

    /// Every backend's persistent state.
    pub fn snapshots(&self) -> Vec<BackendSnapshot> {
        self.entries()
            .map(|e| BackendSnapshot {
                id: e.spec.id.clone(),
                lifecycle: e.lifecycle,
                health: e.health.state,
                breaker: e.breaker.snapshot(),
            })
            .collect()
    }

    /// Restores a backend's persisted state after a restart (the backend must be added first).
    pub fn restore(&mut self, snapshot: &BackendSnapshot) -> Result<(), PoolError> {
        let slot = self.slot_of(&snapshot.id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(&snapshot.id))?;
        entry.lifecycle = match snapshot.lifecycle {
            Lifecycle::Draining if entry.in_flight.leases == 0 => Lifecycle::Drained,
            other => other,
        };
        entry.health = Health {
            state: snapshot.health,
            ..Health::default()
        };
        entry.breaker = CircuitBreaker::restore(snapshot.breaker);
        Ok(())
    }

    /// Every backend's breaker state, for persistence.
    pub fn persisted_breakers(&self) -> Vec<(BackendId, BreakerSnapshot)> {
        self.entries()
            .map(|e| (e.spec.id.clone(), e.breaker.snapshot()))
            .collect()
    }

    /// Restores one backend's breaker after a restart.
    pub fn restore_breaker(
        &mut self,
        id: &BackendId,
        snapshot: BreakerSnapshot,
    ) -> Result<(), PoolError> {
        let slot = self.slot_of(id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(id))?;
        entry.breaker = CircuitBreaker::restore(snapshot);
        Ok(())
    }

    /// Renders the pool's metrics in the Prometheus text format (see [`crate::metrics`]).
    pub fn render_metrics(&self, out: &mut String) {
        crate::metrics::render(self, out);
    }

    pub(crate) fn entries(&self) -> impl Iterator<Item = &BackendEntry> {
        self.slots.iter().filter_map(|s| s.entry.as_ref())
    }

    fn settle(
        &mut self,
        share: &LeaseShare,
        outcome: &Outcome,
        lease_id: LeaseId,
        acquired_ms: u64,
        now_ms: u64,
    ) {
        if let Some(entry) = self.entry_for_key_mut(share.backend) {
            entry
                .stats
                .record_outcome(outcome, now_ms.saturating_sub(acquired_ms));
        }
        self.unshare(share, outcome.kind, lease_id, now_ms);
    }

    /// Counts `blocks` as held on `slot` by lease `lease_id`.
    fn hold_blocks(&mut self, lease_id: LeaseId, slot: u32, blocks: Vec<u64>) {
        let Some(entry) = self.entry_mut(slot) else {
            return;
        };
        entry.held.hold(&blocks);
        let key = entry.key;
        self.lease_blocks.insert(lease_id, (key, blocks));
    }

    /// Stops counting the blocks lease `lease_id` holds on `backend`; returns them.
    fn drop_blocks(&mut self, lease_id: LeaseId, backend: BackendKey) -> Option<Vec<u64>> {
        match self.lease_blocks.get(&lease_id) {
            Some((key, _)) if *key == backend => {}
            _ => return None,
        }
        let (_, blocks) = self.lease_blocks.remove(&lease_id)?;
        if let Some(entry) = self.entry_for_key_mut(backend) {
            entry.held.release(&blocks);
        }
        Some(blocks)
    }

    /// Takes a share off its backend's counters and tells the breaker how it ended.
    fn unshare(&mut self, share: &LeaseShare, kind: OutcomeKind, lease_id: LeaseId, now_ms: u64) {
        self.drop_blocks(lease_id, share.backend);
        // Admission control's hook: a backend freed room (bounded; the queue drains it).
        if self.config.admission.enabled && self.freed.len() < 1024 {
            self.freed.push(share.backend.slot);
        }
        let breaker_config = self.config.breaker;
        let Some(entry) = self.entry_for_key_mut(share.backend) else {
            return;
        };
        entry
            .in_flight
            .remove(share.prompt_tokens, share.output_tokens);
        entry.timing.leave(&share.predicted, now_ms);
        let jitter = (xxh3_64(&(lease_id ^ now_ms.rotate_left(32)).to_le_bytes()) >> 11) as f64
            / (1u64 << 53) as f64;
        entry
            .breaker
            .record(kind, share.trial, now_ms, &breaker_config, jitter);
        if entry.lifecycle == Lifecycle::Draining && entry.in_flight.leases == 0 {
            entry.lifecycle = Lifecycle::Drained;
        }
    }

    fn slot_of(&self, id: &BackendId) -> Result<u32, PoolError> {
        self.index.get(id).copied().ok_or_else(|| unknown(id))
    }

    fn entry(&self, slot: u32) -> Option<&BackendEntry> {
        self.slots.get(slot as usize)?.entry.as_ref()
    }

    fn entry_mut(&mut self, slot: u32) -> Option<&mut BackendEntry> {
        self.slots.get_mut(slot as usize)?.entry.as_mut()
    }

    fn entry_for_key_mut(&mut self, key: BackendKey) -> Option<&mut BackendEntry> {
        let s = self.slots.get_mut(key.slot as usize)?;
        if s.generation != key.generation {
            return None;
        }
        s.entry.as_mut()
    }

    fn sync_affinity_capacity(&mut self, slot: u32) {
        let block_tokens = self.config.block_tokens();
        if let Some(entry) = self.entry(slot) {
            let blocks = entry.capacity().capacity_blocks(block_tokens);
            self.affinity.set_backend_capacity(slot, blocks);
        }
    }

    fn members_changed(&mut self) {
        let members: Vec<RingMember<'_>> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| {
                s.entry.as_ref().map(|e| RingMember {
                    node: slot as u32,
                    id: e.spec.id.as_str(),
                    weight: e.spec.weight,
                })
            })
            .collect();
        self.policy.members_changed(&members);
    }

    fn view(&self, slot: u32) -> Option<BackendView> {
        let e = self.entry(slot)?;
        Some(BackendView {
            id: e.spec.id.clone(),
            pool: self.name.clone(),
            url: e.spec.url.clone(),
            region: e.spec.region.clone(),
            models: e.spec.models.clone(),
            served_models: match &e.probed_models {
                Some(m) if !m.is_empty() => m.clone(),
                _ => e.spec.models.clone(),
            },
            weight: e.spec.weight,
            role: e.spec.role,
            has_api_key: e.spec.api_key.is_some(),
            capacity: e.capacity(),
            lifecycle: e.lifecycle,
            health: e.health.state,
            breaker: e.breaker.state(),
            breaker_open_until_ms: e.breaker.open_until_ms(),
            saturated_until_ms: e.breaker.saturated_until_ms(),
            leases_in_flight: e.in_flight.leases,
            inflight_prompt_tokens: e.in_flight.prompt_tokens,
            inflight_output_tokens: e.in_flight.output_tokens,
            load: e.load(self.config.queue_weight, self.echo()),
            affinity_blocks: self.affinity.backend_len(slot),
            added_ms: e.added_ms,
            last_probe_ms: e.health.last_probe_ms,
            scraped: e.scraped,
            timing: e.timing.view(&self.config.time_model, self.now_hint_ms),
        })
    }
}

fn unknown(id: &BackendId) -> PoolError {
    PoolError::UnknownBackend { id: id.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::{request_features, FeatureConfig};
    use crate::random::SplitMix64;
    use serde_json::json;

    fn spec(id: &str) -> BackendSpec {
        BackendSpec {
            id: id.into(),
            url: format!("http://{id}:8000"),
            models: vec!["llama".into()],
            api_key: Some(format!("key-{id}")),
            ..BackendSpec::default()
        }
    }

    fn up() -> ProbeResult {
        ProbeResult {
            ok: true,
            ..ProbeResult::default()
        }
    }

    fn pool_with(policy: PolicyKind, n: usize) -> Pool {
        let mut pool = Pool::new(
            "p1",
            PoolConfig {
                policy,
                ..PoolConfig::default()
            },
        );
        for i in 0..n {
            let id = pool.add_backend(spec(&format!("b{i}")), 0).unwrap();
            pool.record_probe(&id, &up(), 0).unwrap();
        }
        pool
    }

    fn features(text: &str) -> RequestFeatures {
        let body = json!({"model": "llama", "messages": [{"role": "user", "content": text}]});
        request_features(&body, &|_| None, &FeatureConfig::default()).unwrap()
    }

    #[test]
    fn pending_backend_serves_nothing_until_probed() {
        let mut pool = Pool::new("p", PoolConfig::default());
        let id = pool.add_backend(spec("a"), 0).unwrap();
        let mut rng = SplitMix64::new(1);
        assert_eq!(
            pool.acquire(&features("hi"), 1, &mut rng),
            Err(AcquireError::NoBackendAvailable {
                retry_after_s: DEFAULT_RETRY_AFTER_S
            })
        );
        pool.record_probe(&id, &up(), 2).unwrap();
        assert_eq!(pool.backend(&id).unwrap().lifecycle, Lifecycle::Ready);
        let grant = pool.acquire(&features("hi"), 3, &mut rng).unwrap();
        assert_eq!(grant.backend, id);
        assert_eq!(grant.candidates[0].api_key.as_deref(), Some("key-a"));
    }

    #[test]
    fn unknown_model_is_model_not_found() {
        let mut pool = pool_with(PolicyKind::LeastLoad, 2);
        let mut f = features("x");
        f.model = "gpt-9".into();
        assert_eq!(
            pool.acquire(&f, 0, &mut SplitMix64::new(0)),
            Err(AcquireError::ModelNotFound {
                model: "gpt-9".into()
            })
        );
    }

    #[test]
    fn probed_models_replace_registered_ones() {
        let mut pool = pool_with(PolicyKind::LeastLoad, 1);
        let id = BackendId::from("b0");
        let probe = ProbeResult {
            ok: true,
            models: Some(vec!["mistral".into()]),
            ..ProbeResult::default()
        };
        pool.record_probe(&id, &probe, 1).unwrap();
        let mut rng = SplitMix64::new(0);
        assert!(matches!(
            pool.acquire(&features("x"), 2, &mut rng),
            Err(AcquireError::ModelNotFound { .. })
        ));
        let mut f = features("x");
        f.model = "mistral".into();
        assert!(pool.acquire(&f, 2, &mut rng).is_ok());
    }

    #[test]
    fn grants_rank_distinct_candidates_and_count_leases() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 4);
        let mut rng = SplitMix64::new(0);
        let g = pool.acquire(&features("hello"), 0, &mut rng).unwrap();
        assert_eq!(g.candidates.len(), 3);
        assert_eq!(g.decision, Some(DecisionKind::RoundRobin));
        assert_eq!(pool.in_flight_total(), 1);
        assert_eq!(pool.in_flight(&g.backend).unwrap().leases, 1);
        assert_eq!(pool.next_deadline(), Some(60_000));
        assert!(pool.release(g.lease_id, &Outcome::from_status(200), 10));
        assert!(
            !pool.release(g.lease_id, &Outcome::from_status(200), 11),
            "double release is a no-op"
        );
        assert_eq!(pool.in_flight_total(), 0);
        assert_eq!(pool.in_flight(&g.backend).unwrap(), InFlight::default());
    }

    #[test]
    fn client_errors_never_open_the_breaker_but_5xx_do() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 1);
        let mut rng = SplitMix64::new(0);
        let id = BackendId::from("b0");
        for t in 0..20 {
            let g = pool.acquire(&features("x"), t, &mut rng).unwrap();
            pool.release(g.lease_id, &Outcome::from_status(400), t);
            let g = pool.acquire(&features("x"), t, &mut rng).unwrap();
            pool.release(g.lease_id, &Outcome::of_kind(OutcomeKind::Cancelled), t);
        }
        assert_eq!(pool.backend(&id).unwrap().breaker, BreakerState::Closed);
        for t in 0..5 {
            let g = pool.acquire(&features("x"), 100 + t, &mut rng).unwrap();
            pool.release(g.lease_id, &Outcome::from_status(502), 100 + t);
        }
        let view = pool.backend(&id).unwrap();
        assert_eq!(view.breaker, BreakerState::Open);
        match pool.acquire(&features("x"), 200, &mut rng) {
            Err(AcquireError::NoBackendAvailable { retry_after_s }) => {
                assert!((1..=5).contains(&retry_after_s))
            }
            other => panic!("{other:?}"),
        }
        // After the cooldown, one trial is admitted; its success (twice) closes the breaker.
        let t = view.breaker_open_until_ms;
        let g = pool.acquire(&features("x"), t, &mut rng).unwrap();
        assert!(
            pool.acquire(&features("x"), t, &mut rng).is_err(),
            "one trial at a time"
        );
        pool.release(g.lease_id, &Outcome::from_status(200), t + 1);
        let g = pool.acquire(&features("x"), t + 2, &mut rng).unwrap();
        pool.release(g.lease_id, &Outcome::from_status(200), t + 3);
        assert_eq!(pool.backend(&id).unwrap().breaker, BreakerState::Closed);
    }

    #[test]
    fn rate_limit_saturates_briefly() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 1);
        let mut rng = SplitMix64::new(0);
        let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
        pool.release(g.lease_id, &Outcome::from_status(429), 1_000);
        assert_eq!(
            pool.acquire(&features("x"), 1_500, &mut rng),
            Err(AcquireError::NoBackendAvailable { retry_after_s: 2 })
        );
        assert!(pool.acquire(&features("x"), 3_000, &mut rng).is_ok());
        assert_eq!(
            pool.backend(&BackendId::from("b0")).unwrap().breaker,
            BreakerState::Closed
        );
    }

    #[test]
    fn reassign_moves_the_lease_and_blames_the_old_backend() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 3);
        let mut rng = SplitMix64::new(0);
        let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
        let next = g.candidates[1].id.clone();
        let view = pool
            .reassign(
                g.lease_id,
                &next,
                &Outcome::of_kind(OutcomeKind::Transport),
                5,
            )
            .unwrap();
        assert_eq!(view.id, next);
        assert_eq!(pool.in_flight(&g.backend).unwrap().leases, 0);
        assert_eq!(pool.in_flight(&next).unwrap().leases, 1);
        let stats = &pool
            .entries()
            .find(|e| e.spec.id == g.backend)
            .unwrap()
            .stats;
        assert_eq!(stats.outcomes[OutcomeKind::Transport.index()], 1);
        assert!(pool.release(g.lease_id, &Outcome::from_status(200), 9));
        assert_eq!(pool.in_flight_total(), 0);
        assert!(matches!(
            pool.reassign(g.lease_id, &next, &Outcome::default(), 10),
            Err(PoolError::UnknownLease { .. })
        ));
    }

    #[test]
    fn reassign_to_an_unavailable_backend_changes_nothing() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 2);
        let pending = pool.add_backend(spec("new"), 0).unwrap();
        let mut rng = SplitMix64::new(0);
        let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
        assert_eq!(
            pool.reassign(
                g.lease_id,
                &pending,
                &Outcome::of_kind(OutcomeKind::Timeout),
                1
            ),
            Err(PoolError::BackendUnavailable {
                id: pending.clone()
            })
        );
        assert_eq!(pool.in_flight(&g.backend).unwrap().leases, 1);
    }

    #[test]
    fn expiry_frees_counters_and_drains() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 1);
        let mut rng = SplitMix64::new(0);
        let id = BackendId::from("b0");
        let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
        assert_eq!(
            pool.set_lifecycle(&id, Lifecycle::Draining, 1),
            Ok(Lifecycle::Draining)
        );
        assert!(pool.acquire(&features("x"), 2, &mut rng).is_err());
        assert_eq!(pool.expire(59_999), 0);
        assert_eq!(pool.expire(60_000), 1);
        assert_eq!(pool.in_flight_total(), 0);
        assert_eq!(pool.backend(&id).unwrap().lifecycle, Lifecycle::Drained);
        assert!(!pool.release(g.lease_id, &Outcome::default(), 60_001));
        assert_eq!(pool.next_deadline(), None);
        assert_eq!(
            pool.set_lifecycle(&id, Lifecycle::Ready, 3),
            Ok(Lifecycle::Ready)
        );
        assert!(pool.acquire(&features("x"), 4, &mut rng).is_ok());
    }

    #[test]
    fn lifecycle_rules() {
        let mut pool = Pool::new("p", PoolConfig::default());
        let id = pool.add_backend(spec("a"), 0).unwrap();
        assert_eq!(
            pool.set_lifecycle(&id, Lifecycle::Ready, 0),
            Err(PoolError::InvalidTransition {
                from: Lifecycle::Pending,
                to: Lifecycle::Ready
            })
        );
        assert_eq!(
            pool.set_lifecycle(&id, Lifecycle::Draining, 0),
            Ok(Lifecycle::Drained)
        );
        assert_eq!(
            pool.set_lifecycle(&id, Lifecycle::Ready, 0),
            Ok(Lifecycle::Pending),
            "not healthy yet"
        );
        assert!(pool.set_lifecycle(&id, Lifecycle::Drained, 0).is_err());
        pool.record_probe(&id, &up(), 1).unwrap();
        assert_eq!(pool.backend(&id).unwrap().lifecycle, Lifecycle::Ready);
    }

    #[test]
    fn removing_a_backend_with_live_leases_never_goes_negative() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 2);
        let mut rng = SplitMix64::new(0);
        let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
        pool.remove_backend(&g.backend, 1).unwrap();
        assert_eq!(pool.in_flight_total(), 0);
        assert_eq!(pool.live_leases(), 1);
        // The slot is reused by a new backend, which must not inherit the old lease's release.
        let id = pool.add_backend(spec("fresh"), 2).unwrap();
        pool.record_probe(&id, &up(), 2).unwrap();
        let g2 = pool.acquire(&features("y"), 3, &mut rng).unwrap();
        let before = pool.in_flight_total();
        assert!(pool.release(g.lease_id, &Outcome::from_status(500), 4));
        assert_eq!(pool.in_flight_total(), before);
        assert!(pool.release(g2.lease_id, &Outcome::from_status(200), 5));
        assert_eq!(pool.in_flight_total(), 0);
        assert_eq!(pool.live_leases(), 0);
        assert!(pool.remove_backend(&g.backend, 6).is_err());
    }

    #[test]
    fn cache_aware_follows_the_prefix() {
        let mut pool = pool_with(PolicyKind::CacheAware, 4);
        let mut rng = SplitMix64::new(0);
        let doc = "shared system prompt ".repeat(100);
        let g1 = pool.acquire(&features(&doc), 0, &mut rng).unwrap();
        assert_eq!(g1.decision, Some(DecisionKind::CacheMiss));
        pool.release(g1.lease_id, &Outcome::from_status(200), 1);
        let g2 = pool
            .acquire(&features(&format!("{doc} and more")), 2, &mut rng)
            .unwrap();
        assert_eq!(g2.decision, Some(DecisionKind::CacheHit));
        assert_eq!(g2.backend, g1.backend);
        assert!(g2.cached_blocks > 25, "{}", g2.cached_blocks);
        assert!(pool.affinity().len() > 25);
    }

    #[test]
    fn consistent_hash_is_sticky_per_key() {
        let mut pool = pool_with(PolicyKind::ConsistentHash, 5);
        let mut rng = SplitMix64::new(0);
        let mut f = features("x");
        f.routing_key = Some("session-42".into());
        let first = pool.acquire(&f, 0, &mut rng).unwrap();
        assert_eq!(first.decision, Some(DecisionKind::Sticky));
        pool.release(first.lease_id, &Outcome::default(), 1);
        for t in 2..10 {
            let g = pool.acquire(&f, t, &mut rng).unwrap();
            assert_eq!(g.backend, first.backend);
            pool.release(g.lease_id, &Outcome::default(), t);
        }
        f.routing_key = None;
        assert_eq!(
            pool.acquire(&f, 20, &mut rng).unwrap().decision,
            Some(DecisionKind::NoKey)
        );
    }

    #[test]
    fn disaggregated_pairs_prefill_and_decode() {
        let mut pool = Pool::new(
            "p",
            PoolConfig {
                policy: PolicyKind::Disaggregated,
                ..PoolConfig::default()
            },
        );
        for (id, role) in [
            ("pf", Role::Prefill),
            ("dc", Role::Decode),
            ("mx", Role::Mixed),
        ] {
            let id = pool
                .add_backend(BackendSpec { role, ..spec(id) }, 0)
                .unwrap();
            pool.record_probe(&id, &up(), 0).unwrap();
        }
        let mut rng = SplitMix64::new(0);
        let g = pool.acquire(&features("x"), 1, &mut rng).unwrap();
        assert_eq!(g.backend.as_str(), "pf");
        assert_eq!(g.decode_candidates[0].id.as_str(), "dc");
        assert_eq!(pool.in_flight_total(), 2);
        pool.release(g.lease_id, &Outcome::default(), 2);
        assert_eq!(pool.in_flight_total(), 0);
        pool.set_lifecycle(&"dc".into(), Lifecycle::Draining, 3)
            .unwrap();
        let g = pool.acquire(&features("x"), 4, &mut rng).unwrap();
        assert_eq!(
            g.backend.as_str(),
            "mx",
            "no decode backend: mixed fallback"
        );
        assert!(g.decode_candidates.is_empty());
        let mut f = features("x");
        f.role_hint = Some(Role::Decode);
        assert!(
            pool.acquire(&f, 5, &mut rng).is_err(),
            "the only decode backend is drained"
        );
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

    #[test]
    fn snapshots_restore_breakers_and_health() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 1);
        let mut rng = SplitMix64::new(0);
        for t in 0..5 {
            let g = pool.acquire(&features("x"), t, &mut rng).unwrap();
            pool.release(g.lease_id, &Outcome::from_status(503), t);
        }
        let snaps = pool.snapshots();
        let json = serde_json::to_string(&snaps).unwrap();
        let mut rebuilt = Pool::new("p1", pool.config().clone());
        rebuilt.add_backend(spec("b0"), 10).unwrap();
        for s in serde_json::from_str::<Vec<BackendSnapshot>>(&json).unwrap() {
            rebuilt.restore(&s).unwrap();
        }
        let view = rebuilt.backend(&"b0".into()).unwrap();
        assert_eq!(
            (view.lifecycle, view.health, view.breaker),
            (Lifecycle::Ready, HealthState::Healthy, BreakerState::Open)
        );
        let (id, b) = pool.persisted_breakers().remove(0);
        let mut other = Pool::new("p2", PoolConfig::default());
        other.add_backend(spec("b0"), 0).unwrap();
        other.restore_breaker(&id, b).unwrap();
        assert_eq!(other.backend(&id).unwrap().breaker, BreakerState::Open);
    }

    #[test]
    fn a_backend_busy_with_other_clients_is_avoided() {
        let mut pool = pool_with(PolicyKind::PredictedLatency, 2);
        let busy = ProbeResult {
            ok: true,
            waiting: Some(20.0),
            running: Some(10.0),
            kv_usage: Some(1.0),
            ..ProbeResult::default()
        };
        pool.record_probe(&BackendId::from("b0"), &busy, 1).unwrap();
        let mut rng = SplitMix64::new(3);
        for i in 0..4 {
            let g = pool
                .acquire(&features(&format!("q{i}")), 2, &mut rng)
                .unwrap();
            assert_eq!(g.backend.as_str(), "b1", "request {i}");
            assert!(pool.release(g.lease_id, &Outcome::from_status(200), 3));
        }
    }

    #[test]
    fn scraped_time_per_token_teaches_the_decode_rate() {
        let mut pool = pool_with(PolicyKind::PredictedLatency, 1);
        let id = BackendId::from("b0");
        let scrape = |sum: f64, count: f64| ProbeResult {
            ok: true,
            running: Some(4.0),
            tpot_seconds_sum: Some(sum),
            tpot_count: Some(count),
            ..ProbeResult::default()
        };
        pool.record_probe(&id, &scrape(0.0, 0.0), 1).unwrap();
        // 30 ms a token at a batch of 4, where the configured model says 10.6 ms.
        let mut sum = 0.0;
        for round in 1..=40u64 {
            sum += 200.0 * 0.030;
            pool.record_probe(&id, &scrape(sum, 200.0 * round as f64), round * 1000)
                .unwrap();
        }
        let t = pool.backend(&id).unwrap().timing;
        assert!(
            (t.decode_ms_per_step - 10.0 * 30.0 / 10.6).abs() < 1.0,
            "{t:?}"
        );
        // Too few tokens between scrapes teach nothing.
        let before = t.observations;
        pool.record_probe(&id, &scrape(sum + 0.3, 8_010.0), 50_000)
            .unwrap();
        assert_eq!(pool.backend(&id).unwrap().timing.observations, before);
    }

    #[test]
    fn config_is_validated_and_partial_json_works() {
        let cfg: PoolConfig =
            serde_json::from_str(r#"{"policy":"power_of_two","consistent_hash":{"eps":0.5}}"#)
                .unwrap();
        assert_eq!(cfg.policy, PolicyKind::PowerOfTwo);
        assert_eq!(cfg.consistent_hash.eps, 0.5);
        assert_eq!(cfg.max_candidates, 3);
        assert!(serde_json::from_str::<PoolConfig>(r#"{"policy":"fastest"}"#).is_err());
        let mut pool = pool_with(PolicyKind::RoundRobin, 2);
        assert!(pool
            .set_config(PoolConfig {
                max_candidates: 0,
                ..PoolConfig::default()
            })
            .is_err());
        pool.set_config(PoolConfig {
            policy: PolicyKind::ConsistentHash,
            ..PoolConfig::default()
        })
        .unwrap();
        assert_eq!(pool.config().policy, PolicyKind::ConsistentHash);
        let g = pool
            .acquire(&features("x"), 0, &mut SplitMix64::new(0))
            .unwrap();
        assert_eq!(g.policy, PolicyKind::ConsistentHash);
    }

    #[test]
    fn degenerate_config_does_not_panic() {
        let cfg = PoolConfig {
            max_candidates: 0,
            block_tokens: 0,
            lease_ttl_ms: 0,
            affinity_max_entries: 0,
            queue_weight: f64::NAN,
            cache_aware: CacheAwareConfig {
                cache_weight: f64::NAN,
                ..CacheAwareConfig::default()
            },
            ..PoolConfig::default()
        };
        for policy in PolicyKind::ALL {
            let mut pool = Pool::new(
                "p",
                PoolConfig {
                    policy,
                    ..cfg.clone()
                },
            );
            let id = pool.add_backend(spec("a"), 0).unwrap();
            pool.record_probe(&id, &up(), 0).unwrap();
            let g = pool
                .acquire(
                    &features("some prompt text here"),
                    0,
                    &mut SplitMix64::new(1),
                )
                .unwrap();
            assert_eq!(g.candidates.len(), 1);
            assert_eq!(pool.expire(0), 1);
        }
    }

    #[test]
    fn update_backend_patches_and_validates() {
        let mut pool = pool_with(PolicyKind::Weighted, 2);
        let id = BackendId::from("b1");
        let patch = BackendPatch {
            weight: Some(4),
            ..BackendPatch::default()
        };
        assert_eq!(pool.update_backend(&id, &patch, 0).unwrap().weight, 4);
        let bad = BackendPatch {
            url: Some("nope".into()),
            ..BackendPatch::default()
        };
        assert!(matches!(
            pool.update_backend(&id, &bad, 0),
            Err(PoolError::InvalidSpec { .. })
        ));
        let mut rng = SplitMix64::new(0);
        let mut count = 0;
        for t in 0..50 {
            let g = pool.acquire(&features("x"), t, &mut rng).unwrap();
            count += usize::from(g.backend == id);
            pool.release(g.lease_id, &Outcome::default(), t);
        }
        assert_eq!(count, 40);
    }
}
