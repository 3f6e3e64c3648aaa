//! The pool directory: one Durable Object that lists every pool, so the Worker (admin listings,
//! `/v1/models`, the cron probe sweep, regional ordering) can find all pools without a fixed list.
//!
//! Routes (internal, see [`crate::protocol`]):
//! - `GET /pools`: every [`PoolEntry`], ordered by name.
//! - `PUT /pools/{name}`: insert or update a pool's entry (body: [`PoolEntry`]).
//! - `DELETE /pools/{name}`: forget a pool.

use crate::api_error::ApiError;
use crate::protocol::PoolEntry;
use worker::*;

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
        if let Err(e) = sql.exec(
            "CREATE TABLE IF NOT EXISTS pools (name TEXT PRIMARY KEY, region TEXT NOT NULL DEFAULT '')",
            None,
        ) {
            console_error!("directory: schema: {e}");
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
            _ => Err(ApiError::not_found(format!("directory has no route {path}"))),
        };
        result.or_else(|e| e.to_response())
    }
}

impl PoolDirectory {
    fn list(&self) -> std::result::Result<Vec<PoolEntry>, ApiError> {
        let cursor = self
            .state
            .storage()
            .sql()
            .exec("SELECT name, region FROM pools ORDER BY name", None)
            .map_err(ApiError::from_worker)?;
        cursor.to_array::<PoolEntry>().map_err(ApiError::from_worker)
    }

    fn upsert(&self, entry: &PoolEntry) -> std::result::Result<(), ApiError> {
        self.state
            .storage()
            .sql()
            .exec(
                "INSERT INTO pools (name, region) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET region = excluded.region",
                vec![entry.name.clone().into(), entry.region.clone().into()],
            )
            .map(|_| ())
            .map_err(ApiError::from_worker)
    }
}
