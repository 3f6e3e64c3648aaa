//! The pool: one group of vLLM servers and every routing decision about them.
//!
//! This is the facade the pool's Durable Object calls. It owns the backend registry, each
//! backend's health and circuit breaker, the routing policy (and its hash ring), the
//! prefix-affinity table and the live leases. The Durable Object persists what [`Pool`] hands it
//! ([`BackendSpec`], [`PoolConfig`], [`BackendSnapshot`]) and rebuilds the pool from them after a
//! restart; leases and affinity are memory only.
//!
//! A request's life: the Worker computes
//! [`RequestFeatures`](crate::request::prompt::RequestFeatures); [`Pool::acquire`] filters the
//! backends (served model, role, lifecycle, health, breaker, saturation), fills in the cost model,
//! lets the policy rank them and grants a lease on the first; the Worker calls the backend, walks
//! to the next candidate with [`Pool::reassign`] if it fails before the first byte, and finally
//! [`Pool::release`]s the lease with the [`Outcome`](crate::stream::outcome::Outcome), which feeds
//! the breaker and the statistics. [`Pool::expire`] ends leases nobody released, and
//! [`Pool::next_deadline`] says when to call it.
//!
//! The files: `config` (the knobs), `capacity` (whether a backend has room), `errors`, `views`
//! (what crosses the boundary), `entry` (slot storage: one backend's state from [`crate::backend`]
//! per slot), `registry` (adding, changing and probing backends), `acquire/` (the decision:
//! eligible -> rank -> admit -> lease), `lease` (the lease table and a lease's terms), `leases` (a
//! lease's life after the grant), `affinity` (the prefix-affinity table: which backend recently
//! served which prompt prefix), `guess` (an isolate's guess of a shard's choice, for a fetch sent
//! beside the lease call), `persistence` (snapshots and restore), `shard` (which coordinator
//! shard owns a request, and the load reports shards exchange), `siblings` (this pool as one of
//! several coordinator shards), `stats` (the counters) and `render` (Prometheus text).

mod acquire;
pub mod affinity;
mod capacity;
mod config;
mod entry;
mod errors;
pub mod evidence;
pub mod guess;
pub mod lease;
mod leases;
mod persistence;
mod registry;
mod render;
pub mod responses;
pub mod shard;
mod siblings;
mod stats;
#[cfg(test)]
pub(crate) mod test_support;
mod views;

pub use crate::backend::scrape::ScrapedGauges;
pub use capacity::has_room;
pub use config::{AdmissionConfig, ConfigError, PoolConfig, MAX_CANDIDATES, MAX_QUEUE};
pub use errors::{AcquireError, PoolError, Refusal, DEFAULT_RETRY_AFTER_S};
pub use stats::{BackendReport, BackendStats, PoolStats};
pub use views::{BackendSnapshot, BackendView, CandidateView, Grant, ProbeResult, RouteReceipt};

use crate::backend::cost::InFlight;
use crate::backend::time_model::{OutputRatio, TailEstimate};
use crate::backend::{BackendId, BackendKey, BackendSpec, Lifecycle};
use crate::policy::ring::RingMember;
use crate::policy::{self, PoolPolicies};
use crate::pool::affinity::PrefixAffinity;
use crate::pool::lease::{Lease, LeaseId, LeaseTable};
use crate::pool::shard::SiblingLoads;
use acquire::Scratch;
use entry::{BackendEntry, Slot};
use errors::unknown;
use std::collections::HashMap;
use std::fmt;

