//! The gateway's Durable Objects and the protocol the Worker speaks to them.
//!
//! - [`pool_coordinator::PoolCoordinator`]: one per GPU pool; registry, health, leases.
//! - [`directory::PoolDirectory`]: a single instance listing every pool.
//! - [`protocol`]: the internal routes and bodies; [`api_error`]: the OpenAI-style error shape.

pub mod api_error;
pub mod directory;
pub mod pool_coordinator;
pub mod protocol;
pub mod registry;
