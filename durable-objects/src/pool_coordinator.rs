//! The pool coordinator: one Durable Object per GPU pool, the single authority for that pool's
//! backends, their health, and the requests in flight on them.
//!
//! The Worker reaches it over internal HTTP routes (see [`crate::protocol`]). Response bytes never
//! pass through here: the Worker asks for a lease, streams from the backend itself, and releases
//! the lease when the stream ends. Probes run from this object's alarm, which the cron trigger keeps
//! armed.

use crate::api_error::ApiError;
use crate::protocol::BackendRegistration;
use crate::registry::{validate_registration, Registry, StoredBackend};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::cell::RefCell;
use std::collections::HashMap;
use worker::*;

/// How often the alarm probes backends unless configured otherwise.
const DEFAULT_PROBE_INTERVAL_MS: i64 = 10_000;

/// Live state of one pool.
#[durable_object]
pub struct PoolCoordinator {
    state: State,
    env: Env,
    inner: RefCell<Option<Inner>>,
}

/// What the coordinator keeps in memory (rebuilt from the registry after a restart).
struct Inner {
    registry: Registry,
    backends: Vec<StoredBackend>,
    healthy: HashMap<String, bool>,
    in_flight: HashMap<u64, String>,
    next_lease: u64,
}

/// A granted lease: the backend to call.
#[derive(Serialize, Deserialize)]
pub struct Grant {
    /// Lease id, to release.
    pub lease_id: u64,
    /// Chosen backend id.
    pub backend_id: String,
    /// Its base URL.
    pub url: String,
    /// Its API key, for the Authorization header.
    pub api_key: Option<String>,
}

/// A backend as listed by the admin API (API key redacted).
#[derive(Serialize)]
struct BackendView<'a> {
    id: &'a str,
    url: &'a str,
    region: &'a str,
    models: &'a [String],
    weight: u32,
    role: &'a str,
    api_key: Option<&'static str>,
    healthy: Option<bool>,
    in_flight: usize,
}

#[derive(Deserialize)]
struct AcquireRequest {
    model: String,
}

#[derive(Deserialize)]
struct ReleaseRequest {
    lease_id: u64,
}

impl DurableObject for PoolCoordinator {
    fn new(state: State, env: Env) -> Self {
        PoolCoordinator { state, env, inner: RefCell::new(None) }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        if let Err(e) = self.load() {
            return e.to_response();
        }
        let path = req.path();
        let segments: Vec<String> = path.trim_matches('/').split('/').map(str::to_string).collect();
        let segs: Vec<&str> = segments.iter().map(String::as_str).collect();
        let method = req.method();
        let body = match method {
            Method::Post | Method::Put | Method::Patch => match req.text().await {
                Ok(t) => t,
                Err(e) => return ApiError::bad_request(format!("unreadable body: {e}")).to_response(),
            },
            _ => String::new(),
        };
        let result = match (method, segs.as_slice()) {
            (Method::Post, ["backends"]) => self.register(&body),
            (Method::Get, ["backends"]) => self.list(),
            (Method::Post, ["acquire"]) => self.acquire(&body),
            (Method::Post, ["release"]) => self.release(&body),
            (Method::Post, ["probe", "ensure"]) => self.ensure_alarm().await,
            (Method::Get, ["state"]) => self.summary(),
            _ => Err(ApiError::not_found(format!("pool has no route {path}"))),
        };
        result.or_else(|e| e.to_response())
    }

    async fn alarm(&self) -> Result<Response> {
        if let Err(e) = self.load() {
            return e.to_response();
        }
        self.probe_all().await;
        self.state.storage().set_alarm(self.probe_interval_ms()).await?;
        Response::ok("probed")
    }
}

type ApiResult = std::result::Result<Response, ApiError>;

fn json_response<T: Serialize>(status: u16, value: &T) -> ApiResult {
    Response::from_json(value).map(|r| r.with_status(status)).map_err(ApiError::from_worker)
}

impl PoolCoordinator {
    /// Loads the registry into memory on first use after a (re)start.
    fn load(&self) -> std::result::Result<(), ApiError> {
        if self.inner.borrow().is_some() {
            return Ok(());
        }
        let registry = Registry::open(self.state.storage().sql()).map_err(ApiError::from_worker)?;
        let backends = registry.backends().map_err(ApiError::from_worker)?;
        *self.inner.borrow_mut() =
            Some(Inner { registry, backends, healthy: HashMap::new(), in_flight: HashMap::new(), next_lease: 1 });
        Ok(())
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut guard = self.inner.borrow_mut();
        f(guard.as_mut().expect("load() runs before every handler"))
    }

