//! Grants answered recently, by ticket: a Worker whose client hung up while the grant was on its
//! way back (or before any answer) never reads it, and names the wait in a dequeue instead; the
//! lease of a grant answered under that ticket then goes back at once rather than after
//! `lease_ttl_ms`. Remembered for [`DELIVERED_KEEP_MS`] (the dequeue is sent the moment the client
//! hangs up, so milliseconds later), at most [`DELIVERED_MAX`] of them, oldest forgotten first.

use super::request::Ticket;
use crate::pool::lease::LeaseId;
use std::collections::{HashMap, VecDeque};

/// How long a delivered grant stays known by its ticket, ms.
pub const DELIVERED_KEEP_MS: u64 = 30_000;
/// Most delivered grants remembered.
pub const DELIVERED_MAX: usize = 4_096;

/// Recently answered grants, by the ticket they were answered under.
#[derive(Debug, Clone, Default)]
pub struct DeliveredGrants {
    by_ticket: HashMap<Ticket, (LeaseId, u64)>,
    order: VecDeque<(u64, Ticket)>,
}

impl DeliveredGrants {
    /// Remembers that lease `lease_id` was answered under `ticket` at `now_ms`.
    pub fn record(&mut self, ticket: Ticket, lease_id: LeaseId, now_ms: u64) {
        self.forget_old(now_ms);
        while self.by_ticket.len() >= DELIVERED_MAX {
            let Some((at, old)) = self.order.pop_front() else {
                break;
            };
            self.forget_if(old, at);
        }
        self.by_ticket.insert(ticket, (lease_id, now_ms));
        self.order.push_back((now_ms, ticket));
    }

    /// The lease answered under `ticket`, forgotten as it is taken (a second dequeue finds
    /// nothing).
    pub fn take(&mut self, ticket: Ticket) -> Option<LeaseId> {
        self.by_ticket.remove(&ticket).map(|(lease, _)| lease)
    }

    /// Forgets the grants answered [`DELIVERED_KEEP_MS`] or more before `now_ms`.
    pub fn forget_old(&mut self, now_ms: u64) {
        while let Some(&(at, ticket)) = self.order.front() {
            if now_ms < at.saturating_add(DELIVERED_KEEP_MS) {
                break;
            }
            self.order.pop_front();
            self.forget_if(ticket, at);
        }
    }

    /// Grants remembered.
    pub fn len(&self) -> usize {
        self.by_ticket.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.by_ticket.is_empty()
    }

    /// Forgets `ticket` if its record is the one made at `at` (not a later one under the same
    /// ticket).
    fn forget_if(&mut self, ticket: Ticket, at: u64) {
        if self.by_ticket.get(&ticket).is_some_and(|(_, t)| *t == at) {
            self.by_ticket.remove(&ticket);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_is_found_once_by_its_ticket_within_the_keep_time() {
        let mut d = DeliveredGrants::default();
        d.record(7, 70, 1_000);
        d.record(8, 80, 2_000);
        assert_eq!(d.take(7), Some(70));
        assert_eq!(d.take(7), None, "a second dequeue releases nothing");
        d.forget_old(2_000 + DELIVERED_KEEP_MS - 1);
        assert_eq!(d.len(), 1);
        d.forget_old(2_000 + DELIVERED_KEEP_MS);
        assert!(d.is_empty());
        assert_eq!(d.take(8), None, "too old: its Worker read it long ago");
    }

    #[test]
    fn the_record_is_bounded_and_a_reused_ticket_keeps_its_newest_grant() {
        let mut d = DeliveredGrants::default();
        for t in 0..(DELIVERED_MAX as u64 + 10) {
            d.record(t + 1, t + 100, 5);
        }
        assert_eq!(d.len(), DELIVERED_MAX);
        assert_eq!(d.take(1), None, "the oldest went first");
        let mut d = DeliveredGrants::default();
        d.record(1, 10, 0);
        d.record(1, 11, 20_000);
        d.forget_old(DELIVERED_KEEP_MS);
        assert_eq!(d.take(1), Some(11));
    }
}
