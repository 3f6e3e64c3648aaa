//! Every internal route of the gateway's Durable Objects, as one enum.
//!
//! The Worker builds a call's method and URL from a [`Route`]; the Durable Object parses the
//! method and path it receives back into the same [`Route`]. Neither side spells a route string,
//! so the two cannot drift apart.

/// Base of the internal URLs used to reach a Durable Object (the host is never resolved).
pub const INTERNAL_ORIGIN: &str = "https://do.internal";

/// The HTTP methods the internal routes use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpMethod {
    /// `GET`.
    Get,
    /// `POST`.
    Post,
    /// `PUT`.
    Put,
    /// `PATCH`.
    Patch,
    /// `DELETE`.
    Delete,
}

impl HttpMethod {
    /// Parses an upper-case method name.
    pub fn parse(method: &str) -> Option<HttpMethod> {
        Some(match method {
            "GET" => HttpMethod::Get,
            "POST" => HttpMethod::Post,
            "PUT" => HttpMethod::Put,
            "PATCH" => HttpMethod::Patch,
            "DELETE" => HttpMethod::Delete,
            _ => return None,
        })
    }

    /// The method's name.
    pub fn as_str(self) -> &'static str {
        match self {
            HttpMethod::Get => "GET",
            HttpMethod::Post => "POST",
            HttpMethod::Put => "PUT",
            HttpMethod::Patch => "PATCH",
            HttpMethod::Delete => "DELETE",
        }
    }
}

/// Which kind of Durable Object serves a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Object {
    /// `PoolCoordinator`, one per pool.
    Pool,
    /// `GatewayDirectory`, the single list of pools and client keys.
    Directory,
    /// `ClientRateLimiter`, one per client key.
    ClientRateLimiter,
}

/// One call to a Durable Object. The comment on each variant names its body and answer; the
/// pairing itself is [`crate::call`]'s: each request message implements [`crate::call::Call`]
/// with its route and its answer type, so neither side can pair them otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `POST /acquire`: [`crate::acquire::Acquire`] -> [`crate::acquire::AcquireAnswer`]
    /// (`Granted` 200, `Queued` 202, `Refused` as its error).
    /// `spill_ok`: a further pool could take the request, so a saturated pool may refuse it.
    Acquire {
        /// A saturated or full pool may refuse (the Worker has somewhere else to go).
        spill_ok: bool,
    },
    /// `POST /dequeue`: `DequeueRequest` -> `DequeueAnswer`.
    Dequeue,
    /// `POST /reassign`: `ReassignRequest` -> `ReassignAnswer` (`Moved` 200, `Refused` as its
    /// error).
    Reassign,
    /// `POST /release`: `ReleaseRequest` -> `ReleaseAnswer`.
    Release,
    /// `POST /release_batch`: `ReleaseBatch` -> `ReleaseBatchAnswer` (several leases of one
    /// shard ended; an isolate sends them together while a release to that shard is in flight).
    ReleaseBatch,
    /// `POST /renew`: `RenewRequest` -> `RenewAnswer`.
    Renew,
    /// `POST /prefill_done`: `PrefillDone` -> `PrefillDoneAnswer`.
    PrefillDone,
    /// `POST /responses/holder`: `ResponseHolder` -> `ResponseHolderAnswer` (the backend holding
    /// a stored Responses API response, for `GET /v1/responses/{id}` and its cancel).
    ResponseHolder,
    /// `POST /backends`: `BackendRegistration` -> `BackendView` (201).
    RegisterBackend,
    /// `GET /backends`: -> `BackendList`.
    ListBackends,
    /// `GET /backends/{id}`: -> `AdminBackend`.
    ShowBackend(String),
    /// `PATCH /backends/{id}`: `AdminPatch` -> `AdminBackend`.
    PatchBackend(String),
    /// `DELETE /backends/{id}[?force=true]`: -> `DeleteAnswer` (200 removed, 202 draining).
    DeleteBackend {
        /// The backend.
        id: String,
        /// Remove it now even with requests in flight.
        force: bool,
    },
    /// `GET /models`: -> `ModelsAnswer`.
    Models,
    /// `GET /config`: -> `PoolSettings`.
    GetConfig,
    /// `PUT /config`: `PoolSettings` -> `PoolSettings`.
    PutConfig,
    /// `GET /state`: -> `PoolSummary`.
    Summary,
    /// `GET /metrics`: -> `MetricsPage` (Prometheus text).
    Metrics,
    /// `GET /history`: -> `PoolHistory`.
    History,
    /// `POST /probe/ensure`: -> `AlarmAnswer` (the cron trigger keeps the probe alarm armed).
    EnsureProbeAlarm,
    /// `POST /probe/now`: -> `PoolSummary`, after a fresh probe round.
    ProbeNow,
    /// `POST /shard/load` (shard to sibling): `routing_core::pool::shard::LoadReport` -> `LoadReportAnswer`.
    ShardLoad,
    /// `POST /shard/probes` (shard 0 to sibling): `ProbeRound` -> `ShardAck`.
    ShardProbes,
    /// `POST /shard/registry` (shard 0 to sibling): `ShardRegistry` -> `ShardAck`.
    ShardRegistry,
    /// `GET /pools` (directory): -> `Vec<PoolEntry>`.
    ListPools,
    /// `PUT /pools/{name}` (directory): `PoolEntry` -> `PoolEntry`.
    PutPool(String),
    /// `PUT /pools/{name}/card` (pool shard 0 to the directory): `TimeCard` -> `CardAnswer`.
    PutCard(String),
    /// `GET /keys` (directory): -> `Vec<StoredKey>`.
    ListKeys,
    /// `POST /keys` (directory): `StoredKey` -> `StoredKey` (201).
    AddKey,
    /// `PATCH /keys/{id}` (directory): `KeyPatch` -> `KeyPatchAnswer`.
    PatchKey(String),
    /// `DELETE /keys/{id}` (directory): -> `DeleteAnswer`.
    DeleteKey(String),
    /// `POST /take` (rate limiter): `TakeRequest` -> `Taken`, or 429.
    TakeTokens,
    /// `POST /settle` (rate limiter): `SettleRequest` -> `Ack`.
    SettleTokens,
}

