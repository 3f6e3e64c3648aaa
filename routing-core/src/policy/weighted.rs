//! Smooth weighted round robin, as nginx does it: backends take turns in proportion to their
//! weights, interleaved rather than in bursts (weights 5, 1, 1 give a a b a c a a, not a a a a a b c).
//!
//! Each pick adds every candidate's weight to its running "current weight", chooses the largest,
//! and subtracts the total from the chosen one. The fallbacks are the next largest current weights,
//! i.e. the backends whose turn is nearest.

use super::{smallest_by, DecisionInput, DecisionKind, PolicyKind, RoutingPolicy};
use crate::policy::ring::RingMember;
use crate::random::RandomSource;

/// The smooth weighted round-robin policy.
#[derive(Debug, Clone, Default)]
pub struct Weighted {
    current: Vec<i64>,
}

impl RoutingPolicy for Weighted {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Weighted
    }

    fn rank(
        &mut self,
        input: &DecisionInput<'_>,
        _rng: &mut dyn RandomSource,
        order: &mut Vec<usize>,
    ) -> DecisionKind {
        order.clear();
        let cands = input.candidates;
        if cands.is_empty() {
            return DecisionKind::Weighted;
        }
        let max_slot = cands.iter().map(|c| c.slot as usize).max().unwrap_or(0);
        if self.current.len() <= max_slot {
            self.current.resize(max_slot + 1, 0);
        }
        let mut total = 0i64;
        let mut best = 0;
        for (i, c) in cands.iter().enumerate() {
            let w = i64::from(c.weight.max(1));
            total += w;
            self.current[c.slot as usize] += w;
            if self.current[c.slot as usize] > self.current[cands[best].slot as usize] {
                best = i;
            }
        }
        self.current[cands[best].slot as usize] -= total;
        order.push(best);
        let current = &self.current;
        smallest_by(
            cands.len(),
            input.limit.saturating_sub(1),
            0,
            &[best],
            |i| -(current[cands[i].slot as usize] as f64),
            order,
        );
        DecisionKind::Weighted
    }

    fn members_changed(&mut self, _members: &[RingMember<'_>]) {
        self.current.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidates, identity};
    use super::*;
    use crate::random::SplitMix64;

    #[test]
    fn smooth_interleaving_by_weight() {
        let mut c = candidates(&[0.0, 0.0, 0.0]);
        c[0].weight = 5;
        let idx = identity(3);
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: None,
            limit: 3,
        };
        let mut p = Weighted::default();
        let mut rng = SplitMix64::new(0);
        let mut order = Vec::new();
        let mut picks = String::new();
        for _ in 0..7 {
            p.rank(&input, &mut rng, &mut order);
            assert_eq!(order.len(), 3);
            picks.push((b'a' + order[0] as u8) as char);
        }
        assert_eq!(picks, "aabacaa");
    }

    #[test]
    fn shares_follow_weights_over_many_picks() {
        let mut c = candidates(&[0.0; 3]);
        c[0].weight = 1;
        c[1].weight = 2;
        c[2].weight = 7;
        let idx = identity(3);
        let input = DecisionInput {
            candidates: &c,
            slot_index: &idx,
            key_hash: None,
            limit: 1,
        };
        let mut p = Weighted::default();
        let mut rng = SplitMix64::new(0);
        let mut order = Vec::new();
        let mut counts = [0; 3];
        for _ in 0..1000 {
            p.rank(&input, &mut rng, &mut order);
            counts[order[0]] += 1;
        }
        assert_eq!(counts, [100, 200, 700]);
    }
}
