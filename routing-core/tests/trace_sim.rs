//! Production traces in the timed simulation: windows of Mooncake's FAST'25 conversation trace
//! (real arrival times) and its synthetic trace (Poisson arrivals, 64% block reuse), lengths
//! scaled as the real bench scales them (`common::trace`), replayed on 8 simulated engines at a
//! moderate load and near round robin's saturation, through every policy.
//!
//! Printed per policy: TTFT p50/p90/p99, e2e p99, throughput, hit rate; and, for the default
//! policy's slowest 1% of requests, where their time went (the engine's queue, their prefill,
//! their decode) and what the router's receipt said (the predicted TTFT on the backend it chose
//! and on the best alternative, with both engines' queue and batch when it was granted); and for
//! its slowest 1% by e2e, their first token, decode and time per token against everyone's (the
//! conversation trace's: 79 tokens at 20-29 ms a token against 12-15, their steps carrying other
//! prompts' prefill).
//!
//! `trace_shapes_hold` is the bounded check `make test` runs (2 windows of 500 requests per trace
//! and load, about a second): the default's TTFT p99 at most 1.1x the best of round robin, least
//! load, consistent hashing and cache-aware, its TTFT p50 at most 0.9x, its throughput at least
//! 0.97x, on both traces at both loads (on vLLM 0.34's engine since 2026-12-06, below; the
//! figures until that paragraph are on the 16-token engine of before). Screening (6 windows of
//! 500, 4,096 blocks as the bench runs), TTFT p99 over the best baseline's at conversation moderate / saturated, synthetic
//! moderate / saturated: 1.00x / 0.94x / 1.28x / 1.07x before this round; 0.97x / 0.87x / 0.96x /
//! 0.94x now (9 windows of 400, to check the fit is not to the windows: 0.92x / 0.88x / 0.93x /
//! 1.03x). What the receipts of the slowest requests found, one fix each: idle backends' exact
//! ties went to a coin toss, not to the emptiest cache; a long prompt sent where others were
//! still in their prefill delayed their first tokens (first-token harm); a backend whose engine
//! ran behind the model kept getting traffic, two ways: its hidden wait was fitted as overhead,
//! which is not ranked on (now the excess over the pool's common overhead is ranked, and fitted
//! into its prefill rate), and its prompts were counted computed on schedule, so duplicates sent
//! there were priced as hits (now the wait before them is stretched by how late its predictions
//! run). The 0.85x is out of reach at the two moderate loads: the p99 of the requests'
//! own prefill, with every block seen before cached and no wait at all (printed as the floor), is
//! 0.90x and 0.95x the best baseline's there (0.77x and 0.72x at the saturated loads). The same
//! floor at the median (printed beside it) is 50 ms on the conversation trace, whose best baseline
//! at the moderate load is round robin at a p50 of 93 ms: the 0.6x, 56 ms, would leave 6 ms
//! for every wait and every prefix not cached in 4,096 blocks. Pricing the prefill a cached prefix
//! saves above its share of the time to first token (an affinity bonus, weights 0.5 to 4 of it,
//! screened on 2026-12-02) raised the hit rate from 12-13% to cache-aware's 16% and moved the p50
//! by 0.01x to 0.03x, but raised the conversation trace's e2e p99 on other windows (9 of 400: 1.04x
//! to 1.11x), so it was not adopted. Screened for the saturated loads' tail and not adopted either
//! (2026-12, means over 6 windows of 500, 9 of 400 and 7 of 500 under `SIM_RNG` 1-3; TTFT p99 at
//! the four shapes 0.94x / 0.89x / 0.95x / 0.95x as it stands): the harm terms pull a long prompt
//! away from the backend predicted fastest (the slowest 1% at synthetic saturated: 744 ms on the
//! chosen, 597 ms on one running 14.5 sequences), but they also keep everyone's prefill short (all
//! requests' mean 92 ms against 120 ms with none), so a guard letting them pull only within a
//! budget of the best predicted TTFT (0 to 300 ms, 0.25x to 0.4x of it, from 300 or 400 ms, with or
//! without the first-token harm) moved the tail to other requests: TTFT p99 at synthetic saturated
//! 0.92x to 1.07x against 0.94x on the same 6 windows of 500 and 1.00x to 1.09x against 1.03x on 9
//! of 400, e2e p99 at conversation saturated 1.08x to 1.44x (budgets of 300 down to 25 ms) against
//! 1.08x. Harm weights shrunk as the best predicted TTFT grows (`1 / (1 + best / 1 or 2 s)`), a
//! wait quantile of 3.5 or 4, harm 0.3 to 0.35 with first-token harm 0.35 to 0.4, or those weights
//! only when every candidate waits 35 to 100 ms (0.90x to 0.92x at synthetic saturated) each gained
//! at a saturated load only by costing the other one, the synthetic trace's saturated p50 (up to
//! 0.67x from 0.63x) or the conversation trace's e2e p99 (24 windows of 500: 0.85x / 1.04x at
//! conversation saturated became 0.84x to 0.87x / 1.06x to 1.07x). What helped here and not on
//! the real stack (same 5 runs): predicting that prompts arriving after a request share its
//! prefill's steps (the time model's `prefill_interference`, own prefill x recent share in
//! prefill, k = 1): the slowest 1% at conversation saturated were predicted 579 ms and measured
//! 730, then 737 and 724; TTFT p99 0.94x / 0.89x / 0.95x / 0.92x, synthetic saturated's e2e p99
//! 0.86x from 0.89x. On the real stack (`make bench-traces`, synthetic x24, three runs each way)
//! its TTFT p99 was within noise and its e2e p99 longer in all three pairs (2,105 to 2,571 ms
//! against 2,042 to 2,230), so it is off by default (`SIM_TIME_MODEL='{"prefill_interference":1}'`
//! screens it). Stretching by `share / (1 - share)` instead (k 0.1 to 2) or counting the stretch
//! in the harm terms too did not win without a cost elsewhere. Why the two disagreed, and how to
//! screen so they do not: the saturated synthetic shape here (x18.5, windows of 500) is a
//! lighter load than the bench's (x24 on the first 1,000 requests, 1.3 times it); replayed as
//! the bench replays it (`TRACE_WINDOW=1000 TRACE_LOAD=130 TRACE_SEEDS=1`) k = 1 lost here too
//! (e2e p99 2,236 against 1,960 ms, TTFT p99 659 against 604), and the gain over 6 windows of
//! 500 came from one window (per-window e2e p99 differences -266 to +228 ms). `SIM_RNG` only
//! relabels the backends for `predicted_latency`, so runs under it are not independent samples:
//! vary the windows instead, treat gains within the windows' spread as none, and screen the
//! bench's own window and load beside these shapes. (The engine here also differs from
//! vllm-sim's under budget pressure: vllm-sim counts decode tokens against the step's token
//! budget, admits new sequences only from what is left and not after a preemption, and caches a
//! prompt's blocks chunk by chunk.)
//! The e2e tail (2026-12-05): the slowest 1% by e2e now also shows how much of their decode went
//! to other prompts' prefill in their steps, from prompts that hit the cache there (a
//! conversation's next turn) and from the rest, and the e2e floor (the TTFT floor plus every later
//! token at one step alone). On the bench's shapes (12 windows of 1,000 of the conversation
//! trace) the slowest answers' stall was 296 ms (x8) and 820 ms (x16), 97-98% of it from prompts
//! that hit no cache there, not from their own conversation's turns; arrivals come in bursts 375
//! ms apart (the trace's timestamps at x8). The e2e floor's p99 is 901 ms at conversation x8
//! against the best baseline's 1,077 (0.84x): the 0.9x leaves 68 ms of stall for the
//! slowest answers. Pricing the prefill a prompt adds to answers predicted to end past the pool's
//! learned e2e tail (`tail_harm_weight`, `tail_quantile`) took e2e p99 to 0.97x / 0.95x / 0.83x
//! / 0.81x of the best baseline's at the four bench shapes (1.05x / 1.03x / 0.96x / 0.92x
//! without; weight 0.5 at 0.95) and 0.97x / 1.00x / 0.80x / 0.78x on 6 windows of 500 (1.06x /
//! 1.08x / 0.90x / 0.85x), TTFT p99 within 0.02x but for that set's synthetic saturated (1.03x
//! against 0.94x); weighting running sequences by their output over the mean, or counting only
//! those three times the mean, moved e2e p99 by a third as much and cost synthetic saturated
//! TTFT p99 up to 1.4x. The real stack followed the e2e gain (0.85x to 0.92x of the default's
//! e2e p99 over three paired windows) and paid TTFT p99 1.14x at synthetic x24, which this
//! simulation did not show (see the knob's doc), so it is off. `TRACE_STALLS=1` lists who held
//! up the slowest answers, `TRACE_EXPLAIN_ALL=1` explains the baselines' slowest too
//! (cache_aware's slowest answers at conversation x8 stalled 125 ms against the default's 241:
//! its load counts the tokens in flight, so cold prompts avoid the backends holding long answers;
//! the real stack agreed, 191 against 377 ms), `TRACE_ONLY=x8` (a substring of the shape's name)
//! runs one shape.
//! vLLM 0.34's engine (2026-12-06): the engines here are now vllm-sim's as the bench runs it
//! (`timed::EngineShape::VLLM_034`: 64-token blocks, 4,096 of them, so 4x the tokens; 2,048-token
//! steps that count decodes and admit the queue only from what is left; 256 sequences); the
//! gateway still hashes 16-token blocks and credits whole engine blocks. `TRACE_ENGINE=16` replays
//! the engine of before, `TRACE_ENGINE=blocks` that engine with 64-token blocks alone. The
//! default's ratios to the best baseline, TTFT p99 / e2e p99 at conversation moderate, saturated,
//! synthetic moderate, saturated (6 windows of 500) and at the bench's conversation x8, x16,
//! synthetic x12, x24 (3 windows of 1,000), and hit rate against cache_aware's:
//!
//! | engine          | usual shapes TTFT p99 / e2e p99            | bench shapes TTFT p99 / e2e p99            | hit, bench shapes (cache_aware)     |
//! |-----------------|--------------------------------------------|--------------------------------------------|-------------------------------------|
//! | 16-token        | .97 .87 .96 .94 / 1.06 1.08 .90 .85        | .94 .89 .98 .95 / 1.11 1.05 .96 .92        | 18.0 17.8 23.2 22.8 (19.5 18.2 26.9 25.9) |
//! | 64-token blocks | .96 .88 .96 .98 / 1.05 1.05 .90 .87        | .95 .91 .99 .96 / 1.11 1.10 .97 .95        | 14.6 14.9 23.9 22.6 (18.3 17.9 28.2 28.0) |
//! | vLLM 0.34       | .98 .96 1.01 1.10 / 1.04 1.10 .94 .96      | 1.00 .99 1.01 1.14 / 1.08 1.16 1.00 .93    | 14.8 15.5 23.4 23.0 (18.2 17.9 28.0 27.7) |
//! | vLLM 0.34, the bench's one window |                          | 1.00 .98 1.00 1.12 / 1.15 1.16 .97 .98     | 13.5 14.1 14.4 14.9 (17.9 17.5 17.0 16.9) |
//! | real bench      |                                            | .99 .96 1.02 1.07 / 1.05 1.15 .90 .83      | 14.5 14.5 14.4 12.8 (cache_aware 16.3-17.5) |
//!
//! So the 64-token blocks widened the default's hit gap to cache_aware at the conversation trace
//! by 0.6-2.6 points, and vLLM's batch limits moved its TTFT p99 up 0.02-0.18x: on the bench's
//! own window the simulation now shows the real bench's figures, e2e p99 at the synthetic trace
//! aside (the synthetic trace's later windows reuse more, hence the 3 windows' 23%).
//!
//! Screened on 2026-12-06 for issue 44 (conversation e2e p99 to 0.95x the best baseline's and hit
//! rate to cache_aware's, no TTFT p99 ratio raised). Means over `SIM_RNG` 1-3 of set A (the usual
//! shapes on 6 windows of 500, the bench's on 3 of 1,000); columns conversation moderate,
//! saturated, x8, x16, synthetic moderate, saturated, x12, x24; hit is the default's points under
//! cache_aware's (conversation moderate, saturated, x8, x16):
//!
//! | change (`SIM_PREDICTED_LATENCY` / `SIM_TIME_MODEL`) | TTFT p99                          | e2e p99                          | hit gap              |
//! |------------------------------------------|-----------------------------------|----------------------------------|----------------------|
//! | none (default)                           | .98 .96 1.00 .99 1.04 1.11 .99 1.13 | 1.07 1.10 1.09 1.12 .93 .94 .96 .95 | 1.9 2.2 3.5 2.2      |
//! | `step_token_budget` 2,048 (vLLM's)       | .98 .95 1.00 .99 1.04 1.08 .98 1.11 | 1.05 1.04 1.10 1.12 .92 .93 .96 .90 | 1.7 1.7 3.1 2.6      |
//! | `harm_weight` 0.6 / 0.8                  | up to 1.16 / 1.26 (synthetic)     | 1.10 1.10 1.07 1.11 / 1.08 1.04 1.11 1.11 | 1.1-3.4        |
//! | decode-stall harm: running decodes x own prefill, weight 0.2 / 0.4 / 0.8 | 1.20 / 1.26 / 1.31 at synthetic saturated | 1.06-1.12 / 1.06-1.10 / 1.04-1.09 | 1.1-3.9 |
//! | tokens in flight at the prefill rate, 0.05 / 0.1 / 0.2 | within 0.03 of none       | 1.08-1.15 (no gain)              | as none or wider     |
//! | `stall_weight` 0.8                       | .98 .98 1.00 .98 1.02 1.12 1.00 1.17 | 1.05 1.05 1.09 1.08 .88 .89 .87 .92 | 2.3-3.8        |
//! | `tail_harm_weight` 0.5                   | 1.00 .97 1.01 1.00 1.04 1.19 1.00 1.17 | 1.01 1.02 1.04 1.00 .86 .84 .87 .82 | 1.4-3.3       |
//! | affinity (saved prefill, only while the wait there is short) 1 at 150 ms | within 0.02 of none | 1.08 1.07 1.10 1.11              | 1.2 1.4 2.4 2.1      |
//! | affinity 4 at 250 ms                     | .98 .96 .99 .99 1.03 1.11 .99 1.07 | 1.04 1.06 1.06 1.08 .89 .90 .94 .87 | 0.7 0.3 1.2 1.0     |
//! | affinity 8 at 300 ms                     | .98 .97 1.01 .99 1.04 1.13 .98 1.06 | 1.07 1.05 1.07 1.09               | 0.1 -0.1 0.3 0.3     |
//! | affinity 4 at 300 ms + tail harm 0.5 at the 0.99 quantile | up to 1.08 / 1.19 at synthetic | 1.02 1.01 1.01 1.03       | 0.4-1.3              |
//!
//! The decode-stall harm and the tokens in flight were screening terms in `price.rs` and the
//! policy, removed since (the affinity bonus is `affinity_weight` at `affinity_queue_ms`). The
//! affinity bonus's wait bound relative to the prefill it saves (0.5x to 2x) did no better
//! than a fixed one. Affinity 4 at 250 ms was the only change that met the rule on set A, and, at
//! two decimals (x8 and x16 0.003 higher), on set B (9 windows of 400; the bench's conversation
//! shapes on 12 windows of 1,000): TTFT p99 .98 .97 1.00 .96 1.01 1.09 against .99 .98 1.00 .96
//! 1.02 1.10, e2e p99 1.05 1.07 1.03 1.04 against
//! 1.06 1.10 1.06 1.05, hit gap 0.2 0.3 1.1 0.7 against 1.3 1.2 3.0 2.1. On windows it was not
//! chosen on (set C: 7 of 700 at the usual shapes, the bench's loads on 6 of 500) it failed it:
//! conversation moderate's e2e p99 1.07 against 1.05 and synthetic x12's TTFT p99 1.04 against
//! 1.01 (hit gap 0.3-1.4 against 1.8-5.8). So nothing was adopted: the default is unchanged, and
//! the bonus is a knob, off (`predicted_latency.affinity_weight`, `affinity_queue_ms`), for the
//! real stack to judge (`make bench-traces` with `--policies
//! 'predicted_latency,predicted_latency+{"predicted_latency":{"affinity_weight":4}}'`). No change
//! came near 0.95x at the conversation trace's e2e p99; the nearest, tail harm, pays for it at the
//! synthetic trace's saturated TTFT p99, as the real stack showed on 2026-12-05.
//! `TRACE_BENCH=1` replays the bench's own shapes instead (below), `TRACE_SEEDS`, `TRACE_WINDOW`, `TRACE_LOAD` (percent), `TRACE_SCALE`, `TRACE_KV`, `TRACE_SHOW`
//! (slow requests to print), `SIM_RNG` (other coin tosses), `SIM_VERBOSE` (each window's p99),
//! `SIM_TIMING` (the default's learned rates, overhead, backlog and leases beside each engine's
//! queue, batch and memory, four times a simulated second), `SIM_PREDICTED_LATENCY` and
//! `SIM_TIME_MODEL` (knobs as JSON) widen it for screening; `SIM_ROUTE_AHEAD` replays each
//! request's `ROUTE_AHEAD` guess (one isolate's `routing_core::pool::guess`) and tells the pool of
//! the fetch sent ahead, with `SIM_RTT_MS` (default 50) as the re-send's round trip, and prints
//! how many were sent ahead and kept and the TTFT with the lease call's round trip added unless
//! kept:
//! `TRACE_SEEDS=6 cargo test --release -q -p routing-core --test trace_sim -- --nocapture`.

