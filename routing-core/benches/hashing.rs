//! Prompt hashing throughput: chained xxh3 block hashes of canonical prompts from 1 KB to
//! 512 KB, and the whole feature extraction (canonicalisation, token estimate, routing key, block
//! hashes) of a chat request whose body is already parsed.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use routing_core::request::prompt::{
    block_hashes, request_features, FeatureConfig, DEFAULT_BLOCK_TOKENS,
};
use serde_json::json;
use std::time::Duration;

const SIZES: [usize; 5] = [1 << 10, 8 << 10, 64 << 10, 256 << 10, 512 << 10];

fn prompt(bytes: usize) -> String {
    "The quick brown fox jumps over the lazy dog. ".repeat(bytes / 45 + 1)[..bytes].to_string()
}

fn hashing(c: &mut Criterion) {
    let mut group = c.benchmark_group("block_hashes");
    group
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for size in SIZES {
        let text = prompt(size);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(format!("{}KB", size >> 10)),
            &text,
            |b, t| b.iter(|| block_hashes(black_box(t.as_bytes()), DEFAULT_BLOCK_TOKENS)),
        );
    }
    group.finish();

    let mut group = c.benchmark_group("request_features");
    group
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let config = FeatureConfig {
        max_blocks: usize::MAX,
        ..FeatureConfig::default()
    };
    for size in SIZES {
        let body = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": prompt(size / 2)},
                {"role": "user", "content": prompt(size - size / 2)}
            ]
        });
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(format!("{}KB", size >> 10)),
            &body,
            |b, body| b.iter(|| request_features(black_box(body), &|_| None, &config).unwrap()),
        );
    }
    group.finish();
}

criterion_group!(benches, hashing);
criterion_main!(benches);
