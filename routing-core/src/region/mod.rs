//! Routing between pools: which pool, in which region, a request goes to.
//!
//! Inside a pool the coordinator chooses a backend on predicted time; between pools the Worker
//! chooses on predicted time too, the network included. Each pool's coordinator publishes a
//! [`TimeCard`] (its predicted time to first token for a few request classes, its queue and its
//! capacity) with the pool list the Worker already caches; the Worker adds the round trip from its
//! colo to each pool ([`NetworkModel`]: a configured table refined by its own measurements) and
//! the prefix it knows a pool holds for the conversation ([`HomePools`]), and
//! [`order_pools`] puts the pools in the order to try them, with the reason for the first. Pools
//! outside the request's allowed jurisdictions never take part (residency). [`PoolWalk`] walks
//! that order, reading each pool's refusal: spill over, wait at the nearest full pool, fall back
//! to the nearest saturated one, or stop.
//!
//! Everything here is pure: the time, the cards and a uniform random number are inputs.

pub mod choice;
pub mod home;
pub mod network;
pub mod routed;
pub mod time_card;
pub mod walk;

pub use choice::{order_pools, ChoiceConfig, ChoiceReason, PoolChoice, PoolOption};
pub use home::HomePools;
pub use network::NetworkModel;
pub use routed::{ChoiceNote, RoutedCounts};
pub use time_card::TimeCard;
pub use walk::{
    AfterAnswer, NextPool, PoolAnswer, PoolWalk, RefusalKind, Turn, WalkEnd, WalkRefusal,
};
