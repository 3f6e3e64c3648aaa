//! Blame goes to what failed: a 5xx that a request gets from every backend it tries is the
//! request's (no breaker is charged, the first backend's deferred charge is withdrawn); a 5xx the
//! next backend does not repeat is charged to the first one at the release; a first-byte timeout
//! the backend's queue explains is load, not failure; and no more than `breaker.max_open_ratio`
//! of a pool's ready backends' breakers are ever open at once.

mod common;

use routing_core::{
    BackendId, BreakerConfig, BreakerState, Outcome, OutcomeKind, PolicyKind, Pool, PoolConfig,
    RequestFeatures, SplitMix64,
};

fn pool(n: usize, breaker: BreakerConfig) -> Pool {
    let config = PoolConfig {
        policy: PolicyKind::RoundRobin,
        breaker,
        ..PoolConfig::default()
    };
    common::small_pool(config, n)
}

fn features() -> RequestFeatures {
    RequestFeatures {
        model: "m".into(),
        prompt_tokens: 100,
        max_tokens: 50,
        request_id: "r".into(),
        ..RequestFeatures::default()
    }
}

/// Opens a breaker at the second consecutive failure, so a test shows what one more charge does.
fn two_strikes() -> BreakerConfig {
    BreakerConfig {
        failure_threshold: 2,
        ..BreakerConfig::default()
    }
}

fn request_fault(status: u16) -> Outcome {
    Outcome {
        request_fault: true,
        ..Outcome::from_status(status)
    }
}

fn breakers(pool: &Pool) -> Vec<BreakerState> {
    pool.backends().map(|v| v.breaker).collect()
}

/// One request that fails with `first` on its first backend, is moved to the next, and ends
/// there with `last`. Returns the two backends.
fn fail_then(pool: &mut Pool, t: u64, first: &Outcome, last: &Outcome) -> (BackendId, BackendId) {
    let g = pool
        .acquire(&features(), t, &mut SplitMix64::new(t))
        .unwrap();
    let next = g.candidates[1].id.clone();
    pool.reassign(g.lease_id, &next, first, t).unwrap();
    assert!(pool.release(g.lease_id, last, t + 1));
    (g.backend, next)
}

#[test]
fn a_poison_request_charges_no_breaker_however_often_it_comes() {
    let mut p = pool(3, two_strikes());
    for t in 0..50 {
        fail_then(
            &mut p,
            t * 10,
            &Outcome::from_status(500),
            &request_fault(500),
        );
    }
    assert_eq!(breakers(&p), [BreakerState::Closed; 3]);
    assert_eq!(p.in_flight_total(), 0);
    // The statistics still show what the backends answered.
    let errors: u64 = p
        .backend_reports()
        .map(|r| r.stats.outcomes[OutcomeKind::ServerError.index()])
        .sum();
    assert_eq!(errors, 100);
    // Ordinary requests find every backend.
    let mut chosen = std::collections::HashSet::new();
    for t in 0..6 {
        let g = p
            .acquire(&features(), 1_000 + t, &mut SplitMix64::new(t))
            .unwrap();
        chosen.insert(g.backend.clone());
        p.release(g.lease_id, &Outcome::from_status(200), 1_000 + t);
    }
    assert_eq!(chosen.len(), 3);
}

#[test]
fn a_5xx_the_next_backend_does_not_repeat_is_charged_at_the_release() {
    let mut p = pool(3, two_strikes());
    let (first, _) = fail_then(
        &mut p,
        0,
        &Outcome::from_status(503),
        &Outcome::from_status(200),
    );
    let view = p.backend(&first).unwrap();
    assert_eq!(view.breaker, BreakerState::Closed, "one strike");
    // The same backend fails a second request the same way: its second strike opens it.
    let mut t = 10;
    loop {
        let g = p.acquire(&features(), t, &mut SplitMix64::new(t)).unwrap();
        if g.backend == first {
            let next = g.candidates[1].id.clone();
            p.reassign(g.lease_id, &next, &Outcome::from_status(503), t)
                .unwrap();
            assert_eq!(
                p.backend(&first).unwrap().breaker,
                BreakerState::Closed,
                "the charge waits for the release"
            );
            p.release(g.lease_id, &Outcome::from_status(200), t + 1);
            break;
        }
        p.release(g.lease_id, &Outcome::from_status(200), t);
        t += 1;
    }
    assert_eq!(p.backend(&first).unwrap().breaker, BreakerState::Open);
    assert_eq!(p.in_flight_total(), 0);
}

