//! Granting queued requests: [`AdmissionQueue::dispatch`] asks the pool for a lease for every
//! waiting request it can place, in the queue's order, a freed backend preferring a request whose
//! prefix it holds.
//!
//! **Nothing blocks on what it cannot place.** The whole queue is walked in service order, not
//! just its head: a request whose backends are full is passed over, and so is every later request
//! for the same model (and role), which those full backends would refuse too, so each model costs
//! one failed try per dispatch and a request for a model with idle backends is placed at once
//! behind any number waiting for a saturated one. Bands keep their order: a lower band's request
//! is placed only when no request of a higher band could use the room (every higher one before it
//! in the walk was tried, or passed over as its model's were refused).

use super::request::{Departure, DropReason};
use super::AdmissionQueue;
use crate::backend::BackendId;
use crate::pool::{AcquireError, AdmissionConfig, Pool};
use crate::random::RandomSource;
use crate::request::role::Role;
use std::collections::HashSet;

impl AdmissionQueue {
    /// Grants leases to every waiting request the pool can place: in the queue's order, the
    /// look-ahead preferring a request whose prefix a `freed` backend holds (one freed backend per
    /// grant), passing over requests whose model's backends are full (see the module
    /// documentation). Expired requests are dropped first. Departures are appended to `out`.
    pub fn dispatch(
        &mut self,
        pool: &mut Pool,
        config: &AdmissionConfig,
        freed: &[BackendId],
        now_ms: u64,
        rng: &mut dyn RandomSource,
        out: &mut Vec<Departure>,
    ) {
        self.expire(now_ms, out);
        let quantum = config.quantum_tokens.clamp(1, i64::MAX as u64) as i64;
        let lookahead = config.lookahead.max(1);
        let mut freed = freed.iter();
        let mut plan = std::mem::take(&mut self.plan);
        let mut order: Vec<usize> = Vec::new();
        // Models (and roles) whose backends refused a request in this dispatch.
        let mut full: HashSet<(String, Option<Role>)> = HashSet::new();
        let blocked = |q: &AdmissionQueue, full: &HashSet<(String, Option<Role>)>, t| {
            q.waiting
                .get(&t)
                .is_none_or(|w| full.contains(&(w.features.model.clone(), w.features.role_hint)))
        };
        while !self.is_empty() {
            self.plan(self.len(), config.quantum_tokens, &mut plan);
            order.clear();
            order.extend((0..plan.len()).filter(|&i| !blocked(self, &full, plan[i].0)));
            let Some(&head) = order.first() else { break };
            if let Some(backend) = freed.next() {
                // Only the band being served competes for the freed backend's prefix, among the
                // next `lookahead` requests that could be placed.
                let band = self.waiting.get(&plan[head].0).map(|w| w.priority);
                let best = order
                    .iter()
                    .take(lookahead)
                    .filter_map(|&i| {
                        let w = self.waiting.get(&plan[i].0)?;
                        (w.priority == band?).then_some(())?;
                        Some((pool.cached_blocks_on(backend, &w.features.block_hashes), i))
                    })
                    .filter(|(blocks, _)| *blocks > 0)
                    .max_by_key(|(blocks, i)| (*blocks, std::cmp::Reverse(*i)));
                if let Some((_, i)) = best {
                    order.retain(|j| *j != i);
                    order.insert(0, i);
                }
            }
            // Overcommit only for a request that has the queue to itself (which may then fit
            // where it was refused a moment ago with others waiting).
            let headroom = if self.len() == 1 {
                if config.overcommit > 0.0 {
                    full.clear();
                }
                config.overcommit
            } else {
                0.0
            };
            let mut served = false;
            for &i in &order {
                let (ticket, in_turn) = plan[i];
                if blocked(self, &full, ticket) {
                    continue;
                }
                let Some(w) = self.waiting.get(&ticket) else {
                    continue;
                };
                match pool.acquire_within(&w.features, now_ms, rng, Some(headroom)) {
                    Ok(grant) => {
                        if let Some(w) = self.take(ticket, in_turn, quantum) {
                            let waited_ms = now_ms.saturating_sub(w.arrived_ms);
                            self.stats.admitted += 1;
                            self.stats.queued += 1;
                            self.stats.observe_wait(waited_ms);
                            out.push(Departure::Admitted {
                                ticket,
                                grant,
                                waited_ms,
                            });
                        }
                        served = true;
                        break;
                    }
                    // Its model, or the backend holding its stored response, left the pool.
                    Err(
                        AcquireError::ModelNotFound { .. } | AcquireError::ResponseNotFound { .. },
                    ) => {
                        if let Some(w) = self.remove(ticket, DropReason::ModelGone) {
                            out.push(Departure::Dropped {
                                ticket,
                                reason: DropReason::ModelGone,
                                waited_ms: now_ms.saturating_sub(w.arrived_ms),
                            });
                        }
                        served = true;
                        break;
                    }
                    // Full, or no backend up: it (and its model's) waits for a lease to end or a
                    // backend to recover; the walk goes on to the next model.
                    Err(_) => {
                        full.insert((w.features.model.clone(), w.features.role_hint));
                    }
                }
            }
            if !served {
                break;
            }
        }
        self.plan = plan;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::test_support::{config, features};
    use crate::admission::{AdmissionRequest, Ticket, Waiting};
    use crate::backend::BackendSpec;
    use crate::pool::test_support::add_ready;
    use crate::pool::PoolConfig;
    use crate::random::SplitMix64;
    use crate::request::prompt::{request_features, FeatureConfig};
    use crate::stream::outcome::Outcome;
    use serde_json::json;

    fn pool(backends: usize, max_num_seqs: u32, policy: crate::policy::PolicyKind) -> Pool {
        let mut pool = Pool::new(
            "p",
            PoolConfig {
                policy,
                admission: config(),
                ..PoolConfig::default()
            },
        );
        for i in 0..backends {
            let mut spec = BackendSpec {
                id: format!("b{i}").into(),
                url: format!("http://b{i}:8000"),
                models: vec!["llama".into()],
                ..BackendSpec::default()
            };
            spec.capacity.max_num_seqs = max_num_seqs;
            add_ready(&mut pool, spec);
        }
        pool
    }

    fn enqueue(
        q: &mut AdmissionQueue,
        ticket: Ticket,
        tenant: &str,
        priority: i32,
        text: &str,
        now: u64,
    ) {
        let who = AdmissionRequest {
            tenant: tenant.into(),
            priority,
            ..AdmissionRequest::default()
        };
        q.offer(
            Waiting::new(ticket, features(text, 16), &who, &config(), now),
            &config(),
        )
        .unwrap();
    }

    fn admitted(out: &[Departure]) -> Vec<(Ticket, String)> {
        out.iter()
            .filter_map(|d| match d {
                Departure::Admitted { ticket, grant, .. } => {
                    Some((*ticket, grant.backend.0.clone()))
                }
                _ => None,
            })
            .collect()
    }

    /// The lease granted to `ticket` among `out`'s departures.
    fn lease_of(out: &[Departure], ticket: Ticket) -> (u64, BackendId) {
        out.iter()
            .find_map(|d| match d {
                Departure::Admitted {
                    ticket: t, grant, ..
                } if *t == ticket => Some((grant.lease_id, grant.backend.clone())),
                _ => None,
            })
            .unwrap()
    }

    fn ok() -> Outcome {
        Outcome::of_kind(crate::stream::outcome::OutcomeKind::Success)
    }

    #[test]
    fn dispatch_grants_up_to_capacity_and_the_next_when_a_lease_ends() {
        let mut pool = pool(2, 2, crate::policy::PolicyKind::LeastLoad);
        let mut q = AdmissionQueue::new();
        let mut rng = SplitMix64::new(1);
        for t in 1..=6 {
            enqueue(&mut q, t, "a", 0, &format!("question {t}"), 0);
        }
        let mut out = Vec::new();
        q.dispatch(&mut pool, &config(), &[], 10, &mut rng, &mut out);
        let first: Vec<Ticket> = admitted(&out).iter().map(|a| a.0).collect();
        assert_eq!(first, vec![1, 2, 3, 4]);
        assert_eq!(q.len(), 2);
        assert_eq!(pool.live_leases(), 4);
        // Nothing has room: dispatching again grants nothing.
        let mut more = Vec::new();
        q.dispatch(&mut pool, &config(), &[], 20, &mut rng, &mut more);
        assert!(more.is_empty());
        // A lease ends: exactly one more is granted, on the backend that freed.
        let (lease, backend) = lease_of(&out, 1);
        pool.release(lease, &ok(), 30);
        let freed = pool.take_freed();
        assert_eq!(freed, vec![backend.clone()]);
        q.dispatch(&mut pool, &config(), &freed, 30, &mut rng, &mut more);
        assert_eq!(admitted(&more), vec![(5, backend.0.clone())]);
        assert!(matches!(more[0], Departure::Admitted { waited_ms: 30, .. }));
        assert_eq!(q.stats().queued, 5);
        pool.check_counters().unwrap();
    }

    #[test]
    fn a_freed_backend_prefers_a_queued_request_whose_prefix_it_holds() {
        let mut pool = pool(2, 1, crate::policy::PolicyKind::CacheAware);
        let mut rng = SplitMix64::new(3);
        let shared = "You are a careful assistant who answers in French. ".repeat(30);
        // Two requests with different prompts hold both backends.
        let mut q = AdmissionQueue::new();
        let mut out = Vec::new();
        enqueue(&mut q, 1, "a", 0, &format!("{shared} first"), 0);
        q.dispatch(&mut pool, &config(), &[], 0, &mut rng, &mut out);
        enqueue(&mut q, 2, "a", 0, "something else entirely", 0);
        q.dispatch(&mut pool, &config(), &[], 0, &mut rng, &mut out);
        assert_eq!(pool.live_leases(), 2);
        let (lease, home) = lease_of(&out, 1);
        // Queue: an unrelated request first, then one sharing the long prefix.
        enqueue(&mut q, 3, "b", 0, "an unrelated question", 1);
        enqueue(&mut q, 4, "c", 0, &format!("{shared} second"), 2);
        // The prefix's home frees up: it takes request 4 although 3 is first in line.
        pool.release(lease, &ok(), 5);
        let freed = pool.take_freed();
        out.clear();
        q.dispatch(&mut pool, &config(), &freed, 5, &mut rng, &mut out);
        assert_eq!(admitted(&out), vec![(4, home.0.clone())]);
        // With look-ahead 1 the queue's order wins: request 3 goes first.
        enqueue(&mut q, 6, "c", 0, &format!("{shared} third"), 3);
        let (lease, _) = lease_of(&out, 4);
        pool.release(lease, &ok(), 6);
        let freed = pool.take_freed();
        out.clear();
        let strict = AdmissionConfig {
            lookahead: 1,
            ..config()
        };
        q.dispatch(&mut pool, &strict, &freed, 6, &mut rng, &mut out);
        assert_eq!(
            admitted(&out).iter().map(|a| a.0).collect::<Vec<_>>(),
            vec![3]
        );
    }

    #[test]
    fn overcommit_applies_only_to_a_request_alone_in_the_queue() {
        let mut pool = pool(1, 2, crate::policy::PolicyKind::LeastLoad);
        let mut rng = SplitMix64::new(5);
        let c = AdmissionConfig {
            overcommit: 0.5,
            ..config()
        };
        let mut q = AdmissionQueue::new();
        let mut out = Vec::new();
        for t in 1..=2 {
            enqueue(&mut q, t, "a", 0, &format!("q{t}"), 0);
        }
        q.dispatch(&mut pool, &c, &[], 0, &mut rng, &mut out);
        assert_eq!(pool.live_leases(), 2);
        enqueue(&mut q, 3, "a", 0, "q3", 0);
        enqueue(&mut q, 4, "a", 0, "q4", 0);
        q.dispatch(&mut pool, &c, &[], 0, &mut rng, &mut out);
        assert_eq!(pool.live_leases(), 2, "two waiting: strict capacity");
        q.remove(4, DropReason::ClientGone);
        q.dispatch(&mut pool, &c, &[], 0, &mut rng, &mut out);
        assert_eq!(pool.live_leases(), 3, "alone in the queue: 50% over 2 is 3");
    }

    #[test]
    fn a_request_whose_model_left_the_pool_is_dropped() {
        let mut pool = pool(1, 4, crate::policy::PolicyKind::LeastLoad);
        let mut rng = SplitMix64::new(5);
        let mut q = AdmissionQueue::new();
        let who = AdmissionRequest {
            tenant: "a".into(),
            ..AdmissionRequest::default()
        };
        let body = json!({"model": "gone", "messages": [{"role": "user", "content": "x"}]});
        let f = request_features(&body, &|_| None, &FeatureConfig::default()).unwrap();
        q.offer(Waiting::new(1, f, &who, &config(), 0), &config())
            .unwrap();
        let mut out = Vec::new();
        q.dispatch(&mut pool, &config(), &[], 0, &mut rng, &mut out);
        assert!(matches!(
            out[..],
            [Departure::Dropped {
                reason: DropReason::ModelGone,
                ..
            }]
        ));
    }

    /// A pool with `a` one-sequence backends for model `llama` and `b` for model `other`.
    fn two_model_pool(a: usize, b: usize) -> Pool {
        let mut pool = Pool::new(
            "p",
            PoolConfig {
                policy: crate::policy::PolicyKind::LeastLoad,
                admission: config(),
                ..PoolConfig::default()
            },
        );
        for (i, model) in std::iter::repeat_n("llama", a)
            .chain(std::iter::repeat_n("other", b))
            .enumerate()
        {
            let mut spec = BackendSpec {
                id: format!("b{i}").into(),
                url: format!("http://b{i}:8000"),
                models: vec![model.into()],
                ..BackendSpec::default()
            };
            spec.capacity.max_num_seqs = 1;
            add_ready(&mut pool, spec);
        }
        pool
    }

    fn enqueue_model(q: &mut AdmissionQueue, ticket: Ticket, model: &str, priority: i32) {
        let who = AdmissionRequest {
            tenant: format!("t{ticket}"),
            priority,
            ..AdmissionRequest::default()
        };
        let body = json!({"model": model, "max_tokens": 8,
                          "messages": [{"role": "user", "content": format!("q{ticket}")}]});
        let f = request_features(&body, &|_| None, &FeatureConfig::default()).unwrap();
        q.offer(Waiting::new(ticket, f, &who, &config(), 0), &config())
            .unwrap();
    }

    #[test]
    fn a_request_for_an_idle_model_is_placed_behind_any_number_for_a_full_one() {
        let mut pool = two_model_pool(1, 1);
        let mut rng = SplitMix64::new(9);
        let mut q = AdmissionQueue::new();
        let mut out = Vec::new();
        // Model llama's one backend is busy; far more than `lookahead` wait for it.
        enqueue_model(&mut q, 1, "llama", 0);
        q.dispatch(&mut pool, &config(), &[], 0, &mut rng, &mut out);
        assert_eq!(admitted(&out).len(), 1);
        for t in 2..=40 {
            enqueue_model(&mut q, t, "llama", 0);
        }
        assert!(config().lookahead < 39);
        enqueue_model(&mut q, 100, "other", 0);
        out.clear();
        q.dispatch(&mut pool, &config(), &[], 1, &mut rng, &mut out);
        assert_eq!(admitted(&out), vec![(100, "b1".to_string())]);
        assert_eq!(q.len(), 39, "llama's waiters still wait");
        assert_eq!(q.waiting_for_model("llama"), 39);
        assert_eq!(q.waiting_for_model("other"), 0);
        pool.check_counters().unwrap();
    }

    #[test]
    fn a_lower_band_is_placed_when_no_higher_band_request_can_use_the_room() {
        let mut pool = two_model_pool(1, 1);
        let mut rng = SplitMix64::new(10);
        let mut q = AdmissionQueue::new();
        let mut out = Vec::new();
        enqueue_model(&mut q, 1, "llama", 0);
        q.dispatch(&mut pool, &config(), &[], 0, &mut rng, &mut out);
        let (held, _) = lease_of(&out, 1);
        // High priority waits for the full model; low priority for the idle one is placed.
        enqueue_model(&mut q, 2, "llama", 9);
        enqueue_model(&mut q, 3, "llama", 0);
        enqueue_model(&mut q, 4, "other", -5);
        out.clear();
        q.dispatch(&mut pool, &config(), &[], 1, &mut rng, &mut out);
        assert_eq!(admitted(&out), vec![(4, "b1".to_string())]);
        // The room that frees goes to the higher band first, then in order.
        pool.release(held, &ok(), 2);
        let freed = pool.take_freed();
        out.clear();
        q.dispatch(&mut pool, &config(), &freed, 2, &mut rng, &mut out);
        assert_eq!(admitted(&out), vec![(2, "b0".to_string())]);
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn one_dispatch_places_every_request_that_fits_across_models() {
        let mut pool = two_model_pool(2, 3);
        let mut rng = SplitMix64::new(11);
        let mut q = AdmissionQueue::new();
        for t in 1..=6 {
            enqueue_model(&mut q, t, "llama", 0);
        }
        for t in 11..=16 {
            enqueue_model(&mut q, t, "other", 0);
        }
        let mut out = Vec::new();
        q.dispatch(&mut pool, &config(), &[], 0, &mut rng, &mut out);
        let granted = admitted(&out);
        let llama = granted.iter().filter(|(t, _)| *t < 10).count();
        let other = granted.iter().filter(|(t, _)| *t > 10).count();
        assert_eq!((llama, other), (2, 3), "{granted:?}");
        // Within each model, arrival order: the first ones were served.
        let mut tickets: Vec<Ticket> = granted.iter().map(|g| g.0).collect();
        tickets.sort();
        assert_eq!(tickets, vec![1, 2, 11, 12, 13]);
        pool.check_counters().unwrap();
    }
}
