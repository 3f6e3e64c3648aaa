//! The isolate's memory: every `thread_local!` the Worker keeps between requests, declared here
//! and nowhere else, each with what it caches, its bound and who reads and writes it. An isolate
//! serves many requests one after another (and interleaved at their awaits); none of this belongs
//! to a request, all of it may be lost whenever the platform starts a new isolate, and every
//! reader copes with it being empty. The files that own the rules keep them: they reach the
//! statics only through the small accessors below (`with_*` hands the static's cell to a closure,
//! as `LocalKey::with` does).
//!
//! Also the cache shapes only these statics hold ([`CacheSlot`] with [`stale_while_revalidate`],
//! [`ReleaseQueue`], [`InFlightRequest`]).
//!
//! One lookup is left where it is used: `platform/http.rs` keeps the global `crypto` object it
//! looks up once per isolate beside `random_hex`, because this module reads the settings'
//! types, and the settings read `http.rs`'s helpers (keeping it here would be an import circle).

use crate::platform::settings::{RegionSettings, Settings, DEFAULT_RELAY_BUFFER_BYTES};
use coordinator_protocol::messages::{PoolEntry, ReleaseRequest, StoredKey};
use coordinator_protocol::ApiError;
use routing_core::pool::guess::GuessBook;
use routing_core::region::{HomePools, NetworkModel, TimeCard};
use routing_core::request::rate_limit::LimitAheadBook;
use std::cell::{Cell, OnceCell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::thread::LocalKey;
use std::time::Duration;
use wasm_bindgen::closure::Closure;
use wasm_bindgen::JsValue;
use worker::worker_sys::DurableObjectNamespace;
use worker::{Context, Env};

thread_local! {
    // ---- platform/settings.rs: the settings ----

    /// The Worker's settings, read from the environment by the first request that needs them
    /// (an isolate's bindings do not change while it lives). One value, never refreshed.
    /// Written by [`settings`]; read by every stage of the request path, and by the relay
    /// through [`slow_client_timeout`] and [`relay_buffer_bytes`].
    static SETTINGS: OnceCell<Rc<Settings>> = const { OnceCell::new() };

    // ---- platform/do_client.rs: the Durable Objects' addresses and the pool list ----

    /// The Durable Object namespaces, by binding: one per binding (three). Written and read by
    /// `do_client::stub`.
    static NAMESPACES: RefCell<HashMap<&'static str, DurableObjectNamespace>> =
        RefCell::new(HashMap::new());
    /// The ids of the objects this isolate called, by binding and name (a hash of the name each):
    /// at most `do_client::MAX_CACHED_IDS`, then the map starts again. Written and read by
    /// `do_client::stub`.
    static OBJECT_IDS: RefCell<HashMap<(&'static str, String), JsValue>> =
        RefCell::new(HashMap::new());
    /// The directory's pool list: trusted for `do_client::POOL_CACHE_MS` (2 s), then served
    /// stale while one background refresh runs. Written by `do_client` (`list_pools`,
    /// `list_pools_cached`, cleared when the admin API changes a pool in this isolate); read by
    /// the plan (`regions::plan` through `list_pools_cached`) and the pool stubs' location hints.
    static POOLS: RefCell<CacheSlot<Vec<PoolEntry>>> = const { RefCell::new(CacheSlot::new()) };

    // ---- clients/keys.rs: minted client keys ----

    /// The hashes of the minted client keys: trusted for `keys::CACHE_MS` (5 s), then served
    /// stale while one background refresh runs; cleared when the admin API changes a key in
    /// this isolate. Written and read by `clients/keys.rs`.
    static MINTED: RefCell<CacheSlot<Vec<StoredKey>>> = const { RefCell::new(CacheSlot::new()) };
    /// When the directory last answered with the minted keys (ms since the epoch; one value).
    /// Written and read by `clients/keys.rs`.
    static MINTED_READ_MS: Cell<u64> = const { Cell::new(0) };

    // ---- clients/reserving.rs: the clients' rate limits as this isolate knows them ----

    /// Clients the limiter refused, with when (ms since the epoch) they may be asked beside the
    /// lease call again: at most `reserving::MAX_REFUSED` (4,096), then the map starts again.
    /// Written and read by `clients/reserving.rs`.
    static REFUSED_CLIENTS: RefCell<HashMap<String, u64>> = RefCell::new(HashMap::new());
    /// What this isolate knows of its clients' buckets, from the limiter's answers
    /// (`RATE_LIMIT_AHEAD` and the `x-ratelimit-*` headers): at most 4,096 clients (the book's
    /// own bound). Written and read by `clients/reserving.rs`.
    static LIMIT_AHEAD_BOOK: RefCell<LimitAheadBook> = RefCell::new(LimitAheadBook::new());

    // ---- request/admission.rs: the tenants of keyless clients ----

    /// The salt of keyless tenants' address hashes: `TENANT_SALT`, else random per isolate. One
    /// value, read once. Written and read by `admission::tenant_salt`.
    static TENANT_SALT: OnceCell<Rc<str>> = const { OnceCell::new() };

    // ---- request/regions.rs: the plan's view of the pools and the network ----

    /// The pool choice's settings (`TIME_ROUTING`, `POOL_CHOICE_MARGIN_*`, `HOME_POOLS_MAX`,
    /// `SIMULATE_*`), read once. Written and read by `regions.rs`.
    static REGION_SETTINGS: OnceCell<RegionSettings> = const { OnceCell::new() };
    /// The round-trip model (`REGION_RTT_MS`, refined by lease calls' round trips): measurements
    /// of at most `routing_core::region::network::MAX_POOLS` (64) pools, 16 each. Written and read by
    /// `regions.rs` (the plan, `observe_rtt` after a grant).
    static NETWORK: OnceCell<RefCell<NetworkModel>> = const { OnceCell::new() };
    /// Conversations' home pools: at most `HOME_POOLS_MAX` (8,192 unless set). Written by
    /// `regions.rs` when a request is sent or a home recorded; read by the plan.
    static HOMES: OnceCell<RefCell<HomePools>> = const { OnceCell::new() };
    /// Per pool, the requests this isolate sent it that have not ended: at most
    /// `regions::SENT_KEPT` (512) a pool; those older than the pool's card are counted in it and
    /// dropped. Written by `regions::served` and `regions::finished` (a lease's end); read by the
    /// plan.
    static IN_FLIGHT: RefCell<HashMap<String, VecDeque<InFlightRequest>>> =
        RefCell::new(HashMap::new());
    /// The newest time card a grant (or the answer to an overdue stream's renewal) brought from
    /// each pool (fresher than the pool list's copy for the pools this isolate sends to): one per
    /// pool. Written by `regions::fresh_card`; read by the plan.
    static GRANT_CARDS: RefCell<HashMap<String, TimeCard>> = RefCell::new(HashMap::new());

    // ---- request/ahead.rs: ROUTE_AHEAD's guesses ----

    /// This isolate's record of its pool shards' choices (`ROUTE_AHEAD`): at most
    /// `routing_core::pool::guess::MAX_SHARDS` (64) places, `MAX_PREFIXES` (1,024) prefix entries
    /// each (the book's own bounds). Written and read by `ahead.rs`.
    static GUESS_BOOK: RefCell<GuessBook> = RefCell::new(GuessBook::new());

    // ---- request/forward/attempts.rs ----

    /// A rejection handler that does nothing, made once (see `attempts::send`). Read only.
    static IGNORE_REJECTION: Closure<dyn FnMut(JsValue)> = Closure::new(|_: JsValue| {});

    // ---- request/lease/releases.rs: lease releases batched per pool shard ----

    /// Per pool shard, the releases waiting for the sender in flight: one entry per shard this
    /// isolate released to; a queue is emptied by each call of its sender. Written and read by
    /// `releases.rs`.
    static RELEASE_QUEUES: RefCell<HashMap<(String, u32), ReleaseQueue>> =
        RefCell::new(HashMap::new());
    /// The last release sender's id (one counter). Written and read by `releases.rs`.
    static NEXT_SENDER: Cell<u64> = const { Cell::new(0) };
    /// `GET /v1/models`' last complete list and when it was built: one list, kept
    /// `MODELS_CACHE_MS` (3 s). Written and read by `operator/models.rs`; the admin API forgets it
    /// after every change.
    static MODEL_LIST: RefCell<Option<(u64, serde_json::Value)>> = const { RefCell::new(None) };
}

// ---- accessors, in the order above ----

/// This isolate's settings, read from `env` on first use.
pub fn settings(env: &Env) -> Rc<Settings> {
    SETTINGS.with(|s| s.get_or_init(|| Rc::new(Settings::read(env))).clone())
}

/// `SLOW_CLIENT_TIMEOUT_MS` as this isolate read it (the default before any request read the
/// settings), for the relay, which has no `Env`.
pub fn slow_client_timeout() -> Duration {
    let ms = SETTINGS.with(|s| s.get().map(|s| s.slow_client_timeout_ms));
    Duration::from_millis(ms.unwrap_or(30_000))
}

/// `RELAY_BUFFER_BYTES` as this isolate read it (the default before any request read the
/// settings), for the relay, which has no `Env`.
pub fn relay_buffer_bytes() -> u64 {
    SETTINGS
        .with(|s| s.get().map(|s| s.relay_buffer_bytes))
        .unwrap_or(DEFAULT_RELAY_BUFFER_BYTES)
}

/// The Durable Object namespaces, by binding.
pub(crate) fn with_namespaces<R>(
    f: impl FnOnce(&RefCell<HashMap<&'static str, DurableObjectNamespace>>) -> R,
) -> R {
    NAMESPACES.with(f)
}

/// The ids of the objects this isolate called.
pub(crate) fn with_object_ids<R>(
    f: impl FnOnce(&RefCell<HashMap<(&'static str, String), JsValue>>) -> R,
) -> R {
    OBJECT_IDS.with(f)
}

/// The directory's pool list, as a [`CacheSlot`] for [`stale_while_revalidate`].
pub(crate) fn pool_list() -> &'static LocalKey<RefCell<CacheSlot<Vec<PoolEntry>>>> {
    &POOLS
}

/// The minted client keys, as a [`CacheSlot`] for [`stale_while_revalidate`].
pub(crate) fn minted_keys() -> &'static LocalKey<RefCell<CacheSlot<Vec<StoredKey>>>> {
    &MINTED
}

/// When the directory last answered with the minted keys.
pub(crate) fn minted_read_ms() -> &'static LocalKey<Cell<u64>> {
    &MINTED_READ_MS
}

/// The clients the limiter refused, and when they may be asked beside again.
pub(crate) fn with_refused_clients<R>(f: impl FnOnce(&RefCell<HashMap<String, u64>>) -> R) -> R {
    REFUSED_CLIENTS.with(f)
}

/// This isolate's view of its clients' buckets.
pub(crate) fn with_limit_ahead_book<R>(f: impl FnOnce(&RefCell<LimitAheadBook>) -> R) -> R {
    LIMIT_AHEAD_BOOK.with(f)
}

/// The keyless tenants' salt, once read.
pub(crate) fn with_tenant_salt<R>(f: impl FnOnce(&OnceCell<Rc<str>>) -> R) -> R {
    TENANT_SALT.with(f)
}

/// The pool choice's settings, once read.
pub(crate) fn with_region_settings<R>(f: impl FnOnce(&OnceCell<RegionSettings>) -> R) -> R {
    REGION_SETTINGS.with(f)
}

/// The round-trip model, once made.
pub(crate) fn with_network<R>(f: impl FnOnce(&OnceCell<RefCell<NetworkModel>>) -> R) -> R {
    NETWORK.with(f)
}

/// The conversations' home pools, once made.
pub(crate) fn with_homes<R>(f: impl FnOnce(&OnceCell<RefCell<HomePools>>) -> R) -> R {
    HOMES.with(f)
}

/// Per pool, the requests sent it that have not ended.
pub(crate) fn with_in_flight<R>(
    f: impl FnOnce(&RefCell<HashMap<String, VecDeque<InFlightRequest>>>) -> R,
) -> R {
    IN_FLIGHT.with(f)
}

/// The newest time card a grant brought from each pool.
pub(crate) fn with_grant_cards<R>(f: impl FnOnce(&RefCell<HashMap<String, TimeCard>>) -> R) -> R {
    GRANT_CARDS.with(f)
}

/// The record of the pool shards' choices (`ROUTE_AHEAD`).
pub(crate) fn with_guess_book<R>(f: impl FnOnce(&RefCell<GuessBook>) -> R) -> R {
    GUESS_BOOK.with(f)
}

/// The rejection handler that does nothing.
pub(crate) fn with_ignore_rejection<R>(f: impl FnOnce(&Closure<dyn FnMut(JsValue)>) -> R) -> R {
    IGNORE_REJECTION.with(f)
}

/// Per pool shard, the releases waiting for the sender in flight.
pub(crate) fn with_release_queues<R>(
    f: impl FnOnce(&RefCell<HashMap<(String, u32), ReleaseQueue>>) -> R,
) -> R {
    RELEASE_QUEUES.with(f)
}

/// The next release sender's id.
pub(crate) fn next_sender_id() -> u64 {
    NEXT_SENDER.with(|n| {
        n.set(n.get() + 1);
        n.get()
    })
}

/// `GET /v1/models`' list, kept a few seconds.
pub(crate) fn with_model_list<R>(
    f: impl FnOnce(&RefCell<Option<(u64, serde_json::Value)>>) -> R,
) -> R {
    MODEL_LIST.with(f)
}

// ---- the cache shapes ----

/// A value an isolate keeps from the directory (the pool list, minted key hashes).
pub struct CacheSlot<T> {
    /// The value, and when it was read (ms since the epoch).
    pub(crate) value: Option<(u64, T)>,
    /// When the background refresh in flight started.
    refreshing_since: Option<u64>,
}

impl<T> CacheSlot<T> {
    /// An empty slot.
    pub const fn new() -> Self {
        CacheSlot {
            value: None,
            refreshing_since: None,
        }
    }

    /// Forgets the value (this isolate just changed it).
    pub fn clear(&mut self) {
        self.value = None;
    }
}

/// A background refresh that has run this long is presumed lost and may be started again.
const REFRESH_GIVE_UP_MS: u64 = 10_000;

/// Serves `slot`'s value: fresh for `fresh_ms`; after that the old copy is still served at once
/// while one refresh runs in the background (`ctx.wait_until`), and a failed refresh keeps it.
/// The directory is on the request path only while the isolate has no copy at all.
pub async fn stale_while_revalidate<T, F, Fut>(
    slot: &'static LocalKey<RefCell<CacheSlot<T>>>,
    fresh_ms: u64,
    ctx: &Context,
    fetch: F,
) -> Result<T, ApiError>
where
    T: Clone + 'static,
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<T, ApiError>> + 'static,
{
    let now = js_sys::Date::now() as u64;
    let (value, refreshing_since) = slot.with(|s| {
        let s = s.borrow();
        (s.value.clone(), s.refreshing_since)
    });
    match value {
        Some((at, v)) if now < at + fresh_ms => Ok(v),
        Some((_, v)) => {
            if refreshing_since.is_none_or(|t| now > t + REFRESH_GIVE_UP_MS) {
                slot.with(|s| s.borrow_mut().refreshing_since = Some(now));
                let refresh = fetch();
                ctx.wait_until(async move {
                    let result = refresh.await;
                    slot.with(|s| {
                        let mut s = s.borrow_mut();
                        s.refreshing_since = None;
                        match result {
                            Ok(v) => s.value = Some((js_sys::Date::now() as u64, v)),
                            Err(e) => worker::console_error!(
                                "directory refresh failed; serving the cached copy: {e}"
                            ),
                        }
                    });
                });
            }
            Ok(v)
        }
        None => {
            let v = fetch().await?;
            slot.with(|s| s.borrow_mut().value = Some((now, v.clone())));
            Ok(v)
        }
    }
}

/// The releases of one pool shard waiting for the sender in flight (`releases.rs`).
#[derive(Default)]
pub(crate) struct ReleaseQueue {
    /// The sender in flight: its id and when it started.
    pub(crate) sender: Option<(u64, u64)>,
    pub(crate) queued: Vec<ReleaseRequest>,
}

/// One request this isolate sent a pool that has not ended: when, its lease, and the output
/// tokens it asked for (`regions.rs`).
#[derive(Clone, Copy)]
pub(crate) struct InFlightRequest {
    pub(crate) at_ms: u64,
    pub(crate) lease: u64,
    pub(crate) tokens: u32,
}
