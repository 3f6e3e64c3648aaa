//! Slot storage: one [`BackendEntry`] per registered backend (its spec and live state), kept in
//! reusable slots whose generation tells a removed backend's stale lease shares from a new one's.

use super::views::CandidateView;
use super::BackendStats;
use super::DEFAULT_RETRY_AFTER_S;
use crate::backend::{BackendKey, BackendSpec, Capacity, Lifecycle};
use crate::breaker::{BreakerConfig, CircuitBreaker};
use crate::cost::{backend_load, InFlight};
use crate::health::Health;
use crate::scrape::ScrapedGauges;
use crate::time_model::BackendTiming;

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
}

impl BackendEntry {
    pub(super) fn serves(&self, model: &str) -> bool {
        match &self.probed_models {
            Some(models) if !models.is_empty() => models.iter().any(|m| m == model),
            _ => self.spec.models.iter().any(|m| m == model),
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
        c
    }

    pub(super) fn load(&self, queue_weight: f64) -> f64 {
        let c = self.capacity();
        backend_load(
            &self.in_flight,
            c.capacity_tokens(),
            self.scraped.waiting.unwrap_or(0.0),
            c.max_num_seqs,
            queue_weight,
        )
    }

    /// Sequences decoding (or about to) on the backend: its leases plus other clients' running ones.
    pub(super) fn running(&self) -> f64 {
        f64::from(self.in_flight.leases) + self.external_running
    }

    pub(super) fn available(&self, now_ms: u64, breaker: &BreakerConfig) -> bool {
        self.lifecycle == Lifecycle::Ready
            && self.health.is_serving()
            && self.breaker.would_admit(now_ms, breaker)
            && !self.breaker.is_saturated(now_ms)
    }

    pub(super) fn retry_after_ms(&self, now_ms: u64, breaker: &BreakerConfig) -> u64 {
        if self.lifecycle == Lifecycle::Ready && self.health.is_serving() {
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
