//! The waiting room: acquires that wait inside a pool's Durable Object until a backend has room.
//!
//! The queue's order and limits are `routing_core::admission`'s; this module holds the open calls.
//! A queued acquire is an HTTP call from the Worker that stays open while its request waits: when
//! the queue grants it a lease (a lease ended, a backend joined or recovered) or drops it, the
//! verdict goes through a one-shot channel to that call, which answers. A call waits at most
//! `poll_ms` and then answers `202` with the request's ticket; the Worker asks again at once with
//! the ticket. That keeps every waiter's liveness visible here, whatever the platform tells:
//!
//! - a caller that hung up while its call was open: its request signal aborts (workerd propagates
//!   the cancellation of a Durable Object call in production; locally it does not), or its channel
//!   reports the call dropped; checked at every grant and every sweep;
//! - a Worker that stopped asking (its invocation ended, or it crashed): no call is open for
//!   longer than [`POLL_GRACE_MS`], and the sweep drops it;
//! - a verdict reached while no call was open is parked for the next call; a parked lease nobody
//!   picks up within the grace is released;
//! - the Durable Object restarted: the Worker's call fails or its ticket is unknown here, and the
//!   request re-enters the queue with the time it already waited (so its deadline holds);
//! - a grant answered to a call whose Worker had already given up on it (its client hung up while
//!   the answer was on its way, or before any answer): the Worker names the wait in a dequeue
//!   (its `wait_id`, which is the ticket), and the lease of a grant delivered under that ticket in
//!   the last `DELIVERED_KEEP_MS` goes back at once, not after `lease_ttl_ms`.
//!
//! **When the queue is dispatched.** Only when room may have appeared: a lease share ended (the
//! pool's freed list), or the Durable Object [`WaitingRoom::wake`]s it (a probe, a registry or
//! configuration change, a sibling's load); deadlines are enforced when they pass. A renewal or a
//! new request queued behind others costs no dispatch, so a call's work does not grow with the
//! queue. A new request whose model has nobody waiting is tried at once, whatever waits for other
//! models.

use futures_channel::oneshot;
use routing_core::admission::{
    AdmissionConfig, AdmissionQueue, AdmissionRequest, DeliveredGrants, Departure, DropReason,
    Ticket, Waiting,
};
use routing_core::outcome::{Outcome, OutcomeKind};
use routing_core::pool::{AcquireError, Grant, Pool};
use routing_core::prompt::RequestFeatures;
use routing_core::random::RandomSource;
use std::collections::HashMap;

/// How long a queued request may go without an open call before the sweep counts its client as
/// gone (the Worker asks again within milliseconds of a `202`).
pub const POLL_GRACE_MS: u64 = 3_000;
/// Least time between two sweeps.
const SWEEP_EVERY_MS: u64 = 250;

/// How a queued request's wait ended.
#[derive(Debug)]
pub enum Verdict {
    /// A lease.
    Granted {
        /// The lease and candidates.
        grant: Grant,
        /// Time spent waiting (including any time before a restart).
        waited_ms: u64,
    },
    /// No lease.
    Dropped {
        /// Why.
        reason: DropReason,
        /// Time spent waiting.
        waited_ms: u64,
    },
}

impl From<Departure> for Verdict {
    fn from(d: Departure) -> Verdict {
        match d {
            Departure::Admitted {
                grant, waited_ms, ..
            } => Verdict::Granted { grant, waited_ms },
            Departure::Dropped {
                reason, waited_ms, ..
            } => Verdict::Dropped { reason, waited_ms },
        }
    }
}

/// One queued request's connection to its client.
struct Waiter {
    /// The open call waiting for the verdict, if one is open.
    call: Option<oneshot::Sender<Verdict>>,
    /// Which call that is (a newer call with the same ticket supersedes an older one).
    call_id: u64,
    /// The open call's request signal.
    signal: Option<web_sys::AbortSignal>,
    /// A verdict reached while no call was open, for the next call.
    parked: Option<Verdict>,
    /// When the last call ended (or the verdict was parked).
    since_ms: u64,
}

impl Waiter {
    fn caller_left(&self, now_ms: u64) -> bool {
        match &self.call {
            Some(tx) => tx.is_canceled() || self.signal.as_ref().is_some_and(|s| s.aborted()),
            None => now_ms > self.since_ms.saturating_add(POLL_GRACE_MS),
        }
    }
}

