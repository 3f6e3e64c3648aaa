//! A timed fleet simulation: the pool routing requests to simulated vLLM engines that run engine
//! steps in simulated time, so policies are compared on what users feel (time to first token,
//! end-to-end latency, throughput) and not only on cache hits.
//!
//! The engines, the workloads and the simulation loop are in `common::timed`. Workloads, both
//! closed loop (each client sends its next request when the previous one ends):
//! - multi-turn chat: users share one long system prompt and resend their growing history;
//! - shared-prefix groups: questions behind long group prompts, with new groups arriving all run;
//! - both again in `make bench`'s shapes at 64 clients with no think time (`bench_shapes_*`).
//!
//! Printed per policy; the assertions hold `predicted_latency` to the targets against
//! round robin, least load and consistent hashing.

mod common;

use common::timed::{
    averaged, simulate, Conditions, Groups, MultiTurn, Report, Speed, Workload, SIM_SPEED,
};
use routing_core::{BackendId, PolicyKind, SplitMix64};
use std::collections::HashMap;

const COMPARED: [PolicyKind; 5] = [
    PolicyKind::PredictedLatency,
    PolicyKind::CacheAware,
    PolicyKind::RoundRobin,
    PolicyKind::LeastLoad,
    PolicyKind::ConsistentHash,
];

fn compare(
    name: &str,
    kv_blocks: usize,
    make: &dyn Fn(u64) -> Box<dyn Workload>,
) -> HashMap<PolicyKind, Report> {
    compare_through(name, kv_blocks, Conditions::SINGLE, make)
}

fn compare_through(
    name: &str,
    kv_blocks: usize,
    gateway: Conditions,
    make: &dyn Fn(u64) -> Box<dyn Workload>,
) -> HashMap<PolicyKind, Report> {
    let speeds = [SIM_SPEED; 8];
    let mut out = HashMap::new();
    for policy in COMPARED {
        // 12 seeds: with 6, closed-loop throughput moved by 3% under other coin tosses
        // (`SIM_RNG`), as much as the margin `check` holds it to.
        let r = averaged(policy, make, &speeds, kv_blocks, gateway, 12);
        println!(
            "{name:>13} {:>17}: TTFT p50 {:7.1} p99 {:7.1} ms | e2e p50 {:7.1} p99 {:7.1} ms | \
             {:6.2} req/s | hit {:5.1}% | busiest/mean {:.2} | preempted {:.1}%",
            policy.as_str(),
            r.ttft_p50,
            r.ttft_p99,
            r.e2e_p50,
            r.e2e_p99,
            r.throughput,
            100.0 * r.hit_rate,
            r.busiest_over_mean,
            r.preempted
        );
        out.insert(policy, r);
    }
    out
}

/// The best of round robin, least load and consistent hashing on one figure.
fn best_baseline(r: &HashMap<PolicyKind, Report>, f: &dyn Fn(&Report) -> f64, lower: bool) -> f64 {
    let figures = [
        PolicyKind::RoundRobin,
        PolicyKind::LeastLoad,
        PolicyKind::ConsistentHash,
    ]
    .map(|p| f(&r[&p]));
    if lower {
        figures.into_iter().fold(f64::INFINITY, f64::min)
    } else {
        figures.into_iter().fold(0.0, f64::max)
    }
}

/// Guards what this simulation shows `predicted_latency` reaching (the targets are
/// stricter on multi-turn; see the closing note and the README): never slower at the median,
/// never less throughput, balanced, and a tail within `ttft_p99_ratio` of the best baseline.
fn check(name: &str, r: &HashMap<PolicyKind, Report>, ttft_p99_ratio: f64) {
    let ours = &r[&PolicyKind::PredictedLatency];
    let best_p99 = best_baseline(r, &|x| x.ttft_p99, true);
    assert!(
        ours.ttft_p99 <= ttft_p99_ratio * best_p99,
        "{name}: TTFT p99 {:.1} ms over {ttft_p99_ratio}x the best baseline's {best_p99:.1}",
        ours.ttft_p99
    );
    let best_e2e = best_baseline(r, &|x| x.e2e_p50, true);
    assert!(
        ours.e2e_p50 <= 1.02 * best_e2e,
        "{name}: e2e p50 {:.1} ms vs the best baseline's {best_e2e:.1}",
        ours.e2e_p50
    );
    let best_rate = best_baseline(r, &|x| x.throughput, false);
    assert!(
        ours.throughput >= 0.97 * best_rate,
        "{name}: {:.2} req/s vs the best baseline's {best_rate:.2}",
        ours.throughput
    );
    let best_hits = best_baseline(r, &|x| x.hit_rate, false);
    assert!(
        ours.hit_rate >= 0.95 * best_hits,
        "{name}: hit rate {:.3} vs the best baseline's {best_hits:.3}",
        ours.hit_rate
    );
    assert!(
        ours.busiest_over_mean <= 1.3,
        "{name}: busiest backend {:.2}x the mean",
        ours.busiest_over_mean
    );
    let rr = &r[&PolicyKind::RoundRobin];
    assert!(
        ours.ttft_p99 < 0.8 * rr.ttft_p99,
        "{name}: TTFT p99 {:.1} vs round robin's {:.1}",
        ours.ttft_p99,
        rr.ttft_p99
    );
}