    fn probe_interval_ms(&self) -> i64 {
        self.env
            .var("PROBE_INTERVAL_MS")
            .ok()
            .and_then(|v| v.to_string().parse().ok())
            .unwrap_or(DEFAULT_PROBE_INTERVAL_MS)
    }

    fn register(&self, body: &str) -> ApiResult {
        let reg: BackendRegistration =
            serde_json::from_str(body).map_err(|e| ApiError::bad_request(format!("invalid backend registration: {e}")))?;
        let backend = validate_registration(reg, "")?;
        self.with(|inner| {
            inner.registry.insert(&backend)?;
            inner.backends.push(backend.clone());
            Ok(())
        })?;
        self.with(|inner| json_response(201, &view(inner, inner.backends.last().expect("just pushed"))))
    }

    fn list(&self) -> ApiResult {
        self.with(|inner| {
            let views: Vec<BackendView> = inner.backends.iter().map(|b| view(inner, b)).collect();
            json_response(200, &json!({ "object": "list", "data": views }))
        })
    }

    fn acquire(&self, body: &str) -> ApiResult {
        let req: AcquireRequest =
            serde_json::from_str(body).map_err(|e| ApiError::bad_request(format!("invalid acquire: {e}")))?;
        self.with(|inner| {
            let serving: Vec<&StoredBackend> =
                inner.backends.iter().filter(|b| b.models.is_empty() || b.models.contains(&req.model)).collect();
            if serving.is_empty() {
                return Err(ApiError::model_not_found(&req.model));
            }
            let chosen = serving
                .into_iter()
                .filter(|b| inner.healthy.get(&b.id).copied().unwrap_or(true))
                .min_by_key(|b| inner.in_flight.values().filter(|id| *id == &b.id).count())
                .cloned()
                .ok_or_else(|| ApiError::unavailable("No healthy backend can serve this model now.", 1))?;
            let lease_id = inner.next_lease;
            inner.next_lease += 1;
            inner.in_flight.insert(lease_id, chosen.id.clone());
            json_response(200, &Grant { lease_id, backend_id: chosen.id, url: chosen.url, api_key: chosen.api_key })
        })
    }

    fn release(&self, body: &str) -> ApiResult {
        let req: ReleaseRequest =
            serde_json::from_str(body).map_err(|e| ApiError::bad_request(format!("invalid release: {e}")))?;
        let released = self.with(|inner| inner.in_flight.remove(&req.lease_id).is_some());
        json_response(200, &json!({ "released": released }))
    }

    async fn ensure_alarm(&self) -> ApiResult {
        let storage = self.state.storage();
        let armed = storage.get_alarm().await.map_err(ApiError::from_worker)?;
        if armed.is_none() {
            storage.set_alarm(0i64).await.map_err(ApiError::from_worker)?;
        }
        json_response(200, &json!({ "alarm_was_armed": armed.is_some() }))
    }

    fn summary(&self) -> ApiResult {
        self.with(|inner| {
            let last_probe_ms: Option<f64> = inner.registry.meta("last_probe_ms").and_then(|v| v.parse().ok());
            json_response(
                200,
                &json!({
                    "backends": inner.backends.len(),
                    "in_flight": inner.in_flight.len(),
                    "last_probe_ms": last_probe_ms,
                }),
            )
        })
    }

    /// Probes every backend's `/health`, six at a time (the platform's connection limit).
    async fn probe_all(&self) {
        let targets: Vec<(String, String)> =
            self.with(|inner| inner.backends.iter().map(|b| (b.id.clone(), b.url.clone())).collect());
        for batch in targets.chunks(6) {
            let probes = batch.iter().map(|(id, url)| async move {
                let ok = matches!(Fetch::Url(match Url::parse(&format!("{url}/health")) {
                    Ok(u) => u,
                    Err(_) => return (id.clone(), false),
                }).send().await, Ok(r) if r.status_code() == 200);
                (id.clone(), ok)
            });
            let results = futures_util::future::join_all(probes).await;
            self.with(|inner| {
                for (id, ok) in results {
                    inner.healthy.insert(id, ok);
                }
            });
        }
        let now = Date::now().as_millis().to_string();
        self.with(|inner| {
            if let Err(e) = inner.registry.set_meta("last_probe_ms", &now) {
                console_error!("pool: could not record probe time: {e}");
            }
        });
    }
}

fn view<'a>(inner: &Inner, b: &'a StoredBackend) -> BackendView<'a> {
    BackendView {
        id: &b.id,
        url: &b.url,
        region: &b.region,
        models: &b.models,
        weight: b.weight,
        role: &b.role,
        api_key: b.api_key.as_ref().map(|_| "[redacted]"),
        healthy: inner.healthy.get(&b.id).copied(),
        in_flight: inner.in_flight.values().filter(|id| *id == &b.id).count(),
    }
}
