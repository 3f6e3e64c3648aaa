//! The names both sides agree on outside the message bodies: the headers internal calls carry,
//! the pool coordinator's binding and the default pool. Kept apart from the messages so the error
//! type can name a header without depending on them.

/// Header carrying the pool's name on every call to a pool coordinator (a Durable Object does not
/// know the name it was addressed by).
pub const POOL_HEADER: &str = "x-gateway-pool";
/// Header carrying the coordinator shard's index next to [`POOL_HEADER`] (absent: shard 0).
pub const SHARD_HEADER: &str = "x-gateway-shard";
/// Binding name of the pool coordinator namespace (wrangler.toml), for the Worker and for shards
/// calling their siblings.
pub const POOL_BINDING: &str = "POOL";
/// Header of a granted acquire: milliseconds the request waited in the pool's queue.
pub const QUEUE_WAIT_HEADER: &str = "x-gateway-queue-wait-ms";
/// Header of a request refused or dropped by admission control: the drop reason.
pub const QUEUE_DROP_HEADER: &str = "x-gateway-queue-drop";
/// The name a pool gets when a registration names none.
pub const DEFAULT_POOL: &str = "default";
/// Binding name of the directory namespace (wrangler.toml).
pub const DIRECTORY_BINDING: &str = "DIRECTORY";
/// The name of the single directory instance.
pub const DIRECTORY_NAME: &str = "directory";