/// One pool of backends and its routing state.
pub struct Pool {
    name: String,
    config: PoolConfig,
    /// The prefill (or only) policy and, for a pool that pairs, the decode policy.
    policies: PoolPolicies,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    index: HashMap<BackendId, u32>,
    leases: LeaseTable,
    affinity: PrefixAffinity,
    pub(crate) stats: PoolStats,
    scratch: Scratch,
    /// Real over requested output length, learned from usage.
    output_ratio: OutputRatio,
    /// Mean uncached prompt tokens per granted request (prices scraped waiting requests).
    mean_uncached_tokens: f64,
    /// A high quantile of the end-to-end times of successful streamed requests (grant to
    /// release), learned: answers predicted to end past it are the ones a prompt's prefill holds
    /// up in the tail (`Candidate::tail_harm_ms`).
    e2e_tail: TailEstimate,
    /// The overhead the backends have in common, as of the last release (see
    /// [`crate::backend::time_model::Observation::pool_overhead_ms`]).
    common_overhead_ms: Option<f64>,
    /// The latest time the pool was told (views show the prefill backlog as of then).
    now_hint_ms: u64,
    /// Slots where a lease share ended since [`Pool::take_freed`] (admission control only).
    freed: Vec<u32>,
    /// This coordinator's shard index, and its siblings' load reports when the pool has several.
    shard: u32,
    shards: u32,
    siblings: Option<SiblingLoads>,
    /// When the siblings' load was last summed into the entries.
    siblings_summed_ms: u64,
    /// Changes whenever a backend leaves service or changes how it is called (removed, drained,
    /// patched): carried on every grant ([`Grant::roster`]) so an isolate's guesses of this
    /// shard's choices (`ROUTE_AHEAD`) forget every backend they knew at its next answer.
    roster: u32,
    /// Which backend holds each stored Responses API response (`previous_response_id`).
    responses: responses::ResponseBook,
    /// After a restart: until when admission control grants nothing new (0: no hold), so the
    /// streams still running renew first ([`Pool::hold_admission`]).
    admission_hold_until_ms: u64,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.name)
            .field("policy", &self.config.policy)
            .field("backends", &self.index.len())
            .field("leases", &self.leases.len())
            .field("affinity_entries", &self.affinity.len())
            .finish()
    }
}

impl Pool {
    /// An empty pool. The configuration is used as given; validate untrusted input with
    /// [`PoolConfig::validate`] first ([`Pool::set_config`] does). Out-of-range values never make
    /// the pool panic; they are clamped where they would.
    pub fn new(name: &str, config: PoolConfig) -> Pool {
        let policies = policy::build(
            config.policy,
            &config.consistent_hash,
            &config.cache_aware,
            &config.predicted_latency,
        );
        let affinity = PrefixAffinity::new(config.affinity_max_entries);
        Pool {
            name: name.to_string(),
            config,
            policies,
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: HashMap::new(),
            leases: LeaseTable::new(),
            affinity,
            stats: PoolStats::default(),
            scratch: Scratch::default(),
            output_ratio: OutputRatio::default(),
            mean_uncached_tokens: 0.0,
            e2e_tail: TailEstimate::default(),
            common_overhead_ms: None,
            now_hint_ms: 0,
            freed: Vec::new(),
            shard: 0,
            shards: 1,
            siblings: None,
            siblings_summed_ms: 0,
            roster: 0,
            responses: responses::ResponseBook::default(),
            admission_hold_until_ms: 0,
        }
    }

    /// Holds admission control until `until_ms`: while it lasts, an acquire under a capacity rule
    /// finds no backend with room ([`AcquireError::AtCapacity`]: the request waits in the queue
    /// or spills), whatever the counters say. A restarted pool's counters know none of the
    /// streams still running until they renew (see `crate::coordinator::drain`).
    pub fn hold_admission(&mut self, until_ms: u64) {
        self.admission_hold_until_ms = until_ms;
    }

    /// Ends the admission hold once `now_ms` reaches it. Returns whether it ended now (room
    /// appeared: the queue should be dispatched).
    pub fn end_admission_hold(&mut self, now_ms: u64) -> bool {
        if self.admission_hold_until_ms == 0 || now_ms < self.admission_hold_until_ms {
            return false;
        }
        self.admission_hold_until_ms = 0;
        true
    }

    /// Whether admission is held at `now_ms` ([`Pool::hold_admission`]).
    pub fn admission_held(&self, now_ms: u64) -> bool {
        now_ms < self.admission_hold_until_ms
    }

