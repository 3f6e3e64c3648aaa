//! The admin side of the registry: registering, listing, changing and removing backends,
//! finishing drains, and writing backend state to SQLite when it changes.

use super::*;

impl PoolCoordinator {
    pub(super) async fn register(&self, reg: BackendRegistration) -> ApiResult {
        let spec = validate_registration(reg)?;
        let view = self.with(|l| {
            if l.registry.url_taken(&spec.url, &spec.id.0)? {
                return Err(ApiError::conflict(
                    "a backend with this URL is already registered",
                ));
            }
            l.pool
                .add_backend(spec.clone(), now_ms())
                .map_err(pool_error)?;
            if let Err(e) = l.registry.put_spec(&spec) {
                let _ = l.pool.remove_backend(&spec.id, now_ms());
                return Err(e);
            }
            persist_snapshots(l);
            l.pool
                .backend(&spec.id)
                .ok_or_else(|| ApiError::internal("backend vanished"))
        })?;
        // A new backend serves nothing until probed: probe now rather than at the next round.
        self.probe_soon().await;
        answer(201, &view)
    }

    pub(super) fn list(&self) -> ApiResult {
        self.with(|l| {
            let data: Vec<AdminBackend> = l.pool.backends().map(|v| admin_backend(l, v)).collect();
            answer(
                200,
                &BackendList {
                    object: "list".into(),
                    pool: Some(l.name.clone()),
                    data,
                },
            )
        })
    }

    pub(super) fn show(&self, id: &str) -> ApiResult {
        self.with(|l| {
            let id = BackendId(id.to_string());
            let view = l
                .pool
                .backend(&id)
                .ok_or_else(|| ApiError::not_found(format!("no backend `{}`", id.0)))?;
            answer(200, &admin_backend(l, view))
        })
    }

    pub(super) fn patch(&self, id: &str, req: AdminPatch) -> ApiResult {
        let id = BackendId(id.to_string());
        self.with(|l| {
            let now = now_ms();
            let mut patch = req.patch;
            if let Some(models) = &patch.models {
                validate_models(models)?;
            }
            if let Some(region) = patch.region.as_ref().filter(|r| !r.is_empty()) {
                validate_name("region", region)?;
            }
            if let Some(url) = &patch.url {
                let url = validate_url(url)?;
                if l.registry.url_taken(&url, &id.0)? {
                    return Err(ApiError::conflict(
                        "a backend with this URL is already registered",
                    ));
                }
                patch.url = Some(url);
            }
            l.pool
                .update_backend(&id, &patch, now)
                .map_err(pool_error)?;
            match req.drain {
                Some(true) => {
                    l.pool
                        .set_lifecycle(&id, Lifecycle::Draining, now)
                        .map_err(pool_error)?;
                    record_drain(l, &id, Some(now))?;
                }
                Some(false) => {
                    l.pool
                        .set_lifecycle(&id, Lifecycle::Ready, now)
                        .map_err(pool_error)?;
                    record_drain(l, &id, None)?;
                    l.pending_delete.remove(&id);
                    l.registry.set_meta("pending_delete", &l.pending_delete)?;
                }
                None => {}
            }
            finish_drains(l);
            if let Some(spec) = l.pool.spec(&id) {
                l.registry.put_spec(spec)?;
            }
            persist_snapshots(l);
            let view = l
                .pool
                .backend(&id)
                .ok_or_else(|| ApiError::not_found("backend vanished"))?;
            answer(200, &admin_backend(l, view))
        })
    }

    pub(super) fn delete(&self, id: &str, force: bool) -> ApiResult {
        let id = BackendId(id.to_string());
        self.with(|l| {
            let now = now_ms();
            let view = l
                .pool
                .backend(&id)
                .ok_or_else(|| ApiError::not_found(format!("no backend `{}`", id.0)))?;
            // Within a restart's hold, a backend showing no leases may still run streams the
            // pool forgot: it drains like a busy one, and goes once they renewed and ended.
            if force || (view.leases_in_flight == 0 && now >= drain_hold(l, &id)) {
                remove_backend(l, &id)?;
                return answer(
                    200,
                    &DeleteAnswer {
                        id: id.0,
                        deleted: true,
                        status: None,
                        leases_in_flight: None,
                    },
                );
            }
            l.pool
                .set_lifecycle(&id, Lifecycle::Draining, now)
                .map_err(pool_error)?;
            record_drain(l, &id, Some(now))?;
            l.pending_delete.insert(id.clone());
            l.registry.set_meta("pending_delete", &l.pending_delete)?;
            persist_snapshots(l);
            answer(
                202,
                &DeleteAnswer {
                    id: id.0,
                    deleted: false,
                    status: Some("draining".into()),
                    leases_in_flight: Some(view.leases_in_flight),
                },
            )
        })
    }

