//! The Worker's walk over a request's pools (`routing_core::region::walk`), fed the pool's own
//! refusals: every branch of the walk, as `completion` drives it.

use routing_core::pool::{PoolError, Refusal};
use routing_core::region::walk::{AfterAnswer, NextPool, PoolAnswer, PoolWalk, Turn, WalkEnd};

fn walk(pools: usize) -> PoolWalk<Refusal> {
    PoolWalk::new(pools, false)
}

fn ask(pool: usize, spill_ok: bool, turn: Turn) -> Option<NextPool> {
    Some(NextPool {
        pool,
        spill_ok,
        turn,
    })
}

fn refused(w: &mut PoolWalk<Refusal>, r: Refusal) -> AfterAnswer<Refusal> {
    w.feed(PoolAnswer::Refused(r))
}

fn not_served() -> Refusal {
    Refusal::ModelNotFound { model: "m".into() }
}

fn busy() -> Refusal {
    Refusal::NoBackendAvailable { retry_after_s: 4 }
}

#[test]
fn pools_are_asked_nearest_first_and_only_the_last_may_not_refuse() {
    let mut w = walk(3);
    assert_eq!(w.next_pool(), ask(0, true, Turn::Order));
    assert_eq!(refused(&mut w, busy()), AfterAnswer::Go);
    assert_eq!(w.next_pool(), ask(1, true, Turn::Order));
    assert_eq!(w.feed(PoolAnswer::Failed), AfterAnswer::Go);
    assert_eq!(w.next_pool(), ask(2, false, Turn::Order));
    assert_eq!(refused(&mut w, busy()), AfterAnswer::Go);
    assert_eq!(w.next_pool(), None);
    assert_eq!(w.end(), WalkEnd::Refused(busy()));
}

#[test]
fn a_single_pool_may_not_refuse_and_no_pool_at_all_serves_nothing() {
    let mut w = walk(1);
    assert_eq!(w.next_pool(), ask(0, false, Turn::Order));
    let mut none = walk(0);
    assert_eq!(none.next_pool(), None);
    assert_eq!(none.end(), WalkEnd::NotServed);
}

#[test]
fn pools_that_do_not_serve_the_model_are_skipped_as_if_not_asked() {
    let mut w = walk(2);
    w.next_pool();
    assert_eq!(refused(&mut w, busy()), AfterAnswer::Go);
    w.next_pool();
    // A pool whose model went away while the request waited counts the same.
    assert_eq!(refused(&mut w, Refusal::ModelGone), AfterAnswer::Go);
    assert_eq!(w.next_pool(), None);
    assert_eq!(
        w.end(),
        WalkEnd::Refused(busy()),
        "the earlier refusal stands"
    );

    let mut w = walk(2);
    for _ in 0..2 {
        w.next_pool();
        assert_eq!(refused(&mut w, not_served()), AfterAnswer::Go);
    }
    assert_eq!(w.next_pool(), None);
    assert_eq!(w.end(), WalkEnd::NotServed);
}

#[test]
fn the_request_waits_at_the_nearest_full_pool_once_no_pool_has_room() {
    let mut w = walk(3);
    w.next_pool();
    assert_eq!(refused(&mut w, Refusal::Full), AfterAnswer::Go);
    // The last pool may refuse too: the full pool's queue is still there.
    assert_eq!(w.next_pool(), ask(1, true, Turn::Order));
    assert_eq!(refused(&mut w, Refusal::Full), AfterAnswer::Go);
    assert_eq!(w.next_pool(), ask(2, true, Turn::Order));
    assert_eq!(refused(&mut w, busy()), AfterAnswer::Go);
    // Back to the nearest full pool, which may not refuse now: it queues the request.
    assert_eq!(w.next_pool(), ask(0, false, Turn::Queue));
    assert_eq!(refused(&mut w, Refusal::AtCapacity), AfterAnswer::Go);
    assert_eq!(w.next_pool(), None, "one queue only, the nearest");
    assert_eq!(w.end(), WalkEnd::Refused(Refusal::AtCapacity));
}