    /// Whether vLLM's own counts, scraped since the restart, show no request the pool does not
    /// count on any backend that may take one (ready and serving): each runs and queues no more
    /// requests than it has leases here. A backend whose page gave no count answers `false`.
    pub fn scrapes_match_leases(&self) -> bool {
        self.entries()
            .filter(|e| e.lifecycle == Lifecycle::Ready && e.health.is_serving())
            .all(|e| {
                let g = e.load_gauges();
                g.running.is_some_and(|running| {
                    running + g.waiting.unwrap_or(0.0) <= f64::from(e.in_flight.leases)
                })
            })
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The configuration in effect.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Validates and applies a new configuration. A new policy starts fresh (its ring rebuilt);
    /// live leases keep their deadlines; a smaller affinity bound evicts at once.
    pub fn set_config(&mut self, config: PoolConfig) -> Result<(), ConfigError> {
        config.validate()?;
        let block_tokens_changed = config.block_tokens != self.config.block_tokens;
        self.config = config;
        self.policies = policy::build(
            self.config.policy,
            &self.config.consistent_hash,
            &self.config.cache_aware,
            &self.config.predicted_latency,
        );
        self.members_changed();
        self.affinity
            .set_max_entries(self.config.affinity_max_entries);
        if block_tokens_changed {
            for slot in 0..self.slots.len() {
                self.sync_affinity_capacity(slot as u32);
            }
        }
        Ok(())
    }

    /// The earliest deadline of a live lease, for the Durable Object's alarm.
    pub fn next_deadline(&self) -> Option<u64> {
        self.leases.next_deadline()
    }

    /// Live leases counted on existing backends (a removed backend's leases are not counted).
    pub fn in_flight_total(&self) -> u64 {
        self.entries().map(|e| u64::from(e.in_flight.leases)).sum()
    }

    /// Live leases, including those on backends removed since.
    pub fn live_leases(&self) -> usize {
        self.leases.len()
    }

    /// Checks that every backend's in-flight counters equal the sum of its live lease shares, and
    /// that the blocks counted as held there are exactly those its live leases hold (used by tests
    /// and property tests; cheap enough for a debug endpoint).
    pub fn check_counters(&self) -> Result<(), String> {
        for s in &self.slots {
            let Some(e) = &s.entry else { continue };
            let mut expected = InFlight::default();
            for lease in self.leases.iter() {
                for share in std::iter::once(&lease.primary).chain(lease.decode.as_ref()) {
                    if share.backend == e.key {
                        expected.add(share.prompt_tokens, share.output_tokens);
                    }
                }
            }
            if expected != e.in_flight {
                return Err(format!(
                    "backend {}: counters {:?}, live leases {:?}",
                    e.spec.id, e.in_flight, expected
                ));
            }
            let held = e.held.recount();
            if held != e.held.distinct() {
                return Err(format!(
                    "backend {}: {} blocks counted as held, live leases hold {}",
                    e.spec.id,
                    e.held.distinct(),
                    held
                ));
            }
            if let Some((id, _)) = e.held.prompts().find(|&(id, _)| {
                self.leases
                    .get(id)
                    .is_none_or(|lease| lease.primary.backend != e.key)
            }) {
                return Err(format!(
                    "backend {}: lease {id} holds blocks here but is not live on it",
                    e.spec.id
                ));
            }
        }
        Ok(())
    }

    /// A backend's in-flight counters.
    pub fn in_flight(&self, id: &BackendId) -> Option<InFlight> {
        let slot = *self.index.get(id)?;
        self.entry(slot).map(|e| e.in_flight)
    }

    /// The live lease `lease_id`.
    pub fn lease(&self, lease_id: LeaseId) -> Option<&Lease> {
        self.leases.get(lease_id)
    }

    /// The prefix-affinity table.
    pub fn affinity(&self) -> &PrefixAffinity {
        &self.affinity
    }

    /// Backends where a lease ended since the last call, oldest first (admission control on).
    pub fn take_freed(&mut self) -> Vec<BackendId> {
        let slots = std::mem::take(&mut self.freed);
        slots
            .into_iter()
            .filter_map(|slot| self.entry(slot).map(|e| e.spec.id.clone()))
            .collect()
    }

    /// Leading blocks of `block_hashes` that backend `id` probably holds.
    pub fn cached_blocks_on(&self, id: &BackendId, block_hashes: &[u64]) -> u32 {
        let Some(&slot) = self.index.get(id) else {
            return 0;
        };
        let mut lengths = Vec::new();
        self.affinity.match_lengths(block_hashes, &mut lengths);
        lengths.get(slot as usize).copied().unwrap_or(0)
    }

    /// A backend's spec as registered (API key included: for the Durable Object's own use, to
    /// persist it and to authenticate probes; never for views).
    pub fn spec(&self, id: &BackendId) -> Option<&BackendSpec> {
        let slot = *self.index.get(id)?;
        self.entry(slot).map(|e| &e.spec)
    }

    /// A backend's listing.
    pub fn backend(&self, id: &BackendId) -> Option<BackendView> {
        self.view(*self.index.get(id)?)
    }

    /// Every backend's listing, in slot order.
    pub fn backends(&self) -> impl Iterator<Item = BackendView> + '_ {
        (0..self.slots.len()).filter_map(|slot| self.view(slot as u32))
    }

