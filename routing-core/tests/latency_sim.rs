//! A timed fleet simulation: the pool routing requests to simulated vLLM engines that run engine
//! steps in simulated time, so policies are compared on what users feel (time to first token,
//! end-to-end latency, throughput) and not only on cache hits.
//!
//! Each engine works as vllm-sim does (and, roughly, vLLM with chunked prefill): a FIFO waiting
//! queue and a running batch; every step decodes one token for each running sequence and prefills
//! up to a token budget from the queue; a step lasts `base + per_seq × decoding + per_token ×
//! prefill tokens`. A request's uncached prompt is what its engine's prefix cache (an LRU over
//! block hashes, as large as the KV cache) does not hold when its prefill starts. The pool sees
//! only what the real gateway sees: a grant per request, and a release with time to first byte,
//! duration and completion tokens.
//!
//! Workloads, both closed loop (each client sends its next request when the previous one ends):
//! - multi-turn chat: users share one long system prompt and resend their growing history;
//! - shared-prefix groups: questions behind long group prompts, with new groups arriving all run.
//!
//! Printed per policy; the assertions hold `predicted_latency` to the targets against
//! round robin, least load and consistent hashing.

mod common;

use common::ServerCache;
use routing_core::prompt::{request_features, FeatureConfig};
use routing_core::{
    BackendId, Capacity, Outcome, PolicyKind, Pool, RandomSource, RequestFeatures, SplitMix64,
};
use serde_json::json;
use std::collections::{HashMap, VecDeque};

const BLOCK: u64 = 16;

/// One simulated engine's speed.
#[derive(Debug, Clone, Copy)]
struct Speed {
    prefill_us_per_token: f64,
    step_ms: f64,
    per_seq_ms: f64,
}

const SIM_SPEED: Speed = Speed {
    prefill_us_per_token: 100.0,
    step_ms: 10.0,
    per_seq_ms: 0.15,
};
const STEP_TOKEN_BUDGET: u64 = 8_192;
/// Time between the gateway and an engine, in each direction's first byte (ms).
const NETWORK_MS: f64 = 20.0;
const MAX_NUM_SEQS: usize = 64;

struct Seq {
    client: usize,
    lease: u64,
    blocks: Vec<u64>,
    prompt: u64,
    prefill_left: u64,
    started: bool,
    output: u32,
    produced: u32,
    arrival_ms: f64,
    ttft_ms: Option<f64>,
    uncached: u64,
}

struct Engine {
    speed: Speed,
    cache: ServerCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    step_end: Option<f64>,
    /// Sequences whose prefill this step carries, and how many tokens each.
    in_step: Vec<(usize, u64)>,
    computed_tokens: u64,
}

impl Engine {
    fn new(speed: Speed, kv_blocks: usize) -> Self {
        Engine {
            speed,
            cache: ServerCache::new(kv_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            step_end: None,
            in_step: Vec::new(),
            computed_tokens: 0,
        }
    }

    /// Plans the next step starting at `now` (if there is work).
    fn plan(&mut self, now: f64, hit_tokens: &mut u64) {
        // Admit from the queue in FIFO order while the batch has room.
        while self.running.len() < MAX_NUM_SEQS {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            let hits = (self.cache.hits(&s.blocks) as u64 * BLOCK).min(s.prompt.saturating_sub(1));
            *hit_tokens += hits;
            s.prefill_left = s.prompt - hits;
            s.uncached = s.prefill_left;
            self.computed_tokens += s.prefill_left;
            self.cache.prefill(&s.blocks);
            s.started = true;
            self.running.push(s);
        }
        let mut budget = STEP_TOKEN_BUDGET;
        self.in_step.clear();
        let mut decoding = 0usize;
        for (i, s) in self.running.iter().enumerate() {
            if s.prefill_left > 0 {
                let take = s.prefill_left.min(budget);
                if take > 0 {
                    self.in_step.push((i, take));
                    budget -= take;
                }
            } else {
                decoding += 1;
            }
        }
        if self.in_step.is_empty() && decoding == 0 {
            self.step_end = None;
            return;
        }
        let prefill_tokens = STEP_TOKEN_BUDGET - budget;
        let ms = self.speed.step_ms
            + self.speed.per_seq_ms * decoding as f64
            + self.speed.prefill_us_per_token * prefill_tokens as f64 / 1000.0;
        self.step_end = Some(now + ms);
    }

    /// Applies the step that ends at `now`; returns finished sequences.
    fn finish_step(&mut self, now: f64) -> Vec<Seq> {
        for &(i, take) in &self.in_step {
            self.running[i].prefill_left -= take;
        }
        for s in self.running.iter_mut() {
            if s.prefill_left > 0 {
                continue;
            }
            // A sequence whose prefill completed this step emits its first token now; the others
            // decode one token.
            s.produced += 1;
            if s.ttft_ms.is_none() {
                s.ttft_ms = Some(now - s.arrival_ms);
            }
        }
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].prefill_left == 0
                && self.running[i].produced >= self.running[i].output
            {
                done.push(self.running.swap_remove(i));
            } else {
                i += 1;
            }
        }
        done
    }
}

