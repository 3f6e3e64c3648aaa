//! Decision time per policy: one `acquire` plus its `release`, at 8, 64 and 512 backends, with
//! the prefix-affinity table holding 100k and 1M entries. Request features (block hashes) are
//! computed beforehand, so hashing is not included; see `hashing.rs` for that.
//!
//! Also prints the affinity table's bytes per entry at each size.
//!
//! `live` measures what running answers add to a `predicted_latency` decision: at 64 and 512
//! backends (100k entries), with the pool's end-to-end tail learned from streamed requests and 64
//! answers in flight per backend, tail harm (which walks every candidate's running answers) on
//! at its default weight against off, side by side.

use criterion::measurement::WallTime;
use criterion::{
    black_box, criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion,
};
use routing_core::request::prompt::block_hashes;
use routing_core::{
    BackendSpec, Capacity, Outcome, PolicyKind, Pool, PoolConfig, ProbeResult, RequestFeatures,
    SplitMix64,
};
use std::time::Duration;

const DOCS: usize = 256;

/// Requests of 2,048 tokens: a 1,536-token shared document and a 512-token unique tail.
fn features(count: usize, salt: u64) -> Vec<RequestFeatures> {
    (0..count)
        .map(|i| {
            let doc = format!("{:>64}", (i % DOCS) as u64 ^ salt).repeat(96);
            let tail = format!("{:>64}", i as u64 + salt * 1_000_003).repeat(32);
            let text = format!("{doc}{tail}");
            RequestFeatures {
                model: "m".into(),
                prompt_tokens: (text.len() / 4) as u32,
                max_tokens: 256,
                block_tokens: 16,
                block_hashes: block_hashes(text.as_bytes(), 16),
                routing_key: Some(format!("user-{}", i % 997)),
                ..RequestFeatures::default()
            }
        })
        .collect()
}

fn pool(policy: PolicyKind, backends: usize, entries: usize) -> Pool {
    let mut pool = Pool::new(
        "bench",
        PoolConfig {
            policy,
            affinity_max_entries: entries,
            ..PoolConfig::default()
        },
    );
    // Room for twice the table's share per backend, in blocks: an entry stands for up to
    // CHUNK_BLOCKS of them, so with fewer the backends' bounds would cap the table below its own
    // and the warm-up would never end.
    let per_backend =
        (2 * entries * routing_core::pool::affinity::CHUNK_BLOCKS / backends).max(1024) as u64;
    for b in 0..backends {
        let id = pool
            .add_backend(
                BackendSpec {
                    id: format!("gpu-{b}").into(),
                    url: format!("http://gpu-{b}:8000"),
                    models: vec!["m".into()],
                    capacity: Capacity {
                        kv_blocks: per_backend,
                        block_size: 16,
                        ..Capacity::default()
                    },
                    ..BackendSpec::default()
                },
                0,
            )
            .unwrap();
        pool.record_probe(
            &id,
            &ProbeResult {
                ok: true,
                ..ProbeResult::default()
            },
            0,
        )
        .unwrap();
    }
    pool
}

/// Fills the affinity table to its bound with distinct prefixes, runs the benchmark's own
/// requests through once so the policy's placement settles, and leaves some load in flight.
fn warm(pool: &mut Pool, rng: &mut SplitMix64) {
    let mut salt = 1u64;
    while pool.affinity().len() < pool.affinity().max_entries() {
        for f in features(512, salt) {
            let g = pool.acquire(&f, 0, rng).unwrap();
            pool.release(g.lease_id, &Outcome::from_status(200), 0);
        }
        salt += 1;
    }
    for f in features(1024, 0) {
        let g = pool.acquire(&f, 0, rng).unwrap();
        pool.release(g.lease_id, &Outcome::from_status(200), 0);
    }
    for f in features(4 * pool.backend_count(), 0).iter() {
        pool.acquire(f, 0, rng).unwrap();
    }
}

/// Times one decision: `requests` in turn, each acquired at `now_ms` and released at once.
fn measure(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: BenchmarkId,
    pool: &mut Pool,
    rng: &mut SplitMix64,
    requests: &[RequestFeatures],
    now_ms: u64,
) {
    let mut i = 0;
    group.bench_function(id, |b| {
        b.iter(|| {
            let f = &requests[i % requests.len()];
            i += 1;
            let g = pool.acquire(black_box(f), now_ms, rng).unwrap();
            pool.release(g.lease_id, &Outcome::from_status(200), now_ms);
        })
    });
}

fn decisions(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let requests = features(1024, 0);
    for entries in [100_000usize, 1_000_000] {
        for backends in [8usize, 64, 512] {
            for policy in PolicyKind::ALL {
                // A fresh pool per policy, warmed by that policy, so each is measured in its own
                // steady state rather than in the table another policy left behind.
                let mut rng = SplitMix64::new(7);
                let mut pool = pool(policy, backends, entries);
                warm(&mut pool, &mut rng);
                if policy == PolicyKind::CacheAware {
                    let a = pool.affinity();
                    eprintln!(
                        "affinity: {} backends, {} entries, {} bytes, {:.1} bytes/entry",
                        backends,
                        a.len(),
                        a.memory_bytes(),
                        a.memory_bytes() as f64 / a.len() as f64
                    );
                }
                let id =
                    BenchmarkId::new(policy.as_str(), format!("{backends}b/{}k", entries / 1000));
                measure(&mut group, id, &mut pool, &mut rng, &requests, 1);
            }
        }
    }
    group.finish();
}

/// See the module documentation: decisions with 64 answers running per backend, tail harm on
/// (the default) and off.
fn live(c: &mut Criterion) {
    let mut group = c.benchmark_group("live");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let requests: Vec<RequestFeatures> = features(1024, 0)
        .into_iter()
        .map(|f| RequestFeatures { stream: true, ..f })
        .collect();
    for backends in [64usize, 512] {
        for weight in [1.0, 0.0] {
            let mut rng = SplitMix64::new(7);
            let mut pool = pool(PolicyKind::PredictedLatency, backends, 100_000);
            let mut config = pool.config().clone();
            config.predicted_latency.tail_harm_weight = weight;
            pool.set_config(config).unwrap();
            warm(&mut pool, &mut rng);
            // Streamed requests teach the pool its end-to-end tail (about 1 s)...
            for (i, f) in requests.iter().take(64).enumerate() {
                let g = pool.acquire(f, i as u64, &mut rng).unwrap();
                pool.release(g.lease_id, &Outcome::from_status(200), i as u64 + 1_000);
            }
            // ...and 64 answers per backend stay running.
            for f in requests.iter().cycle().take(64 * backends) {
                pool.acquire(f, 2_000, &mut rng).unwrap();
            }
            let id = BenchmarkId::new(format!("tail_harm_{weight}"), format!("{backends}b/100k"));
            measure(&mut group, id, &mut pool, &mut rng, &requests, 2_001);
        }
    }
    group.finish();
}

criterion_group!(benches, decisions, live);
criterion_main!(benches);
