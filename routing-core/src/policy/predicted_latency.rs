//! Predicted-latency routing (the default): the backend where the request costs the least time.
//!
//! The pool fills each candidate's predicted time to first token, its own decode time and the
//! time it would cost the sequences already running there from the time model
//! ([`crate::backend::time_model`]); this policy ranks by
//! `ttft_weight × (ttft + (wait_quantile − 1) × wait) + decode_weight × own decode +
//! harm_weight × harm + first_token_harm_weight × first-token harm + stall_weight × stall +
//! arrival_harm_weight × arrival harm + tail_harm_weight × tail harm − affinity_weight × saved
//! prefill (where the wait is short)`, lowest first, where `wait` is the part of `ttft` spent
//! before the prefill starts (priced at a quantile rather than its mean: waits are what runs
//! long), and arrival harm is what its prefill there would cost the requests arriving after it.
//!
//! Cache hits are not weighted separately: a backend that holds the prompt's prefix skips that
//! prefill, which shows up as a shorter time to first token and less harm to its running
//! sequences. So a conversation stays where its history is cached unless the queue there costs
//! more than recomputing the history elsewhere, and a hot prefix gains a replica exactly when its
//! holder's prefill backlog exceeds a cold prefill on another backend (the pool then records the
//! prefix on the new holder too).
//!
//! A request whose fetch the Worker sent ahead to one backend (`ROUTE_AHEAD`) would reach any
//! other a re-send later: that round trip (`Candidate::resend_ms`) counts in the others' time to
//! first token, so the backend already sent to keeps the request unless another is predicted
//! faster by more than the re-send costs.
//!
//! Costs within 1 ms of the best count as tied, and ties go to the backend whose KV
//! cache the prefix-affinity table finds least full, so idle-time conversations spread.
//!
//! Decisions: `cache_hit` when the chosen backend holds part of the prefix, `spill` when another
//! candidate held more of it but was predicted slower, `cache_miss` otherwise.

use super::{smallest_by, DecisionInput, DecisionKind, PolicyKind, RoutingPolicy};
use crate::random::RandomSource;
use serde::{Deserialize, Serialize};

/// Predicted costs within this many ms of the best count as tied. Screened in the timed
/// simulation (Mooncake traces, 4,096 KV blocks, 6 windows x 3 seeds): 1 ms took the synthetic
/// trace's moderate-load TTFT p99 from 1.28x to 1.04x the best baseline's, 3 ms only to 1.11x,
/// 2% of the best cost to 1.25x.
const NEAR_TIE_MS: f64 = 1.0;

