//! What the pool reports and how it is set: its settings, its summary, its metrics and
//! the last hour's history.

use super::*;

impl PoolCoordinator {
    pub(super) async fn put_config(&self, settings: PoolSettings) -> ApiResult {
        settings.validate()?;
        let applied = self.with(|l| {
            l.pool
                .set_config(settings.routing.clone())
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            l.registry.set_meta("config", &settings)?;
            let old = &l.settings.routing;
            let reshard = (old.shards, old.shard_exchange_ms)
                != (settings.routing.shards, settings.routing.shard_exchange_ms);
            l.settings = settings;
            if reshard {
                shards::apply_shard_settings(l);
            }
            l.load = pool_load(l);
            answer(200, &l.settings)
        })?;
        // Shard 0 brings its siblings' registries in line (a new shard starts empty).
        self.push_registry().await;
        Ok(applied)
    }

    pub(super) fn summary(&self) -> ApiResult {
        self.with(|l| answer(200, &summary(l)))
    }

    pub(super) fn metrics(&self) -> ApiResult {
        let text = self.with(|l| {
            let mut out = String::new();
            l.pool.render_metrics(&mut out);
            render_pool_metrics(l, &mut out);
            l.routed.render(&l.name, &mut out);
            l.room.queue.render_metrics(&l.name, &mut out);
            out
        });
        let mut resp = Response::ok(text)?;
        resp.headers_mut()
            .set("content-type", "text/plain; version=0.0.4")?;
        Ok(resp)
    }

    /// The last hour, minute by minute, including the current minute so far.
    pub(super) fn history(&self) -> ApiResult {
        self.with(|l| {
            record_history(l);
            answer(
                200,
                &PoolHistory {
                    pool: l.name.clone(),
                    report: l.history.report(now_ms()),
                },
            )
        })
    }
}

/// Adds what the pool's counters (and the backends' scraped prefix-cache counters) gained since
/// the last call to the current minute of the history.
pub(super) fn record_history(l: &mut Live) {
    let mut totals = history::totals(&l.pool);
    for (id, report) in &l.probes {
        totals.set_cache_counters(
            id,
            report.metrics.prefix_cache_queries,
            report.metrics.prefix_cache_hits,
        );
    }
    l.history.record(now_ms(), totals);
}

/// The coordinator's own metric families, beside the routing core's.
pub(super) fn render_pool_metrics(l: &Live, out: &mut String) {
    let counters = CoordinatorCounters {
        retries: l.retries,
        retry_budget_exhausted: l.budget.exhausted_total(),
        spills: l.spills,
        probe_rounds: l.probe_rounds,
        probes_ok: l.probe_results.0,
        probes_failed: l.probe_results.1,
    };
    let mut probes: Vec<LastProbe> = l
        .probes
        .iter()
        .map(|(id, r)| LastProbe {
            backend: &id.0,
            ok: r.result.ok,
            duration_ms: r.duration_ms,
            at_ms: r.at_ms,
        })
        .collect();
    probes.sort_by_key(|p| p.backend);
    let target = l.settings.autoscale_target_waiting;
    coordinator_metrics::render(out, &l.name, &counters, &pool_load(l), target, &probes);
}

/// The pool at a glance (`GET /state`).
pub(super) fn summary(l: &Live) -> PoolSummary {
    let load = pool_load(l);
    PoolSummary {
        pool: l.name.clone(),
        region: l.settings.routing.region.clone(),
        policy: l.settings.routing.policy,
        backends: l.pool.backend_count(),
        ready_backends: load.ready,
        in_flight: l.pool.live_leases(),
        in_flight_tokens: l.pool.in_flight_total(),
        waiting: load.waiting,
        running: load.running,
        saturated: load.saturated,
        queue: queue_summary(l),
        autoscaling: Autoscaling {
            target_waiting_per_replica: l.settings.autoscale_target_waiting,
            desired_replicas: load.desired_replicas,
        },
        retries: l.retries,
        spills: l.spills,
        last_probe_ms: l.last_probe_ms,
        probe_rounds: l.probe_rounds,
        retry_budget_exhausted: l.budget.exhausted_total(),
        jurisdiction: l.settings.jurisdiction.clone(),
        time_card: None,
    }
}

/// The admission queue as `GET /admin/pools/{pool}` shows it.
pub(super) fn queue_summary(l: &Live) -> QueueSummary {
    let q = &l.room.queue;
    let s = q.stats();
    QueueSummary {
        enabled: l.settings.routing.admission.enabled,
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
