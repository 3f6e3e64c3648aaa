//! Per-client rate limits: requests per minute and tokens per minute, as two token buckets.
//!
//! Each bucket holds up to one minute's allowance and refills continuously, so a client may burst
//! up to its per-minute limit and then proceeds at the steady rate. A request takes one unit from
//! the request bucket and its estimated tokens (prompt plus requested output) from the token
//! bucket, both or neither. When refused, the answer says how long until both would have room,
//! for `Retry-After`. A request is charged an estimate when admitted and settled with the tokens
//! the backend reported when it ends ([`RateLimiter::settle`]): the difference is refunded or
//! charged, so the bucket may go below zero and later requests wait for it. Time is passed in. The
//! buckets serialize (the rate limiter's Durable Object writes them behind its changes, so an
//! eviction or a deploy does not refill them).
//!
//! [`LimitAheadBook`] is an isolate's view of its clients' buckets, from the limiter's answers, for
//! admitting a request before the limiter has answered (`RATE_LIMIT_AHEAD`): only while every
//! limited bucket would stay at least half full after the charges in flight and this one.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// A client's limits; 0 means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RateLimits {
    /// Requests per minute.
    pub requests_per_minute: u64,
    /// Tokens (estimated prompt plus max output) per minute.
    pub tokens_per_minute: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
struct Bucket {
    level: f64,
    last_ms: u64,
    started: bool,
}

/// `level` after `elapsed_ms` of refill in a bucket of `per_minute` capacity.
fn refill(level: f64, per_minute: u64, elapsed_ms: u64) -> f64 {
    let capacity = per_minute as f64;
    (level + elapsed_ms as f64 * capacity / 60_000.0).min(capacity)
}

impl Bucket {
    /// Level after refilling up to `now_ms`, for a bucket of `per_minute` capacity.
    fn refilled(&self, per_minute: u64, now_ms: u64) -> f64 {
        if !self.started {
            return per_minute as f64;
        }
        refill(self.level, per_minute, now_ms.saturating_sub(self.last_ms))
    }

    /// Milliseconds until `amount` fits (`None` if it never can: more than a minute's worth).
    fn wait_ms(&self, per_minute: u64, amount: f64, now_ms: u64) -> Option<u64> {
        let capacity = per_minute as f64;
        if amount > capacity {
            return None;
        }
        let level = self.refilled(per_minute, now_ms);
        if level >= amount {
            return Some(0);
        }
        Some(((amount - level) * 60_000.0 / capacity).ceil() as u64)
    }

    fn take(&mut self, per_minute: u64, amount: f64, now_ms: u64) {
        self.level = self.refilled(per_minute, now_ms) - amount;
        self.last_ms = now_ms;
        self.started = true;
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    /// Milliseconds until the request would fit; `None` when it never can (it alone exceeds a
    /// minute's token allowance).
    pub retry_after_ms: Option<u64>,
}

/// The two buckets of one client.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RateLimiter {
    requests: Bucket,
    tokens: Bucket,
    /// Changes made to the buckets so far: what [`Left::version`] reports.
    #[serde(default)]
    changes: u64,
}

impl RateLimiter {
    /// A limiter with full buckets.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one request and `tokens` tokens, or refuses and takes nothing.
    pub fn try_take(
        &mut self,
        limits: &RateLimits,
        tokens: u64,
        now_ms: u64,
    ) -> Result<(), Refusal> {
        let mut wait = 0u64;
        if limits.requests_per_minute > 0 {
            match self
                .requests
                .wait_ms(limits.requests_per_minute, 1.0, now_ms)
            {
                Some(w) => wait = wait.max(w),
                None => {
                    return Err(Refusal {
                        retry_after_ms: None,
                    })
                }
            }
        }
        if limits.tokens_per_minute > 0 {
            match self
                .tokens
                .wait_ms(limits.tokens_per_minute, tokens as f64, now_ms)
            {
                Some(w) => wait = wait.max(w),
                None => {
                    return Err(Refusal {
                        retry_after_ms: None,
                    })
                }
            }
        }
        if wait > 0 {
            return Err(Refusal {
                retry_after_ms: Some(wait),
            });
        }
        self.force_take(limits, tokens, now_ms);
        Ok(())
    }

