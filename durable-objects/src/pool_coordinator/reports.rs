//! What the pool reports and how it is set: its settings, its summary, its metrics and
//! the last hour's history.

use super::{coordinator_settings, now_ms, ApiResult, PoolCoordinator, PoolShard};
use crate::call::answer;
use coordinator_protocol::call::Reply;
use coordinator_protocol::messages::{Autoscaling, PoolHistory, PoolSummary, QueueSummary};
use coordinator_protocol::settings::PoolSettings;
use coordinator_protocol::ApiError;
use routing_core::admission::DropReason;

impl PoolCoordinator {
    pub(super) async fn put_config(&self, settings: PoolSettings) -> ApiResult {
        settings.validate()?;
        let (applied, performed) = self.with(|shard| {
            let effects = shard
                .coordinator
                .set_settings(coordinator_settings(&settings))
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            shard.registry.set_meta("config", &settings)?;
            shard.settings = settings;
            let performed = shard.perform(effects, now_ms());
            Ok::<_, ApiError>((answer(200, &shard.settings)?, performed))
        })?;
        // Shard 0 brings its siblings' registries in line (a new shard starts empty).
        self.follow_up(performed).await;
        Ok(applied)
    }

    pub(super) fn summary(&self) -> ApiResult {
        self.with(|shard| answer(200, &summary(shard)))
    }

    pub(super) fn metrics(&self) -> ApiResult {
        let text = self.with(|shard| {
            let mut out = String::new();
            shard.coordinator.render_metrics(&shard.name, &mut out);
            out
        });
        Ok(Reply {
            status: 200,
            content_type: "text/plain; version=0.0.4",
            headers: Vec::new(),
            body: text,
        })
    }

    /// The last hour, minute by minute, including the current minute so far.
    pub(super) fn history(&self) -> ApiResult {
        self.with(|shard| {
            let report = shard.coordinator.history_report(now_ms());
            answer(
                200,
                &PoolHistory {
                    pool: shard.name.clone(),
                    report,
                },
            )
        })
    }
}

/// The pool at a glance (`GET /state`).
fn summary(shard: &PoolShard) -> PoolSummary {
    let coordinator = &shard.coordinator;
    let settings = &shard.settings;
    let load = coordinator.load();
    let pool = coordinator.pool();
    let counters = coordinator.counters();
    PoolSummary {
        pool: shard.name.clone(),
        region: settings.routing.region.clone(),
        policy: settings.routing.policy,
        backends: pool.backend_count(),
        ready_backends: load.ready,
        in_flight: pool.live_leases(),
        in_flight_tokens: pool.in_flight_total(),
        waiting: load.waiting,
        running: load.running,
        saturated: load.saturated,
        queue: queue_summary(shard),
        autoscaling: Autoscaling {
            target_waiting_per_replica: settings.autoscale_target_waiting,
            desired_replicas: load.desired_replicas,
        },
        retries: counters.retries,
        spills: counters.spills,
        last_probe_ms: coordinator.last_probe_ms(),
        probe_rounds: counters.probe_rounds,
        retry_budget_exhausted: counters.retry_budget_exhausted,
        jurisdiction: settings.jurisdiction.clone(),
        time_card: None,
    }
}

/// The admission queue as `GET /admin/pools/{pool}` shows it.
fn queue_summary(shard: &PoolShard) -> QueueSummary {
    let q = &shard.coordinator.room().queue;
    let s = q.stats();
    QueueSummary {
        enabled: shard.settings.routing.admission.enabled,
        length: q.len(),
        by_priority: q
            .lengths_by_priority()
            .into_iter()
            .map(|(p, n)| (p.to_string(), n))
            .collect(),
        tenants: q.tenants(),
        oldest_wait_ms: q.oldest_arrival_ms().map(|a| now_ms().saturating_sub(a)),
        waiting_tokens: q.waiting_tokens(),
        admitted: s.admitted,
        queued: s.queued,
        reentered: s.reentered,
        dropped: DropReason::ALL
            .iter()
            .map(|r| (r.as_str().to_string(), s.dropped(*r)))
            .collect(),
    }
}
