//! Slot storage: one [`BackendEntry`] per registered backend (its spec and live state), kept in
//! reusable slots whose generation tells a removed backend's stale lease shares from a new one's.

use super::evidence::LeaseEvidence;
use super::views::CandidateView;
use super::BackendStats;
use super::DEFAULT_RETRY_AFTER_S;
use crate::backend::breaker::{BreakerConfig, CircuitBreaker};
use crate::backend::cost::{backend_load, InFlight};
use crate::backend::health::Health;
use crate::backend::held_blocks::HeldBlocks;
use crate::backend::scrape::ScrapedGauges;
use crate::backend::serving::Serving;
use crate::backend::time_model::BackendTiming;
use crate::backend::{BackendKey, BackendSpec, Capacity, Lifecycle};
use crate::pool::shard::ShardLoad;

/// One registered backend and its live state.
#[derive(Debug, Clone)]
pub(super) struct BackendEntry {
    pub(super) key: BackendKey,
    pub(super) spec: BackendSpec,
    pub(super) lifecycle: Lifecycle,
    pub(super) health: Health,
    pub(super) breaker: CircuitBreaker,
    pub(super) in_flight: InFlight,
    pub(super) probed_models: Option<Vec<String>>,
    pub(super) scraped: ScrapedGauges,
    /// The last scrape did not report the backend's load (no `vllm:*` series): its `scraped`
    /// load gauges are empty, and it is priced with `assumed_load`.
    pub(super) load_unknown: bool,
    /// The load assumed while it is unknown: the most loaded known backend's (see
    /// `Pool::assume_unknown_loads`).
    pub(super) assumed_load: ScrapedGauges,
    pub(super) added_ms: u64,
    pub(super) stats: BackendStats,
    /// Learned rates and the virtual prefill queue.
    pub(super) timing: BackendTiming,
    /// Sequences the last scrape found running, and waiting, beyond the gateway's own leases
    /// (other clients of the same server).
    pub(super) external_running: f64,
    pub(super) external_waiting: f64,
    /// The previous scrape's time-per-output-token sum and count, for the rate between scrapes.
    pub(super) tpot_scraped: Option<(f64, f64)>,
    /// Sibling coordinator shards' load on the backend, with their backlog as of `remote_at_ms`
    /// (zero with one shard).
    pub(super) remote: ShardLoad,
    pub(super) remote_at_ms: u64,
    /// This shard's own in-flight leases when it last reported (see [`BackendEntry::all_in_flight`]).
    pub(super) reported: InFlight,
    /// Prompt blocks the live leases hold here.
    pub(super) held: HeldBlocks,
    /// The batch the server runs at most, as its scrapes showed it (`running` while requests
    /// waited: vLLM's `max_num_seqs`, or fewer when its KV cache is the limit), and when a scrape
    /// last confirmed it; see [`learn_seq_limit`].
    pub(super) learned_seqs: Option<(u32, u64)>,
    /// When a scrape last reported the backend's load, in ms of pool time (lease evidence counts
    /// only the streams granted after it: the scrape saw the earlier ones).
    pub(super) load_scraped_ms: Option<u64>,
    /// What the lease table says of the backend's engine queue (see `super::evidence`).
    pub(super) evidence: LeaseEvidence,
}

/// How long a learned batch limit holds without a scrape confirming it (a queue behind a full
/// batch), in ms: a limit set by long prompts filling the KV cache does not outlive them.
pub(super) const LEARNED_SEQS_TTL_MS: u64 = 60_000;

/// The batch limit after a scrape that saw `running` sequences and `waiting` requests at
/// `now_ms`: a queue behind a running batch says the batch is full, so its size is the limit (the
/// largest such batch while the limit holds: a scrape between one sequence ending and the next
/// admitted sees one fewer); a batch larger than the limit raises it; a limit no queue confirms
/// lapses after [`LEARNED_SEQS_TTL_MS`].
pub(super) fn learn_seq_limit(
    learned: Option<(u32, u64)>,
    running: f64,
    waiting: f64,
    now_ms: u64,
) -> Option<(u32, u64)> {
    let running = running.round().max(0.0) as u32;
    if waiting >= 1.0 && running >= 1 {
        let limit = match learned {
            Some((limit, at)) if now_ms.saturating_sub(at) <= LEARNED_SEQS_TTL_MS => {
                limit.max(running)
            }
            _ => running,
        };
        return Some((limit, now_ms));
    }
    match learned {
        Some((limit, at)) if running > limit => Some((running, at)),
        Some((_, at)) if now_ms.saturating_sub(at) > LEARNED_SEQS_TTL_MS => None,
        other => other,
    }
}

