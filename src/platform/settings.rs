//! The request path's configuration, read from the Worker's environment (wrangler.toml vars and
//! secrets) once per isolate.
//!
//! An isolate runs one version of the Worker, whose bindings do not change while it lives, so the
//! dozen vars every proxied request consults (feature extraction, proxy timeouts, body limit, the
//! client keys and rate limits, the region map, the regional hop's role, bindings and secret) are
//! parsed on its first request and kept. Each lookup crosses into JavaScript, and together they
//! were a measurable share of a request's CPU.
//! The admin API and the cron handler still read the environment directly.

use crate::platform::auth::{hash_key, secret};
use crate::platform::http::{json_var_or_default, var_or};
use routing_core::region::ChoiceConfig;
use routing_core::request::prompt::FeatureConfig;
use routing_core::request::rate_limit::RateLimits;
use std::collections::HashMap;
use std::time::Duration;
use worker::Env;

/// Largest request body accepted unless `MAX_BODY_BYTES` says otherwise.
const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// What a proxied request needs from the environment.
pub struct Settings {
    /// Feature extraction (`BLOCK_TOKENS`, `DEFAULT_MAX_TOKENS`, `ROUTING_KEY_HEADER`).
    pub features: FeatureConfig,
    /// Timeouts, retries and resumptions.
    pub proxy: ProxySettings,
    /// `MAX_BODY_BYTES`.
    pub max_body_bytes: usize,
    /// SHA-256 hashes (hex) of the `CLIENT_API_KEYS` keys.
    pub client_key_hashes: Vec<String>,
    /// `REQUIRE_CLIENT_KEYS`: the OpenAI surface stays closed (401) even with no key configured
    /// or minted (production); off, it is open until the first key exists (local development).
    pub require_client_keys: bool,
    /// `KEY_LIST_MAX_STALE_MS`: how long a cached list of minted keys may be served while the
    /// directory cannot be read; past it, keyed requests get a 503 rather than a check against a
    /// list that may still hold revoked keys.
    pub key_list_max_stale_ms: u64,
    /// `SLOW_CLIENT_TIMEOUT_MS`: how long a client may make no progress reading once the
    /// backend finished while anything is still queued for it, before it is cut off.
    pub slow_client_timeout_ms: u64,
    /// `RELAY_BUFFER_BYTES`: how much of a streamed answer the relay holds for a client that reads
    /// slower than the backend writes (the backend is never held up by the client); a client that
    /// falls further behind is cut off.
    pub relay_buffer_bytes: u64,
    /// `RATE_LIMIT_RPM`, `RATE_LIMIT_TPM`.
    pub rate_limits: RateLimits,
    /// `RATE_LIMIT_AHEAD = "true"`: a client well within its limits is served without waiting
    /// for its charge's answer (`src/clients/reserving.rs`).
    pub rate_limit_ahead: bool,
    /// `ROUTE_AHEAD = "true"`: a request's backend fetch is sent beside its lease call, to the
    /// backend the isolate expects the pool to choose, and kept only if it does
    /// (`src/request/ahead.rs`).
    pub route_ahead: bool,
    /// `ALLOW_REGION_HEADER`: whether `x-gateway-region` is trusted.
    pub region_header: bool,
    /// `REGION_MAP`: colo or continent code to region.
    pub region_map: HashMap<String, String>,
    /// `GATEWAY_ROLE = "regional"`: this deployment is a regional Worker (`src/request/hop.rs`).
    pub regional: bool,
    /// `REGIONAL_WORKERS`: a pool region to the service binding of its regional Worker.
    pub regional_workers: HashMap<String, String>,
    /// The `HOP_SECRET` secret (or var), if set: never logged or sent anywhere but the hop.
    pub hop_secret: Option<String>,
}

