//! Probe health: whether a backend answers its health checks.
//!
//! The Durable Object probes every backend every few seconds (`/health`, `/v1/models`,
//! `/metrics`) and feeds each result to [`Health::record`]. Separate thresholds for consecutive
//! failures and successes keep one lost probe from flapping a backend out of rotation, and one
//! lucky probe from bringing a broken one back. A backend starts [`HealthState::Unknown`] and is
//! promoted by its first successful probe; a 503 while vLLM loads its model puts it in
//! [`HealthState::Loading`], out of rotation but not counted as a failure.

use serde::{Deserialize, Serialize};

/// Thresholds for health transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HealthConfig {
    /// Consecutive failed probes that make a backend unhealthy (default 3).
    pub failure_threshold: u32,
    /// Consecutive successful probes that make an unhealthy backend healthy again (default 2).
    /// The very first successful probe of a new backend always promotes it.
    pub success_threshold: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            failure_threshold: 3,
            success_threshold: 2,
        }
    }
}

/// A backend's probe health.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthState {
    /// Never probed successfully; serves nothing.
    #[default]
    Unknown,
    /// Answers its probes; may serve.
    Healthy,
    /// Failed `failure_threshold` probes in a row; serves nothing.
    Unhealthy,
    /// Up but still loading its model (503 on `/health`); serves nothing.
    Loading,
}

impl HealthState {
    /// The state's name as used in JSON and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            HealthState::Unknown => "unknown",
            HealthState::Healthy => "healthy",
            HealthState::Unhealthy => "unhealthy",
            HealthState::Loading => "loading",
        }
    }
}

/// What one probe said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeVerdict {
    /// The server is up and serving.
    Up,
    /// The server is up but loading its model.
    Loading,
    /// No answer, or an error.
    Down,
}

/// A health state change, `from -> to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthTransition {
    /// State before the probe.
    pub from: HealthState,
    /// State after the probe.
    pub to: HealthState,
}

/// A backend's health state machine.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Health {
    /// Current state.
    pub state: HealthState,
    /// Successful probes in a row.
    pub consecutive_successes: u32,
    /// Failed probes in a row.
    pub consecutive_failures: u32,
    /// When the last probe result arrived.
    pub last_probe_ms: Option<u64>,
    /// Number of state changes so far.
    pub transitions: u64,
    /// A model the backend answered "does not exist" for since its last successful probe, when
    /// it was the only one it served: it is not chosen for it until a probe lists it again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub missing_model: Option<String>,
    /// When a request's answer last asked for a probe of this backend out of turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_soon_ms: Option<u64>,
}

/// Shortest time between two out-of-turn probes one backend's answers may ask for, in ms.
pub const PROBE_SOON_MIN_INTERVAL_MS: u64 = 5_000;

impl Health {
    /// Whether an answer of the backend may ask for a probe out of turn now: at most one per
    /// [`PROBE_SOON_MIN_INTERVAL_MS`], so a backend that keeps contradicting its probes cannot
    /// keep the pool probing. Records the ask when it is granted.
    pub fn ask_probe_soon(&mut self, now_ms: u64) -> bool {
        let due = self
            .probe_soon_ms
            .is_none_or(|at| now_ms.saturating_sub(at) >= PROBE_SOON_MIN_INTERVAL_MS);
        if due {
            self.probe_soon_ms = Some(now_ms);
        }
        due
    }

    /// Whether the backend may serve, as far as probes know.
    pub fn is_serving(&self) -> bool {
        self.state == HealthState::Healthy
    }

