//! The pool coordinator: one Durable Object per GPU pool, the single authority for that pool's
//! backends, their health and breakers, the requests in flight on them, and the prefix-affinity
//! table. The decisions themselves are `routing_core::pool::Pool`'s; this file is the adapter that
//! gives it time, randomness, persistence and an HTTP surface.
//!
//! Response bytes never pass through here: the Worker acquires a lease, streams from the backend
//! itself, reassigns the lease if it must retry elsewhere, and releases it when the stream ends.
//! Leases also expire on a deadline, so a Worker that dies never leaks load. Probes run from this
//! object's alarm, which re-arms itself and which the cron trigger makes sure is armed.
//!
//! Persisted in SQLite: backend specs, their lifecycle/health/breaker snapshots, pool settings.
//! In memory only: leases, affinity, the retry budget, the last probe reports, and the last hour's
//! per-minute history (`routing_core::history`, for the dashboard).
//!
//! A pool may run on several such objects, its coordinator shards (`shards` in its settings; see
//! `routing_core::shard`): shard 0 is the object named after the pool, shard k the object
//! `pool#k`, and every call names its shard in `x-gateway-shard`. Each shard owns its leases,
//! affinity and queue; shards push their load to each other ([`shards`]); only shard 0 probes,
//! and it hands each round's results to the others.
//!
//! This file holds the object, its memory and the dispatch of each call; the handlers are grouped
//! by job: [`acquire`], [`leases`], [`backends`], [`probing`], [`reports`] and [`shards`].

mod acquire;
mod backends;
mod card;
mod leases;
mod probing;
mod reports;
mod shards;

use backends::{finish_drains, persist_backends, persist_snapshots, remove_backend};
use reports::record_history;

use crate::call::{answer, parse_route, read_body};
use crate::probe::{probe_backend, ProbeReport};
use crate::registry::{
    validate_models, validate_name, validate_registration, validate_url, Registry,
};
use crate::waiting_room::{Step, Verdict, WaitingRoom};
use coordinator_protocol::acquire::AcquireRequest;
use coordinator_protocol::messages::{
    AdminBackend, AdminPatch, AlarmAnswer, Autoscaling, BackendList, BackendRegistration,
    DeleteAnswer, DequeueAnswer, DequeueRequest, ModelsAnswer, PoolHistory, PoolSummary,
    PrefillDone, PrefillDoneAnswer, QueueSummary, Queued, ReassignRequest, ReleaseAnswer,
    ReleaseBatch, ReleaseBatchAnswer, ReleaseRequest, RenewAnswer, RenewRequest, POOL_HEADER,
    SHARD_HEADER,
};
pub use coordinator_protocol::settings::PoolSettings;
use coordinator_protocol::{ApiError, Object, Route};
use futures_util::future::{select, Either};
use routing_core::admission::DropReason;
use routing_core::backend::{BackendId, BackendSpec, Lifecycle};
use routing_core::coordinator_metrics::{self, CoordinatorCounters, LastProbe};
use routing_core::drain::drain_finished;
use routing_core::health::HealthState;
use routing_core::history::{self, History};
use routing_core::pool::{BackendSnapshot, Pool, PoolError};
use routing_core::pool_load::{LoadTargets, PoolLoad};
use routing_core::probe_verdict::settle_loading;
use routing_core::random::SplitMix64;
use routing_core::reassign::{reassign, RetryRefused};
use routing_core::retry_budget::RetryBudget;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;
use worker::*;

/// Default time between probe rounds (the `PROBE_INTERVAL_MS` var overrides it).
pub const DEFAULT_PROBE_INTERVAL_MS: u64 = 10_000;
/// Most backends probed at once (the platform allows six outbound connections per invocation).
const PROBE_CONCURRENCY: usize = 6;

/// Live state of one pool.
#[durable_object]
pub struct PoolCoordinator {
    state: State,
    env: Env,
    /// Shared with the load pushes that run after a call has been answered.
    live: Rc<RefCell<Option<Live>>>,
    /// A probe round is running (rounds never overlap: a second one would double-count the
    /// health hysteresis).
    probing: std::cell::Cell<bool>,
    /// A round was asked for while one ran: run one more after it (its targets may be new).
    probe_again: std::cell::Cell<bool>,
}

