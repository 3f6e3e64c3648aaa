//! Admission control: when every backend is full, requests wait in the gateway's own queue, in an
//! order the operator chose, instead of piling up invisibly in vLLM's first-come-first-served one.
//!
//! **Capacity.** A backend takes a new lease only while it has room ([`has_room`]): fewer live
//! leases than its `max_num_seqs`, and, when its KV-cache size is known, in-flight tokens plus the
//! request's within its KV capacity. With an empty queue a backend may be pushed `overcommit` over
//! capacity (0 = strict), so the GPU's batch stays full across the round trip between a lease
//! ending and the next grant.
//!
//! **Order.** The [`AdmissionQueue`] serves the highest priority band first. Within a band, tenants
//! share by deficit round robin weighted by estimated tokens (prompt plus `max_tokens`): each turn
//! gives a tenant `quantum_tokens` of credit, and its oldest request is served once its credit
//! covers the request's cost, so a tenant sending long requests gets the same tokens as one
//! sending short ones, not the same number of requests. Within a tenant, arrival order. A round in
//! which nobody could pay is skipped in one step, so a small quantum costs no time.
//!
//! **Look-ahead.** When a lease ends on backend X, the dispatcher looks at the next `lookahead`
//! requests that order would serve and serves first the one whose prefix X holds longest. The
//! window only ever holds requests of the band being served, and a request served early is charged
//! to its tenant's credit at once (which may go negative), so no request is overtaken by more than
//! `lookahead - 1` others that the order would have served after it, and tenants' long-run shares
//! are unchanged.
//!
//! **Leaving.** A request leaves the queue granted, or dropped for a [`DropReason`]: the queue or
//! its tenant's share of it is full, it was evicted to make room for a tenant under its share,
//! its wait passed its deadline, or its client left. Time is passed in; nothing here does I/O.

use crate::backend::{BackendId, Capacity};
use crate::cost::InFlight;
use crate::metrics::{header, sample};
use crate::pool::{AcquireError, Grant, Pool};
use crate::prompt::RequestFeatures;
use crate::random::RandomSource;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use xxhash_rust::xxh3::xxh3_64;

/// A pool's admission knobs (`admission` in the pool's settings).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdmissionConfig {
    /// Whether backends have a capacity and requests queue for it (default false).
    pub enabled: bool,
    /// Most requests waiting in the pool's queue (default 1,024; 1 to 10,000).
    pub max_queue: usize,
    /// Most requests one tenant may have waiting (default 256; 0 = no limit besides its share of
    /// a full queue).
    pub max_queue_per_tenant: usize,
    /// Longest wait before 503 `queue_timeout`, ms (default 30,000; 0 = never wait). A client's
    /// `x-gateway-max-wait-ms` may shorten it.
    pub max_wait_ms: u64,
    /// How far over capacity a backend may be pushed when the queue is empty, as a fraction of
    /// its capacity (default 0: strict; 0.25 lets a backend of 8 sequences run 10).
    pub overcommit: f64,
    /// Requests considered when a freed backend looks for one whose prefix it holds (default 8;
    /// 1 turns the preference off).
    pub lookahead: usize,
    /// Credit a tenant gets per round of deficit round robin, in estimated tokens (default 16, one
    /// KV block: small, so tenants alternate request by request rather than in bursts).
    pub quantum_tokens: u64,
    /// Longest one acquire call waits in the Durable Object before it answers "still queued" and
    /// the Worker asks again, ms (default 5,000). A waiter whose Worker stops asking leaves the
    /// queue within about this long.
    pub poll_ms: u64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            enabled: false,
            max_queue: 1024,
            max_queue_per_tenant: 256,
            max_wait_ms: 30_000,
            overcommit: 0.0,
            lookahead: 8,
            quantum_tokens: 16,
            poll_ms: 5_000,
        }
    }
}

/// Largest accepted `max_queue`.
pub const MAX_QUEUE: usize = 10_000;

impl AdmissionConfig {
    /// Checks every knob's range.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_queue == 0 || self.max_queue > MAX_QUEUE {
            return Err("admission.max_queue must be between 1 and 10,000".into());
        }
        if self.max_queue_per_tenant > self.max_queue {
            return Err(
                "admission.max_queue_per_tenant must be at most max_queue (0: no limit)".into(),
            );
        }
        if self.max_wait_ms > 3_600_000 {
            return Err("admission.max_wait_ms must be at most 3,600,000".into());
        }
        if !(self.overcommit.is_finite() && (0.0..=10.0).contains(&self.overcommit)) {
            return Err("admission.overcommit must be within [0, 10]".into());
        }
        if self.lookahead == 0 || self.lookahead > 64 {
            return Err("admission.lookahead must be between 1 and 64".into());
        }
        if self.quantum_tokens == 0 || self.quantum_tokens > 1_000_000_000 {
            return Err("admission.quantum_tokens must be between 1 and 1,000,000,000".into());
        }
        if !(200..=60_000).contains(&self.poll_ms) {
            return Err("admission.poll_ms must be between 200 and 60,000".into());
        }
        Ok(())
    }
}

/// Whether a backend carrying `in_flight` may take a request adding `tokens` of KV-cache work,
/// `headroom` over its capacity (0 = strict). An idle backend always has room, so a request larger
/// than a whole KV cache is not queued forever.
pub fn has_room(in_flight: &InFlight, capacity: &Capacity, tokens: u64, headroom: f64) -> bool {
    let scale = 1.0 + headroom.clamp(0.0, 10.0);
    let seqs = (f64::from(capacity.max_num_seqs.max(1)) * scale)
        .floor()
        .max(1.0);
    if f64::from(in_flight.leases) >= seqs {
        return false;
    }
    if capacity.kv_blocks > 0 && in_flight.leases > 0 {
        let used = in_flight
            .prompt_tokens
            .saturating_add(in_flight.output_tokens)
            .saturating_add(tokens);
        if used as f64 > capacity.capacity_tokens() as f64 * scale {
            return false;
        }
    }
    true
}

/// A queued request's handle, chosen by the queue.
pub type Ticket = u64;

/// Largest ticket handed out (2^53 - 1, so it survives JavaScript numbers).
pub const MAX_TICKET: u64 = (1 << 53) - 1;

