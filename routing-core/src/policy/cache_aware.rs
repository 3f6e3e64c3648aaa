//! Cache-aware routing: prefix affinity weighed against load.
//!
//! Each candidate scores `a * (load + request_load) - b * benefit` (see [`crate::backend::cost`]):
//! its load after taking the request if nothing were cached, minus the prefill it would skip thanks
//! to its prefix cache; the lowest score wins. With `b = a` this is exactly least load counting
//! cache hits; `b > a` prefers the cache more strongly, because a prefix hit also saves prefill
//! compute and time to first token, not just KV space.
//!
//! A load guard keeps a popular prefix from overloading its holder: if the winner was chosen for
//! its cache and its load exceeds both `load_guard_ratio` times the mean load and the least load
//! plus `load_guard_min_gap`, the request spills to the least-loaded candidate. The pool records
//! the prefix there too, so a hot prefix gains a second replica and later requests for it are
//! shared between the two by load.

use super::least_load::rank_by_cost;
use super::{not_nan, smallest_by, DecisionInput, DecisionKind, PolicyKind, RoutingPolicy};
use crate::random::RandomSource;
use serde::{Deserialize, Serialize};

/// Knobs of the cache_aware policy (also the prefill side of disaggregated).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CacheAwareConfig {
    /// `a`: weight of load (default 1.0).
    pub load_weight: f64,
    /// `b`: weight of the cache benefit (default 8.0: skipping a prefill token is worth eight
    /// tokens of KV occupancy).
    pub cache_weight: f64,
    /// Spill when the cached winner's load exceeds this multiple of the mean load (default 1.2).
    pub load_guard_ratio: f64,
    /// ...and exceeds the least load by at least this much, as a fraction of capacity
    /// (default 0.05), so that near-idle pools keep their affinity.
    pub load_guard_min_gap: f64,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            load_weight: 1.0,
            cache_weight: 8.0,
            load_guard_ratio: 1.2,
            load_guard_min_gap: 0.05,
        }
    }
}

impl CacheAwareConfig {
    /// Checks the knobs.
    pub fn validate(&self) -> Result<(), String> {
        let ok = |x: f64, lo: f64, hi: f64| x.is_finite() && x >= lo && x <= hi;
        if !ok(self.load_weight, 0.0, 1e6) || !ok(self.cache_weight, 0.0, 1e6) {
            return Err("cache_aware weights must be within [0, 1e6]".into());
        }
        if self.load_weight == 0.0 && self.cache_weight == 0.0 {
            return Err("cache_aware weights must not both be 0".into());
        }
        if !ok(self.load_guard_ratio, 1.0, 1e6) {
            return Err("cache_aware.load_guard_ratio must be at least 1".into());
        }
        if !ok(self.load_guard_min_gap, 0.0, 1e6) {
            return Err("cache_aware.load_guard_min_gap must be at least 0".into());
        }
        Ok(())
    }
}

/// The cache-aware policy.
#[derive(Debug, Clone, Copy)]
pub struct CacheAware {
    config: CacheAwareConfig,
}

impl CacheAware {
    /// A policy with the given knobs.
    pub fn new(config: CacheAwareConfig) -> Self {
        CacheAware { config }
    }
}

