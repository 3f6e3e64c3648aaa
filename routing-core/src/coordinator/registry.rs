//! The registry's rules: registering, changing and removing backends, a `DELETE` that waits for
//! its backend's drain, drains that finish (and the restart's hold on them), and a sibling shard
//! bringing its registry in line with shard 0's. Each change says what to write
//! ([`super::Effect`]).

use super::{Coordinator, Effect, Effects};
use crate::backend::{BackendId, BackendPatch, BackendSpec, Lifecycle};
use crate::pool::PoolError;
use std::collections::HashSet;

/// What a `DELETE` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deletion {
    /// The backend is gone.
    Deleted,
    /// The backend drains; it goes once its last lease ends.
    Draining {
        /// Its leases when the `DELETE` came.
        leases_in_flight: u32,
    },
}

impl Coordinator {
    /// Adds a backend (it serves nothing until probed: probe soon).
    pub fn register(&mut self, spec: BackendSpec, now_ms: u64) -> Result<Effects, PoolError> {
        self.pool.add_backend(spec.clone(), now_ms)?;
        let mut effects = vec![Effect::PersistSpec(spec)];
        self.persist_snapshots(&mut effects);
        effects.push(Effect::ProbeSoon);
        Ok(effects)
    }

    /// Takes back a registration whose spec could not be written.
    pub fn unregister(&mut self, id: &BackendId, now_ms: u64) {
        let _ = self.pool.remove_backend(id, now_ms);
        self.persisted.remove(id);
        self.load = self.measure_load();
    }

    /// Changes a backend's spec, and drains it (`Some(true)`) or puts it back in service
    /// (`Some(false)`, which also cancels a `DELETE` waiting for its drain); either probes soon.
    pub fn patch(
        &mut self,
        id: &BackendId,
        patch: &BackendPatch,
        drain: Option<bool>,
        now_ms: u64,
    ) -> Result<Effects, PoolError> {
        let mut effects = Effects::new();
        self.pool.update_backend(id, patch, now_ms)?;
        match drain {
            Some(true) => {
                self.pool.set_lifecycle(id, Lifecycle::Draining, now_ms)?;
                self.record_drain(id, Some(now_ms), &mut effects);
            }
            Some(false) => {
                self.pool.set_lifecycle(id, Lifecycle::Ready, now_ms)?;
                self.record_drain(id, None, &mut effects);
                self.drains.set_delete_pending(id, false);
                effects.push(Effect::PersistPendingDeletes);
            }
            None => {}
        }
        self.finish_drains(now_ms, &mut effects);
        if let Some(spec) = self.pool.spec(id) {
            effects.push(Effect::PersistSpec(spec.clone()));
        }
        self.persist_snapshots(&mut effects);
        if drain.is_some() {
            effects.push(Effect::ProbeSoon);
        }
        Ok(effects)
    }

    /// Removes a backend: at once when `force`d or idle (within a restart's hold, a backend
    /// showing no leases may still run streams the pool forgot: it drains like a busy one), else
    /// once its drain finishes.
    pub fn delete(
        &mut self,
        id: &BackendId,
        force: bool,
        now_ms: u64,
    ) -> Result<(Deletion, Effects), PoolError> {
        let mut effects = Effects::new();
        let view = self
            .pool
            .backend(id)
            .ok_or_else(|| PoolError::UnknownBackend { id: id.clone() })?;
        if force || (view.leases_in_flight == 0 && now_ms >= self.drains.hold_of(id)) {
            self.remove_backend(id, now_ms, &mut effects);
            return Ok((Deletion::Deleted, effects));
        }
        self.pool.set_lifecycle(id, Lifecycle::Draining, now_ms)?;
        self.record_drain(id, Some(now_ms), &mut effects);
        self.drains.set_delete_pending(id, true);
        effects.push(Effect::PersistPendingDeletes);
        self.persist_snapshots(&mut effects);
        let leases_in_flight = view.leases_in_flight;
        Ok((Deletion::Draining { leases_in_flight }, effects))
    }

    /// Leases past their deadline end, and drains that finished with them (the alarm).
    pub fn expire(&mut self, now_ms: u64) -> Effects {
        let mut effects = Effects::new();
        self.pool.expire(now_ms);
        self.finish_drains(now_ms, &mut effects);
        effects
    }

