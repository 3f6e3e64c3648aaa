//! What survives a restart: each backend's lifecycle, health and breaker as a
//! [`BackendSnapshot`], and restoring them into a rebuilt pool. A backend restored draining stays
//! draining until its hold ends ([`crate::coordinator::drain`]) and [`Pool::finish_idle_drains`] is called.

use super::entry::BackendEntry;
use super::errors::unknown;
use super::{BackendSnapshot, Pool, PoolError};
use crate::backend::breaker::CircuitBreaker;
use crate::backend::health::Health;
use crate::backend::{BackendId, Lifecycle};

impl Pool {
    /// One backend's persistent state (what a request's ending may have changed).
    pub fn snapshot(&self, id: &BackendId) -> Option<BackendSnapshot> {
        self.entry(*self.index.get(id)?).map(snapshot_of)
    }

    /// Every backend's persistent state.
    pub fn snapshots(&self) -> Vec<BackendSnapshot> {
        self.entries().map(snapshot_of).collect()
    }

    /// Restores a backend's persisted state after a restart (the backend must be added first).
    pub fn restore(&mut self, snapshot: &BackendSnapshot) -> Result<(), PoolError> {
        let slot = self.slot_of(&snapshot.id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(&snapshot.id))?;
        // A draining backend stays draining: its streams are unknown until they renew (see
        // `crate::coordinator::drain`); the caller holds its drain for a lease lifetime.
        entry.lifecycle = snapshot.lifecycle;
        entry.health = Health {
            state: snapshot.health,
            ..Health::default()
        };
        entry.breaker = CircuitBreaker::restore(snapshot.breaker);
        Ok(())
    }

    /// Marks drained every draining backend that carries no lease (after a restart's hold: its
    /// streams had a lease lifetime to renew and none did). Returns their ids.
    pub fn finish_idle_drains(&mut self) -> Vec<BackendId> {
        let mut done = Vec::new();
        for slot in &mut self.slots {
            let Some(e) = &mut slot.entry else { continue };
            if e.lifecycle == Lifecycle::Draining && e.in_flight.leases == 0 {
                e.lifecycle = Lifecycle::Drained;
                done.push(e.spec.id.clone());
            }
        }
        done
    }
}

fn snapshot_of(e: &BackendEntry) -> BackendSnapshot {
    BackendSnapshot {
        id: e.spec.id.clone(),
        lifecycle: e.lifecycle,
        health: e.health.state,
        breaker: e.breaker.snapshot(),
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::breaker::BreakerState;
    use crate::backend::health::HealthState;
    use crate::backend::Lifecycle;
    use crate::policy::PolicyKind;
    use crate::pool::test_support::{features, pool_with, spec};
    use crate::pool::{BackendSnapshot, Pool};
    use crate::random::SplitMix64;
    use crate::stream::outcome::Outcome;

    #[test]
    fn snapshots_restore_breakers_and_health() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 1);
        let mut rng = SplitMix64::new(0);
        for t in 0..5 {
            let g = pool.acquire(&features("x"), t, &mut rng).unwrap();
            pool.release(g.lease_id, &Outcome::from_status(503), t);
        }
        let snaps = pool.snapshots();
        let json = serde_json::to_string(&snaps).unwrap();
        let mut rebuilt = Pool::new("p1", pool.config().clone());
        rebuilt.add_backend(spec("b0"), 10).unwrap();
        for s in serde_json::from_str::<Vec<BackendSnapshot>>(&json).unwrap() {
            rebuilt.restore(&s).unwrap();
        }
        let view = rebuilt.backend(&"b0".into()).unwrap();
        assert_eq!(
            (view.lifecycle, view.health, view.breaker),
            (Lifecycle::Ready, HealthState::Healthy, BreakerState::Open)
        );
    }
}
