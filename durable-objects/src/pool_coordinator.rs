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
    ReleaseRequest, RenewAnswer, RenewRequest, POOL_HEADER, QUEUE_DROP_HEADER, QUEUE_WAIT_HEADER,
};
pub use coordinator_protocol::settings::PoolSettings;
use coordinator_protocol::{ApiError, Object, Route};
use futures_util::future::{select, Either};
use routing_core::admission::DropReason;
use routing_core::backend::{BackendId, Lifecycle};
use routing_core::coordinator_metrics::{self, CoordinatorCounters, LastProbe};
use routing_core::drain::drain_finished;
use routing_core::health::HealthState;
use routing_core::history::{self, History};
use routing_core::pool::{AcquireError, BackendSnapshot, Pool, PoolError};
use routing_core::pool_load::{LoadTargets, PoolLoad};
use routing_core::probe_verdict::settle_loading;
use routing_core::random::SplitMix64;
use routing_core::reassign::{reassign, FailedAttempt, RetryRefused};
use routing_core::retry_budget::RetryBudget;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
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
    live: RefCell<Option<Live>>,
    /// A probe round is running (rounds never overlap: a second one would double-count the
    /// health hysteresis).
    probing: std::cell::Cell<bool>,
    /// A round was asked for while one ran: run one more after it (its targets may be new).
    probe_again: std::cell::Cell<bool>,
}

/// What the coordinator keeps in memory (rebuilt from the registry after a restart).
struct Live {
    name: String,
    registry: Registry,
    pool: Pool,
    settings: PoolSettings,
    rng: SplitMix64,
    budget: RetryBudget,
    probes: HashMap<BackendId, ProbeReport>,
    /// Backends whose `DELETE` waits for their drain to finish.
    pending_delete: HashSet<BackendId>,
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

fn pool_error(e: PoolError) -> ApiError {
    match e {
        PoolError::UnknownBackend { .. } => ApiError::not_found(e.to_string()),
        PoolError::DuplicateBackend { .. } => ApiError::conflict(e.to_string()),
        PoolError::UnknownLease { .. } => ApiError::not_found(e.to_string()),
        PoolError::BackendUnavailable { .. } => ApiError::unavailable(e.to_string(), 1),
        PoolError::InvalidSpec { .. } | PoolError::InvalidTransition { .. } => {
            ApiError::bad_request(e.to_string())
        }
    }
}

impl DurableObject for PoolCoordinator {
    fn new(state: State, env: Env) -> Self {
        PoolCoordinator {
            state,
            env,
            live: RefCell::new(None),
            probing: std::cell::Cell::new(false),
            probe_again: std::cell::Cell::new(false),
        }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        let name = req.headers().get(POOL_HEADER).ok().flatten();
        if let Err(e) = self.load(name.as_deref()) {
            return e.to_response();
        }
        let result = match parse_route(&req, Object::Pool) {
            Ok(route) => self.handle(route, &mut req).await,
            Err(e) => Err(e),
        };
        // Whatever the call changed (a lease ended, a backend came back, settings) may let a
        // queued request in.
        self.settle_queue();
        result.or_else(|e| e.to_response())
    }