/// What the coordinator keeps in memory (rebuilt from the registry after a restart).
struct Live {
    name: String,
    /// This object's shard index (0: the pool's own object, which alone probes).
    shard: u32,
    /// When this shard last pushed its load to its siblings, and whether a push is scheduled.
    exchange: shards::Exchange,
    registry: Registry,
    pool: Pool,
    settings: PoolSettings,
    rng: SplitMix64,
    budget: RetryBudget,
    probes: HashMap<BackendId, ProbeReport>,
    /// Backends whose `DELETE` waits for their drain to finish.
    pending_delete: HashSet<BackendId>,
    /// When each draining backend's drain started (persisted, so a restart knows it drains).
    drain_started: HashMap<BackendId, u64>,
    /// After a restart: until when no drain of a backend restored from storage may finish, so
    /// the streams still running on it renew first (`routing_core::drain`); 0 once over.
    drain_hold_until_ms: u64,
    /// The backends restored at the restart (those whose streams the pool may have forgotten).
    restored: HashSet<BackendId>,
    probe_rounds: u64,
    last_probe_ms: Option<u64>,
    /// Leases moved to another backend after a failure (retries).
    retries: u64,
    /// Acquires refused because the pool was saturated and another pool could take the work.
    spills: u64,
    /// Probe outcomes: (successes, failures).
    probe_results: (u64, u64),
    /// Admission control's queue and the acquires waiting on it.
    room: WaitingRoom,
    /// The pool's load summary as of the last probe round or registry change (what spillover
    /// reads on every acquire, so that no acquire walks the whole fleet for it).
    load: PoolLoad,
    /// Each backend's state as last written to SQLite (only changes are written).
    persisted: HashMap<BackendId, BackendSnapshot>,
    /// Per-minute aggregates of the last hour, for the dashboard.
    history: History,
    /// Acquires by why the Worker chose this pool.
    routed: routing_core::region::RoutedCounts,
    /// The time card grants carry, kept for a quarter second.
    grant_card: Option<routing_core::region::TimeCard>,
}

/// The pool's load, measured now.
fn pool_load(l: &Live) -> PoolLoad {
    let targets = LoadTargets {
        saturation_waiting_per_backend: l.settings.saturation_waiting_per_backend,
        autoscale_target_waiting: l.settings.autoscale_target_waiting,
    };
    PoolLoad::measure(l.pool.backends(), l.room.queue.len(), &targets)
}

type ApiResult = std::result::Result<Response, ApiError>;

fn now_ms() -> u64 {
    Date::now().as_millis()
}

/// A registry or lease operation's error, worded for the caller (`coordinator_protocol::refusal`).
fn pool_error(e: PoolError) -> ApiError {
    ApiError::from(e)
}

impl DurableObject for PoolCoordinator {
    fn new(state: State, env: Env) -> Self {
        PoolCoordinator {
            state,
            env,
            live: Rc::new(RefCell::new(None)),
            probing: std::cell::Cell::new(false),
            probe_again: std::cell::Cell::new(false),
        }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        let name = req.headers().get(POOL_HEADER).ok().flatten();
        let shard = req.headers().get(SHARD_HEADER).ok().flatten();
        let shard = match shard.map(|s| s.parse::<u32>()) {
            None => None,
            Some(Ok(k)) if k < routing_core::shard::MAX_SHARDS => Some(k),
            Some(_) => {
                return ApiError::bad_request("x-gateway-shard must be a shard index").to_response()
            }
        };
        if let Err(e) = self.load(name.as_deref(), shard) {
            return e.to_response();
        }
        let result = match parse_route(&req, Object::Pool) {
            Ok(route) => {
                let moves_load = route.moves_load();
                // A lease that ends frees room through the pool's freed list; a registry, probe,
                // configuration or sibling change may free room too: it wakes the queue. Reads
                // and renewals cost no dispatch.
                let read_only = matches!(
                    route,
                    Route::Summary
                        | Route::Metrics
                        | Route::History
                        | Route::GetConfig
                        | Route::ListBackends
                        | Route::ShowBackend(_)
                        | Route::Models
                );
                let result = self.handle(route, &mut req).await;
                if !moves_load && !read_only {
                    self.with(|l| l.room.wake());
                }
                if moves_load {
                    self.load_changed();
                }
                result
            }
            Err(e) => Err(e),
        };
        // Whatever the call changed (a lease ended, a backend came back, settings) may let a
        // queued request in; a call that changed nothing costs no dispatch.
        self.settle_queue();
        result.or_else(|e| e.to_response())
    }

