//! A pool's time card: what its coordinator predicts a new request would wait there for its
//! first token, for a few request classes, published with the pool list so the Worker can compare
//! pools without asking any of them on the request path.
//!
//! The classes are points on one curve: a prompt with nothing to prefill (fully cached), one with
//! [`SHORT_TOKENS`] uncached tokens and one with [`LONG_TOKENS`]. Each point is the pool's best
//! backend's predicted time to first token for such a request (the time model's queue, prefill
//! and the waits for memory and sequence slots it knows of), so a request of `u` uncached tokens is
//! predicted by the straight lines between the points. A pool whose backends cannot take a
//! request now (none ready, all full) publishes no points; its admission queue's predicted wait is
//! added to every point.

use serde::{Deserialize, Serialize};

/// Uncached prompt tokens of the card's short class.
pub const SHORT_TOKENS: u32 = 1024;
/// Uncached prompt tokens of the card's long class.
pub const LONG_TOKENS: u32 = 8192;
/// Output tokens the card's made-up requests ask for ([`TimeCard::decode_ms`] is their decode).
pub const CARD_OUTPUT_TOKENS: u32 = 256;

/// A pool's published prediction (compact: it travels with every pool listing).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TimeCard {
    /// When the pool computed it, in ms since the epoch (the pool's clock).
    pub at_ms: u64,
    /// Predicted time to first token for a prompt with nothing to prefill, in ms; `None` when no
    /// backend of the pool can take a request now.
    pub cached_ms: Option<u32>,
    /// The same for [`SHORT_TOKENS`] uncached tokens.
    pub short_ms: Option<u32>,
    /// The same for [`LONG_TOKENS`] uncached tokens.
    pub long_ms: Option<u32>,
    /// Requests waiting in the pool's admission queue.
    pub queued: u32,
    /// Predicted wait in that queue for a request arriving now, in ms (0 without a queue).
    pub queue_wait_ms: u32,
    /// Backends ready to serve.
    pub ready: u32,
    /// Sequences running on them (the pool's leases and what the probes saw).
    pub running: u32,
    /// Sequences they can run at once (the sum of their learned or configured `max_num_seqs`).
    pub max_seqs: u32,
    /// Streams the pool's lease evidence finds queued in its backends' engines since their last
    /// scrape (`crate::pool::evidence`; already counted in the predictions and `max_seqs`).
    #[serde(skip_serializing_if = "is_zero")]
    pub queued_by_leases: u32,
    /// Models the pool's ready backends serve.
    pub models: Vec<String>,
    /// Predicted decode time of the card's made-up request ([`CARD_OUTPUT_TOKENS`]) on the best
    /// backend, in ms: about how long one more request holds a sequence slot.
    pub decode_ms: Option<u32>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl TimeCard {
    /// Predicted time to first token, queue included, for a request with `uncached` tokens to
    /// prefill; `None` when the pool cannot take a request now.
    pub fn predict_ms(&self, uncached: u32) -> Option<u64> {
        let (c, s, l) = (self.cached_ms?, self.short_ms?, self.long_ms?);
        let (c, s, l) = (f64::from(c), f64::from(s), f64::from(l));
        let u = f64::from(uncached);
        let short = f64::from(SHORT_TOKENS);
        let long = f64::from(LONG_TOKENS);
        let ttft = if u <= short {
            c + (s - c) * u / short
        } else {
            // Beyond the long point the line goes on with the slope between the two.
            s + (l - s) * (u - short) / (long - short)
        };
        Some(ttft.max(0.0).round() as u64 + u64::from(self.queue_wait_ms))
    }

    /// The wait `sent` more requests add, those this Worker sent the pool since the card was
    /// computed and that still hold a sequence slot (the card cannot know them), each asking for
    /// `tokens` output tokens on average: each beyond the free slots waits for a slot to free, and
    /// the slots free about once per decode between them.
    pub fn backlog_ms(&self, sent: u32, tokens: u32) -> u64 {
        let (Some(decode), true) = (self.decode_ms, self.max_seqs > 0) else {
            return 0;
        };
        let over = (self.running + sent).saturating_sub(self.max_seqs.max(self.running));
        let over = over.min(sent);
        let decode = u64::from(decode) * u64::from(tokens) / u64::from(CARD_OUTPUT_TOKENS);
        u64::from(over) * decode / u64::from(self.max_seqs)
    }

    /// How much of the card's predictions has drained `age_ms` after it was computed: the waiting
    /// part of a prediction (the queue's wait and what a request with nothing to prefill waits
    /// for a slot, `cached_ms`) shrinks in real time while nobody adds to it, up to all of it;
    /// the prefill part does not. What others sent the pool since is unknown here, which is why
    /// a card older than the choice's `card_max_age_ms` is not used at all; what this Worker sent
    /// is added back by [`Self::backlog_ms`].
    pub fn drained_ms(&self, age_ms: u64) -> u64 {
        let waiting = u64::from(self.queue_wait_ms) + u64::from(self.cached_ms.unwrap_or(0));
        age_ms.min(waiting)
    }

    /// Whether the card says the pool serves `model` (a card that lists no models says nothing).
    pub fn serves(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }

    /// How old the card is at `now_ms`.
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.at_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(c: u32, s: u32, l: u32) -> TimeCard {
        TimeCard {
            cached_ms: Some(c),
            short_ms: Some(s),
            long_ms: Some(l),
            ..TimeCard::default()
        }
    }

    #[test]
    fn predictions_follow_the_curve_through_its_points() {
        let c = card(10, 110, 810);
        assert_eq!(c.predict_ms(0), Some(10));
        assert_eq!(c.predict_ms(512), Some(60));
        assert_eq!(c.predict_ms(SHORT_TOKENS), Some(110));
        assert_eq!(c.predict_ms(LONG_TOKENS), Some(810));
        // Past the long point, the same slope: 700 ms per 7,168 tokens.
        assert_eq!(c.predict_ms(LONG_TOKENS + 7168), Some(1510));
    }

    #[test]
    fn the_queue_wait_adds_to_every_class() {
        let mut c = card(10, 110, 810);
        c.queue_wait_ms = 500;
        assert_eq!(c.predict_ms(0), Some(510));
        assert_eq!(c.predict_ms(SHORT_TOKENS), Some(610));
    }

    #[test]
    fn a_pool_that_cannot_take_requests_predicts_nothing() {
        let c = TimeCard::default();
        assert_eq!(c.predict_ms(100), None);
        assert!(
            c.serves("any"),
            "a card without models says nothing about them"
        );
        let c = TimeCard {
            models: vec!["m".into()],
            ..card(1, 2, 3)
        };
        assert!(c.serves("m") && !c.serves("other"));
    }

    #[test]
    fn requests_sent_since_the_card_add_their_wait_once_the_slots_are_full() {
        let c = TimeCard {
            running: 6,
            max_seqs: 8,
            decode_ms: Some(800),
            ..card(10, 110, 810)
        };
        assert_eq!(c.backlog_ms(0, 256), 0);
        assert_eq!(c.backlog_ms(2, 256), 0, "two free slots");
        // Two beyond them wait a quarter decode in all; short answers free their slots sooner.
        assert_eq!(c.backlog_ms(4, 256), 200);
        assert_eq!(c.backlog_ms(4, 64), 50);
        assert_eq!(TimeCard::default().backlog_ms(100, 256), 0);
    }

    #[test]
    fn a_cards_wait_drains_with_its_age_but_not_its_prefill() {
        let mut c = card(900, 1000, 1700);
        c.queue_wait_ms = 600;
        assert_eq!(c.drained_ms(0), 0);
        assert_eq!(c.drained_ms(1000), 1000);
        // All 1,500 ms of waiting gone; the 100 ms of a short prompt's prefill stays.
        assert_eq!(c.drained_ms(60_000), 1500);
        let aged = c.predict_ms(SHORT_TOKENS).unwrap() - c.drained_ms(60_000);
        assert_eq!(aged, 100);
        assert_eq!(TimeCard::default().drained_ms(5000), 0);
    }

    #[test]
    fn the_wire_form_is_compact_and_tolerant() {
        let c = TimeCard {
            at_ms: 5,
            ..card(1, 2, 3)
        };
        let text = serde_json::to_string(&c).unwrap();
        assert!(text.len() < 180, "{text}");
        let back: TimeCard = serde_json::from_str(&text).unwrap();
        assert_eq!(back, c);
        let old: TimeCard = serde_json::from_str("{}").unwrap();
        assert_eq!(old, TimeCard::default());
    }
}
