//! The pool coordinator: one Durable Object per coordinator shard of a GPU pool, the single
//! authority for that shard's view of the pool's backends, their health and breakers, the requests
//! in flight on them, and the prefix-affinity table. The rules are
//! `routing_core::coordinator::Coordinator`'s; this object is the adapter that gives it time,
//! randomness, persistence and a surface for calls (RPC, `gatewayCall`, and `fetch`, one dispatch
//! for both), and performs the effects it returns
//! ([`PoolShard::perform`]): SQLite writes, answers to waiting calls, probe rounds, pushes to the
//! sibling shards and to the directory.
//!
//! Response bytes never pass through here: the Worker acquires a lease, streams from the backend
//! itself, reassigns the lease if it must retry elsewhere, and releases it when the stream ends.
//! Leases also expire on a deadline, so a Worker that dies never leaks load. Probes run from this
//! object's alarm, which re-arms itself and which the cron trigger makes sure is armed.
//!
//! Persisted in SQLite: backend specs, their lifecycle/health/breaker snapshots, pool settings,
//! the drains. In memory only: leases, affinity, the retry budget, the last probe reports, and
//! the last hour's per-minute history (`routing_core::coordinator::history`, for the dashboard).
//!
//! A pool may run on several such objects, its coordinator shards (`shards` in its settings; see
//! `routing_core::pool::shard`): shard 0 is the object named after the pool, shard k the object
//! `pool#k`, and every call names its shard (`x-gateway-shard`, or an RPC call's shard argument).
//! Each shard owns its leases,
//! affinity and queue; shards push their load to each other ([`shards`]); only shard 0 probes,
//! and it hands each round's results to the others.
//!
//! This file holds the object, what it keeps in memory and the dispatch of each call; the
//! handlers are grouped by job: [`acquire`], [`leases`], [`backends`], [`probing`], [`reports`],
//! [`card`] and [`shards`].

mod acquire;
mod backends;
mod card;
mod leases;
mod probing;
mod reports;
mod shards;

use crate::call::{answer, parse_route, parse_rpc_route, respond, respond_rpc, Answered, Incoming};
use crate::registry::Registry;
use crate::waiting_room::OpenCalls;
use coordinator_protocol::messages::{AdminPatch, POOL_HEADER, SHARD_HEADER};
pub use coordinator_protocol::settings::PoolSettings;
use coordinator_protocol::{ApiError, Object, Route};
use routing_core::backend::BackendId;
use routing_core::coordinator::load::LoadTargets;
use routing_core::coordinator::{Coordinator, CoordinatorSettings, Effect, Effects, Stored};
use routing_core::pool::PoolError;
use routing_core::region::TimeCard;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;
use worker::{
    console_error, console_log, durable_object, Date, Delay, DurableObject, Env, Request, Response,
    Result, State,
};

/// Default time between probe rounds (the `PROBE_INTERVAL_MS` var overrides it).
pub const DEFAULT_PROBE_INTERVAL_MS: u64 = 10_000;
/// Most backends probed at once (the platform allows six outbound connections per invocation).
const PROBE_CONCURRENCY: usize = 6;

/// One coordinator shard of a pool.
#[durable_object]
pub struct PoolCoordinator {
    state: State,
    env: Env,
    /// Shared with the load pushes that run after a call has been answered.
    shard: Rc<RefCell<Option<PoolShard>>>,
    /// A probe round is running (rounds never overlap: a second one would double-count the
    /// health hysteresis).
    probing: Cell<bool>,
    /// A round was asked for while one ran: run one more after it (its targets may be new).
    probe_again: Cell<bool>,
}

/// What the object keeps in memory once loaded (rebuilt from the registry after a restart).
struct PoolShard {
    /// The pool's name.
    name: String,
    /// The SQLite tables.
    registry: Registry,
    /// The settings as the admin API set them.
    settings: PoolSettings,
    /// The rules and their memory.
    coordinator: Coordinator,
    /// The acquires waiting in the queue.
    calls: OpenCalls,
}

