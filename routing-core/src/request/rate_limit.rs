//! Per-client rate limits: requests per minute and tokens per minute, as two token buckets.
//!
//! Each bucket holds up to one minute's allowance and refills continuously, so a client may burst
//! up to its per-minute limit and then proceeds at the steady rate. A request takes one unit from
//! the request bucket and its estimated tokens (prompt plus requested output) from the token
//! bucket, both or neither. When refused, the answer says how long until both would have room,
//! for `Retry-After`. A request is charged an estimate when admitted and settled with the tokens
//! the backend reported when it ends ([`RateLimiter::settle`]): the difference is refunded or
//! charged, so the bucket may go below zero and later requests wait for it. Time is passed in. The
//! buckets serialize (the rate limiter's Durable Object stores them after every change, so an
//! eviction or a deploy does not refill them).

use serde::{Deserialize, Serialize};

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

impl Bucket {
    /// Level after refilling up to `now_ms`, for a bucket of `per_minute` capacity.
    fn refilled(&self, per_minute: u64, now_ms: u64) -> f64 {
        let capacity = per_minute as f64;
        if !self.started {
            return capacity;
        }
        let elapsed = now_ms.saturating_sub(self.last_ms) as f64;
        (self.level + elapsed * capacity / 60_000.0).min(capacity)
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
        if limits.requests_per_minute > 0 {
            self.requests.take(limits.requests_per_minute, 1.0, now_ms);
        }
        if limits.tokens_per_minute > 0 {
            self.tokens
                .take(limits.tokens_per_minute, tokens as f64, now_ms);
        }
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
}