#[test]
fn multi_turn_chat_on_time() {
    for kv_blocks in [2_048, 512] {
        let r = compare("multi-turn", kv_blocks, &|seed| {
            let mut rng = SplitMix64::new(1 + seed);
            Box::new(MultiTurn::new(32, 10, &mut rng))
        });
        // Measured (6 seeds): 0.90x and 0.91x the best baseline's p99 (least load) with 2,048
        // and 512 blocks; the floor is a cold system-prompt prefill, which no policy avoids on a user's
        // first turn.
        check("multi-turn", &r, 1.0);
    }
}

#[test]
fn shared_prefix_groups_on_time() {
    for kv_blocks in [2_048, 512] {
        let r = compare("shared-prefix", kv_blocks, &|seed| {
            let mut rng = SplitMix64::new(2 + 10 * seed);
            Box::new(Groups::new(96, 32, 1_500, &mut rng))
        });
        // Measured (6 seeds): 0.78x the best baseline's p99 (least load), 0.58x round robin's; 6% of the
        // requests open a new group, whose cold prefill (about 130 ms) floors every policy's p99.
        check("shared-prefix", &r, 1.0);
        let (ours, rr) = (
            &r[&PolicyKind::PredictedLatency],
            &r[&PolicyKind::RoundRobin],
        );
        assert!(
            ours.ttft_p99 <= 0.65 * rr.ttft_p99,
            "shared-prefix: TTFT p99 {:.1} vs round robin's {:.1}",
            ours.ttft_p99,
            rr.ttft_p99
        );
    }
}

/// A busy gateway's own delay (0 to 300 ms on each answer's first byte, as at 64 clients on two
/// cores, and 0 to 150 ms between a grant and the request reaching its engine, so the pool counts
/// requests the engine has not seen yet) is noise in what the time model learns from. Fitted without a prior, the prefill rates
/// swung between their bounds and conversations piled onto whichever backend looked fastest
/// (busiest backend 1.54x the mean, TTFT p99 2.6x the best baseline's); the shrunk fit keeps the
/// targets.
#[test]
fn a_busy_gateway_does_not_scatter_conversations() {
    let busy = Conditions {
        busy_jitter_ms: 300.0,
        dispatch_jitter_ms: 150.0,
        ..Conditions::SINGLE
    };
    let r = compare_through("busy gateway", 2_048, busy, &|seed| {
        let mut rng = SplitMix64::new(1 + seed);
        Box::new(MultiTurn::new(32, 10, &mut rng))
    });
    check("busy gateway", &r, 1.0);
}

#[test]
fn learned_rates_converge_on_a_slower_backend() {
    let slow = Speed {
        prefill_us_per_token: 300.0,
        step_ms: 30.0,
        per_seq_ms: 0.45,
    };
    let speeds = [SIM_SPEED, SIM_SPEED, SIM_SPEED, slow];
    // Round robin sends the slow backend its full share, so its rates are learned from many
    // releases (the model learns under every policy); four clients keep it from being
    // overloaded, where others' prefills interleaved with its decode steps would blur the rates.
    let mut rng = SplitMix64::new(3);
    let mut w = Groups::new(200, 4, 600, &mut rng);
    let (_, pools) = simulate(
        PolicyKind::RoundRobin,
        &mut w,
        &speeds,
        2_048,
        9,
        Conditions::SINGLE,
    );
    let pool = &pools[0];
    let fast = pool.backend(&BackendId::from("gpu-0")).unwrap().timing;
    let slow = pool.backend(&BackendId::from("gpu-3")).unwrap().timing;
    println!("fast {fast:?}\nslow {slow:?}");
    assert!(slow.observations >= 10, "{slow:?}");
    assert!(
        (slow.decode_ms_per_step / 30.0 - 1.0).abs() < 0.25,
        "slow backend's step cost learned as {:.1} ms",
        slow.decode_ms_per_step
    );
    assert!(
        (slow.prefill_us_per_token / 300.0 - 1.0).abs() < 0.35,
        "slow backend's prefill learned as {:.0} us/token",
        slow.prefill_us_per_token
    );
    assert!(
        (fast.decode_ms_per_step / 10.0 - 1.0).abs() < 0.25,
        "{fast:?}"
    );
    // Once learned, predicted_latency gives the slow backend less work than any fast one.
    let mut rng = SplitMix64::new(3);
    let mut w = Groups::new(200, 8, 600, &mut rng);
    let (_, pools) = simulate(
        PolicyKind::PredictedLatency,
        &mut w,
        &speeds,
        2_048,
        9,
        Conditions::SINGLE,
    );
    let pool = &pools[0];
    let served = |id: &str| {
        pool.backend(&BackendId::from(id))
            .unwrap()
            .timing
            .observations
    };
    assert!(
        (0..3).all(|b| served(&format!("gpu-{b}")) > 2 * served("gpu-3")),
        "fast backends served {:?}, the slow one {}",
        (0..3)
            .map(|b| served(&format!("gpu-{b}")))
            .collect::<Vec<_>>(),
        served("gpu-3")
    );
}