/// What is left to do after [`PoolShard::perform`]: the effects that need an await, and the first
/// storage write that failed.
#[derive(Default)]
#[must_use]
struct Performed {
    error: Option<ApiError>,
    probe_soon: bool,
    push_probe_round: bool,
    push_registry: bool,
    card: Option<TimeCard>,
    /// Backends lease evidence asked to be scraped now.
    scrape: Vec<BackendId>,
    /// Push this shard's load to its siblings (it asks shard 0 for a scrape).
    push_load: bool,
}

impl Performed {
    /// The first storage write that failed, if one did.
    fn check(&mut self) -> std::result::Result<(), ApiError> {
        self.error.take().map_or(Ok(()), Err)
    }
}

impl PoolShard {
    /// Performs `effects` in order: storage writes (a snapshot that could not be written is
    /// logged and written again later; the first other failure is kept in the result) and
    /// answers to waiting calls (a verdict no call takes goes back, and the queue settles again).
    fn perform(&mut self, effects: Effects, now: u64) -> Performed {
        let mut performed = Performed::default();
        let mut pending = effects;
        while !pending.is_empty() {
            let mut resettle = false;
            for effect in pending {
                let written = match effect {
                    Effect::PersistSpec(spec) => self.registry.put_spec(&spec),
                    Effect::PersistSnapshot(snapshot) => {
                        if let Err(e) = self.registry.put_snapshot(&snapshot) {
                            console_error!("pool {}: persisting {}: {e}", self.name, snapshot.id.0);
                            self.coordinator.persist_failed(&snapshot.id);
                        }
                        Ok(())
                    }
                    Effect::DeleteBackend(id) => self.registry.delete(&id.0),
                    Effect::PersistPendingDeletes => self.registry.set_meta(
                        "pending_delete",
                        self.coordinator.drains().pending_deletes(),
                    ),
                    Effect::PersistDrainStarts => self
                        .registry
                        .set_meta("drain_started", self.coordinator.drains().starts()),
                    Effect::Answer {
                        ticket,
                        call_id,
                        verdict,
                    } => {
                        if let Some(verdict) = self.calls.answer(ticket, call_id, verdict) {
                            resettle |= !self.coordinator.unanswered(ticket, verdict, now);
                        }
                        Ok(())
                    }
                    Effect::CloseCall { ticket, call_id } => {
                        self.calls.close(ticket, call_id);
                        Ok(())
                    }
                    Effect::ProbeSoon => {
                        performed.probe_soon = true;
                        Ok(())
                    }
                    Effect::PushProbeRound => {
                        performed.push_probe_round = true;
                        Ok(())
                    }
                    Effect::PushRegistry => {
                        performed.push_registry = true;
                        Ok(())
                    }
                    Effect::PublishCard(card) => {
                        performed.card = Some(card);
                        Ok(())
                    }
                    Effect::PersistResponse {
                        response,
                        backend,
                        at_ms,
                        forget_before_ms,
                    } => self
                        .registry
                        .put_response(&response, &backend, at_ms, forget_before_ms),
                    Effect::ScrapeNow(ids) => {
                        performed.scrape.extend(ids);
                        Ok(())
                    }
                    Effect::PushLoad => {
                        performed.push_load = true;
                        Ok(())
                    }
                };
                if let Err(e) = written {
                    console_error!("pool {}: storage: {e}", self.name);
                    performed.error.get_or_insert(e);
                }
            }
            // A lease refused by a departed caller went back to the pool: grant it again.
            pending = if resettle {
                self.coordinator.settle(now, &self.calls)
            } else {
                Effects::new()
            };
        }
        performed
    }

    /// Lets queued requests in if backends have room (and drops those whose client left).
    fn settle_queue(&mut self, now: u64) {
        let effects = self.coordinator.settle(now, &self.calls);
        let _ = self.perform(effects, now);
    }
}

/// What the coordinator's rules read from the pool's settings.
fn coordinator_settings(settings: &PoolSettings) -> CoordinatorSettings {
    CoordinatorSettings {
        routing: settings.routing.clone(),
        retry_budget: settings.retry_budget,
        load_targets: LoadTargets {
            saturation_waiting_per_backend: settings.saturation_waiting_per_backend,
            autoscale_target_waiting: settings.autoscale_target_waiting,
        },
    }
}