/// Knobs of the predicted_latency policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PredictedLatencyConfig {
    /// Weight of the predicted time to first token (default 1).
    pub ttft_weight: f64,
    /// Weight of the request's own decode time (default 0.8).
    pub decode_weight: f64,
    /// Weight of the time the request costs the sequences running there (default 0.4). At 0.8
    /// (the decode weight, as it was), a long prompt went to the backend running the fewest
    /// sequences even when it was predicted several times slower to start, which under load is
    /// the one stalled for memory with a queue (the Mooncake traces in the timed simulation:
    /// TTFT p99 1.4x to 1.6x the best baseline's).
    pub harm_weight: f64,
    /// The wait before the prefill starts (prefill queue, room, other clients' queue) is priced
    /// at this multiple of its predicted mean (default 3): a high quantile of a wait, which
    /// varies about as much as it lasts, rather than its mean, so a backend whose queue might
    /// run long loses to an idle one that only looks a little slower. At 2 the conversation
    /// trace's hit rate rose by 1-1.5 points on the real stack (2026-12-06), but in the timed
    /// simulation `make bench`'s prefix groups (64 closed-loop clients) had their TTFT p99 go
    /// from 360 to 461 ms with tail harm on, so it stays 3.
    pub wait_quantile: f64,
    /// Weight of the time other prompts' prefill would add to the request's decode there
    /// (`stall_ms`, from the backend's recent share of time in prefill; default 0, off). In the
    /// timed simulation (Mooncake traces, 4,096 KV blocks, 6 windows of 500) 0.8 took the e2e p99
    /// at the synthetic trace's loads from 0.90x / 0.85x the best baseline's to 0.84x / 0.82x, did
    /// nothing for the conversation trace's (1.06x / 1.08x), and raised the synthetic trace's TTFT
    /// p99 near saturation from 0.94x to 1.06x: for fleets whose SLO is on whole answers.
    pub stall_weight: f64,
    /// Weight of the time the request's prefill there would add to the requests arriving there
    /// after it (`arrival_harm_ms`: its prefill times `share / (1 - share)`, the backend's recent
    /// share of time in prefill; default 1). A prefix computed again on a busy backend is GPU
    /// time the requests behind it wait for, which the request's own time to first token does
    /// not show; the price grows with the backend's load, so an idle backend still takes a spill
    /// at no extra cost. On the real stack (2026-12-06, screens of 3 windows per load, each in one
    /// run with the default of before) 1 took conversation e2e p99 at x16 / x22.6 from 1,453 /
    /// 2,200 ms to 1,367 / 2,069 and TTFT p99 at x22.6 from 808 to 731 ms, and the synthetic
    /// trace's hit rate at x12 / x17 / x18.5 from 17.9 / 18.2 / 20.8% to 21.7 / 21.0 / 21.5% with
    /// TTFT p99 within 1%, but its e2e p99 at x18.5 went from 989 to 1,168 ms (windows 870-1,300
    /// against 821-1,243); in the timed simulation (conversation at x22.4, 6 windows) e2e p99 went
    /// from 2,232 to 2,139 ms. At 2 the real stack gave the same (2,067 ms at x22.6).
    pub arrival_harm_weight: f64,
    /// Weight of the time the request's prefill adds to the first token of requests still in
    /// their prefill there (`first_token_harm_ms`), on top of `harm_weight`'s share of it
    /// (default 0.3). vLLM computes a new prompt in the same steps as the prompts before it, so
    /// a long prompt sent where others are prefilling delays their first tokens, which is what
    /// the slowest requests' receipts showed (prefill 2x their own, in shared steps). In the
    /// timed simulation (4,096 KV blocks, 6 windows x 3 seeds) 0.3 took the Mooncake traces'
    /// TTFT p99 from 0.95x / 0.95x / 1.04x / 1.05x the best baseline's to 0.95x / 0.89x / 0.97x
    /// / 1.08x; 0.6 went further at three loads but once let a burst pile onto one backend
    /// (2.0x at the synthetic trace's saturated load).
    pub first_token_harm_weight: f64,
    /// Weight of the time the request's prefill would add to the answers running there that are
    /// predicted to end in the pool's tail of end-to-end times (`tail_harm_ms`: for each, how
    /// far the prefill pushes it past the `tail_quantile` of the end-to-end times the pool
    /// measured; default 0, off). In the timed simulation (Mooncake traces, the bench's own
    /// shapes over 12 and 3 windows of 1,000, and 6 of 500 and 9 of 400 at the usual shapes)
    /// 0.5 at the 0.95 quantile took e2e p99 to 0.92-0.98x of what it was without on the
    /// conversation trace and 0.86-0.95x on the synthetic one, TTFT p99 within 0.02x but for one
    /// saturated synthetic set (0.94x to 1.03x of the best baseline's); the receipts had shown
    /// the slowest 1% of answers spending 300-800 ms of their decode in other prompts' prefill,
    /// 97% of it from prompts that hit no cache there. On the real stack (`make bench-traces`,
    /// 2026-12-05, three windows of each trace paired) 0.5 took e2e p99 to 0.90x / 0.89x / 0.85x
    /// / 0.92x of the default's at conversation x8 / x16, synthetic x12 / x24, but TTFT p99 to
    /// 1.05x / 0.99x / 1.03x / 1.14x (synthetic x24 in every window, which the simulation did not
    /// show). The goodput benchmark (`make bench-goodput`, 2026-12-06, 3 windows per load) then
    /// showed what the e2e tail costs: near saturation every router broke on e2e p99 with TTFT p99
    /// far inside its bound. At 1 (the default since) the conversation trace held x20.7 (e2e p99
    /// 1,894 ms against a 2,004 ms bound; without tail harm 2,256 and 2,000 ms in two runs;
    /// cache-aware's highest sustained load) and the synthetic trace x17 (the baselines' best,
    /// x14.3), both breaking on e2e p99 one step up. At the bench's loads e2e p99 was 1,021 /
    /// 1,398 ms at conversation x8 / x16 and 627 ms at synthetic x12, 0.94x / 0.93x / 0.81x the
    /// best baseline's in a run of the same day, and TTFT p99 600 / 660 / 382 ms, 0.99x / 0.97x
    /// / 1.01x. The first token of the longest prompts, which set TTFT p99, is what tail harm can
    /// cost (at 1 with `wait_quantile` 2: 1.05x at conversation x8 in one run, 0.98x in another).
    pub tail_harm_weight: f64,
    /// The quantile of the pool's end-to-end times that `tail_harm_weight` protects answers from
    /// crossing (0.5 to 0.999).
    pub tail_quantile: f64,
    /// Weight of the prefill a backend's computed prefix of the prompt saves (`affinity_ms`),
    /// subtracted from its price where every wait before the prefill there (`queue_ms`) is at
    /// most `affinity_queue_ms` (default 0, off): a bonus for the prefix's holder above the
    /// shorter time to first token it already gets, and only while its queue is short. In the
    /// timed simulation (vLLM 0.34's 64-token blocks, 2026-12-06; Mooncake traces at the bench's
    /// loads and the usual ones, 3 to 12 windows, `SIM_RNG` 1-3) 4 at 250 ms took the hit rate
    /// from 1.3-5.8 points under cache_aware's to 0.2-1.6 under it and the conversation trace's
    /// e2e p99 down by 0.01-0.05x of the best baseline's on the windows it was chosen on, but on
    /// other windows it lengthened conversation moderate's e2e p99 (1.07x against 1.05x) and
    /// raised a TTFT p99 (synthetic x12 on 6 windows of 500: 1.04x against 1.01x), so it is off;
    /// `make bench-traces --policies` can screen it on the real stack.
    pub affinity_weight: f64,
    /// The longest wait before the prefill (ms) at which `affinity_weight` applies (default 250).
    pub affinity_queue_ms: f64,
}