#[test]
fn a_transport_failure_is_charged_at_once() {
    let no_cap = BreakerConfig {
        max_open_ratio: 1.0,
        ..two_strikes()
    };
    let mut p = pool(2, no_cap);
    let g = p.acquire(&features(), 0, &mut SplitMix64::new(0)).unwrap();
    let next = g.candidates[1].id.clone();
    p.reassign(
        g.lease_id,
        &next,
        &Outcome::of_kind(OutcomeKind::Transport),
        0,
    )
    .unwrap();
    p.release(g.lease_id, &request_fault(500), 1);
    assert_eq!(breakers(&p), [BreakerState::Closed; 2]);
    // One more failure on each: the first backend had one strike (the transport failure), so it
    // opens; the second had none (the request's fault), so it does not.
    for (backend, t) in [(&g.backend, 10), (&next, 20)] {
        let mut now = t;
        loop {
            let g = p
                .acquire(&features(), now, &mut SplitMix64::new(now))
                .unwrap();
            let hit = &g.backend == backend;
            let outcome = if hit {
                Outcome::from_status(502)
            } else {
                Outcome::from_status(200)
            };
            p.release(g.lease_id, &outcome, now);
            now += 1;
            if hit {
                break;
            }
        }
    }
    assert_eq!(p.backend(&g.backend).unwrap().breaker, BreakerState::Open);
    assert_eq!(p.backend(&next).unwrap().breaker, BreakerState::Closed);
}

#[test]
fn a_first_byte_timeout_the_queue_explains_is_load_not_failure() {
    let mut p = pool(1, two_strikes());
    let id = BackendId::from("b0");
    // Two requests that waited 30 s in a queue the last scrape saw: a full batch and more waiting.
    let probe = routing_core::ProbeResult {
        ok: true,
        metrics: routing_core::backend::scrape::VllmMetrics {
            gauges: routing_core::backend::scrape::ScrapedGauges {
                running: Some(256.0),
                waiting: Some(40.0),
                ..Default::default()
            },
            ..Default::default()
        },
        ..Default::default()
    };
    p.record_probe(&id, &probe, 0).unwrap();
    let timeout = Outcome {
        ttfb_ms: Some(30_000),
        ..Outcome::of_kind(OutcomeKind::Timeout)
    };
    for t in 0..4 {
        let g = p
            .acquire(&features(), 40_000 * t, &mut SplitMix64::new(t))
            .unwrap();
        p.release(g.lease_id, &timeout, 40_000 * t + 30_000);
    }
    let view = p.backend(&id).unwrap();
    assert_eq!(view.breaker, BreakerState::Closed);
    assert_eq!(
        view.saturated_until_ms, 152_000,
        "counted as load: briefly avoided"
    );
    // Without a queue to explain them, the same timeouts open the breaker.
    let idle = routing_core::ProbeResult {
        ok: true,
        metrics: routing_core::backend::scrape::VllmMetrics {
            gauges: routing_core::backend::scrape::ScrapedGauges {
                running: Some(0.0),
                waiting: Some(0.0),
                ..Default::default()
            },
            ..Default::default()
        },
        ..Default::default()
    };
    p.record_probe(&id, &idle, 190_000).unwrap();
    for t in 0..2 {
        let now = 200_000 + 40_000 * t;
        let g = p
            .acquire(&features(), now, &mut SplitMix64::new(t))
            .unwrap();
        p.release(g.lease_id, &timeout, now + 30_000);
    }
    assert_eq!(p.backend(&id).unwrap().breaker, BreakerState::Open);
}

#[test]
fn breakers_never_take_more_than_the_cap_out_of_rotation() {
    for (n, ratio, cap) in [(3, 0.5, 1), (4, 0.5, 2), (3, 1.0, 3), (2, 0.5, 1)] {
        let mut p = pool(
            n,
            BreakerConfig {
                max_open_ratio: ratio,
                ..two_strikes()
            },
        );
        // Every backend fails every request, for a long while.
        for t in 0..200u64 {
            let Ok(g) = p.acquire(&features(), t, &mut SplitMix64::new(t)) else {
                continue;
            };
            p.release(g.lease_id, &Outcome::from_status(502), t);
            let open = breakers(&p)
                .iter()
                .filter(|b| **b != BreakerState::Closed)
                .count();
            assert!(
                open <= cap,
                "{n} backends at {ratio}: {open} open, cap {cap}"
            );
        }
        let open = breakers(&p)
            .iter()
            .filter(|b| **b != BreakerState::Closed)
            .count();
        assert_eq!(open, cap, "{n} backends at {ratio}");
        assert_eq!(p.in_flight_total(), 0);
    }
}
