//! The pool coordinator's rules: one [`Coordinator`] per coordinator shard of a pool owns the
//! [`Pool`], the retry budget, the drains, the probe reports, the admission queue and its waiters,
//! the counters, the load summary, the history and the time card that grants carry. The Durable
//! Object around it only parses calls, performs what the coordinator asks for and answers.
//!
//! Every method takes the time (`now_ms`) as an input; the coordinator's randomness is a seeded
//! [`SplitMix64`] the caller seeds once. What must happen outside (rows to write to storage,
//! parked calls to wake and with what, a probe round to start, pushes to the sibling shards and to
//! the directory) comes back as [`Effect`]s, in the order they must be performed. The caller
//! reports back only what failed: a snapshot it could not write ([`Coordinator::persist_failed`])
//! or a verdict no open call took ([`Coordinator::unanswered`]).
//!
//! The files, by concern: `acquire` (acquires, the queue's settle, pause and dequeue) over
//! `waiting` (the waiting room's rules); `leases` (reassign, renew, prefill, release) over
//! `reassign` and `retry_budget`; `registry` (registering, patching, deleting, a sibling's
//! registry) over `drain`; `probes` (probe rounds and their reports) over `probe_verdict`;
//! `reports` (summary counters, metrics, history) over `load`, `history` and `metrics`; `card`
//! (the grant's time card) and `exchange` (when load goes to the sibling shards).

mod acquire;
mod card;
pub mod drain;
mod evidence;
mod exchange;
pub mod history;
mod leases;
pub mod load;
pub mod metrics;
pub mod probe_answers;
pub mod probe_verdict;
mod probes;
pub mod reassign;
mod registry;
mod reports;
pub mod retry_budget;
mod waiting;

pub use card::GRANT_CARD_MS;
pub use drain::Drains;
pub use exchange::LoadPush;
pub use leases::Release;
pub use probes::{AdapterCard, ProbeReport, ProbeTarget};
pub use registry::Deletion;
pub use waiting::{Callers, Step, WaitEnd, WaitingRoom, POLL_GRACE_MS};

use crate::admission::Ticket;
use crate::backend::{BackendId, BackendSpec};
use crate::pool::{BackendSnapshot, Pool, PoolConfig, PoolError};
use crate::random::SplitMix64;
use crate::region::{RoutedCounts, TimeCard};
use crate::stream::outcome::StoredResponse;
use exchange::Exchange;
use history::History;
use load::{LoadTargets, PoolLoad};
use probes::ProbeLog;
use retry_budget::{RetryBudget, RetryBudgetConfig};
use std::collections::{HashMap, HashSet};

/// Something the coordinator's caller must do, in order, after a call into it.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Write this backend's spec (insert, or replace keeping its snapshot).
    PersistSpec(BackendSpec),
    /// Write this backend's lifecycle, health and breaker (its spec row exists).
    PersistSnapshot(BackendSnapshot),
    /// Delete this backend's row.
    DeleteBackend(BackendId),
    /// Write the backends whose `DELETE` waits for their drain ([`Drains::pending_deletes`]).
    PersistPendingDeletes,
    /// Write when each draining backend's drain started ([`Drains::starts`]).
    PersistDrainStarts,
    /// Hand `verdict` to the open call `call_id` of the wait `ticket`, which answers it.
    Answer {
        /// The wait.
        ticket: Ticket,
        /// Its open call.
        call_id: u64,
        /// What the call answers.
        verdict: WaitEnd,
    },
    /// The wait `ticket` is over without a verdict for its open call `call_id`: close the call
    /// (it answers `202`, and its Worker learns the rest when it asks again).
    CloseCall {
        /// The wait.
        ticket: Ticket,
        /// Its open call.
        call_id: u64,
    },
    /// Run a probe round now rather than at the next interval.
    ProbeSoon,
    /// Hand the last probe round's reports ([`Coordinator::probe_reports`]) to every sibling shard.
    PushProbeRound,
    /// Make every sibling shard's registry match this one ([`Coordinator::registry_entries`]).
    PushRegistry,
    /// Hand this time card to the directory.
    PublishCard(TimeCard),
    /// Write that `backend` holds the stored `response` since `at_ms`, and drop the stored
    /// records older than `forget_before_ms` (the pool's book evicted or expired them).
    PersistResponse {
        /// The response and its owner.
        response: StoredResponse,
        /// The backend holding it.
        backend: BackendId,
        /// When it was recorded.
        at_ms: u64,
        /// Records older than this are gone from the book.
        forget_before_ms: Option<u64>,
    },
    /// Scrape these backends now, outside the probe round (lease evidence says their model is
    /// wrong), and hand the findings to [`Coordinator::finish_evidence_scrape`].
    ScrapeNow(Vec<BackendId>),
    /// Push this shard's load to its siblings ([`Coordinator::load_changed`]): a sibling shard's
    /// lease evidence asks shard 0 for a scrape on it.
    PushLoad,
}