    /// Settles a request admitted with `reserved` tokens that used `actual`: refunds the
    /// difference, or charges the excess (possibly taking the bucket below zero).
    pub fn settle(&mut self, limits: &RateLimits, reserved: u64, actual: u64, now_ms: u64) {
        if limits.tokens_per_minute == 0 || reserved == actual {
            return;
        }
        let delta = actual as f64 - reserved as f64;
        self.tokens.take(limits.tokens_per_minute, delta, now_ms);
        let capacity = limits.tokens_per_minute as f64;
        self.tokens.level = self.tokens.level.min(capacity);
        self.changes += 1;
    }

    /// Takes one request and `tokens` tokens whatever the buckets hold, so they may go below zero:
    /// a request admitted ahead of the limiter's answer that the limiter then refused is paid for
    /// all the same, and the client's next requests wait for the debt.
    pub fn force_take(&mut self, limits: &RateLimits, tokens: u64, now_ms: u64) {
        if limits.requests_per_minute > 0 {
            self.requests.take(limits.requests_per_minute, 1.0, now_ms);
        }
        if limits.tokens_per_minute > 0 {
            self.tokens
                .take(limits.tokens_per_minute, tokens as f64, now_ms);
        }
        self.changes += 1;
    }

    /// The buckets were read back from storage by a new instance, which may have lost the
    /// changes not yet written: its states are numbered above every one before, so a book that
    /// holds a newer-looking answer from before takes the new instance's answers as the newer.
    pub fn restarted(&mut self) {
        self.changes = ((self.changes >> 32) + 1) << 32;
    }

    /// What is left in each limited bucket at `now_ms`.
    pub fn left(&self, limits: &RateLimits, now_ms: u64) -> Left {
        let level =
            |b: &Bucket, per_minute: u64| (per_minute > 0).then(|| b.refilled(per_minute, now_ms));
        Left {
            requests: level(&self.requests, limits.requests_per_minute),
            tokens: level(&self.tokens, limits.tokens_per_minute),
            version: self.changes,
        }
    }
}

/// What a limiter answers an admitted charge: what is left in each limited bucket after it
/// (`None`: unlimited, or not said).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Left {
    /// Requests left of the minute's allowance.
    pub requests: Option<f64>,
    /// Tokens left of the minute's allowance.
    pub tokens: Option<f64>,
    /// How many changes the limiter had made to the buckets when this was so: of two answers,
    /// the one with the higher version is the newer state, whichever came first (0: not said).
    pub version: u64,
}

/// How old the limiter's last answer may be for a request to go ahead of the next one: the other
/// isolates' spending since is what the book cannot see.
pub const AHEAD_MAX_AGE_MS: u64 = 10_000;
/// Most clients a book remembers; past it, it starts again (every client then waits once).
const AHEAD_MAX_CLIENTS: usize = 4_096;

/// One client in a [`LimitAheadBook`].
#[derive(Debug, Clone, Default)]
struct AheadEntry {
    /// What the answers say is left, and when that was.
    left: Option<(Left, u64)>,
    /// Charges sent and not answered yet: requests and tokens.
    in_flight: (u64, u64),
    /// The first charge of this entry (an answer to an earlier one belongs to an entry the book
    /// has since forgotten).
    first_seq: u64,
    /// The highest [`Left::version`] answered so far, a refusal since or not.
    newest_version: u64,
    /// The latest charge refused: an admission of an earlier one that comes after the refusal
    /// is older news (a refusal carries no version).
    refused_seq: Option<u64>,
}

/// A charge counted in a [`LimitAheadBook`]: whether its request may go ahead of the answer, and
/// the number to give [`LimitAheadBook::answered`] with the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountedCharge {
    /// Whether the request may be served before the answer.
    pub ahead: bool,
    /// The charge's number in this book.
    pub seq: u64,
}

