//! This object as one of its pool's coordinator shards: pushing its load to its siblings, taking
//! theirs, applying shard 0's probe rounds, and matching shard 0's registry.
//!
//! Load exchange: a call that moves load (a lease taken, moved or ended) schedules a push of
//! `Pool::load_report` to every sibling, at once when the last push is at least
//! `shard_exchange_ms` old, else at the end of that interval; changes arriving meanwhile ride on
//! the scheduled push. So a shard pushes at most once per interval, and while its load changes its
//! siblings' copy is never older than about one interval. Pushes run after the call is answered
//! (fire-and-forget: a sibling that fails to take one gets the next). A sibling (shard k > 0)
//! also arms its alarm at its next lease deadline, since only shard 0's alarm probes.

use super::*;
use coordinator_protocol::internal_call::{internal_request, ShardAddress};
use coordinator_protocol::messages::{
    shard_object_name, LoadReportAnswer, ProbeRound, ShardAck, ShardRegistry, POOL_BINDING,
};
use routing_core::backend::BackendPatch;
use routing_core::shard::LoadReport;

/// When this shard last pushed its load, and whether a push is scheduled.
#[derive(Debug, Default)]
pub(super) struct Exchange {
    last_push_ms: u64,
    scheduled: bool,
}

/// Makes the routing core one shard of the pool's `shards` (on load and when they change).
pub(super) fn apply_shard_settings(l: &mut Live) {
    let r = &l.settings.routing;
    l.pool.set_shard(l.shard, r.shards, r.shard_exchange_ms);
}

/// The pool's other current shards.
fn siblings(l: &Live) -> Vec<u32> {
    (0..l.settings.routing.shards.max(1))
        .filter(|&k| k != l.shard)
        .collect()
}

/// Posts `body` to sibling `shard` of `pool`.
async fn call_sibling(
    env: &Env,
    pool: &str,
    shard: u32,
    route: &Route,
    body: String,
) -> std::result::Result<(), ApiError> {
    let stub = env
        .durable_object(POOL_BINDING)?
        .id_from_name(&shard_object_name(pool, shard))?
        .get_stub()?;
    let to = ShardAddress { pool, shard };
    let resp = stub
        .fetch_with_request(internal_request(route, Some(to), Some(body))?)
        .await?;
    match resp.status_code() {
        200..=299 => Ok(()),
        status => Err(ApiError::internal(format!(
            "shard {shard} answered {status}"
        ))),
    }
}

/// Posts `body` to every shard in `targets`, logging failures.
async fn tell_siblings(env: &Env, pool: &str, targets: &[u32], route: &Route, body: String) {
    let calls = targets
        .iter()
        .map(|&k| call_sibling(env, pool, k, route, body.clone()));
    for (k, result) in targets
        .iter()
        .zip(futures_util::future::join_all(calls).await)
    {
        if let Err(e) = result {
            console_error!("pool {pool}: {} to shard {k}: {e}", route.path());
        }
    }
}

/// Pushes this shard's load to its siblings now.
async fn push_load(live: Rc<RefCell<Option<Live>>>, env: Env, storage: Storage) {
    let now = now_ms();
    let taken = live.borrow_mut().as_mut().map(|l| {
        l.exchange.scheduled = false;
        l.exchange.last_push_ms = now;
        let report = serde_json::to_string(&l.pool.load_report(now));
        (
            l.name.clone(),
            siblings(l),
            report,
            l.shard,
            l.pool.next_deadline(),
        )
    });
    let Some((pool, targets, Ok(report), me, deadline)) = taken else {
        return;
    };
    tell_siblings(&env, &pool, &targets, &Route::ShardLoad, report).await;
    if let (true, Some(deadline)) = (me != 0, deadline) {
        if matches!(storage.get_alarm().await, Ok(None)) {
            let wait = deadline.saturating_sub(now_ms()) + 1;
            if let Err(e) = storage.set_alarm(wait as i64).await {
                console_error!("pool {pool} shard {me}: cannot arm the expiry alarm: {e}");
            }
        }
    }
}

impl PoolCoordinator {
    /// The load changed: push it to the siblings now, or at the end of the current interval.
    pub(super) fn load_changed(&self) {
        let now = now_ms();
        let wait = self.with(|l| {
            let r = &l.settings.routing;
            if r.shards <= 1 || l.exchange.scheduled {
                return None;
            }
            l.exchange.scheduled = true;
            Some((l.exchange.last_push_ms + r.shard_exchange_ms).saturating_sub(now))
        });
        let Some(wait) = wait else {
            return;
        };
        let (live, env, storage) = (self.live.clone(), self.env.clone(), self.state.storage());
        wasm_bindgen_futures::spawn_local(async move {
            if wait > 0 {
                Delay::from(Duration::from_millis(wait)).await;
            }
            push_load(live, env, storage).await;
        });
    }

