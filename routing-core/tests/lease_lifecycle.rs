//! Leases that live as long as their requests: renewal pushes the deadline out, and a lease the
//! pool lost (expired while its request still ran, or the Durable Object restarted) is counted
//! again from the Worker's [`LeaseTerms`], on renewal or on a retry, without leaking counters.

mod common;

use routing_core::pool::lease::LeaseTerms;
use routing_core::{
    BackendId, Outcome, OutcomeKind, PolicyKind, Pool, PoolConfig, PoolError, ProbeResult,
    RequestFeatures, SplitMix64,
};

const TTL: u64 = 10_000;

fn pool(n: usize) -> Pool {
    let config = PoolConfig {
        policy: PolicyKind::RoundRobin,
        lease_ttl_ms: TTL,
        ..PoolConfig::default()
    };
    common::small_pool(config, n)
}

fn features() -> RequestFeatures {
    RequestFeatures {
        model: "m".into(),
        prompt_tokens: 100,
        max_tokens: 50,
        request_id: "r1".into(),
        ..RequestFeatures::default()
    }
}

fn terms(backend: &BackendId) -> LeaseTerms {
    LeaseTerms {
        backend: backend.clone(),
        prompt_tokens: 100,
        max_tokens: 50,
        stream: true,
        request_id: "r1".into(),
    }
}

#[test]
fn renewal_keeps_a_long_request_counted() {
    let mut p = pool(1);
    let g = p.acquire(&features(), 0, &mut SplitMix64::new(1)).unwrap();
    assert_eq!(g.deadline_ms, TTL);
    // A request running for ten lease periods, renewed every third of one.
    let mut now = 0;
    while now < 10 * TTL {
        now += TTL / 3;
        assert_eq!(p.renew(g.lease_id, now), Ok(now + TTL));
        assert_eq!(p.expire(now), 0, "a renewed lease never expires");
        assert_eq!(p.live_leases(), 1);
    }
    assert!(p.release(g.lease_id, &Outcome::from_status(200), now));
    assert_eq!(p.in_flight_total(), 0);
    assert_eq!(
        p.renew(g.lease_id, now),
        Err(PoolError::UnknownLease {
            lease_id: g.lease_id
        })
    );
}

#[test]
fn an_unrenewed_lease_still_expires() {
    let mut p = pool(1);
    let g = p.acquire(&features(), 0, &mut SplitMix64::new(1)).unwrap();
    p.renew(g.lease_id, 1_000).unwrap();
    assert_eq!(p.expire(1_000 + TTL - 1), 0);
    assert_eq!(p.expire(1_000 + TTL), 1);
    assert_eq!(p.in_flight_total(), 0);
    p.check_counters().unwrap();
}

#[test]
fn a_lost_lease_is_counted_again_on_renewal() {
    // The Durable Object restarted: a fresh pool knows nothing of the running request.
    let mut p = pool(2);
    let b1: BackendId = "b1".into();
    let lease_id = 12345;
    assert_eq!(
        p.renew(lease_id, 0),
        Err(PoolError::UnknownLease { lease_id })
    );
    assert_eq!(p.readmit(lease_id, &terms(&b1), 500), Ok(500 + TTL));
    let counted = p.in_flight(&b1).unwrap();
    assert_eq!(
        (counted.leases, counted.prompt_tokens, counted.output_tokens),
        (1, 100, 50)
    );
    // Readmitting a live lease only renews it.
    assert_eq!(p.readmit(lease_id, &terms(&b1), 900), Ok(900 + TTL));
    assert_eq!(p.in_flight(&b1).unwrap().leases, 1);
    p.check_counters().unwrap();
    assert!(p.release(lease_id, &Outcome::from_status(200), 1_000));
    assert_eq!(p.in_flight_total(), 0);
    p.check_counters().unwrap();
}

#[test]
fn a_lost_lease_can_still_be_retried_elsewhere() {
    let mut p = pool(2);
    let g = p.acquire(&features(), 0, &mut SplitMix64::new(1)).unwrap();
    let (first, other) = (g.candidates[0].id.clone(), g.candidates[1].id.clone());
    // Expired while the first attempt hung.
    assert_eq!(p.expire(TTL), 1);
    let failure = Outcome::of_kind(OutcomeKind::Timeout);
    assert!(matches!(
        p.reassign(g.lease_id, &other, &failure, TTL + 1),
        Err(PoolError::UnknownLease { .. })
    ));
    // What the coordinator does then: count it again where it was, and move it.
    p.readmit(g.lease_id, &terms(&first), TTL + 1).unwrap();
    let moved = p.reassign(g.lease_id, &other, &failure, TTL + 1).unwrap();
    assert_eq!(moved.id, other);
    assert_eq!(p.in_flight(&first).unwrap().leases, 0);
    assert_eq!(p.in_flight(&other).unwrap().leases, 1);
    p.check_counters().unwrap();
    assert!(p.release(g.lease_id, &Outcome::from_status(200), TTL + 2));
    assert_eq!(p.in_flight_total(), 0);
}

#[test]
fn readmission_needs_a_known_backend_and_a_valid_id() {
    let mut p = pool(1);
    assert!(matches!(
        p.readmit(7, &terms(&"nope".into()), 0),
        Err(PoolError::UnknownBackend { .. })
    ));
    assert!(matches!(
        p.readmit(0, &terms(&"b0".into()), 0),
        Err(PoolError::UnknownLease { .. })
    ));
    assert!(matches!(
        p.readmit(1 << 60, &terms(&"b0".into()), 0),
        Err(PoolError::UnknownLease { .. })
    ));
    assert_eq!(p.in_flight_total(), 0);
}

