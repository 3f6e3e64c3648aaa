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

use crate::stream::outcome::OutcomeKind;
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
mod tests;
