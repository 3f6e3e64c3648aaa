//! Client API keys: who may call the OpenAI surface.
//!
//! Keys come from two places: the `CLIENT_API_KEYS` secret (comma-separated, for a fixed set) and
//! keys minted through the admin API, of which only a SHA-256 hash is stored (in the pool
//! directory). The OpenAI surface is open only while neither holds a key, no key was ever minted
//! (the directory then lists a seal, an entry with no hash, once the last minted key is deleted)
//! and `REQUIRE_CLIENT_KEYS` is off: local development. A presented key is hashed and compared
//! against every known hash in constant time. The set of minted keys (hashes, ids and admission
//! priorities) is cached in the isolate and refreshed in the background every few seconds; while
//! the directory cannot be read the cached set is served for at most `KEY_LIST_MAX_STALE_MS`,
//! after which keyed requests get a 503 (a revoked key must not keep working indefinitely). Rate
//! limits charge an estimate when a request is admitted and settle it with the tokens the request
//! really used when it ends.

use crate::platform::auth::{client_key, constant_time_eq, hash_key};
use crate::platform::do_client::{call, To};
use crate::platform::isolate::{self, stale_while_revalidate};
use coordinator_protocol::call::ListKeys;
use coordinator_protocol::messages::{SettleRequest, StoredKey, TakeRequest};
use coordinator_protocol::ApiError;
use routing_core::request::rate_limit::{Left, RateLimits};
use worker::{Context, Env, Request};

/// How long minted-key hashes are cached in an isolate.
const CACHE_MS: u64 = 5_000;

/// Forgets the cached minted keys (after the admin API changed them in this isolate).
pub fn invalidate() {
    isolate::minted_keys().with(|m| m.borrow_mut().clear());
}

async fn fetch_minted(env: Env) -> Result<Vec<StoredKey>, ApiError> {
    let keys = call(&env, To::Directory, &ListKeys).await?;
    isolate::minted_read_ms().with(|t| t.set(crate::platform::http::now_ms()));
    Ok(keys)
}

/// The answer when the minted keys cannot be read: the key cannot be checked, so the request is
/// refused (never let through), and told to come back.
fn key_list_unavailable(e: ApiError) -> ApiError {
    worker::console_error!("reading the minted keys failed: {e}");
    ApiError::unavailable(
        "API keys cannot be checked right now (the key directory is unreachable); retry shortly.",
        5,
    )
    .with_code("key_list_unavailable")
}

/// Whether a listed key is the directory's seal (keys were minted once; none is left): it has no
/// hash, so no presented key matches it, and it keeps the surface closed.
pub fn is_seal(key: &StoredKey) -> bool {
    key.hash.is_empty()
}

/// Whether the cached list of minted keys, last read at `read_ms`, is too old to check keys
/// against at `now_ms`.
fn too_stale(read_ms: u64, now_ms: u64, max_stale_ms: u64) -> bool {
    read_ms > 0 && now_ms.saturating_sub(read_ms) > max_stale_ms
}

async fn minted_keys(env: &Env, ctx: &Context) -> Result<Vec<StoredKey>, ApiError> {
    let env = env.clone();
    stale_while_revalidate(isolate::minted_keys(), CACHE_MS, ctx, move || {
        fetch_minted(env)
    })
    .await
}

/// A client key that passed the check: who the client is, for rate limits and admission control.
#[derive(Debug, Clone)]
pub struct ClientKey {
    /// Hex SHA-256 of the key (the rate limiter's identity).
    pub hash: String,
    /// The tenant: a minted key's id, or `env-` and the start of the hash of a `CLIENT_API_KEYS` key.
    pub tenant: String,
    /// The admission priority configured for the key (0 for `CLIENT_API_KEYS` keys).
    pub priority: i32,
    /// The jurisdictions its requests may be served in (empty: anywhere the pools allow; always
    /// empty for `CLIENT_API_KEYS` keys).
    pub residency: Vec<String>,
}