#[test]
fn the_prefix_is_recorded_on_the_backend_that_served() {
    let mut p = pool(2);
    let hashes = vec![11, 22, 33];
    let g = p.acquire(&features(), 0, &mut SplitMix64::new(1)).unwrap();
    let served = g.candidates[1].id.clone();
    let failure = Outcome::of_kind(OutcomeKind::Transport);
    p.reassign(g.lease_id, &served, &failure, 1).unwrap();
    p.record_prefix(&served, &hashes).unwrap();
    let mut lengths = Vec::new();
    p.affinity().match_lengths(&hashes, &mut lengths);
    let slot_of_served = p.backends().position(|v| v.id == served).unwrap();
    assert_eq!(lengths[slot_of_served], 3);
    assert!(p.record_prefix(&"nope".into(), &hashes).is_err());
}

#[test]
fn a_backend_that_no_longer_serves_a_model_stops_getting_it() {
    let mut p = pool(2);
    let b0: BackendId = "b0".into();
    // b0 serves two models; "m" was unloaded.
    let both = ProbeResult {
        ok: true,
        models: Some(vec!["m".into(), "other".into()]),
        ..ProbeResult::default()
    };
    p.record_probe(&b0, &both, 1).unwrap();
    assert_eq!(p.forget_model(&b0, "m"), Ok(true));
    assert_eq!(
        p.backend(&b0).unwrap().served_models,
        vec!["other".to_string()]
    );
    for i in 0..6 {
        let g = p
            .acquire(&features(), 10 + i, &mut SplitMix64::new(i))
            .unwrap();
        assert!(
            g.candidates.iter().all(|c| c.id != b0),
            "b0 was offered for m"
        );
        p.release(g.lease_id, &Outcome::from_status(200), 10 + i);
    }
    // A backend whose only model it was leaves rotation for it too (until its next probe).
    let b1: BackendId = "b1".into();
    assert_eq!(p.forget_model(&b1, "m"), Ok(true));
    assert!(p.acquire(&features(), 30, &mut SplitMix64::new(0)).is_err());
    assert_eq!(p.forget_model(&b0, "not-there"), Ok(false));
    // The next probe restores what the backend says it serves.
    p.record_probe(&b0, &both, 20).unwrap();
    assert!(p
        .backend(&b0)
        .unwrap()
        .served_models
        .contains(&"m".to_string()));
}

/// A disaggregated pool with one prefill and one decode backend whose breakers open at once.
fn disaggregated_pool() -> Pool {
    use routing_core::{BackendSpec as Spec, Role};
    let mut p = Pool::new(
        "p",
        PoolConfig {
            policy: PolicyKind::Disaggregated,
            breaker: routing_core::BreakerConfig {
                failure_threshold: 1,
                ..Default::default()
            },
            ..PoolConfig::default()
        },
    );
    for (id, role) in [("pf", Role::Prefill), ("dc", Role::Decode)] {
        let spec = Spec {
            id: id.into(),
            url: format!("http://{id}:8000"),
            models: vec!["m".into()],
            role,
            ..Spec::default()
        };
        common::add_ready(&mut p, spec);
    }
    p
}

#[test]
fn each_stage_of_a_disaggregated_request_reports_its_own_outcome() {
    let mut p = disaggregated_pool();
    let (pf, dc): (BackendId, BackendId) = ("pf".into(), "dc".into());
    // Prefill succeeds: its share ends at once; the decode share stays until the stream ends.
    let g = p.acquire(&features(), 0, &mut SplitMix64::new(1)).unwrap();
    assert_eq!(g.backend, pf);
    assert!(p.finish_prefill(g.lease_id, &Outcome::from_status(200), 5));
    assert_eq!(p.in_flight(&pf).unwrap().leases, 0);
    assert_eq!(p.in_flight(&dc).unwrap().leases, 1);
    p.check_counters().unwrap();
    assert!(
        !p.finish_prefill(g.lease_id, &Outcome::from_status(200), 6),
        "one prefill stage per lease"
    );
    // The decode stage fails: only the decode backend is blamed.
    assert!(p.release(g.lease_id, &Outcome::of_kind(OutcomeKind::Transport), 10));
    assert_eq!(
        p.backend(&dc).unwrap().breaker,
        routing_core::BreakerState::Open
    );
    assert_eq!(
        p.backend(&pf).unwrap().breaker,
        routing_core::BreakerState::Closed
    );
    assert_eq!(p.in_flight_total(), 0);
}

#[test]
fn a_failed_prefill_blames_the_prefill_backend_only() {
    let mut p = disaggregated_pool();
    let g = p.acquire(&features(), 0, &mut SplitMix64::new(1)).unwrap();
    assert!(p.finish_prefill(g.lease_id, &Outcome::from_status(500), 5));
    // The decode stage never ran: the request ends as cancelled there.
    assert!(p.release(g.lease_id, &Outcome::of_kind(OutcomeKind::Cancelled), 6));
    assert_eq!(
        p.backend(&"pf".into()).unwrap().breaker,
        routing_core::BreakerState::Open
    );
    assert_eq!(
        p.backend(&"dc".into()).unwrap().breaker,
        routing_core::BreakerState::Closed
    );
    assert_eq!(p.in_flight_total(), 0);
    p.check_counters().unwrap();
}