/// What an acquire does next.
pub enum Step {
    /// Answer now.
    Done(Verdict),
    /// The pool is full and the caller may try another pool: answer so, without queueing.
    Spill,
    /// The pool cannot serve the request at all (unknown model, no backend up).
    Refused(AcquireError),
    /// Wait for the verdict on `rx`, at most until `until_ms`.
    Wait {
        /// The request's ticket.
        ticket: Ticket,
        /// The call's id, for [`WaitingRoom::pause`].
        call_id: u64,
        /// Where the verdict arrives.
        rx: oneshot::Receiver<Verdict>,
        /// When the call should answer `202` if nothing arrived.
        until_ms: u64,
    },
}

/// A pool's queue and the calls waiting on it.
#[derive(Default)]
pub struct WaitingRoom {
    /// The queue (order, limits, counters).
    pub queue: AdmissionQueue,
    waiters: HashMap<Ticket, Waiter>,
    next_call: u64,
    last_sweep_ms: u64,
    /// Room may have appeared without a lease ending (a probe, a config change): dispatch.
    dirty: bool,
    /// Grants answered recently, for a dequeue of a wait whose Worker never read its answer.
    delivered: DeliveredGrants,
}

impl WaitingRoom {
    /// Whether no request waits and no verdict is parked.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.waiters.is_empty()
    }

    /// Room may have appeared other than by a lease ending (a probe, a registry or configuration
    /// change, a sibling's load report): the next settle dispatches.
    pub fn wake(&mut self) {
        self.dirty = true;
    }

    /// Remembers a grant answered under `ticket`, so a dequeue naming it releases its lease.
    pub fn record_delivered(&mut self, ticket: Ticket, lease_id: u64, now_ms: u64) {
        self.delivered.record(ticket, lease_id, now_ms);
    }

    /// A verdict about to be answered under `ticket`: a grant is remembered (see
    /// [`Self::record_delivered`]).
    fn answered(&mut self, ticket: Ticket, verdict: Verdict, now_ms: u64) -> Verdict {
        if let Verdict::Granted { grant, .. } = &verdict {
            self.record_delivered(ticket, grant.lease_id, now_ms);
        }
        verdict
    }

    /// Whether `ticket` belongs to a wait in progress here.
    pub fn knows(&self, ticket: Option<Ticket>) -> bool {
        ticket.is_some_and(|t| self.waiters.contains_key(&t))
    }

    /// Admits, queues or refuses a request: a new one, one asking again with its ticket, or one
    /// whose ticket this room does not know (it re-enters, keeping the time it already waited).
    #[allow(clippy::too_many_arguments)]
    pub fn enter(
        &mut self,
        pool: &mut Pool,
        config: &AdmissionConfig,
        features: RequestFeatures,
        who: &AdmissionRequest,
        spill_ok: bool,
        signal: Option<web_sys::AbortSignal>,
        now_ms: u64,
        rng: &mut dyn RandomSource,
    ) -> Step {
        if let Some(ticket) = who.ticket {
            if let Some(w) = self.waiters.get_mut(&ticket) {
                if let Some(verdict) = w.parked.take() {
                    self.waiters.remove(&ticket);
                    return Step::Done(self.answered(ticket, verdict, now_ms));
                }
                if self.queue.contains(ticket) {
                    return self.open_call(ticket, signal, config, now_ms);
                }
                self.waiters.remove(&ticket);
            }
            self.queue.record_reentry();
        }
        let free = |t: Ticket| !self.queue.contains(t) && !self.waiters.contains_key(&t);
        let ticket = who
            .ticket
            .filter(|t| free(*t))
            .or_else(|| who.chosen_ticket(free))
            .unwrap_or_else(|| self.queue.new_ticket(rng));
        let request = Waiting::new(ticket, features, who, config, now_ms);
        // Nobody waits for this model: whatever waits for others cannot use its backends' room
        // (or it would have been granted when that room appeared), so it is tried at once.
        if self.queue.waiting_for_model(&request.features.model) == 0 {
            // Overcommit only for a request that has the queue to itself.
            let headroom = if self.queue.is_empty() {
                config.overcommit
            } else {
                0.0
            };
            match pool.acquire_within(
                &request.features,
                now_ms,
                rng,
                config.enabled.then_some(headroom),
            ) {
                Ok(grant) => {
                    self.queue.record_immediate();
                    let waited_ms = who.waited_ms;
                    let verdict = Verdict::Granted { grant, waited_ms };
                    return Step::Done(self.answered(ticket, verdict, now_ms));
                }
                Err(AcquireError::AtCapacity) => {}
                Err(e) => return Step::Refused(e),
            }
        }
        if spill_ok {
            return Step::Spill;
        }
        let waited_ms = who.waited_ms;
        if request.deadline_ms <= now_ms {
            self.queue.record_drop(DropReason::Timeout);
            let reason = DropReason::Timeout;
            return Step::Done(Verdict::Dropped { reason, waited_ms });
        }
        match self.queue.offer(request, config) {
            Err(reason) => return Step::Done(Verdict::Dropped { reason, waited_ms }),
            Ok(Some(evicted)) => {
                let waited_ms = now_ms.saturating_sub(evicted.arrived_ms);
                let ticket = evicted.ticket;
                let reason = DropReason::Evicted;
                self.deliver(
                    pool,
                    Departure::Dropped {
                        ticket,
                        reason,
                        waited_ms,
                    },
                    now_ms,
                );
            }
            Ok(None) => {}
        }
        // Nothing freed room: the new request waits behind its model's without a dispatch.
        self.open_call(ticket, signal, config, now_ms)
    }

    fn open_call(
        &mut self,
        ticket: Ticket,
        signal: Option<web_sys::AbortSignal>,
        config: &AdmissionConfig,
        now_ms: u64,
    ) -> Step {
        let (tx, rx) = oneshot::channel();
        self.next_call += 1;
        let call_id = self.next_call;
        let waiter = self.waiters.entry(ticket).or_insert(Waiter {
            call: None,
            call_id,
            signal: None,
            parked: None,
            since_ms: now_ms,
        });
        // A newer call supersedes an older one still open: the older one answers 202.
        waiter.call = Some(tx);
        waiter.call_id = call_id;
        waiter.signal = signal;
        let deadline = self.queue.get(ticket).map_or(now_ms, |w| w.deadline_ms);
        let until_ms = now_ms
            .saturating_add(config.poll_ms)
            .min(deadline.saturating_add(1));
        Step::Wait {
            ticket,
            call_id,
            rx,
            until_ms,
        }
    }

    /// Drops waiters whose client left and requests past their deadline, then, if room may have
    /// appeared (a lease share ended, or [`Self::wake`]), grants leases while backends have room.
    /// Cheap when nothing changed: call after every call.
    pub fn settle(
        &mut self,
        pool: &mut Pool,
        config: &AdmissionConfig,
        now_ms: u64,
        rng: &mut dyn RandomSource,
    ) {
        self.delivered.forget_old(now_ms);
        if self.is_idle() {
            pool.take_freed();
            self.dirty = false;
            return;
        }
        if now_ms >= self.last_sweep_ms.saturating_add(SWEEP_EVERY_MS) {
            self.sweep(pool, now_ms);
        }
        let mut out = Vec::new();
        if self.queue.next_deadline().is_some_and(|d| d <= now_ms) {
            self.queue.expire(now_ms, &mut out);
            for departure in out.drain(..) {
                self.deliver(pool, departure, now_ms);
            }
        }
        // With admission control turned off, leases that end are not reported as freed room:
        // the requests still queued from before are dispatched on every settle until gone.
        self.dirty |= !config.enabled;
        loop {
            let freed = pool.take_freed();
            if freed.is_empty() && !std::mem::take(&mut self.dirty) {
                break;
            }
            out.clear();
            self.queue
                .dispatch(pool, config, &freed, now_ms, rng, &mut out);
            let mut refused = false;
            for departure in out.drain(..) {
                refused |= !self.deliver(pool, departure, now_ms);
            }
            // A lease refused by a departed caller went back to the pool: grant it again.
            if !refused {
                break;
            }
        }
    }

    /// Hands a departure to its waiter. Returns false when the waiter's caller had left and its
    /// lease was released instead.
    fn deliver(&mut self, pool: &mut Pool, departure: Departure, now_ms: u64) -> bool {
        let ticket = departure.ticket();
        let verdict = Verdict::from(departure);
        let Some(w) = self.waiters.get_mut(&ticket) else {
            return self.refuse(pool, verdict, now_ms);
        };
        if w.call.is_some() && w.caller_left(now_ms) {
            self.waiters.remove(&ticket);
            return self.refuse(pool, verdict, now_ms);
        }
        match w.call.take() {
            Some(tx) => {
                self.waiters.remove(&ticket);
                let lease = match &verdict {
                    Verdict::Granted { grant, .. } => Some(grant.lease_id),
                    Verdict::Dropped { .. } => None,
                };
                match tx.send(verdict) {
                    Ok(()) => {
                        if let Some(lease) = lease {
                            self.record_delivered(ticket, lease, now_ms);
                        }
                        true
                    }
                    Err(verdict) => self.refuse(pool, verdict, now_ms),
                }
            }
            None => {
                w.parked = Some(verdict);
                w.since_ms = now_ms;
                true
            }
        }
    }

    /// A verdict nobody will receive: its lease goes back, and the client counts as gone.
    fn refuse(&mut self, pool: &mut Pool, verdict: Verdict, now_ms: u64) -> bool {
        match verdict {
            Verdict::Granted { grant, .. } => {
                pool.release(
                    grant.lease_id,
                    &Outcome::of_kind(OutcomeKind::Cancelled),
                    now_ms,
                );
                self.queue.record_drop(DropReason::ClientGone);
                false
            }
            Verdict::Dropped { .. } => true,
        }
    }

    /// Drops the waiters whose client left (see the module documentation).
    fn sweep(&mut self, pool: &mut Pool, now_ms: u64) {
        self.last_sweep_ms = now_ms;
        let gone: Vec<Ticket> = self
            .waiters
            .iter()
            .filter(|(_, w)| w.caller_left(now_ms))
            .map(|(t, _)| *t)
            .collect();
        for ticket in gone {
            let Some(w) = self.waiters.remove(&ticket) else {
                continue;
            };
            match w.parked {
                Some(verdict) => {
                    self.refuse(pool, verdict, now_ms);
                }
                None => {
                    self.queue.remove(ticket, DropReason::ClientGone);
                }
            }
        }
    }

    /// The end of a call's wait without a verdict on its channel: returns a verdict that arrived
    /// meanwhile, or `None` (the request still waits: answer `202`). The waiter then has no open
    /// call until the Worker asks again.
    pub fn pause(
        &mut self,
        ticket: Ticket,
        call_id: u64,
        rx: &mut oneshot::Receiver<Verdict>,
        now_ms: u64,
    ) -> Option<Verdict> {
        if let Ok(Some(verdict)) = rx.try_recv() {
            return Some(verdict);
        }
        let Some(w) = self.waiters.get_mut(&ticket) else {
            // Gone meanwhile without a verdict for this call (a newer call took it): still waits
            // as far as this call knows; the next call learns the truth.
            return None;
        };
        if w.call_id != call_id {
            return None;
        }
        if let Some(verdict) = w.parked.take() {
            self.waiters.remove(&ticket);
            return Some(self.answered(ticket, verdict, now_ms));
        }
        w.call = None;
        w.signal = None;
        w.since_ms = now_ms;
        None
    }

    /// Leaves the queue at the client's request (it hung up); a parked lease goes back, and so
    /// does the lease of a grant answered under this ticket that the Worker never read.
    pub fn dequeue(&mut self, pool: &mut Pool, ticket: Ticket, now_ms: u64) -> bool {
        let Some(w) = self.waiters.remove(&ticket) else {
            let Some(lease_id) = self.delivered.take(ticket) else {
                return false;
            };
            let cancelled = Outcome::of_kind(OutcomeKind::Cancelled);
            if pool.release(lease_id, &cancelled, now_ms) {
                self.queue.record_drop(DropReason::ClientGone);
            }
            return true;
        };
        match w.parked {
            Some(verdict) => {
                self.refuse(pool, verdict, now_ms);
            }
            None => {
                self.queue.remove(ticket, DropReason::ClientGone);
            }
        }
        true
    }
}
