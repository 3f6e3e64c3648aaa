//! Client API keys: who may call the OpenAI surface.
//!
//! Keys come from two places: the `CLIENT_API_KEYS` secret (comma-separated, for a fixed set) and
//! keys minted through the admin API, of which only a SHA-256 hash is stored (in the pool
//! directory). When neither holds a key, the OpenAI surface is open (local development). A
//! presented key is hashed and compared against every known hash in constant time. The set of
//! minted-key hashes is cached in the isolate for a few seconds.

use crate::auth::{bearer, constant_time_eq, secret};
use crate::ApiError;
use gateway_durable_objects::directory::StoredKey;
use routing_core::rate_limit::RateLimits;
use sha2::{Digest, Sha256};
use std::cell::RefCell;
use worker::{Date, Env, Request};

/// How long minted-key hashes are cached in an isolate.
const CACHE_MS: u64 = 5_000;

thread_local! {
    static MINTED: RefCell<Option<(u64, Vec<String>)>> = const { RefCell::new(None) };
}

/// Hex SHA-256 of a key.
pub fn hash_key(key: &str) -> String {
    Sha256::digest(key.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Forgets the cached minted keys (after the admin API changed them in this isolate).
pub fn invalidate() {
    MINTED.with(|m| *m.borrow_mut() = None);
}

async fn minted_hashes(env: &Env) -> Result<Vec<String>, ApiError> {
    let now = Date::now().as_millis();
    if let Some(hashes) = MINTED.with(|m| m.borrow().as_ref().filter(|(at, _)| now < at + CACHE_MS).map(|(_, h)| h.clone())) {
        return Ok(hashes);
    }
    let keys: Vec<StoredKey> = crate::pools::directory_json(env, worker::Method::Get, "/keys", None::<&()>).await?;
    let hashes: Vec<String> = keys.into_iter().map(|k| k.hash).collect();
    MINTED.with(|m| *m.borrow_mut() = Some((now, hashes.clone())));
    Ok(hashes)
}

/// Checks the client's bearer key when keys are configured; returns the key's hash (the client's
/// identity for rate limiting), or `None` when the surface is open.
pub async fn require_client(req: &Request, env: &Env) -> Result<Option<String>, ApiError> {
    let mut hashes: Vec<String> = secret(env, "CLIENT_API_KEYS")
        .map(|s| s.split(',').map(str::trim).filter(|k| !k.is_empty()).map(hash_key).collect())
        .unwrap_or_default();
    hashes.extend(minted_hashes(env).await?);
    if hashes.is_empty() {
        return Ok(None);
    }
    let Some(given) = bearer(req) else {
        return Err(ApiError::unauthorized("Missing API key: send Authorization: Bearer <key>."));
    };
    let given = hash_key(&given);
    let mut ok = false;
    for h in &hashes {
        ok |= constant_time_eq(given.as_bytes(), h.as_bytes());
    }
    if ok {
        Ok(Some(given))
    } else {
        Err(ApiError::unauthorized("Invalid API key."))
    }
}

/// Charges a request to its client's rate limits (`RATE_LIMIT_RPM`, `RATE_LIMIT_TPM`; 0 or unset
/// means unlimited). `client` is the key hash from [`require_client`].
pub async fn charge(env: &Env, client: &str, tokens: u64) -> Result<(), ApiError> {
    let var = |name: &str| crate::var_or(env, name, 0u64);
    let limits = RateLimits { requests_per_minute: var("RATE_LIMIT_RPM"), tokens_per_minute: var("RATE_LIMIT_TPM") };
    if limits == RateLimits::default() {
        return Ok(());
    }
    crate::pools::rate_limit(env, client, &serde_json::json!({ "limits": limits, "tokens": tokens })).await
}