type ApiResult = Answered;

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
            shard: Rc::new(RefCell::new(None)),
            probing: Cell::new(false),
            probe_again: Cell::new(false),
        }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        let name = req.headers().get(POOL_HEADER).ok().flatten();
        let index = req.headers().get(SHARD_HEADER).ok().flatten();
        let route = parse_route(&req, Object::Pool);
        respond(
            self.dispatch(route, name, index.as_deref(), Incoming::Request(&mut req))
                .await,
        )
    }

    async fn alarm(&self) -> Result<Response> {
        if let Err(e) = self.load(None, None) {
            return e.to_response();
        }
        self.with(|shard| {
            let now = now_ms();
            let effects = shard.coordinator.expire(now);
            let _ = shard.perform(effects, now);
        });
        self.settle_queue();
        if self.with(|shard| shard.coordinator.shard()) != 0 {
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

/// The calls by Durable Object RPC (`coordinator_protocol::call::RPC_METHOD`): the same routes as
/// `fetch`, named by method and URL, with the pool, the shard and the JSON body as arguments and
/// the answer as `Reply::into_rpc`. The Worker's pool calls come this way: no request or response
/// object on either side of the call (in workerd about 0.1 ms less per call than a `fetch` of
/// the same body, measured in a micro-benchmark).
#[wasm_bindgen::prelude::wasm_bindgen]
impl PoolCoordinator {
    /// One call by RPC.
    #[wasm_bindgen::prelude::wasm_bindgen(js_name = gatewayCall)]
    pub async fn gateway_call(
        &self,
        method: String,
        url: String,
        pool: Option<String>,
        shard: Option<String>,
        body: Option<String>,
    ) -> std::result::Result<wasm_bindgen::JsValue, wasm_bindgen::JsValue> {
        let route = parse_rpc_route(&method, &url, Object::Pool);
        let answered = self
            .dispatch(route, pool, shard.as_deref(), Incoming::Rpc(body))
            .await;
        Ok(respond_rpc(answered))
    }
}

impl PoolCoordinator {
    /// Runs one call, however it came: loads the shard, runs the handler, wakes the queue.
    async fn dispatch(
        &self,
        route: std::result::Result<Route, ApiError>,
        name: Option<String>,
        index: Option<&str>,
        mut incoming: Incoming<'_>,
    ) -> ApiResult {
        let index = match index.map(|s| s.parse::<u32>()) {
            None => None,
            Some(Ok(k)) if k < routing_core::pool::shard::MAX_SHARDS => Some(k),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "x-gateway-shard must be a shard index",
                ))
            }
        };
        self.load(name.as_deref(), index)?;
        let result = match route {
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
                let result = self.handle(route, &mut incoming).await;
                if !moves_load && !read_only {
                    self.with(|shard| shard.coordinator.wake());
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
        result
    }

    /// Runs one call.
    async fn handle(&self, route: Route, req: &mut Incoming<'_>) -> ApiResult {
        match route {
            Route::Acquire { spill_ok } => {
                let signal = req.signal();
                let body = req.body("acquire request").await?;
                self.acquire(body, spill_ok, signal).await
            }
            Route::Dequeue => self.dequeue(req.body("dequeue request").await?),
            Route::Reassign => self.reassign(req.body("reassign request").await?).await,
            Route::Release => self.release(req.body("release request").await?).await,
            Route::ReleaseBatch => self.release_batch(req.body("release batch").await?).await,
            Route::Renew => self.renew(req.body("renew request").await?).await,
            Route::PrefillDone => self.prefill_done(req.body("prefill report").await?),
            Route::ResponseHolder => self.response_holder(req.body("response holder").await?),
            Route::RegisterBackend => self.register(req.body("backend registration").await?).await,
            Route::ListBackends => self.list(),
            Route::ShowBackend(id) => self.show(&id),
            Route::PatchBackend(id) => {
                let patch: AdminPatch = req.body("backend patch").await?;
                // Re-enabled (or drained): it probes now rather than at the next round.
                self.patch(&id, patch).await
            }
            Route::DeleteBackend { id, force } => self.delete(&id, force),
            Route::Models => self.models(),
            Route::GetConfig => self.with(|shard| answer(200, &shard.settings)),
            Route::PutConfig => self.put_config(req.body("pool configuration").await?).await,
            Route::Summary => self.summary(),
            Route::Metrics => self.metrics(),
            Route::History => self.history(),
            Route::EnsureProbeAlarm => self.ensure_alarm().await,
            Route::ShardLoad => self.accept_load(req.body("load report").await?).await,
            Route::ShardProbes => self.apply_probe_round(req.body("probe round").await?),
            Route::ShardRegistry => self.apply_registry(req.body("shard registry").await?),
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
    fn load(&self, name: Option<&str>, index: Option<u32>) -> std::result::Result<(), ApiError> {
        if let Some(shard) = self.shard.borrow_mut().as_mut() {
            if let Some(n) = name.filter(|n| *n != shard.name) {
                shard.name = n.to_string();
                shard.registry.set_meta("name", &shard.name)?;
            }
            if let Some(k) = index.filter(|k| *k != shard.coordinator.shard()) {
                shard.coordinator.set_shard(k);
                shard.registry.set_meta("shard", &k)?;
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
        let stored_index: Option<u32> = registry.meta("shard");
        let index = index.or(stored_index).unwrap_or(0);
        if stored_index != Some(index) {
            registry.set_meta("shard", &index)?;
        }
        let mut settings: PoolSettings = registry.meta("config").unwrap_or_default();
        if settings.validate().is_err() {
            settings = PoolSettings::default();
        }
        let stored = Stored {
            backends: registry.backends()?,
            pending_delete: registry.meta("pending_delete").unwrap_or_default(),
            drain_started: registry.meta("drain_started").unwrap_or_default(),
            responses: registry.responses(routing_core::pool::responses::MAX_RECORDS)?,
        };
        let now = now_ms();
        let seed = now ^ (js_sys::Math::random() * u64::MAX as f64) as u64;
        let rules = coordinator_settings(&settings);
        let (coordinator, failed) = Coordinator::restore(&name, index, rules, stored, seed, now);
        for (id, e) in failed {
            console_error!("pool {name}: cannot restore backend {id}: {e}");
        }
        let drains = coordinator.drains();
        let hold = drains.hold_until_ms();
        for (id, at) in drains.starts() {
            console_log!(
                "pool {name}: backend {} has drained since {at}; held until {hold}",
                id.0
            );
        }
        *self.shard.borrow_mut() = Some(PoolShard {
            name,
            registry,
            settings,
            coordinator,
            calls: OpenCalls::default(),
        });
        Ok(())
    }

    fn with<R>(&self, f: impl FnOnce(&mut PoolShard) -> R) -> R {
        let mut guard = self.shard.borrow_mut();
        f(guard.as_mut().expect("load() runs before every handler"))
    }

    /// Lets queued requests in if backends have room (and drops those whose client left).
    fn settle_queue(&self) {
        self.with(|shard| shard.settle_queue(now_ms()));
    }

    /// Runs what `performed` left to do: a probe round soon, the scrapes lease evidence asked for,
    /// the pushes to the sibling shards, the card to the directory.
    async fn follow_up(&self, performed: Performed) {
        if !performed.scrape.is_empty() {
            // Its own findings are followed up inside (they ask for no further scrape).
            Box::pin(self.evidence_scrape(performed.scrape)).await;
        }
        if performed.probe_soon {
            self.probe_soon().await;
        }
        if performed.push_registry {
            self.push_registry().await;
        }
        // A shard added by raising `shards` learns its backends' health with the registry, from
        // shard 0's last round: without it, requests landing there are refused 503 until the
        // next probe round.
        if performed.push_probe_round || performed.push_registry {
            self.push_probe_round().await;
        }
        if let Some(card) = performed.card {
            self.publish_card(card).await;
        }
        if performed.push_load {
            self.load_changed();
        }
    }

    fn probe_interval_ms(&self) -> u64 {
        let configured = self.with(|shard| shard.settings.probe_interval_ms);
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
