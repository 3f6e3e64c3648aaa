//! The walk over a request's pools: which pool the Worker asks next, and what each refusal means.
//!
//! The Worker asks the pools in the order [`super::order_pools`] gave, nearest (or fastest)
//! first. A pool may refuse only when a further pool could take the request (`spill_ok`), so the
//! last pool in the order is asked without it, unless an earlier pool already offered its queue:
//!
//! - a pool that does not serve the model is skipped, as if never asked;
//! - a pool whose backends are all at their admission capacity is spilled over, and the nearest
//!   such pool is where the request waits (in its queue) when no pool has room: spillover comes
//!   before queueing;
//! - a saturated pool is spilled over, and the nearest one is the fallback when nothing further
//!   can take the request (after the queue, when there is one);
//! - a pool with no room now (or whose object failed) is passed by;
//! - a queue drop or a client that left is the request's answer: the walk stops;
//! - a walk that found no pool ends with the last refusal worth telling (or "no pool answered",
//!   or "no pool serves the model"), and a request restricted to some jurisdictions says so.
//!
//! [`PoolWalk`] is that state machine, over any refusal type that says what it means for the walk
//! ([`WalkRefusal`]; the pool's is `crate::pool::Refusal`). No I/O, no clock: the Worker drives it.

/// What a refusal means for the walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// The pool does not serve the model (or no longer does): look further, as if not asked.
    NotServed,
    /// Every backend is at its admission capacity: look further, and come back to wait in the
    /// nearest such pool's queue when no pool has room.
    Full,
    /// The pool is saturated: look further, and come back to the nearest such pool when nothing
    /// further takes the request.
    Saturated,
    /// No room now: look further.
    Busy,
    /// The request's answer (it waited and was dropped, or its client left): stop.
    Final,
}

/// A refusal the walk can read.
pub trait WalkRefusal {
    /// What the refusal means for the walk.
    fn kind(&self) -> RefusalKind;
}

/// Why the walk asks a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// Its place in the order.
    Order,
    /// Back to the nearest full pool, to wait in its queue.
    Queue,
    /// Back to the nearest saturated pool, the last resort.
    Fallback,
}

/// The next pool to ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextPool {
    /// Its index in the order.
    pub pool: usize,
    /// A further pool could take the request, so this one may refuse when saturated or full.
    pub spill_ok: bool,
    /// Why it is asked.
    pub turn: Turn,
}

/// How a pool answered, other than with a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolAnswer<R> {
    /// It refused.
    Refused(R),
    /// Its object failed, or did not answer in time.
    Failed,
}

/// What the walk does after an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterAnswer<R> {
    /// Ask the next pool ([`PoolWalk::next_pool`]).
    Go,
    /// Stop: this refusal is the request's answer.
    Stop(R),
}

/// How a walk that found no pool ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WalkEnd<R> {
    /// No pool serves the model.
    NotServed,
    /// Pools serve it, but the only answers were failures.
    NoAnswer,
    /// The last refusal that said there is no room now.
    Refused(R),
    /// The request may only go to some jurisdictions, and no pool in them took it.
    Residency,
}

/// What the walk tells the client if it ends now.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Last<R> {
    Nothing,
    NoAnswer,
    Refused(R),
}

/// The walk over `pools` pools (see the module documentation).
#[derive(Debug, Clone)]
pub struct PoolWalk<R> {
    pools: usize,
    next: usize,
    asked: Option<NextPool>,
    queue_at: Option<usize>,
    saturated: Option<usize>,
    last: Last<R>,
    restricted: bool,
}

impl<R: WalkRefusal> PoolWalk<R> {
    /// A walk over `pools` pools in order; `restricted`: the request may only go to some
    /// jurisdictions (some pools were left out of the order for it).
    pub fn new(pools: usize, restricted: bool) -> Self {
        PoolWalk {
            pools,
            next: 0,
            asked: None,
            queue_at: None,
            saturated: None,
            last: Last::Nothing,
            restricted,
        }
    }

    /// The next pool to ask, or `None` when the walk is over ([`PoolWalk::end`]).
    pub fn next_pool(&mut self) -> Option<NextPool> {
        let ask = if self.next < self.pools {
            let pool = self.next;
            self.next += 1;
            NextPool {
                pool,
                spill_ok: pool + 1 < self.pools || self.queue_at.is_some(),
                turn: Turn::Order,
            }
        } else if let Some(pool) = self.queue_at.take() {
            NextPool {
                pool,
                spill_ok: false,
                turn: Turn::Queue,
            }
        } else if let Some(pool) = self.saturated.take() {
            NextPool {
                pool,
                spill_ok: false,
                turn: Turn::Fallback,
            }
        } else {
            return None;
        };
        self.asked = Some(ask);
        Some(ask)
    }

    /// Feeds the answer of the pool last asked.
    pub fn feed(&mut self, answer: PoolAnswer<R>) -> AfterAnswer<R> {
        let (pool, spill_ok) = self
            .asked
            .map_or((None, false), |a| (Some(a.pool), a.spill_ok));
        let refusal = match answer {
            PoolAnswer::Failed => {
                if matches!(self.last, Last::Nothing) {
                    self.last = Last::NoAnswer;
                }
                return AfterAnswer::Go;
            }
            PoolAnswer::Refused(r) => r,
        };
        match refusal.kind() {
            RefusalKind::NotServed => return AfterAnswer::Go,
            RefusalKind::Final => return AfterAnswer::Stop(refusal),
            RefusalKind::Full if spill_ok && self.queue_at.is_none() => self.queue_at = pool,
            RefusalKind::Saturated if spill_ok && self.saturated.is_none() => self.saturated = pool,
            RefusalKind::Full | RefusalKind::Saturated | RefusalKind::Busy => {}
        }
        self.last = Last::Refused(refusal);
        AfterAnswer::Go
    }

    /// How the walk ends, once [`PoolWalk::next_pool`] said it is over.
    pub fn end(self) -> WalkEnd<R> {
        if self.restricted {
            return WalkEnd::Residency;
        }
        match self.last {
            Last::Nothing => WalkEnd::NotServed,
            Last::NoAnswer => WalkEnd::NoAnswer,
            Last::Refused(r) => WalkEnd::Refused(r),
        }
    }
}
