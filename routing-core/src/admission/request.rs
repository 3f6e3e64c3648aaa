//! What waits in the queue and how it leaves: the Worker's [`AdmissionRequest`] (tenant,
//! priority, wait limit), the queued [`Waiting`] request under its [`Ticket`], and its
//! [`Departure`]: granted, or dropped for a [`DropReason`].

use crate::pool::{AdmissionConfig, Grant};
use crate::request::prompt::RequestFeatures;
use serde::{Deserialize, Serialize};

/// A queued request's handle, chosen by the queue.
pub type Ticket = u64;

/// Largest ticket handed out (2^53 - 1, so it survives JavaScript numbers).
pub const MAX_TICKET: u64 = (1 << 53) - 1;

/// Who is asking and how urgently: the admission part of an acquire, as the Worker sends it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdmissionRequest {
    /// The tenant (client key id, else `x-tenant-id`, else a salted hash of the client's
    /// address, else `anonymous`).
    pub tenant: String,
    /// Priority band; higher is served first (default 0).
    pub priority: i32,
    /// The client's own limit on its wait, ms (`x-gateway-max-wait-ms`); the pool's applies if
    /// shorter.
    pub max_wait_ms: Option<u64>,
    /// The ticket of an earlier call that answered "still queued": this call continues that wait.
    pub ticket: Option<Ticket>,
    /// How long the Worker has already waited for this request, ms (so a request re-entering a
    /// restarted Durable Object keeps its place in time and its deadline).
    pub waited_ms: u64,
    /// The Worker's own id for this wait (random, 1 to [`MAX_TICKET`]), chosen before the first
    /// call: the pool files the request under it as its ticket when it is free, so a Worker whose
    /// client hangs up before any answer can still name the wait (and a grant already on its
    /// way) in a dequeue.
    pub wait_id: Option<Ticket>,
}

impl AdmissionRequest {
    /// The ticket a new request from this caller is filed under, if the caller chose a usable
    /// one: its `wait_id`, when in range and `free`.
    pub fn chosen_ticket(&self, free: impl Fn(Ticket) -> bool) -> Option<Ticket> {
        self.wait_id
            .filter(|t| (1..=MAX_TICKET).contains(t) && free(*t))
    }
}

/// Lowest and highest accepted priority.
pub const PRIORITY_RANGE: (i32, i32) = (-1000, 1000);

/// Why a request left the queue without a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// The queue was full and the tenant already had its share of it (429 `queue_full`).
    QueueFull,
    /// The tenant had `max_queue_per_tenant` requests waiting (429 `queue_full`).
    TenantLimit,
    /// Dropped from a full queue to make room for a tenant under its share (429 `queue_full`).
    Evicted,
    /// Its wait reached its deadline (503 `queue_timeout`).
    Timeout,
    /// Its client left: hung up, or its Worker stopped asking.
    ClientGone,
    /// No backend of the pool serves its model any more (404 `model_not_found`).
    ModelGone,
}

impl DropReason {
    /// Every reason, in a stable order (for metrics).
    pub const ALL: [DropReason; 6] = [
        DropReason::QueueFull,
        DropReason::TenantLimit,
        DropReason::Evicted,
        DropReason::Timeout,
        DropReason::ClientGone,
        DropReason::ModelGone,
    ];

    /// The reason's name in metrics and the `x-gateway-queue-drop` header.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::QueueFull => "queue_full",
            DropReason::TenantLimit => "tenant_limit",
            DropReason::Evicted => "evicted",
            DropReason::Timeout => "queue_timeout",
            DropReason::ClientGone => "client_gone",
            DropReason::ModelGone => "model_gone",
        }
    }

    /// The OpenAI error code a client sees.
    pub fn code(self) -> &'static str {
        match self {
            DropReason::QueueFull | DropReason::TenantLimit | DropReason::Evicted => "queue_full",
            DropReason::Timeout => "queue_timeout",
            DropReason::ClientGone => "client_closed_request",
            DropReason::ModelGone => "model_not_found",
        }
    }

    pub(super) fn index(self) -> usize {
        DropReason::ALL.iter().position(|r| *r == self).unwrap_or(0)
    }
}

