//! The pool directory: one Durable Object that lists every pool, so the Worker (admin listings,
//! `/v1/models`, the cron probe sweep, regional ordering) can find all pools without a fixed list.
//!
//! Routes (internal, see [`crate::protocol`]):
//! - `GET /pools`: every [`PoolEntry`], ordered by name.
//! - `PUT /pools/{name}`: insert or update a pool's entry (body: [`PoolEntry`]).
//! - `DELETE /pools/{name}`: forget a pool.
//! - `GET /keys`, `POST /keys`, `PATCH /keys/{id}`, `DELETE /keys/{id}`: client API keys, stored as
//!   SHA-256 hashes (the Worker mints a key, shows it once, and sends only its hash here), each
//!   with the admission priority of its requests.

use crate::api_error::ApiError;
use crate::protocol::PoolEntry;
use serde::{Deserialize, Serialize};
use worker::*;

/// A client API key as stored: never the key itself, only its hash.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StoredKey {
    /// Public id, used to revoke the key.
    pub id: String,
    /// Operator's label.
    pub name: String,
    /// Hex SHA-256 of the key.
    pub hash: String,
    /// When it was minted (ms since the epoch).
    pub created_ms: u64,
    /// Admission priority of the key's requests (higher is served first; default 0).
    #[serde(default)]
    pub priority: i32,
}

/// Body of `PATCH /keys/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct KeyPatch {
    /// New admission priority.
    pub priority: Option<i32>,
}

/// The name of the single directory instance.
pub const DIRECTORY_NAME: &str = "directory";

/// Lists every pool; stored in the object's SQLite database.
#[durable_object]
pub struct PoolDirectory {
    state: State,
}

impl DurableObject for PoolDirectory {
    fn new(state: State, _env: Env) -> Self {
        let sql = state.storage().sql();
        for ddl in [
            "CREATE TABLE IF NOT EXISTS pools (name TEXT PRIMARY KEY, region TEXT NOT NULL DEFAULT '')",
            "ALTER TABLE pools ADD COLUMN location_hint TEXT",
            "CREATE TABLE IF NOT EXISTS keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, hash TEXT NOT NULL UNIQUE, created_ms INTEGER NOT NULL)",
            "ALTER TABLE keys ADD COLUMN priority INTEGER NOT NULL DEFAULT 0",
        ] {
            // An ALTER fails harmlessly once its column exists.
            let _ = sql.exec(ddl, None);
        }
        PoolDirectory { state }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        let path = req.path();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let result = match (req.method(), segments.as_slice()) {
            (Method::Get, ["pools"]) => self.list().and_then(|p| Response::from_json(&p).map_err(ApiError::from_worker)),
            (Method::Put, ["pools", name]) => match req.json::<PoolEntry>().await {
                Ok(entry) if entry.name == *name => self.upsert(&entry).and_then(|_| Response::from_json(&entry).map_err(ApiError::from_worker)),
                Ok(_) => Err(ApiError::bad_request("pool name in body and path differ")),
                Err(e) => Err(ApiError::bad_request(format!("invalid pool entry: {e}"))),
            },
            (Method::Delete, ["pools", name]) => self
                .state
                .storage()
                .sql()
                .exec("DELETE FROM pools WHERE name = ?", vec![(*name).into()])
                .map_err(ApiError::from_worker)
                .and_then(|_| Response::empty().map_err(ApiError::from_worker)),
            (Method::Get, ["keys"]) => self
                .sql("SELECT id, name, hash, created_ms, priority FROM keys ORDER BY created_ms", vec![])
                .and_then(|c| c.to_array::<StoredKey>().map_err(ApiError::from_worker))
                .and_then(|keys| Response::from_json(&keys).map_err(ApiError::from_worker)),
            (Method::Post, ["keys"]) => match req.json::<StoredKey>().await {
                Ok(k) => self
                    .sql(
                        "INSERT INTO keys (id, name, hash, created_ms, priority) VALUES (?, ?, ?, ?, ?)",
                        vec![
                            k.id.clone().into(),
                            k.name.clone().into(),
                            k.hash.clone().into(),
                            (k.created_ms as i64).into(),
                            (k.priority as i64).into(),
                        ],
                    )
                    .and_then(|_| Response::from_json(&k).map(|r| r.with_status(201)).map_err(ApiError::from_worker)),
                Err(e) => Err(ApiError::bad_request(format!("invalid key: {e}"))),
            },
            (Method::Patch, ["keys", id]) => match req.json::<KeyPatch>().await {
                Ok(KeyPatch { priority: Some(p) }) => self
                    .sql("UPDATE keys SET priority = ? WHERE id = ?", vec![(p as i64).into(), (*id).into()])
                    .and_then(|c| {
                        if c.rows_written() > 0 {
                            Response::from_json(&serde_json::json!({ "id": id, "priority": p })).map_err(ApiError::from_worker)
                        } else {
                            Err(ApiError::not_found(format!("no key `{id}`")))
                        }
                    }),
                Ok(_) => Err(ApiError::bad_request("nothing to change: send `priority`")),
                Err(e) => Err(ApiError::bad_request(format!("invalid key patch: {e}"))),
            },
            (Method::Delete, ["keys", id]) => self
                .sql("DELETE FROM keys WHERE id = ?", vec![(*id).into()])
                .and_then(|c| {
                    let deleted = c.rows_written() > 0;
                    if deleted {
                        Response::from_json(&serde_json::json!({ "id": id, "deleted": true })).map_err(ApiError::from_worker)
                    } else {
                        Err(ApiError::not_found(format!("no key `{id}`")))
                    }
                }),
            _ => Err(ApiError::not_found(format!("directory has no route {path}"))),
        };
        result.or_else(|e| e.to_response())
    }
}

impl PoolDirectory {
    fn sql(
        &self,
        query: &str,
        bindings: Vec<SqlStorageValue>,
    ) -> std::result::Result<SqlCursor, ApiError> {
        self.state
            .storage()
            .sql()
            .exec(query, bindings)
            .map_err(ApiError::from_worker)
    }

    fn list(&self) -> std::result::Result<Vec<PoolEntry>, ApiError> {
        let cursor = self
            .state
            .storage()
            .sql()
            .exec(
                "SELECT name, region, location_hint FROM pools ORDER BY name",
                None,
            )
            .map_err(ApiError::from_worker)?;
        cursor
            .to_array::<PoolEntry>()
            .map_err(ApiError::from_worker)
    }

    fn upsert(&self, entry: &PoolEntry) -> std::result::Result<(), ApiError> {
        self.state
            .storage()
            .sql()
            .exec(
                "INSERT INTO pools (name, region, location_hint) VALUES (?, ?, ?) \
                 ON CONFLICT(name) DO UPDATE SET region = excluded.region, location_hint = excluded.location_hint",
                vec![
                    entry.name.clone().into(),
                    entry.region.clone().into(),
                    entry.location_hint.clone().map_or(SqlStorageValue::Null, SqlStorageValue::from),
                ],
            )
            .map(|_| ())
            .map_err(ApiError::from_worker)
    }
}
