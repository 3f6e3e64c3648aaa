//! Probe rounds: the alarm's sweep over every backend, a few at a time (what the findings do is
//! the coordinator's: `routing_core::coordinator::Coordinator::record_probes`), and the calls
//! that ask for one sooner.

use super::{now_ms, ApiResult, PoolCoordinator, PROBE_CONCURRENCY};
use crate::call::answer;
use crate::probe::probe_backend;
use coordinator_protocol::messages::AlarmAnswer;
use routing_core::backend::BackendId;
use std::time::Duration;
use worker::console_error;

impl PoolCoordinator {
    /// Runs a probe round as soon as possible: one more after the round in progress, or else the
    /// alarm fires now (and re-arms itself after).
    pub(super) async fn probe_soon(&self) {
        if self.probing.get() {
            self.probe_again.set(true);
            return;
        }
        if let Err(e) = self.state.storage().set_alarm(0i64).await {
            console_error!("pool: cannot schedule a probe round: {e}");
        }
    }

    pub(super) async fn ensure_alarm(&self) -> ApiResult {
        let storage = self.state.storage();
        let armed = storage.get_alarm().await?;
        if armed.is_none() {
            storage.set_alarm(0i64).await?;
        }
        answer(
            200,
            &AlarmAnswer {
                alarm_was_armed: armed.is_some(),
            },
        )
    }

    /// Probes every backend, `PROBE_CONCURRENCY` at a time, and feeds the results to the pool.
    /// Rounds never overlap: one asked for while another runs becomes a single further round
    /// after it (so a backend registered meanwhile is probed without waiting for the interval).
    pub(super) async fn probe_all(&self) {
        // Probing runs once per pool, on shard 0, which hands its rounds to the other shards.
        if self.with(|shard| shard.coordinator.shard()) != 0 {
            return;
        }
        if self.probing.replace(true) {
            self.probe_again.set(true);
            return;
        }
        loop {
            self.probe_again.set(false);
            self.probe_round().await;
            if !self.probe_again.get() {
                break;
            }
        }
        self.probing.set(false);
    }

    /// Scrapes the backends lease evidence named now, outside the probe round (not while a round
    /// runs: it scrapes them anyway), and applies the findings as a round's
    /// (`Coordinator::finish_evidence_scrape`: the card that follows goes to the directory).
    pub(super) async fn evidence_scrape(&self, ids: Vec<BackendId>) {
        if self.probing.replace(true) {
            return;
        }
        let (targets, timeout) = self.with(|shard| {
            let timeout = Duration::from_millis(shard.settings.probe_timeout_ms);
            let mut targets = shard.coordinator.probe_targets();
            targets.retain(|t| ids.contains(&t.id));
            (targets, timeout)
        });
        let probes = targets
            .iter()
            .take(PROBE_CONCURRENCY)
            .map(|target| async move {
                let report = probe_backend(&target.url, target.api_key.as_deref(), timeout).await;
                (target.id.clone(), report)
            });
        let reports = futures_util::future::join_all(probes).await;
        let performed = self.with(|shard| {
            let now = now_ms();
            let effects = shard
                .coordinator
                .finish_evidence_scrape(reports, now, &shard.calls);
            shard.perform(effects, now)
        });
        self.probing.set(false);
        if self.probe_again.replace(false) {
            // The alarm's round came while this ran: run it now.
            self.probe_soon().await;
        }
        self.follow_up(performed).await;
    }

    pub(super) async fn probe_round(&self) {
        let (targets, timeout) = self.with(|shard| {
            let timeout = Duration::from_millis(shard.settings.probe_timeout_ms);
            (shard.coordinator.probe_targets(), timeout)
        });
        for batch in targets.chunks(PROBE_CONCURRENCY) {
            let probes = batch.iter().map(|target| async move {
                let report = probe_backend(&target.url, target.api_key.as_deref(), timeout).await;
                (target.id.clone(), report)
            });
            let reports = futures_util::future::join_all(probes).await;
            self.with(|shard| shard.coordinator.record_probes(reports, now_ms()));
        }
        let performed = self.with(|shard| {
            let now = now_ms();
            let effects = shard.coordinator.finish_probe_round(now, &shard.calls);
            shard.perform(effects, now)
        });
        self.follow_up(performed).await;
    }
}
