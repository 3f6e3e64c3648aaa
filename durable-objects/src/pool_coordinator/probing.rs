//! Probe rounds: the alarm's sweep over every backend, a few at a time, and the calls that
//! ask for one sooner.

use super::*;

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
        if self.with(|l| l.shard) != 0 {
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

    pub(super) async fn probe_round(&self) {
        let (targets, timeout) = self.with(|l| {
            let targets: Vec<(BackendId, String, Option<String>)> = l
                .pool
                .backends()
                .map(|v| {
                    let key = l.pool.spec(&v.id).and_then(|s| s.api_key.clone());
                    (v.id, v.url, key)
                })
                .collect();
            (targets, Duration::from_millis(l.settings.probe_timeout_ms))
        });
        for batch in targets.chunks(PROBE_CONCURRENCY) {
            let probes = batch.iter().map(|(id, url, key)| async move {
                (
                    id.clone(),
                    probe_backend(url, key.as_deref(), timeout).await,
                )
            });
            let reports = futures_util::future::join_all(probes).await;
            self.with(|l| {
                let now = now_ms();
                for (id, mut report) in reports {
                    let lifecycle = l.pool.backend(&id).map(|v| v.lifecycle);
                    if let Some(failure) = settle_loading(&mut report.result, lifecycle) {
                        report.error = Some(failure.to_string());
                    }
                    // The backend may have been removed while the probe ran.
                    if l.pool.record_probe(&id, &report.result, now).is_ok() {
                        if report.result.ok {
                            l.probe_results.0 += 1;
                        } else {
                            l.probe_results.1 += 1;
                        }
                        l.probes.insert(id, report);
                    }
                }
            });
        }
        self.with(|l| {
            l.probe_rounds += 1;
            l.last_probe_ms = Some(now_ms());
            l.pool.expire(now_ms());
            finish_drains(l);
            persist_snapshots(l);
            record_history(l);
            // A round may bring a backend back or learn a larger capacity: dispatch the queue.
            l.room.wake();
        });
        self.settle_queue();
        self.push_probe_round().await;
        self.publish_card().await;
    }
}