    /// `POST /shard/load`: a sibling's load report.
    pub(super) fn accept_load(&self, report: LoadReport) -> ApiResult {
        self.with(|l| {
            let accepted = l.pool.accept_load_report(report, now_ms());
            answer(200, &LoadReportAnswer { accepted })
        })
    }

    /// On shard 0 of several: sends what `build` makes of its state to every other shard.
    async fn tell_siblings_from_shard_zero<T: serde::Serialize>(
        &self,
        route: Route,
        build: impl FnOnce(&Live) -> T,
    ) {
        let call = self.with(|l| {
            let targets = siblings(l);
            if l.shard != 0 || targets.is_empty() {
                return None;
            }
            Some((l.name.clone(), targets, serde_json::to_string(&build(l))))
        });
        if let Some((pool, targets, Ok(body))) = call {
            tell_siblings(&self.env, &pool, &targets, &route, body).await;
        }
    }

    /// After a probe round on shard 0: hands its results to the siblings.
    pub(super) async fn push_probe_round(&self) {
        self.tell_siblings_from_shard_zero(Route::ShardProbes, |l| ProbeRound {
            reports: l
                .probes
                .iter()
                .map(|(id, r)| (id.clone(), r.clone()))
                .collect(),
        })
        .await;
    }

    /// `POST /shard/probes`: shard 0's probe round, applied as if this shard had probed.
    pub(super) fn apply_probe_round(&self, round: ProbeRound) -> ApiResult {
        self.with(|l| {
            let now = now_ms();
            let mut applied = 0;
            for (id, report) in round.reports {
                // The backend may be unknown here for a moment (a registration on its way).
                if l.pool.record_probe(&id, &report.result, now).is_ok() {
                    l.probes.insert(id, report);
                    applied += 1;
                }
            }
            l.last_probe_ms = Some(now);
            l.pool.expire(now);
            finish_drains(l);
            persist_snapshots(l);
            record_history(l);
            answer(200, &ShardAck { applied })
        })
    }

    /// After a configuration change on shard 0: makes every sibling's registry match its own, so
    /// a shard added by raising `shards` knows every backend.
    pub(super) async fn push_registry(&self) {
        self.tell_siblings_from_shard_zero(Route::ShardRegistry, |l| ShardRegistry {
            backends: l
                .pool
                .backends()
                .filter_map(|v| {
                    let draining = matches!(v.lifecycle, Lifecycle::Draining | Lifecycle::Drained);
                    l.pool.spec(&v.id).map(|s| (s.clone(), draining))
                })
                .collect(),
            pending_delete: l.pending_delete.iter().cloned().collect(),
        })
        .await;
    }

    /// `POST /shard/registry`: adds, updates and removes backends to match shard 0's.
    pub(super) fn apply_registry(&self, sync: ShardRegistry) -> ApiResult {
        self.with(|l| {
            let now = now_ms();
            let mut applied = 0;
            let wanted: HashSet<BackendId> =
                sync.backends.iter().map(|(s, _)| s.id.clone()).collect();
            let gone: Vec<BackendId> = l
                .pool
                .backends()
                .map(|v| v.id)
                .filter(|id| !wanted.contains(id))
                .collect();
            for id in gone {
                remove_backend(l, &id)?;
                applied += 1;
            }
            for (spec, draining) in sync.backends {
                let id = spec.id.clone();
                match l.pool.spec(&id) {
                    Some(held) if *held == spec => {}
                    Some(_) => {
                        l.pool
                            .update_backend(&id, &full_patch(&spec), now)
                            .map_err(pool_error)?;
                        l.registry.put_spec(&spec)?;
                        applied += 1;
                    }
                    None => {
                        l.pool.add_backend(spec.clone(), now).map_err(pool_error)?;
                        l.registry.put_spec(&spec)?;
                        applied += 1;
                    }
                }
                let lifecycle = l.pool.backend(&id).map(|v| v.lifecycle);
                let to = match (draining, lifecycle) {
                    (true, Some(Lifecycle::Pending | Lifecycle::Ready)) => {
                        Some(Lifecycle::Draining)
                    }
                    (false, Some(Lifecycle::Draining | Lifecycle::Drained)) => {
                        Some(Lifecycle::Ready)
                    }
                    _ => None,
                };
                if let Some(to) = to {
                    l.pool.set_lifecycle(&id, to, now).map_err(pool_error)?;
                }
            }
            l.pending_delete = sync.pending_delete.into_iter().collect();
            l.registry.set_meta("pending_delete", &l.pending_delete)?;
            finish_drains(l);
            persist_snapshots(l);
            answer(200, &ShardAck { applied })
        })
    }
}

/// A patch that makes a backend's spec `spec`.
fn full_patch(spec: &BackendSpec) -> BackendPatch {
    BackendPatch {
        url: Some(spec.url.clone()),
        region: Some(spec.region.clone()),
        models: Some(spec.models.clone()),
        weight: Some(spec.weight),
        role: Some(spec.role),
        api_key: Some(spec.api_key.clone()),
        capacity: Some(spec.capacity),
    }
}
