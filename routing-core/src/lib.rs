//! The routing core of the LLM gateway: every decision about which vLLM server serves a request,
//! as plain Rust with no I/O.
//!
//! The gateway's Worker parses a request into [`request::prompt::RequestFeatures`] (model, token
//! estimates, routing key, chained prefix-block hashes); the pool's Durable Object holds one
//! [`pool::Pool`] and asks it for a [`pool::Grant`] (a lease plus ranked candidates), then releases
//! the lease with the outcome. The folders follow a request through the gateway:
//!
//! - [`request`]: what a client request is: its endpoint, its features (prompt, token estimates,
//!   block hashes and their wire form), its routing key, the role it may ask for, and the
//!   per-client rate limits it is charged against;
//! - [`stream`]: an answer as it streams and ends: the backends' token usage, a broken stream's
//!   resumption and the [`Outcome`] a lease is released with;
//! - [`backend`]: one backend's state: its spec, probe health, circuit breaker, scraped `/metrics`
//!   gauges, cost model, time model and the KV blocks its running requests hold;
//! - [`policy`]: the routing policies that rank eligible backends (and the consistent-hash ring
//!   the sticky ones walk);
//! - [`pool`]: one pool of backends and every decision about it: the registry, the acquire walk,
//!   leases, the prefix-affinity table and the coordinator shards' split of the key space;
//! - [`admission`]: admission control and its fair queue; [`region`]: choosing among regions'
//!   pools; [`metrics`]: Prometheus rendering;
//! - [`coordinator`]: the pool coordinator's own rules: one [`coordinator::Coordinator`] per
//!   coordinator shard owns the pool, the retry budget, the drains, the probe reports, the
//!   admission queue's waits, the load summary and the history, and answers every call with the
//!   effects its Durable Object performs (rows to write, calls to wake, probes, pushes to sibling
//!   shards).
//!
//! Imports go one way: `request` imports nothing here, `stream` imports `request`, `backend`
//! imports both, `policy` imports `backend`, `pool` imports all of these (and `region`), and
//! `admission` and `coordinator` sit on top of `pool`.
//!
//! Time and randomness are inputs: every function that needs the time takes `now_ms: u64`, and every
//! random choice draws from a [`random::RandomSource`] handed in by the caller. The crate has no
//! `worker` dependency and builds for `wasm32-unknown-unknown`, so the same decisions run in the
//! Durable Object, in native tests and in benchmarks.

pub mod admission;
pub mod backend;
pub mod coordinator;
pub mod metrics;
pub mod policy;
pub mod pool;
pub mod random;
pub mod region;
pub mod request;
pub mod stream;

pub use backend::breaker::{BreakerConfig, BreakerSnapshot, BreakerState};
pub use backend::health::{HealthConfig, HealthState};
pub use backend::{BackendId, BackendPatch, BackendSpec, Capacity, Lifecycle};
pub use policy::{DecisionKind, PolicyKind};
pub use pool::{
    AcquireError, BackendSnapshot, BackendView, CandidateView, ConfigError, Grant, Pool,
    PoolConfig, PoolError, ProbeResult, RouteReceipt,
};
pub use random::{RandomSource, SplitMix64};
pub use request::endpoint::Endpoint;
pub use request::prompt::{FeatureConfig, PromptError, RequestFeatures};
pub use request::role::Role;
pub use stream::outcome::{Outcome, OutcomeKind};