/// What a client sends next.
trait Workload {
    fn clients(&self) -> usize;
    /// The next request of `client`, or `None` when it is done.
    fn next(&mut self, client: usize, rng: &mut SplitMix64) -> Option<(RequestFeatures, u32)>;
    /// The answer to `client`'s last request (multi-turn appends it to the history).
    fn answered(&mut self, _client: usize, _rng: &mut SplitMix64) {}
}

/// About `tokens` tokens of filler.
fn words(rng: &mut SplitMix64, tokens: usize) -> String {
    common::text(rng, tokens * 4)
}

fn features(body: serde_json::Value, key: String) -> RequestFeatures {
    let mut f = request_features(&body, &|_| None, &FeatureConfig::default()).unwrap();
    f.routing_key = Some(key);
    f.stream = true;
    f
}

struct MultiTurn {
    system: String,
    histories: Vec<Vec<serde_json::Value>>,
    turns_left: Vec<u32>,
    max_tokens: u32,
    last_output: Vec<u32>,
}

impl MultiTurn {
    fn new(users: usize, turns: u32, rng: &mut SplitMix64) -> Self {
        MultiTurn {
            system: words(rng, 1_000),
            histories: vec![Vec::new(); users],
            turns_left: vec![turns; users],
            max_tokens: 128,
            last_output: vec![0; users],
        }
    }
}

impl Workload for MultiTurn {
    fn clients(&self) -> usize {
        self.histories.len()
    }

    fn next(&mut self, c: usize, rng: &mut SplitMix64) -> Option<(RequestFeatures, u32)> {
        if self.turns_left[c] == 0 {
            return None;
        }
        self.turns_left[c] -= 1;
        self.histories[c].push(json!({"role": "user", "content": words(rng, 80)}));
        let mut messages = vec![json!({"role": "system", "content": self.system})];
        messages.extend(self.histories[c].iter().cloned());
        let body = json!({"model": "m", "max_tokens": self.max_tokens, "messages": messages});
        // Answers end at EOS before max_tokens: 32 to 128 tokens.
        self.last_output[c] = 32 + rng.below(97) as u32;
        Some((features(body, format!("user-{c}")), self.last_output[c]))
    }

    fn answered(&mut self, c: usize, rng: &mut SplitMix64) {
        let answer = words(rng, self.last_output[c] as usize);
        self.histories[c].push(json!({"role": "assistant", "content": answer}));
    }
}

struct Groups {
    prompts: Vec<String>,
    clients: usize,
    sent: usize,
    total: usize,
    window: usize,
}

impl Groups {
    fn new(groups: usize, clients: usize, total: usize, rng: &mut SplitMix64) -> Self {
        Groups {
            prompts: (0..groups).map(|_| words(rng, 1_200)).collect(),
            clients,
            sent: 0,
            total,
            window: 8,
        }
    }
}

impl Workload for Groups {
    fn clients(&self) -> usize {
        self.clients
    }

    fn next(&mut self, _c: usize, rng: &mut SplitMix64) -> Option<(RequestFeatures, u32)> {
        if self.sent >= self.total {
            return None;
        }
        // New groups keep arriving: the newest is proportional to progress, and requests pick
        // among the latest `window` groups.
        let newest = (self.sent * self.prompts.len() / self.total).max(self.window - 1);
        let g = newest - rng.below(self.window as u64) as usize;
        self.sent += 1;
        let body = json!({"model": "m", "max_tokens": 64, "messages": [
            {"role": "system", "content": self.prompts[g]},
            {"role": "user", "content": words(rng, 40)},
        ]});
        Some((
            features(body, format!("group-{g}")),
            16 + rng.below(49) as u32,
        ))
    }
}

