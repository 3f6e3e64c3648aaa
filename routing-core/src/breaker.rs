//! The circuit breaker: one per backend, fed by request outcomes.
//!
//! Closed, it counts consecutive backend failures (5xx, timeouts, transport errors only; see
//! [`OutcomeKind::is_backend_failure`]) and opens after `failure_threshold` of them. Open, it
//! admits nothing until a cooldown passes; the cooldown doubles with each consecutive opening, up
//! to `max_cooldown_ms`, minus a random jitter so that breakers opened together do not all retry
//! together. Then it is half-open: at most `half_open_max_trials` trial requests at once; each
//! trial success counts towards `success_threshold`, after which it closes; any trial failure
//! reopens it with a longer cooldown.
//!
//! Breakers never take more than `max_open_ratio` of a pool's ready backends out of rotation at
//! once (Envoy's `max_ejection_percent` has the same job): the pool tells [`CircuitBreaker::record_gated`]
//! whether an opening would pass that cap, and a breaker refused its opening stays closed at its
//! threshold, so the next failure asks again. Failures a bad request causes on every backend it
//! touches cannot empty a pool this way.
//!
//! Outcomes of requests admitted before the breaker opened are ignored while it is open or
//! half-open: they describe the past, not the trial. A 429 leaves the breaker alone and marks the
//! backend saturated for `saturation_ms` instead.

use crate::outcome::OutcomeKind;
use serde::{Deserialize, Serialize};

/// Breaker thresholds and timings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BreakerConfig {
    /// Consecutive backend failures that open a closed breaker (default 5).
    pub failure_threshold: u32,
    /// Trial successes that close a half-open breaker (default 2).
    pub success_threshold: u32,
    /// Trial requests admitted at once while half-open (default 1).
    pub half_open_max_trials: u32,
    /// Cooldown after the first opening, in ms (default 5,000).
    pub base_cooldown_ms: u64,
    /// Longest cooldown, in ms (default 120,000).
    pub max_cooldown_ms: u64,
    /// Fraction of the cooldown removed at random, in `[0, 1]` (default 0.2).
    pub jitter_ratio: f64,
    /// How long a 429 keeps the backend out of rotation, in ms (default 2,000).
    pub saturation_ms: u64,
    /// Largest share of the pool's ready, healthy backends whose breakers may be out of rotation
    /// (open or half-open) at once, in `[0, 1]` (default 0.5). At least one breaker may always
    /// open unless it is 0, which keeps every breaker closed.
    pub max_open_ratio: f64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 5,
            success_threshold: 2,
            half_open_max_trials: 1,
            base_cooldown_ms: 5_000,
            max_cooldown_ms: 120_000,
            jitter_ratio: 0.2,
            saturation_ms: 2_000,
            max_open_ratio: 0.5,
        }
    }
}

impl BreakerConfig {
    /// Checks the knobs; returns a reason when one is out of range.
    pub fn validate(&self) -> Result<(), String> {
        if self.failure_threshold == 0 {
            return Err("breaker.failure_threshold must be at least 1".into());
        }
        if self.success_threshold == 0 {
            return Err("breaker.success_threshold must be at least 1".into());
        }
        if self.half_open_max_trials == 0 {
            return Err("breaker.half_open_max_trials must be at least 1".into());
        }
        if self.base_cooldown_ms == 0 || self.max_cooldown_ms < self.base_cooldown_ms {
            return Err(
                "breaker cooldowns must satisfy 0 < base_cooldown_ms <= max_cooldown_ms".into(),
            );
        }
        if !(0.0..=1.0).contains(&self.jitter_ratio) {
            return Err("breaker.jitter_ratio must be within [0, 1]".into());
        }
        if !(0.0..=1.0).contains(&self.max_open_ratio) {
            return Err("breaker.max_open_ratio must be within [0, 1]".into());
        }
        Ok(())
    }