/// Who is asking and how urgently: the admission part of an acquire, as the Worker sends it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdmissionRequest {
    /// The tenant (client key id, else `x-tenant-id`, else `anonymous`).
    pub tenant: String,
    /// Priority band; higher is served first (default 0).
    pub priority: i32,
    /// The client's own limit on its wait, ms (`x-gateway-max-wait-ms`); the pool's applies if
    /// shorter.
    pub max_wait_ms: Option<u64>,
    /// The ticket of an earlier call that answered "still queued": this call continues that wait.
    pub ticket: Option<Ticket>,
    /// How long the Worker has already waited for this request, ms (so a request re-entering a
    /// restarted Durable Object keeps its place in time and its deadline).
    pub waited_ms: u64,
}

/// Lowest and highest accepted priority.
pub const PRIORITY_RANGE: (i32, i32) = (-1000, 1000);

/// Why a request left the queue without a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// The queue was full and the tenant already had its share of it (429 `queue_full`).
    QueueFull,
    /// The tenant had `max_queue_per_tenant` requests waiting (429 `queue_full`).
    TenantLimit,
    /// Dropped from a full queue to make room for a tenant under its share (429 `queue_full`).
    Evicted,
    /// Its wait reached its deadline (503 `queue_timeout`).
    Timeout,
    /// Its client left: hung up, or its Worker stopped asking.
    ClientGone,
    /// No backend of the pool serves its model any more (404 `model_not_found`).
    ModelGone,
}

impl DropReason {
    /// Every reason, in a stable order (for metrics).
    pub const ALL: [DropReason; 6] = [
        DropReason::QueueFull,
        DropReason::TenantLimit,
        DropReason::Evicted,
        DropReason::Timeout,
        DropReason::ClientGone,
        DropReason::ModelGone,
    ];

    /// The reason's name in metrics and the `x-gateway-queue-drop` header.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::QueueFull => "queue_full",
            DropReason::TenantLimit => "tenant_limit",
            DropReason::Evicted => "evicted",
            DropReason::Timeout => "queue_timeout",
            DropReason::ClientGone => "client_gone",
            DropReason::ModelGone => "model_gone",
        }
    }

    /// The OpenAI error code a client sees.
    pub fn code(self) -> &'static str {
        match self {
            DropReason::QueueFull | DropReason::TenantLimit | DropReason::Evicted => "queue_full",
            DropReason::Timeout => "queue_timeout",
            DropReason::ClientGone => "client_closed_request",
            DropReason::ModelGone => "model_not_found",
        }
    }

    fn index(self) -> usize {
        DropReason::ALL.iter().position(|r| *r == self).unwrap_or(0)
    }
}

/// A request waiting for capacity.
#[derive(Debug, Clone, PartialEq)]
pub struct Waiting {
    /// Its handle.
    pub ticket: Ticket,
    /// Its tenant.
    pub tenant: String,
    /// Its priority band.
    pub priority: i32,
    /// Estimated tokens (prompt plus `max_tokens`, at least 1): its deficit-round-robin cost.
    pub cost: u64,
    /// When it arrived (pool time).
    pub arrived_ms: u64,
    /// When it times out.
    pub deadline_ms: u64,
    /// What the pool needs to route it.
    pub features: RequestFeatures,
}

impl Waiting {
    /// A waiting request for `features` from `who`, arriving `now_ms` (less what it already
    /// waited elsewhere) with the pool's `config`.
    pub fn new(
        ticket: Ticket,
        features: RequestFeatures,
        who: &AdmissionRequest,
        config: &AdmissionConfig,
        now_ms: u64,
    ) -> Waiting {
        let max_wait = who
            .max_wait_ms
            .map_or(config.max_wait_ms, |m| m.min(config.max_wait_ms));
        let arrived_ms = now_ms.saturating_sub(who.waited_ms);
        Waiting {
            ticket,
            tenant: who.tenant.clone(),
            priority: who.priority.clamp(PRIORITY_RANGE.0, PRIORITY_RANGE.1),
            cost: (u64::from(features.prompt_tokens) + u64::from(features.max_tokens)).max(1),
            arrived_ms,
            deadline_ms: arrived_ms.saturating_add(max_wait),
            features,
        }
    }
}

/// What happened to a queued request.
#[derive(Debug, Clone, PartialEq)]
pub enum Departure {
    /// It got a lease.
    Admitted {
        /// Its handle.
        ticket: Ticket,
        /// The lease.
        grant: Grant,
        /// Time spent in the queue.
        waited_ms: u64,
    },
    /// It left without one.
    Dropped {
        /// Its handle.
        ticket: Ticket,
        /// Why.
        reason: DropReason,
        /// Time spent in the queue.
        waited_ms: u64,
    },
}

impl Departure {
    /// The request's handle.
    pub fn ticket(&self) -> Ticket {
        match self {
            Departure::Admitted { ticket, .. } | Departure::Dropped { ticket, .. } => *ticket,
        }
    }
}

/// One tenant's requests in one band and its deficit-round-robin credit.
#[derive(Debug, Clone, Default)]
struct Flow {
    queue: VecDeque<Ticket>,
    deficit: i64,
    /// Whether the flow got its quantum on its current turn at the front.
    credited: bool,
}

/// One priority band: its tenants' flows and the round-robin order of those with requests.
#[derive(Debug, Clone, Default)]
struct Band {
    active: VecDeque<u64>,
    flows: HashMap<u64, Flow>,
}

impl Band {
    fn len(&self) -> usize {
        self.flows.values().map(|f| f.queue.len()).sum()
    }

    /// Deficit round robin, one request at a time: the next request this band serves. Both the
    /// real dispatch and the look-ahead (on a copy) call this, so they agree.
    fn pop(&mut self, quantum: i64, cost_of: &dyn Fn(Ticket) -> i64) -> Option<(u64, Ticket)> {
        let mut rotations = 0;
        loop {
            let &tenant = self.active.front()?;
            let Some(flow) = self.flows.get_mut(&tenant) else {
                self.active.pop_front();
                continue;
            };
            let Some(&ticket) = flow.queue.front() else {
                self.active.pop_front();
                self.flows.remove(&tenant);
                continue;
            };
            let cost = cost_of(ticket);
            if flow.deficit >= cost {
                flow.deficit -= cost;
                flow.queue.pop_front();
                if flow.queue.is_empty() {
                    // An idle flow keeps no credit (or debt), as in deficit round robin.
                    self.active.pop_front();
                    self.flows.remove(&tenant);
                }
                return Some((tenant, ticket));
            }
            if !flow.credited {
                flow.deficit = flow.deficit.saturating_add(quantum);
                flow.credited = true;
                continue;
            }
            flow.credited = false;
            self.active.rotate_left(1);
            rotations += 1;
            if rotations >= self.active.len() {
                // A whole round and nobody could pay: skip the rounds in which nobody would.
                let rounds = self
                    .active
                    .iter()
                    .filter_map(|t| {
                        let f = self.flows.get(t)?;
                        let need = cost_of(*f.queue.front()?) - f.deficit;
                        Some((need.max(0) + quantum - 1) / quantum)
                    })
                    .min()
                    .unwrap_or(0);
                if rounds > 1 {
                    for f in self.flows.values_mut() {
                        f.deficit = f.deficit.saturating_add((rounds - 1) * quantum);
                    }
                }
                rotations = 0;
            }
        }
    }
}

