//! Probe rounds as the coordinator sees them: what to probe, what each probe's findings do to the
//! pool (through [`super::probe_verdict`] and the health hysteresis), the reports kept for the
//! admin view and metrics, and what a round's end asks for: the changed backends written, the
//! queue dispatched, the round handed to the sibling shards and the card to the directory.
//! Probing runs once per pool, on shard 0, which hands each round's reports to the others.

use super::probe_verdict::settle_loading;
use super::{Callers, Coordinator, Effect, Effects};
use crate::backend::scrape::VllmMetrics;
use crate::backend::BackendId;
use crate::pool::ProbeResult;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// What one probe round found out about a backend, kept for the admin view and metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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
    /// Of those, the LoRA adapters (listed with a `parent`), with their base model and path.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<AdapterCard>,
    /// Gauges read from `/metrics`.
    pub metrics: VllmMetrics,
    /// The result fed to the pool.
    pub result: ProbeResult,
}

/// A LoRA adapter a backend serves, as vLLM lists it in `/v1/models`
/// (`vllm/entrypoints/openai/models/serving.py`: `parent` the base model, `root` its path).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AdapterCard {
    /// The adapter's name (a model id requests name).
    pub id: String,
    /// The base model it adapts.
    pub parent: String,
    /// Where the server loaded it from.
    #[serde(default)]
    pub root: Option<String>,
}

/// A backend to probe.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeTarget {
    /// The backend.
    pub id: BackendId,
    /// Its base URL.
    pub url: String,
    /// The key its probes present.
    pub api_key: Option<String>,
}

/// The probes' record: the last report of each backend and the counters.
#[derive(Debug, Default)]
pub(super) struct ProbeLog {
    pub(super) reports: HashMap<BackendId, ProbeReport>,
    pub(super) rounds: u64,
    pub(super) last_probe_ms: Option<u64>,
    pub(super) ok: u64,
    pub(super) failed: u64,
}

impl Coordinator {
    /// Every backend, to probe.
    pub fn probe_targets(&self) -> Vec<ProbeTarget> {
        self.pool
            .backends()
            .map(|v| ProbeTarget {
                api_key: self.pool.spec(&v.id).and_then(|s| s.api_key.clone()),
                id: v.id,
                url: v.url,
            })
            .collect()
    }

    /// Feeds this shard's own probes' reports to the pool: a 503 from a backend that has served
    /// is a failure, not "loading". A backend removed while its probe ran is skipped.
    pub fn record_probes(&mut self, reports: Vec<(BackendId, ProbeReport)>, now_ms: u64) {
        for (id, mut report) in reports {
            let lifecycle = self.pool.backend(&id).map(|v| v.lifecycle);
            if let Some(failure) = settle_loading(&mut report.result, lifecycle) {
                report.error = Some(failure.to_string());
            }
            if self.pool.record_probe(&id, &report.result, now_ms).is_ok() {
                if report.result.ok {
                    self.probes.ok += 1;
                } else {
                    self.probes.failed += 1;
                }
                self.probes.reports.insert(id, report);
            }
        }
    }

    /// The end of this shard's probe round: leases past their deadline end, drains finish, the
    /// changed backends are written, the history takes a sample, and the queue is dispatched (a
    /// round may bring a backend back or learn a larger capacity). Shard 0 of several then hands
    /// the round to its siblings, and shard 0 its card to the directory.
    pub fn finish_probe_round(&mut self, now_ms: u64, callers: &dyn Callers) -> Effects {
        self.probes.rounds += 1;
        self.probes.last_probe_ms = Some(now_ms);
        self.probes_applied(now_ms, callers)
    }

    /// What follows new probe findings on shard 0: the changed backends written, the queue
    /// dispatched, the findings handed to the siblings and the card to the directory.
    pub(super) fn probes_applied(&mut self, now_ms: u64, callers: &dyn Callers) -> Effects {
        let mut effects = self.after_probes(now_ms);
        self.room.wake();
        effects.extend(self.settle(now_ms, callers));
        if self.shard == 0 && !self.siblings().is_empty() {
            effects.push(Effect::PushProbeRound);
        }
        if let Some(card) = self.directory_card(now_ms) {
            effects.push(Effect::PublishCard(card));
        }
        effects
    }

    /// Shard 0's probe round, applied on a sibling as if it had probed. Returns how many reports
    /// applied (a backend may be unknown here for a moment: a registration on its way).
    pub fn apply_probe_round(
        &mut self,
        reports: Vec<(BackendId, ProbeReport)>,
        now_ms: u64,
    ) -> (usize, Effects) {
        let mut applied = 0;
        for (id, report) in reports {
            if self.pool.record_probe(&id, &report.result, now_ms).is_ok() {
                self.probes.reports.insert(id, report);
                applied += 1;
            }
        }
        self.probes.last_probe_ms = Some(now_ms);
        (applied, self.after_probes(now_ms))
    }

    pub(super) fn after_probes(&mut self, now_ms: u64) -> Effects {
        let mut effects = Effects::new();
        self.pool.expire(now_ms);
        if self.pool.admission_held(now_ms) && self.pool.scrapes_match_leases() {
            // vLLM runs nothing the pool does not count: no stream is left to renew (an idle
            // object that was evicted and woke up), so the restart's hold ends now.
            self.pool.hold_admission(0);
            self.room.wake();
        }
        self.finish_drains(now_ms, &mut effects);
        self.persist_snapshots(&mut effects);
        self.record_history(now_ms);
        effects
    }

    /// A backend's last probe report.
    pub fn probe_report(&self, id: &BackendId) -> Option<&ProbeReport> {
        self.probes.reports.get(id)
    }

    /// Every backend's last probe report (what a round hands to the siblings).
    pub fn probe_reports(&self) -> impl Iterator<Item = (&BackendId, &ProbeReport)> {
        self.probes.reports.iter()
    }

    /// When the last probe round ended (here or, on a sibling, on shard 0).
    pub fn last_probe_ms(&self) -> Option<u64> {
        self.probes.last_probe_ms
    }
}