impl Settings {
    pub(crate) fn read(env: &Env) -> Settings {
        let defaults = FeatureConfig::default();
        Settings {
            features: FeatureConfig {
                block_tokens: var_or(env, "BLOCK_TOKENS", defaults.block_tokens),
                default_max_tokens: var_or(env, "DEFAULT_MAX_TOKENS", defaults.default_max_tokens),
                routing_header: env
                    .var("ROUTING_KEY_HEADER")
                    .ok()
                    .map(|v| v.to_string().to_ascii_lowercase())
                    .filter(|h| !h.is_empty()),
                max_blocks: defaults.max_blocks,
            },
            proxy: ProxySettings::from_env(env),
            max_body_bytes: var_or(env, "MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES),
            client_key_hashes: secret(env, "CLIENT_API_KEYS")
                .map(|s| {
                    s.split(',')
                        .map(str::trim)
                        .filter(|k| !k.is_empty())
                        .map(hash_key)
                        .collect()
                })
                .unwrap_or_default(),
            require_client_keys: var_or(env, "REQUIRE_CLIENT_KEYS", String::new()) != "false",
            key_list_max_stale_ms: var_or(env, "KEY_LIST_MAX_STALE_MS", 300_000u64).max(1_000),
            slow_client_timeout_ms: var_or(env, "SLOW_CLIENT_TIMEOUT_MS", 30_000u64).max(100),
            relay_buffer_bytes: var_or(env, "RELAY_BUFFER_BYTES", DEFAULT_RELAY_BUFFER_BYTES)
                .max(MIN_RELAY_BUFFER_BYTES),
            rate_limits: RateLimits {
                requests_per_minute: var_or(env, "RATE_LIMIT_RPM", 0),
                tokens_per_minute: var_or(env, "RATE_LIMIT_TPM", 0),
            },
            rate_limit_ahead: var_or(env, "RATE_LIMIT_AHEAD", String::new()) == "true",
            route_ahead: var_or(env, "ROUTE_AHEAD", String::new()) == "true",
            region_header: var_or(env, "ALLOW_REGION_HEADER", String::new()) == "true",
            region_map: json_var_or_default(env, "REGION_MAP"),
            regional: var_or(env, "GATEWAY_ROLE", String::new()).trim() == "regional",
            regional_workers: json_var_or_default(env, "REGIONAL_WORKERS"),
            hop_secret: secret(env, "HOP_SECRET"),
        }
    }
}

/// Proxy timing and retry knobs (wrangler.toml vars).
#[derive(Debug, Clone, Copy)]
pub struct ProxySettings {
    /// Most extra attempts after the first (default 2).
    pub max_retries: u32,
    /// A streamed answer must deliver its first chunk within this time (default 30 s).
    pub first_byte_timeout: Duration,
    /// A non-streamed answer must arrive whole within this time (default 600 s).
    pub response_timeout: Duration,
    /// After its first chunk, a stream may go this long without one (default 60 s).
    pub stream_idle_timeout: Duration,
    /// Most times one stream is resumed on another backend after failing mid-answer (default 1;
    /// 0 turns resumption off).
    pub max_stream_resumes: u32,
}

impl ProxySettings {
    /// Reads the knobs from the environment, with defaults.
    pub fn from_env(env: &Env) -> Self {
        let var = |name: &str, default: u64| var_or(env, name, default);
        ProxySettings {
            max_retries: var("MAX_RETRIES", 2).min(10) as u32,
            first_byte_timeout: Duration::from_millis(var("FIRST_BYTE_TIMEOUT_MS", 30_000).max(10)),
            response_timeout: Duration::from_millis(var("RESPONSE_TIMEOUT_MS", 600_000).max(10)),
            stream_idle_timeout: Duration::from_millis(
                var("STREAM_IDLE_TIMEOUT_MS", 60_000).max(10),
            ),
            max_stream_resumes: var("MAX_STREAM_RESUMES", 1).min(5) as u32,
        }
    }
}

/// `RELAY_BUFFER_BYTES` unless set: about 20,000 tokens of chat events.
pub(crate) const DEFAULT_RELAY_BUFFER_BYTES: u64 = 4 << 20;
/// The smallest `RELAY_BUFFER_BYTES` taken: a few events' worth.
const MIN_RELAY_BUFFER_BYTES: u64 = 64 << 10;

/// The pool choice's settings (`request/regions.rs` reads them, once per isolate).
pub(crate) struct RegionSettings {
    pub(crate) choice: ChoiceConfig,
    pub(crate) home_capacity: usize,
    /// `SIMULATE_NETWORK`: local runs wait out the configured round trips themselves.
    pub(crate) simulate_network: bool,
    /// `SIMULATE_LIMITER_RTT_MS`: with `simulate_network`, the round trip to a client's rate
    /// limiter object that local runs wait out.
    pub(crate) limiter_rtt_ms: u64,
}
