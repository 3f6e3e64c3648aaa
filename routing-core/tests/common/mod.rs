//! What the integration tests share: a pool of healthy backends, a simulated server's prefix
//! cache, filler text, and the timed simulator ([`timed`]).
// Each test binary uses a part of this module.
#![allow(dead_code)]

pub mod timed;
pub mod trace;

use routing_core::{
    BackendId, BackendSpec, Capacity, PolicyKind, Pool, PoolConfig, ProbeResult, RandomSource,
    SplitMix64,
};
use std::collections::{BTreeMap, HashMap};

/// A pool of `backends` servers `gpu-0`, `gpu-1`, ... serving model `m` with `capacity`, each
/// probed up at time 0, routed by `policy`.
pub fn fleet(policy: PolicyKind, backends: usize, capacity: Capacity) -> Pool {
    let mut pool = Pool::new(
        "sim",
        PoolConfig {
            policy,
            predicted_latency: screened_knobs(),
            time_model: screened_time_model(),
            ..PoolConfig::default()
        },
    );
    for b in 0..backends {
        let spec = BackendSpec {
            id: format!("gpu-{b}").into(),
            url: format!("http://gpu-{b}:8000"),
            models: vec!["m".into()],
            capacity,
            ..BackendSpec::default()
        };
        add_ready(&mut pool, spec);
    }
    pool
}

/// The default policy's knobs, or (for screening ideas without a rebuild) those in
/// `SIM_PREDICTED_LATENCY` as JSON, e.g. `{"harm_weight": 0.2}`.
pub fn screened_knobs() -> routing_core::policy::PredictedLatencyConfig {
    std::env::var("SIM_PREDICTED_LATENCY")
        .ok()
        .map(|v| serde_json::from_str(&v).expect("SIM_PREDICTED_LATENCY"))
        .unwrap_or_default()
}

/// The time model's knobs, or those in `SIM_TIME_MODEL` as JSON, e.g. `{"learning_rate": 0}`.
pub fn screened_time_model() -> routing_core::backend::time_model::TimeModelConfig {
    std::env::var("SIM_TIME_MODEL")
        .ok()
        .map(|v| serde_json::from_str(&v).expect("SIM_TIME_MODEL"))
        .unwrap_or_default()
}

/// A pool named `p` with `config` and `n` backends `b0`, `b1`, ... serving model `m`, each probed
/// up at time 0.
pub fn small_pool(config: PoolConfig, n: usize) -> Pool {
    let mut pool = Pool::new("p", config);
    for i in 0..n {
        let spec = BackendSpec {
            id: format!("b{i}").into(),
            url: format!("http://b{i}:8000"),
            models: vec!["m".into()],
            ..BackendSpec::default()
        };
        add_ready(&mut pool, spec);
    }
    pool
}

/// Adds `spec` to `pool` at time 0 and has it probed healthy, so it takes requests.
pub fn add_ready(pool: &mut Pool, spec: BackendSpec) -> BackendId {
    let id = pool.add_backend(spec, 0).unwrap();
    let up = ProbeResult {
        ok: true,
        ..ProbeResult::default()
    };
    pool.record_probe(&id, &up, 0).unwrap();
    id
}

/// A simulated server's prefix cache: an LRU over block hashes, as large as its KV cache.
pub struct ServerCache {
    capacity: usize,
    stamp: u64,
    by_block: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
}

impl ServerCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        ServerCache {
            capacity,
            stamp: 0,
            by_block: HashMap::new(),
            by_stamp: BTreeMap::new(),
        }
    }

    /// Leading blocks of `blocks` the cache holds.
    pub fn hits(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.by_block.contains_key(b))
            .count()
    }

    /// Computes (or reuses) every block, touching the last first as vLLM frees them.
    pub fn prefill(&mut self, blocks: &[u64]) {
        for &b in blocks.iter().rev() {
            self.stamp += 1;
            if let Some(old) = self.by_block.insert(b, self.stamp) {
                self.by_stamp.remove(&old);
            }
            self.by_stamp.insert(self.stamp, b);
            if self.by_block.len() > self.capacity {
                if let Some((_, victim)) = self.by_stamp.pop_first() {
                    self.by_block.remove(&victim);
                }
            }
        }
    }
}

/// `bytes` bytes of seeded filler words (about a token every 4 bytes).
pub fn text(rng: &mut SplitMix64, bytes: usize) -> String {
    const WORDS: [&str; 8] = [
        "alpha ", "beta ", "gamma ", "delta ", "kv ", "cache ", "token ", "prefix ",
    ];
    let mut s = String::with_capacity(bytes + 8);
    while s.len() < bytes {
        s.push_str(WORDS[rng.below(8) as usize]);
    }
    s.truncate(bytes);
    s
}
