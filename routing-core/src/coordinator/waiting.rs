//! The waiting room's rules: acquires that wait in a pool's admission queue until a backend has
//! room, and how each wait ends.
//!
//! The queue's order and limits are [`crate::admission`]'s; this file follows the waits. A queued
//! acquire is an open call from the Worker: when the queue grants it a lease (a lease ended, a
//! backend joined or recovered) or drops it, the verdict goes to that call
//! ([`Effect::Answer`]). A call waits at most `poll_ms` and then answers `202` with the request's
//! ticket ([`WaitingRoom::pause`]); the Worker asks again at once with the ticket. That keeps every
//! waiter's liveness visible, whatever the platform tells:
//!
//! - a caller that hung up while its call was open: the caller says so ([`Callers::left`]: its
//!   request signal aborted, or its call was dropped); checked at every grant and every sweep;
//! - a Worker that stopped asking (its invocation ended, or it crashed): no call is open for
//!   longer than [`POLL_GRACE_MS`], and the sweep drops it;
//! - a verdict reached while no call was open is parked for the next call; a parked lease nobody
//!   picks up within the grace is released;
//! - the Durable Object restarted: the Worker's call fails or its ticket is unknown here, and the
//!   request re-enters the queue with the time it already waited (so its deadline holds);
//! - a grant answered to a call whose Worker had already given up on it (its client hung up while
//!   the answer was on its way, or before any answer): the Worker names the wait in a dequeue
//!   (its `wait_id`, which is the ticket), and the lease of a grant delivered under that ticket in
//!   the last `DELIVERED_KEEP_MS` goes back at once, not after `lease_ttl_ms`;
//! - a grant whose answer was lost (the call failed, or hit the Worker's call limit) and the
//!   Worker asking again with its ticket: the lease answered under that ticket goes back before
//!   the request is tried again, so it never holds two (a Worker that gives up on the pool instead
//!   names the wait in a dequeue, as above).
//!
//! **When the queue is dispatched.** Only when room may have appeared: a lease share ended (the
//! pool's freed list), or the coordinator [`WaitingRoom::wake`]s it (a probe, a registry or
//! configuration change, a sibling's load); deadlines are enforced when they pass. A renewal or a
//! new request queued behind others costs no dispatch, so a call's work does not grow with the
//! queue. A new request whose model has nobody waiting is tried at once, whatever waits for other
//! models.

use super::{Effect, Effects};
use crate::admission::{
    AdmissionConfig, AdmissionQueue, AdmissionRequest, DeliveredGrants, Departure, DropReason,
    Ticket, Waiting,
};
use crate::pool::{AcquireError, Grant, Pool};
use crate::random::RandomSource;
use crate::request::prompt::RequestFeatures;
use crate::stream::outcome::{Outcome, OutcomeKind};
use std::collections::HashMap;

/// How long a queued request may go without an open call before the sweep counts its client as
/// gone (the Worker asks again within milliseconds of a `202`).
pub const POLL_GRACE_MS: u64 = 3_000;
/// Least time between two sweeps.
const SWEEP_EVERY_MS: u64 = 250;

/// How a queued request's wait ended.
#[derive(Debug, Clone, PartialEq)]
pub enum WaitEnd {
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

impl From<Departure> for WaitEnd {
    fn from(d: Departure) -> WaitEnd {
        match d {
            Departure::Admitted {
                grant, waited_ms, ..
            } => WaitEnd::Granted { grant, waited_ms },
            Departure::Dropped {
                reason, waited_ms, ..
            } => WaitEnd::Dropped { reason, waited_ms },
        }
    }
}

/// What the caller knows of the open calls: whether the client of a wait's open call left.
pub trait Callers {
    /// Whether the client of `ticket`'s open call has hung up (or the call is gone).
    fn left(&self, ticket: Ticket) -> bool;
}

/// One queued request's connection to its client.
#[derive(Debug)]
struct Waiter {
    /// The open call waiting for the verdict, if one is open.
    call: Option<u64>,
    /// The last call's id (a newer call with the same ticket supersedes an older one).
    call_id: u64,
    /// A verdict reached while no call was open, for the next call.
    parked: Option<WaitEnd>,
    /// When the last call ended (or the verdict was parked).
    since_ms: u64,
}

impl Waiter {
    fn caller_left(&self, ticket: Ticket, now_ms: u64, callers: &dyn Callers) -> bool {
        match self.call {
            Some(_) => callers.left(ticket),
            None => now_ms > self.since_ms.saturating_add(POLL_GRACE_MS),
        }
    }
}

/// What an acquire does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Answer now.
    Done(WaitEnd),
    /// The pool is saturated and a further pool can take the request: refuse it so.
    Saturated,
    /// The pool is full and the caller may try another pool: answer so, without queueing.
    Spill,
    /// The pool cannot serve the request at all (unknown model, no backend up).
    Refused(AcquireError),
    /// Open a call that waits for its verdict ([`Effect::Answer`]), at most until `until_ms`.
    Wait {
        /// The request's ticket.
        ticket: Ticket,
        /// The call's id, for [`WaitingRoom::pause`].
        call_id: u64,
        /// When the call should answer `202` if nothing arrived.
        until_ms: u64,
    },
}

