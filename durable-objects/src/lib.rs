//! The gateway's Durable Objects (the protocol the Worker speaks to them is the
//! `coordinator-protocol` crate).
//!
//! - [`pool_coordinator::PoolCoordinator`]: one per GPU pool; registry, health, breakers, leases,
//!   prefix affinity (the rules are `routing_core::coordinator`'s).
//! - [`directory::GatewayDirectory`]: a single instance listing every pool and every minted
//!   client key (as its hash).
//! - [`rate_limiter::ClientRateLimiter`]: one per client key, that client's rate-limit buckets
//!   (`routing_core::request::rate_limit::RateLimiter`).
//! - [`call`]: the route, body and answer of an internal call.
//! - [`probe`]: active health checks.
//! - [`waiting_room`]: the open calls of the acquires waiting in a pool's admission queue.

pub mod call;
pub mod directory;
pub mod pool_coordinator;
pub mod probe;
pub mod rate_limiter;
pub mod registry;
pub mod waiting_room;
