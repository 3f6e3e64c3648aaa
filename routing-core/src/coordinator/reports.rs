//! What the coordinator reports: its counters, the pool's load measured now, the Prometheus page
//! (the pool's families, the coordinator's own, the routed counts and the queue's), and the last
//! hour's history.

use super::history::{self, HistoryReport};
use super::load::PoolLoad;
use super::metrics::{self, CoordinatorCounters, LastProbe};
use super::Coordinator;

impl Coordinator {
    /// The pool's load, measured now.
    pub fn load(&self) -> PoolLoad {
        self.measure_load()
    }

    /// The coordinator's counters.
    pub fn counters(&self) -> CoordinatorCounters {
        CoordinatorCounters {
            retries: self.retries,
            retry_budget_exhausted: self.budget.exhausted_total(),
            spills: self.spills,
            evidence_scrapes: self.evidence_scrapes,
            renewals: self.renewals,
            probe_rounds: self.probes.rounds,
            probes_ok: self.probes.ok,
            probes_failed: self.probes.failed,
            sent_ahead: self.sent_ahead,
        }
    }

    /// The waiting requests one replica should carry.
    pub fn autoscale_target_waiting(&self) -> f64 {
        self.load_targets.autoscale_target_waiting
    }

    /// Writes every metric family of pool `name`.
    pub fn render_metrics(&self, name: &str, out: &mut String) {
        self.pool.render_metrics(out);
        let mut probes: Vec<LastProbe> = self
            .probes
            .reports
            .iter()
            .map(|(id, r)| LastProbe {
                backend: &id.0,
                ok: r.result.ok,
                duration_ms: r.duration_ms,
                at_ms: r.at_ms,
            })
            .collect();
        probes.sort_by_key(|p| p.backend);
        let target = self.load_targets.autoscale_target_waiting;
        let counters = self.counters();
        metrics::render(out, name, &counters, &self.load(), target, &probes);
        self.routed.render(name, out);
        self.room.queue.render_metrics(name, out);
    }

    /// The last hour, minute by minute, including the current minute so far.
    pub fn history_report(&mut self, now_ms: u64) -> HistoryReport {
        self.record_history(now_ms);
        self.history.report(now_ms)
    }

    /// Adds what the pool's counters (and the backends' scraped prefix-cache counters) gained
    /// since the last sample to the current minute of the history.
    pub(super) fn record_history(&mut self, now_ms: u64) {
        let mut totals = history::totals(&self.pool);
        for (id, report) in &self.probes.reports {
            totals.set_cache_counters(
                id,
                report.metrics.prefix_cache_queries,
                report.metrics.prefix_cache_hits,
            );
        }
        self.history.record(now_ms, totals);
    }
}
