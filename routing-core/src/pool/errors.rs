//! What can go wrong: [`PoolError`] for registry and lease operations, [`AcquireError`] when no
//! lease is granted, and [`Refusal`], every reason a pool answers "no" to an acquire or a retry,
//! as it travels back to the Worker.

use crate::backend::{BackendId, Lifecycle};
use crate::pool::lease::LeaseId;
use crate::region::walk::{RefusalKind, WalkRefusal};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Errors of the registry and lease operations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "error", rename_all = "snake_case")]
pub enum PoolError {
    /// No backend has this id.
    UnknownBackend {
        /// The id asked for.
        id: BackendId,
    },
    /// A backend with this id already exists.
    DuplicateBackend {
        /// The id asked for.
        id: BackendId,
    },
    /// The spec or patch is invalid.
    InvalidSpec {
        /// Why.
        reason: String,
    },
    /// The lifecycle change is not allowed.
    InvalidTransition {
        /// Current lifecycle.
        from: Lifecycle,
        /// Requested lifecycle.
        to: Lifecycle,
    },
    /// No live lease has this id (released, expired or never granted).
    UnknownLease {
        /// The id asked for.
        lease_id: LeaseId,
    },
    /// The backend cannot take the request now (not ready, unhealthy, breaker open, saturated).
    BackendUnavailable {
        /// The backend.
        id: BackendId,
    },
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::UnknownBackend { id } => write!(f, "no backend `{id}`"),
            PoolError::DuplicateBackend { id } => write!(f, "backend `{id}` already exists"),
            PoolError::InvalidSpec { reason } => write!(f, "invalid backend: {reason}"),
            PoolError::InvalidTransition { from, to } => write!(
                f,
                "cannot move a backend from {} to {}",
                from.as_str(),
                to.as_str()
            ),
            PoolError::UnknownLease { lease_id } => write!(f, "no live lease {lease_id}"),
            PoolError::BackendUnavailable { id } => write!(f, "backend `{id}` is unavailable"),
        }
    }
}

impl std::error::Error for PoolError {}

/// Why no lease was granted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "error", rename_all = "snake_case")]
pub enum AcquireError {
    /// No backend in the pool serves the model (the Worker answers 404 `model_not_found`).
    ModelNotFound {
        /// The model asked for.
        model: String,
    },
    /// Backends serve the model but none can take a request now (the Worker answers 503 with
    /// `Retry-After`).
    NoBackendAvailable {
        /// Seconds until a breaker cooldown or saturation mark ends (at least 1).
        retry_after_s: u64,
    },
    /// Backends serve the model and are up, but every one is at its admission capacity (only with
    /// admission control on: the request may wait in the pool's queue).
    AtCapacity,
    /// The request names a stored response (`previous_response_id`) no backend of the pool can
    /// serve: the pool has no record of it, or the backend holding it left the pool or is down
    /// (the Worker answers 404 `response_not_found`).
    ResponseNotFound {
        /// The response id asked for.
        id: String,
    },
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AcquireError::ModelNotFound { model } => {
                write!(f, "the model `{model}` does not exist in this pool")
            }
            AcquireError::NoBackendAvailable { retry_after_s } => write!(
                f,
                "no backend is available for this model; retry after {retry_after_s} s"
            ),
            AcquireError::AtCapacity => f.write_str("every backend for this model is at capacity"),
            AcquireError::ResponseNotFound { id } => {
                write!(f, "no backend of this pool holds the response `{id}`")
            }
        }
    }
}

impl std::error::Error for AcquireError {}

/// Why a pool did not grant a lease (or move one): the core's [`AcquireError`]s, and what the pool
/// coordinator adds around them (spillover, its queue, its retry budget). It travels to the Worker
/// typed; `coordinator_protocol` words each one for the client, in one place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum Refusal {
    /// No backend in the pool serves the model ([`AcquireError::ModelNotFound`]).
    ModelNotFound {
        /// The model asked for.
        model: String,
    },
    /// Backends serve the model but none can take a request now
    /// ([`AcquireError::NoBackendAvailable`]).
    NoBackendAvailable {
        /// Seconds until a breaker cooldown or saturation mark ends.
        retry_after_s: u64,
    },
    /// Every backend is at its admission capacity and the pool does not queue the request
    /// ([`AcquireError::AtCapacity`]).
    AtCapacity,
    /// The pool is saturated and a further pool could take the request: try that one.
    Saturated,
    /// Every backend is at its admission capacity and a further pool could take the request: try
    /// that one (the request did not join this pool's queue).
    Full,
    /// The request left the pool's queue: the queue is full.
    QueueFull {
        /// Seconds a client should wait.
        retry_after_s: u32,
    },
    /// The request left the pool's queue: its tenant's share of the queue is full.
    TenantLimit {
        /// Seconds a client should wait.
        retry_after_s: u32,
    },
    /// The request left the pool's queue: a more urgent request took its place.
    Evicted {
        /// Seconds a client should wait.
        retry_after_s: u32,
    },
    /// The request waited in the pool's queue as long as it may.
    QueueTimeout {
        /// Seconds a client should wait.
        retry_after_s: u32,
    },
    /// The request's client left while it waited.
    ClientGone,
    /// The request waited, and meanwhile no backend of the pool serves its model any more.
    ModelGone,
    /// The pool's queue stopped answering while the request waited in it (the Worker's verdict
    /// after several failed calls in a row).
    QueueUnavailable,
    /// The request names a stored response no backend of the pool holds
    /// ([`AcquireError::ResponseNotFound`]); a further pool may hold it.
    ResponseNotFound {
        /// The response id asked for.
        id: String,
    },
    /// A retry: the pool's retry budget is spent (the lease ended with the failure).
    RetryBudgetExhausted,
    /// A retry: the pool could not move the lease to the candidate asked for.
    CannotMove {
        /// Why.
        error: PoolError,
    },
}

impl From<AcquireError> for Refusal {
    fn from(e: AcquireError) -> Refusal {
        match e {
            AcquireError::ModelNotFound { model } => Refusal::ModelNotFound { model },
            AcquireError::NoBackendAvailable { retry_after_s } => {
                Refusal::NoBackendAvailable { retry_after_s }
            }
            AcquireError::AtCapacity => Refusal::AtCapacity,
            AcquireError::ResponseNotFound { id } => Refusal::ResponseNotFound { id },
        }
    }
}

impl WalkRefusal for Refusal {
    fn kind(&self) -> RefusalKind {
        match self {
            Refusal::ModelNotFound { .. }
            | Refusal::ModelGone
            | Refusal::ResponseNotFound { .. } => RefusalKind::NotServed,
            Refusal::AtCapacity | Refusal::Full => RefusalKind::Full,
            Refusal::Saturated => RefusalKind::Saturated,
            Refusal::NoBackendAvailable { .. }
            | Refusal::QueueUnavailable
            | Refusal::RetryBudgetExhausted
            | Refusal::CannotMove { .. } => RefusalKind::Busy,
            Refusal::QueueFull { .. }
            | Refusal::TenantLimit { .. }
            | Refusal::Evicted { .. }
            | Refusal::QueueTimeout { .. }
            | Refusal::ClientGone => RefusalKind::Final,
        }
    }
}

/// Seconds suggested to retry after when no breaker or saturation mark says better (a backend
/// that is pending, loading or unhealthy waits for the next probe).
pub const DEFAULT_RETRY_AFTER_S: u64 = 5;

pub(super) fn unknown(id: &BackendId) -> PoolError {
    PoolError::UnknownBackend { id: id.clone() }
}