impl Default for PredictedLatencyConfig {
    fn default() -> Self {
        PredictedLatencyConfig {
            ttft_weight: 1.0,
            decode_weight: 0.8,
            harm_weight: 0.4,
            wait_quantile: 3.0,
            stall_weight: 0.0,
            arrival_harm_weight: 1.0,
            first_token_harm_weight: 0.3,
            tail_harm_weight: 1.0,
            tail_quantile: 0.95,
            affinity_weight: 0.0,
            affinity_queue_ms: 250.0,
        }
    }
}

impl PredictedLatencyConfig {
    /// Checks the knobs.
    pub fn validate(&self) -> Result<(), String> {
        let ok = |x: f64| x.is_finite() && (0.0..=1e6).contains(&x);
        if !ok(self.ttft_weight)
            || !ok(self.decode_weight)
            || !ok(self.harm_weight)
            || !ok(self.stall_weight)
            || !ok(self.arrival_harm_weight)
            || !ok(self.first_token_harm_weight)
            || !ok(self.tail_harm_weight)
            || !ok(self.affinity_weight)
            || !ok(self.affinity_queue_ms)
        {
            return Err(
                "predicted_latency weights and affinity_queue_ms must be within [0, 1e6]".into(),
            );
        }
        if !(self.wait_quantile.is_finite() && (1.0..=100.0).contains(&self.wait_quantile)) {
            return Err("predicted_latency.wait_quantile must be within [1, 100]".into());
        }
        if !(self.tail_quantile.is_finite() && (0.5..=0.999).contains(&self.tail_quantile)) {
            return Err("predicted_latency.tail_quantile must be within [0.5, 0.999]".into());
        }
        if self.ttft_weight == 0.0 && self.decode_weight == 0.0 {
            return Err("predicted_latency weights must not both be 0".into());
        }
        Ok(())
    }
}

