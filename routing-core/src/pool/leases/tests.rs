//! Tests of [`super`]: what a release charges to breakers, reassignment, expiry and moves onto
//! full backends.

use crate::backend::breaker::BreakerState;
use crate::backend::BackendId;
use crate::backend::Lifecycle;
use crate::policy::PolicyKind;
use crate::pool::test_support::{features, pool_with, spec};
use crate::pool::{AcquireError, PoolError};
use crate::random::SplitMix64;
use crate::stream::outcome::{Outcome, OutcomeKind};

#[test]
fn client_errors_never_open_the_breaker_but_5xx_do() {
    let mut pool = pool_with(PolicyKind::RoundRobin, 1);
    let mut rng = SplitMix64::new(0);
    let id = BackendId::from("b0");
    for t in 0..20 {
        let g = pool.acquire(&features("x"), t, &mut rng).unwrap();
        pool.release(g.lease_id, &Outcome::from_status(400), t);
        let g = pool.acquire(&features("x"), t, &mut rng).unwrap();
        pool.release(g.lease_id, &Outcome::of_kind(OutcomeKind::Cancelled), t);
    }
    assert_eq!(pool.backend(&id).unwrap().breaker, BreakerState::Closed);
    for t in 0..5 {
        let g = pool.acquire(&features("x"), 100 + t, &mut rng).unwrap();
        pool.release(g.lease_id, &Outcome::from_status(502), 100 + t);
    }
    let view = pool.backend(&id).unwrap();
    assert_eq!(view.breaker, BreakerState::Open);
    match pool.acquire(&features("x"), 200, &mut rng) {
        Err(AcquireError::NoBackendAvailable { retry_after_s }) => {
            assert!((1..=5).contains(&retry_after_s))
        }
        other => panic!("{other:?}"),
    }
    // After the cooldown, one trial is admitted; its success (twice) closes the breaker.
    let t = view.breaker_open_until_ms;
    let g = pool.acquire(&features("x"), t, &mut rng).unwrap();
    assert!(
        pool.acquire(&features("x"), t, &mut rng).is_err(),
        "one trial at a time"
    );
    pool.release(g.lease_id, &Outcome::from_status(200), t + 1);
    let g = pool.acquire(&features("x"), t + 2, &mut rng).unwrap();
    pool.release(g.lease_id, &Outcome::from_status(200), t + 3);
    assert_eq!(pool.backend(&id).unwrap().breaker, BreakerState::Closed);
}

#[test]
fn rate_limit_saturates_briefly() {
    let mut pool = pool_with(PolicyKind::RoundRobin, 1);
    let mut rng = SplitMix64::new(0);
    let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
    pool.release(g.lease_id, &Outcome::from_status(429), 1_000);
    assert_eq!(
        pool.acquire(&features("x"), 1_500, &mut rng),
        Err(AcquireError::NoBackendAvailable { retry_after_s: 2 })
    );
    assert!(pool.acquire(&features("x"), 3_000, &mut rng).is_ok());
    assert_eq!(
        pool.backend(&BackendId::from("b0")).unwrap().breaker,
        BreakerState::Closed
    );
}

#[test]
fn reassign_moves_the_lease_and_blames_the_old_backend() {
    let mut pool = pool_with(PolicyKind::RoundRobin, 3);
    let mut rng = SplitMix64::new(0);
    let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
    let next = g.candidates[1].id.clone();
    let view = pool
        .reassign(
            g.lease_id,
            &next,
            &Outcome::of_kind(OutcomeKind::Transport),
            5,
        )
        .unwrap();
    assert_eq!(view.id, next);
    assert_eq!(pool.in_flight(&g.backend).unwrap().leases, 0);
    assert_eq!(pool.in_flight(&next).unwrap().leases, 1);
    let stats = &pool
        .entries()
        .find(|e| e.spec.id == g.backend)
        .unwrap()
        .stats;
    assert_eq!(stats.outcomes[OutcomeKind::Transport.index()], 1);
    assert!(pool.release(g.lease_id, &Outcome::from_status(200), 9));
    assert_eq!(pool.in_flight_total(), 0);
    assert!(matches!(
        pool.reassign(g.lease_id, &next, &Outcome::default(), 10),
        Err(PoolError::UnknownLease { .. })
    ));
}

#[test]
fn reassign_to_an_unavailable_backend_changes_nothing() {
    let mut pool = pool_with(PolicyKind::RoundRobin, 2);
    let pending = pool.add_backend(spec("new"), 0).unwrap();
    let mut rng = SplitMix64::new(0);
    let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
    assert_eq!(
        pool.reassign(
            g.lease_id,
            &pending,
            &Outcome::of_kind(OutcomeKind::Timeout),
            1
        ),
        Err(PoolError::BackendUnavailable {
            id: pending.clone()
        })
    );
    assert_eq!(pool.in_flight(&g.backend).unwrap().leases, 1);
}