    /// Every model some backend of the pool serves now (`backend::serving`), sorted, once each:
    /// what `/v1/models` lists and what the pool's time card advertises.
    pub fn served_models(&self) -> Vec<String> {
        let mut models: Vec<String> = self
            .entries()
            .flat_map(|e| e.serving().served_models())
            .cloned()
            .collect();
        models.sort();
        models.dedup();
        models
    }

    /// Number of registered backends.
    pub fn backend_count(&self) -> usize {
        self.index.len()
    }

    fn entries(&self) -> impl Iterator<Item = &BackendEntry> {
        self.slots.iter().filter_map(|s| s.entry.as_ref())
    }

    fn slot_of(&self, id: &BackendId) -> Result<u32, PoolError> {
        self.index.get(id).copied().ok_or_else(|| unknown(id))
    }

    /// The learned tail of the pool's end-to-end times, in ms (the `predicted_latency`
    /// policy's `tail_quantile` of successful streamed requests' times from grant to release),
    /// once enough requests have taught it.
    pub fn e2e_tail_ms(&self) -> Option<f64> {
        self.e2e_tail.ms()
    }

    fn entry(&self, slot: u32) -> Option<&BackendEntry> {
        self.slots.get(slot as usize)?.entry.as_ref()
    }

    fn entry_mut(&mut self, slot: u32) -> Option<&mut BackendEntry> {
        self.slots.get_mut(slot as usize)?.entry.as_mut()
    }

    fn entry_for_key_mut(&mut self, key: BackendKey) -> Option<&mut BackendEntry> {
        let s = self.slots.get_mut(key.slot as usize)?;
        if s.generation != key.generation {
            return None;
        }
        s.entry.as_mut()
    }

    fn sync_affinity_capacity(&mut self, slot: u32) {
        let block_tokens = self.config.block_tokens();
        if let Some(entry) = self.entry(slot) {
            let blocks = entry.capacity().capacity_blocks(block_tokens);
            self.affinity.set_backend_capacity(slot, blocks);
        }
    }

    /// The shard's roster number (see [`Grant::roster`]).
    pub fn roster(&self) -> u32 {
        self.roster
    }

    /// A backend left service or changes how it is called: the roster number moves on.
    pub(super) fn roster_changed(&mut self) {
        self.roster = self.roster.wrapping_add(1);
    }

    fn members_changed(&mut self) {
        let members: Vec<RingMember<'_>> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| {
                s.entry.as_ref().map(|e| RingMember {
                    node: slot as u32,
                    id: e.spec.id.as_str(),
                    weight: e.spec.weight,
                })
            })
            .collect();
        self.policies.members_changed(&members);
    }

    fn view(&self, slot: u32) -> Option<BackendView> {
        let e = self.entry(slot)?;
        Some(BackendView {
            id: e.spec.id.clone(),
            pool: self.name.clone(),
            url: e.spec.url.clone(),
            region: e.spec.region.clone(),
            models: e.spec.models.clone(),
            served_models: e.serving().listed_models().to_vec(),
            weight: e.spec.weight,
            role: e.spec.role,
            has_api_key: e.spec.api_key.is_some(),
            capacity: e.capacity(),
            lifecycle: e.lifecycle,
            health: e.health.state,
            breaker: e.breaker.state(),
            breaker_open_until_ms: e.breaker.open_until_ms(),
            saturated_until_ms: e.breaker.saturated_until_ms(),
            leases_in_flight: e.in_flight.leases,
            inflight_prompt_tokens: e.in_flight.prompt_tokens,
            inflight_output_tokens: e.in_flight.output_tokens,
            load: e.load(self.config.queue_weight, self.sibling_twins()),
            affinity_blocks: self.affinity.backend_len(slot),
            added_ms: e.added_ms,
            last_probe_ms: e.health.last_probe_ms,
            scraped: e.scraped,
            load_unknown: e.load_unknown,
            timing: e.timing.view(&self.config.time_model, self.now_hint_ms),
        })
    }
}