impl RoutingPolicy for CacheAware {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheAware
    }

    fn rank(
        &mut self,
        input: &DecisionInput<'_>,
        rng: &mut dyn RandomSource,
        order: &mut Vec<usize>,
    ) -> DecisionKind {
        order.clear();
        let cands = input.candidates;
        let n = cands.len();
        if n == 0 {
            return DecisionKind::CacheMiss;
        }
        let cfg = &self.config;
        if cands.iter().all(|c| c.cached_blocks == 0) {
            rank_by_cost(input, rng, order);
            return DecisionKind::CacheMiss;
        }
        let score = |i: usize| {
            let c = &cands[i];
            cfg.load_weight * (c.load + c.request_load) - cfg.cache_weight * c.benefit
        };
        let start = rng.below(n as u64) as usize;
        smallest_by(n, input.limit, start, &[], score, order);
        let best = &cands[order[0]];
        if best.cached_blocks == 0 {
            return DecisionKind::CacheMiss;
        }
        let mean = cands.iter().map(|c| not_nan(c.load)).sum::<f64>() / n as f64;
        let (least, least_load) = cands
            .iter()
            .enumerate()
            .map(|(i, c)| (i, not_nan(c.load)))
            .fold(
                (0, f64::INFINITY),
                |acc, x| if x.1 < acc.1 { x } else { acc },
            );
        let too_far_ahead = best.load > cfg.load_guard_ratio * mean
            && best.load - least_load > cfg.load_guard_min_gap;
        if too_far_ahead && least != order[0] {
            order.retain(|&i| i != least);
            order.insert(0, least);
            order.truncate(input.limit);
            return DecisionKind::Spill;
        }
        DecisionKind::CacheHit
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidates, identity};
    use super::*;
    use crate::random::SplitMix64;

    fn input<'a>(c: &'a [super::super::Candidate], idx: &'a [u32]) -> DecisionInput<'a> {
        DecisionInput {
            candidates: c,
            slot_index: idx,
            key_hash: None,
            limit: 3,
        }
    }

    #[test]
    fn prefers_the_cached_backend_despite_some_load() {
        let mut c = candidates(&[0.10, 0.12, 0.09]);
        c[1].cached_blocks = 50;
        c[1].benefit = 0.02;
        let idx = identity(3);
        let mut order = Vec::new();
        let mut p = CacheAware::new(CacheAwareConfig::default());
        let kind = p.rank(&input(&c, &idx), &mut SplitMix64::new(0), &mut order);
        assert_eq!(kind, DecisionKind::CacheHit);
        assert_eq!(order[0], 1);
        assert_eq!(order.len(), 3);
    }

    #[test]
    fn no_cache_anywhere_is_least_load() {
        let c = candidates(&[0.3, 0.1, 0.2]);
        let idx = identity(3);
        let mut order = Vec::new();
        let mut p = CacheAware::new(CacheAwareConfig::default());
        assert_eq!(
            p.rank(&input(&c, &idx), &mut SplitMix64::new(0), &mut order),
            DecisionKind::CacheMiss
        );
        assert_eq!(order, vec![1, 2, 0]);
    }

    #[test]
    fn load_guard_spills_to_the_least_loaded() {
        let mut c = candidates(&[0.60, 0.10, 0.20]);
        c[0].cached_blocks = 100;
        c[0].benefit = 0.2;
        let idx = identity(3);
        let mut order = Vec::new();
        let mut p = CacheAware::new(CacheAwareConfig::default());
        let kind = p.rank(&input(&c, &idx), &mut SplitMix64::new(0), &mut order);
        assert_eq!(kind, DecisionKind::Spill);
        assert_eq!(order[0], 1);
        assert!(order.contains(&0), "the cached backend stays a fallback");
    }

    #[test]
    fn guard_gap_keeps_affinity_when_nearly_idle() {
        let mut c = candidates(&[0.03, 0.0, 0.0]);
        c[0].cached_blocks = 10;
        c[0].benefit = 0.01;
        let idx = identity(3);
        let mut order = Vec::new();
        let mut p = CacheAware::new(CacheAwareConfig::default());
        assert_eq!(
            p.rank(&input(&c, &idx), &mut SplitMix64::new(0), &mut order),
            DecisionKind::CacheHit
        );
        assert_eq!(order[0], 0);
    }

    #[test]
    fn validation() {
        assert!(CacheAwareConfig::default().validate().is_ok());
        let bad = CacheAwareConfig {
            load_guard_ratio: 0.5,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = CacheAwareConfig {
            cache_weight: f64::NAN,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }
}