impl BackendEntry {
    /// What the one "serves this model" rule reads of this backend.
    pub(super) fn serving(&self) -> Serving<'_> {
        Serving {
            spec: &self.spec,
            probed_models: self.probed_models.as_deref(),
            lifecycle: self.lifecycle,
            health: &self.health,
        }
    }

    pub(super) fn capacity(&self) -> Capacity {
        let mut c = self.spec.capacity;
        if let Some(blocks) = self.scraped.kv_blocks.filter(|&b| b > 0) {
            c.kv_blocks = blocks;
        }
        if let Some(size) = self.scraped.block_size.filter(|&s| s > 0) {
            c.block_size = size;
        }
        if let Some(tokens) = self.scraped.kv_cache_tokens.filter(|&t| t > 0) {
            c.kv_tokens = tokens;
        }
        if let Some((seqs, _)) = self.learned_seqs {
            c.max_num_seqs = c.max_num_seqs.min(seqs.max(1));
        }
        if let Some(seqs) = self.evidence_seq_bound() {
            c.max_num_seqs = c.max_num_seqs.min(seqs);
        }
        c
    }

    /// What is in flight on the backend: this coordinator's leases and its sibling shards'.
    ///
    /// Siblings count as of their last report, plus what they probably placed since: each of this
    /// shard's own placements since its last report counts `twins` more times, for the siblings
    /// (`twins` = (shards - 1) × [`SIBLING_ECHO`](crate::pool::shard::SIBLING_ECHO), from
    /// `Pool::sibling_twins`). See [`crate::pool::shard`].
    pub(super) fn all_in_flight(&self, twins: f64) -> InFlight {
        let mut all = self.in_flight;
        let remote = self.remote.in_flight();
        let grown = |now: u64, then: u64| (now.saturating_sub(then) as f64 * twins) as u64;
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
    pub(super) fn remote_backlog_ms(&self, now_ms: u64) -> f64 {
        (self.remote.backlog_ms - now_ms.saturating_sub(self.remote_at_ms) as f64).max(0.0)
    }

    /// The load gauges routing prices with: the scraped ones, or while the load is unknown the
    /// assumed ones (never a missing series read as zero).
    pub(super) fn load_gauges(&self) -> ScrapedGauges {
        match self.load_unknown {
            true => self.assumed_load,
            false => self.scraped,
        }
    }

    pub(super) fn load(&self, queue_weight: f64, twins: f64) -> f64 {
        let c = self.capacity();
        backend_load(
            &self.all_in_flight(twins),
            c.capacity_tokens(),
            self.load_gauges().waiting.unwrap_or(0.0),
            c.max_num_seqs,
            queue_weight,
        )
    }

    /// Sequences decoding (or about to) on the backend: its leases plus other clients' running ones.
    pub(super) fn running(&self, twins: f64) -> f64 {
        f64::from(self.all_in_flight(twins).leases) + self.external_running
    }

    /// Whether it may take a request now: up (see [`Serving::is_up`]), admitted by its breaker
    /// and not saturated.
    pub(super) fn available(&self, now_ms: u64, breaker: &BreakerConfig) -> bool {
        self.serving().is_up()
            && self.breaker.would_admit(now_ms, breaker)
            && !self.breaker.is_saturated(now_ms)
    }

    pub(super) fn retry_after_ms(&self, now_ms: u64, breaker: &BreakerConfig) -> u64 {
        if self.serving().is_up() {
            self.breaker
                .retry_after_ms(now_ms, breaker)
                .unwrap_or(DEFAULT_RETRY_AFTER_S * 1000)
        } else {
            DEFAULT_RETRY_AFTER_S * 1000
        }
    }

    pub(super) fn candidate_view(&self) -> CandidateView {
        CandidateView {
            id: self.spec.id.clone(),
            url: self.spec.url.clone(),
            api_key: self.spec.api_key.clone(),
            role: self.spec.role,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct Slot {
    pub(super) generation: u32,
    pub(super) entry: Option<BackendEntry>,
}
