//! A deterministic fleet simulation: a pool of simulated vLLM servers under a shared-prefix
//! workload, in simulated time with a seeded random source, comparing policies.
//!
//! Workload: chat requests whose system message is one of `GROUPS` documents of about 1,000
//! tokens (picked with Zipf popularity, so a few documents are hot) followed by a unique
//! question of about 128 tokens, and 128 output tokens; Poisson arrivals at a rate that keeps
//! about `TARGET_CONCURRENCY` requests in flight per backend.
//!
//! Each simulated server has a real prefix cache: an LRU of block hashes as large as its KV
//! capacity (the same number of blocks the pool's affinity table assumes), filled at prefill in
//! vLLM's order. A request hits the longest prefix of its blocks in the cache of the server it
//! is sent to; its service time is `uncached tokens * PREFILL_MS_PER_TOKEN + output tokens *
//! DECODE_MS_PER_TOKEN`. Leases are released when the request completes.
//!
//! Upper bound on the prefix hit rate: no routing can hit a block that was never computed before
//! anywhere, so the hit rate of a single unbounded cache that has seen every earlier request
//! bounds every policy. It is computed alongside each run.

mod common;

use common::{text, ServerCache};
use routing_core::request::prompt::{request_features, FeatureConfig};
use routing_core::{
    BackendId, Capacity, DecisionKind, Outcome, PolicyKind, RandomSource, RequestFeatures,
    SplitMix64,
};
use serde_json::json;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

const BACKENDS: usize = 8;
const GROUPS: usize = 24;
const ZIPF_S: f64 = 0.9;
const DOC_BYTES: usize = 4_096;
const QUESTION_BYTES: usize = 512;
const OUTPUT_TOKENS: u32 = 128;
const KV_BLOCKS: u64 = 512;
const PREFILL_MS_PER_TOKEN: f64 = 0.5;
const DECODE_MS_PER_TOKEN: f64 = 20.0;
const TARGET_CONCURRENCY: f64 = 8.0;
const REQUESTS: usize = 8_000;
const SEED: u64 = 0x5eed;

struct Workload {
    requests: Vec<(u64, RequestFeatures)>,
}

fn workload() -> Workload {
    let mut rng = SplitMix64::new(SEED);
    let docs: Vec<String> = (0..GROUPS).map(|_| text(&mut rng, DOC_BYTES)).collect();
    let weights: Vec<f64> = (1..=GROUPS)
        .map(|k| 1.0 / (k as f64).powf(ZIPF_S))
        .collect();
    let total: f64 = weights.iter().sum();
    let prompt_tokens = ((DOC_BYTES + QUESTION_BYTES) / 4) as f64;
    let service_ms =
        prompt_tokens * PREFILL_MS_PER_TOKEN * 0.3 + f64::from(OUTPUT_TOKENS) * DECODE_MS_PER_TOKEN;
    let mean_gap_ms = service_ms / (TARGET_CONCURRENCY * BACKENDS as f64);
    let mut now = 0.0f64;
    let mut requests = Vec::with_capacity(REQUESTS);
    for i in 0..REQUESTS {
        let mut pick = rng.unit() * total;
        let mut group = 0;
        while group + 1 < GROUPS && pick >= weights[group] {
            pick -= weights[group];
            group += 1;
        }
        let body = json!({
            "model": "m",
            "max_tokens": OUTPUT_TOKENS,
            "messages": [
                {"role": "system", "content": docs[group]},
                {"role": "user", "content": text(&mut rng, QUESTION_BYTES)}
            ]
        });
        let mut f = request_features(&body, &|_| None, &FeatureConfig::default()).unwrap();
        f.request_id = format!("r{i}");
        // Only consistent_hash reads the key: the document, as a RAG gateway would send it.
        f.routing_key = Some(format!("doc-{group}"));
        now += -(1.0 - rng.unit()).ln() * mean_gap_ms;
        requests.push((now as u64, f));
    }
    Workload { requests }
}

#[derive(Debug)]
struct Report {
    hit_rate: f64,
    upper_bound: f64,
    requests_per_backend: Vec<u64>,
    busiest_over_mean: f64,
    /// Mean over arrivals of the largest in-flight lease count on any backend.
    mean_max_in_flight: f64,
    /// Mean over arrivals of the mean in-flight lease count.
    mean_in_flight: f64,
    spills: u64,
}

