//! A pool's load in aggregate, and the two decisions made from it: whether the pool is saturated
//! (new work spills to the next pool when there is one) and how many replicas an autoscaler
//! should aim for.
//!
//! The pool coordinator measures the load after every probe round and registry change, not on
//! every acquire, so an acquire never walks the whole fleet for it.

use crate::backend::serving::is_up;
use crate::pool::BackendView;
use serde::Serialize;

/// The two targets the load is judged against (both from the pool's settings).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadTargets {
    /// Saturated when the backends' scraped waiting queues average more than this per ready
    /// backend (0: never).
    pub saturation_waiting_per_backend: f64,
    /// The waiting requests one replica should carry (the HPA/KEDA target).
    pub autoscale_target_waiting: f64,
}

/// The pool's load in aggregate: what autoscalers and spillover look at.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PoolLoad {
    /// Backends ready and healthy.
    pub ready: usize,
    /// Sum of the backends' scraped waiting queues.
    pub waiting: f64,
    /// Requests waiting in the gateway's own admission queue for this pool.
    pub queued: usize,
    /// Sum of the backends' scraped running batches.
    pub running: f64,
    /// Replicas an autoscaler should aim for (see [`desired_replicas`]).
    pub desired_replicas: u64,
    /// Whether new work should go to another pool if there is one.
    pub saturated: bool,
}

impl PoolLoad {
    /// Measures the load of `backends`, with `queued` requests in the gateway's own queue.
    pub fn measure(
        backends: impl IntoIterator<Item = BackendView>,
        queued: usize,
        targets: &LoadTargets,
    ) -> PoolLoad {
        let mut load = PoolLoad {
            queued,
            desired_replicas: 1,
            ..PoolLoad::default()
        };
        for v in backends {
            if is_up(v.lifecycle, v.health) {
                load.ready += 1;
            }
            load.waiting += v.scraped.waiting.unwrap_or(0.0);
            load.running += v.scraped.running.unwrap_or(0.0);
        }
        // Requests in the gateway's queue wait for a replica just as those in vLLM's own do.
        load.desired_replicas = desired_replicas(
            load.ready,
            load.waiting + queued as f64,
            load.running,
            targets.autoscale_target_waiting,
        );
        let threshold = targets.saturation_waiting_per_backend;
        load.saturated =
            threshold > 0.0 && load.ready > 0 && load.waiting / load.ready as f64 > threshold;
        load
    }

    /// Whether an acquire should be refused so that it spills to a further pool: only when there
    /// is one (`spill_ok`), only for a new request (a queued one `continuing` its wait keeps its
    /// place), and only while the pool is saturated.
    pub fn spills(&self, spill_ok: bool, continuing: bool) -> bool {
        spill_ok && !continuing && self.saturated
    }
}

/// Desired replicas for a target of `target` waiting requests per replica: grows by one replica
/// per `target` requests waiting beyond what the ready replicas should carry; holds while anything
/// runs; lets an idle pool shrink to one.
pub fn desired_replicas(ready: usize, waiting: f64, running: f64, target: f64) -> u64 {
    let ready = ready as f64;
    let desired = if waiting > target * ready {
        ready + ((waiting - target * ready) / target).ceil()
    } else if running > 0.0 || waiting > 0.0 {
        ready
    } else {
        1.0
    };
    desired.max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::health::HealthState;
    use crate::backend::Lifecycle;
    use crate::pool::ScrapedGauges;

    const TARGETS: LoadTargets = LoadTargets {
        saturation_waiting_per_backend: 16.0,
        autoscale_target_waiting: 4.0,
    };

    fn backend(ready: bool, waiting: f64, running: f64) -> BackendView {
        BackendView {
            lifecycle: if ready {
                Lifecycle::Ready
            } else {
                Lifecycle::Pending
            },
            health: HealthState::Healthy,
            scraped: ScrapedGauges {
                waiting: Some(waiting),
                running: Some(running),
                ..ScrapedGauges::default()
            },
            ..BackendView::default()
        }
    }

    #[test]
    fn desired_replicas_grow_with_the_queue_hold_while_busy_and_shrink_when_idle() {
        assert_eq!(desired_replicas(2, 8.0, 0.0, 4.0), 2, "exactly at target");
        assert_eq!(
            desired_replicas(2, 9.0, 0.0, 4.0),
            3,
            "one waiting too many"
        );
        assert_eq!(desired_replicas(2, 20.0, 0.0, 4.0), 5);
        assert_eq!(desired_replicas(3, 0.0, 5.0, 4.0), 3, "busy: hold");
        assert_eq!(desired_replicas(3, 0.0, 0.0, 4.0), 1, "idle: one");
        assert_eq!(
            desired_replicas(0, 1.0, 0.0, 4.0),
            1,
            "nothing ready, little waiting"
        );
        assert_eq!(desired_replicas(0, 9.0, 0.0, 4.0), 3);
    }

    #[test]
    fn saturation_counts_ready_backends_only() {
        let load = PoolLoad::measure(
            [backend(true, 40.0, 2.0), backend(false, 0.0, 0.0)],
            0,
            &TARGETS,
        );
        assert_eq!((load.ready, load.waiting, load.running), (1, 40.0, 2.0));
        assert!(load.saturated, "40 waiting on one ready backend > 16");
        let calm = PoolLoad::measure(
            [backend(true, 10.0, 2.0), backend(true, 10.0, 2.0)],
            0,
            &TARGETS,
        );
        assert!(!calm.saturated);
        let never = LoadTargets {
            saturation_waiting_per_backend: 0.0,
            ..TARGETS
        };
        assert!(!PoolLoad::measure([backend(true, 1e6, 0.0)], 0, &never).saturated);
        assert!(!PoolLoad::measure([backend(false, 1e6, 0.0)], 0, &TARGETS).saturated);
    }

    #[test]
    fn the_gateways_queue_asks_for_replicas_but_does_not_saturate() {
        let load = PoolLoad::measure([backend(true, 0.0, 1.0)], 12, &TARGETS);
        assert_eq!(load.queued, 12);
        assert_eq!(
            load.desired_replicas, 3,
            "12 queued: 1 + ceil((12 - 4) / 4)"
        );
        assert!(!load.saturated);
    }

    #[test]
    fn only_a_new_request_with_somewhere_to_go_spills() {
        let saturated = PoolLoad {
            saturated: true,
            ..PoolLoad::default()
        };
        assert!(saturated.spills(true, false));
        assert!(!saturated.spills(false, false), "no further pool");
        assert!(
            !saturated.spills(true, true),
            "a queued request keeps its place"
        );
        assert!(!PoolLoad::default().spills(true, false));
    }
}