mod common;

use common::timed::{
    averaged, pct, sim_rtt_ms, Conditions, EngineShape, Record, Report, Workload, BLOCK, SIM_SPEED,
};
use common::trace::{load, Trace, TraceRequest};
use routing_core::PolicyKind;
use std::collections::HashMap;

const POLICIES: [PolicyKind; 5] = [
    PolicyKind::PredictedLatency,
    PolicyKind::CacheAware,
    PolicyKind::LeastLoad,
    PolicyKind::ConsistentHash,
    PolicyKind::RoundRobin,
];
const BASELINES: [PolicyKind; 4] = [
    PolicyKind::CacheAware,
    PolicyKind::LeastLoad,
    PolicyKind::ConsistentHash,
    PolicyKind::RoundRobin,
];
/// 512-token trace blocks become 32 tokens (2 simulation blocks).
const SCALE: u64 = 16;
/// KV blocks per engine, as `make bench` runs vllm-sim (`bench/config/traces.json`): of 64
/// tokens, 262,144 tokens, about 300 scaled prompts of the conversation trace (65,536 tokens with
/// the 16-token blocks before vLLM 0.34).
const KV_BLOCKS: usize = 4_096;

/// The engines' shape: vllm-sim's with no flags, as the bench runs it (64-token blocks, 2,048-token
/// steps, 256 sequences), unless `TRACE_ENGINE=16` (the simulation's engine before, 16-token
/// blocks, 8,192-token steps, 64 sequences) or `TRACE_ENGINE=blocks` (that engine with 64-token
/// blocks alone).
fn engine() -> EngineShape {
    match std::env::var("TRACE_ENGINE").as_deref() {
        Ok("16") => EngineShape::SIM16,
        Ok("blocks") => EngineShape {
            block_tokens: 64,
            ..EngineShape::SIM16
        },
        _ => EngineShape::VLLM_034,
    }
}

