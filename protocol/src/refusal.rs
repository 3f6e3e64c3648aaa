//! How each refusal of a pool reads to the client: the one place that turns a
//! `routing_core::pool::Refusal` into its HTTP status, OpenAI error code and message,
//! `Retry-After`, and the queue's drop reason in `x-gateway-queue-drop`. The pool sends its
//! refusals worded this way (with the refusal itself beside the error, see [`crate::call`]), and
//! the Worker answers its client with the same words.
//!
//! Also here: a queue's drop reasons as refusals ([`dropped`], [`drop_reason`]), and the wording
//! of the core's `PoolError` (what a lease or registry operation refused).

use crate::error::{ApiError, ErrorKind};
use crate::names::QUEUE_DROP_HEADER;
use routing_core::admission::DropReason;
use routing_core::pool::{PoolError, Refusal};

/// The refusal of a request that left the pool's queue for `reason`, telling its client to come
/// back after `retry_after_s` (where that means something).
pub fn dropped(reason: DropReason, retry_after_s: u32) -> Refusal {
    match reason {
        DropReason::QueueFull => Refusal::QueueFull { retry_after_s },
        DropReason::TenantLimit => Refusal::TenantLimit { retry_after_s },
        DropReason::Evicted => Refusal::Evicted { retry_after_s },
        DropReason::Timeout => Refusal::QueueTimeout { retry_after_s },
        DropReason::ClientGone => Refusal::ClientGone,
        DropReason::ModelGone => Refusal::ModelGone,
    }
}

/// Why the refused request left the pool's queue, if it waited in one.
pub fn drop_reason(r: &Refusal) -> Option<DropReason> {
    Some(match r {
        Refusal::QueueFull { .. } => DropReason::QueueFull,
        Refusal::TenantLimit { .. } => DropReason::TenantLimit,
        Refusal::Evicted { .. } => DropReason::Evicted,
        Refusal::QueueTimeout { .. } => DropReason::Timeout,
        Refusal::ClientGone => DropReason::ClientGone,
        Refusal::ModelGone => DropReason::ModelGone,
        _ => return None,
    })
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> ApiError {
        let at_capacity = |message: &str| {
            ApiError::unavailable(message.to_string(), 1).with_code("pool_at_capacity")
        };
        let e = match &r {
            Refusal::ModelNotFound { model } => ApiError::model_not_found(model),
            Refusal::NoBackendAvailable { retry_after_s } => ApiError::unavailable(
                "No backend in this pool can take the request now.",
                (*retry_after_s).clamp(1, 3600) as u32,
            ),
            Refusal::AtCapacity => at_capacity("Every backend of this pool is at capacity."),
            Refusal::Full => {
                at_capacity("Every backend of this pool is at capacity; try the next pool.")
            }
            Refusal::Saturated => {
                ApiError::unavailable("This pool is saturated; try the next pool.", 1)
                    .with_code("pool_saturated")
            }
            Refusal::QueueFull { retry_after_s }
            | Refusal::TenantLimit { retry_after_s }
            | Refusal::Evicted { retry_after_s } => ApiError::new(
                429,
                ErrorKind::RateLimit,
                Some("queue_full"),
                "The gateway's queue for this pool is full for you; retry later.",
            )
            .with_retry_after(*retry_after_s),
            Refusal::QueueTimeout { retry_after_s } => ApiError::new(
                503,
                ErrorKind::Server,
                Some("queue_timeout"),
                "The request waited in the gateway's queue as long as it may; retry later.",
            )
            .with_retry_after(*retry_after_s),
            Refusal::ClientGone => ApiError::client_closed(),
            // Looked past by the Worker (another pool may serve the model); never a client's.
            Refusal::ModelGone => ApiError::model_not_found(""),
            Refusal::QueueUnavailable => {
                ApiError::unavailable("The pool's queue is unavailable; retry later.", 1)
                    .with_code("queue_unavailable")
            }
            Refusal::ResponseNotFound { id } => {
                ApiError::response_not_found(id, "previous_response_id")
            }
            Refusal::RetryBudgetExhausted => {
                ApiError::unavailable("The pool's retry budget is exhausted.", 1)
                    .with_code("retry_budget_exhausted")
            }
            Refusal::CannotMove { error } => ApiError::from(error.clone()),
        };
        match drop_reason(&r) {
            Some(reason) => e.with_header(QUEUE_DROP_HEADER, reason.as_str()),
            None => e,
        }
    }
}