    /// How many of `ready` backends' breakers may be out of rotation at once: the
    /// `max_open_ratio` share, rounded down, but at least one (unless the ratio is 0).
    pub fn max_open(&self, ready: usize) -> usize {
        if self.max_open_ratio <= 0.0 || ready == 0 {
            return 0;
        }
        ((ready as f64 * self.max_open_ratio.min(1.0)).floor() as usize).max(1)
    }

    /// The cooldown for the `streak`-th consecutive opening (1-based), given a uniform `u` in
    /// `[0, 1)`: `min(max, base * 2^(streak-1)) * (1 - jitter_ratio * u)`, at least 1 ms.
    pub fn cooldown_ms(&self, streak: u32, u: f64) -> u64 {
        let doublings = streak.saturating_sub(1).min(40);
        let raw = self
            .base_cooldown_ms
            .saturating_mul(1u64 << doublings)
            .min(self.max_cooldown_ms);
        let jitter = (raw as f64 * self.jitter_ratio.clamp(0.0, 1.0) * u.clamp(0.0, 1.0)) as u64;
        raw.saturating_sub(jitter).max(1)
    }
}

/// The breaker's state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// Traffic flows; failures are counted.
    #[default]
    Closed,
    /// No traffic until the cooldown ends.
    Open,
    /// A bounded number of trial requests test the backend.
    HalfOpen,
}

impl BreakerState {
    /// Every state, in order (for metrics).
    pub const ALL: [BreakerState; 3] = [
        BreakerState::Closed,
        BreakerState::Open,
        BreakerState::HalfOpen,
    ];

    /// The state's name as used in JSON and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// How a request was let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Through a closed breaker.
    Normal,
    /// As one of a half-open breaker's trials; its outcome decides the breaker.
    Trial,
}

/// A breaker state change, `from -> to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerTransition {
    /// State before.
    pub from: BreakerState,
    /// State after.
    pub to: BreakerState,
}

/// What the Durable Object persists of a breaker, so a restart does not forget an open breaker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BreakerSnapshot {
    /// State at the time of the snapshot.
    pub state: BreakerState,
    /// End of the current cooldown (meaningful when open).
    pub open_until_ms: u64,
    /// Consecutive failures counted while closed.
    pub consecutive_failures: u32,
    /// Consecutive openings without a close in between (drives the exponential cooldown).
    pub open_streak: u32,
}

/// One backend's circuit breaker.
#[derive(Debug, Clone, Default)]
pub struct CircuitBreaker {
    state: BreakerState,
    consecutive_failures: u32,
    open_until_ms: u64,
    open_streak: u32,
    trials_in_flight: u32,
    trial_successes: u32,
    saturated_until_ms: u64,
    transitions: [u64; 3],
    openings_held: u64,
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new() -> Self {
        CircuitBreaker::default()
    }

    /// The state as of the last call that could change it (see [`CircuitBreaker::state_at`]).
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// The state at `now_ms`, reporting an open breaker whose cooldown has passed as half-open.
    pub fn state_at(&self, now_ms: u64) -> BreakerState {
        if self.state == BreakerState::Open && now_ms >= self.open_until_ms {
            BreakerState::HalfOpen
        } else {
            self.state
        }
    }

    /// End of the current cooldown.
    pub fn open_until_ms(&self) -> u64 {
        self.open_until_ms
    }

    /// Trial requests currently in flight.
    pub fn trials_in_flight(&self) -> u32 {
        self.trials_in_flight
    }

    /// Consecutive failures counted while closed.
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    /// Number of transitions into each state, indexed like [`BreakerState::ALL`].
    pub fn transitions(&self) -> [u64; 3] {
        self.transitions
    }

    /// Whether a 429 still marks the backend saturated at `now_ms`.
    pub fn is_saturated(&self, now_ms: u64) -> bool {
        now_ms < self.saturated_until_ms
    }

    /// End of the current saturation mark.
    pub fn saturated_until_ms(&self) -> u64 {
        self.saturated_until_ms
    }