#[derive(Debug)]
struct Report {
    ttft_p50: f64,
    ttft_p99: f64,
    e2e_p50: f64,
    e2e_p99: f64,
    throughput: f64,
    hit_rate: f64,
    busiest_over_mean: f64,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

fn simulate(
    policy: PolicyKind,
    workload: &mut dyn Workload,
    speeds: &[Speed],
    kv_blocks: usize,
    seed: u64,
) -> (Report, Pool) {
    let capacity = Capacity {
        kv_blocks: kv_blocks as u64,
        block_size: 16,
        max_num_seqs: MAX_NUM_SEQS as u32,
    };
    let mut pool = common::fleet(policy, speeds.len(), capacity);
    let index: HashMap<BackendId, usize> = (0..speeds.len())
        .map(|b| (BackendId::from(format!("gpu-{b}")), b))
        .collect();
    let mut engines: Vec<Engine> = speeds.iter().map(|&s| Engine::new(s, kv_blocks)).collect();
    let mut rng = SplitMix64::new(seed);
    let mut wrng = SplitMix64::new(seed ^ 0x77);
    let mut pending: Vec<(f64, usize)> = (0..workload.clients())
        .map(|c| (c as f64 * 7.0, c))
        .collect();
    let (mut ttfts, mut e2es) = (Vec::new(), Vec::new());
    let (mut hit_tokens, mut prompt_tokens) = (0u64, 0u64);
    let mut now;
    let mut last_end = 0.0f64;
    loop {
        let next_arrival = pending
            .iter()
            .enumerate()
            .min_by(|a, b| a.1 .0.partial_cmp(&b.1 .0).unwrap());
        let next_step = engines
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.step_end.map(|t| (t, i)))
            .min_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
        match (next_arrival, next_step) {
            (None, None) => break,
            (Some((pi, &(at, client))), step) if step.is_none_or(|(t, _)| at <= t) => {
                pending.swap_remove(pi);
                now = at;
                let Some((f, output)) = workload.next(client, &mut wrng) else {
                    continue;
                };
                let grant = pool.acquire(&f, now as u64, &mut rng).unwrap();
                let b = index[&grant.backend];
                prompt_tokens += u64::from(f.prompt_tokens);
                let e = &mut engines[b];
                e.waiting.push_back(Seq {
                    client,
                    lease: grant.lease_id,
                    blocks: f.block_hashes.clone(),
                    prompt: u64::from(f.prompt_tokens),
                    prefill_left: 0,
                    started: false,
                    output,
                    produced: 0,
                    arrival_ms: now,
                    ttft_ms: None,
                    uncached: 0,
                });
                if e.step_end.is_none() {
                    e.plan(now, &mut hit_tokens);
                }
            }
            (_, Some((t, b))) => {
                now = t;
                let done = engines[b].finish_step(now);
                for s in done {
                    let ttft = s.ttft_ms.unwrap_or(0.0);
                    let e2e = now - s.arrival_ms;
                    ttfts.push(ttft);
                    e2es.push(e2e);
                    // The gateway measures the first byte a network hop later than the engine.
                    let outcome = Outcome {
                        ttfb_ms: Some((ttft + NETWORK_MS) as u64),
                        completion_tokens: Some(s.produced),
                        ..Outcome::from_status(200)
                    };
                    assert!(pool.release(s.lease, &outcome, (now + NETWORK_MS) as u64));
                    workload.answered(s.client, &mut wrng);
                    // Think time: 20 to 220 ms.
                    pending.push((now + 20.0 + 200.0 * wrng.unit(), s.client));
                    debug_assert!(s.started);
                }
                engines[b].plan(now, &mut hit_tokens);
                last_end = now;
            }
            _ => unreachable!(),
        }
    }
    pool.check_counters().unwrap();
    let computed: Vec<f64> = engines.iter().map(|e| e.computed_tokens as f64).collect();
    let mean = computed.iter().sum::<f64>() / computed.len() as f64;
    let n = ttfts.len() as f64;
    let report = Report {
        ttft_p50: pct(&mut ttfts, 0.5),
        ttft_p99: pct(&mut ttfts, 0.99),
        e2e_p50: pct(&mut e2es, 0.5),
        e2e_p99: pct(&mut e2es, 0.99),
        throughput: n / (last_end / 1000.0),
        hit_rate: hit_tokens as f64 / prompt_tokens as f64,
        busiest_over_mean: computed.iter().cloned().fold(0.0, f64::max) / mean,
    };
    (report, pool)
}

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
    let speeds = [SIM_SPEED; 8];
    let mut out = HashMap::new();
    for policy in COMPARED {
        // Three seeds, averaged: one run's p99 rests on a handful of requests.
        let runs: Vec<Report> = (0..3u64)
            .map(|seed| {
                let mut w = make(seed);
                simulate(policy, w.as_mut(), &speeds, kv_blocks, 0x5eed + seed).0
            })
            .collect();
        let mean = |f: &dyn Fn(&Report) -> f64| runs.iter().map(f).sum::<f64>() / runs.len() as f64;
        let r = Report {
            ttft_p50: mean(&|r| r.ttft_p50),
            ttft_p99: mean(&|r| r.ttft_p99),
            e2e_p50: mean(&|r| r.e2e_p50),
            e2e_p99: mean(&|r| r.e2e_p99),
            throughput: mean(&|r| r.throughput),
            hit_rate: mean(&|r| r.hit_rate),
            busiest_over_mean: mean(&|r| r.busiest_over_mean),
        };
        println!(
            "{name:>13} {:>17}: TTFT p50 {:7.1} p99 {:7.1} ms | e2e p50 {:7.1} p99 {:7.1} ms | \
             {:6.2} req/s | hit {:5.1}% | busiest/mean {:.2}",
            policy.as_str(),
            r.ttft_p50,
            r.ttft_p99,
            r.e2e_p50,
            r.e2e_p99,
            r.throughput,
            100.0 * r.hit_rate,
            r.busiest_over_mean
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
        // Measured: 0.92x the best baseline's p99 (least load) with either cache size; the floor
        // is a cold system-prompt prefill, which no policy avoids on a user's first turn.
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
        // Measured: 0.95x the best baseline's p99 (least load), 0.58x round robin's; 6% of the
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
    let (_, pool) = simulate(PolicyKind::RoundRobin, &mut w, &speeds, 2_048, 9);
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
    let (_, pool) = simulate(PolicyKind::PredictedLatency, &mut w, &speeds, 2_048, 9);
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
