//! One pool Durable Object's hot path, natively: an acquire+release pair as the overhead benchmark
//! drives it in workerd (`bench/coordinator.mjs`, issue 15 part a), without workerd.
//!
//! 64 backends (KV size hint 262,144 blocks each), policy `predicted_latency`, the affinity table
//! warmed to its default bound of entries by prompts of 1,024 distinct block hashes (at least 1,000
//! of them, as many as the bound takes), so that every new entry evicts one. Each
//! measured request has 128 (2k tokens) or 1,024 (16k tokens) block hashes, the first half a
//! random warm prompt's and the rest fresh. `pool` times `Pool::acquire` and
//! `Pool::release`; `wire` adds what the object does around them: decoding the acquire body's
//! features (block hashes in base64) and the release's outcome, and encoding the grant.

use criterion::{black_box, criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use routing_core::request::block_hash_encoding;
use routing_core::{
    BackendSpec, Capacity, Outcome, PolicyKind, Pool, PoolConfig, ProbeResult, RandomSource,
    RequestFeatures, SplitMix64,
};
use std::time::Duration;

const BACKENDS: usize = 64;
const KV_BLOCKS: u64 = 262_144;
const MIN_WARM_PROMPTS: u64 = 1_000;
const WARM_BLOCKS: usize = 1_024;
const BLOCK_TOKENS: u32 = 16;

/// `n` pseudo-random block hashes, the same for the same seed.
fn hashes(n: usize, seed: u64) -> Vec<u64> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.next_u64()).collect()
}

fn features(block_hashes: Vec<u64>, i: u64) -> RequestFeatures {
    RequestFeatures {
        request_id: format!("bench-{i}"),
        model: "m".into(),
        stream: true,
        prompt_tokens: block_hashes.len() as u32 * BLOCK_TOKENS + 7,
        max_tokens: 128,
        block_tokens: BLOCK_TOKENS,
        block_hashes,
        ..RequestFeatures::default()
    }
}

/// A measured request: `blocks` hashes, the first half one of the `warm` prompts'.
fn request(blocks: usize, warm: u64, rng: &mut SplitMix64, i: u64) -> RequestFeatures {
    let mut h = hashes(blocks, rng.next_u64());
    let warm = hashes(blocks / 2, 0x5eed_0000 + rng.below(warm));
    h[..blocks / 2].copy_from_slice(&warm);
    features(h, i)
}

/// The pool, warmed; and how many warm prompts it saw.
fn pool() -> (Pool, u64) {
    let mut pool = Pool::new(
        "bench",
        PoolConfig {
            policy: PolicyKind::PredictedLatency,
            ..PoolConfig::default()
        },
    );
    for b in 0..BACKENDS {
        let spec = BackendSpec {
            id: format!("be-{b:02}").into(),
            url: format!("http://127.0.0.1:{}", 9000 + b),
            models: vec!["m".into()],
            capacity: Capacity {
                kv_blocks: KV_BLOCKS,
                block_size: BLOCK_TOKENS,
                max_num_seqs: 256,
                kv_tokens: 0,
            },
            ..BackendSpec::default()
        };
        let id = pool.add_backend(spec, 0).unwrap();
        let up = ProbeResult {
            ok: true,
            ..ProbeResult::default()
        };
        pool.record_probe(&id, &up, 0).unwrap();
    }
    let mut rng = SplitMix64::new(1);
    let mut warm = 0;
    while warm < MIN_WARM_PROMPTS || pool.affinity().len() < pool.affinity().max_entries() {
        let f = features(hashes(WARM_BLOCKS, 0x5eed_0000 + warm), warm);
        let g = pool.acquire(&f, 0, &mut rng).unwrap();
        pool.release(g.lease_id, &Outcome::from_status(200), 0);
        warm += 1;
    }
    (pool, warm)
}

/// A release's outcome, as the benchmark's driver sends it.
const RELEASE: &str = concat!(
    r#"{"status":200,"kind":"success","ttfb_ms":20,"#,
    r#""prompt_tokens":2055,"cached_tokens":1024,"completion_tokens":128}"#
);

fn pairs(c: &mut Criterion) {
    let mut group = c.benchmark_group("coordinator_pair");
    group
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let (mut pool, warm) = pool();
    eprintln!(
        "affinity after the warm-up ({warm} prompts): {} entries, {} bytes",
        pool.affinity().len(),
        pool.affinity().memory_bytes()
    );
    // The workload's draws and the pool's are separate: setup and routine each hold one.
    let (mut workload, mut rng) = (SplitMix64::new(7), SplitMix64::new(8));
    let mut i = 0u64;
    for blocks in [128usize, 1024] {
        let tokens = format!("{}k", blocks * BLOCK_TOKENS as usize / 1024);
        group.bench_function(BenchmarkId::new("pool", &tokens), |b| {
            b.iter_batched(
                || {
                    i += 1;
                    (request(blocks, warm, &mut workload, i), i / 2)
                },
                |(f, now)| {
                    let g = pool.acquire(black_box(&f), now, &mut rng).unwrap();
                    pool.release(g.lease_id, &Outcome::from_status(200), now);
                    g.cached_blocks
                },
                BatchSize::SmallInput,
            )
        });
        group.bench_function(BenchmarkId::new("wire", &tokens), |b| {
            b.iter_batched(
                || {
                    i += 1;
                    let f = request(blocks, warm, &mut workload, i);
                    (serde_json::to_string(&f).unwrap(), i / 2)
                },
                |(body, now)| {
                    let f: RequestFeatures = serde_json::from_str(black_box(&body)).unwrap();
                    let g = pool.acquire(&f, now, &mut rng).unwrap();
                    let answer = serde_json::to_string(&g).unwrap();
                    let outcome: Outcome = serde_json::from_str(RELEASE).unwrap();
                    pool.release(g.lease_id, &outcome, now);
                    answer.len()
                },
                BatchSize::SmallInput,
            )
        });
        let body =
            block_hash_encoding::encode(&request(blocks, warm, &mut workload, 0).block_hashes);
        group.bench_function(BenchmarkId::new("decode_hashes", &tokens), |b| {
            b.iter(|| block_hash_encoding::decode(black_box(&body)).unwrap().len())
        });
    }
    group.finish();
}

criterion_group!(benches, pairs);
criterion_main!(benches);