    /// Whether a request would be admitted at `now_ms`, without admitting it.
    pub fn would_admit(&self, now_ms: u64, config: &BreakerConfig) -> bool {
        match self.state_at(now_ms) {
            BreakerState::Closed => true,
            BreakerState::Open => false,
            BreakerState::HalfOpen => {
                let in_flight = if self.state == BreakerState::Open {
                    0
                } else {
                    self.trials_in_flight
                };
                in_flight < config.half_open_max_trials.max(1)
            }
        }
    }

    /// How long until the breaker or the saturation mark would let a request through, if it
    /// would not now.
    pub fn retry_after_ms(&self, now_ms: u64, config: &BreakerConfig) -> Option<u64> {
        let mut wait = None;
        if !self.would_admit(now_ms, config) {
            wait = Some(self.open_until_ms.saturating_sub(now_ms).max(1));
        }
        if self.is_saturated(now_ms) {
            let w = self.saturated_until_ms - now_ms;
            wait = Some(wait.map_or(w, |x: u64| x.max(w)));
        }
        wait
    }

    /// Moves an open breaker whose cooldown has passed to half-open.
    pub fn refresh(&mut self, now_ms: u64) -> Option<BreakerTransition> {
        if self.state == BreakerState::Open && now_ms >= self.open_until_ms {
            self.trials_in_flight = 0;
            self.trial_successes = 0;
            return Some(self.go(BreakerState::HalfOpen));
        }
        None
    }

    /// Admits one request if the breaker allows it, counting half-open trials.
    pub fn admit(&mut self, now_ms: u64, config: &BreakerConfig) -> Option<Admission> {
        self.refresh(now_ms);
        match self.state {
            BreakerState::Closed => Some(Admission::Normal),
            BreakerState::Open => None,
            BreakerState::HalfOpen => {
                if self.trials_in_flight < config.half_open_max_trials.max(1) {
                    self.trials_in_flight += 1;
                    Some(Admission::Trial)
                } else {
                    None
                }
            }
        }
    }

    /// Applies a request's outcome. `trial` says whether the request was admitted as a half-open
    /// trial; `jitter` is a uniform value in `[0, 1)` used if the breaker opens.
    pub fn record(
        &mut self,
        kind: OutcomeKind,
        trial: bool,
        now_ms: u64,
        config: &BreakerConfig,
        jitter: f64,
    ) -> Option<BreakerTransition> {
        self.record_gated(kind, trial, now_ms, config, jitter, true)
    }

    /// Whether recording a failure of `kind` now would open this closed breaker.
    pub fn would_open(&self, kind: OutcomeKind, config: &BreakerConfig) -> bool {
        self.state == BreakerState::Closed
            && kind.is_backend_failure()
            && self.consecutive_failures.saturating_add(1) >= config.failure_threshold.max(1)
    }

    /// Openings refused because the pool's cap on open breakers was reached.
    pub fn openings_held(&self) -> u64 {
        self.openings_held
    }

    /// [`CircuitBreaker::record`], with `may_open` saying whether the pool's cap on open breakers
    /// lets a closed breaker open now. Refused, the breaker stays closed one failure short of
    /// its threshold (so the next failure asks again). A half-open trial's failure reopens it
    /// whatever the cap: it was out of rotation already.
    pub fn record_gated(
        &mut self,
        kind: OutcomeKind,
        trial: bool,
        now_ms: u64,
        config: &BreakerConfig,
        jitter: f64,
        may_open: bool,
    ) -> Option<BreakerTransition> {
        if !may_open && !trial && self.would_open(kind, config) {
            self.consecutive_failures = config.failure_threshold.max(1) - 1;
            self.openings_held += 1;
            return None;
        }
        let is_current_trial = trial && self.state == BreakerState::HalfOpen;
        if is_current_trial {
            self.trials_in_flight = self.trials_in_flight.saturating_sub(1);
        }
        if kind == OutcomeKind::RateLimited {
            self.saturated_until_ms = self
                .saturated_until_ms
                .max(now_ms.saturating_add(config.saturation_ms));
            return None;
        }
        match (self.state, kind) {
            (BreakerState::Closed, OutcomeKind::Success) => {
                self.consecutive_failures = 0;
                None
            }
            (BreakerState::Closed, k) if k.is_backend_failure() => {
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                if self.consecutive_failures >= config.failure_threshold.max(1) {
                    Some(self.open(now_ms, config, jitter))
                } else {
                    None
                }
            }
            (BreakerState::HalfOpen, OutcomeKind::Success) if is_current_trial => {
                self.trial_successes += 1;
                if self.trial_successes >= config.success_threshold.max(1) {
                    self.consecutive_failures = 0;
                    self.open_streak = 0;
                    self.trials_in_flight = 0;
                    self.trial_successes = 0;
                    Some(self.go(BreakerState::Closed))
                } else {
                    None
                }
            }
            (BreakerState::HalfOpen, k) if is_current_trial && k.is_backend_failure() => {
                Some(self.open(now_ms, config, jitter))
            }
            _ => None,
        }
    }