/// Checks the client's bearer key when keys are configured; returns who it is, or `None` when the
/// surface is open.
pub async fn identify(
    req: &Request,
    env: &Env,
    ctx: &Context,
) -> Result<Option<ClientKey>, ApiError> {
    let settings = isolate::settings(env);
    let configured = &settings.client_key_hashes;
    let mut minted = minted_keys(env, ctx).await.map_err(key_list_unavailable)?;
    let read_ms = isolate::minted_read_ms().with(|t| t.get());
    if too_stale(
        read_ms,
        crate::platform::http::now_ms(),
        settings.key_list_max_stale_ms,
    ) {
        // The copy is older than the bound (the isolate was idle, or the background refreshes
        // fail): read the directory now, and refuse rather than trust the old copy if it fails.
        invalidate();
        minted = minted_keys(env, ctx).await.map_err(key_list_unavailable)?;
    }
    if !settings.require_client_keys && configured.is_empty() && minted.is_empty() {
        return Ok(None);
    }
    let Some(given) = client_key(req) else {
        return Err(ApiError::unauthorized(
            "Missing API key: send Authorization: Bearer <key> (or x-api-key: <key>).",
        ));
    };
    let given = hash_key(&given);
    // Every hash is compared, so the time taken does not tell which one matched.
    let mut found = None;
    for h in configured {
        if constant_time_eq(given.as_bytes(), h.as_bytes()) {
            found = Some(ClientKey {
                hash: given.clone(),
                tenant: format!("env-{}", &h[..12]),
                priority: 0,
                residency: Vec::new(),
            });
        }
    }
    for k in minted.iter().filter(|k| !is_seal(k)) {
        if constant_time_eq(given.as_bytes(), k.hash.as_bytes()) {
            found = Some(ClientKey {
                hash: given.clone(),
                tenant: k.id.clone(),
                priority: k.priority,
                residency: k.residency.clone(),
            });
        }
    }
    found
        .map(Some)
        .ok_or_else(|| ApiError::unauthorized("Invalid API key."))
}

/// Checks the client's bearer key when keys are configured; returns the key's hash (the client's
/// identity for rate limiting), or `None` when the surface is open.
pub async fn require_client(
    req: &Request,
    env: &Env,
    ctx: &Context,
) -> Result<Option<String>, ApiError> {
    Ok(identify(req, env, ctx).await?.map(|k| k.hash))
}

/// Tokens charged to a client at admission, to settle when the request ends (while the
/// limiter's answer is on its way, `clients/reserving.rs` holds it as a `PendingReservation`).
/// Serialisable: the regional hop (`src/request/hop.rs`) hands it to the Worker that settles it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Reservation {
    client: String,
    limits: RateLimits,
    /// The estimate charged.
    pub tokens: u64,
    /// The charge on its way, for a request served ahead of its answer (resolving to whether it
    /// landed): a settlement waits for it, so the limiter sees the charge first.
    #[serde(skip)]
    pub charging: Option<js_sys::Promise>,
}

/// The rate limits, when any is configured (`RATE_LIMIT_RPM` or `RATE_LIMIT_TPM` set above 0).
pub fn configured_limits(env: &Env) -> Option<RateLimits> {
    let limits = isolate::settings(env).rate_limits;
    (limits != RateLimits::default()).then_some(limits)
}

/// Charges a request to its client's rate `limits` (the edge's decision: its `RATE_LIMIT_RPM`,
/// `RATE_LIMIT_TPM`; 0 means unlimited) with an estimate of its tokens. `client` is the key hash
/// from [`require_client`]. Returns the reservation to [`settle`] when a token limit applies.
pub async fn reserve(
    env: &Env,
    client: &str,
    limits: RateLimits,
    estimate: u64,
) -> Result<(Option<Reservation>, Left), ApiError> {
    let left = take(env, client, limits, estimate, false).await?;
    Ok((reservation(client, limits, estimate), left))
}

/// One `take` call to `client`'s limiter: what is left after it, or the refusal.
async fn take(
    env: &Env,
    client: &str,
    limits: RateLimits,
    tokens: u64,
    force: bool,
) -> Result<Left, ApiError> {
    let body = TakeRequest {
        limits,
        tokens,
        force,
    };
    Ok(call(env, To::Limiter(client), &body).await?.left)
}

/// What a request charged `estimate` settles when it ends (nothing without a token limit).
pub fn reservation(client: &str, limits: RateLimits, estimate: u64) -> Option<Reservation> {
    (limits.tokens_per_minute > 0).then(|| Reservation {
        client: client.to_string(),
        limits,
        tokens: estimate,
        charging: None,
    })
}

/// Charges a request the limiter refused after it was served ahead of the answer: whatever the
/// buckets hold, so the client's next requests wait for the debt.
pub async fn force_charge(
    env: &Env,
    client: &str,
    limits: RateLimits,
    estimate: u64,
) -> Result<(), ApiError> {
    take(env, client, limits, estimate, true).await.map(drop)
}

/// Settles a reservation with the tokens the request really used (the backend's usage); failures
/// are logged: the estimate stands.
pub async fn settle(env: &Env, reservation: &Reservation, actual: u64) {
    // A request served ahead of its charge: settled after the charge, and, if the charge never
    // landed (the limiter failed), charged what it used with nothing to refund.
    let reserved = match &reservation.charging {
        Some(charging) => match wasm_bindgen_futures::JsFuture::from(charging.clone()).await {
            Ok(landed) if landed.as_bool() == Some(false) => 0,
            _ => reservation.tokens,
        },
        None => reservation.tokens,
    };
    if actual == reserved {
        return;
    }
    let body = SettleRequest {
        limits: reservation.limits,
        reserved,
        actual,
    };
    if let Err(e) = call(env, To::Limiter(&reservation.client), &body).await {
        worker::console_error!("settling a client's token reservation failed: {e}");
    }
}