    pub(super) fn models(&self) -> ApiResult {
        self.with(|l| {
            let mut models: Vec<String> = l
                .pool
                .backends()
                .filter(|v| v.lifecycle == Lifecycle::Ready && v.health == HealthState::Healthy)
                .flat_map(|v| v.served_models)
                .collect();
            models.sort();
            models.dedup();
            answer(200, &ModelsAnswer { models })
        })
    }
}

/// A backend as the admin API shows it.
pub(super) fn admin_backend(l: &Live, view: routing_core::pool::BackendView) -> AdminBackend {
    AdminBackend {
        last_probe: l.probes.get(&view.id).cloned(),
        delete_pending: l.pending_delete.contains(&view.id),
        view,
    }
}

/// Removes drained backends whose `DELETE` was waiting for the drain; once a restart's hold is
/// over, marks drained the draining backends none of whose streams came back.
pub(super) fn finish_drains(l: &mut Live) {
    let now = now_ms();
    if l.drain_hold_until_ms != 0 && now >= l.drain_hold_until_ms {
        l.drain_hold_until_ms = 0;
        l.restored.clear();
        if !l.pool.finish_idle_drains().is_empty() {
            persist_snapshots(l);
        }
    }
    if l.pending_delete.is_empty() {
        return;
    }
    let done: Vec<BackendId> = l
        .pending_delete
        .iter()
        .filter(|id| drain_finished(l.pool.backend(id).as_ref(), now, drain_hold(l, id)))
        .cloned()
        .collect();
    for id in done {
        if let Err(e) = remove_backend(l, &id) {
            console_error!("pool {}: removing drained backend {}: {e}", l.name, id.0);
        }
    }
}

/// Until when `id`'s drain is held after a restart (0: not held).
pub(super) fn drain_hold(l: &Live, id: &BackendId) -> u64 {
    if l.restored.contains(id) {
        l.drain_hold_until_ms
    } else {
        0
    }
}

/// Records when a backend's drain started (`Some`) or that it no longer drains (`None`).
pub(super) fn record_drain(
    l: &mut Live,
    id: &BackendId,
    started_ms: Option<u64>,
) -> std::result::Result<(), ApiError> {
    let changed = match started_ms {
        Some(at) => {
            if l.drain_started.contains_key(id) {
                false
            } else {
                l.drain_started.insert(id.clone(), at);
                true
            }
        }
        None => l.drain_started.remove(id).is_some(),
    };
    if changed {
        l.registry.set_meta("drain_started", &l.drain_started)?;
    }
    Ok(())
}

pub(super) fn remove_backend(l: &mut Live, id: &BackendId) -> std::result::Result<(), ApiError> {
    let _ = l.pool.remove_backend(id, now_ms());
    l.registry.delete(&id.0)?;
    l.probes.remove(id);
    l.persisted.remove(id);
    l.load = pool_load(l);
    record_drain(l, id, None)?;
    if l.pending_delete.remove(id) {
        l.registry.set_meta("pending_delete", &l.pending_delete)?;
    }
    Ok(())
}

/// Writes the lifecycle, health and breaker state of every backend whose state changed since it
/// was last written, and refreshes the load summary spillover reads (probe rounds, admin changes).
pub(super) fn persist_snapshots(l: &mut Live) {
    for snapshot in l.pool.snapshots() {
        persist_if_changed(l, snapshot);
    }
    l.load = pool_load(l);
}

/// The same for the backends a request touched: no work proportional to the fleet per request.
/// (A request's ending changes breakers and drains, never what the load summary counts.)
pub(super) fn persist_backends(l: &mut Live, ids: &[Option<&BackendId>]) {
    for id in ids.iter().flatten() {
        if let Some(snapshot) = l.pool.snapshot(id) {
            persist_if_changed(l, snapshot);
        }
    }
}

pub(super) fn persist_if_changed(l: &mut Live, snapshot: BackendSnapshot) {
    if l.persisted.get(&snapshot.id) == Some(&snapshot) {
        return;
    }
    match l.registry.put_snapshot(&snapshot) {
        Ok(()) => {
            l.persisted.insert(snapshot.id.clone(), snapshot);
        }
        Err(e) => console_error!("pool {}: persisting {}: {e}", l.name, snapshot.id.0),
    }
}