/// An isolate's view of its clients' rate-limit buckets, for serving a request before its charge
/// is answered (`RATE_LIMIT_AHEAD`; unrelated to `ROUTE_AHEAD`'s fetch sent ahead, whose record is
/// `pool::guess::GuessBook`). A request goes ahead only when the limiter's last answer for its client is at
/// most [`AHEAD_MAX_AGE_MS`] old and every limited bucket, refilled since, less every charge this
/// isolate has in flight and this one, stays at or above half its capacity; otherwise it waits
/// for the answer, as without the book. Answers may come back in any order: the book keeps the
/// newest state by the limiter's [`Left::version`] (a new limiter instance numbers its states above
/// its predecessor's), and an admission of a charge sent before a refused one counts as older than
/// the refusal. So a client near its limits is checked exactly, and an isolate that alone charges
/// a client never spends past what the limiter said, as long as its charges reach the limiter in
/// the order it sent them and its requests use no more than their estimates (a settlement beyond
/// an estimate is seen only in the next answer). Otherwise, and for isolates that charge the same
/// client (which see each other's spending only through the limiter's answers), each isolate can
/// take the client past a limit by at most what each view it is given held above half the
/// allowance, before its next answer: half a minute's allowance at most, for as long as its view
/// may be old. The limiter charges those requests all the same ([`RateLimiter::force_take`]), so
/// the excess is repaid by the client's next requests waiting.
/// A randomized test checks both bounds (1 to 4 isolates, 300 orders each, no refill).
#[derive(Debug, Default)]
pub struct LimitAheadBook {
    clients: HashMap<String, AheadEntry>,
    next_seq: u64,
}

impl LimitAheadBook {
    /// An empty book.
    pub fn new() -> Self {
        Self::default()
    }

    /// A charge of one request and `tokens` tokens is being sent for `client`: counted in flight
    /// until [`LimitAheadBook::answered`]. Says whether the request may go ahead of the answer.
    pub fn charge(
        &mut self,
        client: &str,
        limits: &RateLimits,
        tokens: u64,
        now_ms: u64,
    ) -> CountedCharge {
        if self.clients.len() >= AHEAD_MAX_CLIENTS && !self.clients.contains_key(client) {
            self.clients.clear();
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = self
            .clients
            .entry(client.to_string())
            .or_insert_with(|| AheadEntry {
                first_seq: seq,
                ..AheadEntry::default()
            });
        let ahead = entry.may_go_ahead(limits, tokens, now_ms);
        entry.in_flight.0 += 1;
        entry.in_flight.1 += tokens;
        CountedCharge { ahead, seq }
    }

    /// The limiter answered charge `seq` of `tokens` for `client`: with what is left after it, or
    /// `None` when it refused or failed (the client's next requests then wait for their answers
    /// until one admits them). Answers may come in any order: the book keeps the newest state of
    /// the buckets by the limiter's [`Left::version`], and an admission of a charge sent before
    /// one that was refused counts as older than the refusal; an older answer only takes its
    /// charge out of those in flight. Returns whether the answer is the newest word on the client.
    pub fn answered(
        &mut self,
        client: &str,
        seq: u64,
        tokens: u64,
        left: Option<Left>,
        now_ms: u64,
    ) -> bool {
        let Some(entry) = self.clients.get_mut(client) else {
            return false;
        };
        if seq < entry.first_seq {
            return false;
        }
        entry.in_flight.0 = entry.in_flight.0.saturating_sub(1);
        entry.in_flight.1 = entry.in_flight.1.saturating_sub(tokens);
        match left {
            Some(new)
                if new.version < entry.newest_version
                    || entry.refused_seq.is_some_and(|refused| seq < refused) =>
            {
                false
            }
            Some(new) => {
                entry.newest_version = new.version;
                entry.left = Some((new, now_ms));
                true
            }
            None => {
                entry.left = None;
                entry.refused_seq = entry.refused_seq.max(Some(seq));
                true
            }
        }
    }

    /// What `client`'s buckets hold by this isolate's account at `now_ms`: the last answer,
    /// refilled since, less the charges in flight (`None` before any answer).
    pub fn view(&self, client: &str, limits: &RateLimits, now_ms: u64) -> Option<Left> {
        self.clients.get(client)?.view(limits, now_ms)
    }
}

/// The OpenAI API's rate-limit headers for `limits` and what is `left`:
/// `x-ratelimit-limit-*`, `x-ratelimit-remaining-*` (whole units, never below 0) and
/// `x-ratelimit-reset-*` (how long until the bucket is full again, as `250ms`, `12s` or `1m30s`),
/// for requests and tokens, each only when that limit is set and its level known.
pub fn openai_headers(limits: &RateLimits, left: &Left) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let mut bucket = |names: [&'static str; 3], per_minute: u64, level: Option<f64>| {
        let Some(level) = level.filter(|_| per_minute > 0) else {
            return;
        };
        let capacity = per_minute as f64;
        let level = level.min(capacity);
        let reset_ms = ((capacity - level) * 60_000.0 / capacity).ceil().max(0.0) as u64;
        out.push((names[0], per_minute.to_string()));
        out.push((names[1], (level.max(0.0).floor() as u64).to_string()));
        out.push((names[2], duration(reset_ms)));
    };
    bucket(
        [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        ],
        limits.requests_per_minute,
        left.requests,
    );
    bucket(
        [
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
        ],
        limits.tokens_per_minute,
        left.tokens,
    );
    out
}

