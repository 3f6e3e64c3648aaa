//! The routing core of the LLM gateway: every decision about which vLLM server serves a request,
//! as plain Rust with no I/O.
//!
//! The gateway's Worker parses a request into [`prompt::RequestFeatures`] (model, token estimates,
//! routing key, chained prefix-block hashes); the pool's Durable Object holds one [`pool::Pool`] and
//! asks it for a [`pool::Grant`] (a lease plus ranked candidates), then releases the lease with the
//! outcome. Everything a decision depends on lives here: the backend registry ([`backend`]), probe
//! health ([`health`]), circuit breakers ([`breaker`]), the consistent-hash ring ([`ring`]), the
//! prefix-affinity table ([`affinity`]), the LLM cost model ([`cost`]), leases ([`lease`]), the
//! policies ([`policy`]), admission control and its fair queue ([`admission`]) and Prometheus
//! rendering ([`metrics`]); the probe's reading of vLLM's `/metrics` page ([`scrape`]), the
//! reading of backends' token usage ([`usage`]) and each endpoint's request features
//! ([`endpoint`]) too. The pool coordinator's own rules live in [`coordinator`]: one
//! [`coordinator::Coordinator`] per coordinator shard owns the pool, the retry budget, the drains,
//! the probe reports, the admission queue's waits, the load summary and the history, and answers
//! every call with the effects its Durable Object performs (rows to write, calls to wake, probes,
//! pushes to sibling shards).
//!
//! Time and randomness are inputs: every function that needs the time takes `now_ms: u64`, and every
//! random choice draws from a [`random::RandomSource`] handed in by the caller. The crate has no
//! `worker` dependency and builds for `wasm32-unknown-unknown`, so the same decisions run in the
//! Durable Object, in native tests and in benchmarks.

pub mod admission;
pub mod affinity;
pub mod backend;
pub mod block_hash_encoding;
pub mod breaker;
pub mod coordinator;
pub mod cost;
pub mod endpoint;
pub mod health;
pub mod held_blocks;
pub mod lease;
pub mod metrics;
pub mod outcome;
pub mod policy;
pub mod pool;
pub mod prompt;
pub mod random;
pub mod rate_limit;
pub mod region;
pub mod resume;
pub mod ring;
pub mod routing_key;
pub mod scrape;
pub mod shard;
pub mod time_model;
pub mod usage;

pub use backend::{BackendId, BackendPatch, BackendSpec, Capacity, Lifecycle, Role};
pub use breaker::{BreakerConfig, BreakerSnapshot, BreakerState};
pub use endpoint::Endpoint;
pub use health::{HealthConfig, HealthState};
pub use outcome::{Outcome, OutcomeKind};
pub use policy::{DecisionKind, PolicyKind};
pub use pool::{
    AcquireError, BackendSnapshot, BackendView, CandidateView, ConfigError, Grant, Pool,
    PoolConfig, PoolError, ProbeResult, RouteReceipt,
};
pub use prompt::{FeatureConfig, PromptError, RequestFeatures};
pub use random::{RandomSource, SplitMix64};
