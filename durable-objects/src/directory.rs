//! The gateway's directory: one Durable Object that lists every pool, so the Worker (admin
//! listings, `/v1/models`, the cron probe sweep, regional ordering) can find all pools without a
//! fixed list, and holds the hashes of the client keys the admin API minted.
//!
//! Routes (internal, see `coordinator_protocol::Route`):
//! - `GET /pools`: every [`PoolEntry`], ordered by name.
//! - `PUT /pools/{name}`: insert or update a pool's entry (body: [`PoolEntry`]): the Worker sends
//!   the whole entry, merged onto the one in effect (a partial admin `PUT` keeps residency); the
//!   count of shard objects only grows (a retired shard still releases the leases it granted).
//! - `PUT /pools/{name}/card`: a pool's latest time card (body: `TimeCard`), pushed by the pool's
//!   shard 0 after each probe round and listed with its entry; kept in memory only (a restarted
//!   directory lists no cards until the next round, and the Worker then orders pools nearest first).
//! - `GET /keys`, `POST /keys`, `PATCH /keys/{id}`, `DELETE /keys/{id}`: client API keys, stored as
//!   SHA-256 hashes (the Worker mints a key, shows it once, and sends only its hash here), each
//!   with the admission priority of its requests. Once a key has been minted the directory
//!   remembers it (`meta.keys_minted`): when no key is left, `GET /keys` lists a seal, an entry
//!   with an empty hash that no presented key matches, so deleting the last key closes the
//!   OpenAI surface instead of opening it.

use crate::call::{parse_route, read_body, reply, respond, Answered};
use coordinator_protocol::call::{DeleteKey, ListKeys, ListPools, PatchKey, PutCard};
use coordinator_protocol::messages::{
    CardAnswer, DeleteAnswer, KeyPatch, KeyPatchAnswer, PoolEntry, StoredKey,
};
use coordinator_protocol::{ApiError, Object, Route};
use routing_core::region::TimeCard;
use serde::Deserialize;
use std::cell::RefCell;
use std::collections::HashMap;
use worker::*;

pub use coordinator_protocol::names::DIRECTORY_NAME;

/// What `GET /keys` lists when keys were minted and every one was deleted: no hash, so no key
/// matches it, and the Worker keeps the surface closed.
const SEAL_KEY: StoredKey = StoredKey {
    id: String::new(),
    name: String::new(),
    hash: String::new(),
    created_ms: 0,
    priority: 0,
    residency: Vec::new(),
};

/// Every pool and every minted client key, in the object's SQLite database.
#[durable_object]
pub struct GatewayDirectory {
    state: State,
    /// Each pool's latest time card.
    cards: RefCell<HashMap<String, TimeCard>>,
}

/// A row of the `keys` table (residency as comma-separated names).
#[derive(Deserialize)]
struct KeyRow {
    id: String,
    name: String,
    hash: String,
    created_ms: u64,
    priority: i32,
    residency: Option<String>,
}

impl KeyRow {
    fn into_key(self) -> StoredKey {
        StoredKey {
            id: self.id,
            name: self.name,
            hash: self.hash,
            created_ms: self.created_ms,
            priority: self.priority,
            residency: split_list(self.residency),
        }
    }
}