/// Why a method and path name no route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteError {
    /// No route has this path.
    NotFound,
    /// The path exists, but not with this method.
    MethodNotAllowed,
}

impl Route {
    /// The kind of Durable Object that serves this route.
    pub fn object(&self) -> Object {
        match self {
            Route::ListPools
            | Route::PutPool(_)
            | Route::PutCard(_)
            | Route::ListKeys
            | Route::AddKey
            | Route::PatchKey(_)
            | Route::DeleteKey(_) => Object::Directory,
            Route::TakeTokens | Route::SettleTokens => Object::ClientRateLimiter,
            _ => Object::Pool,
        }
    }

    /// The route's method.
    pub fn method(&self) -> HttpMethod {
        use HttpMethod::*;
        match self {
            Route::ListBackends
            | Route::ShowBackend(_)
            | Route::Models
            | Route::GetConfig
            | Route::Summary
            | Route::Metrics
            | Route::History
            | Route::ListPools
            | Route::ListKeys => Get,
            Route::PutConfig | Route::PutPool(_) | Route::PutCard(_) => Put,
            Route::PatchBackend(_) | Route::PatchKey(_) => Patch,
            Route::DeleteBackend { .. } | Route::DeleteKey(_) => Delete,
            _ => Post,
        }
    }

    /// The route's path and query, such as `/backends/b-1?force=true`.
    pub fn path(&self) -> String {
        match self {
            Route::Acquire { spill_ok: true } => "/acquire?spill_ok=true".into(),
            Route::Acquire { spill_ok: false } => "/acquire".into(),
            Route::Dequeue => "/dequeue".into(),
            Route::Reassign => "/reassign".into(),
            Route::Release => "/release".into(),
            Route::ReleaseBatch => "/release_batch".into(),
            Route::Renew => "/renew".into(),
            Route::PrefillDone => "/prefill_done".into(),
            Route::ResponseHolder => "/responses/holder".into(),
            Route::RegisterBackend | Route::ListBackends => "/backends".into(),
            Route::ShowBackend(id) | Route::PatchBackend(id) => format!("/backends/{id}"),
            Route::DeleteBackend { id, force: true } => format!("/backends/{id}?force=true"),
            Route::DeleteBackend { id, force: false } => format!("/backends/{id}"),
            Route::Models => "/models".into(),
            Route::GetConfig | Route::PutConfig => "/config".into(),
            Route::Summary => "/state".into(),
            Route::Metrics => "/metrics".into(),
            Route::History => "/history".into(),
            Route::EnsureProbeAlarm => "/probe/ensure".into(),
            Route::ProbeNow => "/probe/now".into(),
            Route::ShardLoad => "/shard/load".into(),
            Route::ShardProbes => "/shard/probes".into(),
            Route::ShardRegistry => "/shard/registry".into(),
            Route::ListPools => "/pools".into(),
            Route::PutPool(name) => format!("/pools/{name}"),
            Route::PutCard(name) => format!("/pools/{name}/card"),
            Route::ListKeys | Route::AddKey => "/keys".into(),
            Route::PatchKey(id) | Route::DeleteKey(id) => format!("/keys/{id}"),
            Route::TakeTokens => "/take".into(),
            Route::SettleTokens => "/settle".into(),
        }
    }