    async fn alarm(&self) -> Result<Response> {
        if let Err(e) = self.load(None) {
            return e.to_response();
        }
        self.with(|l| {
            l.pool.expire(now_ms());
            finish_drains(l);
        });
        self.settle_queue();
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
            Route::PutConfig => self.put_config(read_body(req, "pool configuration").await?),
            Route::Summary => self.summary(),
            Route::Metrics => self.metrics(),
            Route::History => self.history(),
            Route::EnsureProbeAlarm => self.ensure_alarm().await,
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
    fn load(&self, name: Option<&str>) -> std::result::Result<(), ApiError> {
        if let Some(live) = self.live.borrow_mut().as_mut() {
            if let Some(n) = name.filter(|n| *n != live.name) {
                live.name = n.to_string();
                live.registry.set_meta("name", &live.name)?;
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
        let seed = now ^ (js_sys::Math::random() * u64::MAX as f64) as u64;
        *self.live.borrow_mut() = Some(Live {
            name,
            registry,
            pool,
            settings,
            rng: SplitMix64::new(seed),
            budget: RetryBudget::new(),
            probes: HashMap::new(),
            pending_delete,
            probe_rounds: 0,
            last_probe_ms: None,
            retries: 0,
            spills: 0,
            probe_results: (0, 0),
            room: WaitingRoom::default(),
            history: History::default(),
            load: PoolLoad::default(),
            persisted: HashMap::new(),
        });
        self.with(|l| {
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

    async fn acquire(
        &self,
        req: AcquireRequest,
        spill_ok: bool,
        signal: web_sys::AbortSignal,
    ) -> ApiResult {
        let (features, admission) = req.into_parts();
        let step = self.with(|l| {
            let now = now_ms();
            let admission_config = l.settings.routing.admission;
            let queueing =
                admission_config.enabled || l.room.knows(admission.as_ref().and_then(|a| a.ticket));
            let continuing = admission.as_ref().is_some_and(|a| a.ticket.is_some());
            if l.load.spills(spill_ok, continuing) {
                l.spills += 1;
                return Err(
                    ApiError::unavailable("This pool is saturated; try the next pool.", 1)
                        .with_code("pool_saturated"),
                );
            }
            let Live {
                pool, rng, room, ..
            } = l;
            if !queueing {
                return Ok(match pool.acquire(&features, now, rng) {
                    Ok(grant) => Step::Done(Verdict::Granted {
                        grant,
                        waited_ms: 0,
                    }),
                    Err(e) => Step::Refused(e),
                });
            }
            let who = admission.unwrap_or_default();
            Ok(room.enter(
                pool,
                &admission_config,
                features,
                &who,
                spill_ok,
                Some(signal),
                now,
                rng,
            ))
        })?;
        let (ticket, call_id, rx, until_ms) = match step {
            Step::Done(verdict) => return self.answer(verdict),
            Step::Spill => {
                self.with(|l| l.spills += 1);
                return Err(ApiError::unavailable(
                    "Every backend of this pool is at capacity; try the next pool.",
                    1,
                )
                .with_code("pool_at_capacity"));
            }
            Step::Refused(AcquireError::ModelNotFound { model }) => {
                return Err(ApiError::model_not_found(&model))
            }
            Step::Refused(AcquireError::NoBackendAvailable { retry_after_s }) => {
                return Err(ApiError::unavailable(
                    "No backend in this pool can take the request now.",
                    retry_after_s.clamp(1, 3600) as u32,
                ))
            }
            Step::Refused(AcquireError::AtCapacity) => {
                return Err(
                    ApiError::unavailable("Every backend of this pool is at capacity.", 1)
                        .with_code("pool_at_capacity"),
                )
            }
            Step::Wait {
                ticket,
                call_id,
                rx,
                until_ms,
            } => (ticket, call_id, rx, until_ms),
        };
        let timer = Delay::from(Duration::from_millis(
            until_ms.saturating_sub(now_ms()).max(1),
        ));
        let verdict = match select(rx, timer).await {
            Either::Left((Ok(verdict), _)) => Some(verdict),
            // A newer call with the same ticket took over.
            Either::Left((Err(_), _)) => None,
            Either::Right((_, mut rx)) => self.with(|l| {
                let now = now_ms();
                let Live {
                    pool,
                    rng,
                    room,
                    settings,
                    ..
                } = l;
                room.settle(pool, &settings.routing.admission, now, rng);
                room.pause(ticket, call_id, &mut rx, now)
            }),
        };
        match verdict {
            Some(verdict) => self.answer(verdict),
            None => {
                let queue_length = self.with(|l| l.room.queue.len());
                answer(
                    202,
                    &Queued {
                        ticket,
                        queue_length,
                    },
                )
            }
        }
    }

    /// The answer to an acquire whose wait ended.
    fn answer(&self, verdict: Verdict) -> ApiResult {
        match verdict {
            Verdict::Granted { grant, waited_ms } => {
                self.with(|l| l.budget.record_request(now_ms(), &l.settings.retry_budget));
                let mut resp = answer(200, &grant)?;
                resp.headers_mut()
                    .set(QUEUE_WAIT_HEADER, &waited_ms.to_string())?;
                Ok(resp)
            }
            Verdict::Dropped { reason, waited_ms } => {
                Err(self.with(|l| drop_error(l, reason, waited_ms)))
            }
        }
    }

    /// `POST /dequeue`: a queued request's client left.
    fn dequeue(&self, req: DequeueRequest) -> ApiResult {
        self.with(|l| {
            let Live { pool, room, .. } = l;
            let left = room.dequeue(pool, req.ticket, now_ms());
            answer(200, &DequeueAnswer { dequeued: left })
        })
    }

    /// Lets queued requests in if backends have room (and drops those whose client left).
    fn settle_queue(&self) {
        self.with(|l| {
            let Live {
                pool,
                rng,
                room,
                settings,
                ..
            } = l;
            room.settle(pool, &settings.routing.admission, now_ms(), rng);
        });
    }

    async fn reassign(&self, req: ReassignRequest) -> ApiResult {
        if req.missing_model.is_some() {
            // Its served models changed: probe now rather than at the next round.
            self.probe_soon().await;
        }
        self.with(|l| {
            let attempt = FailedAttempt {
                lease_id: req.lease_id,
                to: &req.to,
                failure: &req.failure,
                terms: req.terms.as_ref(),
                block_hashes: &req.block_hashes,
                missing_model: req.missing_model.as_deref(),
            };
            let Live {
                pool,
                budget,
                settings,
                ..
            } = l;
            let done = reassign(pool, budget, &settings.retry_budget, &attempt, now_ms());
            let failed = req.terms.as_ref().map(|t| &t.backend);
            if let (true, Some(backend), Some(model)) =
                (done.forgot_model, failed, &req.missing_model)
            {
                console_log!(
                    "pool {}: backend {} no longer serves {model}",
                    l.name,
                    backend.0
                );
            }
            match done.result {
                Ok(candidate) => {
                    l.retries += 1;
                    persist_backends(l, &[failed, Some(&req.to)]);
                    answer(200, &candidate)
                }
                Err(RetryRefused::BudgetExhausted) => {
                    persist_backends(l, &[failed]);
                    Err(
                        ApiError::unavailable("The pool's retry budget is exhausted.", 1)
                            .with_code("retry_budget_exhausted"),
                    )
                }
                Err(RetryRefused::Pool(e)) => {
                    persist_backends(l, &[failed, Some(&req.to)]);
                    Err(pool_error(e))
                }
            }
        })
    }

    fn renew(&self, req: RenewRequest) -> ApiResult {
        self.with(|l| {
            let now = now_ms();
            let (deadline_ms, reestablished) = match l.pool.renew(req.lease_id, now) {
                Ok(d) => (d, false),
                Err(_) => (
                    l.pool
                        .readmit(req.lease_id, &req.terms, now)
                        .map_err(pool_error)?,
                    true,
                ),
            };
            answer(
                200,
                &RenewAnswer {
                    deadline_ms,
                    reestablished,
                },
            )
        })
    }

    fn prefill_done(&self, req: PrefillDone) -> ApiResult {
        self.with(|l| {
            let ended = l.pool.finish_prefill(req.lease_id, &req.outcome, now_ms());
            if ended {
                persist_backends(l, &[req.backend.as_ref()]);
            }
            answer(200, &PrefillDoneAnswer { ended })
        })
    }

    fn release(&self, req: ReleaseRequest) -> ApiResult {
        self.with(|l| {
            let released = l.pool.release(req.lease_id, &req.outcome, now_ms());
            if released {
                persist_backends(l, &[req.backend.as_ref()]);
            }
            finish_drains(l);
            answer(200, &ReleaseAnswer { released })
        })
    }

    async fn register(&self, reg: BackendRegistration) -> ApiResult {
        let spec = validate_registration(reg)?;
        let view = self.with(|l| {
            if l.registry.url_taken(&spec.url, &spec.id.0)? {
                return Err(ApiError::conflict(
                    "a backend with this URL is already registered",
                ));
            }
            l.pool
                .add_backend(spec.clone(), now_ms())
                .map_err(pool_error)?;
            if let Err(e) = l.registry.put_spec(&spec) {
                let _ = l.pool.remove_backend(&spec.id, now_ms());
                return Err(e);
            }
            persist_snapshots(l);
            l.pool
                .backend(&spec.id)
                .ok_or_else(|| ApiError::internal("backend vanished"))
        })?;
        // A new backend serves nothing until probed: probe now rather than at the next round.
        self.probe_soon().await;
        answer(201, &view)
    }

    fn list(&self) -> ApiResult {
        self.with(|l| {
            let data: Vec<AdminBackend> = l.pool.backends().map(|v| admin_backend(l, v)).collect();
            answer(
                200,
                &BackendList {
                    object: "list".into(),
                    pool: Some(l.name.clone()),
                    data,
                },
            )
        })
    }

    fn show(&self, id: &str) -> ApiResult {
        self.with(|l| {
            let id = BackendId(id.to_string());
            let view = l
                .pool
                .backend(&id)
                .ok_or_else(|| ApiError::not_found(format!("no backend `{}`", id.0)))?;
            answer(200, &admin_backend(l, view))
        })
    }

    fn patch(&self, id: &str, req: AdminPatch) -> ApiResult {
        let id = BackendId(id.to_string());
        self.with(|l| {
            let now = now_ms();
            let mut patch = req.patch;
            if let Some(models) = &patch.models {
                validate_models(models)?;
            }
            if let Some(region) = patch.region.as_ref().filter(|r| !r.is_empty()) {
                validate_name("region", region)?;
            }
            if let Some(url) = &patch.url {
                let url = validate_url(url)?;
                if l.registry.url_taken(&url, &id.0)? {
                    return Err(ApiError::conflict(
                        "a backend with this URL is already registered",
                    ));
                }
                patch.url = Some(url);
            }
            l.pool
                .update_backend(&id, &patch, now)
                .map_err(pool_error)?;
            match req.drain {
                Some(true) => {
                    l.pool
                        .set_lifecycle(&id, Lifecycle::Draining, now)
                        .map_err(pool_error)?;
                }
                Some(false) => {
                    l.pool
                        .set_lifecycle(&id, Lifecycle::Ready, now)
                        .map_err(pool_error)?;
                    l.pending_delete.remove(&id);
                    l.registry.set_meta("pending_delete", &l.pending_delete)?;
                }
                None => {}
            }
            finish_drains(l);
            if let Some(spec) = l.pool.spec(&id) {
                l.registry.put_spec(spec)?;
            }
            persist_snapshots(l);
            let view = l
                .pool
                .backend(&id)
                .ok_or_else(|| ApiError::not_found("backend vanished"))?;
            answer(200, &admin_backend(l, view))
        })
    }

    fn delete(&self, id: &str, force: bool) -> ApiResult {
        let id = BackendId(id.to_string());
        self.with(|l| {
            let now = now_ms();
            let view = l
                .pool
                .backend(&id)
                .ok_or_else(|| ApiError::not_found(format!("no backend `{}`", id.0)))?;
            if force || view.leases_in_flight == 0 {
                remove_backend(l, &id)?;
                return answer(
                    200,
                    &DeleteAnswer {
                        id: id.0,
                        deleted: true,
                        status: None,
                        leases_in_flight: None,
                    },
                );
            }
            l.pool
                .set_lifecycle(&id, Lifecycle::Draining, now)
                .map_err(pool_error)?;
            l.pending_delete.insert(id.clone());
            l.registry.set_meta("pending_delete", &l.pending_delete)?;
            persist_snapshots(l);
            answer(
                202,
                &DeleteAnswer {
                    id: id.0,
                    deleted: false,
                    status: Some("draining".into()),
                    leases_in_flight: Some(view.leases_in_flight),
                },
            )
        })
    }

    fn models(&self) -> ApiResult {
        self.with(|l| {
            let mut models: Vec<String> = l
                .pool
                .backends()
                .filter(|v| v.lifecycle == Lifecycle::Ready && v.health == HealthState::Healthy)
                .flat_map(|v| v.served_models)
                .collect();
            models.sort();
            models.dedup();
            answer(200, &ModelsAnswer { models })
        })
    }

    fn put_config(&self, settings: PoolSettings) -> ApiResult {
        settings.validate()?;
        self.with(|l| {
            l.pool
                .set_config(settings.routing.clone())
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            l.registry.set_meta("config", &settings)?;
            l.settings = settings;
            l.load = pool_load(l);
            answer(200, &l.settings)
        })
    }

    fn summary(&self) -> ApiResult {
        self.with(|l| answer(200, &summary(l)))
    }

    fn metrics(&self) -> ApiResult {
        let text = self.with(|l| {
            let mut out = String::new();
            l.pool.render_metrics(&mut out);
            render_pool_metrics(l, &mut out);
            l.room.queue.render_metrics(&l.name, &mut out);
            out
        });
        let mut resp = Response::ok(text)?;
        resp.headers_mut()
            .set("content-type", "text/plain; version=0.0.4")?;
        Ok(resp)
    }

    /// Runs a probe round as soon as possible: one more after the round in progress, or else the
    /// alarm fires now (and re-arms itself after).
    async fn probe_soon(&self) {
        if self.probing.get() {
            self.probe_again.set(true);
            return;
        }
        if let Err(e) = self.state.storage().set_alarm(0i64).await {
            console_error!("pool: cannot schedule a probe round: {e}");
        }
    }

    async fn ensure_alarm(&self) -> ApiResult {
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
    async fn probe_all(&self) {
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

    async fn probe_round(&self) {
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
        });
        self.settle_queue();
    }

    /// The last hour, minute by minute, including the current minute so far.
    fn history(&self) -> ApiResult {
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
fn record_history(l: &mut Live) {
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
fn render_pool_metrics(l: &Live, out: &mut String) {
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

/// The error a client gets for a request that left the queue without a lease.
fn drop_error(l: &Live, reason: DropReason, waited_ms: u64) -> ApiError {
    let seconds = |ms: u64| ms.div_ceil(1000).clamp(1, 60) as u32;
    match reason {
        DropReason::QueueFull | DropReason::TenantLimit | DropReason::Evicted => {
            let oldest = l
                .room
                .queue
                .oldest_arrival_ms()
                .map_or(0, |a| now_ms().saturating_sub(a));
            ApiError::queue_full(reason.as_str(), seconds(oldest))
        }
        DropReason::Timeout => ApiError::queue_timeout(seconds(waited_ms)),
        DropReason::ClientGone => {
            let mut e = ApiError::bad_request("The client closed the request.")
                .with_code("client_closed_request");
            e.status = 499;
            e.with_header(QUEUE_DROP_HEADER, reason.as_str())
        }
        DropReason::ModelGone => {
            ApiError::model_not_found("").with_header(QUEUE_DROP_HEADER, reason.as_str())
        }
    }
}

/// A backend as the admin API shows it.
fn admin_backend(l: &Live, view: routing_core::pool::BackendView) -> AdminBackend {
    AdminBackend {
        last_probe: l.probes.get(&view.id).cloned(),
        delete_pending: l.pending_delete.contains(&view.id),
        view,
    }
}

/// The pool at a glance (`GET /state`).
fn summary(l: &Live) -> PoolSummary {
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
    }
}

/// The admission queue as `GET /admin/pools/{pool}` shows it.
fn queue_summary(l: &Live) -> QueueSummary {
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

/// Removes drained backends whose `DELETE` was waiting for the drain.
fn finish_drains(l: &mut Live) {
    if l.pending_delete.is_empty() {
        return;
    }
    let done: Vec<BackendId> = l
        .pending_delete
        .iter()
        .filter(|id| drain_finished(l.pool.backend(id).as_ref()))
        .cloned()
        .collect();
    for id in done {
        if let Err(e) = remove_backend(l, &id) {
            console_error!("pool {}: removing drained backend {}: {e}", l.name, id.0);
        }
    }
}

fn remove_backend(l: &mut Live, id: &BackendId) -> std::result::Result<(), ApiError> {
    let _ = l.pool.remove_backend(id, now_ms());
    l.registry.delete(&id.0)?;
    l.probes.remove(id);
    l.persisted.remove(id);
    l.load = pool_load(l);
    if l.pending_delete.remove(id) {
        l.registry.set_meta("pending_delete", &l.pending_delete)?;
    }
    Ok(())
}

/// Writes the lifecycle, health and breaker state of every backend whose state changed since it
/// was last written, and refreshes the load summary spillover reads (probe rounds, admin changes).
fn persist_snapshots(l: &mut Live) {
    for snapshot in l.pool.snapshots() {
        persist_if_changed(l, snapshot);
    }
    l.load = pool_load(l);
}

/// The same for the backends a request touched: no work proportional to the fleet per request.
/// (A request's ending changes breakers and drains, never what the load summary counts.)
fn persist_backends(l: &mut Live, ids: &[Option<&BackendId>]) {
    for id in ids.iter().flatten() {
        if let Some(snapshot) = l.pool.snapshot(id) {
            persist_if_changed(l, snapshot);
        }
    }
}

fn persist_if_changed(l: &mut Live, snapshot: BackendSnapshot) {
    if l.persisted.get(&snapshot.id) == Some(&snapshot) {
        return;
    }
    match l.registry.put_snapshot(&snapshot) {
        Ok(()) => {
            l.persisted.insert(snapshot.id.clone(), snapshot);
        }
        Err(e) => console_error!("pool {}: persisting {}: {e}", l.name, snapshot.id.0),
    }
}