#[test]
fn expiry_frees_counters_and_drains() {
    let mut pool = pool_with(PolicyKind::RoundRobin, 1);
    let mut rng = SplitMix64::new(0);
    let id = BackendId::from("b0");
    let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
    assert_eq!(
        pool.set_lifecycle(&id, Lifecycle::Draining, 1),
        Ok(Lifecycle::Draining)
    );
    assert!(pool.acquire(&features("x"), 2, &mut rng).is_err());
    assert_eq!(pool.expire(59_999), 0);
    assert_eq!(pool.expire(60_000), 1);
    assert_eq!(pool.in_flight_total(), 0);
    assert_eq!(pool.backend(&id).unwrap().lifecycle, Lifecycle::Drained);
    assert!(!pool.release(g.lease_id, &Outcome::default(), 60_001));
    assert_eq!(pool.next_deadline(), None);
    assert_eq!(
        pool.set_lifecycle(&id, Lifecycle::Ready, 3),
        Ok(Lifecycle::Ready)
    );
    assert!(pool.acquire(&features("x"), 4, &mut rng).is_ok());
}

/// A pool of `n` backends of one sequence each, admission control on.
fn strict_pool(n: usize) -> crate::pool::Pool {
    let mut pool = crate::pool::Pool::new(
        "p1",
        crate::pool::PoolConfig {
            policy: PolicyKind::LeastLoad,
            admission: crate::pool::AdmissionConfig {
                enabled: true,
                ..crate::pool::AdmissionConfig::default()
            },
            ..crate::pool::PoolConfig::default()
        },
    );
    for i in 0..n {
        let mut s = spec(&format!("b{i}"));
        s.capacity.max_num_seqs = 1;
        crate::pool::test_support::add_ready(&mut pool, s);
    }
    pool
}

#[test]
fn a_move_onto_a_full_backend_is_refused_and_one_with_room_is_taken() {
    let mut pool = strict_pool(3);
    let mut rng = SplitMix64::new(0);
    let a = pool.acquire(&features("a"), 0, &mut rng).unwrap();
    let b = pool.acquire(&features("b"), 0, &mut rng).unwrap();
    let free: Vec<BackendId> = ["b0", "b1", "b2"]
        .iter()
        .map(|id| BackendId::from(*id))
        .filter(|id| *id != a.backend && *id != b.backend)
        .collect();
    let failure = Outcome::of_kind(OutcomeKind::Transport);
    // b's backend is full: the retry of a there is refused and nothing moves.
    assert_eq!(
        pool.reassign(a.lease_id, &b.backend, &failure, 1),
        Err(PoolError::BackendUnavailable {
            id: b.backend.clone()
        })
    );
    assert_eq!(pool.in_flight(&a.backend).unwrap().leases, 1);
    assert_eq!(pool.in_flight(&b.backend).unwrap().leases, 1);
    // The next candidate has room: the lease goes there.
    let view = pool.reassign(a.lease_id, &free[0], &failure, 2).unwrap();
    assert_eq!(view.id, free[0]);
    assert_eq!(pool.in_flight(&a.backend).unwrap().leases, 0);
    assert_eq!(pool.in_flight(&free[0]).unwrap().leases, 1);
    // A retry on the backend it already holds adds nothing, so it is not refused as full.
    assert!(pool.reassign(a.lease_id, &free[0], &failure, 3).is_ok());
    pool.check_counters().unwrap();
}

#[test]
fn a_lost_lease_is_readmitted_even_over_capacity_but_a_move_of_it_is_checked() {
    let mut pool = strict_pool(2);
    let mut rng = SplitMix64::new(0);
    let a = pool.acquire(&features("a"), 0, &mut rng).unwrap();
    let b = pool.acquire(&features("b"), 0, &mut rng).unwrap();
    // The pool forgot a stream that still runs on a's backend (say, a restart) while that
    // backend took another request: readmitting it is counted, never refused, because the
    // stream runs there whatever the pool says.
    let terms = crate::pool::lease::LeaseTerms {
        backend: a.backend.clone(),
        prompt_tokens: 10,
        max_tokens: 10,
        ..crate::pool::lease::LeaseTerms::default()
    };
    let lost = 999;
    assert!(pool.readmit(lost, &terms, 5).is_ok());
    assert_eq!(pool.in_flight(&a.backend).unwrap().leases, 2);
    // It now counts: no new request and no move may land on either full backend.
    assert!(pool.acquire(&features("c"), 6, &mut rng).is_err());
    let failure = Outcome::of_kind(OutcomeKind::Transport);
    assert!(pool.reassign(lost, &b.backend, &failure, 7).is_err());
    pool.check_counters().unwrap();
    pool.release(lost, &Outcome::from_status(200), 8);
    pool.release(a.lease_id, &Outcome::from_status(200), 8);
    pool.release(b.lease_id, &Outcome::from_status(200), 8);
    assert_eq!(pool.in_flight_total(), 0);
}