/// The effects of one call, in order.
pub type Effects = Vec<Effect>;

/// What the coordinator's rules read from a pool's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct CoordinatorSettings {
    /// The routing core's configuration (policy, leases, admission, shards).
    pub routing: PoolConfig,
    /// The pool-wide retry budget.
    pub retry_budget: RetryBudgetConfig,
    /// What saturation and the desired replicas are judged against.
    pub load_targets: LoadTargets,
}

impl Default for CoordinatorSettings {
    fn default() -> Self {
        CoordinatorSettings {
            routing: PoolConfig::default(),
            retry_budget: RetryBudgetConfig::default(),
            load_targets: LoadTargets {
                saturation_waiting_per_backend: 16.0,
                autoscale_target_waiting: 4.0,
            },
        }
    }
}

/// What a coordinator starts from after a (re)start: the stored backends and drains.
#[derive(Debug, Clone, Default)]
pub struct Stored {
    /// Every stored backend with its last snapshot.
    pub backends: Vec<(BackendSpec, Option<BackendSnapshot>)>,
    /// Backends whose `DELETE` waits for their drain.
    pub pending_delete: HashSet<BackendId>,
    /// When each draining backend's drain started.
    pub drain_started: HashMap<BackendId, u64>,
    /// The stored Responses API responses' holders (`crate::pool::responses`): the response,
    /// its backend and when it was recorded, oldest first.
    pub responses: Vec<(StoredResponse, BackendId, u64)>,
}

/// One coordinator shard of a pool: its rules and its memory (see the module documentation).
pub struct Coordinator {
    /// This shard's index (0: the pool's own object, which alone probes).
    shard: u32,
    pool: Pool,
    retry_budget_config: RetryBudgetConfig,
    load_targets: LoadTargets,
    rng: SplitMix64,
    budget: RetryBudget,
    drains: Drains,
    probes: ProbeLog,
    /// Leases moved to another backend after a failure (retries).
    retries: u64,
    /// Acquires refused because the pool was saturated and another pool could take the work.
    spills: u64,
    /// Backends lease evidence asked to be scraped now (see `evidence`).
    evidence_scrapes: u64,
    /// Lease renewals received, `[other, overdue]` (see `evidence`).
    renewals: [u64; 2],
    /// Admission control's queue and the waits on it.
    room: WaitingRoom,
    /// The pool's load as of the last probe round or registry change (what spillover reads on
    /// every acquire, so that no acquire walks the whole fleet for it).
    load: PoolLoad,
    /// Each backend's state as last handed out to be written (only changes are written).
    persisted: HashMap<BackendId, BackendSnapshot>,
    /// Per-minute aggregates of the last hour, for the dashboard.
    history: History,
    /// Acquires by why the Worker chose this pool.
    routed: RoutedCounts,
    /// Acquires that came with a fetch sent ahead, by what became of it.
    sent_ahead: metrics::SentAheadCounts,
    /// The time card grants carry, kept for [`GRANT_CARD_MS`].
    grant_card: Option<TimeCard>,
    /// The last card published to the directory showed a wait ([`card::BUSY_CARD_MS`]): the
    /// pool publishes again as soon as its last lease ends, not at the next probe round.
    published_busy: bool,
    /// When this shard last pushed its load to its siblings, and whether a push is scheduled.
    exchange: Exchange,
}

