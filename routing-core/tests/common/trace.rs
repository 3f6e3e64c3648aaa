//! A public production trace as a timed-simulation workload: Mooncake's FAST'25 traces
//! (`bench/traces/*.jsonl.gz`, one request a line: `timestamp` ms, `input_length`,
//! `output_length`, `hash_ids` of 512-token prefix blocks) replayed at their own arrival times.
//!
//! Lengths are scaled as the real bench scales them: a 512-token trace block becomes
//! `512 / scale` tokens (so a prompt of `input_length` tokens becomes `input_length / scale`, and
//! its output `output_length / scale`, at least 1), and each trace block id becomes the
//! simulation's 16-token block hashes in order (the gateway's hashed blocks; an engine of 64-token
//! blocks caches them four at a time, `timed::EngineShape`), so requests that share their first k
//! trace ids share the first k × `512 / scale` tokens of prefix, as in the trace. Arrivals are sped up by
//! `speedup` (the trace's time divided by it) to set the load.
use super::timed::{Speed, Workload, BLOCK};
use routing_core::{RequestFeatures, SplitMix64};
use std::collections::HashSet;
use std::io::{BufRead, BufReader};

/// One trace request, unscaled.
#[derive(Debug, Clone)]
pub struct TraceRequest {
    pub timestamp_ms: f64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

/// Reads `bench/traces/<name>.jsonl.gz` (relative to the workspace).
pub fn load(name: &str) -> Vec<TraceRequest> {
    let path = format!(
        "{}/../bench/traces/{name}.jsonl.gz",
        env!("CARGO_MANIFEST_DIR")
    );
    let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let reader = BufReader::new(flate2::read::GzDecoder::new(file));
    reader
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
            TraceRequest {
                timestamp_ms: v["timestamp"].as_f64().unwrap(),
                input_length: v["input_length"].as_u64().unwrap(),
                output_length: v["output_length"].as_u64().unwrap(),
                hash_ids: v["hash_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_u64().unwrap())
                    .collect(),
            }
        })
        .collect()
}

/// A window of a trace, scaled, replayed at its arrival times.
pub struct Trace {
    requests: Vec<(f64, RequestFeatures, u32)>,
}

impl Trace {
    /// `count` requests of `all` from `start`, lengths divided by `scale` (a power of two up to
    /// 32, so a trace block is whole simulation blocks), arrivals sped up by `speedup`.
    pub fn window(
        all: &[TraceRequest],
        start: usize,
        count: usize,
        scale: u64,
        speedup: f64,
    ) -> Self {
        let window = &all[start.min(all.len())..(start + count).min(all.len())];
        let t0 = window.first().map_or(0.0, |r| r.timestamp_ms);
        let trace_block = 512 / scale;
        let per_block = (trace_block / BLOCK).max(1);
        let requests = window
            .iter()
            .map(|r| {
                let prompt = (r.input_length / scale).max(1);
                let output = (r.output_length / scale).max(1) as u32;
                let full = (prompt / BLOCK) as usize;
                let block_hashes: Vec<u64> = r
                    .hash_ids
                    .iter()
                    .flat_map(|&h| (0..per_block).map(move |k| block_hash(h, k)))
                    .take(full)
                    .collect();
                let features = RequestFeatures {
                    model: "m".into(),
                    stream: true,
                    prompt_tokens: prompt as u32,
                    max_tokens: output,
                    block_tokens: BLOCK as u32,
                    block_hashes,
                    ..RequestFeatures::default()
                };
                ((r.timestamp_ms - t0) / speedup, features, output)
            })
            .collect();
        Trace { requests }
    }

    /// Requests per second of the window as replayed.
    pub fn rate(&self) -> f64 {
        let span = self.requests.last().map_or(0.0, |r| r.0);
        self.requests.len() as f64 / (span / 1000.0).max(1e-9)
    }

    /// Each request's floor: its time to first token alone on an engine of `speed` that caches
    /// every block seen before in the window (its uncached prefill and one step), counting only
    /// whole engine blocks of `block` tokens. No policy beats it, so its p99 bounds what any can
    /// reach.
    pub fn floors(&self, speed: Speed, block: u64) -> Vec<f64> {
        let mut seen = HashSet::new();
        self.requests
            .iter()
            .map(|(_, f, _)| {
                let hits = f
                    .block_hashes
                    .iter()
                    .take_while(|b| seen.contains(*b))
                    .count();
                seen.extend(f.block_hashes.iter().copied());
                let cached = hits as u64 * BLOCK;
                let uncached = u64::from(f.prompt_tokens)
                    .saturating_sub(cached - cached % block.max(1))
                    .max(1);
                uncached as f64 * speed.prefill_us_per_token / 1000.0 + speed.step_ms
            })
            .collect()
    }

    /// Each request's end-to-end floor: its time-to-first-token floor ([`Trace::floors`]) and its
    /// later tokens at one step each on an engine decoding it alone.
    pub fn e2e_floors(&self, speed: Speed, block: u64) -> Vec<f64> {
        self.floors(speed, block)
            .into_iter()
            .zip(&self.requests)
            .map(|(ttft, (_, _, out))| {
                ttft + f64::from(out.saturating_sub(1)) * (speed.step_ms + speed.per_seq_ms)
            })
            .collect()
    }

    /// Mean scaled prompt and output tokens.
    pub fn mean_lengths(&self) -> (f64, f64) {
        let n = self.requests.len().max(1) as f64;
        let p = self
            .requests
            .iter()
            .map(|r| f64::from(r.1.prompt_tokens))
            .sum::<f64>();
        let o = self.requests.iter().map(|r| f64::from(r.2)).sum::<f64>();
        (p / n, o / n)
    }
}

/// The simulation's hash of sub-block `k` of trace block `id` (equal ids are an equal prefix, so
/// no chaining is needed).
fn block_hash(id: u64, k: u64) -> u64 {
    let mut x =
        id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (k + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 29)
}

impl Workload for Trace {
    fn clients(&self) -> usize {
        self.requests.len()
    }

    fn next(&mut self, client: usize, _rng: &mut SplitMix64) -> Option<(RequestFeatures, u32)> {
        self.requests
            .get(client)
            .map(|(_, f, out)| (f.clone(), *out))
    }

    fn arrivals(&self) -> Option<Vec<f64>> {
        Some(self.requests.iter().map(|r| r.0).collect())
    }
}