/// A duration as the OpenAI API writes its resets: `0s`, `250ms`, `12s`, `1m30s`.
fn duration(ms: u64) -> String {
    match ms {
        0 => "0s".to_string(),
        1..=999 => format!("{ms}ms"),
        _ => {
            let s = ms.div_ceil(1_000);
            match s / 60 {
                0 => format!("{s}s"),
                m => format!("{m}m{}s", s % 60),
            }
        }
    }
}

impl AheadEntry {
    /// The last answer, refilled to `now_ms`, less the charges in flight (a limit of 0 leaves
    /// its level as the answer said).
    fn view(&self, limits: &RateLimits, now_ms: u64) -> Option<Left> {
        let (left, at_ms) = self.left?;
        let elapsed = now_ms.saturating_sub(at_ms);
        let now = |level: Option<f64>, per_minute: u64, in_flight: u64| {
            level.map(|l| match per_minute {
                0 => l,
                _ => refill(l, per_minute, elapsed) - in_flight as f64,
            })
        };
        Some(Left {
            requests: now(left.requests, limits.requests_per_minute, self.in_flight.0),
            tokens: now(left.tokens, limits.tokens_per_minute, self.in_flight.1),
            version: left.version,
        })
    }

    fn may_go_ahead(&self, limits: &RateLimits, tokens: u64, now_ms: u64) -> bool {
        let fresh = self
            .left
            .is_some_and(|(_, at_ms)| now_ms.saturating_sub(at_ms) <= AHEAD_MAX_AGE_MS);
        let Some(view) = self.view(limits, now_ms).filter(|_| fresh) else {
            return false;
        };
        // Each limited bucket, less what is in flight and this charge, stays at least half full;
        // a limited bucket the answer did not report never goes ahead.
        let stays_half_full = |per_minute: u64, level: Option<f64>, this: f64| {
            per_minute == 0 || level.is_some_and(|l| l - this >= per_minute as f64 / 2.0)
        };
        stays_half_full(limits.requests_per_minute, view.requests, 1.0)
            && stays_half_full(limits.tokens_per_minute, view.tokens, tokens as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unlimited_never_refuses() {
        let mut l = RateLimiter::new();
        for t in 0..1000 {
            assert!(l.try_take(&RateLimits::default(), 1_000_000, t).is_ok());
        }
    }

    #[test]
    fn requests_burst_then_refill_at_the_steady_rate() {
        let limits = RateLimits {
            requests_per_minute: 60,
            tokens_per_minute: 0,
        };
        let mut l = RateLimiter::new();
        for _ in 0..60 {
            assert!(l.try_take(&limits, 0, 0).is_ok());
        }
        let refusal = l.try_take(&limits, 0, 0).unwrap_err();
        assert_eq!(refusal.retry_after_ms, Some(1000));
        assert!(l.try_take(&limits, 0, 999).is_err());
        assert!(l.try_take(&limits, 0, 1000).is_ok());
    }

    #[test]
    fn tokens_are_charged_and_a_refusal_takes_nothing() {
        let limits = RateLimits {
            requests_per_minute: 100,
            tokens_per_minute: 1000,
        };
        let mut l = RateLimiter::new();
        assert!(l.try_take(&limits, 800, 0).is_ok());
        let refusal = l.try_take(&limits, 300, 0).unwrap_err();
        assert_eq!(refusal.retry_after_ms, Some(6000));
        // The refused request took no request unit: 99 remain.
        for _ in 0..99 {
            assert!(l.try_take(&limits, 0, 0).is_ok());
        }
        assert!(l.try_take(&limits, 0, 0).is_err());
    }

    #[test]
    fn settling_refunds_an_overestimate_and_charges_an_underestimate() {
        let limits = RateLimits {
            requests_per_minute: 0,
            tokens_per_minute: 1000,
        };
        let mut l = RateLimiter::new();
        assert!(l.try_take(&limits, 900, 0).is_ok());
        assert!(l.try_take(&limits, 500, 0).is_err());
        // It used 100 of the 900 reserved: 800 come back.
        l.settle(&limits, 900, 100, 0);
        assert!(l.try_take(&limits, 500, 0).is_ok());
        // This one generated 3,000 tokens on a 300 reservation: the bucket goes below zero.
        let mut l = RateLimiter::new();
        assert!(l.try_take(&limits, 300, 0).is_ok());
        l.settle(&limits, 300, 3000, 0);
        let refusal = l.try_take(&limits, 10, 0).unwrap_err();
        assert_eq!(refusal.retry_after_ms, Some(120_600));
        // A refund never fills past capacity.
        let mut l = RateLimiter::new();
        l.settle(&limits, 500, 0, 0);
        assert!(l.try_take(&limits, 1000, 0).is_ok());
        assert!(l.try_take(&limits, 1, 0).is_err());
    }

    #[test]
    fn a_request_bigger_than_a_minute_never_fits() {
        let limits = RateLimits {
            requests_per_minute: 0,
            tokens_per_minute: 100,
        };
        let mut l = RateLimiter::new();
        assert_eq!(
            l.try_take(&limits, 101, 0),
            Err(Refusal {
                retry_after_ms: None
            })
        );
    }

    #[test]
    fn buckets_round_trip_through_json() {
        let limits = RateLimits {
            requests_per_minute: 10,
            tokens_per_minute: 1000,
        };
        let mut l = RateLimiter::new();
        assert!(l.try_take(&limits, 900, 5_000).is_ok());
        let stored = serde_json::to_string(&l).unwrap();
        let mut restored: RateLimiter = serde_json::from_str(&stored).unwrap();
        assert_eq!(restored, l);
        // The restored buckets remember the 900 taken: a second 900 does not fit.
        assert!(restored.try_take(&limits, 900, 5_000).is_err());
    }

    #[test]
    fn a_forced_take_goes_below_zero_and_what_is_left_is_reported() {
        let limits = RateLimits {
            requests_per_minute: 10,
            tokens_per_minute: 1000,
        };
        let mut l = RateLimiter::new();
        assert!(l.try_take(&limits, 900, 0).is_ok());
        assert_eq!(
            l.left(&limits, 0),
            Left {
                requests: Some(9.0),
                tokens: Some(100.0),
                version: 1,
            }
        );
        assert!(l.try_take(&limits, 300, 0).is_err());
        l.force_take(&limits, 300, 0);
        assert_eq!(l.left(&limits, 0).tokens, Some(-200.0));
        // The debt is repaid before the next request fits: 210 tokens take 12.6 s.
        assert_eq!(
            l.try_take(&limits, 10, 0).unwrap_err().retry_after_ms,
            Some(12_600)
        );
        let unlimited = RateLimits {
            requests_per_minute: 10,
            tokens_per_minute: 0,
        };
        assert_eq!(l.left(&unlimited, 0).tokens, None);
    }

    const TPM: RateLimits = RateLimits {
        requests_per_minute: 0,
        tokens_per_minute: 1000,
    };

    std::thread_local! {
        static VERSION: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    /// A limiter's answer with `tokens` left (and no request limit), newer than every one before.
    fn tokens_left(tokens: f64) -> Option<Left> {
        let version = VERSION.with(|v| {
            v.set(v.get() + 1);
            v.get()
        });
        Some(Left {
            requests: None,
            tokens: Some(tokens),
            version,
        })
    }

    #[test]
    fn a_client_goes_ahead_only_after_an_answer_and_only_while_half_its_allowance_stays() {
        let mut book = LimitAheadBook::new();
        // No answer yet: wait.
        assert!(!book.charge("a", &TPM, 100, 0).ahead);
        book.answered("a", 0, 100, tokens_left(900.0), 10);
        // 900 left: 300 leaves 600, ahead; with it in flight another 300 would leave 300: wait.
        assert!(book.charge("a", &TPM, 300, 20).ahead);
        assert!(!book.charge("a", &TPM, 300, 20).ahead);
        // Both answered, 300 left: even a small one waits.
        book.answered("a", 1, 300, tokens_left(600.0), 30);
        book.answered("a", 2, 300, tokens_left(300.0), 30);
        assert!(!book.charge("a", &TPM, 10, 30).ahead);
        book.answered("a", 3, 10, tokens_left(290.0), 40);
        // The bucket refills: 290 + 250 (15 s) would do, but the answer is too old by then.
        assert!(!book.charge("a", &TPM, 10, 40 + AHEAD_MAX_AGE_MS + 1).ahead);
        book.answered("a", 4, 10, tokens_left(280.0), 5_000);
        // 280 + 9 s of refill (150) = 430: still under half.
        assert!(!book.charge("a", &TPM, 1, 14_000).ahead);
        book.answered("a", 5, 1, tokens_left(429.0), 14_000);
        // 429 + 6 s (100) = 529, less 20: ahead.
        assert!(book.charge("a", &TPM, 20, 20_000).ahead);
        // Another client has its own view.
        assert!(!book.charge("b", &TPM, 1, 20_000).ahead);
    }

    #[test]
    fn a_refusal_or_a_failure_makes_the_client_wait_again() {
        let mut book = LimitAheadBook::new();
        book.charge("a", &TPM, 10, 0);
        book.answered("a", 0, 10, tokens_left(990.0), 0);
        assert!(book.charge("a", &TPM, 10, 0).ahead);
        book.answered("a", 1, 10, None, 0);
        assert!(!book.charge("a", &TPM, 10, 0).ahead);
    }

    #[test]
    fn every_limited_bucket_must_stay_half_full_and_an_unreported_one_never_goes_ahead() {
        let limits = RateLimits {
            requests_per_minute: 4,
            tokens_per_minute: 1000,
        };
        let mut book = LimitAheadBook::new();
        book.charge("a", &limits, 10, 0);
        book.answered(
            "a",
            0,
            10,
            Some(Left {
                requests: Some(3.0),
                tokens: Some(990.0),
                version: 1,
            }),
            0,
        );
        // 3 requests left: one more leaves 2, half of 4.
        assert!(book.charge("a", &limits, 10, 0).ahead);
        // With that one in flight, another would leave 1.
        assert!(!book.charge("a", &limits, 10, 0).ahead);
        let mut book = LimitAheadBook::new();
        book.charge("a", &limits, 10, 0);
        book.answered("a", 0, 10, tokens_left(990.0), 0);
        assert!(!book.charge("a", &limits, 10, 0).ahead);
    }

    #[test]
    fn the_book_s_view_and_the_openai_headers() {
        let limits = RateLimits {
            requests_per_minute: 60,
            tokens_per_minute: 1000,
        };
        let mut book = LimitAheadBook::new();
        assert_eq!(book.view("a", &limits, 0), None);
        book.charge("a", &limits, 100, 0);
        book.answered(
            "a",
            0,
            100,
            Some(Left {
                requests: Some(59.0),
                tokens: Some(900.0),
                version: 1,
            }),
            0,
        );
        // One more in flight, and 3 s of refill: 59 + 3 (capped at 60) - 1 requests, 900 + 50 -
        // 200 tokens.
        book.charge("a", &limits, 200, 3_000);
        let view = book.view("a", &limits, 3_000).unwrap();
        assert_eq!(view.requests, Some(59.0));
        assert_eq!(view.tokens, Some(750.0));
        let headers = openai_headers(&limits, &view);
        let get = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("x-ratelimit-limit-requests"), Some("60"));
        assert_eq!(get("x-ratelimit-remaining-requests"), Some("59"));
        assert_eq!(get("x-ratelimit-reset-requests"), Some("1s"));
        assert_eq!(get("x-ratelimit-limit-tokens"), Some("1000"));
        assert_eq!(get("x-ratelimit-remaining-tokens"), Some("750"));
        // 250 tokens short of full at 1,000 a minute: 15 s.
        assert_eq!(get("x-ratelimit-reset-tokens"), Some("15s"));
        // A bucket in debt: nothing remaining, full again after more than a minute.
        let debt = Left {
            requests: None,
            tokens: Some(-500.0),
            version: 0,
        };
        let headers = openai_headers(&limits, &debt);
        assert_eq!(
            headers.len(),
            3,
            "no request level known: no request headers"
        );
        assert_eq!(
            headers[1],
            ("x-ratelimit-remaining-tokens", "0".to_string())
        );
        assert_eq!(
            headers[2],
            ("x-ratelimit-reset-tokens", "1m30s".to_string())
        );
        assert_eq!(duration(999), "999ms");
        assert_eq!(duration(1_001), "2s");
        // No limit set: no headers, whatever is known.
        assert!(openai_headers(&RateLimits::default(), &view).is_empty());
    }

    #[test]
    fn sequential_requests_are_refused_exactly_at_the_limit() {
        // One isolate, one request at a time, every answer in before the next: the limiter's
        // buckets and the book agree, so the first refusal comes where it would without the book.
        let limits = RateLimits {
            requests_per_minute: 0,
            tokens_per_minute: 1000,
        };
        let mut limiter = RateLimiter::new();
        let mut book = LimitAheadBook::new();
        let mut served = 0;
        for _ in 0..20 {
            let sent = book.charge("a", &limits, 90, 0);
            match limiter.try_take(&limits, 90, 0) {
                Ok(()) => {
                    book.answered("a", sent.seq, 90, Some(limiter.left(&limits, 0)), 0);
                    served += 1;
                }
                Err(_) => {
                    assert!(!sent.ahead, "a request went ahead and was refused");
                    book.answered("a", sent.seq, 90, None, 0);
                    break;
                }
            }
        }
        assert_eq!(served, 11);
    }

    #[test]
    fn an_answer_older_than_the_view_only_takes_its_charge_out_of_those_in_flight() {
        let mut book = LimitAheadBook::new();
        let first = book.charge("a", &TPM, 10, 0);
        book.answered("a", first.seq, 10, tokens_left(990.0), 0);
        let (a, b) = (
            book.charge("a", &TPM, 100, 0),
            book.charge("a", &TPM, 100, 0),
        );
        assert!(a.ahead && b.ahead);
        // The limiter took a then b, but b's answer comes first: 790 left, not a's 890.
        let after = |tokens: f64, version: u64| {
            Some(Left {
                requests: None,
                tokens: Some(tokens),
                version,
            })
        };
        book.answered("a", b.seq, 100, after(790.0, 3), 0);
        book.answered("a", a.seq, 100, after(890.0, 2), 0);
        assert_eq!(book.view("a", &TPM, 0).unwrap().tokens, Some(790.0));
    }

    #[test]
    fn an_admission_that_comes_after_a_later_charge_s_refusal_is_older_news() {
        let mut book = LimitAheadBook::new();
        let first = book.charge("a", &TPM, 10, 0);
        book.answered("a", first.seq, 10, tokens_left(990.0), 0);
        // p goes ahead; its answer is slow. Three more go ahead and are refused (another isolate
        // spent the bucket meanwhile).
        let p = book.charge("a", &TPM, 10, 0);
        let late: Vec<CountedCharge> = (0..3).map(|_| book.charge("a", &TPM, 150, 0)).collect();
        assert!(p.ahead && late.iter().all(|s| s.ahead));
        for s in &late {
            assert!(book.answered("a", s.seq, 150, None, 0));
        }
        // p's admission, given before those refusals, arrives last: it brings nothing back.
        assert!(!book.answered("a", p.seq, 10, tokens_left(980.0), 0));
        assert!(!book.charge("a", &TPM, 10, 0).ahead);
        assert_eq!(book.view("a", &TPM, 0), None);
    }

    #[test]
    fn a_restarted_limiter_numbers_its_states_above_every_one_before() {
        let mut l = RateLimiter::new();
        for _ in 0..5 {
            assert!(l.try_take(&TPM, 10, 0).is_ok());
        }
        let before = l.left(&TPM, 0).version;
        // Read back as stored two changes earlier, by a new instance.
        let mut stored = RateLimiter::new();
        for _ in 0..3 {
            assert!(stored.try_take(&TPM, 10, 0).is_ok());
        }
        stored.restarted();
        assert!(stored.try_take(&TPM, 10, 0).is_ok());
        assert!(stored.left(&TPM, 0).version > before);
        // And buckets stored before states were numbered read as version 0.
        let old: RateLimiter = serde_json::from_str(
            r#"{"requests":{"level":0.0,"last_ms":0,"started":false},"tokens":{"level":500.0,"last_ms":0,"started":true}}"#,
        )
        .unwrap();
        assert_eq!(old.left(&TPM, 0).version, 0);
    }

    /// `isolates` books charging one client's limiter, no refill: what is served against a
    /// minute's allowance of 1,000 tokens. The answers come back in a random order; the charges
    /// reach the limiter in a random order too, or, with `in_order`, each isolate's in the order
    /// it sent them.
    fn served_by(isolates: usize, in_order: bool, seed: u64) -> u64 {
        use crate::random::{RandomSource, SplitMix64};
        const CAP: u64 = 1_000;
        let mut rng = SplitMix64::new(seed);
        let mut limiter = RateLimiter::new();
        let mut books: Vec<LimitAheadBook> = (0..isolates).map(|_| LimitAheadBook::new()).collect();
        // Charges on their way to the limiter, and answers on their way back:
        // (isolate, seq, tokens, served ahead, what the limiter said).
        let mut to_limiter: Vec<(usize, u64, u64, bool)> = Vec::new();
        let mut to_isolate: Vec<(usize, u64, u64, Option<Left>)> = Vec::new();
        let mut served = 0;
        for _ in 0..400 {
            match rng.below(3) {
                0 => {
                    let i = rng.below(isolates as u64) as usize;
                    let tokens = 10 + rng.below(150);
                    let sent = books[i].charge("k", &TPM, tokens, 0);
                    if sent.ahead {
                        served += tokens;
                    }
                    to_limiter.push((i, sent.seq, tokens, sent.ahead));
                }
                1 if !to_limiter.is_empty() => {
                    let mut at = rng.below(to_limiter.len() as u64) as usize;
                    if in_order {
                        // That isolate's oldest charge.
                        let i = to_limiter[at].0;
                        at = to_limiter.iter().position(|c| c.0 == i).unwrap_or(at);
                    }
                    let (i, seq, tokens, ahead) = to_limiter.remove(at);
                    let left = match limiter.try_take(&TPM, tokens, 0) {
                        Ok(()) => {
                            if !ahead {
                                served += tokens;
                            }
                            Some(limiter.left(&TPM, 0))
                        }
                        Err(_) => {
                            if ahead {
                                limiter.force_take(&TPM, tokens, 0);
                            }
                            None
                        }
                    };
                    to_isolate.push((i, seq, tokens, left));
                }
                _ if !to_isolate.is_empty() => {
                    let at = rng.below(to_isolate.len() as u64) as usize;
                    let (i, seq, tokens, left) = to_isolate.swap_remove(at);
                    books[i].answered("k", seq, tokens, left, 0);
                }
                _ => {}
            }
        }
        assert!(
            served <= CAP + CAP * isolates as u64 / 2,
            "{isolates} isolates served {served}"
        );
        served
    }

    #[test]
    fn the_overshoot_stays_within_half_an_allowance_per_isolate_and_a_lone_one_never_overshoots() {
        let mut over = [0u64; 5];
        for seed in 0..300 {
            // A lone isolate whose charges reach the limiter in order, its answers in any order.
            assert!(served_by(1, true, seed) <= 1_000, "seed {seed}");
            // Otherwise at most half an allowance over per isolate (`served_by` asserts it).
            for (isolates, most) in over.iter_mut().enumerate().skip(1) {
                *most = (*most).max(served_by(isolates, false, seed));
            }
        }
        // The bound is approached, not just never reached: isolates do overshoot.
        assert!(over[4] > 1_000, "{over:?}");
    }
}
