//! The pool's durable registry: backends, pool configuration and breaker state in the Durable
//! Object's SQLite database, so a restarted object comes back with everything that must survive.
//! Leases and the prefix-affinity table are deliberately not here: they describe the moment and
//! are rebuilt by traffic (leases also expire on their own deadline).

use crate::api_error::ApiError;
use crate::protocol::BackendRegistration;
use serde::{Deserialize, Serialize};
use worker::{SqlStorage, Url};

/// A validated backend as stored (the API key included; views redact it).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StoredBackend {
    /// Stable id, derived from the URL unless the caller chose one.
    pub id: String,
    /// Base URL without a trailing slash.
    pub url: String,
    /// Region of the backend's pool.
    pub region: String,
    /// Models it serves.
    pub models: Vec<String>,
    /// Relative weight.
    pub weight: u32,
    /// `mixed`, `prefill` or `decode`.
    pub role: String,
    /// Bearer key sent to the backend.
    pub api_key: Option<String>,
    /// Capacity hint: maximum concurrent sequences.
    pub max_num_seqs: Option<u32>,
    /// Capacity hint: KV blocks.
    pub kv_blocks: Option<u64>,
    /// Capacity hint: tokens per block.
    pub block_size: Option<u32>,
}

/// Roles a backend may have.
pub const ROLES: [&str; 3] = ["mixed", "prefill", "decode"];

/// Longest accepted id or model name; ids appear in URLs and metric labels.
const MAX_NAME_LEN: usize = 128;

/// Checks a name used as an id, pool or model: printable, no path or label metacharacters.
pub fn validate_name(field: &str, value: &str) -> Result<(), ApiError> {
    let ok = !value.is_empty()
        && value.len() <= MAX_NAME_LEN
        && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '@'))
        && value != "."
        && value != "..";
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "`{field}` must be 1-{MAX_NAME_LEN} characters of letters, digits, '-', '_', '.', ':' or '@'"
        ))
        .with_param(field))
    }
}

/// Checks a backend URL: http or https, a host, no credentials, no query or fragment.
pub fn validate_url(raw: &str) -> Result<String, ApiError> {
    let bad = |why: &str| Err(ApiError::bad_request(format!("invalid backend url: {why}")).with_param("url"));
    let url = match Url::parse(raw) {
        Ok(u) => u,
        Err(_) => return bad("not an absolute URL"),
    };
    if url.scheme() != "http" && url.scheme() != "https" {
        return bad("scheme must be http or https");
    }
    if url.host_str().map_or(true, str::is_empty) {
        return bad("missing host");
    }
    if !url.username().is_empty() || url.password().is_some() {
        return bad("credentials in the URL are not allowed; use api_key");
    }
    if url.query().is_some() || url.fragment().is_some() {
        return bad("query strings and fragments are not allowed");
    }
    Ok(url.as_str().trim_end_matches('/').to_string())
}

/// Validates a registration and turns it into a stored backend.
pub fn validate_registration(reg: BackendRegistration, default_region: &str) -> Result<StoredBackend, ApiError> {
    let url = validate_url(&reg.url)?;
    let role = reg.role.unwrap_or_else(|| "mixed".to_string());
    if !ROLES.contains(&role.as_str()) {
        return Err(ApiError::bad_request(format!("unknown role `{role}`; expected mixed, prefill or decode")).with_param("role"));
    }
    for m in &reg.models {
        if m.is_empty() || m.len() > 256 || m.chars().any(|c| c.is_control()) {
            return Err(ApiError::bad_request("model names must be 1-256 printable characters").with_param("models"));
        }
    }
    let weight = reg.weight.unwrap_or(1);
    if weight == 0 || weight > 1000 {
        return Err(ApiError::bad_request("`weight` must be between 1 and 1000").with_param("weight"));
    }
    let id = match reg.id {
        Some(id) => {
            validate_name("id", &id)?;
            id
        }
        None => format!("b-{:012x}", xxhash_rust::xxh3::xxh3_64(url.as_bytes()) & 0xffff_ffff_ffff),
    };
    let region = reg.region.unwrap_or_else(|| default_region.to_string());
    if !region.is_empty() {
        validate_name("region", &region)?;
    }
    Ok(StoredBackend {
        id,
        url,
        region,
        models: reg.models,
        weight,
        role,
        api_key: reg.api_key.filter(|k| !k.is_empty()),
        max_num_seqs: reg.max_num_seqs,
        kv_blocks: reg.kv_blocks,
        block_size: reg.block_size,
    })
}

/// The SQLite tables of a pool.
pub struct Registry {
    sql: SqlStorage,
}

#[derive(Deserialize)]
struct SpecRow {
    spec: String,
}

#[derive(Deserialize)]
struct ValueRow {
    value: String,
}

impl Registry {
    /// Opens the registry, creating its tables on first use.
    pub fn open(sql: SqlStorage) -> worker::Result<Self> {
        sql.exec("CREATE TABLE IF NOT EXISTS backends (id TEXT PRIMARY KEY, url TEXT NOT NULL UNIQUE, spec TEXT NOT NULL)", None)?;
        sql.exec("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)", None)?;
        Ok(Registry { sql })
    }

    /// Every stored backend.
    pub fn backends(&self) -> worker::Result<Vec<StoredBackend>> {
        let rows: Vec<SpecRow> = self.sql.exec("SELECT spec FROM backends ORDER BY id", None)?.to_array()?;
        Ok(rows.into_iter().filter_map(|r| serde_json::from_str(&r.spec).ok()).collect())
    }

    /// Inserts a backend; `Conflict` when its id or URL is taken.
    pub fn insert(&self, b: &StoredBackend) -> Result<(), ApiError> {
        let taken: Vec<SpecRow> = self
            .sql
            .exec("SELECT spec FROM backends WHERE id = ? OR url = ?", vec![b.id.clone().into(), b.url.clone().into()])
            .and_then(|c| c.to_array())
            .map_err(ApiError::from_worker)?;
        if !taken.is_empty() {
            return Err(ApiError::conflict(format!("a backend with id `{}` or this URL is already registered", b.id)));
        }
        self.put(b)
    }

    /// Writes (inserts or replaces) a backend.
    pub fn put(&self, b: &StoredBackend) -> Result<(), ApiError> {
        let spec = serde_json::to_string(b).map_err(|e| ApiError::internal(e.to_string()))?;
        self.sql
            .exec(
                "INSERT OR REPLACE INTO backends (id, url, spec) VALUES (?, ?, ?)",
                vec![b.id.clone().into(), b.url.clone().into(), spec.into()],
            )
            .map(|_| ())
            .map_err(ApiError::from_worker)
    }

    /// Deletes a backend.
    pub fn delete(&self, id: &str) -> Result<(), ApiError> {
        self.sql.exec("DELETE FROM backends WHERE id = ?", vec![id.into()]).map(|_| ()).map_err(ApiError::from_worker)
    }

    /// Reads a metadata value.
    pub fn meta(&self, key: &str) -> Option<String> {
        let rows: Vec<ValueRow> = self
            .sql
            .exec("SELECT value FROM meta WHERE key = ?", vec![key.into()])
            .and_then(|c| c.to_array())
            .ok()?;
        rows.into_iter().next().map(|r| r.value)
    }

    /// Writes a metadata value.
    pub fn set_meta(&self, key: &str, value: &str) -> Result<(), ApiError> {
        self.sql
            .exec("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", vec![key.into(), value.into()])
            .map(|_| ())
            .map_err(ApiError::from_worker)
    }
}
