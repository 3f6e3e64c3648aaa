//! A granted lease until it is given back: `lease_guard.rs` (renewal, release with the outcome,
//! the access log, the token settlement) and `releases.rs` (an isolate's releases batched per pool
//! shard).

pub mod lease_guard;
pub mod releases;