    /// Whether the call can change the load a pool's shard reports to its siblings (a lease taken,
    /// moved or ended, a queued request leaving).
    pub fn moves_load(&self) -> bool {
        matches!(
            self,
            Route::Acquire { .. }
                | Route::Dequeue
                | Route::Reassign
                | Route::Release
                | Route::ReleaseBatch
                | Route::Renew
                | Route::PrefillDone
        )
    }

    /// The full internal URL of the call.
    pub fn url(&self) -> String {
        format!("{INTERNAL_ORIGIN}{}", self.path())
    }

    /// Parses a method and an absolute URL (as [`Route::url`] builds them) into a route. The URL
    /// is split by hand, not parsed with the `url` crate: that cost about 30 us of wasm per call,
    /// a tenth of a cheap call's whole cost, and internal URLs are already in normal form.
    pub fn parse_url(method: &str, url: &str) -> Result<Route, RouteError> {
        let (path, query) = path_and_query(url);
        Route::parse(method, path, query)
    }

    /// Parses a method, a path and a query string (without `?`) into a route.
    pub fn parse(method: &str, path: &str, query: Option<&str>) -> Result<Route, RouteError> {
        use HttpMethod::*;
        let flag = |name: &str| {
            query
                .unwrap_or("")
                .split('&')
                .any(|pair| pair.split_once('=') == Some((name, "true")))
        };
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let method = HttpMethod::parse(method).ok_or(RouteError::MethodNotAllowed)?;
        let owned = |s: &str| s.to_string();
        let route = match (segments.as_slice(), method) {
            (["acquire"], Post) => Route::Acquire {
                spill_ok: flag("spill_ok"),
            },
            (["dequeue"], Post) => Route::Dequeue,
            (["reassign"], Post) => Route::Reassign,
            (["release"], Post) => Route::Release,
            (["release_batch"], Post) => Route::ReleaseBatch,
            (["renew"], Post) => Route::Renew,
            (["prefill_done"], Post) => Route::PrefillDone,
            (["responses", "holder"], Post) => Route::ResponseHolder,
            (["backends"], Post) => Route::RegisterBackend,
            (["backends"], Get) => Route::ListBackends,
            (["backends", id], Get) => Route::ShowBackend(owned(id)),
            (["backends", id], Patch) => Route::PatchBackend(owned(id)),
            (["backends", id], Delete) => Route::DeleteBackend {
                id: owned(id),
                force: flag("force"),
            },
            (["models"], Get) => Route::Models,
            (["config"], Get) => Route::GetConfig,
            (["config"], Put) => Route::PutConfig,
            (["state"], Get) => Route::Summary,
            (["metrics"], Get) => Route::Metrics,
            (["history"], Get) => Route::History,
            (["probe", "ensure"], Post) => Route::EnsureProbeAlarm,
            (["probe", "now"], Post) => Route::ProbeNow,
            (["shard", "load"], Post) => Route::ShardLoad,
            (["shard", "probes"], Post) => Route::ShardProbes,
            (["shard", "registry"], Post) => Route::ShardRegistry,
            (["pools"], Get) => Route::ListPools,
            (["pools", name], Put) => Route::PutPool(owned(name)),
            (["pools", name, "card"], Put) => Route::PutCard(owned(name)),
            (["keys"], Get) => Route::ListKeys,
            (["keys"], Post) => Route::AddKey,
            (["keys", id], Patch) => Route::PatchKey(owned(id)),
            (["keys", id], Delete) => Route::DeleteKey(owned(id)),
            (["take"], Post) => Route::TakeTokens,
            (["settle"], Post) => Route::SettleTokens,
            (
                ["acquire" | "dequeue" | "reassign" | "release" | "renew" | "prefill_done"]
                | ["backends"]
                | ["backends", _]
                | ["models" | "config" | "state" | "metrics" | "history" | "pools" | "keys"]
                | ["probe", "ensure" | "now"]
                | ["shard", "load" | "probes" | "registry"]
                | ["pools", _]
                | ["pools", _, "card"]
                | ["keys", _]
                | ["take" | "settle"],
                _,
            ) => return Err(RouteError::MethodNotAllowed),
            _ => return Err(RouteError::NotFound),
        };
        Ok(route)
    }
}

