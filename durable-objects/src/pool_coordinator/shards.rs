//! This object as one of its pool's coordinator shards: pushing its load to its siblings, taking
//! theirs, applying shard 0's probe rounds, and matching shard 0's registry. When to push is the
//! coordinator's rule (`routing_core::coordinator::Coordinator::load_changed`: at most once per
//! `shard_exchange_ms`); pushes run after the call is answered (fire-and-forget: a sibling that
//! fails to take one gets the next). A sibling (shard k > 0) also arms its alarm at its next lease
//! deadline, since only shard 0's alarm probes.

use super::{now_ms, pool_error, ApiResult, PoolCoordinator, PoolShard};
use crate::call::{reply, send_body};
use coordinator_protocol::internal_call::ShardAddress;
use coordinator_protocol::messages::{
    shard_object_name, LoadReportAnswer, ProbeRound, ShardAck, ShardRegistry, POOL_BINDING,
};
use coordinator_protocol::{ApiError, Call, Route};
use routing_core::pool::shard::LoadReport;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;
use worker::{console_error, Delay, Env, Storage};

/// Sends `msg` (its `route` and `body` made once) to sibling `shard` of `pool`.
async fn call_sibling<M: Call>(
    env: &Env,
    pool: &str,
    shard: u32,
    route: &Route,
    body: Option<String>,
) -> std::result::Result<M::Answer, ApiError> {
    let stub = env
        .durable_object(POOL_BINDING)?
        .id_from_name(&shard_object_name(pool, shard))?
        .get_stub()?;
    let to = ShardAddress { pool, shard };
    send_body::<M>(&stub, Some(to), route, body).await
}

/// Sends `msg` to every shard in `targets`, logging failures.
async fn tell_siblings<M: Call>(env: &Env, pool: &str, targets: &[u32], msg: &M) {
    let route = msg.route();
    let body = match msg.body() {
        Ok(body) => body,
        Err(e) => {
            console_error!("pool {pool}: {}: {e}", route.path());
            return;
        }
    };
    let calls = targets
        .iter()
        .map(|&k| call_sibling::<M>(env, pool, k, &route, body.clone()));
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
async fn push_load(shard: Rc<RefCell<Option<PoolShard>>>, env: Env, storage: Storage) {
    let now = now_ms();
    let taken = shard.borrow_mut().as_mut().map(|shard| {
        let push = shard.coordinator.take_load_push(now);
        (shard.name.clone(), shard.coordinator.shard(), push)
    });
    let Some((pool, me, push)) = taken else {
        return;
    };
    tell_siblings(&env, &pool, &push.siblings, &push.report).await;
    if let Some(deadline) = push.expiry_alarm_at_ms {
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
        let Some(wait) = self.with(|shard| shard.coordinator.load_changed(now_ms())) else {
            return;
        };
        let (shard, env, storage) = (self.shard.clone(), self.env.clone(), self.state.storage());
        wasm_bindgen_futures::spawn_local(async move {
            if wait > 0 {
                Delay::from(Duration::from_millis(wait)).await;
            }
            push_load(shard, env, storage).await;
        });
    }

    /// `POST /shard/load`: a sibling's load report. On shard 0, the backends it asks to have
    /// scraped (its lease evidence) are scraped before the answer (the sibling pushes in the
    /// background).
    pub(super) async fn accept_load(&self, report: LoadReport) -> ApiResult {
        let (accepted, performed) = self.with(|shard| {
            let now = now_ms();
            let (accepted, effects) = shard.coordinator.accept_load(report, now);
            (accepted, shard.perform(effects, now))
        });
        self.follow_up(performed).await;
        reply::<LoadReport>(&LoadReportAnswer { accepted })
    }

    /// Sends the message `build` makes of this shard to every other shard.
    async fn tell_every_sibling<M: Call>(&self, build: impl FnOnce(&PoolShard) -> M) {
        let (pool, targets, msg) = self.with(|shard| {
            (
                shard.name.clone(),
                shard.coordinator.siblings(),
                build(shard),
            )
        });
        if !targets.is_empty() {
            tell_siblings(&self.env, &pool, &targets, &msg).await;
        }
    }

    /// After a probe round on shard 0: hands its results to the siblings.
    pub(super) async fn push_probe_round(&self) {
        self.tell_every_sibling(|shard| ProbeRound {
            reports: shard
                .coordinator
                .probe_reports()
                .map(|(id, r)| (id.clone(), r.clone()))
                .collect(),
        })
        .await;
    }

    /// `POST /shard/probes`: shard 0's probe round, applied as if this shard had probed.
    pub(super) fn apply_probe_round(&self, round: ProbeRound) -> ApiResult {
        self.with(|shard| {
            let now = now_ms();
            let (applied, effects) = shard.coordinator.apply_probe_round(round.reports, now);
            let _ = shard.perform(effects, now);
            reply::<ProbeRound>(&ShardAck { applied })
        })
    }

    /// After a configuration change on shard 0: makes every sibling's registry match its own, so
    /// a shard added by raising `shards` knows every backend.
    pub(super) async fn push_registry(&self) {
        self.tell_every_sibling(|shard| ShardRegistry {
            backends: shard.coordinator.registry_entries(),
            pending_delete: shard
                .coordinator
                .drains()
                .pending_deletes()
                .iter()
                .cloned()
                .collect(),
        })
        .await;
    }

    /// `POST /shard/registry`: adds, updates and removes backends to match shard 0's.
    pub(super) fn apply_registry(&self, sync: ShardRegistry) -> ApiResult {
        self.with(|shard| {
            let now = now_ms();
            let (applied, effects) =
                shard
                    .coordinator
                    .sync_registry(sync.backends, sync.pending_delete, now);
            let written = shard.perform(effects, now).check();
            let applied = applied.map_err(pool_error)?;
            written?;
            reply::<ShardRegistry>(&ShardAck { applied })
        })
    }
}
