//! Granting queued requests: [`AdmissionQueue::dispatch`] asks the pool for a lease for each
//! waiting request in the queue's order while backends have room, a freed backend preferring a
//! request whose prefix it holds.

use super::request::{Departure, DropReason};
use super::AdmissionQueue;
use crate::backend::BackendId;
use crate::pool::{AcquireError, AdmissionConfig, Pool};
use crate::random::RandomSource;

impl AdmissionQueue {
    /// Grants leases to waiting requests while backends have room: in the queue's order, the
    /// look-ahead preferring a request whose prefix a `freed` backend holds (one freed backend per
    /// grant), skipping requests whose backends are all full. Expired requests are dropped first.
    /// Departures are appended to `out`.
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
        let mut freed = freed.iter();
        let mut plan = std::mem::take(&mut self.plan);
        let mut order: Vec<usize> = Vec::new();
        while !self.is_empty() {
            self.plan(config.lookahead.max(1), config.quantum_tokens, &mut plan);
            order.clear();
            order.extend(0..plan.len());
            if let Some(backend) = freed.next() {
                // Only the band being served competes for the freed backend's prefix.
                let band = plan
                    .first()
                    .and_then(|(t, _)| self.waiting.get(t))
                    .map(|w| w.priority);
                let best = plan
                    .iter()
                    .enumerate()
                    .filter(|(_, (t, _))| self.waiting.get(t).map(|w| w.priority) == band)
                    .filter_map(|(i, (t, _))| {
                        let w = self.waiting.get(t)?;
                        Some((pool.cached_blocks_on(backend, &w.features.block_hashes), i))
                    })
                    .filter(|(blocks, _)| *blocks > 0)
                    .max_by_key(|(blocks, i)| (*blocks, std::cmp::Reverse(*i)));
                if let Some((_, i)) = best {
                    order.retain(|j| *j != i);
                    order.insert(0, i);
                }
            }
            // Overcommit only for a request that has the queue to itself.
            let headroom = if self.len() == 1 {
                config.overcommit
            } else {
                0.0
            };
            let mut served = false;
            for &i in &order {
                let (ticket, in_turn) = plan[i];
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
                    Err(AcquireError::ModelNotFound { .. }) => {
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
                    // Full, or no backend up: it waits for a lease to end or a backend to recover.
                    Err(_) => continue,
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
    use crate::outcome::Outcome;
    use crate::pool::test_support::add_ready;
    use crate::pool::PoolConfig;
    use crate::prompt::{request_features, FeatureConfig};
    use crate::random::SplitMix64;
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
        Outcome::of_kind(crate::outcome::OutcomeKind::Success)
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
}