    fn open(&mut self, now_ms: u64, config: &BreakerConfig, jitter: f64) -> BreakerTransition {
        self.open_streak = self.open_streak.saturating_add(1);
        self.open_until_ms = now_ms.saturating_add(config.cooldown_ms(self.open_streak, jitter));
        self.trials_in_flight = 0;
        self.trial_successes = 0;
        self.consecutive_failures = 0;
        self.go(BreakerState::Open)
    }

    fn go(&mut self, to: BreakerState) -> BreakerTransition {
        let from = self.state;
        self.state = to;
        self.transitions[to as usize] += 1;
        BreakerTransition { from, to }
    }

    /// The persistent part of the breaker.
    pub fn snapshot(&self) -> BreakerSnapshot {
        BreakerSnapshot {
            state: self.state,
            open_until_ms: self.open_until_ms,
            consecutive_failures: self.consecutive_failures,
            open_streak: self.open_streak,
        }
    }

    /// A breaker rebuilt from a snapshot. Trials in flight died with the old instance, so a
    /// half-open breaker comes back with all its trial slots free.
    pub fn restore(snapshot: BreakerSnapshot) -> Self {
        CircuitBreaker {
            state: snapshot.state,
            consecutive_failures: snapshot.consecutive_failures,
            open_until_ms: snapshot.open_until_ms,
            open_streak: snapshot.open_streak,
            ..CircuitBreaker::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            failure_threshold: 3,
            success_threshold: 2,
            half_open_max_trials: 2,
            base_cooldown_ms: 1_000,
            max_cooldown_ms: 8_000,
            jitter_ratio: 0.0,
            saturation_ms: 500,
            max_open_ratio: 0.5,
        }
    }

    fn open_breaker(b: &mut CircuitBreaker, now: u64) {
        for _ in 0..3 {
            b.admit(now, &cfg());
            b.record(OutcomeKind::ServerError, false, now, &cfg(), 0.0);
        }
    }

    #[test]
    fn opens_after_consecutive_backend_failures_only() {
        let c = cfg();
        let mut b = CircuitBreaker::new();
        b.record(OutcomeKind::ServerError, false, 0, &c, 0.0);
        b.record(OutcomeKind::Timeout, false, 0, &c, 0.0);
        b.record(OutcomeKind::Success, false, 0, &c, 0.0);
        assert_eq!(b.consecutive_failures(), 0, "a success resets the count");
        b.record(OutcomeKind::Transport, false, 0, &c, 0.0);
        b.record(OutcomeKind::ServerError, false, 0, &c, 0.0);
        assert_eq!(b.state(), BreakerState::Closed);
        let t = b.record(OutcomeKind::Timeout, false, 10, &c, 0.0).unwrap();
        assert_eq!((t.from, t.to), (BreakerState::Closed, BreakerState::Open));
        assert_eq!(b.open_until_ms(), 1_010);
        assert!(!b.would_admit(500, &c));
        assert_eq!(b.admit(500, &c), None);
    }

