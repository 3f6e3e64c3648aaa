//! One backend's state: what the pool knows and learns about a single vLLM server.
//!
//! This file is what a backend is (its [`BackendSpec`], [`BackendId`], [`Lifecycle`] and
//! [`Capacity`] hints). The files next to it each hold one part of its state, which the pool keeps
//! per backend and combines when it decides: `health` (its probes), `breaker` (its circuit breaker,
//! fed by outcomes), `scrape` (the gauges read from its `/metrics` page), `cost` (how loaded it is
//! and what a request would cost there), `serving` (the one rule for whether it serves a model now),
//! `time_model` (its learned step times: waits for a first token and harm to the requests already
//! running) and `held_blocks` (the KV blocks its running requests hold). They build on [`crate::request`] and [`crate::stream`], never on the pool.
//!
//! A [`BackendSpec`] is what an operator registers (and what the Durable Object persists): identity,
//! URL, region, served models, weight, [`Role`] for prefill/decode disaggregation, an optional API
//! key, and [`Capacity`] hints. Its [`Lifecycle`] says whether it may take new traffic; health and
//! breaker state live in the files beside this one and are combined by the pool.
//!
//! The API key is stored so the Worker can authenticate to the server, but it never appears in
//! `Debug` output, metrics or listings.

pub mod breaker;
pub mod cost;
pub mod health;
pub mod held_blocks;
pub mod scrape;
pub mod serving;
pub mod time_model;

use crate::request::role::Role;
use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;

/// Longest accepted backend id, in bytes.
pub const MAX_BACKEND_ID_BYTES: usize = 128;

/// A backend's stable identity, chosen by whoever registers it.
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BackendId(pub String);

impl BackendId {
    /// Wraps a string as a backend id (validated when the backend is added to a pool).
    pub fn new(id: impl Into<String>) -> Self {
        BackendId(id.into())
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for BackendId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for BackendId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for BackendId {
    fn from(s: &str) -> Self {
        BackendId(s.to_string())
    }
}

impl From<String> for BackendId {
    fn from(s: String) -> Self {
        BackendId(s)
    }
}

/// Whether a backend may take new traffic.
///
/// `pending -> ready` happens on the first successful health probe; `ready -> draining` on an
/// operator's request; `draining -> drained` once its last lease ends. A drained or draining
/// backend can be undrained back to ready.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifecycle {
    /// Registered, never yet probed successfully: serves nothing.
    #[default]
    Pending,
    /// Takes new traffic (subject to health and breaker).
    Ready,
    /// Finishes its live leases, takes no new ones.
    Draining,
    /// Drained: no leases and no new traffic.
    Drained,
}

impl Lifecycle {
    /// The lifecycle's name as used in JSON and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Pending => "pending",
            Lifecycle::Ready => "ready",
            Lifecycle::Draining => "draining",
            Lifecycle::Drained => "drained",
        }
    }

    /// Every lifecycle state, in order (for metrics).
    pub const ALL: [Lifecycle; 4] = [
        Lifecycle::Pending,
        Lifecycle::Ready,
        Lifecycle::Draining,
        Lifecycle::Drained,
    ];
}

/// vLLM's KV block size when a backend does not say (0.34's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 64;

/// Capacity hints for the cost model, overridden by scraped values when a probe reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Capacity {
    /// vLLM's `--max-num-seqs`: sequences it runs at once (default 256).
    pub max_num_seqs: u32,
    /// KV-cache blocks on the GPU (`num_gpu_blocks`); 0 means unknown.
    pub kv_blocks: u64,
    /// Tokens per KV block (vLLM's `--block-size`, default 64 as in vLLM 0.34).
    pub block_size: u32,
    /// The KV capacity in tokens vLLM reports (`kv_cache_size_tokens`); 0 means unknown, and
    /// then `kv_blocks * block_size` stands in.
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_tokens: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Capacity {
    /// Token capacity assumed when the KV size is unknown: 131,072 tokens, roughly an 8B model on
    /// one 80 GB GPU.
    pub const DEFAULT_CAPACITY_TOKENS: u64 = 131_072;

    /// KV capacity in tokens: what vLLM reports (`kv_cache_size_tokens`), else
    /// `kv_blocks * block_size`, or the default when unknown.
    pub fn capacity_tokens(&self) -> u64 {
        if self.kv_tokens > 0 {
            self.kv_tokens
        } else if self.kv_blocks > 0 && self.block_size > 0 {
            self.kv_blocks.saturating_mul(u64::from(self.block_size))
        } else {
            Self::DEFAULT_CAPACITY_TOKENS
        }
    }

    /// KV capacity in prefix blocks of `block_tokens` tokens (at least 1).
    pub fn capacity_blocks(&self, block_tokens: usize) -> u64 {
        (self.capacity_tokens() / block_tokens.max(1) as u64).max(1)
    }
}

