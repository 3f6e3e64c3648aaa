//! When a backend whose removal waits for its drain may go: once it is drained and nothing runs on
//! it any more (or it is already gone), and never while a restart's hold lasts.
//!
//! **Restarts.** Leases live in memory only, so a pool that restarts knows a draining backend's
//! lifecycle (persisted) but none of its streams: they come back one by one as their Workers renew
//! (each renewal of a lease the pool lost counts it again). A draining backend restored with no
//! leases is therefore not drained yet: it stays draining, and nothing counts as finished, until
//! one lease lifetime after the restart ([`restart_hold_until`]), by which time every stream still
//! running has renewed.
//!
//! Admission control is held the same way, for a shorter time: a restarted pool with backends
//! restored grants nothing new for one renewal period ([`admission_hold_until`]; requests wait in
//! the queue, or spill to another pool), so it never grants a backend's whole `max_num_seqs` on
//! top of streams it cannot see yet. When the hold ends the renewals have counted them, and the
//! queue is admitted against the true counts. It ends sooner when a probe round (shard 0's, at
//! most a probe interval after the restart) scrapes every serving backend running and queueing no
//! more requests than the pool counts there: an object evicted while idle and woken by a request
//! waits for that round, not for the renewal period. Without admission control nothing is held.
//!
//! [`Drains`] is what a coordinator keeps of them: the deletes waiting, when each drain started,
//! and the restart's hold.

use crate::backend::{BackendId, Lifecycle};
use crate::pool::{BackendView, Pool};
use std::collections::{HashMap, HashSet};

/// Until when, after a restart at `restarted_ms`, a draining backend with no known leases is held
/// as draining: one lease lifetime, the longest a running stream goes without renewing.
pub fn restart_hold_until(restarted_ms: u64, lease_ttl_ms: u64) -> u64 {
    restarted_ms.saturating_add(lease_ttl_ms)
}

/// How long after the answer to one renewal a running request sends the next at most: the
/// Worker renews every third of the lease TTL (at most 20 s) for its first five minutes, then
/// every third of what the pool's deadline leaves, which is never more.
pub fn renewal_period_ms(lease_ttl_ms: u64) -> u64 {
    lease_ttl_ms / 3
}

/// Time allowed on top of a renewal period for the renewal call itself to arrive.
pub const RENEWAL_CALL_MS: u64 = 1_000;

/// Until when, after a restart at `restarted_ms`, admission control grants nothing new: one
/// renewal period and a renewal call, by when every stream still running has renewed and is
/// counted again (a stream whose renewal failed during the restart comes back within its lease
/// lifetime, like a drain's, but a hold that long would stop a busy pool for a minute).
pub fn admission_hold_until(restarted_ms: u64, lease_ttl_ms: u64) -> u64 {
    restarted_ms
        .saturating_add(renewal_period_ms(lease_ttl_ms))
        .saturating_add(RENEWAL_CALL_MS)
}

/// Whether a backend waiting to be removed (`None`: already gone) may be removed now, at `now_ms`,
/// with drains held until `hold_until_ms` (0 when no restart holds them).
pub fn drain_finished(backend: Option<&BackendView>, now_ms: u64, hold_until_ms: u64) -> bool {
    backend.is_none_or(|v| {
        v.leases_in_flight == 0
            && matches!(v.lifecycle, Lifecycle::Drained | Lifecycle::Draining)
            && now_ms >= hold_until_ms
    })
}

/// The drains a coordinator follows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Drains {
    /// Backends whose `DELETE` waits for their drain to finish (persisted).
    pending_delete: HashSet<BackendId>,
    /// When each draining backend's drain started (persisted, so a restart knows it drains).
    started: HashMap<BackendId, u64>,
    /// After a restart: until when no drain of a backend restored from storage may finish, so
    /// the streams still running on it renew first; 0 once over.
    hold_until_ms: u64,
    /// The backends restored at the restart (those whose streams the pool may have forgotten).
    restored: HashSet<BackendId>,
}

impl Drains {
    /// The drains after a restart: what storage kept, and a hold until `hold_until_ms` on the
    /// `restored` backends (0: none).
    pub fn restored(
        pending_delete: HashSet<BackendId>,
        started: HashMap<BackendId, u64>,
        restored: HashSet<BackendId>,
        hold_until_ms: u64,
    ) -> Drains {
        Drains {
            pending_delete,
            started,
            hold_until_ms,
            restored,
        }
    }

    /// The backends whose `DELETE` waits for their drain.
    pub fn pending_deletes(&self) -> &HashSet<BackendId> {
        &self.pending_delete
    }

    /// Whether `id`'s `DELETE` waits for its drain.
    pub fn delete_pending(&self, id: &BackendId) -> bool {
        self.pending_delete.contains(id)
    }

    /// When each draining backend's drain started.
    pub fn starts(&self) -> &HashMap<BackendId, u64> {
        &self.started
    }

    /// Until when the restart's hold lasts (0: none, or over).
    pub fn hold_until_ms(&self) -> u64 {
        self.hold_until_ms
    }

    /// Until when `id`'s drain is held after a restart (0: not held).
    pub fn hold_of(&self, id: &BackendId) -> u64 {
        if self.restored.contains(id) {
            self.hold_until_ms
        } else {
            0
        }
    }

    /// Records when `id`'s drain started (`Some`; an earlier start stands) or that it no longer
    /// drains (`None`). Returns whether the starts changed.
    pub(super) fn record_start(&mut self, id: &BackendId, started_ms: Option<u64>) -> bool {
        match started_ms {
            Some(_) if self.started.contains_key(id) => false,
            Some(at) => {
                self.started.insert(id.clone(), at);
                true
            }
            None => self.started.remove(id).is_some(),
        }
    }

