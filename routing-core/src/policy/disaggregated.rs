//! Prefill/decode disaggregation: pick a prefill backend and a decode backend for one request.
//!
//! The prefill side is where the prompt is processed, so it is chosen cache-aware (prefix
//! affinity against load); the decode side holds the sequence while it generates, so it is
//! chosen by least load. The Worker sends the request to the prefill server with
//! `kv_transfer_params` and then to the decode server. When the pool has no prefill or no decode
//! backends for the model, the pool falls back to its mixed backends, ranked cache-aware.

use super::cache_aware::{CacheAware, CacheAwareConfig};
use super::least_load::rank_by_cost;
use super::{DecisionInput, DecisionKind, PolicyKind, RoutingPolicy};
use crate::random::RandomSource;

/// The disaggregated policy.
#[derive(Debug, Clone, Copy)]
pub struct Disaggregated {
    prefill: CacheAware,
}

impl Disaggregated {
    /// A policy whose prefill side uses the given cache-aware knobs.
    pub fn new(config: CacheAwareConfig) -> Self {
        Disaggregated {
            prefill: CacheAware::new(config),
        }
    }
}

impl RoutingPolicy for Disaggregated {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Disaggregated
    }

    fn rank(
        &mut self,
        input: &DecisionInput<'_>,
        rng: &mut dyn RandomSource,
        order: &mut Vec<usize>,
    ) -> DecisionKind {
        self.prefill.rank(input, rng, order)
    }

    fn rank_decode(
        &mut self,
        input: &DecisionInput<'_>,
        rng: &mut dyn RandomSource,
        order: &mut Vec<usize>,
    ) -> bool {
        order.clear();
        rank_by_cost(input, rng, order);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidates, identity};
    use super::*;
    use crate::random::SplitMix64;

    #[test]
    fn prefill_is_cache_aware_and_decode_least_loaded() {
        let mut p = Disaggregated::new(CacheAwareConfig::default());
        let mut prefill = candidates(&[0.2, 0.25]);
        prefill[1].cached_blocks = 30;
        prefill[1].benefit = 0.05;
        let decode = candidates(&[0.4, 0.1, 0.3]);
        let idx = identity(3);
        let mut rng = SplitMix64::new(0);
        let mut order = Vec::new();
        let kind = p.rank(
            &DecisionInput {
                candidates: &prefill,
                slot_index: &idx,
                key_hash: None,
                limit: 2,
            },
            &mut rng,
            &mut order,
        );
        assert_eq!((kind, order[0]), (DecisionKind::CacheHit, 1));
        assert!(p.rank_decode(
            &DecisionInput {
                candidates: &decode,
                slot_index: &idx,
                key_hash: None,
                limit: 2
            },
            &mut rng,
            &mut order,
        ));
        assert_eq!(order, vec![1, 2]);
    }
}