/// The predicted-latency policy.
#[derive(Debug, Clone, Copy)]
pub struct PredictedLatency {
    config: PredictedLatencyConfig,
}

impl PredictedLatency {
    /// A policy with the given knobs.
    pub fn new(config: PredictedLatencyConfig) -> Self {
        PredictedLatency { config }
    }
}

impl RoutingPolicy for PredictedLatency {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PredictedLatency
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
        // The price: the request's start there as ranked (the wait at its quantile, and any
        // re-send), then the weighted times and harms.
        let score = |i: usize| {
            let c = &cands[i];
            let start = c.ttft_ms + (cfg.wait_quantile - 1.0) * c.queue_ms + c.resend_ms;
            cfg.ttft_weight * start
                + cfg.decode_weight * c.decode_ms
                + cfg.harm_weight * c.harm_ms
                + cfg.stall_weight * c.stall_ms
                + cfg.arrival_harm_weight * c.arrival_harm_ms
                + cfg.first_token_harm_weight * c.first_token_harm_ms
                + cfg.tail_harm_weight * c.tail_harm_ms
                - if c.queue_ms <= cfg.affinity_queue_ms {
                    cfg.affinity_weight * c.affinity_ms
                } else {
                    0.0
                }
        };
        // Predictions this close are the same to the model's precision (an idle pool's backends
        // tie exactly): among them the one whose KV cache holds least goes first, so new
        // conversations spread over the pool instead of following a coin toss. The order is kept
        // within the band's first half, so nothing outside the band is overtaken.
        let best = (0..n).map(score).fold(f64::INFINITY, f64::min);
        let band = NEAR_TIE_MS;
        let key = |i: usize| {
            let s = score(i);
            if s <= best + band {
                best + 0.5 * band * cands[i].cache_fill.clamp(0.0, 1.0)
            } else {
                s
            }
        };
        let start = rng.below(n as u64) as usize;
        smallest_by(n, input.limit, start, &[], key, order);
        let best = &cands[order[0]];
        let most_cached = cands.iter().map(|c| c.cached_blocks).max().unwrap_or(0);
        if best.cached_blocks > 0 && best.cached_blocks == most_cached {
            DecisionKind::CacheHit
        } else if most_cached > best.cached_blocks {
            DecisionKind::Spill
        } else {
            DecisionKind::CacheMiss
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{candidates, identity};
    use super::super::Candidate;
    use super::*;
    use crate::random::SplitMix64;

    fn rank(c: &[Candidate]) -> (DecisionKind, Vec<usize>) {
        rank_with(c, 3, PredictedLatencyConfig::default())
    }

    /// The decision and the order of up to `limit` candidates under `config`.
    fn rank_with(
        c: &[Candidate],
        limit: usize,
        config: PredictedLatencyConfig,
    ) -> (DecisionKind, Vec<usize>) {
        let idx = identity(c.len());
        let input = DecisionInput {
            candidates: c,
            slot_index: &idx,
            key_hash: None,
            limit,
        };
        let mut order = Vec::new();
        let kind = PredictedLatency::new(config).rank(&input, &mut SplitMix64::new(7), &mut order);
        (kind, order)
    }

    #[test]
    fn a_backend_sent_ahead_to_keeps_the_request_unless_another_is_faster_by_more_than_a_resend() {
        let mut c = candidates(&[0.0; 3]);
        for (i, t) in [100.0, 130.0, 90.0].into_iter().enumerate() {
            c[i].ttft_ms = t;
        }
        // Sent ahead to slot 1: the others are a 50 ms re-send away.
        c[0].resend_ms = 50.0;
        c[2].resend_ms = 50.0;
        assert_eq!(rank(&c).1[0], 1);
        // A re-send of 20 ms: slot 2 is still faster by more than that.
        c[0].resend_ms = 20.0;
        c[2].resend_ms = 20.0;
        assert_eq!(rank(&c).1[0], 2);
    }

    #[test]
    fn ranks_by_predicted_time() {
        let mut c = candidates(&[0.0; 3]);
        for (i, t) in [300.0, 100.0, 200.0].into_iter().enumerate() {
            c[i].ttft_ms = t;
        }
        assert_eq!(rank(&c), (DecisionKind::CacheMiss, vec![1, 2, 0]));
    }

    #[test]
    fn near_ties_go_to_the_emptiest_cache_and_nothing_slower_overtakes() {
        let mut c = candidates(&[0.0; 4]);
        // Slot 0 is fastest by a hair but its cache is full; slot 2 ties with an empty cache;
        // slot 3 is empty but 10% slower, outside the band.
        for (i, (t, fill)) in [(100.0, 0.9), (100.5, 0.5), (101.0, 0.0), (110.0, 0.0)]
            .into_iter()
            .enumerate()
        {
            c[i].ttft_ms = t;
            c[i].cache_fill = fill;
        }
        assert_eq!(rank(&c).1, vec![2, 1, 0]);
        // Exactly tied, equally full: whichever, but only among the tied.
        for x in &mut c {
            x.cache_fill = 0.0;
        }
        let (_, order) = rank(&c);
        assert!(!order.contains(&3), "{order:?}");
    }

    #[test]
    fn a_long_prompt_avoids_the_backend_whose_requests_are_still_in_prefill() {
        let mut c = candidates(&[0.0; 2]);
        // Equal times; slot 0 has three requests before their first token, which a 200 ms
        // prefill there would delay by 200 ms each (weighted 0.3: 180 ms).
        for x in &mut c {
            x.ttft_ms = 300.0;
        }
        c[0].first_token_harm_ms = 600.0;
        assert_eq!(rank(&c).1, vec![1, 0]);
        // Unless the other costs more than that.
        c[1].ttft_ms = 500.0;
        assert_eq!(rank(&c).1, vec![0, 1]);
    }

    #[test]
    fn stays_with_the_cache_until_its_queue_costs_more() {
        let mut c = candidates(&[0.0; 2]);
        c[0].cached_blocks = 60;
        c[0].ttft_ms = 20.0;
        c[1].ttft_ms = 110.0;
        assert_eq!(rank(&c).0, DecisionKind::CacheHit);
        assert_eq!(rank(&c).1[0], 0);
        c[0].ttft_ms = 150.0; // a backlog of 130 ms at the holder
        assert_eq!(rank(&c), (DecisionKind::Spill, vec![1, 0]));
    }

    #[test]
    fn arrival_harm_keeps_a_prefix_on_its_holder_when_the_cold_backend_is_busy() {
        let mut c = candidates(&[0.0; 2]);
        // Slot 0 holds the prefix: 60 ms of prefill left, but 100 ms of queue (priced 3x);
        // slot 1 is cold: 300 ms of prefill and no queue.
        c[0].cached_blocks = 40;
        c[0].ttft_ms = 160.0;
        c[0].queue_ms = 100.0;
        c[1].ttft_ms = 300.0;
        let with = |c: &[Candidate], weight: f64| {
            let config = PredictedLatencyConfig {
                arrival_harm_weight: weight,
                ..Default::default()
            };
            rank_with(c, 2, config)
        };
        // Off: the cold backend starts sooner (300 against 160 + 200).
        assert_eq!(with(&c, 0.0).0, DecisionKind::Spill);
        // The cold backend spends 2/3 of its time in prefill: its 300 ms delay later arrivals
        // there by 600 ms, the holder's 60 ms (at 50%) by 60 ms.
        c[0].arrival_harm_ms = 60.0;
        c[1].arrival_harm_ms = 600.0;
        assert_eq!(with(&c, 0.0).1[0], 1, "off: unpriced");
        assert_eq!(with(&c, 1.0), (DecisionKind::CacheHit, vec![0, 1]));
        // An idle cold backend costs the later arrivals nothing: the spill stays.
        c[1].arrival_harm_ms = 0.0;
        assert_eq!(with(&c, 1.0).0, DecisionKind::Spill);
    }

    #[test]
    fn the_affinity_bonus_pulls_to_the_prefix_holder_only_while_its_queue_is_short() {
        let mut c = candidates(&[0.0; 2]);
        // Slot 0 holds 300 ms of the prompt's prefill and is predicted 50 ms slower to start
        // (its queue); slot 1 is cold.
        c[0].ttft_ms = 250.0;
        c[0].queue_ms = 100.0;
        c[0].affinity_ms = 300.0;
        c[1].ttft_ms = 0.0;
        let with = |weight: f64, queue_ms: f64| {
            let config = PredictedLatencyConfig {
                affinity_weight: weight,
                affinity_queue_ms: queue_ms,
                ..Default::default()
            };
            rank_with(&c, 2, config).1[0]
        };
        // Off by default: the cold backend starts sooner (250 + 2 x 100 ms of priced wait).
        assert_eq!(rank(&c).1[0], 1);
        assert_eq!(with(0.0, 250.0), 1);
        // On, with the holder's 100 ms wait within the bound: 4 x 300 ms outweighs it.
        assert_eq!(with(4.0, 250.0), 0);
        // A queue longer than the bound gets no bonus.
        assert_eq!(with(4.0, 50.0), 1);
    }

    #[test]
    fn decode_harm_counts() {
        let mut c = candidates(&[0.0; 2]);
        c[0].ttft_ms = 50.0;
        c[0].harm_ms = 500.0;
        c[1].ttft_ms = 80.0;
        assert_eq!(rank(&c).1[0], 1);
    }

    #[test]
    fn a_wait_is_priced_above_its_mean() {
        // About the same predicted time to first token: one mostly waiting in a queue, one mostly
        // its own prefill on an idle backend. The idle one wins (at the mean, the queue won).
        let mut c = candidates(&[0.0; 2]);
        c[0].ttft_ms = 400.0;
        c[0].queue_ms = 300.0;
        c[1].ttft_ms = 420.0;
        assert_eq!(rank(&c).1[0], 1);
        c[1].ttft_ms = 1_100.0;
        assert_eq!(rank(&c).1[0], 0, "a wait is not worth any prefill");
    }

    #[test]
    fn validation() {
        assert!(PredictedLatencyConfig::default().validate().is_ok());
        let bad = PredictedLatencyConfig {
            ttft_weight: 0.0,
            decode_weight: 0.0,
            harm_weight: 0.0,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = PredictedLatencyConfig {
            ttft_weight: f64::INFINITY,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = PredictedLatencyConfig {
            wait_quantile: 0.5,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        for tail_quantile in [0.3, 1.0, f64::NAN] {
            let bad = PredictedLatencyConfig {
                tail_quantile,
                ..Default::default()
            };
            assert!(bad.validate().is_err(), "{tail_quantile}");
        }
        let bad = PredictedLatencyConfig {
            tail_harm_weight: -1.0,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        for (affinity_weight, affinity_queue_ms) in [(-1.0, 250.0), (4.0, f64::NAN)] {
            let bad = PredictedLatencyConfig {
                affinity_weight,
                affinity_queue_ms,
                ..Default::default()
            };
            assert!(
                bad.validate().is_err(),
                "{affinity_weight} {affinity_queue_ms}"
            );
        }
    }
}