/// A request waiting for capacity.
#[derive(Debug, Clone, PartialEq)]
pub struct Waiting {
    /// Its handle.
    pub ticket: Ticket,
    /// Its tenant.
    pub tenant: String,
    /// Its priority band.
    pub priority: i32,
    /// Estimated tokens (prompt plus `max_tokens`, at least 1): its deficit-round-robin cost.
    pub cost: u64,
    /// When it arrived (pool time).
    pub arrived_ms: u64,
    /// When it times out.
    pub deadline_ms: u64,
    /// What the pool needs to route it.
    pub features: RequestFeatures,
}

impl Waiting {
    /// A waiting request for `features` from `who`, arriving `now_ms` (less what it already
    /// waited elsewhere) with the pool's `config`.
    pub fn new(
        ticket: Ticket,
        features: RequestFeatures,
        who: &AdmissionRequest,
        config: &AdmissionConfig,
        now_ms: u64,
    ) -> Waiting {
        let max_wait = who
            .max_wait_ms
            .map_or(config.max_wait_ms, |m| m.min(config.max_wait_ms));
        let arrived_ms = now_ms.saturating_sub(who.waited_ms);
        Waiting {
            ticket,
            tenant: who.tenant.clone(),
            priority: who.priority.clamp(PRIORITY_RANGE.0, PRIORITY_RANGE.1),
            cost: (u64::from(features.prompt_tokens) + u64::from(features.max_tokens)).max(1),
            arrived_ms,
            deadline_ms: arrived_ms.saturating_add(max_wait),
            features,
        }
    }
}

/// What happened to a queued request.
#[derive(Debug, Clone, PartialEq)]
pub enum Departure {
    /// It got a lease.
    Admitted {
        /// Its handle.
        ticket: Ticket,
        /// The lease.
        grant: Grant,
        /// Time spent in the queue.
        waited_ms: u64,
    },
    /// It left without one.
    Dropped {
        /// Its handle.
        ticket: Ticket,
        /// Why.
        reason: DropReason,
        /// Time spent in the queue.
        waited_ms: u64,
    },
}

impl Departure {
    /// The request's handle.
    pub fn ticket(&self) -> Ticket {
        match self {
            Departure::Admitted { ticket, .. } | Departure::Dropped { ticket, .. } => *ticket,
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::test_support::{config, features};

    #[test]
    fn waiting_takes_the_shorter_wait_and_keeps_time_already_waited() {
        let who = AdmissionRequest {
            tenant: "t".into(),
            priority: 5000,
            max_wait_ms: Some(2_000),
            waited_ms: 500,
            ..AdmissionRequest::default()
        };
        let w = Waiting::new(7, features("hi", 10), &who, &config(), 10_000);
        assert_eq!((w.arrived_ms, w.deadline_ms), (9_500, 11_500));
        assert_eq!(w.priority, PRIORITY_RANGE.1, "priority is clamped");
        assert_eq!(w.cost, u64::from(w.features.prompt_tokens) + 10);
        let long = AdmissionRequest {
            max_wait_ms: Some(999_999),
            ..who
        };
        let w = Waiting::new(8, features("hi", 10), &long, &config(), 10_000);
        assert_eq!(
            w.deadline_ms,
            9_500 + config().max_wait_ms,
            "the pool's limit caps the client's"
        );
    }

    #[test]
    fn a_wait_id_is_the_ticket_only_when_in_range_and_free() {
        let mut who = AdmissionRequest::default();
        assert_eq!(who.chosen_ticket(|_| true), None);
        who.wait_id = Some(77);
        assert_eq!(who.chosen_ticket(|_| true), Some(77));
        assert_eq!(who.chosen_ticket(|t| t != 77), None, "in use");
        who.wait_id = Some(0);
        assert_eq!(who.chosen_ticket(|_| true), None);
        who.wait_id = Some(MAX_TICKET + 1);
        assert_eq!(who.chosen_ticket(|_| true), None);
    }
}
