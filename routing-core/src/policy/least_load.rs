//! Least load: the backend whose load would be lowest after placing the request, by the LLM cost
//! model (in-flight tokens over capacity plus the scraped queue, plus this request's uncached
//! prompt and expected output). Ties are broken at a random starting point so an idle pool does
//! not send every first request to the same backend.

use super::{smallest_by, DecisionInput, DecisionKind, PolicyKind, RoutingPolicy};
use crate::random::RandomSource;

/// The least-load policy.
#[derive(Debug, Clone, Copy, Default)]
pub struct LeastLoad;

impl RoutingPolicy for LeastLoad {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastLoad
    }

    fn rank(
        &mut self,
        input: &DecisionInput<'_>,
        rng: &mut dyn RandomSource,
        order: &mut Vec<usize>,
    ) -> DecisionKind {
        order.clear();
        rank_by_cost(input, rng, order);
        DecisionKind::LeastLoad
    }
}

/// Appends candidates by ascending [`super::Candidate::cost`], skipping those already in `order`.
pub(crate) fn rank_by_cost(
    input: &DecisionInput<'_>,
    rng: &mut dyn RandomSource,
    order: &mut Vec<usize>,
) {
    let n = input.candidates.len();
    let start = rng.below(n as u64) as usize;
    let skip = order.clone();
    let want = input.limit.saturating_sub(order.len());
    smallest_by(n, want, start, &skip, |i| input.candidates[i].cost(), order);
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidates, identity};
    use super::*;
    use crate::random::SplitMix64;

    #[test]
    fn lowest_cost_first_including_cache_benefit() {
        let mut c = candidates(&[0.5, 0.2, 0.3, 0.9]);
        c[2].benefit = 0.15;
        let idx = identity(4);
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: None,
            limit: 3,
        };
        let mut order = Vec::new();
        LeastLoad.rank(&input, &mut SplitMix64::new(1), &mut order);
        assert_eq!(order, vec![2, 1, 0]);
    }

    #[test]
    fn ties_spread_over_backends() {
        let c = candidates(&[0.0; 4]);
        let idx = identity(4);
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: None,
            limit: 1,
        };
        let mut rng = SplitMix64::new(5);
        let mut order = Vec::new();
        let mut seen = [false; 4];
        for _ in 0..100 {
            LeastLoad.rank(&input, &mut rng, &mut order);
            seen[order[0]] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