/// The path (at least `/`) and the query of an absolute URL, without its fragment.
pub fn path_and_query(url: &str) -> (&str, Option<&str>) {
    let url = url.split_once('#').map_or(url, |(before, _)| before);
    let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = match after_scheme.find(['/', '?']) {
        Some(i) => &after_scheme[i..],
        None => "",
    };
    let (path, query) = match rest.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (rest, None),
    };
    (if path.is_empty() { "/" } else { path }, query)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_route() -> Vec<Route> {
        let id = || "b-1".to_string();
        vec![
            Route::Acquire { spill_ok: true },
            Route::Acquire { spill_ok: false },
            Route::Dequeue,
            Route::Reassign,
            Route::Release,
            Route::ReleaseBatch,
            Route::Renew,
            Route::PrefillDone,
            Route::ResponseHolder,
            Route::RegisterBackend,
            Route::ListBackends,
            Route::ShowBackend(id()),
            Route::PatchBackend(id()),
            Route::DeleteBackend {
                id: id(),
                force: true,
            },
            Route::DeleteBackend {
                id: id(),
                force: false,
            },
            Route::Models,
            Route::GetConfig,
            Route::PutConfig,
            Route::Summary,
            Route::Metrics,
            Route::History,
            Route::EnsureProbeAlarm,
            Route::ProbeNow,
            Route::ShardLoad,
            Route::ShardProbes,
            Route::ShardRegistry,
            Route::ListPools,
            Route::PutPool("eu".into()),
            Route::PutCard("eu".into()),
            Route::ListKeys,
            Route::AddKey,
            Route::PatchKey("key-1".into()),
            Route::DeleteKey("key-1".into()),
            Route::TakeTokens,
            Route::SettleTokens,
        ]
    }

    #[test]
    fn every_route_parses_back_from_the_url_it_builds() {
        for route in every_route() {
            let url = route.url();
            let parsed = Route::parse_url(route.method().as_str(), &url);
            assert_eq!(parsed, Ok(route.clone()), "{url}");
            assert!(url.starts_with(INTERNAL_ORIGIN));
        }
    }

    #[test]
    fn urls_split_like_a_url_parser() {
        for (raw, want) in [
            (
                "https://pool/acquire?spill_ok=true",
                ("/acquire", Some("spill_ok=true")),
            ),
            ("https://pool/backends/gpu-1", ("/backends/gpu-1", None)),
            ("https://pool", ("/", None)),
            ("https://pool?x=1", ("/", Some("x=1"))),
            (
                "https://pool:8443/a/b?c=d&e=f#frag",
                ("/a/b", Some("c=d&e=f")),
            ),
            ("http://127.0.0.1/release", ("/release", None)),
        ] {
            // `want` is what the `url` crate's `path()` and `query()` give for `raw`.
            assert_eq!(path_and_query(raw), want, "{raw}");
        }
    }

    #[test]
    fn unknown_paths_and_wrong_methods_are_told_apart() {
        assert_eq!(
            Route::parse("GET", "/nope", None),
            Err(RouteError::NotFound)
        );
        assert_eq!(
            Route::parse("GET", "/acquire", None),
            Err(RouteError::MethodNotAllowed)
        );
        assert_eq!(
            Route::parse("POST", "/backends/b-1", None),
            Err(RouteError::MethodNotAllowed)
        );
        // The directory no longer forgets pools.
        assert_eq!(
            Route::parse("DELETE", "/pools/eu", None),
            Err(RouteError::MethodNotAllowed)
        );
        assert_eq!(
            Route::parse("OPTIONS", "/acquire", None),
            Err(RouteError::MethodNotAllowed)
        );
    }

    #[test]
    fn flags_count_only_when_true() {
        assert_eq!(
            Route::parse("POST", "/acquire", Some("spill_ok=false")),
            Ok(Route::Acquire { spill_ok: false })
        );
        assert_eq!(
            Route::parse("DELETE", "/backends/x", Some("a=b&force=true")),
            Ok(Route::DeleteBackend {
                id: "x".into(),
                force: true
            })
        );
    }

    #[test]
    fn each_object_serves_its_own_routes() {
        assert_eq!(Route::ListPools.object(), Object::Directory);
        assert_eq!(Route::TakeTokens.object(), Object::ClientRateLimiter);
        assert_eq!(Route::Acquire { spill_ok: false }.object(), Object::Pool);
        assert_eq!(Route::ShardLoad.object(), Object::Pool);
    }
}
