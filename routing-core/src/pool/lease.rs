//! Leases: the pool's record of requests in flight.
//!
//! A lease is taken when a request is routed and ends when the Worker releases it with the
//! outcome, or when its deadline passes (the isolate died and nobody will release it). While the
//! request lives, the Worker renews the lease well before its deadline, so a deadline bounds how
//! long a dead Worker's load stays counted, not how long a request may run. The
//! backend's in-flight counters are exactly the sum of its live leases: the pool adds a lease's
//! share when it is granted and subtracts the same share exactly once, whichever of release,
//! expiry or backend removal comes first. Leases live in memory only; when a Durable Object restarts
//! (or a lease expired while its request still ran), the Worker's next renewal or retry carries the
//! lease's [`LeaseTerms`] so the pool can count the request again.

use crate::backend::time_model::SharePrediction;
use crate::backend::{BackendId, BackendKey};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

/// A lease's identity. Random below 2^53, so it survives a round trip through JavaScript numbers
/// and an id from before a restart is unlikely to name a new lease.
pub type LeaseId = u64;

/// Largest lease id handed out (2^53 - 1).
pub const MAX_LEASE_ID: u64 = (1 << 53) - 1;

/// One backend's share of a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseShare {
    /// The backend carrying it.
    pub backend: BackendKey,
    /// Uncached prompt tokens counted on it.
    pub prompt_tokens: u64,
    /// Expected output tokens counted on it.
    pub output_tokens: u64,
    /// Whether the request was admitted as a half-open breaker trial there.
    pub trial: bool,
    /// What the time model predicted for it there, for learning at release.
    pub predicted: SharePrediction,
    /// The time to first token the pool predicted when it chose the backend (whole ms; `None`
    /// for a retry's share or a restored lease): its error is measured at release.
    pub predicted_ttft_ms: Option<u32>,
}

/// A request in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The lease's id.
    pub id: LeaseId,
    /// The gateway's request id, for logs.
    pub request_id: String,
    /// Estimated prompt tokens of the request.
    pub prompt_tokens: u32,
    /// Expected output tokens of the request.
    pub max_tokens: u32,
    /// Whether the client asked for a stream (its first byte is its first token).
    pub stream: bool,
    /// The backend serving the request (the prefill backend for a disaggregated pair).
    pub primary: LeaseShare,
    /// The decode backend of a disaggregated pair.
    pub decode: Option<LeaseShare>,
    /// When the lease was granted.
    pub acquired_ms: u64,
    /// When it expires unless released.
    pub deadline_ms: u64,
    /// A backend whose 5xx the lease moved away from, its breaker charge deferred to the release:
    /// withdrawn if the request turns out to fail on the next backend too (the request's fault),
    /// charged otherwise.
    pub deferred_failure: Option<BackendKey>,
    /// The stream's time to first token as the Worker reported it (on a renewal or the
    /// release), in ms from the grant: a lease without it past its overdue time counts as queued
    /// in the engine (`crate::pool::evidence`).
    pub first_token_ms: Option<u64>,
    /// The Worker said the stream had no first token at its overdue time
    /// ([`crate::pool::Grant::first_token_due_ms`]); until a first token is reported, it counts
    /// as queued in the engine.
    pub overdue_reported: bool,
}

/// What the Worker knows of its lease: enough for the pool to count it again if it lost it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LeaseTerms {
    /// The backend serving the request now.
    pub backend: BackendId,
    /// Estimated prompt tokens of the request.
    pub prompt_tokens: u32,
    /// Expected output tokens of the request.
    pub max_tokens: u32,
    /// Whether the request streams.
    pub stream: bool,
    /// The gateway's request id.
    pub request_id: String,
}

/// The live leases of a pool, indexed by id and by deadline, and the leases ended lately.
#[derive(Debug, Clone, Default)]
pub struct LeaseTable {
    leases: HashMap<LeaseId, Lease>,
    deadlines: BTreeSet<(u64, LeaseId)>,
    ended: EndedLeases,
}

/// Most leases remembered as ended ([`LeaseTable::mark_ended`]): about 40 bytes each, so at most
/// about 2.6 MB, and the most a pool ends within a lease lifetime in practice (1,000 a second
/// for a minute).
pub const MAX_ENDED_LEASES: usize = 65_536;

/// Leases released or ended by the pool itself, each until a lease lifetime after its end, so a
/// renewal already on its way when the lease ended (it crossed the release, or the pool's refusal
/// of a retry) does not count the request again: its Worker knows the lease ended and will never
/// release it. A lease that expired is not remembered: its request may still run, and its next
/// renewal counts it again.
#[derive(Debug, Clone, Default)]
struct EndedLeases {
    /// Oldest first: until when each is remembered.
    order: VecDeque<(u64, LeaseId)>,
    ids: HashSet<LeaseId>,
}

impl LeaseTable {
    /// An empty table.
    pub fn new() -> Self {
        LeaseTable::default()
    }

    /// Live leases.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// Whether no lease is live.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// Whether `id` names a live lease.
    pub fn contains(&self, id: LeaseId) -> bool {
        self.leases.contains_key(&id)
    }

    /// The live lease `id`.
    pub fn get(&self, id: LeaseId) -> Option<&Lease> {
        self.leases.get(&id)
    }

    /// Mutable access to a live lease; its id and deadline must not change.
    pub fn get_mut(&mut self, id: LeaseId) -> Option<&mut Lease> {
        self.leases.get_mut(&id)
    }