fn run(policy: PolicyKind, w: &Workload) -> Report {
    let capacity = Capacity {
        kv_blocks: KV_BLOCKS,
        block_size: 16,
        ..Capacity::default()
    };
    let mut pool = common::fleet(policy, BACKENDS, capacity);
    let mut caches: Vec<ServerCache> = (0..BACKENDS)
        .map(|_| ServerCache::new(KV_BLOCKS as usize))
        .collect();
    let ids: Vec<BackendId> = (0..BACKENDS)
        .map(|b| BackendId::from(format!("gpu-{b}")))
        .collect();
    let index: HashMap<String, usize> = (0..BACKENDS).map(|b| (format!("gpu-{b}"), b)).collect();
    let mut rng = SplitMix64::new(SEED ^ 0xabc);
    let mut completions: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut hit_blocks, mut bound_blocks, mut total_blocks) = (0u64, 0u64, 0u64);
    let mut per_backend = vec![0u64; BACKENDS];
    let (mut sum_max, mut sum_mean, mut spills) = (0u64, 0.0f64, 0u64);
    for (at, f) in &w.requests {
        while let Some(Reverse((end, lease))) = completions.peek().copied() {
            if end > *at {
                break;
            }
            completions.pop();
            assert!(pool.release(lease, &Outcome::from_status(200), end));
        }
        let in_flight: Vec<u32> = ids
            .iter()
            .map(|id| pool.in_flight(id).unwrap().leases)
            .collect();
        sum_max += u64::from(*in_flight.iter().max().unwrap());
        sum_mean += in_flight.iter().map(|&x| f64::from(x)).sum::<f64>() / BACKENDS as f64;

        let grant = pool.acquire(f, *at, &mut rng).unwrap();
        if grant.decision == Some(DecisionKind::Spill) {
            spills += 1;
        }
        let b = index[grant.backend.as_str()];
        per_backend[b] += 1;
        let blocks = &f.block_hashes;
        let hits = caches[b].hits(blocks);
        caches[b].prefill(blocks);
        hit_blocks += hits as u64;
        total_blocks += blocks.len() as u64;
        bound_blocks += blocks.iter().take_while(|x| seen.contains(x)).count() as u64;
        seen.extend(blocks.iter().copied());
        let uncached = f64::from(f.prompt_tokens) - (hits * 16) as f64;
        let service = uncached.max(0.0) * PREFILL_MS_PER_TOKEN
            + f64::from(f.max_tokens) * DECODE_MS_PER_TOKEN;
        completions.push(Reverse((*at + service as u64, grant.lease_id)));
    }
    pool.check_counters().unwrap();
    let mean = per_backend.iter().sum::<u64>() as f64 / BACKENDS as f64;
    let n = w.requests.len() as f64;
    Report {
        hit_rate: hit_blocks as f64 / total_blocks as f64,
        upper_bound: bound_blocks as f64 / total_blocks as f64,
        busiest_over_mean: *per_backend.iter().max().unwrap() as f64 / mean,
        requests_per_backend: per_backend,
        mean_max_in_flight: sum_max as f64 / n,
        mean_in_flight: sum_mean / n,
        spills,
    }
}

#[test]
fn fleet_simulation() {
    let w = workload();
    let cache_aware = run(PolicyKind::CacheAware, &w);
    let random = run(PolicyKind::Random, &w);
    let p2c = run(PolicyKind::PowerOfTwo, &w);
    let least = run(PolicyKind::LeastLoad, &w);
    let hash = run(PolicyKind::ConsistentHash, &w);
    for (name, r) in [
        ("cache_aware", &cache_aware),
        ("random", &random),
        ("power_of_two", &p2c),
        ("least_load", &least),
        ("consistent_hash", &hash),
    ] {
        println!(
            "{name:>15}: hit rate {:.3} (bound {:.3}, {:.1}% of it), busiest/mean requests {:.3}, \
             mean in flight {:.2}, mean max in flight {:.2}, spills {}, per backend {:?}",
            r.hit_rate,
            r.upper_bound,
            100.0 * r.hit_rate / r.upper_bound,
            r.busiest_over_mean,
            r.mean_in_flight,
            r.mean_max_in_flight,
            r.spills,
            r.requests_per_backend,
        );
    }
    assert!(
        cache_aware.hit_rate >= 0.9 * cache_aware.upper_bound,
        "cache_aware hit rate {:.3} below 90% of the bound {:.3}",
        cache_aware.hit_rate,
        cache_aware.upper_bound
    );
    assert!(
        cache_aware.busiest_over_mean <= 1.3,
        "cache_aware busiest backend at {:.3}x the mean",
        cache_aware.busiest_over_mean
    );
    assert!(cache_aware.hit_rate > random.hit_rate);
    assert!(
        p2c.mean_max_in_flight < random.mean_max_in_flight,
        "power_of_two max load {:.2} not below random's {:.2}",
        p2c.mean_max_in_flight,
        random.mean_max_in_flight
    );
}