/// Requests waiting for capacity in one pool, and the counters about them.
#[derive(Debug, Clone, Default)]
pub struct AdmissionQueue {
    /// Bands by priority (served highest first).
    bands: BTreeMap<i32, Band>,
    waiting: HashMap<Ticket, Waiting>,
    deadlines: BTreeSet<(u64, Ticket)>,
    /// Requests waiting per tenant (hash), across bands.
    per_tenant: HashMap<u64, usize>,
    stats: AdmissionStats,
    plan: Vec<(Ticket, bool)>,
}

fn tenant_key(tenant: &str) -> u64 {
    xxh3_64(tenant.as_bytes())
}

/// Upper bounds of the queue-wait histogram's buckets, in milliseconds.
pub const WAIT_BUCKETS_MS: [u64; 14] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 120_000,
];

/// Counters of a pool's admission control.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdmissionStats {
    /// Requests granted through admission control (at once or after waiting).
    pub admitted: u64,
    /// Of those, requests that waited in the queue first.
    pub queued: u64,
    /// Requests dropped, by [`DropReason`] (indexed as [`DropReason::ALL`]).
    pub dropped: [u64; 6],
    /// Requests that came back with a ticket the queue did not know (a restart) and re-entered.
    pub reentered: u64,
    wait_buckets: [u64; WAIT_BUCKETS_MS.len()],
    wait_count: u64,
    wait_sum_ms: u64,
}

impl AdmissionStats {
    fn observe_wait(&mut self, ms: u64) {
        if let Some(i) = WAIT_BUCKETS_MS.iter().position(|&b| ms <= b) {
            self.wait_buckets[i] += 1;
        }
        self.wait_count += 1;
        self.wait_sum_ms = self.wait_sum_ms.saturating_add(ms);
    }

    /// Requests dropped for `reason`.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped[reason.index()]
    }
}