#[test]
fn a_pool_that_could_not_refuse_is_not_a_queue_to_come_back_to() {
    let mut w = walk(2);
    w.next_pool();
    refused(&mut w, busy());
    assert_eq!(w.next_pool(), ask(1, false, Turn::Order));
    // At capacity although it could not spill (its queue is off): nothing to come back to.
    refused(&mut w, Refusal::AtCapacity);
    assert_eq!(w.next_pool(), None);
    assert_eq!(w.end(), WalkEnd::Refused(Refusal::AtCapacity));
}

#[test]
fn the_nearest_saturated_pool_is_the_last_resort_after_the_queue() {
    let mut w = walk(3);
    w.next_pool();
    assert_eq!(refused(&mut w, Refusal::Saturated), AfterAnswer::Go);
    w.next_pool();
    assert_eq!(refused(&mut w, Refusal::Saturated), AfterAnswer::Go);
    assert_eq!(w.next_pool(), ask(2, false, Turn::Order));
    w.feed(PoolAnswer::Failed);
    assert_eq!(w.next_pool(), ask(0, false, Turn::Fallback));
    assert_eq!(refused(&mut w, busy()), AfterAnswer::Go);
    assert_eq!(w.next_pool(), None);
    assert_eq!(w.end(), WalkEnd::Refused(busy()));

    // With a full pool as well: its queue first, then the saturated pool.
    let mut w = walk(3);
    w.next_pool();
    refused(&mut w, Refusal::Saturated);
    w.next_pool();
    refused(&mut w, Refusal::Full);
    assert_eq!(w.next_pool(), ask(2, true, Turn::Order));
    refused(&mut w, Refusal::Saturated);
    assert_eq!(w.next_pool(), ask(1, false, Turn::Queue));
    refused(&mut w, Refusal::AtCapacity);
    assert_eq!(w.next_pool(), ask(0, false, Turn::Fallback));
    refused(&mut w, Refusal::Saturated);
    assert_eq!(w.next_pool(), None);
    assert_eq!(w.end(), WalkEnd::Refused(Refusal::Saturated));
}

#[test]
fn a_queue_drop_or_a_client_that_left_is_the_answer() {
    for last in [
        Refusal::QueueFull { retry_after_s: 3 },
        Refusal::TenantLimit { retry_after_s: 1 },
        Refusal::Evicted { retry_after_s: 2 },
        Refusal::QueueTimeout { retry_after_s: 60 },
        Refusal::ClientGone,
    ] {
        let mut w = walk(3);
        w.next_pool();
        refused(&mut w, Refusal::Full);
        assert_eq!(refused(&mut w, last.clone()), AfterAnswer::Stop(last));
    }
}

#[test]
fn failures_alone_end_in_no_answer_and_never_hide_a_refusal() {
    let mut w = walk(2);
    w.next_pool();
    w.feed(PoolAnswer::Failed);
    w.next_pool();
    refused(&mut w, not_served());
    assert_eq!(w.next_pool(), None);
    assert_eq!(w.end(), WalkEnd::NoAnswer);

    let mut w = walk(2);
    w.next_pool();
    refused(&mut w, Refusal::QueueUnavailable);
    w.next_pool();
    w.feed(PoolAnswer::Failed);
    assert_eq!(w.next_pool(), None);
    assert_eq!(w.end(), WalkEnd::Refused(Refusal::QueueUnavailable));
}

#[test]
fn a_restricted_request_that_no_allowed_pool_took_says_so() {
    let mut w = PoolWalk::<Refusal>::new(1, true);
    w.next_pool();
    refused(&mut w, busy());
    assert_eq!(w.next_pool(), None);
    assert_eq!(w.end(), WalkEnd::Residency);
    let mut none = PoolWalk::<Refusal>::new(0, true);
    assert_eq!(none.next_pool(), None);
    assert_eq!(none.end(), WalkEnd::Residency);
}

#[test]
fn retry_refusals_only_pass_a_pool_by() {
    let mut w = walk(2);
    w.next_pool();
    let moved = Refusal::CannotMove {
        error: PoolError::UnknownLease { lease_id: 7 },
    };
    assert_eq!(refused(&mut w, moved.clone()), AfterAnswer::Go);
    assert_eq!(w.next_pool(), ask(1, false, Turn::Order));
    assert_eq!(
        refused(&mut w, Refusal::RetryBudgetExhausted),
        AfterAnswer::Go
    );
    assert_eq!(w.end(), WalkEnd::Refused(Refusal::RetryBudgetExhausted));
}
