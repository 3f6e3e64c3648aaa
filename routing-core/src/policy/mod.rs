//! Routing policies: given the eligible backends for a request, rank them in preference order.
//!
//! Every policy implements [`RoutingPolicy`], whose `rank` writes candidate indices best first,
//! as pingora-load-balancing's `BackendIter` does: the first is the choice, the rest are the
//! fallbacks the Worker walks on a retry, so failover needs no second decision. The pool filters
//! first (served model, role, lifecycle, health, breaker, saturation) and fills in each
//! [`Candidate`]'s load and cache figures from the cost model and the affinity table; policies
//! only rank. [`build`] makes the pool's [`PoolPolicies`] from its [`PolicyKind`] and knobs: the
//! policy that ranks a request's backends and, for a pool that pairs prefill and decode servers
//! (`disaggregated`), a second ordinary policy that ranks the decode side.
//!
//! `ring` is the consistent-hash ring with bounded loads that `consistent_hash` walks and whose
//! members every policy is told about ([`RoutingPolicy::members_changed`]); [`ring::key_hash`] is
//! also how the pool and the coordinator shards hash routing keys.

mod cache_aware;
mod consistent_hash;
mod least_load;
mod power_of_two;
mod predicted_latency;
mod random;
pub mod ring;
mod round_robin;
mod weighted;

pub use cache_aware::{CacheAware, CacheAwareConfig};
pub use consistent_hash::{ConsistentHash, ConsistentHashConfig};
pub use least_load::LeastLoad;
pub use power_of_two::PowerOfTwo;
pub use predicted_latency::{PredictedLatency, PredictedLatencyConfig};
pub use random::Random;
pub use round_robin::RoundRobin;
pub use weighted::Weighted;

use crate::policy::ring::RingMember;
use crate::random::RandomSource;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Which policy a pool uses.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Each eligible backend in turn.
    RoundRobin,
    /// Smooth weighted round robin (nginx's), by backend weight.
    Weighted,
    /// A random backend, weight-proportional.
    Random,
    /// The backend with the lowest load after placing the request.
    LeastLoad,
    /// The lower-cost of two random backends.
    PowerOfTwo,
    /// The routing key's owner on the hash ring, with bounded loads.
    ConsistentHash,
    /// Prefix affinity weighed against load (the default before `predicted_latency`).
    CacheAware,
    /// The least predicted time: prefill backlog, uncached prefill and decode interference (the
    /// default).
    #[default]
    PredictedLatency,
    /// A prefill backend (cache-aware) and a decode backend (least load).
    Disaggregated,
}

impl PolicyKind {
    /// Every policy, in order.
    pub const ALL: [PolicyKind; 9] = [
        PolicyKind::RoundRobin,
        PolicyKind::Weighted,
        PolicyKind::Random,
        PolicyKind::LeastLoad,
        PolicyKind::PowerOfTwo,
        PolicyKind::ConsistentHash,
        PolicyKind::CacheAware,
        PolicyKind::PredictedLatency,
        PolicyKind::Disaggregated,
    ];

    /// The policy's name as used in configuration and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Weighted => "weighted",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::ConsistentHash => "consistent_hash",
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::PredictedLatency => "predicted_latency",
            PolicyKind::Disaggregated => "disaggregated",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("unknown policy `{s}`"))
    }
}

/// Why a policy ranked the way it did (reported in the grant and counted in metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionKind {
    /// Round robin's turn.
    RoundRobin,
    /// Smooth weighted round robin's turn.
    Weighted,
    /// A random draw.
    Random,
    /// The least-loaded backend.
    LeastLoad,
    /// The lower-cost of two random backends.
    PowerOfTwo,
    /// The routing key's ring owner.
    Sticky,
    /// The key's owner was at its bounded-load cap; the next backend on the ring took it.
    StickyOverflow,
    /// A sticky policy found no routing key and fell back to least load.
    NoKey,
    /// The chosen backend holds part of the prompt's prefix.
    CacheHit,
    /// No backend holds any of the prefix; chosen by load.
    CacheMiss,
    /// The backend holding the prefix was too far ahead in load; the least-loaded one took it.
    Spill,
}

impl DecisionKind {
    /// Every decision kind, in order.
    pub const ALL: [DecisionKind; 11] = [
        DecisionKind::RoundRobin,
        DecisionKind::Weighted,
        DecisionKind::Random,
        DecisionKind::LeastLoad,
        DecisionKind::PowerOfTwo,
        DecisionKind::Sticky,
        DecisionKind::StickyOverflow,
        DecisionKind::NoKey,
        DecisionKind::CacheHit,
        DecisionKind::CacheMiss,
        DecisionKind::Spill,
    ];

