//! Tests of [`super`]: opening on backend failures only, saturation on 429, half-open trials,
//! cooldown jitter, snapshots, the cap on open breakers and validation.

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