    /// `id`'s `DELETE` waits for its drain (`true`) or no longer does. Returns whether the
    /// pending deletes changed.
    pub(super) fn set_delete_pending(&mut self, id: &BackendId, pending: bool) -> bool {
        if pending {
            self.pending_delete.insert(id.clone())
        } else {
            self.pending_delete.remove(id)
        }
    }

    /// Replaces the pending deletes (shard 0's, on a sibling).
    pub(super) fn replace_pending_deletes(&mut self, ids: HashSet<BackendId>) {
        self.pending_delete = ids;
    }

    /// Ends the restart's hold if it is over at `now_ms`. Returns whether it just ended.
    pub(super) fn end_hold(&mut self, now_ms: u64) -> bool {
        if self.hold_until_ms != 0 && now_ms >= self.hold_until_ms {
            self.hold_until_ms = 0;
            self.restored.clear();
            return true;
        }
        false
    }

    /// The backends whose `DELETE` waited and whose drain is finished at `now_ms`.
    pub(super) fn finished(&self, pool: &Pool, now_ms: u64) -> Vec<BackendId> {
        self.pending_delete
            .iter()
            .filter(|id| drain_finished(pool.backend(id).as_ref(), now_ms, self.hold_of(id)))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;
    use crate::pool::test_support::{features, pool_with, spec};
    use crate::pool::Pool;
    use crate::random::SplitMix64;
    use crate::stream::outcome::Outcome;

    fn view(lifecycle: Lifecycle, leases_in_flight: u32) -> BackendView {
        BackendView {
            lifecycle,
            leases_in_flight,
            ..BackendView::default()
        }
    }

    #[test]
    fn only_a_drained_idle_or_gone_backend_is_finished() {
        assert!(drain_finished(None, 0, 0));
        assert!(drain_finished(Some(&view(Lifecycle::Drained, 0)), 0, 0));
        assert!(!drain_finished(Some(&view(Lifecycle::Drained, 1)), 0, 0));
        assert!(!drain_finished(Some(&view(Lifecycle::Draining, 1)), 0, 0));
        assert!(!drain_finished(Some(&view(Lifecycle::Ready, 0)), 0, 0));
    }

    #[test]
    fn a_restart_holds_every_drain_for_one_lease_lifetime() {
        let hold = restart_hold_until(1_000, 60_000);
        assert_eq!(hold, 61_000);
        // Restored draining with no known leases: its streams may not have renewed yet.
        let restored = view(Lifecycle::Draining, 0);
        assert!(!drain_finished(Some(&restored), 1_000, hold));
        assert!(!drain_finished(Some(&restored), 60_999, hold));
        // A renewed stream ended and left it drained: still held, another may renew.
        assert!(!drain_finished(
            Some(&view(Lifecycle::Drained, 0)),
            30_000,
            hold
        ));
        // A lifetime on, every running stream has renewed: idle means done.
        assert!(drain_finished(Some(&restored), 61_000, hold));
        assert!(!drain_finished(
            Some(&view(Lifecycle::Draining, 1)),
            61_000,
            hold
        ));
    }

    #[test]
    fn a_restored_drain_stays_draining_while_its_streams_renew() {
        use crate::pool::lease::LeaseTerms;
        let mut pool = pool_with(PolicyKind::RoundRobin, 2);
        let mut rng = SplitMix64::new(0);
        let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
        let lost = pool.acquire(&features("y"), 0, &mut rng).unwrap();
        assert_ne!(g.backend, lost.backend);
        for id in [&g.backend, &lost.backend] {
            pool.set_lifecycle(id, Lifecycle::Draining, 1).unwrap();
        }
        let snaps = pool.snapshots();
        // The restart: a new pool, no leases.
        let mut rebuilt = Pool::new("p1", pool.config().clone());
        for id in ["b0", "b1"] {
            rebuilt.add_backend(spec(id), 10).unwrap();
        }
        for s in &snaps {
            rebuilt.restore(s).unwrap();
        }
        let hold = restart_hold_until(10, rebuilt.config().lease_ttl_ms);
        let view = rebuilt.backend(&g.backend).unwrap();
        assert_eq!(view.lifecycle, Lifecycle::Draining);
        assert!(!drain_finished(Some(&view), 10, hold));
        // The stream renews: counted again on its draining backend.
        let terms = LeaseTerms {
            backend: g.backend.clone(),
            prompt_tokens: 5,
            max_tokens: 5,
            ..LeaseTerms::default()
        };
        rebuilt.readmit(g.lease_id, &terms, 20).unwrap();
        assert_eq!(rebuilt.backend(&g.backend).unwrap().leases_in_flight, 1);
        rebuilt.release(g.lease_id, &Outcome::from_status(200), 30);
        let view = rebuilt.backend(&g.backend).unwrap();
        assert!(!drain_finished(Some(&view), 30, hold), "held until {hold}");
        assert!(drain_finished(Some(&view), hold, hold));
        // The other backend's stream never renewed (it ended during the restart): once the hold
        // is over, the caller finishes its drain.
        assert_eq!(
            rebuilt.backend(&lost.backend).unwrap().lifecycle,
            Lifecycle::Draining
        );
        assert_eq!(rebuilt.finish_idle_drains(), vec![lost.backend.clone()]);
        assert_eq!(
            rebuilt.backend(&lost.backend).unwrap().lifecycle,
            Lifecycle::Drained
        );
        assert!(rebuilt.finish_idle_drains().is_empty());
    }
}
