//! A pool-wide retry budget, so retries cannot multiply an overload.
//!
//! When a backend fails, retrying on another is right; when the whole pool is failing, every
//! retry adds load to servers that are already drowning. The budget allows retries up to a
//! fraction of recent first attempts (default 20%, as in Finagle's and Envoy's retry budgets),
//! plus a small floor so a quiet pool can still retry. Counts are kept in two rotating windows,
//! so the view is always between one and two windows long. Time is passed in.
//!
//! A retry is charged when it happens: each move of a lease to another backend after a failure
//! (a retry before the first byte, or a stream's resumption) takes one. A candidate the pool
//! refuses to move the lease to (it is full, or left service) costs nothing, so a request whose
//! next candidate is full still gets its retry on the one after.

use serde::{Deserialize, Serialize};

/// Retry-budget knobs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RetryBudgetConfig {
    /// Retries allowed per first attempt (default 0.2).
    pub ratio: f64,
    /// Retries always allowed per window, whatever the traffic (default 10).
    pub min_per_window: u32,
    /// Window length in milliseconds (default 10,000).
    pub window_ms: u64,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        RetryBudgetConfig {
            ratio: 0.2,
            min_per_window: 10,
            window_ms: 10_000,
        }
    }
}

impl RetryBudgetConfig {
    /// Checks the knobs' ranges.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.ratio.is_finite() && (0.0..=10.0).contains(&self.ratio)) {
            return Err("retry_budget.ratio must be between 0 and 10".into());
        }
        if self.window_ms < 100 || self.window_ms > 3_600_000 {
            return Err("retry_budget.window_ms must be between 100 and 3,600,000".into());
        }
        Ok(())
    }
}

/// Counts first attempts and retries over a sliding pair of windows.
#[derive(Debug, Clone, Default)]
pub struct RetryBudget {
    window_start_ms: u64,
    requests: [u64; 2],
    retries: [u64; 2],
    exhausted_total: u64,
}

impl RetryBudget {
    /// An empty budget.
    pub fn new() -> Self {
        Self::default()
    }

    fn rotate(&mut self, now_ms: u64, cfg: &RetryBudgetConfig) {
        let window = cfg.window_ms.max(1);
        if now_ms >= self.window_start_ms + 2 * window {
            *self = RetryBudget {
                window_start_ms: now_ms,
                exhausted_total: self.exhausted_total,
                ..Self::default()
            };
        } else if now_ms >= self.window_start_ms + window {
            self.requests = [self.requests[1], 0];
            self.retries = [self.retries[1], 0];
            self.window_start_ms += window;
        }
    }

    /// Records a first attempt.
    pub fn record_request(&mut self, now_ms: u64, cfg: &RetryBudgetConfig) {
        self.rotate(now_ms, cfg);
        self.requests[1] += 1;
    }

    /// Whether the budget has a retry left, without taking it; `false` is counted as
    /// exhaustion. A retry that then happens is taken with [`Self::record_retry`]: a candidate
    /// the pool refuses to move the lease to costs nothing.
    pub fn allows_retry(&mut self, now_ms: u64, cfg: &RetryBudgetConfig) -> bool {
        self.rotate(now_ms, cfg);
        let requests = self.requests[0] + self.requests[1];
        let retries = self.retries[0] + self.retries[1];
        let allowed = (requests as f64 * cfg.ratio).floor() as u64 + u64::from(cfg.min_per_window);
        if retries < allowed {
            true
        } else {
            self.exhausted_total += 1;
            false
        }
    }

    /// Records a retry that happened (the lease moved to another backend).
    pub fn record_retry(&mut self, now_ms: u64, cfg: &RetryBudgetConfig) {
        self.rotate(now_ms, cfg);
        self.retries[1] += 1;
    }

    /// Takes one retry from the budget; `false` (and counted as exhaustion) when none is left.
    pub fn try_retry(&mut self, now_ms: u64, cfg: &RetryBudgetConfig) -> bool {
        let allowed = self.allows_retry(now_ms, cfg);
        if allowed {
            self.record_retry(now_ms, cfg);
        }
        allowed
    }

    /// How many retries were refused since the budget was created.
    pub fn exhausted_total(&self) -> u64 {
        self.exhausted_total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_allows_retries_without_traffic() {
        let cfg = RetryBudgetConfig {
            min_per_window: 2,
            ..Default::default()
        };
        let mut b = RetryBudget::new();
        assert!(b.try_retry(0, &cfg));
        assert!(b.try_retry(1, &cfg));
        assert!(!b.try_retry(2, &cfg));
        assert_eq!(b.exhausted_total(), 1);
    }

    #[test]
    fn ratio_scales_with_first_attempts() {
        let cfg = RetryBudgetConfig {
            ratio: 0.1,
            min_per_window: 0,
            window_ms: 1000,
        };
        let mut b = RetryBudget::new();
        for t in 0..100 {
            b.record_request(t, &cfg);
        }
        let granted = (0..50).filter(|_| b.try_retry(200, &cfg)).count();
        assert_eq!(granted, 10);
    }

    #[test]
    fn old_windows_are_forgotten() {
        let cfg = RetryBudgetConfig {
            ratio: 0.0,
            min_per_window: 1,
            window_ms: 1000,
        };
        let mut b = RetryBudget::new();
        assert!(b.try_retry(0, &cfg));
        assert!(!b.try_retry(500, &cfg));
        // One window later the old retry still counts (sliding pair); two windows later it is gone.
        assert!(!b.try_retry(1500, &cfg));
        assert!(b.try_retry(2600, &cfg));
    }
}