/// A pool's queue and the waits on it.
#[derive(Debug, Default)]
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
    fn answered(&mut self, ticket: Ticket, verdict: WaitEnd, now_ms: u64) -> WaitEnd {
        if let WaitEnd::Granted { grant, .. } = &verdict {
            self.record_delivered(ticket, grant.lease_id, now_ms);
        }
        verdict
    }

    /// Whether `ticket` belongs to a wait in progress here.
    pub fn knows(&self, ticket: Option<Ticket>) -> bool {
        ticket.is_some_and(|t| self.waiters.contains_key(&t))
    }

    /// The open call of `ticket`'s wait, if one is open.
    pub fn open_call_of(&self, ticket: Ticket) -> Option<u64> {
        self.waiters.get(&ticket).and_then(|w| w.call)
    }

    /// Removes `ticket`'s waiter; an open call it had is closed.
    fn remove_waiter(&mut self, ticket: Ticket, effects: &mut Effects) -> Option<Waiter> {
        let w = self.waiters.remove(&ticket)?;
        if let Some(call_id) = w.call {
            effects.push(Effect::CloseCall { ticket, call_id });
        }
        Some(w)
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
        now_ms: u64,
        rng: &mut dyn RandomSource,
        callers: &dyn Callers,
        effects: &mut Effects,
    ) -> Step {
        if let Some(ticket) = who.ticket {
            if let Some(w) = self.waiters.get_mut(&ticket) {
                if let Some(verdict) = w.parked.take() {
                    self.remove_waiter(ticket, effects);
                    return Step::Done(self.answered(ticket, verdict, now_ms));
                }
                if self.queue.contains(ticket) {
                    return self.open_call(ticket, config, now_ms, effects);
                }
                self.remove_waiter(ticket, effects);
            } else if let Some(lost) = self.delivered.take(ticket) {
                // A grant was answered under this ticket and the Worker asks again: the answer
                // never reached it (the call failed or hit its limit). Its lease goes back before
                // the request is tried again, so one request never holds two.
                pool.release(lost, &Outcome::of_kind(OutcomeKind::Cancelled), now_ms);
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
                    let verdict = WaitEnd::Granted { grant, waited_ms };
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
        // A request that waits is sent again once granted (the Worker aborts what it sent ahead).
        let mut request = request;
        request.features.sent_ahead = None;
        if request.deadline_ms <= now_ms {
            self.queue.record_drop(DropReason::Timeout);
            let reason = DropReason::Timeout;
            return Step::Done(WaitEnd::Dropped { reason, waited_ms });
        }
        match self.queue.offer(request, config) {
            Err(reason) => return Step::Done(WaitEnd::Dropped { reason, waited_ms }),
            Ok(Some(evicted)) => {
                let waited_ms = now_ms.saturating_sub(evicted.arrived_ms);
                let ticket = evicted.ticket;
                let reason = DropReason::Evicted;
                let departure = Departure::Dropped {
                    ticket,
                    reason,
                    waited_ms,
                };
                self.deliver(pool, departure, now_ms, callers, effects);
            }
            Ok(None) => {}
        }
        // Nothing freed room: the new request waits behind its model's without a dispatch.
        self.open_call(ticket, config, now_ms, effects)
    }

    /// Opens a call for `ticket`'s wait; a call still open for it is superseded (it answers
    /// `202`).
    fn open_call(
        &mut self,
        ticket: Ticket,
        config: &AdmissionConfig,
        now_ms: u64,
        effects: &mut Effects,
    ) -> Step {
        self.next_call += 1;
        let call_id = self.next_call;
        let waiter = self.waiters.entry(ticket).or_insert(Waiter {
            call: None,
            call_id,
            parked: None,
            since_ms: now_ms,
        });
        if let Some(older) = waiter.call.replace(call_id) {
            effects.push(Effect::CloseCall {
                ticket,
                call_id: older,
            });
        }
        waiter.call_id = call_id;
        let deadline = self.queue.get(ticket).map_or(now_ms, |w| w.deadline_ms);
        let until_ms = now_ms
            .saturating_add(config.poll_ms)
            .min(deadline.saturating_add(1));
        Step::Wait {
            ticket,
            call_id,
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
        callers: &dyn Callers,
        effects: &mut Effects,
    ) {
        self.delivered.forget_old(now_ms);
        if self.is_idle() {
            pool.take_freed();
            self.dirty = false;
            return;
        }
        if now_ms >= self.last_sweep_ms.saturating_add(SWEEP_EVERY_MS) {
            self.sweep(pool, now_ms, callers, effects);
        }
        let mut out = Vec::new();
        if self.queue.next_deadline().is_some_and(|d| d <= now_ms) {
            self.queue.expire(now_ms, &mut out);
            for departure in out.drain(..) {
                self.deliver(pool, departure, now_ms, callers, effects);
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
                refused |= !self.deliver(pool, departure, now_ms, callers, effects);
            }
            // A lease refused by a departed caller went back to the pool: grant it again.
            if !refused {
                break;
            }
        }
    }

    /// Hands a departure to its waiter. Returns false when the waiter's caller had left and its
    /// lease was released instead.
    fn deliver(
        &mut self,
        pool: &mut Pool,
        departure: Departure,
        now_ms: u64,
        callers: &dyn Callers,
        effects: &mut Effects,
    ) -> bool {
        let ticket = departure.ticket();
        let verdict = WaitEnd::from(departure);
        let Some(w) = self.waiters.get_mut(&ticket) else {
            return self.refuse(pool, verdict, now_ms);
        };
        if w.call.is_some() && w.caller_left(ticket, now_ms, callers) {
            self.remove_waiter(ticket, effects);
            return self.refuse(pool, verdict, now_ms);
        }
        match w.call {
            Some(call_id) => {
                self.waiters.remove(&ticket);
                if let WaitEnd::Granted { grant, .. } = &verdict {
                    self.record_delivered(ticket, grant.lease_id, now_ms);
                }
                effects.push(Effect::Answer {
                    ticket,
                    call_id,
                    verdict,
                });
                true
            }
            None => {
                w.parked = Some(verdict);
                w.since_ms = now_ms;
                true
            }
        }
    }

    /// A verdict that no open call took after all (see [`Effect::Answer`]): its lease goes back,
    /// and the client counts as gone. Returns false when a lease went back (room freed: settle).
    pub fn unanswered(
        &mut self,
        pool: &mut Pool,
        ticket: Ticket,
        verdict: WaitEnd,
        now_ms: u64,
    ) -> bool {
        if matches!(verdict, WaitEnd::Granted { .. }) {
            // Recorded as delivered when it was handed out; it was not.
            self.delivered.take(ticket);
        }
        self.refuse(pool, verdict, now_ms)
    }

    /// A verdict nobody will receive: its lease goes back, and the client counts as gone.
    fn refuse(&mut self, pool: &mut Pool, verdict: WaitEnd, now_ms: u64) -> bool {
        match verdict {
            WaitEnd::Granted { grant, .. } => {
                pool.release(
                    grant.lease_id,
                    &Outcome::of_kind(OutcomeKind::Cancelled),
                    now_ms,
                );
                self.queue.record_drop(DropReason::ClientGone);
                false
            }
            WaitEnd::Dropped { .. } => true,
        }
    }

    /// Drops the waiters whose client left (see the module documentation).
    fn sweep(
        &mut self,
        pool: &mut Pool,
        now_ms: u64,
        callers: &dyn Callers,
        effects: &mut Effects,
    ) {
        self.last_sweep_ms = now_ms;
        let gone: Vec<Ticket> = self
            .waiters
            .iter()
            .filter(|(t, w)| w.caller_left(**t, now_ms, callers))
            .map(|(t, _)| *t)
            .collect();
        for ticket in gone {
            let Some(w) = self.remove_waiter(ticket, effects) else {
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

    /// The end of call `call_id`'s wait without a verdict: returns a verdict parked meanwhile,
    /// or `None` (the request still waits: answer `202`). The waiter then has no open call until
    /// the Worker asks again.
    pub fn pause(&mut self, ticket: Ticket, call_id: u64, now_ms: u64) -> Option<WaitEnd> {
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
        w.since_ms = now_ms;
        None
    }

    /// Leaves the queue at the client's request (it hung up); a parked lease goes back, and so
    /// does the lease of a grant answered under this ticket that the Worker never read.
    pub fn dequeue(
        &mut self,
        pool: &mut Pool,
        ticket: Ticket,
        now_ms: u64,
        effects: &mut Effects,
    ) -> bool {
        let Some(w) = self.remove_waiter(ticket, effects) else {
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