impl Coordinator {
    /// A coordinator for shard `shard` of pool `name`, rebuilt from `stored` at `now_ms`, drawing
    /// its random choices from `seed`. Returns the backends that could not be restored, with why.
    ///
    /// Leases are memory only: a restored backend may still run streams that renew within a lease
    /// lifetime, so its drain (and any delete waiting for it) is held that long, and admission
    /// control grants nothing new for one renewal period ([`drain`]).
    pub fn restore(
        name: &str,
        shard: u32,
        settings: CoordinatorSettings,
        stored: Stored,
        seed: u64,
        now_ms: u64,
    ) -> (Coordinator, Vec<(BackendId, PoolError)>) {
        let mut pool = Pool::new(name, settings.routing.clone());
        let mut failed = Vec::new();
        for (spec, snapshot) in stored.backends {
            let id = spec.id.clone();
            if let Err(e) = pool.add_backend(spec, now_ms) {
                failed.push((id, e));
                continue;
            }
            if let Some(snapshot) = snapshot {
                let _ = pool.restore(&snapshot);
            }
        }
        for (response, backend, at_ms) in &stored.responses {
            pool.record_response(response, backend, *at_ms);
        }
        let restored: HashSet<BackendId> = pool.backends().map(|v| v.id).collect();
        let hold_until_ms = if restored.is_empty() {
            0
        } else {
            drain::restart_hold_until(now_ms, settings.routing.lease_ttl_ms)
        };
        let drains = Drains::restored(
            stored.pending_delete,
            stored.drain_started,
            restored,
            hold_until_ms,
        );
        let mut coordinator = Coordinator {
            shard,
            pool,
            retry_budget_config: settings.retry_budget,
            load_targets: settings.load_targets,
            rng: SplitMix64::new(seed),
            budget: RetryBudget::new(),
            drains,
            probes: ProbeLog::default(),
            retries: 0,
            spills: 0,
            evidence_scrapes: 0,
            renewals: [0; 2],
            room: WaitingRoom::default(),
            load: PoolLoad::default(),
            persisted: HashMap::new(),
            history: History::default(),
            routed: RoutedCounts::default(),
            sent_ahead: metrics::SentAheadCounts::default(),
            grant_card: None,
            published_busy: false,
            exchange: Exchange::default(),
        };
        if hold_until_ms != 0 {
            // Grant nothing new until the streams still running renewed (with admission control).
            let hold = drain::admission_hold_until(now_ms, settings.routing.lease_ttl_ms);
            coordinator.pool.hold_admission(hold);
        }
        coordinator.apply_shard_settings();
        coordinator.load = coordinator.measure_load();
        coordinator.persisted = coordinator
            .pool
            .snapshots()
            .into_iter()
            .map(|s| (s.id.clone(), s))
            .collect();
        (coordinator, failed)
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// This shard's index.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// Makes this coordinator shard `shard` of its pool (its object learnt its address).
    pub fn set_shard(&mut self, shard: u32) {
        self.shard = shard;
        self.apply_shard_settings();
    }

    /// The pool's other current shards.
    pub fn siblings(&self) -> Vec<u32> {
        (0..self.pool.config().shards.max(1))
            .filter(|&k| k != self.shard)
            .collect()
    }

    /// The drains in progress.
    pub fn drains(&self) -> &Drains {
        &self.drains
    }

    /// The waiting room (the admission queue and the waits on it).
    pub fn room(&self) -> &WaitingRoom {
        &self.room
    }

    /// Applies new settings (the pool's configuration first: refused, nothing changes). Shard 0
    /// of several then brings its siblings' registries in line (a new shard starts empty).
    pub fn set_settings(
        &mut self,
        settings: CoordinatorSettings,
    ) -> Result<Effects, crate::ConfigError> {
        let old = self.pool.config();
        let reshard = (old.shards, old.shard_exchange_ms)
            != (settings.routing.shards, settings.routing.shard_exchange_ms);
        self.pool.set_config(settings.routing)?;
        self.retry_budget_config = settings.retry_budget;
        self.load_targets = settings.load_targets;
        if reshard {
            self.apply_shard_settings();
        }
        self.load = self.measure_load();
        let mut effects = Effects::new();
        if self.shard == 0 && !self.siblings().is_empty() {
            effects.push(Effect::PushRegistry);
        }
        Ok(effects)
    }

    /// Room may have appeared other than by a lease ending (a probe, a registry or configuration
    /// change, a sibling's load report): the next settle dispatches the queue.
    pub fn wake(&mut self) {
        self.room.wake();
    }

    /// A snapshot handed out in [`Effect::PersistSnapshot`] could not be written: it is written
    /// again the next time it is looked at.
    pub fn persist_failed(&mut self, id: &BackendId) {
        self.persisted.remove(id);
    }

    /// Makes the routing core one shard of the pool's `shards` (on restore and when they change).
    fn apply_shard_settings(&mut self) {
        let config = self.pool.config();
        let (shards, exchange_ms) = (config.shards, config.shard_exchange_ms);
        self.pool.set_shard(self.shard, shards, exchange_ms);
    }

    /// The pool's load, measured now.
    fn measure_load(&self) -> PoolLoad {
        PoolLoad::measure(
            self.pool.backends(),
            self.room.queue.len(),
            &self.load_targets,
        )
    }

    /// Hands out the lifecycle, health and breaker of every backend whose state changed since it
    /// was last handed out, and refreshes the load summary spillover reads (probe rounds, admin
    /// changes).
    fn persist_snapshots(&mut self, effects: &mut Effects) {
        for snapshot in self.pool.snapshots() {
            self.persist_if_changed(snapshot, effects);
        }
        self.load = self.measure_load();
    }

    /// The same for the backends a request touched: no work proportional to the fleet per
    /// request. (A request's ending changes breakers and drains, never what the load counts.)
    fn persist_backends(&mut self, ids: &[Option<&BackendId>], effects: &mut Effects) {
        for id in ids.iter().flatten() {
            if let Some(snapshot) = self.pool.snapshot(id) {
                self.persist_if_changed(snapshot, effects);
            }
        }
    }

    fn persist_if_changed(&mut self, snapshot: BackendSnapshot, effects: &mut Effects) {
        if self.persisted.get(&snapshot.id) == Some(&snapshot) {
            return;
        }
        self.persisted.insert(snapshot.id.clone(), snapshot.clone());
        effects.push(Effect::PersistSnapshot(snapshot));
    }
}