    async fn alarm(&self) -> Result<Response> {
        if let Err(e) = self.load(None, None) {
            return e.to_response();
        }
        self.with(|l| {
            l.pool.expire(now_ms());
            finish_drains(l);
        });
        self.settle_queue();
        if self.with(|l| l.shard) != 0 {
            // Probing runs once per pool, on shard 0; a sibling's alarm only expires leases.
            self.load_changed();
            return Response::ok("expired");
        }
        self.probe_all().await;
        self.state
            .storage()
            .set_alarm(self.probe_interval_ms() as i64)
            .await?;
        Response::ok("probed")
    }
}

impl PoolCoordinator {
    /// Runs one call.
    async fn handle(&self, route: Route, req: &mut Request) -> ApiResult {
        match route {
            Route::Acquire { spill_ok } => {
                let signal: web_sys::AbortSignal = req.inner().signal();
                let body = read_body(req, "acquire request").await?;
                self.acquire(body, spill_ok, signal).await
            }
            Route::Dequeue => self.dequeue(read_body(req, "dequeue request").await?),
            Route::Reassign => {
                self.reassign(read_body(req, "reassign request").await?)
                    .await
            }
            Route::Release => self.release(read_body(req, "release request").await?),
            Route::ReleaseBatch => self.release_batch(read_body(req, "release batch").await?),
            Route::Renew => self.renew(read_body(req, "renew request").await?),
            Route::PrefillDone => self.prefill_done(read_body(req, "prefill report").await?),
            Route::RegisterBackend => {
                self.register(read_body(req, "backend registration").await?)
                    .await
            }
            Route::ListBackends => self.list(),
            Route::ShowBackend(id) => self.show(&id),
            Route::PatchBackend(id) => {
                let patch: AdminPatch = read_body(req, "backend patch").await?;
                let drain = patch.drain.is_some();
                let result = self.patch(&id, patch);
                if result.is_ok() && drain {
                    // Re-enabled (or drained): probe now rather than at the next round.
                    self.probe_soon().await;
                }
                result
            }
            Route::DeleteBackend { id, force } => self.delete(&id, force),
            Route::Models => self.models(),
            Route::GetConfig => self.with(|l| answer(200, &l.settings)),
            Route::PutConfig => {
                self.put_config(read_body(req, "pool configuration").await?)
                    .await
            }
            Route::Summary => self.summary(),
            Route::Metrics => self.metrics(),
            Route::History => self.history(),
            Route::EnsureProbeAlarm => self.ensure_alarm().await,
            Route::ShardLoad => self.accept_load(read_body(req, "load report").await?),
            Route::ShardProbes => self.apply_probe_round(read_body(req, "probe round").await?),
            Route::ShardRegistry => self.apply_registry(read_body(req, "shard registry").await?),
            Route::ProbeNow => {
                // Asked for explicitly: wait out a round in progress, then run a fresh one.
                while self.probing.get() {
                    Delay::from(Duration::from_millis(20)).await;
                }
                self.probe_all().await;
                self.summary()
            }
            _ => Err(ApiError::not_found("a pool has no such route")),
        }
    }