impl AdmissionQueue {
    /// An empty queue.
    pub fn new() -> Self {
        AdmissionQueue::default()
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Whether `ticket` is waiting.
    pub fn contains(&self, ticket: Ticket) -> bool {
        self.waiting.contains_key(&ticket)
    }

    /// A waiting request.
    pub fn get(&self, ticket: Ticket) -> Option<&Waiting> {
        self.waiting.get(&ticket)
    }

    /// Requests waiting per priority band, highest first.
    pub fn lengths_by_priority(&self) -> Vec<(i32, usize)> {
        self.bands
            .iter()
            .rev()
            .map(|(p, b)| (*p, b.len()))
            .collect()
    }

    /// Distinct tenants with requests waiting.
    pub fn tenants(&self) -> usize {
        self.per_tenant.len()
    }

    /// Requests `tenant` has waiting.
    pub fn tenant_len(&self, tenant: &str) -> usize {
        self.per_tenant
            .get(&tenant_key(tenant))
            .copied()
            .unwrap_or(0)
    }

    /// When the oldest waiting request arrived.
    pub fn oldest_arrival_ms(&self) -> Option<u64> {
        self.waiting.values().map(|w| w.arrived_ms).min()
    }

    /// Estimated tokens waiting (the requests' costs summed).
    pub fn waiting_tokens(&self) -> u64 {
        self.waiting.values().map(|w| w.cost).sum()
    }

    /// The earliest deadline of a waiting request.
    pub fn next_deadline(&self) -> Option<u64> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    /// The counters.
    pub fn stats(&self) -> &AdmissionStats {
        &self.stats
    }

    /// A fresh ticket (random, below 2^53, not in use).
    pub fn new_ticket(&self, rng: &mut dyn RandomSource) -> Ticket {
        loop {
            let t = rng.next_u64() & MAX_TICKET;
            if t != 0 && !self.waiting.contains_key(&t) {
                return t;
            }
        }
    }

    /// Counts a request granted without waiting (the queue was empty and a backend had room).
    pub fn record_immediate(&mut self) {
        self.stats.admitted += 1;
        self.stats.observe_wait(0);
    }

    /// Counts a request that came back with a ticket the queue did not know.
    pub fn record_reentry(&mut self) {
        self.stats.reentered += 1;
    }

    /// Counts a drop decided outside the queue (a request that never entered it: no time to
    /// wait, or its client left).
    pub fn record_drop(&mut self, reason: DropReason) {
        self.stats.dropped[reason.index()] += 1;
    }

    /// Puts a request in the queue, or refuses it. When the queue is full and the request's tenant
    /// is under its share (`max_queue` over the tenants waiting, its own included), the newest
    /// request of the tenant with the most waiting (from its lowest band) is evicted to make room
    /// and returned, for the caller to answer 429.
    pub fn offer(
        &mut self,
        request: Waiting,
        config: &AdmissionConfig,
    ) -> Result<Option<Waiting>, DropReason> {
        let key = tenant_key(&request.tenant);
        let mine = self.per_tenant.get(&key).copied().unwrap_or(0);
        if config.max_queue_per_tenant > 0 && mine >= config.max_queue_per_tenant {
            self.record_drop(DropReason::TenantLimit);
            return Err(DropReason::TenantLimit);
        }
        let mut evicted = None;
        if self.len() >= config.max_queue.max(1) {
            let tenants = self.per_tenant.len() + usize::from(mine == 0);
            let share = (config.max_queue / tenants.max(1)).max(1);
            let victim = self
                .per_tenant
                .iter()
                .filter(|(t, _)| **t != key)
                .max_by_key(|(t, n)| (**n, **t))
                .map(|(t, n)| (*t, *n));
            match victim {
                Some((victim, n)) if mine < share && n > mine + 1 => {
                    let ticket = self
                        .bands
                        .values()
                        .find_map(|b| b.flows.get(&victim).and_then(|f| f.queue.back().copied()));
                    evicted = ticket.and_then(|t| self.remove(t, DropReason::Evicted));
                }
                _ => {}
            }
            if evicted.is_none() {
                self.record_drop(DropReason::QueueFull);
                return Err(DropReason::QueueFull);
            }
        }
        self.insert(request);
        Ok(evicted)
    }

    fn insert(&mut self, request: Waiting) {
        let key = tenant_key(&request.tenant);
        let band = self.bands.entry(request.priority).or_default();
        let flow = band.flows.entry(key).or_default();
        if flow.queue.is_empty() {
            band.active.push_back(key);
        }
        flow.queue.push_back(request.ticket);
        *self.per_tenant.entry(key).or_default() += 1;
        self.deadlines.insert((request.deadline_ms, request.ticket));
        self.waiting.insert(request.ticket, request);
    }

    /// Takes a request out of the queue, counting it as dropped for `reason`.
    pub fn remove(&mut self, ticket: Ticket, reason: DropReason) -> Option<Waiting> {
        let w = self.unlink(ticket, 0)?;
        self.record_drop(reason);
        Some(w)
    }

    /// Takes a request out of its band and the indexes; `charge` is taken off its flow's credit
    /// first (a request served ahead of its turn).
    fn unlink(&mut self, ticket: Ticket, charge: u64) -> Option<Waiting> {
        let w = self.waiting.remove(&ticket)?;
        let key = tenant_key(&w.tenant);
        if let Some(band) = self.bands.get_mut(&w.priority) {
            if let Some(flow) = band.flows.get_mut(&key) {
                flow.deficit = flow.deficit.saturating_sub(charge as i64);
                flow.queue.retain(|t| *t != ticket);
                if flow.queue.is_empty() {
                    band.flows.remove(&key);
                    band.active.retain(|t| *t != key);
                }
            }
            if band.flows.is_empty() {
                self.bands.remove(&w.priority);
            }
        }
        self.forget(&w);
        Some(w)
    }

    fn forget(&mut self, w: &Waiting) {
        let key = tenant_key(&w.tenant);
        if let Some(n) = self.per_tenant.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.per_tenant.remove(&key);
            }
        }
        self.deadlines.remove(&(w.deadline_ms, w.ticket));
    }

    /// Takes a planned request out for service: in turn (the first its band would serve) through
    /// the band's round robin, else charged to its tenant's credit.
    fn take(&mut self, ticket: Ticket, in_turn: bool, quantum: i64) -> Option<Waiting> {
        if in_turn {
            let priority = self.waiting.get(&ticket)?.priority;
            let waiting = &self.waiting;
            let cost_of = |t: Ticket| waiting.get(&t).map_or(1, |w| w.cost as i64);
            let band = self.bands.get_mut(&priority)?;
            let popped = band.pop(quantum, &cost_of).map(|(_, t)| t);
            if band.flows.is_empty() {
                self.bands.remove(&priority);
            }
            debug_assert_eq!(popped, Some(ticket), "plan and round robin disagree");
            let w = self.waiting.remove(&ticket)?;
            self.forget(&w);
            return Some(w);
        }
        let cost = self.waiting.get(&ticket)?.cost;
        self.unlink(ticket, cost)
    }

    /// The next `k` requests in service order: bands highest first, deficit round robin within
    /// a band. Each comes with whether it is the first its band would serve. Lower bands appear
    /// only after every request of the higher ones (they are served when those are blocked).
    pub fn plan(&self, k: usize, quantum_tokens: u64, out: &mut Vec<(Ticket, bool)>) {
        out.clear();
        let quantum = quantum_tokens.clamp(1, i64::MAX as u64) as i64;
        let cost_of = |t: Ticket| self.waiting.get(&t).map_or(1, |w| w.cost as i64);
        for band in self.bands.values().rev() {
            if out.len() >= k {
                break;
            }
            let mut copy = band.clone();
            let mut first = true;
            while out.len() < k {
                match copy.pop(quantum, &cost_of) {
                    Some((_, t)) => out.push((t, first)),
                    None => break,
                }
                first = false;
            }
        }
    }

    /// Drops every request whose deadline has passed.
    pub fn expire(&mut self, now_ms: u64, out: &mut Vec<Departure>) {
        while let Some(&(deadline, ticket)) = self.deadlines.first() {
            if deadline > now_ms {
                break;
            }
            match self.remove(ticket, DropReason::Timeout) {
                Some(w) => out.push(Departure::Dropped {
                    ticket,
                    reason: DropReason::Timeout,
                    waited_ms: now_ms.saturating_sub(w.arrived_ms),
                }),
                None => {
                    self.deadlines.remove(&(deadline, ticket));
                }
            }
        }
    }

    /// Grants leases to waiting requests while backends have room: in the queue's order, the
    /// look-ahead preferring a request whose prefix a `freed` backend holds (one freed backend per
    /// grant), skipping requests whose backends are all full. Expired requests are dropped first.
    /// Departures are appended to `out`.
    pub fn dispatch(
        &mut self,
        pool: &mut Pool,
        config: &AdmissionConfig,
        freed: &[BackendId],
        now_ms: u64,
        rng: &mut dyn RandomSource,
        out: &mut Vec<Departure>,
    ) {
        self.expire(now_ms, out);
        let quantum = config.quantum_tokens.clamp(1, i64::MAX as u64) as i64;
        let mut freed = freed.iter();
        let mut plan = std::mem::take(&mut self.plan);
        let mut order: Vec<usize> = Vec::new();
        while !self.is_empty() {
            self.plan(config.lookahead.max(1), config.quantum_tokens, &mut plan);
            order.clear();
            order.extend(0..plan.len());
            if let Some(backend) = freed.next() {
                // Only the band being served competes for the freed backend's prefix.
                let band = plan
                    .first()
                    .and_then(|(t, _)| self.waiting.get(t))
                    .map(|w| w.priority);
                let best = plan
                    .iter()
                    .enumerate()
                    .filter(|(_, (t, _))| self.waiting.get(t).map(|w| w.priority) == band)
                    .filter_map(|(i, (t, _))| {
                        let w = self.waiting.get(t)?;
                        Some((pool.cached_blocks_on(backend, &w.features.block_hashes), i))
                    })
                    .filter(|(blocks, _)| *blocks > 0)
                    .max_by_key(|(blocks, i)| (*blocks, std::cmp::Reverse(*i)));
                if let Some((_, i)) = best {
                    order.retain(|j| *j != i);
                    order.insert(0, i);
                }
            }
            // Overcommit only for a request that has the queue to itself.
            let headroom = if self.len() == 1 {
                config.overcommit
            } else {
                0.0
            };
            let mut served = false;
            for &i in &order {
                let (ticket, in_turn) = plan[i];
                let Some(w) = self.waiting.get(&ticket) else {
                    continue;
                };
                match pool.acquire_within(&w.features, now_ms, rng, Some(headroom)) {
                    Ok(grant) => {
                        if let Some(w) = self.take(ticket, in_turn, quantum) {
                            let waited_ms = now_ms.saturating_sub(w.arrived_ms);
                            self.stats.admitted += 1;
                            self.stats.queued += 1;
                            self.stats.observe_wait(waited_ms);
                            out.push(Departure::Admitted {
                                ticket,
                                grant,
                                waited_ms,
                            });
                        }
                        served = true;
                        break;
                    }
                    Err(AcquireError::ModelNotFound { .. }) => {
                        if let Some(w) = self.remove(ticket, DropReason::ModelGone) {
                            out.push(Departure::Dropped {
                                ticket,
                                reason: DropReason::ModelGone,
                                waited_ms: now_ms.saturating_sub(w.arrived_ms),
                            });
                        }
                        served = true;
                        break;
                    }
                    // Full, or no backend up: it waits for a lease to end or a backend to recover.
                    Err(_) => continue,
                }
            }
            if !served {
                break;
            }
        }
        self.plan = plan;
    }

    /// Renders the queue's metric families for `pool` (Prometheus text), appending to `out`.
    pub fn render_metrics(&self, pool: &str, out: &mut String) {
        header(
            out,
            "llm_gateway_queue_length",
            "gauge",
            "Requests waiting in the gateway's admission queue, by priority band.",
        );
        let lengths = self.lengths_by_priority();
        if lengths.is_empty() {
            sample(
                out,
                "llm_gateway_queue_length",
                pool,
                &[("priority", "0")],
                0.0,
            );
        }
        for (priority, n) in lengths {
            let p = priority.to_string();
            sample(
                out,
                "llm_gateway_queue_length",
                pool,
                &[("priority", &p)],
                n as f64,
            );
        }
        header(
            out,
            "llm_gateway_queue_dropped_total",
            "counter",
            "Requests that left the admission queue without a lease, by reason.",
        );
        for reason in DropReason::ALL {
            let n = self.stats.dropped(reason) as f64;
            sample(
                out,
                "llm_gateway_queue_dropped_total",
                pool,
                &[("reason", reason.as_str())],
                n,
            );
        }
        header(
            out,
            "llm_gateway_queue_admitted_total",
            "counter",
            "Requests granted under admission control, by whether they waited in the queue.",
        );
        let s = &self.stats;
        let immediate = s.admitted.saturating_sub(s.queued) as f64;
        sample(
            out,
            "llm_gateway_queue_admitted_total",
            pool,
            &[("queued", "false")],
            immediate,
        );
        sample(
            out,
            "llm_gateway_queue_admitted_total",
            pool,
            &[("queued", "true")],
            s.queued as f64,
        );
        header(
            out,
            "llm_gateway_queue_wait_seconds",
            "histogram",
            "Time granted requests spent in the admission queue (0 for those granted at once).",
        );
        let mut cumulative = 0;
        for (i, bound) in WAIT_BUCKETS_MS.iter().enumerate() {
            cumulative += s.wait_buckets[i];
            let le = format!("{}", *bound as f64 / 1000.0);
            sample(
                out,
                "llm_gateway_queue_wait_seconds_bucket",
                pool,
                &[("le", &le)],
                cumulative as f64,
            );
        }
        let count = s.wait_count as f64;
        sample(
            out,
            "llm_gateway_queue_wait_seconds_bucket",
            pool,
            &[("le", "+Inf")],
            count,
        );
        let sum = s.wait_sum_ms as f64 / 1000.0;
        sample(out, "llm_gateway_queue_wait_seconds_sum", pool, &[], sum);
        sample(
            out,
            "llm_gateway_queue_wait_seconds_count",
            pool,
            &[],
            count,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendSpec;
    use crate::outcome::Outcome;
    use crate::pool::{PoolConfig, ProbeResult};
    use crate::prompt::{request_features, FeatureConfig};
    use crate::random::SplitMix64;
    use serde_json::json;

    const Q: u64 = 100;

    fn config() -> AdmissionConfig {
        AdmissionConfig {
            enabled: true,
            quantum_tokens: Q,
            ..AdmissionConfig::default()
        }
    }

    fn features(text: &str, max_tokens: u32) -> RequestFeatures {
        let body = json!({"model": "llama", "max_tokens": max_tokens,
                          "messages": [{"role": "user", "content": text}]});
        request_features(&body, &|_| None, &FeatureConfig::default()).unwrap()
    }

    /// A waiting request of `cost` tokens (all of them output tokens: an empty-ish prompt).
    fn waiting(ticket: Ticket, tenant: &str, priority: i32, cost: u64, at: u64) -> Waiting {
        Waiting {
            ticket,
            tenant: tenant.into(),
            priority,
            cost,
            arrived_ms: at,
            deadline_ms: at + 60_000,
            features: features(&format!("request {ticket}"), 8),
        }
    }

    /// Serves `n` requests in order (always the planned head) and returns their tickets.
    fn serve(q: &mut AdmissionQueue, n: usize) -> Vec<Ticket> {
        let mut plan = Vec::new();
        let mut served = Vec::new();
        for _ in 0..n {
            q.plan(1, Q, &mut plan);
            let Some(&(t, in_turn)) = plan.first() else {
                break;
            };
            assert!(in_turn);
            q.take(t, true, Q as i64).unwrap();
            served.push(t);
        }
        served
    }

    #[test]
    fn room_counts_sequences_and_known_kv_tokens() {
        let cap = Capacity {
            max_num_seqs: 2,
            kv_blocks: 0,
            block_size: 16,
        };
        let mut f = InFlight::default();
        assert!(
            has_room(&f, &cap, 1_000_000, 0.0),
            "an idle backend always has room"
        );
        f.add(10, 10);
        assert!(has_room(&f, &cap, 10, 0.0));
        f.add(10, 10);
        assert!(
            !has_room(&f, &cap, 10, 0.0),
            "two sequences fill max_num_seqs 2"
        );
        assert!(
            has_room(&f, &cap, 10, 0.5),
            "50% over capacity allows a third"
        );
        let kv = Capacity {
            max_num_seqs: 100,
            kv_blocks: 10,
            block_size: 16,
        };
        let mut g = InFlight::default();
        g.add(100, 40);
        assert!(has_room(&g, &kv, 20, 0.0), "140 + 20 tokens fit in 160");
        assert!(!has_room(&g, &kv, 21, 0.0), "161 tokens do not");
        assert!(has_room(&g, &kv, 21, 0.1));
    }

    #[test]
    fn config_ranges_are_checked() {
        assert!(AdmissionConfig::default().validate().is_ok());
        for bad in [
            AdmissionConfig {
                max_queue: 0,
                ..config()
            },
            AdmissionConfig {
                max_queue: 10_001,
                ..config()
            },
            AdmissionConfig {
                max_queue: 10,
                max_queue_per_tenant: 11,
                ..config()
            },
            AdmissionConfig {
                overcommit: -0.1,
                ..config()
            },
            AdmissionConfig {
                overcommit: f64::NAN,
                ..config()
            },
            AdmissionConfig {
                lookahead: 0,
                ..config()
            },
            AdmissionConfig {
                quantum_tokens: 0,
                ..config()
            },
            AdmissionConfig {
                poll_ms: 100,
                ..config()
            },
            AdmissionConfig {
                max_wait_ms: 3_600_001,
                ..config()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let json: AdmissionConfig = serde_json::from_str(r#"{"enabled": true}"#).unwrap();
        assert_eq!(
            json,
            AdmissionConfig {
                enabled: true,
                ..AdmissionConfig::default()
            }
        );
    }

    #[test]
    fn waiting_takes_the_shorter_wait_and_keeps_time_already_waited() {
        let who = AdmissionRequest {
            tenant: "t".into(),
            priority: 5000,
            max_wait_ms: Some(2_000),
            waited_ms: 500,
            ..AdmissionRequest::default()
        };
        let w = Waiting::new(7, features("hi", 10), &who, &config(), 10_000);
        assert_eq!((w.arrived_ms, w.deadline_ms), (9_500, 11_500));
        assert_eq!(w.priority, PRIORITY_RANGE.1, "priority is clamped");
        assert_eq!(w.cost, u64::from(w.features.prompt_tokens) + 10);
        let long = AdmissionRequest {
            max_wait_ms: Some(999_999),
            ..who
        };
        let w = Waiting::new(8, features("hi", 10), &long, &config(), 10_000);
        assert_eq!(
            w.deadline_ms,
            9_500 + config().max_wait_ms,
            "the pool's limit caps the client's"
        );
    }

    #[test]
    fn higher_priority_is_served_first_then_arrival_order_within_a_tenant() {
        let mut q = AdmissionQueue::new();
        let c = config();
        for (t, p) in [(1, 0), (2, 0), (3, 5), (4, -1), (5, 5)] {
            q.offer(waiting(t, "a", p, 50, t), &c).unwrap();
        }
        assert_eq!(q.lengths_by_priority(), vec![(5, 2), (0, 2), (-1, 1)]);
        assert_eq!(serve(&mut q, 5), vec![3, 5, 1, 2, 4]);
        assert!(q.is_empty());
        assert!(q.bands.is_empty() && q.per_tenant.is_empty() && q.deadlines.is_empty());
    }

    #[test]
    fn equal_tenants_alternate_whatever_one_of_them_floods() {
        let mut q = AdmissionQueue::new();
        let c = AdmissionConfig {
            max_queue_per_tenant: 0,
            ..config()
        };
        for i in 0..100 {
            q.offer(waiting(1000 + i, "flood", 0, 100, i), &c).unwrap();
        }
        for i in 0..10 {
            q.offer(waiting(2000 + i, "light", 0, 100, 100 + i), &c)
                .unwrap();
        }
        let served = serve(&mut q, 20);
        let light = served.iter().filter(|t| **t >= 2000).count();
        assert_eq!(
            light, 10,
            "the light tenant gets half of the first 20: {served:?}"
        );
    }

    #[test]
    fn shares_are_in_tokens_so_long_requests_do_not_starve_short_ones() {
        let mut q = AdmissionQueue::new();
        let c = AdmissionConfig {
            max_queue_per_tenant: 0,
            ..config()
        };
        for i in 0..50 {
            q.offer(waiting(1000 + i, "long", 0, 1000, i), &c).unwrap();
            q.offer(waiting(2000 + i * 10, "short", 0, 100, i), &c)
                .unwrap();
        }
        for i in 0..450 {
            q.offer(waiting(10_000 + i, "short", 0, 100, 100 + i), &c)
                .unwrap();
        }
        let served = serve(&mut q, 110);
        let tokens = |pred: &dyn Fn(Ticket) -> bool| -> u64 {
            served
                .iter()
                .filter(|t| pred(**t))
                .map(|t| if *t < 2000 { 1000 } else { 100 })
                .sum()
        };
        let long = tokens(&|t| t < 2000);
        let short = tokens(&|t| t >= 2000);
        assert!(
            long.abs_diff(short) <= 1000,
            "tokens served: long {long}, short {short}"
        );
    }

    #[test]
    fn a_request_larger_than_many_quanta_is_served_without_spinning() {
        let mut q = AdmissionQueue::new();
        let c = config();
        q.offer(waiting(1, "big", 0, 1_000_000_000, 0), &c).unwrap();
        q.offer(waiting(2, "small", 0, 10, 0), &c).unwrap();
        assert_eq!(serve(&mut q, 2), vec![2, 1]);
    }

    #[test]
    fn the_plan_agrees_with_the_round_robin_under_random_operations() {
        let mut rng = SplitMix64::new(42);
        let mut q = AdmissionQueue::new();
        let c = AdmissionConfig {
            max_queue: 200,
            max_queue_per_tenant: 0,
            ..config()
        };
        let mut next = 1;
        let mut plan = Vec::new();
        for step in 0..5_000u64 {
            match rng.next_u64() % 4 {
                0 | 1 => {
                    let tenant = format!("t{}", rng.next_u64() % 5);
                    let priority = (rng.next_u64() % 3) as i32;
                    let cost = 1 + rng.next_u64() % 400;
                    let _ = q.offer(waiting(next, &tenant, priority, cost, step), &c);
                    next += 1;
                }
                2 => {
                    q.plan(4, Q, &mut plan);
                    if !plan.is_empty() {
                        let (t, in_turn) = plan[(rng.next_u64() % plan.len() as u64) as usize];
                        assert_eq!(q.take(t, in_turn, Q as i64).map(|w| w.ticket), Some(t));
                    }
                }
                _ => {
                    let tickets: Vec<Ticket> = q.waiting.keys().copied().collect();
                    if !tickets.is_empty() {
                        let t = tickets[(rng.next_u64() % tickets.len() as u64) as usize];
                        q.remove(t, DropReason::ClientGone).unwrap();
                    }
                }
            }
            // The indexes agree with the bands.
            let in_bands: usize = q.bands.values().map(Band::len).sum();
            assert_eq!(in_bands, q.len());
            assert_eq!(q.per_tenant.values().sum::<usize>(), q.len());
            assert_eq!(q.deadlines.len(), q.len());
            for band in q.bands.values() {
                assert_eq!(band.active.len(), band.flows.len());
            }
        }
    }

    #[test]
    fn a_full_queue_refuses_tenants_over_their_share_and_evicts_for_those_under_it() {
        let mut q = AdmissionQueue::new();
        let c = AdmissionConfig {
            max_queue: 4,
            max_queue_per_tenant: 0,
            ..config()
        };
        for i in 0..4 {
            q.offer(waiting(i + 1, "flood", 0, 10, i), &c).unwrap();
        }
        assert_eq!(
            q.offer(waiting(10, "flood", 0, 10, 9), &c),
            Err(DropReason::QueueFull)
        );
        let evicted = q.offer(waiting(20, "other", 0, 10, 10), &c).unwrap();
        assert_eq!(
            evicted.map(|w| w.ticket),
            Some(4),
            "the flood's newest makes room"
        );
        assert_eq!((q.tenant_len("flood"), q.tenant_len("other")), (3, 1));
        q.offer(waiting(21, "other", 0, 10, 11), &c).unwrap();
        assert_eq!(
            q.offer(waiting(22, "other", 0, 10, 12), &c),
            Err(DropReason::QueueFull),
            "2 of 4 is its share"
        );
        assert_eq!(q.stats().dropped(DropReason::Evicted), 2);
        assert_eq!(q.stats().dropped(DropReason::QueueFull), 2);
        let limited = AdmissionConfig {
            max_queue_per_tenant: 1,
            ..c
        };
        let mut q = AdmissionQueue::new();
        q.offer(waiting(1, "a", 0, 10, 0), &limited).unwrap();
        assert_eq!(
            q.offer(waiting(2, "a", 0, 10, 0), &limited),
            Err(DropReason::TenantLimit)
        );
        q.offer(waiting(3, "b", 0, 10, 0), &limited).unwrap();
    }

    #[test]
    fn expired_requests_leave_with_their_wait() {
        let mut q = AdmissionQueue::new();
        let c = config();
        let mut w = waiting(1, "a", 0, 10, 1_000);
        w.deadline_ms = 3_000;
        q.offer(w, &c).unwrap();
        q.offer(waiting(2, "a", 0, 10, 1_000), &c).unwrap();
        assert_eq!(q.next_deadline(), Some(3_000));
        let mut out = Vec::new();
        q.expire(2_999, &mut out);
        assert!(out.is_empty());
        q.expire(3_000, &mut out);
        assert_eq!(
            out,
            vec![Departure::Dropped {
                ticket: 1,
                reason: DropReason::Timeout,
                waited_ms: 2_000
            }]
        );
        assert_eq!(q.len(), 1);
    }

    fn pool(backends: usize, max_num_seqs: u32, policy: crate::policy::PolicyKind) -> Pool {
        let mut pool = Pool::new(
            "p",
            PoolConfig {
                policy,
                admission: config(),
                ..PoolConfig::default()
            },
        );
        for i in 0..backends {
            let mut spec = BackendSpec {
                id: format!("b{i}").into(),
                url: format!("http://b{i}:8000"),
                models: vec!["llama".into()],
                ..BackendSpec::default()
            };
            spec.capacity.max_num_seqs = max_num_seqs;
            let id = pool.add_backend(spec, 0).unwrap();
            pool.record_probe(
                &id,
                &ProbeResult {
                    ok: true,
                    ..ProbeResult::default()
                },
                0,
            )
            .unwrap();
        }
        pool
    }

    fn enqueue(
        q: &mut AdmissionQueue,
        ticket: Ticket,
        tenant: &str,
        priority: i32,
        text: &str,
        now: u64,
    ) {
        let who = AdmissionRequest {
            tenant: tenant.into(),
            priority,
            ..AdmissionRequest::default()
        };
        q.offer(
            Waiting::new(ticket, features(text, 16), &who, &config(), now),
            &config(),
        )
        .unwrap();
    }

    fn admitted(out: &[Departure]) -> Vec<(Ticket, String)> {
        out.iter()
            .filter_map(|d| match d {
                Departure::Admitted { ticket, grant, .. } => {
                    Some((*ticket, grant.backend.0.clone()))
                }
                _ => None,
            })
            .collect()
    }

    /// The lease granted to `ticket` among `out`'s departures.
    fn lease_of(out: &[Departure], ticket: Ticket) -> (u64, BackendId) {
        out.iter()
            .find_map(|d| match d {
                Departure::Admitted {
                    ticket: t, grant, ..
                } if *t == ticket => Some((grant.lease_id, grant.backend.clone())),
                _ => None,
            })
            .unwrap()
    }

    fn ok() -> Outcome {
        Outcome::of_kind(crate::outcome::OutcomeKind::Success)
    }

    #[test]
    fn dispatch_grants_up_to_capacity_and_the_next_when_a_lease_ends() {
        let mut pool = pool(2, 2, crate::policy::PolicyKind::LeastLoad);
        let mut q = AdmissionQueue::new();
        let mut rng = SplitMix64::new(1);
        for t in 1..=6 {
            enqueue(&mut q, t, "a", 0, &format!("question {t}"), 0);
        }
        let mut out = Vec::new();
        q.dispatch(&mut pool, &config(), &[], 10, &mut rng, &mut out);
        let first: Vec<Ticket> = admitted(&out).iter().map(|a| a.0).collect();
        assert_eq!(first, vec![1, 2, 3, 4]);
        assert_eq!(q.len(), 2);
        assert_eq!(pool.live_leases(), 4);
        // Nothing has room: dispatching again grants nothing.
        let mut more = Vec::new();
        q.dispatch(&mut pool, &config(), &[], 20, &mut rng, &mut more);
        assert!(more.is_empty());
        // A lease ends: exactly one more is granted, on the backend that freed.
        let (lease, backend) = lease_of(&out, 1);
        pool.release(lease, &ok(), 30);
        let freed = pool.take_freed();
        assert_eq!(freed, vec![backend.clone()]);
        q.dispatch(&mut pool, &config(), &freed, 30, &mut rng, &mut more);
        assert_eq!(admitted(&more), vec![(5, backend.0.clone())]);
        assert!(matches!(more[0], Departure::Admitted { waited_ms: 30, .. }));
        assert_eq!(q.stats().queued, 5);
        pool.check_counters().unwrap();
    }

    #[test]
    fn a_freed_backend_prefers_a_queued_request_whose_prefix_it_holds() {
        let mut pool = pool(2, 1, crate::policy::PolicyKind::CacheAware);
        let mut rng = SplitMix64::new(3);
        let shared = "You are a careful assistant who answers in French. ".repeat(30);
        // Two requests with different prompts hold both backends.
        let mut q = AdmissionQueue::new();
        let mut out = Vec::new();
        enqueue(&mut q, 1, "a", 0, &format!("{shared} first"), 0);
        q.dispatch(&mut pool, &config(), &[], 0, &mut rng, &mut out);
        enqueue(&mut q, 2, "a", 0, "something else entirely", 0);
        q.dispatch(&mut pool, &config(), &[], 0, &mut rng, &mut out);
        assert_eq!(pool.live_leases(), 2);
        let (lease, home) = lease_of(&out, 1);
        // Queue: an unrelated request first, then one sharing the long prefix.
        enqueue(&mut q, 3, "b", 0, "an unrelated question", 1);
        enqueue(&mut q, 4, "c", 0, &format!("{shared} second"), 2);
        // The prefix's home frees up: it takes request 4 although 3 is first in line.
        pool.release(lease, &ok(), 5);
        let freed = pool.take_freed();
        out.clear();
        q.dispatch(&mut pool, &config(), &freed, 5, &mut rng, &mut out);
        assert_eq!(admitted(&out), vec![(4, home.0.clone())]);
        // With look-ahead 1 the queue's order wins: request 3 goes first.
        enqueue(&mut q, 6, "c", 0, &format!("{shared} third"), 3);
        let (lease, _) = lease_of(&out, 4);
        pool.release(lease, &ok(), 6);
        let freed = pool.take_freed();
        out.clear();
        let strict = AdmissionConfig {
            lookahead: 1,
            ..config()
        };
        q.dispatch(&mut pool, &strict, &freed, 6, &mut rng, &mut out);
        assert_eq!(
            admitted(&out).iter().map(|a| a.0).collect::<Vec<_>>(),
            vec![3]
        );
    }

    #[test]
    fn overcommit_applies_only_to_a_request_alone_in_the_queue() {
        let mut pool = pool(1, 2, crate::policy::PolicyKind::LeastLoad);
        let mut rng = SplitMix64::new(5);
        let c = AdmissionConfig {
            overcommit: 0.5,
            ..config()
        };
        let mut q = AdmissionQueue::new();
        let mut out = Vec::new();
        for t in 1..=2 {
            enqueue(&mut q, t, "a", 0, &format!("q{t}"), 0);
        }
        q.dispatch(&mut pool, &c, &[], 0, &mut rng, &mut out);
        assert_eq!(pool.live_leases(), 2);
        enqueue(&mut q, 3, "a", 0, "q3", 0);
        enqueue(&mut q, 4, "a", 0, "q4", 0);
        q.dispatch(&mut pool, &c, &[], 0, &mut rng, &mut out);
        assert_eq!(pool.live_leases(), 2, "two waiting: strict capacity");
        q.remove(4, DropReason::ClientGone);
        q.dispatch(&mut pool, &c, &[], 0, &mut rng, &mut out);
        assert_eq!(pool.live_leases(), 3, "alone in the queue: 50% over 2 is 3");
    }

    #[test]
    fn a_request_whose_model_left_the_pool_is_dropped() {
        let mut pool = pool(1, 4, crate::policy::PolicyKind::LeastLoad);
        let mut rng = SplitMix64::new(5);
        let mut q = AdmissionQueue::new();
        let who = AdmissionRequest {
            tenant: "a".into(),
            ..AdmissionRequest::default()
        };
        let body = json!({"model": "gone", "messages": [{"role": "user", "content": "x"}]});
        let f = request_features(&body, &|_| None, &FeatureConfig::default()).unwrap();
        q.offer(Waiting::new(1, f, &who, &config(), 0), &config())
            .unwrap();
        let mut out = Vec::new();
        q.dispatch(&mut pool, &config(), &[], 0, &mut rng, &mut out);
        assert!(matches!(
            out[..],
            [Departure::Dropped {
                reason: DropReason::ModelGone,
                ..
            }]
        ));
    }

    #[test]
    fn metrics_render_every_family() {
        let mut q = AdmissionQueue::new();
        q.offer(waiting(1, "a", 3, 10, 0), &config()).unwrap();
        q.record_immediate();
        q.record_drop(DropReason::Timeout);
        let mut out = String::new();
        q.render_metrics("p\"1", &mut out);
        assert!(
            out.contains("llm_gateway_queue_length{pool=\"p\\\"1\",priority=\"3\"} 1"),
            "{out}"
        );
        assert!(out.contains(
            "llm_gateway_queue_dropped_total{pool=\"p\\\"1\",reason=\"queue_timeout\"} 1"
        ));
        assert!(
            out.contains("llm_gateway_queue_wait_seconds_bucket{pool=\"p\\\"1\",le=\"0.005\"} 1")
        );
        assert!(out.contains("llm_gateway_queue_wait_seconds_count{pool=\"p\\\"1\"} 1"));
    }
}
