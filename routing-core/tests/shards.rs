//! Coordinator shards through the public API: one shard's load report steers another's choices,
//! a report that grows stale stops counting, and leases and counters return to zero on every
//! shard. The cost of sharding on whole workloads is measured in `shard_sim.rs`.

mod common;

use routing_core::pool::shard::{shard_for, STALE_AFTER_INTERVALS};
use routing_core::request::prompt::{request_features, FeatureConfig};
use routing_core::{
    BackendId, Capacity, Lifecycle, Outcome, PolicyKind, Pool, RequestFeatures, SplitMix64,
};
use serde_json::json;

const EXCHANGE_MS: u64 = 200;

fn shards(n: u32) -> Vec<Pool> {
    let capacity = Capacity {
        kv_blocks: 4_096,
        block_size: 16,
        max_num_seqs: 64,
        kv_tokens: 0,
    };
    (0..n)
        .map(|s| {
            let mut pool = common::fleet(PolicyKind::PredictedLatency, 2, capacity);
            pool.set_shard(s, n, EXCHANGE_MS);
            pool
        })
        .collect()
}

/// A request with a prompt of about `tokens` tokens of its own.
fn request(seed: u64, tokens: usize) -> RequestFeatures {
    let mut rng = SplitMix64::new(seed);
    let body = json!({"model": "m", "max_tokens": 64, "messages": [
        {"role": "user", "content": common::text(&mut rng, tokens * 4)},
    ]});
    request_features(&body, &|_| None, &FeatureConfig::default()).unwrap()
}

fn gpu(b: usize) -> BackendId {
    BackendId::from(format!("gpu-{b}"))
}

#[test]
fn a_siblings_load_steers_choices() {
    let mut pools = shards(2);
    let mut rng = SplitMix64::new(1);
    // Shard 1 puts eight long prefills on gpu-0 (gpu-1 is out of its rotation for a moment).
    pools[1]
        .set_lifecycle(&gpu(1), Lifecycle::Draining, 0)
        .unwrap();
    let mut leases = Vec::new();
    for i in 0..8 {
        let f = request(100 + i, 2_000);
        let g = pools[1].acquire(&f, 0, &mut rng).unwrap();
        assert_eq!(g.backend, gpu(0));
        leases.push(g.lease_id);
    }
    pools[1]
        .set_lifecycle(&gpu(1), Lifecycle::Ready, 0)
        .unwrap();
    let idle = gpu(1);
    let report = pools[1].load_report(10);
    assert!(pools[0].accept_load_report(report, 10));
    // Shard 0 now sends fresh requests to the backend its sibling left idle.
    for i in 0..4 {
        let g = pools[0]
            .acquire(&request(200 + i, 500), 20, &mut rng)
            .unwrap();
        assert_eq!(
            g.backend, idle,
            "request {i} went to the sibling's busy backend"
        );
        assert!(pools[0].release(g.lease_id, &Outcome::from_status(200), 30));
    }
    // A report that is never refreshed stops counting: shard 0 weighs gpu-0 and gpu-1 alike
    // again, so both get some of forty requests (ties go to the backend whose cache holds less,
    // and gpu-1 holds the four prompts above: prompts as long fill gpu-0 up to it).
    let later = 10 + EXCHANGE_MS * (STALE_AFTER_INTERVALS + 1);
    let mut served = [0; 2];
    for i in 0..40 {
        let g = pools[0]
            .acquire(&request(300 + i, 500), later, &mut rng)
            .unwrap();
        served[usize::from(g.backend == gpu(1))] += 1;
        assert!(pools[0].release(g.lease_id, &Outcome::from_status(200), later));
    }
    assert!(served[0] > 0 && served[1] > 0, "served {served:?}");
    for lease in leases {
        assert!(pools[1].release(lease, &Outcome::from_status(200), later));
    }
}

#[test]
fn counters_return_to_zero_on_every_shard() {
    let n = 4;
    let mut pools = shards(n);
    let mut rng = SplitMix64::new(2);
    let mut live = Vec::new();
    for i in 0..64u64 {
        let f = request(i, 300);
        let s = shard_for(n, None, f.block_hashes.first().copied(), i) as usize;
        let g = pools[s].acquire(&f, i, &mut rng).unwrap();
        live.push((s, g.lease_id));
        if i % 8 == 7 {
            let reports: Vec<_> = pools.iter_mut().map(|p| p.load_report(i)).collect();
            for (a, pool) in pools.iter_mut().enumerate() {
                for (b, r) in reports.iter().enumerate() {
                    assert_eq!(pool.accept_load_report(r.clone(), i), a != b);
                }
            }
        }
    }
    assert!(
        pools.iter().all(|p| p.in_flight_total() > 0),
        "some shard got nothing"
    );
    for (s, lease) in live {
        assert!(pools[s].release(lease, &Outcome::from_status(200), 100));
    }
    for pool in pools.iter_mut() {
        pool.check_counters().unwrap();
        assert_eq!(pool.in_flight_total(), 0);
        assert!(pool.load_report(100).backends.is_empty());
    }
}

#[test]
fn one_shard_ignores_reports() {
    let mut pools = shards(1);
    let mut other = shards(2);
    let report = other[1].load_report(0);
    assert!(!pools[0].accept_load_report(report, 0));
}