    /// The kind's name as used in JSON and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionKind::RoundRobin => "round_robin",
            DecisionKind::Weighted => "weighted",
            DecisionKind::Random => "random",
            DecisionKind::LeastLoad => "least_load",
            DecisionKind::PowerOfTwo => "power_of_two",
            DecisionKind::Sticky => "sticky",
            DecisionKind::StickyOverflow => "sticky_overflow",
            DecisionKind::NoKey => "no_key",
            DecisionKind::CacheHit => "cache_hit",
            DecisionKind::CacheMiss => "cache_miss",
            DecisionKind::Spill => "spill",
        }
    }
}

/// Marks a slot with no candidate in [`DecisionInput::slot_index`].
pub const NO_CANDIDATE: u32 = u32::MAX;

/// One eligible backend, as the policies see it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Candidate {
    /// The backend's slot in the pool (its node number on the ring).
    pub slot: u32,
    /// Its weight.
    pub weight: u32,
    /// Its live leases.
    pub leases: u32,
    /// Its current load, a fraction of capacity ([`crate::backend::cost::backend_load`]).
    pub load: f64,
    /// The load this request would add there if nothing were cached:
    /// `(prompt + output tokens) / capacity`.
    pub request_load: f64,
    /// The prefill this request would skip there, a fraction of capacity
    /// ([`crate::backend::cost::cache_benefit`]).
    pub benefit: f64,
    /// Leading prompt blocks it probably holds.
    pub cached_blocks: u32,
    /// Of those, the ones computed by now as far as the pool can tell: blocks recorded by a
    /// request still in its prefill there are not cached yet ([`crate::backend::held_blocks`]);
    /// what the time model prices as cached.
    pub computed_blocks: u32,
    /// Predicted time to first token there, in ms ([`crate::backend::time_model`]).
    pub ttft_ms: f64,
    /// Predicted decode time of the request there, in ms.
    pub decode_ms: f64,
    /// Predicted time the request would cost the sequences running there, in ms.
    pub harm_ms: f64,
    /// Of `ttft_ms`, the wait for KV space or a sequence slot and for other clients' queued
    /// requests, in ms (the rest is the prefill queue, the prefill and a step).
    pub wait_ms: f64,
    /// Of `wait_ms`, the wait for KV space or a sequence slot, in ms.
    pub room_ms: f64,
    /// Of `ttft_ms`, every wait before its prefill starts (the prefill queue ahead and
    /// `wait_ms`): the uncertain part of the prediction.
    pub queue_ms: f64,
    /// Predicted time the request's prefill would add to the first token of the requests whose
    /// prefill runs there now, in ms: their number times its prefill (at most one step's budget),
    /// since vLLM computes the new prompt in their steps.
    pub first_token_harm_ms: f64,
    /// Predicted time other prompts' prefill adds to the request's decode there, in ms: its own
    /// decode times `share / (1 - share)`, where `share` is the backend's recent time in prefill
    /// ([`crate::backend::time_model::BackendTiming::prefill_share`]).
    pub stall_ms: f64,
    /// Predicted time the request's prefill there would add to the requests arriving there after
    /// it, in ms: the prefill it computes there times `share / (1 - share)`, with `share` as for
    /// `stall_ms` (a job of size x at a server busy a share ρ of the time delays the later
    /// arrivals by about x·ρ/(1−ρ) in all). What a prefix computed again costs the fleet, which
    /// the request's own time does not show; what `predicted_latency.arrival_harm_weight` prices.
    pub arrival_harm_ms: f64,
    /// How far the request's prefill would push the answers running there past the pool's tail
    /// of end-to-end times, summed, in ms
    /// ([`crate::backend::time_model::BackendTiming::tail_harm_ms`]; 0 until the tail is
    /// learned, or when `predicted_latency.tail_harm_weight` is 0).
    pub tail_harm_ms: f64,
    /// Share of its KV cache the prefix-affinity table records as holding prompts, 0 to 1 (0 when
    /// the table has no bound for it): breaks near ties towards the backend with the most room
    /// for a new conversation's history.
    pub cache_fill: f64,
    /// The time it would take the Worker to send the request here, in ms: 0 where its fetch went
    /// ahead of the lease call (`ROUTE_AHEAD`) or none went, the round trip of a re-send
    /// elsewhere. Only `predicted_latency` prices it (as time to first token); the other
    /// policies decide as if no fetch had gone ahead.
    pub resend_ms: f64,
    /// The prefill its computed prefix of the prompt saves there, in ms (the tokens it would not
    /// compute, at its prefill rate): what `predicted_latency.affinity_weight` prices.
    pub affinity_ms: f64,
}

