//! What survives a restart: each backend's lifecycle, health and breaker as a
//! [`BackendSnapshot`], and restoring them into a rebuilt pool.

use super::errors::unknown;
use super::{BackendSnapshot, Pool, PoolError};
use crate::backend::{BackendId, Lifecycle};
use crate::breaker::{BreakerSnapshot, CircuitBreaker};
use crate::health::Health;

impl Pool {
    /// One backend's persistent state (what a request's ending may have changed).
    pub fn snapshot(&self, id: &BackendId) -> Option<BackendSnapshot> {
        let e = self.entry(*self.index.get(id)?)?;
        Some(BackendSnapshot {
            id: e.spec.id.clone(),
            lifecycle: e.lifecycle,
            health: e.health.state,
            breaker: e.breaker.snapshot(),
        })
    }

    /// Every backend's persistent state.
    pub fn snapshots(&self) -> Vec<BackendSnapshot> {
        self.entries()
            .map(|e| BackendSnapshot {
                id: e.spec.id.clone(),
                lifecycle: e.lifecycle,
                health: e.health.state,
                breaker: e.breaker.snapshot(),
            })
            .collect()
    }

    /// Restores a backend's persisted state after a restart (the backend must be added first).
    pub fn restore(&mut self, snapshot: &BackendSnapshot) -> Result<(), PoolError> {
        let slot = self.slot_of(&snapshot.id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(&snapshot.id))?;
        entry.lifecycle = match snapshot.lifecycle {
            Lifecycle::Draining if entry.in_flight.leases == 0 => Lifecycle::Drained,
            other => other,
        };
        entry.health = Health {
            state: snapshot.health,
            ..Health::default()
        };
        entry.breaker = CircuitBreaker::restore(snapshot.breaker);
        Ok(())
    }

    /// Every backend's breaker state, for persistence.
    pub fn persisted_breakers(&self) -> Vec<(BackendId, BreakerSnapshot)> {
        self.entries()
            .map(|e| (e.spec.id.clone(), e.breaker.snapshot()))
            .collect()
    }

    /// Restores one backend's breaker after a restart.
    pub fn restore_breaker(
        &mut self,
        id: &BackendId,
        snapshot: BreakerSnapshot,
    ) -> Result<(), PoolError> {
        let slot = self.slot_of(id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(id))?;
        entry.breaker = CircuitBreaker::restore(snapshot);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::Lifecycle;
    use crate::breaker::BreakerState;
    use crate::health::HealthState;
    use crate::outcome::Outcome;
    use crate::policy::PolicyKind;
    use crate::pool::test_support::{features, pool_with, spec};
    use crate::pool::{BackendSnapshot, Pool, PoolConfig};
    use crate::random::SplitMix64;

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
        let (id, b) = pool.persisted_breakers().remove(0);
        let mut other = Pool::new("p2", PoolConfig::default());
        other.add_backend(spec("b0"), 0).unwrap();
        other.restore_breaker(&id, b).unwrap();
        assert_eq!(other.backend(&id).unwrap().breaker, BreakerState::Open);
    }
}