/// One trace at one load: its file, how much faster than real time, and a name.
struct Shape {
    name: &'static str,
    file: &'static str,
    speedup: f64,
}

/// Moderate and near-saturation loads for round robin on 8 engines (measured: round robin's
/// TTFT p50 stays near an idle prefill at the first and grows several-fold at the second).
const SHAPES: [Shape; 4] = [
    Shape {
        name: "conversation moderate",
        file: "mooncake_conversation_trace",
        speedup: 11.5,
    },
    Shape {
        name: "conversation saturated",
        file: "mooncake_conversation_trace",
        speedup: 17.0,
    },
    Shape {
        name: "synthetic moderate",
        file: "mooncake_synthetic_trace",
        speedup: 12.5,
    },
    Shape {
        name: "synthetic saturated",
        file: "mooncake_synthetic_trace",
        speedup: 18.5,
    },
];

/// The shapes `make bench-traces` replays (`bench/config/traces.json`): its speed-ups, on the first
/// 1,000 requests of each trace. `TRACE_BENCH=1` replays these instead (one window of 1,000 unless
/// `TRACE_WINDOW` / `TRACE_SEEDS` say otherwise) and reports without asserting, so a change is
/// screened on what the bench will measure as well as on the shapes above. On the build of
/// 2026-12-04 the default's ratios to the best baseline here (TTFT p99 / p50 / e2e p99 at
/// conversation x8, x16, synthetic x12, x24: 1.00 / 0.85 / 1.22, 0.81 / 0.70 / 1.05, 0.98 / 0.90
/// / 0.97, 1.12 / 0.45 / 0.93) were those of the real bench's run of the same day
/// (`bench/results/2026-12-04-traces-final/`: 1.00 / 0.90 / 1.13, 0.83 / 0.76 / 1.16, 0.99 /
/// 0.94 / 0.98, 0.99 / 0.60 / 0.91) within about 0.1, synthetic x24's TTFT p99 aside.
const BENCH_SHAPES: [Shape; 4] = [
    Shape {
        name: "bench: conversation x8",
        file: "mooncake_conversation_trace",
        speedup: 8.0,
    },
    Shape {
        name: "bench: conversation x16",
        file: "mooncake_conversation_trace",
        speedup: 16.0,
    },
    Shape {
        name: "bench: synthetic x12",
        file: "mooncake_synthetic_trace",
        speedup: 12.0,
    },
    Shape {
        name: "bench: synthetic x24",
        file: "mooncake_synthetic_trace",
        speedup: 24.0,
    },
];

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn scale() -> u64 {
    env("TRACE_SCALE", SCALE as usize) as u64
}

