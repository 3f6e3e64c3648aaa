//! Consistent hashing with bounded loads: requests with the same routing key (session, user,
//! tenant, document) go to the same backend, so its prefix cache and any server-side session state
//! stay warm, yet no backend takes more than `ceil((1 + eps) * average)` live leases.
//!
//! The ring (see [`crate::policy::ring`]) holds every backend in the pool; ineligible ones are
//! skipped during the walk, so a dead backend's keys spread over the backends that follow its
//! points. A request without a key is placed by least load.

use super::least_load::rank_by_cost;
use super::{DecisionInput, DecisionKind, PolicyKind, RoutingPolicy};
use crate::policy::ring::{HashRing, RingMember};
use crate::random::RandomSource;
use serde::{Deserialize, Serialize};

/// Knobs of the consistent_hash policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConsistentHashConfig {
    /// Bounded-load slack: no backend exceeds `ceil((1 + eps) * average)` leases (default 0.25;
    /// larger is stickier, smaller is more even).
    pub eps: f64,
}

impl Default for ConsistentHashConfig {
    fn default() -> Self {
        ConsistentHashConfig { eps: 0.25 }
    }
}

impl ConsistentHashConfig {
    /// Checks the knobs.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.eps.is_finite() && self.eps > 0.0 && self.eps <= 100.0) {
            return Err("consistent_hash.eps must be within (0, 100]".into());
        }
        Ok(())
    }
}

/// The consistent-hash policy.
#[derive(Debug, Clone)]
pub struct ConsistentHash {
    config: ConsistentHashConfig,
    ring: HashRing,
    nodes: Vec<u32>,
}

impl ConsistentHash {
    /// A policy with an empty ring; the pool fills it through `members_changed`.
    pub fn new(config: ConsistentHashConfig) -> Self {
        ConsistentHash {
            config,
            ring: HashRing::default(),
            nodes: Vec::new(),
        }
    }
}

impl RoutingPolicy for ConsistentHash {
    fn kind(&self) -> PolicyKind {
        PolicyKind::ConsistentHash
    }

    fn rank(
        &mut self,
        input: &DecisionInput<'_>,
        rng: &mut dyn RandomSource,
        order: &mut Vec<usize>,
    ) -> DecisionKind {
        order.clear();
        let Some(hash) = input.key_hash else {
            rank_by_cost(input, rng, order);
            return DecisionKind::NoKey;
        };
        let total: u64 = input.candidates.iter().map(|c| u64::from(c.leases)).sum();
        let first = self.ring.rank_bounded(
            hash,
            self.config.eps,
            input.candidates.len(),
            total,
            input.limit,
            |node| {
                input
                    .candidate_of(node)
                    .map(|i| u64::from(input.candidates[i].leases))
            },
            &mut self.nodes,
        );
        order.extend(self.nodes.iter().filter_map(|&n| input.candidate_of(n)));
        if order.is_empty() {
            // Candidates missing from the ring (never expected): still answer.
            rank_by_cost(input, rng, order);
            return DecisionKind::NoKey;
        }
        if first == Some(input.candidates[order[0]].slot) {
            DecisionKind::Sticky
        } else {
            DecisionKind::StickyOverflow
        }
    }

    fn members_changed(&mut self, members: &[RingMember<'_>]) {
        self.ring = HashRing::new(members.iter().copied());
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidates, identity};
    use super::*;
    use crate::policy::ring::key_hash;
    use crate::random::SplitMix64;

    fn policy(n: usize) -> ConsistentHash {
        let ids: Vec<String> = (0..n).map(|i| format!("b{i}")).collect();
        let members: Vec<RingMember> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| RingMember {
                node: i as u32,
                id,
                weight: 1,
            })
            .collect();
        let mut p = ConsistentHash::new(ConsistentHashConfig::default());
        p.members_changed(&members);
        p
    }

    #[test]
    fn same_key_same_backend() {
        let mut p = policy(5);
        let c = candidates(&[0.0; 5]);
        let idx = identity(5);
        let mut rng = SplitMix64::new(0);
        let mut order = Vec::new();
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: Some(key_hash("s1")),
            limit: 3,
        };
        assert_eq!(p.rank(&input, &mut rng, &mut order), DecisionKind::Sticky);
        let first = order.clone();
        for _ in 0..10 {
            p.rank(&input, &mut rng, &mut order);
            assert_eq!(order, first);
        }
    }

    #[test]
    fn full_owner_overflows_to_the_next_on_the_ring() {
        let mut p = policy(4);
        let mut c = candidates(&[0.0; 4]);
        let idx = identity(4);
        let mut rng = SplitMix64::new(0);
        let mut order = Vec::new();
        let h = key_hash("hot");
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: Some(h),
            limit: 4,
        };
        p.rank(&input, &mut rng, &mut order);
        let owner = order[0];
        let next = order[1];
        c[owner].leases = 10;
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: Some(h),
            limit: 4,
        };
        assert_eq!(
            p.rank(&input, &mut rng, &mut order),
            DecisionKind::StickyOverflow
        );
        assert_eq!(order[0], next);
        assert_eq!(*order.last().unwrap(), owner);
    }

    #[test]
    fn ineligible_owner_is_walked_past() {
        let mut p = policy(4);
        let c = candidates(&[0.0; 4]);
        let idx = identity(4);
        let mut rng = SplitMix64::new(0);
        let mut order = Vec::new();
        let h = key_hash("k");
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: Some(h),
            limit: 2,
        };
        p.rank(&input, &mut rng, &mut order);
        let (owner, next) = (order[0], order[1]);
        // Remove the owner from the candidates: slot_index maps it to nothing.
        let rest: Vec<_> = c
            .iter()
            .copied()
            .filter(|x| x.slot as usize != owner)
            .collect();
        let mut idx2 = vec![crate::policy::NO_CANDIDATE; 4];
        for (i, x) in rest.iter().enumerate() {
            idx2[x.slot as usize] = i as u32;
        }
        let input = DecisionInput {
            candidates: &rest,
            slot_index: &idx2,
            key_hash: Some(h),
            limit: 2,
        };
        assert_eq!(p.rank(&input, &mut rng, &mut order), DecisionKind::Sticky);
        assert_eq!(rest[order[0]].slot as usize, next);
    }

    #[test]
    fn no_key_falls_back_to_load() {
        let mut p = policy(3);
        let c = candidates(&[0.5, 0.1, 0.3]);
        let idx = identity(3);
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: None,
            limit: 3,
        };
        let mut order = Vec::new();
        assert_eq!(
            p.rank(&input, &mut SplitMix64::new(0), &mut order),
            DecisionKind::NoKey
        );
        assert_eq!(order, vec![1, 2, 0]);
    }
}
