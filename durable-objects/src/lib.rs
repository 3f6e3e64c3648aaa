//! The gateway's Durable Objects and the protocol the Worker speaks to them.
//!
//! - [`pool_coordinator::PoolCoordinator`]: one per GPU pool; registry, health, breakers, leases,
//!   prefix affinity (the decisions are `routing_core`'s).
//! - [`directory::PoolDirectory`]: a single instance listing every pool.
//! - [`protocol`]: the internal routes and bodies; [`api_error`]: the OpenAI-style error shape.
//! - [`probe`] and [`timed_fetch`]: active health checks and outbound fetches with deadlines.
//! - [`waiting_room`]: acquires waiting in a pool's admission queue.

// `ApiError` carries a whole OpenAI error body (status, message, type, param, code, extra
// headers) and travels only on the error path, where moving it costs nothing next to the
// response it becomes; boxing it would only add an allocation.
#![allow(clippy::result_large_err)]

pub mod api_error;
pub mod directory;
pub mod pool_coordinator;
pub mod probe;
pub mod protocol;
pub mod rate_limiter;
pub mod registry;
pub mod timed_fetch;
pub mod waiting_room;