/// A comma-separated column as its names (none when empty or absent).
fn split_list(column: Option<String>) -> Vec<String> {
    column
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// A row of the `pools` table (residency as comma-separated names).
#[derive(Deserialize)]
struct PoolRow {
    name: String,
    region: String,
    location_hint: Option<String>,
    shards: u32,
    shard_objects: u32,
    jurisdiction: Option<String>,
    residency: Option<String>,
}

impl DurableObject for GatewayDirectory {
    fn new(state: State, _env: Env) -> Self {
        let sql = state.storage().sql();
        for ddl in [
            "CREATE TABLE IF NOT EXISTS pools (name TEXT PRIMARY KEY, region TEXT NOT NULL DEFAULT '')",
            "ALTER TABLE pools ADD COLUMN location_hint TEXT",
            "ALTER TABLE pools ADD COLUMN shards INTEGER NOT NULL DEFAULT 1",
            "ALTER TABLE pools ADD COLUMN shard_objects INTEGER NOT NULL DEFAULT 1",
            "CREATE TABLE IF NOT EXISTS keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, hash TEXT NOT NULL UNIQUE, created_ms INTEGER NOT NULL)",
            "ALTER TABLE keys ADD COLUMN priority INTEGER NOT NULL DEFAULT 0",
            "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
            // A directory whose keys predate the seal remembers them too.
            "INSERT OR IGNORE INTO meta (name, value) SELECT 'keys_minted', 1 WHERE EXISTS (SELECT 1 FROM keys)",
            "ALTER TABLE pools ADD COLUMN jurisdiction TEXT",
            "ALTER TABLE pools ADD COLUMN residency TEXT",
            "ALTER TABLE keys ADD COLUMN residency TEXT",
        ] {
            // An ALTER fails harmlessly once its column exists.
            let _ = sql.exec(ddl, None);
        }
        GatewayDirectory {
            state,
            cards: RefCell::new(HashMap::new()),
        }
    }

    async fn fetch(&self, mut req: Request) -> Result<Response> {
        let result = match parse_route(&req, Object::Directory) {
            Ok(route) => self.handle(route, &mut req).await,
            Err(e) => Err(e),
        };
        respond(result)
    }
}

impl GatewayDirectory {
    async fn handle(&self, route: Route, req: &mut Request) -> Answered {
        match route {
            Route::ListPools => reply::<ListPools>(&self.list()?),
            Route::PutPool(name) => {
                let entry: PoolEntry = read_body(req, "pool entry").await?;
                if entry.name != name {
                    return Err(ApiError::bad_request("pool name in body and path differ"));
                }
                self.upsert(&entry)?;
                reply::<PoolEntry>(&entry)
            }
            Route::PutCard(name) => {
                let card: TimeCard = read_body(req, "time card").await?;
                let known = self.has_pool(&name)?;
                if known {
                    // The newer card wins: two pushes of one pool may arrive out of order (a
                    // card lease evidence published and the one its scrape brought just after).
                    let mut cards = self.cards.borrow_mut();
                    if cards.get(&name).is_none_or(|kept| kept.at_ms <= card.at_ms) {
                        cards.insert(name, card);
                    }
                }
                reply::<PutCard>(&CardAnswer { known })
            }
            Route::ListKeys => {
                let rows: Vec<KeyRow> = self
                    .sql(
                        "SELECT id, name, hash, created_ms, priority, residency FROM keys ORDER BY created_ms",
                        vec![],
                    )?
                    .to_array()?;
                let keys: Vec<StoredKey> = rows.into_iter().map(KeyRow::into_key).collect();
                if keys.is_empty() && self.keys_minted()? {
                    return reply::<ListKeys>(&vec![SEAL_KEY]);
                }
                reply::<ListKeys>(&keys)
            }
            Route::AddKey => {
                let k: StoredKey = read_body(req, "key").await?;
                self.sql(
                    "INSERT INTO keys (id, name, hash, created_ms, priority, residency) VALUES (?, ?, ?, ?, ?, ?)",
                    vec![
                        k.id.clone().into(),
                        k.name.clone().into(),
                        k.hash.clone().into(),
                        (k.created_ms as i64).into(),
                        (k.priority as i64).into(),
                        k.residency.join(",").into(),
                    ],
                )?;
                self.sql(
                    "INSERT OR IGNORE INTO meta (name, value) VALUES ('keys_minted', 1)",
                    vec![],
                )?;
                reply::<StoredKey>(&k)
            }
            Route::PatchKey(id) => {
                let KeyPatch {
                    priority,
                    residency,
                } = read_body(req, "key patch").await?;
                if priority.is_none() && residency.is_none() {
                    return Err(ApiError::bad_request(
                        "nothing to change: send `priority` or `residency`",
                    ));
                }
                let cursor = self.sql(
                    "UPDATE keys SET priority = COALESCE(?, priority), residency = COALESCE(?, residency) WHERE id = ?",
                    vec![
                        priority.map_or(SqlStorageValue::Null, |p| (p as i64).into()),
                        residency
                            .map_or(SqlStorageValue::Null, |r| r.join(",").into()),
                        id.clone().into(),
                    ],
                )?;
                if cursor.rows_written() == 0 {
                    return Err(ApiError::not_found(format!("no key `{id}`")));
                }
                let rows: Vec<KeyRow> = self
                    .sql(
                        "SELECT id, name, hash, created_ms, priority, residency FROM keys WHERE id = ?",
                        vec![id.clone().into()],
                    )?
                    .to_array()?;
                let key = rows
                    .into_iter()
                    .next()
                    .map(KeyRow::into_key)
                    .ok_or_else(|| ApiError::not_found(format!("no key `{id}`")))?;
                reply::<PatchKey>(&KeyPatchAnswer {
                    id,
                    priority: key.priority,
                    residency: key.residency,
                })
            }
            Route::DeleteKey(id) => {
                let cursor = self.sql("DELETE FROM keys WHERE id = ?", vec![id.clone().into()])?;
                if cursor.rows_written() == 0 {
                    return Err(ApiError::not_found(format!("no key `{id}`")));
                }
                reply::<DeleteKey>(&DeleteAnswer {
                    id,
                    deleted: true,
                    status: None,
                    leases_in_flight: None,
                })
            }
            _ => Err(ApiError::not_found("the directory has no such route")),
        }
    }

    fn sql(
        &self,
        query: &str,
        bindings: Vec<SqlStorageValue>,
    ) -> std::result::Result<SqlCursor, ApiError> {
        Ok(self.state.storage().sql().exec(query, bindings)?)
    }

    /// Whether a client key was ever minted here.
    fn keys_minted(&self) -> std::result::Result<bool, ApiError> {
        #[derive(serde::Deserialize)]
        struct Row {
            #[allow(dead_code)]
            value: i64,
        }
        let rows: Vec<Row> = self
            .sql("SELECT value FROM meta WHERE name = 'keys_minted'", vec![])?
            .to_array()?;
        Ok(!rows.is_empty())
    }

    /// Whether the directory lists `pool`.
    fn has_pool(&self, pool: &str) -> std::result::Result<bool, ApiError> {
        #[derive(serde::Deserialize)]
        struct Row {
            #[allow(dead_code)]
            name: String,
        }
        let rows: Vec<Row> = self
            .sql("SELECT name FROM pools WHERE name = ?", vec![pool.into()])?
            .to_array()?;
        Ok(!rows.is_empty())
    }

    fn list(&self) -> std::result::Result<Vec<PoolEntry>, ApiError> {
        let cursor = self.state.storage().sql().exec(
            "SELECT name, region, location_hint, shards, shard_objects, jurisdiction, residency \
             FROM pools ORDER BY name",
            None,
        )?;
        let cards = self.cards.borrow();
        Ok(cursor
            .to_array::<PoolRow>()?
            .into_iter()
            .map(|r| PoolEntry {
                card: cards.get(&r.name).cloned(),
                name: r.name,
                region: r.region,
                location_hint: r.location_hint,
                shards: r.shards,
                shard_objects: r.shard_objects,
                jurisdiction: r.jurisdiction.unwrap_or_default(),
                residency: split_list(r.residency),
            })
            .collect())
    }

    fn upsert(&self, entry: &PoolEntry) -> std::result::Result<(), ApiError> {
        self.state
            .storage()
            .sql()
            .exec(
                "INSERT INTO pools (name, region, location_hint, shards, shard_objects, jurisdiction, residency) \
                 VALUES (?, ?, ?, ?, ?, ?, ?) \
                 ON CONFLICT(name) DO UPDATE SET region = excluded.region, location_hint = excluded.location_hint, \
                 shards = excluded.shards, shard_objects = MAX(pools.shard_objects, excluded.shard_objects), \
                 jurisdiction = excluded.jurisdiction, residency = excluded.residency",
                vec![
                    entry.name.clone().into(),
                    entry.region.clone().into(),
                    entry.location_hint.clone().map_or(SqlStorageValue::Null, SqlStorageValue::from),
                    i64::from(entry.shards.max(1)).into(),
                    i64::from(entry.all_shards()).into(),
                    entry.jurisdiction.clone().into(),
                    entry.residency.join(",").into(),
                ],
            )?;
        Ok(())
    }
}
