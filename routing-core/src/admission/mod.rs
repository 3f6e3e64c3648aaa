//! Admission control: when every backend is full, requests wait in the gateway's own queue, in an
//! order the operator chose, instead of piling up invisibly in vLLM's first-come-first-served one.
//!
//! **Capacity.** A backend takes a new lease only while it has room ([`has_room`]): fewer live
//! leases than its `max_num_seqs`, and, when its KV-cache size is known, in-flight tokens plus the
//! request's within its KV capacity. With an empty queue a backend may be pushed `overcommit` over
//! capacity (0 = strict), so the GPU's batch stays full across the round trip between a lease
//! ending and the next grant.
//!
//! **Order.** The [`AdmissionQueue`] serves the highest priority band first. Within a band, tenants
//! share by deficit round robin weighted by estimated tokens (prompt plus `max_tokens`): each turn
//! gives a tenant `quantum_tokens` of credit, and its oldest request is served once its credit
//! covers the request's cost, so a tenant sending long requests gets the same tokens as one
//! sending short ones, not the same number of requests. Within a tenant, arrival order. A round in
//! which nobody could pay is skipped in one step, so a small quantum costs no time.
//!
//! **No head-of-line blocking.** The dispatcher walks the whole queue in that order and places
//! every request it can: a request whose backends are full is passed over together with every
//! later one for the same model (and role), so a request for a model with idle backends is placed
//! at once behind any number waiting for a saturated one, and a lower band's request is placed
//! only when no higher-band request could use the room. It runs only when room may have appeared
//! (a lease share ended, a probe, a registry or configuration change), never per call.
//!
//! **Look-ahead.** When a lease ends on backend X, the dispatcher looks at the next `lookahead`
//! placeable requests that order would serve and serves first the one whose prefix X holds
//! longest. The window only ever holds requests of the band being served, and a request served
//! early is charged to its tenant's credit at once (which may go negative), so no request is
//! overtaken by more than `lookahead - 1` others of placeable models that the order would have
//! served after it, and tenants' long-run shares are unchanged.
//!
//! **Leaving.** A request leaves the queue granted, or dropped for a [`DropReason`]: the queue or
//! its tenant's share of it is full, it was evicted to make room for a tenant under its share,
//! its wait passed its deadline, or its client left. Time is passed in; nothing here does I/O.//!
//! The files: `request` (what waits and how it leaves), `delivered` (grants answered recently,
//! for a dequeue from a Worker that never read its grant), `fair_share` (one priority band's
//! deficit round robin between tenants), `queue` (the [`AdmissionQueue`]: bands, limits,
//! eviction, the service plan), `dispatch` (granting leases from the [`Pool`](crate::pool::Pool)
//! as backends free up), `stats` and `render` (the queue's counters and their Prometheus text).
//! The capacity rule ([`has_room`]) and the knobs ([`AdmissionConfig`]) are the pool's, since a
//! pool applies them even to a request that never queues; they are re-exported here.

mod delivered;
mod dispatch;
mod fair_share;
mod queue;
mod render;
mod request;
#[cfg(test)]
mod shard_priority;
mod stats;
#[cfg(test)]
mod test_support;

pub use crate::pool::{has_room, AdmissionConfig, MAX_QUEUE};
pub use delivered::{DeliveredGrants, DELIVERED_KEEP_MS, DELIVERED_MAX};
pub use queue::AdmissionQueue;
pub use request::{
    AdmissionRequest, Departure, DropReason, Ticket, Waiting, MAX_TICKET, PRIORITY_RANGE,
};
pub use stats::{AdmissionStats, WAIT_BUCKETS_MS};
