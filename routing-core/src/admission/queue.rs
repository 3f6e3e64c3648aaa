//! The [`AdmissionQueue`]: requests waiting for capacity in one pool, in priority bands of fair
//! shares, with its limits (per queue and per tenant), eviction for a tenant under its share,
//! deadlines, and the service plan the dispatcher follows.

use super::fair_share::{tenant_key, Band};
use super::request::{Departure, DropReason, Ticket, Waiting, MAX_TICKET};
use super::stats::AdmissionStats;
use crate::pool::AdmissionConfig;
use crate::random::RandomSource;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Requests waiting for capacity in one pool, and the counters about them.
#[derive(Debug, Clone, Default)]
pub struct AdmissionQueue {
    /// Bands by priority (served highest first).
    pub(super) bands: BTreeMap<i32, Band>,
    pub(super) waiting: HashMap<Ticket, Waiting>,
    deadlines: BTreeSet<(u64, Ticket)>,
    /// Requests waiting per tenant (hash), across bands.
    per_tenant: HashMap<u64, usize>,
    /// Requests waiting per model, across bands (a new request for a model nobody waits for is
    /// tried at once).
    per_model: HashMap<String, usize>,
    pub(super) stats: AdmissionStats,
    pub(super) plan: Vec<(Ticket, bool)>,
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

    /// Requests waiting for `model`.
    pub fn waiting_for_model(&self, model: &str) -> usize {
        self.per_model.get(model).copied().unwrap_or(0)
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
        *self
            .per_model
            .entry(request.features.model.clone())
            .or_default() += 1;
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
        if let Some(n) = self.per_model.get_mut(&w.features.model) {
            *n -= 1;
            if *n == 0 {
                self.per_model.remove(&w.features.model);
            }
        }
        self.deadlines.remove(&(w.deadline_ms, w.ticket));
    }

    /// Takes a planned request out for service: in turn (the first its band would serve) through
    /// the band's round robin, else charged to its tenant's credit.
    pub(super) fn take(&mut self, ticket: Ticket, in_turn: bool, quantum: i64) -> Option<Waiting> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::test_support::{config, serve, waiting, Q};
    use crate::random::SplitMix64;

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
        assert!(q.per_model.is_empty());
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
            assert_eq!(q.per_model.values().sum::<usize>(), q.len());
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
}