impl Candidate {
    /// Load after placing the request here: `load + request_load - benefit`.
    pub fn cost(&self) -> f64 {
        not_nan(self.load + self.request_load - self.benefit)
    }
}

/// What a policy ranks.
#[derive(Debug, Clone, Copy)]
pub struct DecisionInput<'a> {
    /// The eligible backends (non-empty when a policy is called).
    pub candidates: &'a [Candidate],
    /// For each pool slot, its index in `candidates`, or [`NO_CANDIDATE`].
    pub slot_index: &'a [u32],
    /// Hash of the request's routing key ([`crate::policy::ring::key_hash`]), if it has one.
    pub key_hash: Option<u64>,
    /// How many candidates to rank (at least 1).
    pub limit: usize,
}

impl DecisionInput<'_> {
    /// The candidate index of `slot`, if it is eligible.
    pub fn candidate_of(&self, slot: u32) -> Option<usize> {
        match self.slot_index.get(slot as usize) {
            Some(&i) if i != NO_CANDIDATE => Some(i as usize),
            _ => None,
        }
    }
}

/// A routing policy.
pub trait RoutingPolicy: Send {
    /// Which policy this is.
    fn kind(&self) -> PolicyKind;

    /// Writes up to `input.limit` distinct candidate indices into `order`, best first, and says
    /// why the first was chosen. `input.candidates` is never empty.
    fn rank(
        &mut self,
        input: &DecisionInput<'_>,
        rng: &mut dyn RandomSource,
        order: &mut Vec<usize>,
    ) -> DecisionKind;

