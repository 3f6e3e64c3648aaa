//! The Worker's cost per streamed token, measured on the event path it runs in wasm: a vLLM chat
//! chunk (one token per event) through the usage scanner alone (the pass-through path, when
//! resumption is off or the request rules it out), through the scanner and the reading of the
//! answer (`resume::Partial`, every stream that could be resumed), and through the splice of a
//! continuation (`resume::Splice`, only after a resumption). Native figures: the wasm build is
//! slower by a constant factor, the ratios between the paths are what matter.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use routing_core::stream::resume::{Partial, Splice};
use routing_core::stream::usage::StreamScanner;
use std::time::Duration;

const TOKENS: usize = 256;

fn events() -> Vec<Vec<u8>> {
    (0..TOKENS)
        .map(|i| {
            format!("data: {{\"id\":\"chatcmpl-4881b8d8b36ba464b64f5b98ea1743e1\",\"object\":\"chat.completion.chunk\",\"created\":1796084327,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" w{:02}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n", i % 100)
                .into_bytes()
        })
        .collect()
}

fn per_token(c: &mut Criterion) {
    let events = events();
    let mut group = c.benchmark_group("stream_per_token");
    group
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(TOKENS as u64));
    group.bench_function("pass_through", |b| {
        b.iter(|| {
            let mut s = StreamScanner::new(true);
            for e in &events {
                black_box(s.push(black_box(e)));
            }
        })
    });
    group.bench_function("collecting_the_answer", |b| {
        b.iter(|| {
            let mut s = StreamScanner::new(true);
            let mut p = Partial::new();
            for e in &events {
                black_box(s.push(black_box(e)));
                p.observe(e);
            }
            black_box(p.tokens_sent())
        })
    });
    group.bench_function("splicing_a_continuation", |b| {
        let first = Partial::new();
        b.iter(|| {
            let mut s = StreamScanner::new(true);
            let mut splice = Splice::new(&first, 0);
            let mut p = Partial::new();
            for e in &events {
                black_box(s.push(black_box(e)));
                let out = splice.rewrite(e);
                p.observe(&out);
            }
            black_box(p.tokens_sent())
        })
    });
    group.finish();
}

criterion_group!(benches, per_token);
criterion_main!(benches);
