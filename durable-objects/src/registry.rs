//! The pool's durable registry: backends, pool configuration and breaker state in the Durable
//! Object's SQLite database, so a restarted object comes back with everything that must survive.
//! Leases and the prefix-affinity table are deliberately not here: they describe the moment and
//! are rebuilt by traffic (leases also expire on their own deadline).

use coordinator_protocol::messages::BackendRegistration;
pub use coordinator_protocol::settings::validate_name;
use coordinator_protocol::ApiError;
use routing_core::backend::{BackendId, BackendSpec, Capacity};
use routing_core::pool::BackendSnapshot;
use routing_core::request::role::Role;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use worker::{SqlStorage, Url};

/// Checks a backend URL: http or https, a host, no credentials, no query or fragment.
pub fn validate_url(raw: &str) -> Result<String, ApiError> {
    let bad = |why: &str| {
        Err(ApiError::bad_request(format!("invalid backend url: {why}")).with_param("url"))
    };
    let url = match Url::parse(raw) {
        Ok(u) => u,
        Err(_) => return bad("not an absolute URL"),
    };
    if url.scheme() != "http" && url.scheme() != "https" {
        return bad("scheme must be http or https");
    }
    if url.host_str().is_none_or(str::is_empty) {
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

/// Whether a backend URL names its host by IP address rather than by a DNS name. A deployed
/// Worker cannot fetch such a URL (only hostnames), so registration refuses it unless the operator
/// allows it for local use. The URL parser normalises every IPv4 spelling (`0x7f.1`, `2130706433`)
/// to dotted form, so those count too.
pub fn host_is_ip(raw: &str) -> bool {
    let Ok(url) = Url::parse(raw) else {
        return false;
    };
    let host = url.host_str().unwrap_or_default();
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok()
}

/// Checks model names: 1-256 characters, no control characters, at most 64 of them.
pub fn validate_models(models: &[String]) -> Result<(), ApiError> {
    let bad = models.len() > 64
        || models
            .iter()
            .any(|m| m.is_empty() || m.len() > 256 || m.chars().any(char::is_control));
    if bad {
        return Err(ApiError::bad_request(
            "`models` must hold at most 64 names of 1-256 printable characters",
        )
        .with_param("models"));
    }
    Ok(())
}

/// Validates a registration and turns it into a backend spec.
pub fn validate_registration(reg: BackendRegistration) -> Result<BackendSpec, ApiError> {
    let url = validate_url(&reg.url)?;
    let role = match reg.role.as_deref().unwrap_or("mixed") {
        "mixed" => Role::Mixed,
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        other => {
            return Err(ApiError::bad_request(format!(
                "unknown role `{other}`; expected mixed, prefill or decode"
            ))
            .with_param("role"))
        }
    };
    let id = match reg.id {
        Some(id) => {
            validate_name("id", &id)?;
            id
        }
        None => format!(
            "b-{:012x}",
            xxhash_rust::xxh3::xxh3_64(url.as_bytes()) & 0xffff_ffff_ffff
        ),
    };
    validate_models(&reg.models)?;
    let region = reg.region.unwrap_or_default();
    if !region.is_empty() {
        validate_name("region", &region)?;
    }
    let defaults = Capacity::default();
    let spec = BackendSpec {
        id: BackendId(id),
        url,
        region,
        models: reg.models,
        weight: reg.weight.unwrap_or(1),
        role,
        api_key: reg.api_key.filter(|k| !k.is_empty()),
        capacity: Capacity {
            max_num_seqs: reg.max_num_seqs.unwrap_or(defaults.max_num_seqs),
            kv_blocks: reg.kv_blocks.unwrap_or(defaults.kv_blocks),
            block_size: reg.block_size.unwrap_or(defaults.block_size),
        },
    };
    spec.validate()
        .map_err(|e| ApiError::bad_request(format!("invalid backend: {e}")))?;
    Ok(spec)
}

/// The SQLite tables of a pool.
pub struct Registry {
    sql: SqlStorage,
}

#[derive(Deserialize)]
struct BackendRow {
    spec: String,
    snapshot: Option<String>,
}

#[derive(Deserialize)]
struct ValueRow {
    value: String,
}

impl Registry {
    /// Opens the registry, creating its tables on first use.
    pub fn open(sql: SqlStorage) -> worker::Result<Self> {
        sql.exec(
            "CREATE TABLE IF NOT EXISTS backends (id TEXT PRIMARY KEY, url TEXT NOT NULL UNIQUE, spec TEXT NOT NULL, snapshot TEXT)",
            None,
        )?;
        sql.exec(
            "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
            None,
        )?;
        Ok(Registry { sql })
    }

    /// Every stored backend with its last snapshot (lifecycle, health, breaker).
    pub fn backends(&self) -> worker::Result<Vec<(BackendSpec, Option<BackendSnapshot>)>> {
        let rows: Vec<BackendRow> = self
            .sql
            .exec("SELECT spec, snapshot FROM backends ORDER BY id", None)?
            .to_array()?;
        Ok(rows
            .into_iter()
            .filter_map(|r| {
                let spec = serde_json::from_str(&r.spec).ok()?;
                let snapshot = r.snapshot.and_then(|s| serde_json::from_str(&s).ok());
                Some((spec, snapshot))
            })
            .collect())
    }

    /// Whether a backend with this URL exists under another id.
    pub fn url_taken(&self, url: &str, except_id: &str) -> Result<bool, ApiError> {
        let rows: Vec<ValueRow> = self
            .sql
            .exec(
                "SELECT id AS value FROM backends WHERE url = ? AND id != ?",
                vec![url.into(), except_id.into()],
            )
            .and_then(|c| c.to_array())?;
        Ok(!rows.is_empty())
    }

    /// Writes (inserts or replaces) a backend's spec, keeping its snapshot.
    pub fn put_spec(&self, spec: &BackendSpec) -> Result<(), ApiError> {
        let json = to_json(spec)?;
        self.sql.exec(
            "INSERT INTO backends (id, url, spec) VALUES (?, ?, ?) \
                 ON CONFLICT(id) DO UPDATE SET url = excluded.url, spec = excluded.spec",
            vec![
                spec.id.0.clone().into(),
                spec.url.clone().into(),
                json.into(),
            ],
        )?;
        Ok(())
    }

    /// Writes a backend's snapshot.
    pub fn put_snapshot(&self, snapshot: &BackendSnapshot) -> Result<(), ApiError> {
        let json = to_json(snapshot)?;
        self.sql.exec(
            "UPDATE backends SET snapshot = ? WHERE id = ?",
            vec![json.into(), snapshot.id.0.clone().into()],
        )?;
        Ok(())
    }

    /// Deletes a backend.
    pub fn delete(&self, id: &str) -> Result<(), ApiError> {
        self.sql
            .exec("DELETE FROM backends WHERE id = ?", vec![id.into()])?;
        Ok(())
    }

    /// Reads a metadata value.
    pub fn meta<T: DeserializeOwned>(&self, key: &str) -> Option<T> {
        let rows: Vec<ValueRow> = self
            .sql
            .exec("SELECT value FROM meta WHERE key = ?", vec![key.into()])
            .and_then(|c| c.to_array())
            .ok()?;
        rows.into_iter()
            .next()
            .and_then(|r| serde_json::from_str(&r.value).ok())
    }

    /// Writes a metadata value.
    pub fn set_meta<T: Serialize>(&self, key: &str, value: &T) -> Result<(), ApiError> {
        let json = to_json(value)?;
        self.sql.exec(
            "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
            vec![key.into(), json.into()],
        )?;
        Ok(())
    }
}

fn to_json<T: Serialize>(value: &T) -> Result<String, ApiError> {
    serde_json::to_string(value).map_err(|e| ApiError::internal(e.to_string()))
}