    /// Makes this registry match shard 0's: `backends` with whether each drains, and the
    /// backends whose `DELETE` waits. Returns how many backends changed; the effects of what
    /// was done before an error are returned with it.
    pub fn sync_registry(
        &mut self,
        backends: Vec<(BackendSpec, bool)>,
        pending_delete: Vec<BackendId>,
        now_ms: u64,
    ) -> (Result<usize, PoolError>, Effects) {
        let mut effects = Effects::new();
        let applied = self.sync_backends(backends, now_ms, &mut effects);
        if applied.is_ok() {
            let pending: HashSet<BackendId> = pending_delete.into_iter().collect();
            self.drains.replace_pending_deletes(pending);
            effects.push(Effect::PersistPendingDeletes);
            self.finish_drains(now_ms, &mut effects);
            self.persist_snapshots(&mut effects);
        }
        (applied, effects)
    }

    fn sync_backends(
        &mut self,
        backends: Vec<(BackendSpec, bool)>,
        now_ms: u64,
        effects: &mut Effects,
    ) -> Result<usize, PoolError> {
        let mut applied = 0;
        let wanted: HashSet<BackendId> = backends.iter().map(|(s, _)| s.id.clone()).collect();
        let gone: Vec<BackendId> = self
            .pool
            .backends()
            .map(|v| v.id)
            .filter(|id| !wanted.contains(id))
            .collect();
        for id in gone {
            self.remove_backend(&id, now_ms, effects);
            applied += 1;
        }
        for (spec, draining) in backends {
            let id = spec.id.clone();
            match self.pool.spec(&id) {
                Some(held) if *held == spec => {}
                Some(_) => {
                    self.pool.update_backend(&id, &full_patch(&spec), now_ms)?;
                    effects.push(Effect::PersistSpec(spec));
                    applied += 1;
                }
                None => {
                    self.pool.add_backend(spec.clone(), now_ms)?;
                    effects.push(Effect::PersistSpec(spec));
                    applied += 1;
                }
            }
            let lifecycle = self.pool.backend(&id).map(|v| v.lifecycle);
            let to = match (draining, lifecycle) {
                (true, Some(Lifecycle::Pending | Lifecycle::Ready)) => Some(Lifecycle::Draining),
                (false, Some(Lifecycle::Draining | Lifecycle::Drained)) => Some(Lifecycle::Ready),
                _ => None,
            };
            if let Some(to) = to {
                self.pool.set_lifecycle(&id, to, now_ms)?;
            }
        }
        Ok(applied)
    }

    /// Every backend's spec and whether it drains (what shard 0 hands its siblings).
    pub fn registry_entries(&self) -> Vec<(BackendSpec, bool)> {
        self.pool
            .backends()
            .filter_map(|v| {
                let draining = matches!(v.lifecycle, Lifecycle::Draining | Lifecycle::Drained);
                self.pool.spec(&v.id).map(|s| (s.clone(), draining))
            })
            .collect()
    }

    /// Removes drained backends whose `DELETE` was waiting for the drain; once a restart's hold
    /// is over, marks drained the draining backends none of whose streams came back.
    pub(super) fn finish_drains(&mut self, now_ms: u64, effects: &mut Effects) {
        if self.drains.end_hold(now_ms) && !self.pool.finish_idle_drains().is_empty() {
            self.persist_snapshots(effects);
        }
        if self.drains.pending_deletes().is_empty() {
            return;
        }
        for id in self.drains.finished(&self.pool, now_ms) {
            self.remove_backend(&id, now_ms, effects);
        }
    }

    /// Records when a backend's drain started (`Some`) or that it no longer drains (`None`).
    fn record_drain(&mut self, id: &BackendId, started_ms: Option<u64>, effects: &mut Effects) {
        if self.drains.record_start(id, started_ms) {
            effects.push(Effect::PersistDrainStarts);
        }
    }

    fn remove_backend(&mut self, id: &BackendId, now_ms: u64, effects: &mut Effects) {
        let _ = self.pool.remove_backend(id, now_ms);
        effects.push(Effect::DeleteBackend(id.clone()));
        self.probes.reports.remove(id);
        self.persisted.remove(id);
        self.load = self.measure_load();
        self.record_drain(id, None, effects);
        if self.drains.set_delete_pending(id, false) {
            effects.push(Effect::PersistPendingDeletes);
        }
    }
}

/// A patch that makes a backend's spec `spec`.
fn full_patch(spec: &BackendSpec) -> BackendPatch {
    BackendPatch {
        url: Some(spec.url.clone()),
        region: Some(spec.region.clone()),
        models: Some(spec.models.clone()),
        weight: Some(spec.weight),
        role: Some(spec.role),
        api_key: Some(spec.api_key.clone()),
        capacity: Some(spec.capacity),
    }
}