impl Default for Capacity {
    fn default() -> Self {
        Capacity {
            max_num_seqs: 256,
            kv_blocks: 0,
            block_size: DEFAULT_BLOCK_SIZE,
            kv_tokens: 0,
        }
    }
}

/// A backend as registered by an operator and persisted by the Durable Object.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendSpec {
    /// Stable identity (1 to 128 bytes, no control characters).
    pub id: BackendId,
    /// Base URL of the vLLM server, `http://` or `https://`.
    pub url: String,
    /// Region the server runs in (free text, e.g. `us-east`).
    pub region: String,
    /// Models it serves; replaced by the probe's `/v1/models` answer when one is known.
    pub models: Vec<String>,
    /// Relative weight for weighted round robin and the hash ring (1 to 10,000, default 1).
    pub weight: u32,
    /// Mixed, prefill or decode.
    pub role: Role,
    /// Bearer token for the server; never rendered.
    pub api_key: Option<String>,
    /// Capacity hints for the cost model.
    pub capacity: Capacity,
}

/// Largest accepted backend weight.
pub const MAX_WEIGHT: u32 = 10_000;

impl Default for BackendSpec {
    fn default() -> Self {
        BackendSpec {
            id: BackendId::default(),
            url: String::new(),
            region: String::new(),
            models: Vec::new(),
            weight: 1,
            role: Role::Mixed,
            api_key: None,
            capacity: Capacity::default(),
        }
    }
}

impl fmt::Debug for BackendSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendSpec")
            .field("id", &self.id)
            .field("url", &self.url)
            .field("region", &self.region)
            .field("models", &self.models)
            .field("weight", &self.weight)
            .field("role", &self.role)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl BackendSpec {
    /// Checks the spec's fields; returns a human-readable reason when one is out of range.
    pub fn validate(&self) -> Result<(), String> {
        validate_id(&self.id)?;
        validate_url(&self.url)?;
        if self.weight == 0 || self.weight > MAX_WEIGHT {
            return Err(format!("weight must be between 1 and {MAX_WEIGHT}"));
        }
        if self.models.iter().any(|m| m.is_empty()) {
            return Err("model names must not be empty".into());
        }
        if self.capacity.max_num_seqs == 0 {
            return Err("capacity.max_num_seqs must be at least 1".into());
        }
        if self.capacity.block_size == 0 {
            return Err("capacity.block_size must be at least 1".into());
        }
        Ok(())
    }
}

fn validate_id(id: &BackendId) -> Result<(), String> {
    let s = id.as_str();
    if s.is_empty() {
        return Err("backend id must not be empty".into());
    }
    if s.len() > MAX_BACKEND_ID_BYTES {
        return Err(format!(
            "backend id must be at most {MAX_BACKEND_ID_BYTES} bytes"
        ));
    }
    if s.chars().any(char::is_control) {
        return Err("backend id must not contain control characters".into());
    }
    Ok(())
}

fn validate_url(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"));
    match rest {
        Some(host)
            if !host.is_empty() && !url.chars().any(|c| c.is_whitespace() || c.is_control()) =>
        {
            Ok(())
        }
        _ => Err("url must be an http:// or https:// URL".into()),
    }
}

/// A partial update of a backend's spec; absent fields stay as they are. The id cannot change.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendPatch {
    /// New base URL.
    pub url: Option<String>,
    /// New region.
    pub region: Option<String>,
    /// New list of served models.
    pub models: Option<Vec<String>>,
    /// New weight.
    pub weight: Option<u32>,
    /// New role.
    pub role: Option<Role>,
    /// `Some(Some(key))` sets the key, `Some(None)` (JSON `null`) clears it, absent keeps it.
    #[serde(deserialize_with = "present_or_null", skip_serializing)]
    pub api_key: Option<Option<String>>,
    /// New capacity hints.
    pub capacity: Option<Capacity>,
}

impl fmt::Debug for BackendPatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendPatch")
            .field("url", &self.url)
            .field("region", &self.region)
            .field("models", &self.models)
            .field("weight", &self.weight)
            .field("role", &self.role)
            .field(
                "api_key",
                &self
                    .api_key
                    .as_ref()
                    .map(|k| k.as_ref().map(|_| "<redacted>")),
            )
            .field("capacity", &self.capacity)
            .finish()
    }
}

