//! Round robin: each eligible backend in turn, ignoring load and weight.
//!
//! The turn counter is shared by every model in the pool, so with several models the turns are
//! fair over the pool rather than per model; the fallbacks are the backends that follow.

use super::{DecisionInput, DecisionKind, PolicyKind, RoutingPolicy};
use crate::random::RandomSource;

/// The round-robin policy.
#[derive(Debug, Clone, Default)]
pub struct RoundRobin {
    next: u64,
}

impl RoutingPolicy for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }

    fn rank(
        &mut self,
        input: &DecisionInput<'_>,
        _rng: &mut dyn RandomSource,
        order: &mut Vec<usize>,
    ) -> DecisionKind {
        order.clear();
        let n = input.candidates.len();
        if n == 0 {
            return DecisionKind::RoundRobin;
        }
        let start = (self.next % n as u64) as usize;
        self.next = self.next.wrapping_add(1);
        order.extend((0..input.limit.min(n)).map(|k| (start + k) % n));
        DecisionKind::RoundRobin
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidates, identity};
    use super::*;
    use crate::random::SplitMix64;

    #[test]
    fn takes_turns_and_lists_the_followers() {
        let c = candidates(&[0.0, 0.0, 0.0]);
        let idx = identity(3);
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: None,
            limit: 2,
        };
        let mut p = RoundRobin::default();
        let mut rng = SplitMix64::new(0);
        let mut order = Vec::new();
        let mut firsts = Vec::new();
        for _ in 0..6 {
            p.rank(&input, &mut rng, &mut order);
            assert_eq!(order.len(), 2);
            assert_eq!(order[1], (order[0] + 1) % 3);
            firsts.push(order[0]);
        }
        assert_eq!(firsts, vec![0, 1, 2, 0, 1, 2]);
    }
}
