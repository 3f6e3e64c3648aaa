//! Bearer-token checks for the admin API, the metrics endpoint and clients, and the hash a client
//! key is known by.
//!
//! Tokens are compared in constant time (independent of where the first difference is, and of the
//! length of the guess), so response timing reveals nothing about a secret. Client keys are only
//! ever stored, cached and compared as their SHA-256 hashes ([`hash_key`]).

use crate::platform::http::hex;
use coordinator_protocol::ApiError;
use sha2::{Digest, Sha256};
use worker::{Env, Request};

/// Hex SHA-256 of a key.
pub fn hash_key(key: &str) -> String {
    hex(&Sha256::digest(key.as_bytes()))
}

/// Reads a secret (production: `wrangler secret put`; locally: `.dev.vars`), falling back to a var.
pub fn secret(env: &Env, name: &str) -> Option<String> {
    env.secret(name)
        .map(|s| s.to_string())
        .or_else(|_| env.var(name).map(|v| v.to_string()))
        .ok()
        .filter(|s| !s.is_empty())
}

/// The token in `Authorization: Bearer <token>`, if any.
pub fn bearer(req: &Request) -> Option<String> {
    let value = req.headers().get("authorization").ok().flatten()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim().to_string())
}

/// The client's key: `Authorization: Bearer <key>`, else `x-api-key: <key>` (Anthropic's SDKs
/// send their key that way).
pub fn client_key(req: &Request) -> Option<String> {
    bearer(req).or_else(|| {
        req.headers()
            .get("x-api-key")
            .ok()
            .flatten()
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
    })
}

/// Compares two byte strings in time that depends only on the length of `expected`.
pub fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = (given.len() != expected.len()) as u8;
    for (i, e) in expected.iter().enumerate() {
        diff |= e ^ given.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// Requires the admin token; an unset `ADMIN_TOKEN` locks the admin API rather than opening it.
pub fn require_admin(req: &Request, env: &Env) -> Result<(), ApiError> {
    let Some(expected) = secret(env, "ADMIN_TOKEN") else {
        return Err(ApiError::unauthorized(
            "The admin API is disabled: ADMIN_TOKEN is not set.",
        ));
    };
    match bearer(req) {
        Some(given) if constant_time_eq(given.as_bytes(), expected.as_bytes()) => Ok(()),
        Some(_) => Err(ApiError::unauthorized("Invalid admin token.")),
        None => Err(ApiError::unauthorized(
            "Missing admin token: send Authorization: Bearer <ADMIN_TOKEN>.",
        )),
    }
}

/// Requires `METRICS_TOKEN` (or the admin token) for `/metrics`.
pub fn require_metrics(req: &Request, env: &Env) -> Result<(), ApiError> {
    let given = bearer(req);
    let matches = |name: &str| match (&given, secret(env, name)) {
        (Some(g), Some(expected)) => constant_time_eq(g.as_bytes(), expected.as_bytes()),
        _ => false,
    };
    // Both are compared, so the time taken does not tell which one matched.
    let (metrics, admin) = (matches("METRICS_TOKEN"), matches("ADMIN_TOKEN"));
    if metrics | admin {
        Ok(())
    } else {
        Err(ApiError::unauthorized(
            "Send Authorization: Bearer <METRICS_TOKEN or ADMIN_TOKEN> for /metrics.",
        ))
    }
}