    /// Applies one probe result; returns the transition if the state changed.
    pub fn record(
        &mut self,
        verdict: ProbeVerdict,
        config: &HealthConfig,
        now_ms: u64,
    ) -> Option<HealthTransition> {
        self.last_probe_ms = Some(now_ms);
        let from = self.state;
        let to = match verdict {
            ProbeVerdict::Up => {
                // The probe's model list is the news now.
                self.missing_model = None;
                self.consecutive_failures = 0;
                self.consecutive_successes = self.consecutive_successes.saturating_add(1);
                match from {
                    HealthState::Healthy | HealthState::Unknown | HealthState::Loading => {
                        HealthState::Healthy
                    }
                    HealthState::Unhealthy
                        if self.consecutive_successes >= config.success_threshold.max(1) =>
                    {
                        HealthState::Healthy
                    }
                    HealthState::Unhealthy => HealthState::Unhealthy,
                }
            }
            ProbeVerdict::Loading => {
                self.consecutive_failures = 0;
                self.consecutive_successes = 0;
                HealthState::Loading
            }
            ProbeVerdict::Down => {
                self.consecutive_successes = 0;
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                if self.consecutive_failures >= config.failure_threshold.max(1) {
                    HealthState::Unhealthy
                } else {
                    from
                }
            }
        };
        if to == from {
            return None;
        }
        self.state = to;
        self.transitions += 1;
        Some(HealthTransition { from, to })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: HealthConfig = HealthConfig {
        failure_threshold: 3,
        success_threshold: 2,
    };

    #[test]
    fn new_backend_is_unknown_until_first_success() {
        let mut h = Health::default();
        assert!(!h.is_serving());
        let t = h.record(ProbeVerdict::Up, &CFG, 1).unwrap();
        assert_eq!((t.from, t.to), (HealthState::Unknown, HealthState::Healthy));
        assert!(h.is_serving());
        assert_eq!(h.last_probe_ms, Some(1));
    }

    #[test]
    fn unknown_backend_becomes_unhealthy_after_failures() {
        let mut h = Health::default();
        assert_eq!(h.record(ProbeVerdict::Down, &CFG, 1), None);
        assert_eq!(h.record(ProbeVerdict::Down, &CFG, 2), None);
        assert_eq!(
            h.record(ProbeVerdict::Down, &CFG, 3).unwrap().to,
            HealthState::Unhealthy
        );
    }

    #[test]
    fn healthy_needs_failure_threshold_in_a_row() {
        let mut h = Health::default();
        h.record(ProbeVerdict::Up, &CFG, 0);
        h.record(ProbeVerdict::Down, &CFG, 1);
        h.record(ProbeVerdict::Down, &CFG, 2);
        h.record(ProbeVerdict::Up, &CFG, 3);
        h.record(ProbeVerdict::Down, &CFG, 4);
        h.record(ProbeVerdict::Down, &CFG, 5);
        assert!(
            h.is_serving(),
            "a success in between resets the failure count"
        );
        let t = h.record(ProbeVerdict::Down, &CFG, 6).unwrap();
        assert_eq!(
            (t.from, t.to),
            (HealthState::Healthy, HealthState::Unhealthy)
        );
    }

    #[test]
    fn unhealthy_needs_success_threshold_in_a_row() {
        let mut h = Health::default();
        for t in 0..3 {
            h.record(ProbeVerdict::Down, &CFG, t);
        }
        assert_eq!(h.record(ProbeVerdict::Up, &CFG, 10), None);
        h.record(ProbeVerdict::Down, &CFG, 11);
        assert_eq!(h.record(ProbeVerdict::Up, &CFG, 12), None);
        let t = h.record(ProbeVerdict::Up, &CFG, 13).unwrap();
        assert_eq!(t.to, HealthState::Healthy);
        assert_eq!(h.transitions, 2);
    }

    #[test]
    fn loading_leaves_rotation_immediately_and_returns_on_success() {
        let mut h = Health::default();
        h.record(ProbeVerdict::Up, &CFG, 0);
        assert_eq!(
            h.record(ProbeVerdict::Loading, &CFG, 1).unwrap().to,
            HealthState::Loading
        );
        assert!(!h.is_serving());
        assert_eq!(h.record(ProbeVerdict::Loading, &CFG, 2), None);
        assert_eq!(
            h.record(ProbeVerdict::Up, &CFG, 3).unwrap().to,
            HealthState::Healthy
        );
    }

    #[test]
    fn loading_that_dies_becomes_unhealthy() {
        let mut h = Health::default();
        h.record(ProbeVerdict::Loading, &CFG, 0);
        for t in 1..=3 {
            h.record(ProbeVerdict::Down, &CFG, t);
        }
        assert_eq!(h.state, HealthState::Unhealthy);
    }

    #[test]
    fn zero_thresholds_behave_as_one() {
        let cfg = HealthConfig {
            failure_threshold: 0,
            success_threshold: 0,
        };
        let mut h = Health::default();
        h.record(ProbeVerdict::Down, &cfg, 0);
        assert_eq!(h.state, HealthState::Unhealthy);
        h.record(ProbeVerdict::Up, &cfg, 1);
        assert_eq!(h.state, HealthState::Healthy);
    }
}
