//! Power of two choices (Mitzenmacher): draw two distinct backends uniformly at random and take
//! the one with the lower LLM cost. Nearly as balanced as least load, with no herding onto one
//! backend when many deciders share a stale view. Fallbacks: the other of the two, then the
//! least-cost of the rest.

use super::least_load::rank_by_cost;
use super::{DecisionInput, DecisionKind, PolicyKind, RoutingPolicy};
use crate::random::RandomSource;

/// The power-of-two-choices policy.
#[derive(Debug, Clone, Copy, Default)]
pub struct PowerOfTwo;

impl RoutingPolicy for PowerOfTwo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PowerOfTwo
    }

    fn rank(
        &mut self,
        input: &DecisionInput<'_>,
        rng: &mut dyn RandomSource,
        order: &mut Vec<usize>,
    ) -> DecisionKind {
        order.clear();
        let n = input.candidates.len();
        if n == 0 || input.limit == 0 {
            return DecisionKind::PowerOfTwo;
        }
        if n == 1 {
            order.push(0);
            return DecisionKind::PowerOfTwo;
        }
        let a = rng.below(n as u64) as usize;
        let mut b = rng.below(n as u64 - 1) as usize;
        if b >= a {
            b += 1;
        }
        let (ca, cb) = (input.candidates[a].cost(), input.candidates[b].cost());
        let (first, second) = if cb < ca { (b, a) } else { (a, b) };
        order.push(first);
        if input.limit > 1 {
            order.push(second);
        }
        if input.limit > 2 {
            rank_by_cost(input, rng, order);
        }
        DecisionKind::PowerOfTwo
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidates, identity};
    use super::*;
    use crate::random::SplitMix64;

    #[test]
    fn lower_cost_of_two_wins() {
        let c = candidates(&[0.1, 0.9]);
        let idx = identity(2);
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: None,
            limit: 3,
        };
        let mut rng = SplitMix64::new(9);
        let mut order = Vec::new();
        for _ in 0..20 {
            PowerOfTwo.rank(&input, &mut rng, &mut order);
            assert_eq!(order, vec![0, 1]);
        }
    }

    #[test]
    fn the_most_loaded_backend_never_wins() {
        let c = candidates(&[0.2, 0.3, 0.1, 0.9, 0.4]);
        let idx = identity(5);
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: None,
            limit: 3,
        };
        let mut rng = SplitMix64::new(3);
        let mut order = Vec::new();
        for _ in 0..200 {
            PowerOfTwo.rank(&input, &mut rng, &mut order);
            assert_ne!(order[0], 3);
            assert_eq!(order.len(), 3);
            let mut d = order.clone();
            d.sort();
            d.dedup();
            assert_eq!(d.len(), 3);
        }
        let single = candidates(&[0.5]);
        let input = DecisionInput {
            candidates: &single,
            slot_index: &idx,
            key_hash: None,
            limit: 3,
        };
        PowerOfTwo.rank(&input, &mut rng, &mut order);
        assert_eq!(order, vec![0]);
    }
}