/// The shape's speedup, times `TRACE_LOAD` percent when set (for calibrating).
fn speedup(shape: &Shape) -> f64 {
    shape.speedup * env("TRACE_LOAD", 100) as f64 / 100.0
}

/// Each seed replays its own window of the trace (consecutive windows from the start).
fn run(
    shape: &Shape,
    all: &[TraceRequest],
    window: usize,
    seeds: u64,
) -> HashMap<PolicyKind, Report> {
    let make = |seed: u64| -> Box<dyn Workload> {
        Box::new(Trace::window(
            all,
            seed as usize * window,
            window,
            scale(),
            speedup(shape),
        ))
    };
    let probe = Trace::window(all, 0, window, scale(), speedup(shape));
    let (p, o) = probe.mean_lengths();
    let floor_at = |q: f64| {
        (0..seeds)
            .map(|seed| {
                let w = Trace::window(all, seed as usize * window, window, scale(), 1.0);
                pct(&mut w.floors(SIM_SPEED, engine().block_tokens), q)
            })
            .sum::<f64>()
            / seeds as f64
    };
    let (floor, floor_p50) = (floor_at(0.99), floor_at(0.5));
    let e2e_floor = (0..seeds)
        .map(|seed| {
            let w = Trace::window(all, seed as usize * window, window, scale(), 1.0);
            pct(&mut w.e2e_floors(SIM_SPEED, engine().block_tokens), 0.99)
        })
        .sum::<f64>()
        / seeds as f64;
    println!(
        "{}: {window} requests a window, {seeds} windows, {:.1} req/s, mean prompt {p:.0} / output {o:.0} tokens; \
         TTFT floor (own prefill, every block seen before cached) p50 {floor_p50:.0} / p99 {floor:.0} ms, \
         e2e floor (and its tokens decoded alone) p99 {e2e_floor:.0} ms",
        shape.name,
        probe.rate()
    );
    let speeds = [SIM_SPEED; 8];
    let mut out = HashMap::new();
    for policy in POLICIES {
        let r = averaged(
            policy,
            &make,
            &speeds,
            env("TRACE_KV", KV_BLOCKS),
            Conditions {
                engine: engine(),
                ..Conditions::SINGLE
            },
            seeds,
        );
        let e2e_p99 = r.e2e_p99;
        println!(
            "  {:>17}: TTFT p50 {:7.1} p90 {:7.1} p99 {:7.1} ms | e2e p99 {e2e_p99:7.1} ms | \
             {:6.2} req/s | hit {:5.1}% | busiest/mean {:.2} | preempted {:.1}%",
            policy.as_str(),
            r.ttft_p50,
            r.ttft_p90,
            r.ttft_p99,
            r.throughput,
            100.0 * r.hit_rate,
            r.busiest_over_mean,
            r.preempted
        );
        let sent = r.records.iter().filter(|x| x.ahead.is_some()).count();
        let kept = r.records.iter().filter(|x| x.ahead == Some(true)).count();
        // At the client, past the one round trip every request pays: the time to first token,
        // plus the lease call's round trip unless the fetch went ahead and was kept.
        let rtt = sim_rtt_ms();
        let mut client: Vec<f64> = r
            .records
            .iter()
            .map(|x| x.ttft_ms + if x.ahead == Some(true) { 0.0 } else { rtt })
            .collect();
        println!(
            "  {:>17}  guesses (one isolate{}): {:.1}% of requests sent ahead, {:.1}% of those kept \
             ({:.1}% of requests sent in vain); TTFT + lease round trip ({rtt:.0} ms) unless kept: \
             p50 {:.1} p99 {:.1} ms",
            "",
            if std::env::var("SIM_ROUTE_AHEAD").is_ok() { ", ROUTE_AHEAD" } else { ", scored only" },
            100.0 * sent as f64 / r.records.len().max(1) as f64,
            100.0 * kept as f64 / sent.max(1) as f64,
            100.0 * (sent - kept) as f64 / r.records.len().max(1) as f64,
            pct(&mut client.clone(), 0.5),
            pct(&mut client, 0.99),
        );
        out.insert(policy, r);
    }
    explain(&out[&PolicyKind::PredictedLatency]);
    if env("TRACE_EXPLAIN_ALL", 0) == 1 {
        for p in BASELINES {
            println!("  {}:", p.as_str());
            explain(&out[&p]);
        }
    }
    out
}

