//! Random: a backend drawn at random in proportion to its weight; the fallbacks are further
//! draws without replacement. The randomness comes from the caller's [`RandomSource`].

use super::{DecisionInput, DecisionKind, PolicyKind, RoutingPolicy};
use crate::random::RandomSource;

/// The weighted random policy.
#[derive(Debug, Clone, Copy, Default)]
pub struct Random;

impl RoutingPolicy for Random {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Random
    }

    fn rank(
        &mut self,
        input: &DecisionInput<'_>,
        rng: &mut dyn RandomSource,
        order: &mut Vec<usize>,
    ) -> DecisionKind {
        order.clear();
        draw_without_replacement(input, rng, order);
        DecisionKind::Random
    }
}

/// Draws up to `input.limit` candidates, weight-proportionally, without replacement.
pub(crate) fn draw_without_replacement(
    input: &DecisionInput<'_>,
    rng: &mut dyn RandomSource,
    order: &mut Vec<usize>,
) {
    let cands = input.candidates;
    let want = input.limit.min(cands.len());
    let mut remaining: u64 = cands.iter().map(|c| u64::from(c.weight.max(1))).sum();
    while order.len() < want && remaining > 0 {
        let mut r = rng.below(remaining);
        for (i, c) in cands.iter().enumerate() {
            if order.contains(&i) {
                continue;
            }
            let w = u64::from(c.weight.max(1));
            if r < w {
                order.push(i);
                remaining -= w;
                break;
            }
            r -= w;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidates, identity};
    use super::*;
    use crate::random::SplitMix64;

    #[test]
    fn draws_distinct_candidates_in_proportion_to_weight() {
        let mut c = candidates(&[0.0; 4]);
        c[3].weight = 3;
        let idx = identity(4);
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: None,
            limit: 4,
        };
        let mut rng = SplitMix64::new(42);
        let mut order = Vec::new();
        let mut firsts = [0u32; 4];
        for _ in 0..6000 {
            Random.rank(&input, &mut rng, &mut order);
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, vec![0, 1, 2, 3]);
            firsts[order[0]] += 1;
        }
        assert!((2700..3300).contains(&firsts[3]), "{firsts:?}");
        assert!(
            firsts[..3].iter().all(|&f| (800..1200).contains(&f)),
            "{firsts:?}"
        );
    }
}
