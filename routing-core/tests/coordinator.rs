//! The pool coordinator's rules, through `routing_core::coordinator::Coordinator` as the Durable
//! Object drives it: drains and the pending deletes they end, the restart's hold on restored
//! drains, the retry budget's gate on reassigns, spillover counting, probe rounds, the waiting
//! room's settle (grants to waiters, timeouts, clients gone) and the exact effects each call
//! returns.

use routing_core::admission::{AdmissionRequest, DropReason, Ticket};
use routing_core::backend::health::HealthState;
use routing_core::backend::scrape::VllmMetrics;
use routing_core::backend::{BackendId, BackendSpec, Capacity, Lifecycle};
use routing_core::coordinator::load::LoadTargets;
use routing_core::coordinator::reassign::{FailedAttempt, RetryRefused};
use routing_core::coordinator::retry_budget::RetryBudgetConfig;
use routing_core::coordinator::{
    Callers, Coordinator, CoordinatorSettings, Deletion, Effect, ProbeReport, Release, Step,
    Stored, WaitEnd,
};
use routing_core::pool::lease::LeaseTerms;
use routing_core::pool::{
    AcquireError, AdmissionConfig, BackendSnapshot, Grant, PoolConfig, ProbeResult,
};
use routing_core::stream::outcome::StoredResponse;
use routing_core::{Outcome, PolicyKind, RequestFeatures};
use std::collections::{HashMap, HashSet};

const TTL: u64 = 10_000;

/// The open calls as a test sees them: the tickets whose client hung up.
#[derive(Default)]
struct Hungup(HashSet<Ticket>);

impl Callers for Hungup {
    fn left(&self, ticket: Ticket) -> bool {
        self.0.contains(&ticket)
    }
}

fn spec(i: usize, max_num_seqs: u32) -> BackendSpec {
    BackendSpec {
        id: format!("b{i}").into(),
        url: format!("http://b{i}:8000"),
        models: vec!["m".into()],
        capacity: Capacity {
            max_num_seqs,
            ..Capacity::default()
        },
        ..BackendSpec::default()
    }
}

fn id(i: usize) -> BackendId {
    format!("b{i}").into()
}

fn routing() -> PoolConfig {
    PoolConfig {
        policy: PolicyKind::RoundRobin,
        lease_ttl_ms: TTL,
        ..PoolConfig::default()
    }
}

fn settings(routing: PoolConfig) -> CoordinatorSettings {
    CoordinatorSettings {
        routing,
        ..CoordinatorSettings::default()
    }
}

fn up() -> ProbeReport {
    ProbeReport {
        result: ProbeResult {
            ok: true,
            ..ProbeResult::default()
        },
        ..ProbeReport::default()
    }
}

fn features() -> RequestFeatures {
    RequestFeatures {
        model: "m".into(),
        prompt_tokens: 10,
        max_tokens: 10,
        ..RequestFeatures::default()
    }
}

fn snapshot(c: &Coordinator, i: usize) -> BackendSnapshot {
    c.pool().snapshot(&id(i)).unwrap()
}

/// A coordinator for shard 0 of one shard with `n` backends registered and probed up at time 0.
fn coordinator(settings: CoordinatorSettings, n: usize, max_num_seqs: u32) -> Coordinator {
    let (mut c, failed) = Coordinator::restore("p", 0, settings, Stored::default(), 7, 0);
    assert!(failed.is_empty());
    for i in 0..n {
        c.register(spec(i, max_num_seqs), 0).unwrap();
    }
    // Two successes make a backend healthy.
    for t in [0, 1] {
        c.record_probes((0..n).map(|i| (id(i), up())).collect(), t);
    }
    let _ = c.finish_probe_round(1, &Hungup::default());
    for i in 0..n {
        let view = c.pool().backend(&id(i)).unwrap();
        assert_eq!(
            (view.lifecycle, view.health),
            (Lifecycle::Ready, HealthState::Healthy)
        );
    }
    c
}