impl From<PoolError> for ApiError {
    fn from(e: PoolError) -> ApiError {
        match e {
            PoolError::UnknownBackend { .. } | PoolError::UnknownLease { .. } => {
                ApiError::not_found(e.to_string())
            }
            PoolError::DuplicateBackend { .. } => ApiError::conflict(e.to_string()),
            PoolError::BackendUnavailable { .. } => ApiError::unavailable(e.to_string(), 1),
            PoolError::InvalidSpec { .. } | PoolError::InvalidTransition { .. } => {
                ApiError::bad_request(e.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drop_header(e: &ApiError) -> Option<&str> {
        e.headers
            .iter()
            .find(|(k, _)| k == QUEUE_DROP_HEADER)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn queue_drops_name_their_reason_and_when_to_come_back() {
        let e = ApiError::from(dropped(DropReason::TenantLimit, 3));
        assert_eq!((e.status, e.retry_after_s), (429, Some(3)));
        assert_eq!(e.code.as_deref(), Some("queue_full"));
        assert_eq!(drop_header(&e), Some("tenant_limit"));
        let e = ApiError::from(dropped(DropReason::Timeout, 61));
        assert_eq!((e.status, e.retry_after_s), (503, Some(61)));
        assert_eq!(drop_header(&e), Some("queue_timeout"));
        let gone = ApiError::from(dropped(DropReason::ClientGone, 9));
        assert_eq!((gone.status, gone.retry_after_s), (499, None));
        assert_eq!(drop_header(&gone), Some("client_gone"));
        for reason in DropReason::ALL {
            let refusal = dropped(reason, 1);
            assert_eq!(drop_reason(&refusal), Some(reason));
            // The client's code is the one the queue's metrics and docs give the reason.
            assert_eq!(ApiError::from(refusal).code.as_deref(), Some(reason.code()));
        }
    }

    #[test]
    fn pool_refusals_say_where_to_go_next() {
        let saturated = ApiError::from(Refusal::Saturated);
        assert_eq!((saturated.status, saturated.retry_after_s), (503, Some(1)));
        assert_eq!(saturated.code.as_deref(), Some("pool_saturated"));
        let full = ApiError::from(Refusal::Full);
        assert_eq!(full.code.as_deref(), Some("pool_at_capacity"));
        assert!(full.message.ends_with("try the next pool."));
        assert_eq!(drop_header(&full), None);
        let busy = ApiError::from(Refusal::NoBackendAvailable { retry_after_s: 0 });
        assert_eq!((busy.status, busy.retry_after_s), (503, Some(1)));
        assert_eq!(busy.code.as_deref(), Some("no_backend_available"));
        let missing = ApiError::from(Refusal::ModelNotFound { model: "m".into() });
        assert_eq!(missing, ApiError::model_not_found("m"));
        let lost = ApiError::from(Refusal::ResponseNotFound {
            id: "resp_1".into(),
        });
        assert_eq!(
            (lost.status, lost.code.as_deref()),
            (404, Some("response_not_found"))
        );
        assert_eq!(lost.param.as_deref(), Some("previous_response_id"));
        assert!(lost.message.contains("resp_1"));
    }

    #[test]
    fn a_retry_refusal_reads_like_the_pool_error_behind_it() {
        let spent = ApiError::from(Refusal::RetryBudgetExhausted);
        assert_eq!(spent.code.as_deref(), Some("retry_budget_exhausted"));
        let full = Refusal::CannotMove {
            error: PoolError::BackendUnavailable { id: "b".into() },
        };
        assert_eq!(ApiError::from(full).status, 503);
        let lost = Refusal::CannotMove {
            error: PoolError::UnknownLease { lease_id: 3 },
        };
        assert_eq!(ApiError::from(lost).status, 404);
    }
}