    #[test]
    fn client_errors_cancellations_and_429_never_open() {
        let c = cfg();
        let mut b = CircuitBreaker::new();
        for _ in 0..100 {
            b.record(OutcomeKind::ClientError, false, 0, &c, 0.0);
            b.record(OutcomeKind::Cancelled, false, 0, &c, 0.0);
            b.record(OutcomeKind::RateLimited, false, 0, &c, 0.0);
        }
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.consecutive_failures(), 0);
    }

    #[test]
    fn rate_limit_marks_saturated_for_a_while() {
        let c = cfg();
        let mut b = CircuitBreaker::new();
        b.record(OutcomeKind::RateLimited, false, 100, &c, 0.0);
        assert!(b.is_saturated(100));
        assert!(b.is_saturated(599));
        assert!(!b.is_saturated(600));
        assert_eq!(b.retry_after_ms(200, &c), Some(400));
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn half_open_after_cooldown_admits_bounded_trials() {
        let c = cfg();
        let mut b = CircuitBreaker::new();
        open_breaker(&mut b, 0);
        assert_eq!(b.state_at(999), BreakerState::Open);
        assert_eq!(b.state_at(1_000), BreakerState::HalfOpen);
        assert!(b.would_admit(1_000, &c));
        assert_eq!(b.admit(1_000, &c), Some(Admission::Trial));
        assert_eq!(b.admit(1_000, &c), Some(Admission::Trial));
        assert_eq!(b.admit(1_000, &c), None, "at most two trials at once");
        assert!(!b.would_admit(1_000, &c));
        b.record(OutcomeKind::Cancelled, true, 1_001, &c, 0.0);
        assert_eq!(b.trials_in_flight(), 1, "a cancelled trial frees its slot");
        assert_eq!(b.admit(1_002, &c), Some(Admission::Trial));
    }

    #[test]
    fn closes_after_enough_trial_successes() {
        let c = cfg();
        let mut b = CircuitBreaker::new();
        open_breaker(&mut b, 0);
        b.admit(1_000, &c);
        b.admit(1_000, &c);
        assert_eq!(b.record(OutcomeKind::Success, true, 1_100, &c, 0.0), None);
        let t = b
            .record(OutcomeKind::Success, true, 1_200, &c, 0.0)
            .unwrap();
        assert_eq!(
            (t.from, t.to),
            (BreakerState::HalfOpen, BreakerState::Closed)
        );
        assert_eq!(b.trials_in_flight(), 0);
        // the streak was reset: the next opening uses the base cooldown again
        open_breaker(&mut b, 2_000);
        assert_eq!(b.open_until_ms(), 3_000);
    }

    #[test]
    fn any_trial_failure_reopens_with_longer_cooldown() {
        let c = cfg();
        let mut b = CircuitBreaker::new();
        open_breaker(&mut b, 0);
        b.admit(1_000, &c);
        b.admit(1_000, &c);
        b.record(OutcomeKind::Success, true, 1_100, &c, 0.0);
        let t = b
            .record(OutcomeKind::Transport, true, 1_200, &c, 0.0)
            .unwrap();
        assert_eq!((t.from, t.to), (BreakerState::HalfOpen, BreakerState::Open));
        assert_eq!(b.open_until_ms(), 1_200 + 2_000);
        b.admit(3_200, &c);
        b.record(OutcomeKind::ServerError, true, 3_200, &c, 0.0);
        assert_eq!(b.open_until_ms(), 3_200 + 4_000);
        b.admit(7_200, &c);
        b.record(OutcomeKind::ServerError, true, 7_200, &c, 0.0);
        assert_eq!(b.open_until_ms(), 7_200 + 8_000);
        b.admit(15_200, &c);
        b.record(OutcomeKind::ServerError, true, 15_200, &c, 0.0);
        assert_eq!(
            b.open_until_ms(),
            15_200 + 8_000,
            "capped at max_cooldown_ms"
        );
        assert_eq!(b.transitions()[BreakerState::Open as usize], 5);
    }

    #[test]
    fn stale_outcomes_from_before_opening_are_ignored() {
        let c = cfg();
        let mut b = CircuitBreaker::new();
        open_breaker(&mut b, 0);
        assert_eq!(b.record(OutcomeKind::ServerError, false, 10, &c, 0.0), None);
        assert_eq!(b.record(OutcomeKind::Success, false, 10, &c, 0.0), None);
        assert_eq!(b.state(), BreakerState::Open);
        b.admit(1_000, &c);
        assert_eq!(
            b.record(OutcomeKind::ServerError, false, 1_001, &c, 0.0),
            None
        );
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert_eq!(b.trials_in_flight(), 1);
    }

    #[test]
    fn jitter_shortens_cooldown_within_ratio() {
        let c = BreakerConfig {
            jitter_ratio: 0.5,
            ..cfg()
        };
        assert_eq!(c.cooldown_ms(1, 0.0), 1_000);
        assert_eq!(c.cooldown_ms(1, 0.5), 750);
        assert!(c.cooldown_ms(1, 0.999_999) >= 500);
        assert_eq!(c.cooldown_ms(100, 0.0), 8_000);
        assert_eq!(c.cooldown_ms(u32::MAX, 0.0), 8_000);
    }

    #[test]
    fn snapshot_round_trips_and_frees_trials() {
        let c = cfg();
        let mut b = CircuitBreaker::new();
        open_breaker(&mut b, 0);
        b.admit(1_000, &c);
        let snap = b.snapshot();
        let json = serde_json::to_string(&snap).unwrap();
        let back: BreakerSnapshot = serde_json::from_str(&json).unwrap();
        let r = CircuitBreaker::restore(back);
        assert_eq!(r.state(), BreakerState::HalfOpen);
        assert_eq!(r.trials_in_flight(), 0);
        assert_eq!(r.snapshot(), snap);
    }

    #[test]
    fn a_refused_opening_keeps_the_breaker_closed_at_its_threshold() {
        let c = cfg();
        let mut b = CircuitBreaker::new();
        b.record(OutcomeKind::ServerError, false, 0, &c, 0.0);
        b.record(OutcomeKind::ServerError, false, 0, &c, 0.0);
        assert!(b.would_open(OutcomeKind::ServerError, &c));
        assert!(!b.would_open(OutcomeKind::ClientError, &c));
        for _ in 0..10 {
            let t = b.record_gated(OutcomeKind::ServerError, false, 1, &c, 0.0, false);
            assert_eq!(t, None);
        }
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.consecutive_failures(), 2);
        assert_eq!(b.openings_held(), 10);
        let t = b.record_gated(OutcomeKind::Timeout, false, 2, &c, 0.0, true);
        assert_eq!(
            t.map(|t| t.to),
            Some(BreakerState::Open),
            "room again: it opens"
        );
    }

    #[test]
    fn the_open_cap_is_a_share_of_the_ready_backends_but_at_least_one() {
        let c = BreakerConfig::default();
        assert_eq!(c.max_open(0), 0);
        assert_eq!(c.max_open(1), 1);
        assert_eq!(c.max_open(2), 1);
        assert_eq!(c.max_open(3), 1);
        assert_eq!(c.max_open(4), 2);
        assert_eq!(c.max_open(10), 5);
        let all = BreakerConfig {
            max_open_ratio: 1.0,
            ..c
        };
        assert_eq!(all.max_open(3), 3);
        let none = BreakerConfig {
            max_open_ratio: 0.0,
            ..c
        };
        assert_eq!(none.max_open(3), 0);
        let bad = BreakerConfig {
            max_open_ratio: 1.5,
            ..c
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn validation_rejects_out_of_range_knobs() {
        assert!(BreakerConfig::default().validate().is_ok());
        let bad = BreakerConfig {
            jitter_ratio: 1.5,
            ..BreakerConfig::default()
        };
        assert!(bad.validate().is_err());
        let bad = BreakerConfig {
            max_cooldown_ms: 1,
            ..BreakerConfig::default()
        };
        assert!(bad.validate().is_err());
    }
}
