//! The pool's counters: [`BackendStats`] per backend (gone with the backend) and [`PoolStats`]
//! per pool, and the [`BackendReport`] through which rendering and the dashboard's history read
//! them.

use super::{BackendView, Pool};
use crate::metrics::Histogram;
use crate::policy::{DecisionKind, PolicyKind};
use crate::stream::outcome::{Outcome, StreamResume};
use std::collections::BTreeMap;

/// Per-backend counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Lease shares granted on the backend (first choices and reassigned retries).
    pub requests: u64,
    /// Released shares by outcome, indexed by
    /// [`OutcomeKind::index`](crate::stream::outcome::OutcomeKind::index).
    pub outcomes: [u64; 7],
    /// Shares that expired unreleased.
    pub expired: u64,
    /// Time to first byte.
    pub ttfb: Histogram,
    /// Time from grant to release.
    pub duration: Histogram,
    /// Prompt tokens reported by releases.
    pub prompt_tokens: u64,
    /// Of those, prompt tokens the backend served from its prefix cache.
    pub cached_tokens: u64,
    /// Completion tokens reported by releases.
    pub completion_tokens: u64,
    /// Streams that failed after their first byte, by [`StreamResume::index`].
    pub stream_resumes: [u64; StreamResume::LABELS.len()],
    /// How far the first byte came from the time to first token predicted when the backend was
    /// chosen (successful first choices only), either way.
    pub prediction_error: Histogram,
    /// Of those, first bytes that came later than predicted.
    pub predicted_late: u64,
    /// Requests the backend shed: vLLM's 503 load shedding (`--max-num-queued-reqs` /
    /// `--max-num-queued-tokens`), counted as load, not failure.
    pub shed: u64,
}

impl BackendStats {
    /// Counts how a successful request's first byte (`seen_ms`) compared with the time to first
    /// token predicted for it (`predicted_ms`).
    pub fn record_prediction(&mut self, predicted_ms: u64, seen_ms: u64) {
        self.prediction_error
            .observe(predicted_ms.abs_diff(seen_ms));
        self.predicted_late += u64::from(seen_ms > predicted_ms);
    }

    /// Counts one released share.
    pub fn record_outcome(&mut self, outcome: &Outcome, duration_ms: u64) {
        self.outcomes[outcome.kind.index()] += 1;
        self.shed += u64::from(outcome.is_load_shed());
        if let Some(ttfb) = outcome.ttfb_ms {
            self.ttfb.observe(ttfb);
        }
        self.duration.observe(duration_ms);
        self.prompt_tokens += u64::from(outcome.prompt_tokens.unwrap_or(0));
        self.cached_tokens += u64::from(outcome.cached_tokens.unwrap_or(0));
        self.completion_tokens += u64::from(outcome.completion_tokens.unwrap_or(0));
        if let Some(resume) = outcome.resume {
            self.stream_resumes[resume.index(outcome.kind)] += 1;
        }
    }
}

/// Per-pool counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Decisions by policy and kind.
    pub decisions: BTreeMap<(PolicyKind, DecisionKind), u64>,
    /// Failed acquires: `[model_not_found, no_backend]`.
    pub acquire_errors: [u64; 2],
    /// Leases that expired unreleased.
    pub leases_expired: u64,
    /// Releases of leases that were not live (double, late or unknown).
    pub unknown_releases: u64,
    /// Prompt blocks of routed requests.
    pub prompt_blocks: u64,
    /// Of those, blocks the chosen backend probably had cached.
    pub cached_blocks: u64,
}

impl PoolStats {
    /// Counts one decision.
    pub fn record_decision(&mut self, policy: PolicyKind, decision: DecisionKind) {
        *self.decisions.entry((policy, decision)).or_insert(0) += 1;
    }
}

/// A backend's listing with its counters: what metrics and history read.
#[derive(Debug, Clone)]
pub struct BackendReport<'a> {
    /// The backend's listing.
    pub view: BackendView,
    /// Its counters.
    pub stats: &'a BackendStats,
    /// Health state changes so far.
    pub health_transitions: u64,
    /// Breaker transitions so far, indexed like [`crate::backend::breaker::BreakerState::ALL`].
    pub breaker_transitions: [u64; 3],
    /// Load by the cost model with the siblings' reported load but without the estimate of what
    /// they placed since (the listing's `load` includes it).
    pub reported_load: f64,
}

impl Pool {
    /// The pool's counters.
    pub fn stats(&self) -> &PoolStats {
        &self.stats
    }

    /// Every backend's listing and counters, in slot order.
    pub fn backend_reports(&self) -> impl Iterator<Item = BackendReport<'_>> + '_ {
        self.slots.iter().enumerate().filter_map(|(slot, s)| {
            let e = s.entry.as_ref()?;
            Some(BackendReport {
                view: self.view(slot as u32)?,
                stats: &e.stats,
                health_transitions: e.health.transitions,
                breaker_transitions: e.breaker.transitions(),
                reported_load: e.load(self.config.queue_weight, 0.0),
            })
        })
    }
}
