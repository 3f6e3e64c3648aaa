//! What a request's end charges its client's token reservation: the rule the Worker's lease guard
//! settles with (`src/lease_guard.rs`), kept here so it is tested natively.
//!
//! A request is charged an estimate when admitted (prompt plus requested output) and settled when
//! it ends. The backend's own count wins whenever there is one; otherwise what the backend
//! certainly did is charged, never less: a client that hangs up once its request reached a
//! backend has had the prompt's prefill done for it (before the first byte, or while a whole,
//! non-streamed answer was being computed), so a hang-up never refunds the whole reservation.

use super::outcome::{Outcome, OutcomeKind};
use super::usage::Usage;

/// What the client received of a streamed answer, once it started streaming.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Streamed {
    /// The usage the upstream reported in the stream, if it did.
    pub reported: Option<Usage>,
    /// Answer events passed to the client (about one token each).
    pub answer_events: u32,
}

/// The tokens to settle a reservation with, or `None` to keep the estimate it was charged:
///
/// - the usage the backend reported (in the outcome, or in the stream so far);
/// - a stream the client received part of: the prompt's estimate plus an event a token;
/// - a client that hung up (`Cancelled`) with nothing streamed yet: the prompt's estimate for a
///   streamed request (the prefill was done or under way), and the estimate it was charged for a
///   whole (non-streamed) answer, which the backend was computing whole;
/// - a request that failed before any answer (an error status, a timeout, a broken connection):
///   nothing;
/// - an answer whose usage is unknown otherwise: the estimate.
pub fn settled_tokens(
    outcome: &Outcome,
    streamed: Option<Streamed>,
    prompt_estimate: u32,
    stream: bool,
) -> Option<u64> {
    if let (Some(p), Some(c)) = (outcome.prompt_tokens, outcome.completion_tokens) {
        return Some(u64::from(p) + u64::from(c));
    }
    match streamed {
        Some(Streamed {
            reported: Some(u), ..
        }) => return Some(u.total()),
        Some(s) if s.answer_events > 0 => {
            return Some(u64::from(prompt_estimate) + u64::from(s.answer_events))
        }
        _ => {}
    }
    if outcome.kind == OutcomeKind::Cancelled {
        return stream.then_some(u64::from(prompt_estimate));
    }
    if outcome.status.is_some_and(|s| (200..300).contains(&s)) {
        None
    } else {
        Some(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(kind: OutcomeKind, status: Option<u16>) -> Outcome {
        Outcome {
            status,
            ..Outcome::of_kind(kind)
        }
    }

    /// Issue 42, item 2: a hang-up before the first byte, or during a whole answer, refunded
    /// everything although the backend had done the prefill (for a whole answer, all of it).
    #[test]
    fn a_hang_up_never_refunds_the_prompt() {
        let gone = ended(OutcomeKind::Cancelled, None);
        // Streamed, before the first byte: the prompt.
        assert_eq!(settled_tokens(&gone, None, 600, true), Some(600));
        let started = Streamed::default();
        assert_eq!(settled_tokens(&gone, Some(started), 600, true), Some(600));
        // A whole answer: the estimate it was charged (kept), or what the backend reported.
        assert_eq!(settled_tokens(&gone, None, 600, false), None);
        let reported = Outcome {
            prompt_tokens: Some(610),
            completion_tokens: Some(90),
            ..gone.clone()
        };
        assert_eq!(settled_tokens(&reported, None, 600, false), Some(700));
        // After headers, before any token.
        let headers = ended(OutcomeKind::Cancelled, Some(200));
        assert_eq!(settled_tokens(&headers, None, 600, true), Some(600));
    }

    #[test]
    fn reported_usage_wins_then_what_was_streamed_and_failures_cost_nothing() {
        let ok = ended(OutcomeKind::Success, Some(200));
        let usage = Usage {
            prompt_tokens: 12,
            cached_tokens: None,
            completion_tokens: 3,
        };
        let s = |reported, answer_events| {
            Some(Streamed {
                reported,
                answer_events,
            })
        };
        assert_eq!(settled_tokens(&ok, s(Some(usage), 9), 50, true), Some(15));
        assert_eq!(settled_tokens(&ok, s(None, 9), 50, true), Some(59));
        assert_eq!(settled_tokens(&ok, None, 50, false), None);
        let gone = ended(OutcomeKind::Cancelled, Some(200));
        assert_eq!(settled_tokens(&gone, s(None, 500), 10, true), Some(510));
        for failed in [
            ended(OutcomeKind::ServerError, Some(503)),
            ended(OutcomeKind::Timeout, None),
            ended(OutcomeKind::Transport, None),
            ended(OutcomeKind::ClientError, Some(400)),
        ] {
            assert_eq!(
                settled_tokens(&failed, None, 50, true),
                Some(0),
                "{failed:?}"
            );
            assert_eq!(
                settled_tokens(&failed, None, 50, false),
                Some(0),
                "{failed:?}"
            );
        }
    }
}