    /// Called when the pool's backends or their weights change.
    fn members_changed(&mut self, _members: &[RingMember<'_>]) {}
}

/// The policies a pool holds.
pub struct PoolPolicies {
    /// Ranks the backends a request goes to: every request's, or a pair's prefill side.
    pub prefill: Box<dyn RoutingPolicy>,
    /// Ranks a pair's decode backends; only a pool that pairs prefill and decode servers has one.
    pub decode: Option<Box<dyn RoutingPolicy>>,
}

impl PoolPolicies {
    /// Tells both policies that the pool's backends or their weights changed.
    pub fn members_changed(&mut self, members: &[RingMember<'_>]) {
        self.prefill.members_changed(members);
        if let Some(decode) = &mut self.decode {
            decode.members_changed(members);
        }
    }
}

/// Builds the policies of a pool configured with `kind` and the pool's knobs. `disaggregated`
/// pairs a prefill backend, chosen cache-aware (the prompt is processed there, so its prefix
/// cache matters), with a decode backend chosen by least load (it holds the sequence while it
/// generates); when a pool has no prefill or no decode backends for the model, its mixed backends
/// are ranked by the prefill policy.
pub fn build(
    kind: PolicyKind,
    consistent_hash: &ConsistentHashConfig,
    cache_aware: &CacheAwareConfig,
    predicted_latency: &PredictedLatencyConfig,
) -> PoolPolicies {
    let decode: Option<Box<dyn RoutingPolicy>> = match kind {
        PolicyKind::Disaggregated => Some(Box::new(LeastLoad)),
        _ => None,
    };
    PoolPolicies {
        prefill: build_one(kind, consistent_hash, cache_aware, predicted_latency),
        decode,
    }
}

/// The policy that ranks a request's backends (for `disaggregated`, its prefill side).
fn build_one(
    kind: PolicyKind,
    consistent_hash: &ConsistentHashConfig,
    cache_aware: &CacheAwareConfig,
    predicted_latency: &PredictedLatencyConfig,
) -> Box<dyn RoutingPolicy> {
    match kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::Weighted => Box::new(Weighted::default()),
        PolicyKind::Random => Box::new(Random),
        PolicyKind::LeastLoad => Box::new(LeastLoad),
        PolicyKind::PowerOfTwo => Box::new(PowerOfTwo),
        PolicyKind::ConsistentHash => Box::new(ConsistentHash::new(*consistent_hash)),
        PolicyKind::PredictedLatency => Box::new(PredictedLatency::new(*predicted_latency)),
        PolicyKind::CacheAware | PolicyKind::Disaggregated => {
            Box::new(CacheAware::new(*cache_aware))
        }
    }
}

/// NaN sorts last.
pub(crate) fn not_nan(x: f64) -> f64 {
    if x.is_nan() {
        f64::INFINITY
    } else {
        x
    }
}

/// Writes into `order` the indices in `0..n` with the `limit` smallest keys, ascending. Ties go
/// to the index met first when scanning from `start` (wrapping), which lets callers break ties
/// at random. Runs in `O(n * limit)`, cheaper than sorting for the small limits used here.
pub(crate) fn smallest_by(
    n: usize,
    limit: usize,
    start: usize,
    skip: &[usize],
    key: impl Fn(usize) -> f64,
    order: &mut Vec<usize>,
) {
    let mut keys: Vec<f64> = Vec::with_capacity(limit);
    let base = order.len();
    if n == 0 || limit == 0 {
        return;
    }
    for step in 0..n {
        let i = (start + step) % n;
        if skip.contains(&i) {
            continue;
        }
        let k = not_nan(key(i));
        let held = order.len() - base;
        if held == limit && k >= keys[held - 1] {
            continue;
        }
        let mut pos = held;
        while pos > 0 && k < keys[pos - 1] {
            pos -= 1;
        }
        if held == limit {
            keys.pop();
            order.pop();
        }
        keys.insert(pos, k);
        order.insert(base + pos, i);
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// Candidates at slots `0..loads.len()` with the given loads and weight 1.
    pub fn candidates(loads: &[f64]) -> Vec<Candidate> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| Candidate {
                slot: i as u32,
                weight: 1,
                leases: (load * 10.0) as u32,
                load,
                ..Candidate::default()
            })
            .collect()
    }

    /// The identity slot index for `n` candidates.
    pub fn identity(n: usize) -> Vec<u32> {
        (0..n as u32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{candidates, identity};
    use super::*;
    use crate::random::SplitMix64;

    #[test]
    fn policy_names_round_trip() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.as_str().parse::<PolicyKind>().unwrap(), kind);
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.as_str()));
            let policies = build(
                kind,
                &Default::default(),
                &Default::default(),
                &Default::default(),
            );
            if kind == PolicyKind::Disaggregated {
                assert_eq!(policies.prefill.kind(), PolicyKind::CacheAware);
                assert_eq!(
                    policies.decode.map(|d| d.kind()),
                    Some(PolicyKind::LeastLoad)
                );
            } else {
                assert_eq!(policies.prefill.kind(), kind);
                assert!(policies.decode.is_none(), "{kind}");
            }
        }
        assert!("fastest".parse::<PolicyKind>().is_err());
        for kind in DecisionKind::ALL {
            assert_eq!(
                serde_json::to_string(&kind).unwrap(),
                format!("\"{}\"", kind.as_str())
            );
        }
    }

    #[test]
    fn prefill_is_cache_aware_and_decode_least_loaded() {
        let mut p = build(
            PolicyKind::Disaggregated,
            &Default::default(),
            &Default::default(),
            &Default::default(),
        );
        let mut decode_policy = p.decode.take().unwrap();
        let mut prefill = candidates(&[0.2, 0.25]);
        prefill[1].cached_blocks = 30;
        prefill[1].benefit = 0.05;
        let decode = candidates(&[0.4, 0.1, 0.3]);
        let idx = identity(3);
        let mut rng = SplitMix64::new(0);
        let mut order = Vec::new();
        let kind = p.prefill.rank(
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
        decode_policy.rank(
            &DecisionInput {
                candidates: &decode,
                slot_index: &idx,
                key_hash: None,
                limit: 2,
            },
            &mut rng,
            &mut order,
        );
        assert_eq!(order, vec![1, 2]);
    }

    #[test]
    fn smallest_by_picks_the_lowest_in_order() {
        let keys = [5.0, 1.0, 3.0, 1.0, f64::NAN, 0.5];
        let mut order = Vec::new();
        smallest_by(keys.len(), 3, 0, &[], |i| keys[i], &mut order);
        assert_eq!(order, vec![5, 1, 3]);
        order.clear();
        smallest_by(keys.len(), 3, 2, &[], |i| keys[i], &mut order);
        assert_eq!(
            order,
            vec![5, 3, 1],
            "ties go to the first met from `start`"
        );
        order.clear();
        smallest_by(keys.len(), 10, 0, &[5], |i| keys[i], &mut order);
        assert_eq!(order, vec![1, 3, 2, 0, 4]);
        let mut prefilled = vec![9];
        smallest_by(2, 1, 0, &[], |i| keys[i], &mut prefilled);
        assert_eq!(prefilled, vec![9, 1]);
    }
}
