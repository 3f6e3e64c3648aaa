//! What a request's end charges its client's token reservation: the rule the Worker's lease guard
//! settles with (`src/request/lease/lease_guard.rs`), kept here so it is tested natively.
//!
//! A request is charged an estimate when admitted (prompt plus requested output) and settled when
//! it ends. The backend's own count wins whenever there is one; otherwise what the backend
//! certainly did is charged, never less: a client that hangs up once its request reached a
//! backend has had the prompt's prefill done for it (before the first byte, or while a whole,
//! non-streamed answer was being computed), so a hang-up never refunds the whole reservation.
//!
//! A stream the client received part of without its usage (it hung up, or the stream broke) is
//! charged the prompt's estimate plus the completion tokens it received. An answer event is one
//! token only without speculative decoding (vLLM then streams each step's accepted draft tokens
//! and the sampled one as one event), so the Worker has the backend's tokenizer count the text
//! received ([`Streamed::counted`], vLLM's `POST /tokenize`) whenever [`counts_received`] says the
//! charge depends on it; one token per event is the fallback, and the floor.

use super::outcome::{Outcome, OutcomeKind};
use super::usage::Usage;

/// What the client received of a streamed answer, once it started streaming.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Streamed {
    /// The usage the upstream reported in the stream, if it did, as the client was told it (a
    /// resumed stream's: the prompt once, every completion token).
    pub reported: Option<Usage>,
    /// Answer events passed to the client (one token or more each).
    pub answer_events: u32,
    /// The tokens of the answer text the client received, as the backend's tokenizer counts them,
    /// once asked ([`counts_received`]).
    pub counted: Option<u32>,
}

impl Streamed {
    /// Completion tokens the client received, when the stream reported none: the tokenizer's
    /// count, never fewer than the answer events (each carried at least one token).
    pub fn received_tokens(&self) -> u32 {
        self.counted.unwrap_or(0).max(self.answer_events)
    }
}

/// Whether what `outcome`'s request is charged rests on counting what the client received (no
/// usage came, in the outcome or the stream, and some answer did): then a tokenizer's count of the
/// text is worth asking for.
pub fn counts_received(outcome: &Outcome, streamed: &Streamed) -> bool {
    let reported = outcome.prompt_tokens.is_some() && outcome.completion_tokens.is_some();
    !reported && streamed.reported.is_none() && streamed.answer_events > 0
}

/// The usage a request is charged, as its client sees it, when it is known by parts (the access
/// log shows it): the usage the stream reported (a resumed stream's totals), else the backend's in
/// the outcome, else for a stream the client received part of, the prompt's estimate and the
/// tokens received ([`Streamed::received_tokens`]). `None` otherwise.
pub fn charged_usage(
    outcome: &Outcome,
    streamed: Option<Streamed>,
    prompt_estimate: u32,
) -> Option<Usage> {
    if let Some(u) = streamed.and_then(|s| s.reported) {
        return Some(u);
    }
    if let (Some(p), Some(c)) = (outcome.prompt_tokens, outcome.completion_tokens) {
        return Some(Usage {
            prompt_tokens: p,
            cached_tokens: outcome.cached_tokens,
            completion_tokens: c,
        });
    }
    streamed.filter(|s| s.answer_events > 0).map(|s| Usage {
        prompt_tokens: prompt_estimate,
        cached_tokens: None,
        completion_tokens: s.received_tokens(),
    })
}

/// The tokens to settle a reservation with, or `None` to keep the estimate it was charged:
///
/// - the usage the backend reported (in the stream so far, or in the outcome);
/// - a stream the client received part of: the prompt's estimate plus the tokens received (the
///   tokenizer's count, else an event a token);
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
    if let Some(u) = charged_usage(outcome, streamed, prompt_estimate) {
        return Some(u.total());
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
                counted: None,
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

    /// Issue 42: with speculative decoding an event carries several tokens; a hang-up mid-stream
    /// was charged one token per event. The tokenizer's count of the text received wins, never
    /// below the events.
    #[test]
    fn a_hang_up_mid_stream_is_charged_the_tokens_counted_not_the_events() {
        let gone = ended(OutcomeKind::Cancelled, Some(200));
        let events = Streamed {
            reported: None,
            answer_events: 20,
            counted: None,
        };
        assert!(counts_received(&gone, &events));
        assert_eq!(settled_tokens(&gone, Some(events), 30, true), Some(50));
        let counted = Streamed {
            counted: Some(41),
            ..events
        };
        assert_eq!(settled_tokens(&gone, Some(counted), 30, true), Some(71));
        assert_eq!(
            charged_usage(&gone, Some(counted), 30),
            Some(Usage {
                prompt_tokens: 30,
                cached_tokens: None,
                completion_tokens: 41,
            })
        );
        // A count below the events (a tokenizer merging across them) is floored at the events.
        let low = Streamed {
            counted: Some(12),
            ..events
        };
        assert_eq!(settled_tokens(&gone, Some(low), 30, true), Some(50));
        // Usage the stream reported (continuous usage stats: the last one seen) needs no count.
        let usage = Usage {
            prompt_tokens: 30,
            cached_tokens: Some(16),
            completion_tokens: 44,
        };
        let reported = Streamed {
            reported: Some(usage),
            ..events
        };
        assert!(!counts_received(&gone, &reported));
        assert_eq!(settled_tokens(&gone, Some(reported), 30, true), Some(74));
        assert_eq!(charged_usage(&gone, Some(reported), 30), Some(usage));
        // Nothing streamed: nothing to count.
        assert!(!counts_received(&gone, &Streamed::default()));
    }
}