/// Where the slowest 1% of the default's requests spent their time, and what the receipts said.
fn explain(r: &Report) {
    let mut ttfts: Vec<f64> = r.records.iter().map(|x| x.ttft_ms).collect();
    if ttfts.is_empty() {
        return;
    }
    let cut = pct(&mut ttfts, 0.99);
    let slow: Vec<&Record> = r.records.iter().filter(|x| x.ttft_ms >= cut).collect();
    let n = slow.len() as f64;
    let mean = |f: &dyn Fn(&Record) -> f64| slow.iter().map(|x| f(x)).sum::<f64>() / n;
    let all_n = r.records.len() as f64;
    let all_mean = |f: &dyn Fn(&Record) -> f64| r.records.iter().map(f).sum::<f64>() / all_n;
    println!(
        "    slowest 1% ({} requests, TTFT >= {cut:.0} ms): queue {:.0} + prefill {:.0} ms, decode {:.0} ms; \
         prompt {:.0}, uncached {:.0} tokens",
        slow.len(),
        mean(&|x| x.queue_ms),
        mean(&|x| x.prefill_ms),
        mean(&|x| x.decode_ms),
        mean(&|x| x.prompt as f64),
        mean(&|x| x.uncached as f64),
    );
    println!(
        "    receipts: predicted {:.0} ms on the chosen (measured {:.0}), {:.0} ms on the best alternative; \
         chosen engine queue {:.1} / batch {:.1}, alternative's {:.1} / {:.1}",
        mean(&|x| x.predicted_ttft_ms),
        mean(&|x| x.ttft_ms),
        mean(&|x| x.alt_predicted_ttft_ms),
        mean(&|x| x.chosen_state.0 as f64),
        mean(&|x| x.chosen_state.1 as f64),
        mean(&|x| x.alt_state.0 as f64),
        mean(&|x| x.alt_state.1 as f64),
    );
    println!(
        "    all requests: queue {:.0} + prefill {:.0} ms, predicted {:.0} vs measured {:.0} ms TTFT",
        all_mean(&|x| x.queue_ms),
        all_mean(&|x| x.prefill_ms),
        all_mean(&|x| x.predicted_ttft_ms),
        all_mean(&|x| x.ttft_ms),
    );
    let mut e2es: Vec<f64> = r.records.iter().map(|x| x.e2e_ms).collect();
    let e2e_cut = pct(&mut e2es, 0.99);
    let long: Vec<&Record> = r.records.iter().filter(|x| x.e2e_ms >= e2e_cut).collect();
    let m = long.len() as f64;
    let lmean = |f: &dyn Fn(&Record) -> f64| long.iter().map(|x| f(x)).sum::<f64>() / m;
    // Others' prefill in their decode's steps, from prompts that hit the cache there (a
    // conversation's next turn) or not.
    let by_lease: HashMap<u64, &Record> = r.records.iter().map(|x| (x.lease, x)).collect();
    let hit = |lease: &u64| {
        by_lease.get(lease).is_some_and(|c| {
            c.prompt.saturating_sub(c.uncached) > 2 * BLOCK.max(engine().block_tokens)
        })
    };
    let stalled = |x: &Record, hits: bool| {
        x.stalled_by
            .iter()
            .filter(|(l, _)| hit(l) == hits)
            .map(|(_, ms)| ms)
            .sum::<f64>()
    };
    println!(
        "    slowest 1% by e2e ({} requests, >= {e2e_cut:.0} ms): TTFT {:.0} + decode {:.0} ms for {:.0} tokens \
         ({:.1} ms a token; all requests {:.1}); of the decode, others' prefill {:.0} ms from prompts hitting \
         the cache there, {:.0} ms from others; prompt {:.0}, uncached {:.0}",
        long.len(),
        lmean(&|x| x.ttft_ms),
        lmean(&|x| x.decode_ms),
        lmean(&|x| f64::from(x.output)),
        lmean(&|x| x.decode_ms / f64::from(x.output.max(2) - 1)),
        all_mean(&|x| x.decode_ms / f64::from(x.output.max(2) - 1)),
        lmean(&|x| stalled(x, true)),
        lmean(&|x| stalled(x, false)),
        lmean(&|x| x.prompt as f64),
        lmean(&|x| x.uncached as f64),
    );
    if env("TRACE_STALLS", 0) == 1 {
        for x in long.iter().take(12) {
            println!(
                "      e2e {:.0} at {:.0} on {} out {} ttft {:.0}: stalled by",
                x.e2e_ms, x.arrival_ms, x.backend, x.output, x.ttft_ms
            );
            let mut agg: Vec<(u64, f64)> = Vec::new();
            for &(l, ms) in &x.stalled_by {
                match agg.iter_mut().find(|a| a.0 == l) {
                    Some(a) => a.1 += ms,
                    None => agg.push((l, ms)),
                }
            }
            for (l, ms) in agg.iter().filter(|a| a.1 >= 20.0) {
                if let Some(c) = by_lease.get(l) {
                    println!(
                        "        {ms:4.0} ms: sent {:+.0} ms after, prompt {} uncached {}, predicted {:.0} here vs {:.0} on {:?}; states here {:?} alt {:?}",
                        c.arrival_ms - x.arrival_ms, c.prompt, c.uncached, c.predicted_ttft_ms,
                        c.alt_predicted_ttft_ms, c.alt, c.chosen_state, c.alt_state
                    );
                }
            }
        }
    }
    for x in slow.iter().take(env("TRACE_SHOW", 0)) {
        println!("      {x:?}");
    }
}