/// Chat beyond the fleet's memory: 64 users whose histories need about twice the KV cache of
/// 8 backends of 512 blocks, so every policy queues requests for memory in the engines and
/// recomputes evicted histories. The default keeps the best median, throughput and hit rate, but
/// its tail is not the best: measured 1.24x the best baseline's TTFT p99 (least load spreads the
/// queueing more evenly); the 0.8x is missed here, and the README says so. Admission
/// control (the gateway's queue) is the tool for this regime.
#[test]
fn chat_beyond_memory() {
    let r = compare("over memory", 512, &|seed| {
        let mut rng = SplitMix64::new(1 + seed);
        Box::new(MultiTurn::new(64, 10, &mut rng))
    });
    let ours = &r[&PolicyKind::PredictedLatency];
    let lower = |f: &dyn Fn(&Report) -> f64| best_baseline(&r, f, true);
    assert!(ours.ttft_p50 <= lower(&|x| x.ttft_p50), "{ours:?}");
    assert!(ours.e2e_p50 <= lower(&|x| x.e2e_p50), "{ours:?}");
    assert!(
        ours.throughput >= best_baseline(&r, &|x| x.throughput, false),
        "{ours:?}"
    );
    assert!(
        ours.hit_rate >= best_baseline(&r, &|x| x.hit_rate, false),
        "{ours:?}"
    );
    assert!(ours.ttft_p99 <= 1.35 * lower(&|x| x.ttft_p99), "{ours:?}");
}

/// Shared-prefix groups arriving open loop (Poisson) at about 75% and 90% of what the fleet serves
/// closed loop: the default keeps the best tail (measured 0.93x and 0.90x the best baseline's TTFT
/// p99; the floor is a new group's cold prefill) and the best median, hit rate and e2e.
#[test]
fn shared_prefix_groups_open_loop() {
    for rate in [40.0, 48.0] {
        let open = Conditions {
            open_rate: rate,
            ..Conditions::SINGLE
        };
        let r = compare_through(&format!("open {rate}/s"), 512, open, &|seed| {
            let mut rng = SplitMix64::new(2 + 10 * seed);
            Box::new(Groups::new(96, 64, 1_500, &mut rng))
        });
        check("shared-prefix open loop", &r, 1.0);
    }
}

/// `make bench`'s two workloads in its `closed-64` mode: 64 clients, no think time, 8 backends of
/// 512 blocks. Before decode timing took out interleaved prefill (and at decode weight 0.6), chat
/// piled first turns on the backends that held the system prompt and then moved half the
/// conversations on their second turn: TTFT p99 1.68x the best baseline (195 against 116 ms).
/// Measured now (6 seeds): chat 1.06x (the floor is the system prompt's cold prefill on every
/// backend, which a balanced placement pays 8 times in 320 requests: over 1%), prefix groups 0.33x.
/// The engines share a prefix only once it is computed, as vllm-sim does: the pool treating a
/// prefix recorded by a request still queued as a hit took prefix groups from 0.46x (engines
/// that shared at admission) to 0.87x, and counting it as computed only once that request's
/// prefill is under way (one engine step after its predicted start) brought it to 0.33x.
#[test]
fn bench_shapes_closed_64() {
    let closed = Conditions {
        think_ms: [0.0, 0.0],
        ..Conditions::SINGLE
    };
    let chat = compare_through("bench chat", 512, closed, &|seed| {
        let mut rng = SplitMix64::new(1 + seed);
        Box::new(MultiTurn::shaped(64, 5, 1_000, 48, Some(48), &mut rng))
    });
    let ours = &chat[&PolicyKind::PredictedLatency];
    let best = |f: &dyn Fn(&Report) -> f64, lower: bool| best_baseline(&chat, f, lower);
    assert!(
        ours.ttft_p99 <= 1.2 * best(&|x| x.ttft_p99, true),
        "{ours:?}"
    );
    assert!(
        ours.e2e_p50 <= 1.02 * best(&|x| x.e2e_p50, true),
        "{ours:?}"
    );
    assert!(
        ours.throughput >= 0.97 * best(&|x| x.throughput, false),
        "{ours:?}"
    );
    assert!(
        ours.hit_rate >= 0.98 * best(&|x| x.hit_rate, false),
        "{ours:?}"
    );
    assert!(ours.busiest_over_mean <= 1.15, "{ours:?}");
    let groups = compare_through("bench groups", 512, closed, &|seed| {
        let mut rng = SplitMix64::new(2 + 10 * seed);
        Box::new(Groups::bench(32, 64, 400, &mut rng))
    });
    check("bench groups", &groups, 0.6);
}