fn grant(step: Step) -> Grant {
    match step {
        Step::Done(WaitEnd::Granted { grant, .. }) => grant,
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn acquire(c: &mut Coordinator, now: u64) -> Grant {
    let (step, effects) = c.acquire(features(), None, None, false, now, &Hungup::default());
    assert_eq!(effects, vec![]);
    grant(step)
}

fn release(c: &mut Coordinator, lease_id: u64, backend: &BackendId, now: u64) -> Vec<Effect> {
    let ok = Outcome::from_status(200);
    let one = Release {
        lease_id,
        outcome: &ok,
        backend: Some(backend),
    };
    let (released, effects) = c.release(&[one], now);
    assert_eq!(released, vec![true]);
    effects
}

#[test]
fn registering_writes_the_spec_and_its_state_and_asks_for_a_probe() {
    let (mut c, _) = Coordinator::restore("p", 0, settings(routing()), Stored::default(), 1, 0);
    let effects = c.register(spec(0, 8), 5).unwrap();
    let pending = snapshot(&c, 0);
    assert_eq!(pending.lifecycle, Lifecycle::Pending);
    assert_eq!(
        effects,
        vec![
            Effect::PersistSpec(spec(0, 8)),
            Effect::PersistSnapshot(pending),
            Effect::ProbeSoon
        ]
    );
}

#[test]
fn a_probe_round_makes_backends_healthy_and_writes_only_what_changed() {
    let (mut c, _) = Coordinator::restore("p", 0, settings(routing()), Stored::default(), 1, 0);
    c.register(spec(0, 8), 0).unwrap();
    c.register(spec(1, 8), 0).unwrap();
    c.record_probes(vec![(id(0), up()), (id(1), up())], 10);
    c.record_probes(vec![(id(0), up()), (id(1), up())], 20);
    let effects = c.finish_probe_round(20, &Hungup::default());
    let (b0, b1) = (snapshot(&c, 0), snapshot(&c, 1));
    assert_eq!(
        (b0.lifecycle, b0.health),
        (Lifecycle::Ready, HealthState::Healthy)
    );
    let card = match effects.last() {
        Some(Effect::PublishCard(card)) => card.clone(),
        other => panic!("shard 0 publishes its card, got {other:?}"),
    };
    assert_eq!(card.at_ms, 20);
    assert_eq!(
        effects,
        vec![
            Effect::PersistSnapshot(b0),
            Effect::PersistSnapshot(b1),
            Effect::PublishCard(card)
        ]
    );
    assert_eq!(c.counters().probe_rounds, 1);
    assert_eq!((c.counters().probes_ok, c.counters().probes_failed), (4, 0));
    assert_eq!(c.last_probe_ms(), Some(20));
    // Nothing changed in the next round: nothing to write.
    c.record_probes(vec![(id(0), up()), (id(1), up())], 30);
    let effects = c.finish_probe_round(30, &Hungup::default());
    assert!(
        matches!(effects.as_slice(), [Effect::PublishCard(_)]),
        "{effects:?}"
    );
}

#[test]
fn a_503_after_serving_is_a_failure_and_three_make_the_backend_unhealthy() {
    let mut c = coordinator(settings(routing()), 1, 8);
    let loading = ProbeReport {
        result: ProbeResult {
            loading: true,
            ..ProbeResult::default()
        },
        ..ProbeReport::default()
    };
    for t in 0..2 {
        c.record_probes(vec![(id(0), loading.clone())], 10 + t);
    }
    let report = c.probe_report(&id(0)).unwrap();
    assert_eq!(report.error.as_deref(), Some("/health answered 503"));
    assert!(!report.result.loading);
    assert_eq!(
        c.pool().backend(&id(0)).unwrap().health,
        HealthState::Healthy
    );
    assert_eq!(
        c.finish_probe_round(12, &Hungup::default()).len(),
        1,
        "only the card: still healthy after two failures"
    );
    c.record_probes(vec![(id(0), loading)], 13);
    let effects = c.finish_probe_round(13, &Hungup::default());
    let down = snapshot(&c, 0);
    assert_eq!(down.health, HealthState::Unhealthy);
    assert_eq!(effects[0], Effect::PersistSnapshot(down));
    assert_eq!(c.counters().probes_failed, 3);
}

#[test]
fn a_drain_finishes_when_its_last_lease_ends_and_the_pending_delete_removes_the_backend() {
    let mut c = coordinator(settings(routing()), 2, 8);
    let g = acquire(&mut c, 100);
    let busy = g.backend.clone();
    let (deletion, effects) = c.delete(&busy, false, 200).unwrap();
    assert_eq!(
        deletion,
        Deletion::Draining {
            leases_in_flight: 1
        }
    );
    let i = if busy == id(0) { 0 } else { 1 };
    let draining = snapshot(&c, i);
    assert_eq!(draining.lifecycle, Lifecycle::Draining);
    assert_eq!(
        effects,
        vec![
            Effect::PersistDrainStarts,
            Effect::PersistPendingDeletes,
            Effect::PersistSnapshot(draining)
        ]
    );
    assert!(c.drains().delete_pending(&busy));
    assert_eq!(c.drains().starts().get(&busy), Some(&200));
    // Nothing new goes to a draining backend.
    let other = acquire(&mut c, 300);
    assert_ne!(other.backend, busy);
    // The last lease ends: the drain is over and the backend goes.
    let effects = release(&mut c, g.lease_id, &busy, 400);
    assert!(c.pool().backend(&busy).is_none());
    assert!(c.drains().pending_deletes().is_empty() && c.drains().starts().is_empty());
    let drained = BackendSnapshot {
        lifecycle: Lifecycle::Drained,
        ..snapshot_before(&effects)
    };
    assert_eq!(
        effects,
        vec![
            Effect::PersistSnapshot(drained),
            Effect::DeleteBackend(busy.clone()),
            Effect::PersistDrainStarts,
            Effect::PersistPendingDeletes
        ]
    );
    // An idle backend goes at once.
    let (deletion, effects) = c.delete(&other.backend, true, 500).unwrap();
    assert_eq!(deletion, Deletion::Deleted);
    assert_eq!(effects, vec![Effect::DeleteBackend(other.backend.clone())]);
}

/// The snapshot a release wrote first (its backend's state as the lease ended).
fn snapshot_before(effects: &[Effect]) -> BackendSnapshot {
    match effects.first() {
        Some(Effect::PersistSnapshot(s)) => s.clone(),
        other => panic!("expected a snapshot first, got {other:?}"),
    }
}

#[test]
fn a_restart_holds_a_restored_drain_for_a_lease_lifetime() {
    // Before the restart: b0 drains with a `DELETE` waiting, b1 drains without one.
    let stored_snapshot = |i: usize| BackendSnapshot {
        id: id(i),
        lifecycle: Lifecycle::Draining,
        health: HealthState::Healthy,
        ..BackendSnapshot::default()
    };
    let stored = Stored {
        backends: (0..2)
            .map(|i| (spec(i, 8), Some(stored_snapshot(i))))
            .collect(),
        pending_delete: [id(0)].into_iter().collect(),
        drain_started: HashMap::from([(id(0), 50), (id(1), 60)]),
        responses: Vec::new(),
    };
    let restart = 1_000;
    let (mut c, failed) = Coordinator::restore("p", 0, settings(routing()), stored, 1, restart);
    assert!(failed.is_empty());
    assert_eq!(c.drains().hold_until_ms(), restart + TTL);
    assert_eq!(c.drains().hold_of(&id(0)), restart + TTL);
    // Idle as far as the pool knows, but a stream may still run: nothing finishes.
    assert_eq!(c.expire(restart), vec![]);
    let (deletion, _) = c.delete(&id(0), false, restart + 1).unwrap();
    assert!(matches!(
        deletion,
        Deletion::Draining {
            leases_in_flight: 0
        }
    ));
    // A stream on b0 renews (the pool counts it again) and ends within the hold: still held.
    let terms = LeaseTerms {
        backend: id(0),
        prompt_tokens: 5,
        max_tokens: 5,
        ..LeaseTerms::default()
    };
    assert_eq!(c.renew(42, &terms, 2_000), Ok((2_000 + TTL, true)));
    let effects = release(&mut c, 42, &id(0), 3_000);
    assert!(
        c.pool().backend(&id(0)).is_some(),
        "held until {}",
        restart + TTL
    );
    assert_eq!(effects, vec![Effect::PersistSnapshot(snapshot(&c, 0))]);
    assert_eq!(c.expire(restart + TTL - 1), vec![]);
    // A lease lifetime on: b0's delete goes through, and b1 (no stream came back) is drained.
    let effects = c.expire(restart + TTL);
    let b1 = snapshot(&c, 1);
    assert_eq!(b1.lifecycle, Lifecycle::Drained);
    assert_eq!(
        effects,
        vec![
            Effect::PersistSnapshot(b1),
            Effect::DeleteBackend(id(0)),
            Effect::PersistDrainStarts,
            Effect::PersistPendingDeletes
        ]
    );
    assert_eq!(c.drains().hold_until_ms(), 0);
    assert_eq!(c.drains().starts().keys().collect::<Vec<_>>(), vec![&id(1)]);
}

#[test]
fn the_retry_budget_refuses_a_reassign_once_spent_and_counts_it() {
    let one_retry = CoordinatorSettings {
        retry_budget: RetryBudgetConfig {
            ratio: 0.0,
            min_per_window: 1,
            window_ms: 60_000,
        },
        ..settings(routing())
    };
    let mut c = coordinator(one_retry, 2, 8);
    let failure = Outcome::from_status(502);
    let attempt_on = |c: &mut Coordinator, now: u64| {
        let mut g = acquire(c, now);
        c.hand_out(&mut g, now);
        assert!(g.card.is_some(), "a grant carries the card");
        let to = g.candidates[1].id.clone();
        let terms = LeaseTerms {
            backend: g.backend.clone(),
            prompt_tokens: 10,
            max_tokens: 10,
            ..LeaseTerms::default()
        };
        let attempt = FailedAttempt {
            lease_id: g.lease_id,
            to: to.clone(),
            failure: failure.clone(),
            terms: Some(terms),
            block_hashes: Vec::new(),
            missing_model: None,
        };
        let (done, effects) = c.reassign(&attempt, now);
        (g, to, done, effects)
    };
    let (g, to, done, effects) = attempt_on(&mut c, 100);
    assert_eq!(done.result.unwrap().id, to);
    assert_eq!(c.counters().retries, 1);
    assert_eq!(c.pool().backend(&to).unwrap().leases_in_flight, 1);
    // A 502 is a breaker failure on the failed backend, written if its state changed.
    assert!(effects
        .iter()
        .all(|e| matches!(e, Effect::PersistSnapshot(s) if s.id == g.backend || s.id == to)));
    release(&mut c, g.lease_id, &to, 150);

    let (_, _, done, effects) = attempt_on(&mut c, 200);
    assert_eq!(done.result, Err(RetryRefused::BudgetExhausted));
    assert_eq!(c.counters().retries, 1);
    assert_eq!(c.counters().retry_budget_exhausted, 1);
    assert_eq!(
        c.pool().live_leases(),
        0,
        "the refused lease ended with its failure"
    );
    assert!(!effects.contains(&Effect::ProbeSoon));
}

#[test]
fn a_saturated_pool_spills_only_new_requests_that_have_a_further_pool() {
    let strict = CoordinatorSettings {
        load_targets: LoadTargets {
            saturation_waiting_per_backend: 2.0,
            autoscale_target_waiting: 4.0,
        },
        ..settings(routing())
    };
    let mut c = coordinator(strict, 1, 8);
    let busy = ProbeReport {
        metrics: VllmMetrics::default(),
        result: ProbeResult {
            ok: true,
            metrics: VllmMetrics {
                gauges: routing_core::pool::ScrapedGauges {
                    waiting: Some(5.0),
                    ..Default::default()
                },
                ..VllmMetrics::default()
            },
            ..ProbeResult::default()
        },
        ..ProbeReport::default()
    };
    c.record_probes(vec![(id(0), busy)], 10);
    let _ = c.finish_probe_round(10, &Hungup::default());
    assert!(c.load().saturated);
    let calls = Hungup::default();
    // No further pool: served here.
    let (step, _) = c.acquire(features(), None, None, false, 20, &calls);
    grant(step);
    assert_eq!(c.counters().spills, 0);
    let (step, _) = c.acquire(features(), None, None, true, 30, &calls);
    assert_eq!(step, Step::Saturated);
    assert_eq!(c.counters().spills, 1);
    // A request continuing its wait keeps its place.
    let continuing = AdmissionRequest {
        ticket: Some(9),
        ..AdmissionRequest::default()
    };
    let (step, _) = c.acquire(features(), Some(continuing), None, true, 40, &calls);
    assert!(!matches!(step, Step::Saturated | Step::Spill), "{step:?}");
    assert_eq!(c.counters().spills, 1);
}

fn queued(max_wait_ms: u64) -> PoolConfig {
    PoolConfig {
        admission: AdmissionConfig {
            enabled: true,
            max_wait_ms,
            poll_ms: 1_000,
            ..AdmissionConfig::default()
        },
        ..routing()
    }
}

fn who(tenant: &str) -> Option<AdmissionRequest> {
    Some(AdmissionRequest {
        tenant: tenant.into(),
        ..AdmissionRequest::default()
    })
}

fn wait(step: Step) -> (Ticket, u64, u64) {
    match step {
        Step::Wait {
            ticket,
            call_id,
            until_ms,
        } => (ticket, call_id, until_ms),
        other => panic!("expected a wait, got {other:?}"),
    }
}

#[test]
fn a_full_pool_spills_from_its_queue_only_when_a_further_pool_exists() {
    let mut c = coordinator(settings(queued(5_000)), 1, 1);
    let calls = Hungup::default();
    let (step, _) = c.acquire(features(), who("a"), None, false, 10, &calls);
    grant(step);
    let (step, effects) = c.acquire(features(), who("b"), None, true, 20, &calls);
    assert_eq!((step, effects), (Step::Spill, vec![]));
    assert_eq!(c.counters().spills, 1);
    let (step, _) = c.acquire(features(), who("b"), None, false, 30, &calls);
    wait(step);
    assert_eq!(c.counters().spills, 1);
}

#[test]
fn settling_the_queue_grants_a_waiter_when_a_lease_ends() {
    let mut c = coordinator(settings(queued(5_000)), 1, 1);
    let calls = Hungup::default();
    let (step, _) = c.acquire(features(), who("a"), None, false, 10, &calls);
    let first = grant(step);
    let (step, effects) = c.acquire(features(), who("b"), None, false, 20, &calls);
    assert_eq!(effects, vec![]);
    let (ticket, call_id, until_ms) = wait(step);
    assert_eq!(until_ms, 20 + 1_000, "the call answers 202 after poll_ms");
    assert_eq!(c.room().queue.len(), 1);
    // Nothing freed room: settling costs nothing and says nothing.
    assert_eq!(c.settle(30, &calls), vec![]);
    release(&mut c, first.lease_id, &id(0), 40);
    let effects = c.settle(40, &calls);
    let [Effect::Answer {
        ticket: t,
        call_id: k,
        verdict: WaitEnd::Granted { grant, waited_ms },
    }] = effects.as_slice()
    else {
        panic!("expected one grant to the waiting call, got {effects:?}");
    };
    assert_eq!((*t, *k, *waited_ms), (ticket, call_id, 20));
    assert_eq!(grant.backend, id(0));
    assert!(c.room().queue.is_empty());
    // The Worker never read it and names the wait: its lease goes back at once.
    let (dequeued, effects) = c.dequeue(ticket, 50);
    assert!(dequeued);
    assert_eq!(effects, vec![]);
    assert_eq!(c.pool().live_leases(), 0);
}

#[test]
fn settling_drops_timed_out_waits_and_waits_whose_client_left() {
    let mut c = coordinator(settings(queued(500)), 1, 1);
    let mut calls = Hungup::default();
    let (step, _) = c.acquire(features(), who("a"), None, false, 10, &calls);
    let first = grant(step);
    let (late, late_call, until_ms) =
        wait(c.acquire(features(), who("b"), None, false, 20, &calls).0);
    assert_eq!(until_ms, 20 + 500 + 1, "no later than its deadline");
    let (gone, gone_call, _) = wait(c.acquire(features(), who("c"), None, false, 30, &calls).0);
    // The second client hangs up; the sweep (at most every 250 ms) drops it.
    calls.0.insert(gone);
    let effects = c.settle(300, &calls);
    assert_eq!(
        effects,
        vec![Effect::CloseCall {
            ticket: gone,
            call_id: gone_call
        }]
    );
    assert_eq!(c.room().queue.stats().dropped(DropReason::ClientGone), 1);
    // The first waits past its deadline.
    let effects = c.settle(520, &calls);
    assert_eq!(
        effects,
        vec![Effect::Answer {
            ticket: late,
            call_id: late_call,
            verdict: WaitEnd::Dropped {
                reason: DropReason::Timeout,
                waited_ms: 500
            }
        }]
    );
    assert!(c.room().queue.is_empty());
    // Room frees with nobody waiting: the lease simply ends.
    release(&mut c, first.lease_id, &id(0), 600);
    assert_eq!(c.settle(600, &calls), vec![]);
}

#[test]
fn a_grant_reached_between_calls_is_parked_for_the_next_call() {
    let mut c = coordinator(settings(queued(5_000)), 1, 1);
    let calls = Hungup::default();
    let first = grant(c.acquire(features(), who("a"), None, false, 10, &calls).0);
    let (ticket, call_id, _) = wait(c.acquire(features(), who("b"), None, false, 20, &calls).0);
    // The call's poll ends without a verdict: it answers 202 and the wait has no call open.
    assert_eq!(c.pause(ticket, call_id, 1_020), None);
    release(&mut c, first.lease_id, &id(0), 1_030);
    assert_eq!(c.settle(1_030, &calls), vec![], "nobody to answer: parked");
    // The Worker asks again with its ticket: the parked grant is its answer.
    let again = AdmissionRequest {
        ticket: Some(ticket),
        ..who("b").unwrap()
    };
    let (step, effects) = c.acquire(features(), Some(again), None, false, 1_040, &calls);
    assert_eq!(effects, vec![]);
    assert_eq!(grant(step).backend, id(0));
}

/// Issue 42, item 8: a grant answered to a call whose answer was lost (the call failed, or hit
/// the Worker's 65 s limit) and the Worker asking again with its ticket.
#[test]
fn asking_again_after_a_lost_grant_does_not_hold_two_leases() {
    let mut c = coordinator(settings(queued(5_000)), 1, 2);
    let calls = Hungup::default();
    let first = grant(c.acquire(features(), who("a"), None, false, 10, &calls).0);
    let second = grant(c.acquire(features(), who("a"), None, false, 11, &calls).0);
    let (ticket, _, _) = wait(c.acquire(features(), who("b"), None, false, 20, &calls).0);
    release(&mut c, first.lease_id, &id(0), 40);
    let effects = c.settle(40, &calls);
    assert!(matches!(
        effects.as_slice(),
        [Effect::Answer {
            verdict: WaitEnd::Granted { .. },
            ..
        }]
    ));
    assert_eq!(c.pool().live_leases(), 2);
    // The answer never reached the Worker, which asks again with its ticket.
    let again = AdmissionRequest {
        ticket: Some(ticket),
        waited_ms: 30,
        ..who("b").unwrap()
    };
    let (step, _) = c.acquire(features(), Some(again), None, false, 50, &calls);
    grant(step);
    assert_eq!(
        c.pool().live_leases(),
        2,
        "the lost grant's lease went back: one lease per request"
    );
    release(&mut c, second.lease_id, &id(0), 60);
}

/// Issue 42, item 8: a first call whose immediate grant was lost; the Worker gives up on the
/// pool and names the wait (its `wait_id`) in a dequeue.
#[test]
fn a_lost_immediate_grant_goes_back_when_the_worker_names_its_wait() {
    let mut c = coordinator(settings(queued(5_000)), 1, 1);
    let calls = Hungup::default();
    let asked = AdmissionRequest {
        wait_id: Some(77),
        ..who("a").unwrap()
    };
    grant(
        c.acquire(features(), Some(asked), None, false, 10, &calls)
            .0,
    );
    assert_eq!(c.pool().live_leases(), 1);
    let (dequeued, _) = c.dequeue(77, 20);
    assert!(dequeued);
    assert_eq!(c.pool().live_leases(), 0);
}

#[test]
fn a_newer_call_closes_the_older_and_an_unanswered_grant_goes_back() {
    let mut c = coordinator(settings(queued(5_000)), 1, 1);
    let calls = Hungup::default();
    let first = grant(c.acquire(features(), who("a"), None, false, 10, &calls).0);
    let (ticket, old_call, _) = wait(c.acquire(features(), who("b"), None, false, 20, &calls).0);
    let again = AdmissionRequest {
        ticket: Some(ticket),
        ..who("b").unwrap()
    };
    let (step, effects) = c.acquire(features(), Some(again), None, false, 30, &calls);
    let (same, new_call, _) = wait(step);
    assert_eq!(same, ticket);
    assert_eq!(
        effects,
        vec![Effect::CloseCall {
            ticket,
            call_id: old_call
        }]
    );
    release(&mut c, first.lease_id, &id(0), 40);
    let mut effects = c.settle(40, &calls);
    let Some(Effect::Answer {
        call_id, verdict, ..
    }) = effects.pop()
    else {
        panic!("expected an answer");
    };
    assert_eq!(call_id, new_call);
    // No call took it after all: the lease goes back and the client counts as gone.
    assert!(!c.unanswered(ticket, verdict, 41));
    assert_eq!(c.pool().live_leases(), 0);
    assert_eq!(c.room().queue.stats().dropped(DropReason::ClientGone), 1);
}

#[test]
fn a_pool_that_published_a_busy_card_publishes_again_when_its_last_lease_ends() {
    let mut c = coordinator(settings(routing()), 1, 1);
    let long = RequestFeatures {
        max_tokens: 2000,
        ..features()
    };
    let (step, _) = c.acquire(long, None, None, false, 10, &Hungup::default());
    let held = grant(step);
    // The probe round's card: the one sequence slot is taken for a long answer.
    let effects = c.finish_probe_round(20, &Hungup::default());
    let busy = match effects.last() {
        Some(Effect::PublishCard(card)) => card.clone(),
        other => panic!("shard 0 publishes its card, got {other:?}"),
    };
    assert!(busy.cached_ms.is_none_or(|ms| ms >= 200), "{busy:?}");
    // The lease ends: a new card goes out at once, showing the pool idle.
    let effects = release(&mut c, held.lease_id, &id(0), 30);
    let idle = match effects.last() {
        Some(Effect::PublishCard(card)) => card.clone(),
        other => panic!("the idle pool publishes again, got {effects:?} / {other:?}"),
    };
    assert_eq!(idle.at_ms, 30);
    assert!(idle.cached_ms.unwrap() < 200, "{idle:?}");
    // An idle pool's next lease ends without another card.
    let g = acquire(&mut c, 40);
    let effects = release(&mut c, g.lease_id, &id(0), 50);
    assert!(
        !effects.iter().any(|e| matches!(e, Effect::PublishCard(_))),
        "{effects:?}"
    );
}

/// A Responses request of the client key `key-a` that stores its response, or follows one up.
fn stateful(previous: Option<&str>) -> RequestFeatures {
    RequestFeatures {
        previous_response_id: previous.map(str::to_string),
        stores_response: true,
        owner: Some("key-a".into()),
        ..features()
    }
}

/// A Responses request that stored the response `id`: granted, and released with the id the
/// backend answered, as the Worker reports it.
fn store_response(c: &mut Coordinator, id: &str) -> Grant {
    let (step, _) = c.acquire(stateful(None), None, None, false, 10, &Hungup::default());
    let first = grant(step);
    let stored = Outcome {
        stored_response: Some(Box::new(StoredResponse {
            id: id.into(),
            owner: Some("key-a".into()),
        })),
        ..Outcome::from_status(200)
    };
    let one = Release {
        lease_id: first.lease_id,
        outcome: &stored,
        backend: Some(&first.backend),
    };
    let (released, effects) = c.release(&[one], 20);
    assert_eq!(released, vec![true]);
    // The record is written to storage with the backend's snapshot.
    let persisted = Effect::PersistResponse {
        response: *stored.stored_response.clone().unwrap(),
        backend: first.backend.clone(),
        at_ms: 20,
        forget_before_ms: None,
    };
    assert!(effects.contains(&persisted), "{effects:?}");
    first
}

fn refused(step: Step) -> AcquireError {
    match step {
        Step::Refused(e) => e,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_follow_up_goes_to_the_backend_its_release_recorded_or_is_lost() {
    let mut c = coordinator(settings(routing()), 3, 8);
    let calls = Hungup::default();
    let first = store_response(&mut c, "resp_abc");
    assert_eq!(c.pool().recorded_responses(), 1);
    // Round robin would move on; every follow-up stays on the holder, with no other candidate.
    for t in 0..6 {
        let (step, _) = c.acquire(
            stateful(Some("resp_abc")),
            None,
            None,
            false,
            30 + t,
            &calls,
        );
        let g = grant(step);
        assert_eq!(g.backend, first.backend);
        assert!(g.candidates.iter().all(|v| v.id == first.backend));
        release(&mut c, g.lease_id, &g.backend, 31 + t);
    }
    assert_eq!(
        c.pool()
            .response_holder("resp_abc", Some("key-a"), 40)
            .unwrap()
            .id,
        first.backend
    );
    // Another client's follow-up finds nothing: the response is not its.
    let theirs = RequestFeatures {
        owner: Some("key-b".into()),
        ..stateful(Some("resp_abc"))
    };
    let (step, _) = c.acquire(theirs, None, None, false, 45, &calls);
    assert_eq!(
        refused(step),
        AcquireError::ResponseNotFound {
            id: "resp_abc".into()
        }
    );
    assert!(c.pool().response_holder("resp_abc", None, 45).is_err());
    // An id the pool never recorded: lost, never another backend's answer.
    let (step, _) = c.acquire(stateful(Some("resp_other")), None, None, false, 50, &calls);
    assert_eq!(
        refused(step),
        AcquireError::ResponseNotFound {
            id: "resp_other".into()
        }
    );
    // The holder leaves the pool: its responses are lost with it.
    c.delete(&first.backend, true, 60).unwrap();
    let (step, _) = c.acquire(stateful(Some("resp_abc")), None, None, false, 70, &calls);
    assert_eq!(
        refused(step),
        AcquireError::ResponseNotFound {
            id: "resp_abc".into()
        }
    );
    assert!(c
        .pool()
        .response_holder("resp_abc", Some("key-a"), 70)
        .is_err());
    // The pool's leases all ended.
    assert_eq!(c.pool().in_flight_total(), 0);
}

#[test]
fn a_follow_up_whose_holder_is_down_is_lost() {
    let mut c = coordinator(settings(routing()), 2, 8);
    let calls = Hungup::default();
    let first = store_response(&mut c, "resp_down");
    let down = ProbeReport {
        result: ProbeResult {
            ok: false,
            unreachable: true,
            ..ProbeResult::default()
        },
        ..ProbeReport::default()
    };
    for t in 0..5 {
        c.record_probes(vec![(first.backend.clone(), down.clone())], 100 + t);
    }
    assert_eq!(
        c.pool().backend(&first.backend).unwrap().health,
        HealthState::Unhealthy
    );
    let (step, _) = c.acquire(stateful(Some("resp_down")), None, None, false, 200, &calls);
    assert_eq!(
        refused(step),
        AcquireError::ResponseNotFound {
            id: "resp_down".into()
        }
    );
}

#[test]
fn a_restarted_coordinator_still_knows_where_stored_responses_are() {
    let mut c = coordinator(settings(routing()), 3, 8);
    let first = store_response(&mut c, "resp_kept");
    // What the Durable Object read back from storage after a restart.
    let stored = Stored {
        backends: (0..3)
            .map(|i| (spec(i, 8), Some(snapshot(&c, i))))
            .collect(),
        responses: vec![(
            StoredResponse {
                id: "resp_kept".into(),
                owner: Some("key-a".into()),
            },
            first.backend.clone(),
            20,
        )],
        ..Stored::default()
    };
    let (mut restarted, failed) = Coordinator::restore("p", 0, settings(routing()), stored, 9, 30);
    assert!(failed.is_empty());
    let calls = Hungup::default();
    for t in 0..4 {
        let features = stateful(Some("resp_kept"));
        let (step, _) = restarted.acquire(features, None, None, false, 40 + t, &calls);
        let g = grant(step);
        assert_eq!(g.backend, first.backend);
        release(&mut restarted, g.lease_id, &g.backend, 41 + t);
    }
}

#[test]
fn a_follow_up_whose_holder_drains_waits_and_never_goes_elsewhere() {
    let mut c = coordinator(settings(routing()), 2, 8);
    let first = store_response(&mut c, "resp_draining");
    c.patch(&first.backend, &Default::default(), Some(true), 30)
        .unwrap();
    let (step, _) = c.acquire(
        stateful(Some("resp_draining")),
        None,
        None,
        false,
        40,
        &Hungup::default(),
    );
    assert!(
        matches!(refused(step), AcquireError::NoBackendAvailable { .. }),
        "a draining holder is busy, not lost"
    );
    // A new conversation still goes to the other backend.
    let g = acquire(&mut c, 50);
    assert_ne!(g.backend, first.backend);
}

/// With shards, a sibling's overdue stream has its backend scraped: shard 1 (which does not probe)
/// asks shard 0 on its next load push, shard 0 scrapes under the same once-a-second limit
/// whichever shard asked, and hands the findings to its siblings with its probe reports.
#[test]
fn a_sibling_shards_overdue_stream_has_shard_zero_scrape_its_backend() {
    let sharded = PoolConfig {
        shards: 2,
        ..routing()
    };
    let mut zero = coordinator(settings(sharded.clone()), 1, 256);
    let mut one = coordinator(settings(sharded), 1, 256);
    one.set_shard(1);
    let hungup = Hungup::default();
    let streamed = RequestFeatures {
        stream: true,
        ..features()
    };
    let (step, _) = one.acquire(streamed, None, None, false, 10, &hungup);
    let g = grant(step);
    assert!(one.overdue(g.lease_id));
    // Shard 1 scrapes nothing itself: it pushes its load with the ask.
    assert_eq!(one.check_evidence(600), vec![Effect::PushLoad]);
    assert_eq!(one.counters().evidence_scrapes, 0);
    assert_eq!(one.check_evidence(700), vec![], "asked once a second");
    let push = one.take_load_push(600);
    assert_eq!(
        (push.siblings, &push.report.scrape),
        (vec![0], &vec![id(0)])
    );
    assert!(
        one.take_load_push(800).report.scrape.is_empty(),
        "asked once"
    );
    // Shard 0 scrapes it now, counted, with its card.
    let (accepted, effects) = zero.accept_load(push.report.clone(), 610);
    assert!(accepted);
    assert_eq!(effects.first(), Some(&Effect::ScrapeNow(vec![id(0)])));
    assert!(matches!(effects.last(), Some(Effect::PublishCard(_))));
    assert_eq!(zero.counters().evidence_scrapes, 1);
    // The same ask within the second (another sibling, or shard 0's own evidence): none.
    assert_eq!(zero.accept_load(push.report.clone(), 900).1, vec![]);
    let (step, _) = zero.acquire(
        RequestFeatures {
            stream: true,
            ..features()
        },
        None,
        None,
        false,
        10,
        &hungup,
    );
    let own = grant(step);
    assert!(zero.overdue(own.lease_id));
    assert_eq!(zero.check_evidence(900), vec![]);
    // A second later, it may again.
    assert_eq!(
        zero.accept_load(push.report.clone(), 1_700).1.first(),
        Some(&Effect::ScrapeNow(vec![id(0)]))
    );
    // The findings go to the siblings, as a probe round's do.
    let effects = zero.finish_evidence_scrape(vec![(id(0), up())], 1_750, &hungup);
    assert!(effects.contains(&Effect::PushProbeRound), "{effects:?}");
    // A shard other than 0 takes no ask.
    let mut asked = push.report;
    asked.shard = 0;
    assert_eq!(one.accept_load(asked, 3_000).1, vec![]);
    let _ = release(&mut one, g.lease_id, &id(0), 3_100);
    let _ = release(&mut zero, own.lease_id, &id(0), 3_100);
    assert_eq!(one.pool().live_leases() + zero.pool().live_leases(), 0);
}

/// Lease evidence through the coordinator: the Worker's early renewal says a stream is overdue;
/// the check asks for that backend's scrape and publishes the card that counts the queue; a
/// second overdue renewal within a second asks for nothing; the scrape's findings take over; a
/// first token reported past its due time at the release asks again. Nothing leaks.
#[test]
fn an_overdue_stream_asks_for_a_scrape_of_its_backend_and_the_card_follows() {
    let mut c = coordinator(settings(routing()), 1, 256);
    let hungup = Hungup::default();
    let streamed = || RequestFeatures {
        stream: true,
        ..features()
    };
    let mut leases = Vec::new();
    for _ in 0..4 {
        let (step, _) = c.acquire(streamed(), None, None, false, 10, &hungup);
        let g = grant(step);
        assert!(g.first_token_due_ms.is_some_and(|ms| ms >= 500), "{g:?}");
        leases.push(g.lease_id);
    }
    let terms = LeaseTerms {
        backend: id(0),
        stream: true,
        ..LeaseTerms::default()
    };
    // A first token on time says nothing.
    assert!(c.first_token(leases[0], 20));
    assert_eq!(c.check_evidence(600), vec![]);
    // The second stream has none at its due time.
    c.renew(leases[1], &terms, 600).unwrap();
    assert!(c.overdue(leases[1]));
    let effects = c.check_evidence(600);
    assert_eq!(effects[0], Effect::ScrapeNow(vec![id(0)]));
    match &effects[1..] {
        [Effect::PublishCard(card)] => assert_eq!(card.queued_by_leases, 1),
        other => panic!("expected the card, got {other:?}"),
    }
    assert_eq!(c.counters().evidence_scrapes, 1);
    // The third within the second: counted, no second scrape.
    assert!(c.overdue(leases[2]));
    assert_eq!(c.check_evidence(900), vec![]);
    // The scrape comes back: 2 running, 2 waiting; it learns the batch limit and the directory
    // gets the card.
    let mut scraped = up();
    scraped.result.metrics = VllmMetrics {
        gauges: routing_core::backend::scrape::ScrapedGauges {
            running: Some(2.0),
            waiting: Some(2.0),
            ..Default::default()
        },
        ..VllmMetrics::default()
    };
    let effects = c.finish_evidence_scrape(vec![(id(0), scraped)], 950, &hungup);
    let card = effects.iter().find_map(|e| match e {
        Effect::PublishCard(card) => Some(card.clone()),
        _ => None,
    });
    let card = card.expect("the card goes to the directory");
    assert_eq!((card.queued_by_leases, card.max_seqs), (0, 2), "{card:?}");
    // The fourth stream's first token came at 5 s, reported only at its release: asks again.
    let mut late = Outcome::from_status(200);
    late.ttfb_ms = Some(5_000);
    let one = Release {
        lease_id: leases[3],
        outcome: &late,
        backend: Some(&id(0)),
    };
    let (released, effects) = c.release(&[one], 5_100);
    assert_eq!(released, vec![true]);
    assert!(
        effects.contains(&Effect::ScrapeNow(vec![id(0)])),
        "{effects:?}"
    );
    for &l in &leases[..3] {
        let _ = release(&mut c, l, &id(0), 5_200);
    }
    assert_eq!(c.pool().live_leases(), 0);
    assert_eq!(c.pool().in_flight_total(), 0);
}

/// Issue 42, "still open" (e): the retry budget is charged once per retry that happens, not per
/// candidate the Worker asks for: a candidate the pool refuses (at capacity here) costs nothing,
/// so the next candidate still gets the one retry the budget allows.
#[test]
fn a_candidate_the_pool_refuses_does_not_spend_the_retry_budget() {
    let one_retry = CoordinatorSettings {
        retry_budget: RetryBudgetConfig {
            ratio: 0.0,
            min_per_window: 1,
            window_ms: 60_000,
        },
        ..settings(queued(5_000))
    };
    let mut c = coordinator(one_retry, 3, 1);
    let calls = Hungup::default();
    let first = grant(c.acquire(features(), who("a"), None, false, 10, &calls).0);
    let other = grant(c.acquire(features(), who("b"), None, false, 20, &calls).0);
    assert_ne!(first.backend, other.backend);
    let free = first
        .candidates
        .iter()
        .map(|v| v.id.clone())
        .find(|b| *b != first.backend && *b != other.backend)
        .unwrap();
    let terms = LeaseTerms {
        backend: first.backend.clone(),
        prompt_tokens: 10,
        max_tokens: 10,
        ..LeaseTerms::default()
    };
    let attempt = |to: &BackendId| FailedAttempt {
        lease_id: first.lease_id,
        to: to.clone(),
        failure: Outcome::from_status(502),
        terms: Some(terms.clone()),
        block_hashes: Vec::new(),
        missing_model: None,
    };
    // The Worker's walk: the next candidate is full, so the pool refuses the move ...
    let (done, _) = c.reassign(&attempt(&other.backend), 30);
    assert!(
        matches!(done.result, Err(RetryRefused::Pool(_))),
        "{:?}",
        done.result
    );
    // ... and the one after it takes the request, within the budget's one retry.
    let (done, _) = c.reassign(&attempt(&free), 31);
    assert_eq!(done.result.map(|v| v.id), Ok(free.clone()));
    assert_eq!(c.counters().retries, 1);
    assert_eq!(c.counters().retry_budget_exhausted, 0);
}

/// Issue 42, "still open" (b): a renewal that was on its way when the pool refused the
/// request's retry (the budget was spent, so the pool ended the lease) must not count the
/// request again: the Worker already knows its lease ended and will never release it, so a lease
/// readmitted here would hold its backend's slot until it expired.
#[test]
fn a_renewal_crossing_a_refused_retry_leaves_no_phantom_lease() {
    let no_retry = CoordinatorSettings {
        retry_budget: RetryBudgetConfig {
            ratio: 0.0,
            min_per_window: 0,
            window_ms: 60_000,
        },
        ..settings(routing())
    };
    let mut c = coordinator(no_retry, 2, 8);
    let g = acquire(&mut c, 100);
    let terms = LeaseTerms {
        backend: g.backend.clone(),
        prompt_tokens: 10,
        max_tokens: 10,
        ..LeaseTerms::default()
    };
    let attempt = FailedAttempt {
        lease_id: g.lease_id,
        to: g.candidates[1].id.clone(),
        failure: Outcome::from_status(502),
        terms: Some(terms.clone()),
        block_hashes: Vec::new(),
        missing_model: None,
    };
    let (done, _) = c.reassign(&attempt, 110);
    assert_eq!(done.result, Err(RetryRefused::BudgetExhausted));
    assert_eq!(c.pool().live_leases(), 0);
    // The renewal the Worker sent before it learnt of the refusal arrives now.
    assert!(c.renew(g.lease_id, &terms, 120).is_err());
    assert_eq!(c.pool().live_leases(), 0, "no phantom lease");
    assert_eq!(c.pool().backend(&g.backend).unwrap().leases_in_flight, 0);
    // The same for a renewal that crosses the Worker's own release.
    let g = acquire(&mut c, 200);
    release(&mut c, g.lease_id, &g.backend, 210);
    let terms = LeaseTerms {
        backend: g.backend.clone(),
        ..terms
    };
    assert!(c.renew(g.lease_id, &terms, 220).is_err());
    assert_eq!(c.pool().live_leases(), 0);
    // A lease the pool lost by expiry (or a restart) is still counted again by its renewal.
    let g = acquire(&mut c, 300);
    let _ = c.expire(300 + TTL);
    assert_eq!(c.pool().live_leases(), 0);
    let terms = LeaseTerms {
        backend: g.backend.clone(),
        ..terms
    };
    assert_eq!(
        c.renew(g.lease_id, &terms, 301 + TTL),
        Ok((301 + 2 * TTL, true))
    );
    assert_eq!(c.pool().live_leases(), 1);
}

/// What a restarted pool restores: one ready, healthy backend of 2 sequences.
fn one_ready_backend() -> Stored {
    let ready = BackendSnapshot {
        id: id(0),
        lifecycle: Lifecycle::Ready,
        health: HealthState::Healthy,
        ..BackendSnapshot::default()
    };
    Stored {
        backends: vec![(spec(0, 2), Some(ready))],
        ..Stored::default()
    }
}

/// The settle's only effect is the answer granting `ticket`.
fn assert_only_granted(effects: &[Effect], ticket: Ticket) {
    assert!(
        matches!(effects, [Effect::Answer { ticket: t, verdict: WaitEnd::Granted { .. }, .. }] if *t == ticket),
        "{effects:?}"
    );
}

/// Issue 42, "still open" (a): leases live in memory only, so a restarted pool does not see the
/// streams still running on its backends until they renew. With admission control on it must not
/// grant a backend's whole `max_num_seqs` on top of them: for one renewal period after the
/// restart it grants nothing new (requests wait in the queue, or spill), the renewals count the
/// running streams again, and then the queue is admitted against the true counts.
#[test]
fn a_restarted_pool_holds_admission_until_running_streams_renewed() {
    let stored = one_ready_backend();
    let restart = 1_000;
    let (mut c, failed) =
        Coordinator::restore("p", 0, settings(queued(60_000)), stored, 1, restart);
    assert!(failed.is_empty());
    let calls = Hungup::default();
    // Right after the restart the pool knows of no stream; two are still running on b0.
    let (step, _) = c.acquire(features(), who("a"), None, false, restart + 10, &calls);
    let (ticket, _, _) = wait(step);
    assert_eq!(c.pool().live_leases(), 0, "nothing granted on top of them");
    // A request that can go to another pool goes there rather than wait.
    let (step, _) = c.acquire(features(), who("b"), None, true, restart + 20, &calls);
    assert_eq!(step, Step::Spill);
    // The running streams renew within one renewal period (a third of the lease TTL).
    let terms = LeaseTerms {
        backend: id(0),
        prompt_tokens: 10,
        max_tokens: 10,
        ..LeaseTerms::default()
    };
    for (lease, at) in [(41, restart + 500), (42, restart + TTL / 3 - 1)] {
        assert!(c.renew(lease, &terms, at).unwrap().1);
        assert_eq!(c.settle(at, &calls), vec![]);
    }
    // The hold is over: b0 is full with the two streams that renewed, so the waiter still waits.
    let over = restart + TTL / 3 + 1_000;
    assert_eq!(c.settle(over, &calls), vec![]);
    assert_eq!(c.pool().live_leases(), 2);
    // One of them ends: the waiter gets its place.
    release(&mut c, 41, &id(0), over + 1);
    let effects = c.settle(over + 1, &calls);
    assert_only_granted(&effects, ticket);
}

/// The hold ends by itself: a restarted pool that nobody renews to admits its queue once one
/// renewal period is over.
#[test]
fn a_restarted_pool_admits_its_queue_once_the_hold_is_over() {
    let stored = one_ready_backend();
    let (mut c, _) = Coordinator::restore("p", 0, settings(queued(60_000)), stored, 1, 0);
    let calls = Hungup::default();
    let (step, _) = c.acquire(features(), who("a"), None, false, 10, &calls);
    let (ticket, _, _) = wait(step);
    assert_eq!(c.settle(TTL / 3, &calls), vec![]);
    let effects = c.settle(TTL / 3 + 1_000, &calls);
    assert_only_granted(&effects, ticket);
    // Without admission control there is nothing to hold: a pool restarted with it off grants.
    let stored = one_ready_backend();
    let (mut c, _) = Coordinator::restore("p", 0, settings(routing()), stored, 1, 0);
    acquire(&mut c, 10);
}

/// The hold ends at the first probe round that finds vLLM running nothing the pool does not
/// count (an object evicted while idle and woken by a request): not while a backend runs more.
#[test]
fn a_probe_round_that_finds_no_hidden_stream_ends_the_restart_hold() {
    let scraped = |running: f64| ProbeReport {
        result: ProbeResult {
            ok: true,
            metrics: VllmMetrics {
                gauges: routing_core::pool::ScrapedGauges {
                    running: Some(running),
                    waiting: Some(0.0),
                    ..Default::default()
                },
                ..VllmMetrics::default()
            },
            ..ProbeResult::default()
        },
        ..ProbeReport::default()
    };
    let stored = one_ready_backend();
    let (mut c, _) = Coordinator::restore("p", 0, settings(queued(60_000)), stored, 1, 0);
    let calls = Hungup::default();
    let (step, _) = c.acquire(features(), who("a"), None, false, 10, &calls);
    let (ticket, _, _) = wait(step);
    // vLLM runs a stream the pool has not seen renew yet: still held.
    c.record_probes(vec![(id(0), scraped(1.0))], 100);
    let effects = c.finish_probe_round(100, &calls);
    assert!(
        !effects.iter().any(|e| matches!(e, Effect::Answer { .. })),
        "{effects:?}"
    );
    // Nothing runs: the waiter is admitted at once.
    c.record_probes(vec![(id(0), scraped(0.0))], 200);
    let effects = c.finish_probe_round(200, &calls);
    assert!(
        effects.iter().any(
            |e| matches!(e, Effect::Answer { ticket: t, verdict: WaitEnd::Granted { .. }, .. } if *t == ticket)
        ),
        "{effects:?}"
    );
}