/// The lowest of the baselines' figure.
fn best(r: &HashMap<PolicyKind, Report>, f: &dyn Fn(&Report) -> f64) -> f64 {
    BASELINES
        .iter()
        .map(|p| f(&r[p]))
        .fold(f64::INFINITY, f64::min)
}

#[test]
fn trace_shapes_hold() {
    let bench = env("TRACE_BENCH", 0) == 1;
    let (shapes, window, seeds) = match bench {
        true => (
            &BENCH_SHAPES,
            env("TRACE_WINDOW", 1_000),
            env("TRACE_SEEDS", 1),
        ),
        false => (&SHAPES, env("TRACE_WINDOW", 500), env("TRACE_SEEDS", 2)),
    };
    let seeds = seeds as u64;
    let mut traces: HashMap<&str, Vec<TraceRequest>> = HashMap::new();
    let mut failures = Vec::new();
    for shape in shapes {
        let all = traces.entry(shape.file).or_insert_with(|| load(shape.file));
        if !shape
            .name
            .contains(&std::env::var("TRACE_ONLY").unwrap_or_default())
        {
            continue;
        }
        // As many windows as asked for and the trace holds (the synthetic trace: 3 of 1,000).
        let seeds = seeds.min((all.len() / window).max(1) as u64);
        let r = run(shape, all, window, seeds);
        let ours = &r[&PolicyKind::PredictedLatency];
        let p99 = best(&r, &|x| x.ttft_p99);
        let p50 = best(&r, &|x| x.ttft_p50);
        let e2e = best(&r, &|x| x.e2e_p99);
        let rate = BASELINES
            .iter()
            .map(|p| r[p].throughput)
            .fold(0.0, f64::max);
        println!(
            "  => TTFT p99 {:.2}x, p50 {:.2}x, e2e p99 {:.2}x, throughput {:.3}x the best baseline",
            ours.ttft_p99 / p99,
            ours.ttft_p50 / p50,
            ours.e2e_p99 / e2e,
            ours.throughput / rate
        );
        if bench {
            continue;
        }
        if ours.ttft_p99 > 1.1 * p99 {
            failures.push(format!(
                "{}: TTFT p99 {:.0} over 1.1x the best baseline's {p99:.0}",
                shape.name, ours.ttft_p99
            ));
        }
        if ours.ttft_p50 > 0.9 * p50 {
            failures.push(format!(
                "{}: TTFT p50 {:.0} over 0.9x the best baseline's {p50:.0}",
                shape.name, ours.ttft_p50
            ));
        }
        if ours.throughput < 0.97 * rate {
            failures.push(format!(
                "{}: throughput {:.2} under the best baseline's {rate:.2}",
                shape.name, ours.throughput
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
