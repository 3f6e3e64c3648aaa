//! The admin side of the registry: registering, listing, changing and removing backends. The
//! rules (and what to write) are the coordinator's; this file validates, checks the URL against
//! SQLite, and answers.

use super::{now_ms, pool_error, ApiResult, PoolCoordinator};
use crate::call::answer;
use coordinator_protocol::messages::{
    AdminBackend, AdminPatch, BackendList, BackendRegistration, DeleteAnswer, ModelsAnswer,
};
use coordinator_protocol::registration::{validate_models, validate_registration, validate_url};
use coordinator_protocol::settings::validate_name;
use coordinator_protocol::ApiError;
use routing_core::backend::BackendId;
use routing_core::coordinator::{Coordinator, Deletion};
use routing_core::pool::BackendView;

impl PoolCoordinator {
    pub(super) async fn register(&self, reg: BackendRegistration) -> ApiResult {
        let spec = validate_registration(reg)?;
        let (view, performed) = self.with(|shard| {
            if shard.registry.url_taken(&spec.url, &spec.id.0)? {
                return Err(ApiError::conflict(
                    "a backend with this URL is already registered",
                ));
            }
            let now = now_ms();
            let effects = shard
                .coordinator
                .register(spec.clone(), now)
                .map_err(pool_error)?;
            let mut performed = shard.perform(effects, now);
            if let Err(e) = performed.check() {
                shard.coordinator.unregister(&spec.id, now);
                return Err(e);
            }
            let view = shard
                .coordinator
                .pool()
                .backend(&spec.id)
                .ok_or_else(|| ApiError::internal("backend vanished"))?;
            Ok((view, performed))
        })?;
        // A new backend serves nothing until probed: probe now rather than at the next round.
        self.follow_up(performed).await;
        answer(201, &view)
    }

    pub(super) fn list(&self) -> ApiResult {
        self.with(|shard| {
            let coordinator = &shard.coordinator;
            let data: Vec<AdminBackend> = coordinator
                .pool()
                .backends()
                .map(|v| admin_backend(coordinator, v))
                .collect();
            answer(
                200,
                &BackendList {
                    object: "list".into(),
                    pool: Some(shard.name.clone()),
                    data,
                },
            )
        })
    }

    pub(super) fn show(&self, id: &str) -> ApiResult {
        self.with(|shard| {
            let id = BackendId(id.to_string());
            let view = shard
                .coordinator
                .pool()
                .backend(&id)
                .ok_or_else(|| ApiError::not_found(format!("no backend `{}`", id.0)))?;
            answer(200, &admin_backend(&shard.coordinator, view))
        })
    }

    pub(super) async fn patch(&self, id: &str, req: AdminPatch) -> ApiResult {
        let id = BackendId(id.to_string());
        let (backend, performed) = self.with(|shard| {
            let mut patch = req.patch;
            if let Some(models) = &patch.models {
                validate_models(models)?;
            }
            if let Some(region) = patch.region.as_ref().filter(|r| !r.is_empty()) {
                validate_name("region", region)?;
            }
            if let Some(url) = &patch.url {
                let url = validate_url(url)?;
                if shard.registry.url_taken(&url, &id.0)? {
                    return Err(ApiError::conflict(
                        "a backend with this URL is already registered",
                    ));
                }
                patch.url = Some(url);
            }
            let now = now_ms();
            let effects = shard
                .coordinator
                .patch(&id, &patch, req.drain, now)
                .map_err(pool_error)?;
            let mut performed = shard.perform(effects, now);
            performed.check()?;
            let view = shard
                .coordinator
                .pool()
                .backend(&id)
                .ok_or_else(|| ApiError::not_found("backend vanished"))?;
            Ok((admin_backend(&shard.coordinator, view), performed))
        })?;
        self.follow_up(performed).await;
        answer(200, &backend)
    }

    pub(super) fn delete(&self, id: &str, force: bool) -> ApiResult {
        let id = BackendId(id.to_string());
        self.with(|shard| {
            if shard.coordinator.pool().backend(&id).is_none() {
                return Err(ApiError::not_found(format!("no backend `{}`", id.0)));
            }
            let now = now_ms();
            let (deletion, effects) = shard
                .coordinator
                .delete(&id, force, now)
                .map_err(pool_error)?;
            shard.perform(effects, now).check()?;
            match deletion {
                Deletion::Deleted => answer(
                    200,
                    &DeleteAnswer {
                        id: id.0,
                        deleted: true,
                        status: None,
                        leases_in_flight: None,
                    },
                ),
                Deletion::Draining { leases_in_flight } => answer(
                    202,
                    &DeleteAnswer {
                        id: id.0,
                        deleted: false,
                        status: Some("draining".into()),
                        leases_in_flight: Some(leases_in_flight),
                    },
                ),
            }
        })
    }

    pub(super) fn models(&self) -> ApiResult {
        self.with(|shard| {
            // The one "serves this model" rule, the same the time card and the acquire follow.
            let pool = shard.coordinator.pool();
            let models = pool.served_models();
            // The adapters the backends that are up listed in their last probe (issue 43).
            let mut adapters: Vec<_> = pool
                .backends()
                .filter(|v| routing_core::backend::serving::is_up(v.lifecycle, v.health))
                .filter_map(|v| shard.coordinator.probe_report(&v.id))
                .flat_map(|r| r.adapters.iter().cloned())
                .collect();
            adapters.sort();
            adapters.dedup_by(|a, b| a.id == b.id);
            answer(200, &ModelsAnswer { models, adapters })
        })
    }
}

/// A backend as the admin API shows it.
fn admin_backend(coordinator: &Coordinator, view: BackendView) -> AdminBackend {
    AdminBackend {
        last_probe: coordinator.probe_report(&view.id).cloned(),
        delete_pending: coordinator.drains().delete_pending(&view.id),
        view,
    }
}
