//! The pool's durable registry: backends, pool configuration and breaker state in the Durable
//! Object's SQLite database, so a restarted object comes back with everything that must survive;
//! and which backend holds each stored Responses API response (`routing_core::pool::responses`),
//! so a deploy or an eviction does not lose a conversation's way back to its server.
//! Leases and the prefix-affinity table are deliberately not here: they describe the moment and
//! are rebuilt by traffic (leases also expire on their own deadline).

use coordinator_protocol::ApiError;
use routing_core::backend::{BackendId, BackendSpec};
use routing_core::pool::BackendSnapshot;
use routing_core::stream::outcome::StoredResponse;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use worker::{SqlStorage, SqlStorageValue};

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
struct ResponseRow {
    id: String,
    backend: String,
    owner: Option<String>,
    at_ms: f64,
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
        sql.exec(
            "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, backend TEXT NOT NULL, owner TEXT, at_ms INTEGER NOT NULL)",
            None,
        )?;
        sql.exec(
            "CREATE INDEX IF NOT EXISTS responses_at ON responses (at_ms)",
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

    /// The stored responses' holders, oldest first: the newest `limit` of them.
    pub fn responses(&self, limit: usize) -> worker::Result<Vec<(StoredResponse, BackendId, u64)>> {
        let rows: Vec<ResponseRow> = self
            .sql
            .exec(
                "SELECT id, backend, owner, at_ms FROM (SELECT id, backend, owner, at_ms \
                 FROM responses ORDER BY at_ms DESC LIMIT ?) ORDER BY at_ms",
                vec![i64::try_from(limit).unwrap_or(i64::MAX).into()],
            )?
            .to_array()?;
        Ok(rows
            .into_iter()
            .map(|r| {
                let response = StoredResponse {
                    id: r.id,
                    owner: r.owner,
                };
                (response, BackendId(r.backend), r.at_ms as u64)
            })
            .collect())
    }

    /// Writes that `backend` holds the stored `response` since `at_ms`, and drops the records
    /// older than `forget_before_ms`.
    pub fn put_response(
        &self,
        response: &StoredResponse,
        backend: &BackendId,
        at_ms: u64,
        forget_before_ms: Option<u64>,
    ) -> Result<(), ApiError> {
        if let Some(before) = forget_before_ms {
            self.sql.exec(
                "DELETE FROM responses WHERE at_ms < ?",
                vec![i64::try_from(before).unwrap_or(i64::MAX).into()],
            )?;
        }
        self.sql.exec(
            "INSERT OR REPLACE INTO responses (id, backend, owner, at_ms) VALUES (?, ?, ?, ?)",
            vec![
                response.id.clone().into(),
                backend.0.clone().into(),
                match &response.owner {
                    Some(owner) => owner.clone().into(),
                    None => SqlStorageValue::Null,
                },
                i64::try_from(at_ms).unwrap_or(i64::MAX).into(),
            ],
        )?;
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