    /// Adds a lease; returns it back if its id is taken.
    pub fn insert(&mut self, lease: Lease) -> Result<(), Box<Lease>> {
        if self.leases.contains_key(&lease.id) {
            return Err(Box::new(lease));
        }
        self.deadlines.insert((lease.deadline_ms, lease.id));
        self.leases.insert(lease.id, lease);
        Ok(())
    }

    /// Removes and returns lease `id`.
    pub fn remove(&mut self, id: LeaseId) -> Option<Lease> {
        let lease = self.leases.remove(&id)?;
        self.deadlines.remove(&(lease.deadline_ms, id));
        Some(lease)
    }

    /// Moves lease `id`'s deadline to `deadline_ms`; returns `false` if it is not live.
    pub fn set_deadline(&mut self, id: LeaseId, deadline_ms: u64) -> bool {
        let Some(lease) = self.leases.get_mut(&id) else {
            return false;
        };
        self.deadlines.remove(&(lease.deadline_ms, id));
        lease.deadline_ms = deadline_ms;
        self.deadlines.insert((deadline_ms, id));
        true
    }

    /// Removes and returns every lease whose deadline is at or before `now_ms`.
    pub fn take_expired(&mut self, now_ms: u64) -> Vec<Lease> {
        let mut out = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now_ms {
                break;
            }
            self.deadlines.pop_first();
            if let Some(lease) = self.leases.remove(&id) {
                out.push(lease);
            }
        }
        out
    }

    /// The earliest deadline of a live lease.
    pub fn next_deadline(&self) -> Option<u64> {
        self.deadlines.first().map(|&(d, _)| d)
    }

    /// Remembers that lease `id` ended at `now_ms` (released, or ended by the pool), until
    /// `keep_ms` later: a renewal of it in that time must not count it again.
    pub fn mark_ended(&mut self, id: LeaseId, now_ms: u64, keep_ms: u64) {
        self.forget_ended(now_ms);
        if self.ended.order.len() >= MAX_ENDED_LEASES {
            if let Some((_, oldest)) = self.ended.order.pop_front() {
                self.ended.ids.remove(&oldest);
            }
        }
        if self.ended.ids.insert(id) {
            self.ended
                .order
                .push_back((now_ms.saturating_add(keep_ms), id));
        }
    }

    /// Whether lease `id` ended lately (see [`Self::mark_ended`]).
    pub fn ended_lately(&mut self, id: LeaseId, now_ms: u64) -> bool {
        self.forget_ended(now_ms);
        self.ended.ids.contains(&id)
    }

    fn forget_ended(&mut self, now_ms: u64) {
        while let Some(&(until_ms, id)) = self.ended.order.front() {
            if until_ms > now_ms {
                break;
            }
            self.ended.order.pop_front();
            self.ended.ids.remove(&id);
        }
    }

    /// Iterates over live leases in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Lease> {
        self.leases.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(id: LeaseId, deadline_ms: u64) -> Lease {
        Lease {
            id,
            request_id: format!("r{id}"),
            prompt_tokens: 1,
            max_tokens: 1,
            stream: false,
            primary: LeaseShare {
                backend: BackendKey {
                    slot: 0,
                    generation: 0,
                },
                prompt_tokens: 1,
                output_tokens: 1,
                trial: false,
                predicted: SharePrediction::default(),
                predicted_ttft_ms: None,
            },
            decode: None,
            acquired_ms: 0,
            deadline_ms,
            deferred_failure: None,
            first_token_ms: None,
            overdue_reported: false,
        }
    }

    #[test]
    fn insert_remove_and_duplicate_ids() {
        let mut t = LeaseTable::new();
        t.insert(lease(1, 100)).unwrap();
        assert!(t.insert(lease(1, 200)).is_err());
        assert_eq!(t.len(), 1);
        assert_eq!(t.remove(1).unwrap().deadline_ms, 100);
        assert!(t.remove(1).is_none(), "second removal is a no-op");
        assert!(t.is_empty());
        assert_eq!(t.next_deadline(), None);
    }

    #[test]
    fn expiry_takes_exactly_the_past_deadlines() {
        let mut t = LeaseTable::new();
        for (id, d) in [(1, 300), (2, 100), (3, 200), (4, 200)] {
            t.insert(lease(id, d)).unwrap();
        }
        assert_eq!(t.next_deadline(), Some(100));
        let mut gone: Vec<_> = t.take_expired(200).into_iter().map(|l| l.id).collect();
        gone.sort();
        assert_eq!(gone, vec![2, 3, 4]);
        assert_eq!(t.next_deadline(), Some(300));
        assert!(t.take_expired(299).is_empty());
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn ended_leases_are_remembered_for_a_while_and_boundedly() {
        let mut t = LeaseTable::new();
        t.mark_ended(7, 100, 50);
        assert!(t.ended_lately(7, 149));
        assert!(!t.ended_lately(7, 150), "forgotten after keep_ms");
        for id in 1..=(MAX_ENDED_LEASES as u64 + 1) {
            t.mark_ended(id, 200, 1_000);
        }
        assert!(!t.ended_lately(1, 201), "the oldest goes first when full");
        assert!(t.ended_lately(2, 201));
        assert_eq!(t.ended.order.len(), MAX_ENDED_LEASES);
        assert_eq!(t.ended.ids.len(), MAX_ENDED_LEASES);
    }

    #[test]
    fn a_moved_deadline_is_the_one_that_expires() {
        let mut t = LeaseTable::new();
        t.insert(lease(1, 100)).unwrap();
        assert!(t.set_deadline(1, 500));
        assert!(!t.set_deadline(2, 500));
        assert!(t.take_expired(499).is_empty());
        assert_eq!(t.next_deadline(), Some(500));
        assert_eq!(t.take_expired(500).len(), 1);
    }
}