/// Distinguishes a JSON `null` (clear) from an absent field (keep) for `Option<Option<T>>`.
fn present_or_null<'de, D, T>(deserializer: D) -> Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(deserializer).map(Some)
}

impl BackendPatch {
    /// Applies the patch to a copy of `spec` and validates the result.
    pub fn apply(&self, spec: &BackendSpec) -> Result<BackendSpec, String> {
        let mut next = spec.clone();
        if let Some(url) = &self.url {
            next.url = url.clone();
        }
        if let Some(region) = &self.region {
            next.region = region.clone();
        }
        if let Some(models) = &self.models {
            next.models = models.clone();
        }
        if let Some(weight) = self.weight {
            next.weight = weight;
        }
        if let Some(role) = self.role {
            next.role = role;
        }
        if let Some(key) = &self.api_key {
            next.api_key = key.clone();
        }
        if let Some(capacity) = self.capacity {
            next.capacity = capacity;
        }
        next.validate()?;
        Ok(next)
    }
}

/// Where a backend lives inside a pool: its slot and the slot's generation.
///
/// Slots are reused after removal; the generation tells a lease that outlived its backend that
/// the slot now belongs to someone else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BackendKey {
    /// Index into the pool's backend table.
    pub slot: u32,
    /// Incremented every time the slot is reused.
    pub generation: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> BackendSpec {
        BackendSpec {
            id: "gpu-1".into(),
            url: "http://10.0.0.1:8000".into(),
            models: vec!["llama".into()],
            api_key: Some("secret-key".into()),
            ..BackendSpec::default()
        }
    }

    #[test]
    fn debug_never_shows_the_api_key() {
        let text = format!("{:?}", spec());
        assert!(!text.contains("secret-key"));
        assert!(text.contains("<redacted>"));
    }

    #[test]
    fn validation_rejects_bad_fields() {
        assert!(spec().validate().is_ok());
        let mut s = spec();
        s.id = "".into();
        assert!(s.validate().is_err());
        let mut s = spec();
        s.id = "a\nb".into();
        assert!(s.validate().is_err());
        let mut s = spec();
        s.url = "ftp://x".into();
        assert!(s.validate().is_err());
        let mut s = spec();
        s.url = "http://".into();
        assert!(s.validate().is_err());
        let mut s = spec();
        s.weight = 0;
        assert!(s.validate().is_err());
    }

    #[test]
    fn partial_json_fills_defaults() {
        let s: BackendSpec =
            serde_json::from_str(r#"{"id":"a","url":"http://h:1","models":["m"]}"#).unwrap();
        assert_eq!(s.weight, 1);
        assert_eq!(s.role, Role::Mixed);
        assert_eq!(s.capacity.max_num_seqs, 256);
        let role: Role = serde_json::from_str("\"prefill\"").unwrap();
        assert_eq!(role, Role::Prefill);
    }

    #[test]
    fn patch_distinguishes_null_from_absent_key() {
        let keep: BackendPatch = serde_json::from_str(r#"{"weight":3}"#).unwrap();
        let clear: BackendPatch = serde_json::from_str(r#"{"api_key":null}"#).unwrap();
        let set: BackendPatch = serde_json::from_str(r#"{"api_key":"k2"}"#).unwrap();
        let base = spec();
        assert_eq!(
            keep.apply(&base).unwrap().api_key.as_deref(),
            Some("secret-key")
        );
        assert_eq!(keep.apply(&base).unwrap().weight, 3);
        assert_eq!(clear.apply(&base).unwrap().api_key, None);
        assert_eq!(set.apply(&base).unwrap().api_key.as_deref(), Some("k2"));
        let bad: BackendPatch = serde_json::from_str(r#"{"weight":0}"#).unwrap();
        assert!(bad.apply(&base).is_err());
    }

    #[test]
    fn capacity_in_tokens_and_blocks() {
        let c = Capacity {
            kv_blocks: 1000,
            block_size: 16,
            ..Capacity::default()
        };
        assert_eq!(c.capacity_tokens(), 16_000);
        assert_eq!(c.capacity_blocks(16), 1000);
        // vLLM's own figure wins over blocks x size (wrong for hybrid models).
        let reported = Capacity {
            kv_tokens: 12_345,
            ..c
        };
        assert_eq!(reported.capacity_tokens(), 12_345);
        assert_eq!(Capacity::default().block_size, 64);
        assert_eq!(
            Capacity::default().capacity_tokens(),
            Capacity::DEFAULT_CAPACITY_TOKENS
        );
    }
}