    /// Loads the registry into memory on first use after a (re)start.
    fn load(&self, name: Option<&str>, shard: Option<u32>) -> std::result::Result<(), ApiError> {
        if let Some(live) = self.live.borrow_mut().as_mut() {
            if let Some(n) = name.filter(|n| *n != live.name) {
                live.name = n.to_string();
                live.registry.set_meta("name", &live.name)?;
            }
            if let Some(k) = shard.filter(|k| *k != live.shard) {
                live.shard = k;
                live.registry.set_meta("shard", &k)?;
                shards::apply_shard_settings(live);
            }
            return Ok(());
        }
        let registry = Registry::open(self.state.storage().sql())?;
        let stored_name: Option<String> = registry.meta("name");
        let name = name
            .map(str::to_string)
            .or(stored_name.clone())
            .unwrap_or_else(|| "unnamed".to_string());
        if stored_name.as_deref() != Some(&name) {
            registry.set_meta("name", &name)?;
        }
        let stored_shard: Option<u32> = registry.meta("shard");
        let shard = shard.or(stored_shard).unwrap_or(0);
        if stored_shard != Some(shard) {
            registry.set_meta("shard", &shard)?;
        }
        let mut settings: PoolSettings = registry.meta("config").unwrap_or_default();
        if settings.validate().is_err() {
            settings = PoolSettings::default();
        }
        let mut pool = Pool::new(&name, settings.routing.clone());
        let now = now_ms();
        for (spec, snapshot) in registry.backends()? {
            let id = spec.id.clone();
            if let Err(e) = pool.add_backend(spec, now) {
                console_error!("pool {name}: cannot restore backend {id}: {e}");
                continue;
            }
            if let Some(snapshot) = snapshot {
                let _ = pool.restore(&snapshot);
            }
        }
        let pending_delete: HashSet<BackendId> =
            registry.meta("pending_delete").unwrap_or_default();
        let drain_started: HashMap<BackendId, u64> =
            registry.meta("drain_started").unwrap_or_default();
        // Leases are memory only: a restored backend may still run streams that renew within a
        // lease lifetime, so its drain (and any delete waiting for it) waits that long.
        let restored: HashSet<BackendId> = pool.backends().map(|v| v.id).collect();
        let drain_hold_until_ms = if restored.is_empty() {
            0
        } else {
            routing_core::drain::restart_hold_until(now, settings.routing.lease_ttl_ms)
        };
        for (id, at) in &drain_started {
            console_log!(
                "pool {name}: backend {} has drained since {at}; held until {drain_hold_until_ms}",
                id.0
            );
        }
        let seed = now ^ (js_sys::Math::random() * u64::MAX as f64) as u64;
        *self.live.borrow_mut() = Some(Live {
            name,
            shard,
            exchange: shards::Exchange::default(),
            registry,
            pool,
            settings,
            rng: SplitMix64::new(seed),
            budget: RetryBudget::new(),
            probes: HashMap::new(),
            pending_delete,
            drain_started,
            drain_hold_until_ms,
            restored,
            probe_rounds: 0,
            last_probe_ms: None,
            retries: 0,
            spills: 0,
            probe_results: (0, 0),
            room: WaitingRoom::default(),
            history: History::default(),
            load: PoolLoad::default(),
            persisted: HashMap::new(),
            routed: Default::default(),
            grant_card: None,
        });
        self.with(|l| {
            shards::apply_shard_settings(l);
            l.load = pool_load(l);
            l.persisted = l
                .pool
                .snapshots()
                .into_iter()
                .map(|s| (s.id.clone(), s))
                .collect();
        });
        Ok(())
    }

    fn with<R>(&self, f: impl FnOnce(&mut Live) -> R) -> R {
        let mut guard = self.live.borrow_mut();
        f(guard.as_mut().expect("load() runs before every handler"))
    }

    fn probe_interval_ms(&self) -> u64 {
        let configured = self.with(|l| l.settings.probe_interval_ms);
        if configured > 0 {
            return configured;
        }
        self.env
            .var("PROBE_INTERVAL_MS")
            .ok()
            .and_then(|v| v.to_string().parse().ok())
            .filter(|&v: &u64| v >= 100)
            .unwrap_or(DEFAULT_PROBE_INTERVAL_MS)
    }
}
