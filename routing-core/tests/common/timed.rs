//! The timed fleet simulation both `latency_sim` and `shard_sim` run: simulated vLLM engines that
//! run engine steps in simulated time, the workloads that drive them, and the loop that routes each
//! request through one pool, or through a pool's coordinator shards that exchange load reports.
//!
//! Each engine works as vllm-sim does (and, roughly, vLLM with chunked prefill): a FIFO waiting
//! queue and a running batch; every step decodes one token for each running sequence and prefills
//! up to a token budget from the queue; a step lasts `base + per_seq × decoding + per_token ×
//! prefill tokens`. A request's uncached prompt is what its engine's prefix cache (an LRU over
//! block hashes, as large as the KV cache) does not hold when its prefill starts. Running
//! sequences hold KV blocks; a prompt block is shared only once it is computed: blocks enter the
//! prefix cache when their sequence's prefill completes, as in vllm-sim, so requests admitted
//! together behind a prefix no one has computed yet each compute and hold their own copy (and
//! the first to finish makes it shared for later ones). A sequence is admitted only when its blocks
//! fit, and when generated tokens overflow the cache the newest running sequence is preempted and
//! later recomputed, as vLLM does. The pool sees
//! only what the real gateway sees: a grant per request, and a release with time to first byte,
//! duration and completion tokens.
use super::ServerCache;
use routing_core::pool::guess::{Granted as Learned, GuessBook, Place, Scored};
use routing_core::pool::shard;
use routing_core::request::prompt::{request_features, FeatureConfig, SentAhead};
use routing_core::{
    BackendId, Capacity, Outcome, PolicyKind, Pool, RandomSource, RequestFeatures, SplitMix64,
};
use serde_json::json;
use std::collections::{HashMap, VecDeque};

pub const BLOCK: u64 = 16;

/// One simulated engine's speed.
#[derive(Debug, Clone, Copy)]
pub struct Speed {
    pub prefill_us_per_token: f64,
    pub step_ms: f64,
    pub per_seq_ms: f64,
}

pub const SIM_SPEED: Speed = Speed {
    prefill_us_per_token: 100.0,
    step_ms: 10.0,
    per_seq_ms: 0.15,
};
pub const STEP_TOKEN_BUDGET: u64 = 8_192;
/// Time between the gateway and an engine, in each direction's first byte (ms).
pub const NETWORK_MS: f64 = 20.0;
pub const MAX_NUM_SEQS: usize = 64;

/// An engine's shape beyond its speed: the tokens in one KV (and prefix-cache) block, the step's
/// token budget, the running batch's limit, and whether the budget is vLLM's (decodes count
/// against it, running sequences are served first and the queue is admitted only from what is
/// left) or the older simulation's (everyone admitted, the budget for prefill alone).
#[derive(Debug, Clone, Copy)]
pub struct EngineShape {
    /// Tokens per engine block: a multiple of [`BLOCK`], the gateway's hashed block.
    pub block_tokens: u64,
    pub step_token_budget: u64,
    pub max_num_seqs: usize,
    pub vllm_budget: bool,
}

impl EngineShape {
    /// The simulation's engine before vLLM 0.34 (16-token blocks, 8,192-token steps, 64
    /// sequences), which `latency_sim`, `shard_sim` and their bounds were measured on.
    pub const SIM16: EngineShape = EngineShape {
        block_tokens: BLOCK,
        step_token_budget: STEP_TOKEN_BUDGET,
        max_num_seqs: MAX_NUM_SEQS,
        vllm_budget: false,
    };
    /// vllm-sim with no flags, as `make bench-traces` runs it (vLLM 0.34's defaults on its A100
    /// profile): 64-token blocks, `max_num_batched_tokens` 2,048, `max_num_seqs` 256.
    pub const VLLM_034: EngineShape = EngineShape {
        block_tokens: 64,
        step_token_budget: 2_048,
        max_num_seqs: 256,
        vllm_budget: true,
    };

    /// The engine's block hashes of a prompt hashed in [`BLOCK`]-token blocks: one per whole
    /// engine block, the last of its gateway blocks (which names the prefix up to it).
    pub fn engine_blocks(&self, hashes: &[u64]) -> Vec<u64> {
        let k = (self.block_tokens / BLOCK).max(1) as usize;
        hashes.chunks_exact(k).map(|c| c[k - 1]).collect()
    }
}

pub struct Seq {
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
    /// The prompt blocks this sequence counts in its engine's shared `held` map; the rest of
    /// `blocks` are its own copies.
    shared: Vec<u64>,
    /// When its engine first admitted it to the running batch.
    admitted_ms: Option<f64>,
    /// When its first token came.
    first_token_ms: Option<f64>,
    /// The leases whose prefill ran in its decode's steps, and for how long (ms, a step each).
    stalled_by: Vec<(u64, f64)>,
}

impl Seq {
    /// KV blocks the sequence holds beyond its full prompt blocks: the prompt's partial last
    /// block and the generated tokens.
    fn tail_blocks(&self, block: u64) -> usize {
        ((self.prompt % block + u64::from(self.produced)).div_ceil(block)) as usize
    }
}

pub struct Engine {
    speed: Speed,
    shape: EngineShape,
    cache: ServerCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    step_end: Option<f64>,
    /// Sequences whose prefill this step carries, and how many tokens each.
    in_step: Vec<(usize, u64)>,
    computed_tokens: u64,
    /// KV blocks, and how many running sequences hold each full prompt block (shared prefixes
    /// are held once).
    kv_blocks: usize,
    held: HashMap<u64, u32>,
    /// Sequences sent back to the queue for lack of KV space (recomputed when readmitted).
    pub preempted: u64,
}

impl Engine {
    fn new(speed: Speed, kv_blocks: usize, shape: EngineShape) -> Self {
        Engine {
            speed,
            shape,
            cache: ServerCache::new(kv_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            step_end: None,
            in_step: Vec::new(),
            computed_tokens: 0,
            kv_blocks,
            held: HashMap::new(),
            preempted: 0,
        }
    }

    /// KV blocks the running sequences hold.
    fn used_blocks(&self) -> usize {
        self.held.len()
            + self
                .running
                .iter()
                .map(|s| s.blocks.len() - s.shared.len() + s.tail_blocks(self.shape.block_tokens))
                .sum::<usize>()
    }

    /// Blocks `s` would add to the running batch: its cached prefix's blocks no running sequence
    /// holds, and its own copies of the rest.
    fn new_blocks(&self, s: &Seq) -> usize {
        let hits = self.cache.hits(&s.blocks);
        s.blocks[..hits]
            .iter()
            .filter(|b| !self.held.contains_key(b))
            .count()
            + (s.blocks.len() - hits)
            + s.tail_blocks(self.shape.block_tokens)
            + 1
    }

    fn hold(&mut self, blocks: &[u64]) {
        for &b in blocks {
            *self.held.entry(b).or_default() += 1;
        }
    }

    fn unhold(&mut self, blocks: &[u64]) {
        for b in blocks {
            if let Some(n) = self.held.get_mut(b) {
                *n -= 1;
                if *n == 0 {
                    self.held.remove(b);
                }
            }
        }
    }

    /// Plans the next step starting at `now` (if there is work).
    fn plan(&mut self, now: f64, hit_tokens: &mut u64) {
        // Out of KV space, the newest sequence goes back to the head of the queue, to be
        // recomputed (vLLM's recompute preemption).
        while self.running.len() > 1 && self.used_blocks() > self.kv_blocks {
            let newest = (0..self.running.len())
                .max_by(|&a, &b| {
                    let (a, b) = (&self.running[a], &self.running[b]);
                    a.arrival_ms.partial_cmp(&b.arrival_ms).unwrap()
                })
                .unwrap();
            let mut s = self.running.swap_remove(newest);
            let shared = std::mem::take(&mut s.shared);
            self.unhold(&shared);
            self.preempted += 1;
            self.waiting.push_front(s);
        }
        // With vLLM's budget, the running sequences take theirs first (a token per decode, the
        // next chunk per prefill) and the queue is admitted only while some is left.
        let mut left = self.shape.step_token_budget;
        if self.shape.vllm_budget {
            for s in &self.running {
                left = left.saturating_sub(s.prefill_left.max(1));
            }
        }
        // Admit from the queue in FIFO order while the batch has room and KV space.
        while self.running.len() < self.shape.max_num_seqs {
            if self.shape.vllm_budget && left == 0 {
                break;
            }
            let Some(s) = self.waiting.front() else {
                break;
            };
            if !self.running.is_empty() && self.used_blocks() + self.new_blocks(s) > self.kv_blocks
            {
                break;
            }
            let mut s = self.waiting.pop_front().unwrap();
            let hit_blocks = self.cache.hits(&s.blocks);
            let hits =
                (hit_blocks as u64 * self.shape.block_tokens).min(s.prompt.saturating_sub(1));
            // A preempted sequence recomputes what it had generated too.
            let first = !s.started;
            if first {
                *hit_tokens += hits;
                s.admitted_ms = Some(now);
            }
            s.prefill_left = s.prompt - hits + u64::from(s.produced);
            if first {
                s.uncached = s.prefill_left;
            }
            self.computed_tokens += s.prefill_left;
            left = left.saturating_sub(s.prefill_left);
            // The cached prefix is shared now; the rest is this sequence's own until computed.
            self.cache.prefill(&s.blocks[..hit_blocks]);
            s.shared = s.blocks[..hit_blocks].to_vec();
            self.hold(&s.blocks[..hit_blocks]);
            s.started = true;
            self.running.push(s);
        }
        let mut budget = self.shape.step_token_budget;
        if self.shape.vllm_budget {
            let decoding = self.running.iter().filter(|s| s.prefill_left == 0).count() as u64;
            budget = budget.saturating_sub(decoding);
        }
        let full = budget;
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
        let prefill_tokens = full - budget;
        if !self.in_step.is_empty() && decoding > 0 {
            // Who held up the sequences decoding in this step, for the receipts.
            let per = self.speed.prefill_us_per_token / 1000.0;
            let by: Vec<(u64, f64)> = self
                .in_step
                .iter()
                .map(|&(i, take)| (self.running[i].lease, take as f64 * per))
                .collect();
            for s in self.running.iter_mut().filter(|s| s.prefill_left == 0) {
                s.stalled_by.extend_from_slice(&by);
            }
        }
        let ms = self.speed.step_ms
            + self.speed.per_seq_ms * decoding as f64
            + self.speed.prefill_us_per_token * prefill_tokens as f64 / 1000.0;
        self.step_end = Some(now + ms);
    }

    /// Applies the step that ends at `now`; returns finished sequences.
    fn finish_step(&mut self, now: f64) -> Vec<Seq> {
        for k in 0..self.in_step.len() {
            let (i, take) = self.in_step[k];
            self.running[i].prefill_left -= take;
            if self.running[i].prefill_left == 0 {
                // Computed: its blocks enter the prefix cache, and those no one else holds
                // become shared (a copy computed alongside another's stays its own).
                let blocks = self.running[i].blocks.clone();
                self.cache.prefill(&blocks);
                let from = self.running[i].shared.len();
                for &b in &blocks[from..] {
                    if let std::collections::hash_map::Entry::Vacant(e) = self.held.entry(b) {
                        e.insert(1);
                        self.running[i].shared.push(b);
                    }
                }
            }
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
                s.first_token_ms = Some(now);
            }
        }
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].prefill_left == 0
                && self.running[i].produced >= self.running[i].output
            {
                let s = self.running.swap_remove(i);
                self.unhold(&s.shared);
                done.push(s);
            } else {
                i += 1;
            }
        }
        done
    }
}

/// What a client sends next.
pub trait Workload {
    fn clients(&self) -> usize;
    /// The next request of `client`, or `None` when it is done.
    fn next(&mut self, client: usize, rng: &mut SplitMix64) -> Option<(RequestFeatures, u32)>;
    /// The answer to `client`'s last request (multi-turn appends it to the history).
    fn answered(&mut self, _client: usize, _rng: &mut SplitMix64) {}
    /// A replayed trace's arrival times (ms), one per client, each client sending one request
    /// then; `None` for closed or Poisson loops.
    fn arrivals(&self) -> Option<Vec<f64>> {
        None
    }
}

/// About `tokens` tokens of filler.
pub fn words(rng: &mut SplitMix64, tokens: usize) -> String {
    super::text(rng, tokens * 4)
}

pub fn features(body: serde_json::Value, key: Option<String>) -> RequestFeatures {
    let mut f = request_features(&body, &|_| None, &FeatureConfig::default()).unwrap();
    f.routing_key = key;
    f.stream = true;
    f
}

pub struct MultiTurn {
    system: String,
    histories: Vec<Vec<serde_json::Value>>,
    turns_left: Vec<u32>,
    max_tokens: u32,
    last_output: Vec<u32>,
    question_tokens: usize,
    /// Every answer this long (`None`: 32 to 128 tokens, ending at EOS).
    fixed_output: Option<u32>,
}

impl MultiTurn {
    /// 1,000-token system prompt, 80-token questions, answers of 32 to 128 tokens.
    pub fn new(users: usize, turns: u32, rng: &mut SplitMix64) -> Self {
        Self::shaped(users, turns, 1_000, 80, None, rng)
    }

    /// A chat of the given shape (`make bench`'s `chat`: 1,000, 48 and `Some(48)`).
    pub fn shaped(
        users: usize,
        turns: u32,
        system_tokens: usize,
        question_tokens: usize,
        fixed_output: Option<u32>,
        rng: &mut SplitMix64,
    ) -> Self {
        MultiTurn {
            system: words(rng, system_tokens),
            histories: vec![Vec::new(); users],
            turns_left: vec![turns; users],
            max_tokens: fixed_output.unwrap_or(128),
            last_output: vec![0; users],
            question_tokens,
            fixed_output,
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
        let question = words(rng, self.question_tokens);
        self.histories[c].push(json!({"role": "user", "content": question}));
        let mut messages = vec![json!({"role": "system", "content": self.system})];
        messages.extend(self.histories[c].iter().cloned());
        let body = json!({"model": "m", "max_tokens": self.max_tokens, "messages": messages});
        // Answers end at EOS before max_tokens: 32 to 128 tokens.
        self.last_output[c] = self
            .fixed_output
            .unwrap_or_else(|| 32 + rng.below(97) as u32);
        Some((
            features(body, Some(format!("user-{c}"))),
            self.last_output[c],
        ))
    }

    fn answered(&mut self, c: usize, rng: &mut SplitMix64) {
        let answer = words(rng, self.last_output[c] as usize);
        self.histories[c].push(json!({"role": "assistant", "content": answer}));
    }
}

pub struct Groups {
    prompts: Vec<String>,
    clients: usize,
    sent: usize,
    total: usize,
    window: usize,
    /// `make bench`'s shape: no routing key, the newest group the hottest (Zipf s = 1 over the
    /// active groups by recency), 32-token questions and 48-token answers.
    bench_shape: bool,
}

impl Groups {
    pub fn new(groups: usize, clients: usize, total: usize, rng: &mut SplitMix64) -> Self {
        Groups {
            prompts: (0..groups).map(|_| words(rng, 1_200)).collect(),
            clients,
            sent: 0,
            total,
            window: 8,
            bench_shape: false,
        }
    }

    /// `make bench`'s `prefix-groups`: 1,200-token group prompts, 8 groups at the start and the
    /// others appearing evenly over the run, requests picking an active group by recency (Zipf).
    pub fn bench(groups: usize, clients: usize, total: usize, rng: &mut SplitMix64) -> Self {
        Groups {
            bench_shape: true,
            ..Self::new(groups, clients, total, rng)
        }
    }

    fn pick_bench(&self, rng: &mut SplitMix64) -> usize {
        let initial = self.window;
        let arriving = self.prompts.len() - initial;
        // The last group appears at 8/9 of the run.
        let active = initial + (self.sent * 9 * arriving / (8 * self.total)).min(arriving);
        let weights: Vec<f64> = (1..=active).map(|r| 1.0 / r as f64).collect();
        let mut x = rng.unit() * weights.iter().sum::<f64>();
        for (r, w) in weights.iter().enumerate() {
            if x < *w {
                return active - 1 - r;
            }
            x -= w;
        }
        active - 1
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
        if self.bench_shape {
            let g = self.pick_bench(rng);
            self.sent += 1;
            let body = json!({"model": "m", "max_tokens": 48, "messages": [
                {"role": "system", "content": self.prompts[g]},
                {"role": "user", "content": words(rng, 32)},
            ]});
            return Some((features(body, None), 48));
        }
        let newest = (self.sent * self.prompts.len() / self.total).max(self.window - 1);
        let g = newest - rng.below(self.window as u64) as usize;
        self.sent += 1;
        let body = json!({"model": "m", "max_tokens": 64, "messages": [
            {"role": "system", "content": self.prompts[g]},
            {"role": "user", "content": words(rng, 40)},
        ]});
        Some((
            features(body, Some(format!("group-{g}"))),
            16 + rng.below(49) as u32,
        ))
    }
}

/// What happened to one request, and what the router predicted for it (the grant's receipt):
/// where its time to first token went and what the engines it chose between held when it came.
#[derive(Debug, Clone, Default)]
pub struct Record {
    pub arrival_ms: f64,
    pub backend: usize,
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    /// From the grant until its engine admitted it to the running batch (vLLM's queue).
    pub queue_ms: f64,
    /// From admission to its first token: its prefill, sharing steps with others'.
    pub prefill_ms: f64,
    /// From its first token to its last.
    pub decode_ms: f64,
    pub prompt: u64,
    pub uncached: u64,
    pub output: u32,
    /// The receipt: predicted TTFT on the chosen backend, the best alternative and its.
    pub predicted_ttft_ms: f64,
    pub alt: Option<usize>,
    pub alt_predicted_ttft_ms: f64,
    /// The chosen and the alternative engine's queue and running batch when it was granted.
    pub chosen_state: (usize, usize),
    pub alt_state: (usize, usize),
    /// With `ROUTE_AHEAD`'s guess (one gateway isolate, `routing_core::pool::guess`): whether a
    /// fetch would have been sent beside the lease call, and if so whether the grant kept it.
    pub ahead: Option<bool>,
    /// Its lease, and the leases whose prefill ran in its decode's steps with how long (ms).
    pub lease: u64,
    pub stalled_by: Vec<(u64, f64)>,
}

pub struct Report {
    pub ttft_p50: f64,
    pub ttft_p90: f64,
    pub ttft_p99: f64,
    pub e2e_p50: f64,
    pub e2e_p99: f64,
    pub throughput: f64,
    pub hit_rate: f64,
    pub busiest_over_mean: f64,
    /// Preemptions per 100 requests.
    pub preempted: f64,
    /// Every request, for the receipts' analysis (left out of `Debug`).
    pub records: Vec<Record>,
}

impl std::fmt::Debug for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TTFT p50 {:.1} p90 {:.1} p99 {:.1} | e2e p50 {:.1} p99 {:.1} | {:.2} req/s | \
             hit {:.3} | busiest/mean {:.2} | preempted {:.1}%",
            self.ttft_p50,
            self.ttft_p90,
            self.ttft_p99,
            self.e2e_p50,
            self.e2e_p99,
            self.throughput,
            self.hit_rate,
            self.busiest_over_mean,
            self.preempted
        )
    }
}

/// The round trip between the gateway's edge and a pool (`SIM_RTT_MS`, default 50 ms): what a
/// request pays once more when its backend fetch waits for the lease call.
pub fn sim_rtt_ms() -> f64 {
    std::env::var("SIM_RTT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50.0)
}

pub fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// The simulated gateway: one coordinator, or `shards` of them that exchange load reports every
/// `exchange_ms` of simulated time; how much a busy gateway delays each answer's first and last
/// byte on top of the network (uniform in `[0, busy_jitter_ms]`, as measured at 64 clients on 2
/// cores by `make bench`); and whether clients wait for answers (closed loop) or requests arrive
/// at `open_rate` regardless (open loop).
#[derive(Debug, Clone, Copy)]
pub struct Conditions {
    pub shards: u32,
    pub exchange_ms: u64,
    pub busy_jitter_ms: f64,
    /// Requests arrive as a Poisson process at this rate (per second) instead of each client
    /// sending its next request after a think time (0: closed loop).
    pub open_rate: f64,
    /// A closed-loop client's think time before its next request: uniform in this range (ms).
    pub think_ms: [f64; 2],
    /// How long a busy gateway takes, after the grant, to deliver the request to its engine:
    /// uniform in `[0, dispatch_jitter_ms]`.
    pub dispatch_jitter_ms: f64,
    /// The engines' blocks, step budget and batch limit.
    pub engine: EngineShape,
}

impl Conditions {
    /// The exact single coordinator on an idle gateway.
    pub const SINGLE: Conditions = Conditions {
        shards: 1,
        exchange_ms: shard::DEFAULT_EXCHANGE_MS,
        busy_jitter_ms: 0.0,
        open_rate: 0.0,
        think_ms: [20.0, 220.0],
        dispatch_jitter_ms: 0.0,
        engine: EngineShape::SIM16,
    };
}

/// Runs `workload` on engines of `speeds` behind pools routing by `policy`; returns the report and
/// the coordinators (one per shard).
pub fn simulate(
    policy: PolicyKind,
    workload: &mut dyn Workload,
    speeds: &[Speed],
    kv_blocks: usize,
    seed: u64,
    conditions: Conditions,
) -> (Report, Vec<Pool>) {
    let capacity = Capacity {
        kv_blocks: kv_blocks as u64,
        block_size: conditions.engine.block_tokens as u32,
        max_num_seqs: conditions.engine.max_num_seqs as u32,
        kv_tokens: 0,
    };
    let shards = conditions.shards.max(1);
    let mut pools: Vec<Pool> = (0..shards)
        .map(|s| {
            let mut pool = super::fleet(policy, speeds.len(), capacity);
            pool.set_shard(s, shards, conditions.exchange_ms);
            pool
        })
        .collect();
    let index: HashMap<BackendId, usize> = (0..speeds.len())
        .map(|b| (BackendId::from(format!("gpu-{b}")), b))
        .collect();
    let mut engines: Vec<Engine> = speeds
        .iter()
        .map(|&s| Engine::new(s, kv_blocks, conditions.engine))
        .collect();
    let mut rng = SplitMix64::new(seed);
    let mut wrng = SplitMix64::new(seed ^ 0x77);
    let scheduled = workload.arrivals();
    let open = conditions.open_rate > 0.0 || scheduled.is_some();
    let mut arrivals = SplitMix64::new(seed ^ 0x0a11);
    let mut pending: Vec<(f64, usize)> = if let Some(times) = &scheduled {
        // Reversed, so the earliest is at the end (popped first).
        times
            .iter()
            .copied()
            .enumerate()
            .map(|(c, t)| (t, c))
            .rev()
            .collect()
    } else if open {
        vec![(0.0, 0)]
    } else {
        (0..workload.clients())
            .map(|c| (c as f64 * 7.0, c))
            .collect()
    };
    // The shard that granted each live lease.
    let mut lease_shard: HashMap<u64, usize> = HashMap::new();
    let mut next_exchange = if shards > 1 {
        conditions.exchange_ms as f64
    } else {
        f64::INFINITY
    };
    let (mut ttfts, mut e2es) = (Vec::new(), Vec::new());
    let (mut hit_tokens, mut prompt_tokens) = (0u64, 0u64);
    let mut now;
    let mut last_end = 0.0f64;
    let jitter_ms = conditions.busy_jitter_ms;
    let mut jrng = SplitMix64::new(seed ^ 0x1177);
    // Granted requests on their way to an engine: (arrival, engine, sequence).
    let mut in_transit: Vec<(f64, usize, Seq)> = Vec::new();
    let mut drng = SplitMix64::new(seed ^ 0xd15a);
    let mut records: HashMap<u64, Record> = HashMap::new();
    let mut done_records: Vec<Record> = Vec::new();
    let trace_timing =
        std::env::var("SIM_TIMING").is_ok() && policy == PolicyKind::PredictedLatency;
    let mut next_timing = 0.0;
    let mut guesses = GuessBook::new();
    let route_ahead_rtt = std::env::var("SIM_ROUTE_AHEAD")
        .is_ok()
        .then(|| sim_rtt_ms() as u32);
    loop {
        // A replayed trace's arrivals are sorted (the earliest last): no scan over thousands.
        let next_arrival = if scheduled.is_some() {
            pending.len().checked_sub(1).map(|i| (i, &pending[i]))
        } else {
            pending
                .iter()
                .enumerate()
                .min_by(|a, b| a.1 .0.partial_cmp(&b.1 .0).unwrap())
        };
        let next_step = engines
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.step_end.map(|t| (t, i)))
            .min_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
        let next_delivery = in_transit
            .iter()
            .enumerate()
            .min_by(|a, b| a.1 .0.partial_cmp(&b.1 .0).unwrap())
            .map(|(i, d)| (d.0, i));
        if next_arrival.is_none() && next_step.is_none() && next_delivery.is_none() {
            break;
        }
        // A request the gateway granted reaches its engine.
        if let Some((at, i)) = next_delivery {
            let before_arrival = next_arrival.is_none_or(|(_, &(a, _))| at <= a);
            if before_arrival && next_step.is_none_or(|(t, _)| at <= t) && at < next_exchange {
                let (_, b, seq) = in_transit.swap_remove(i);
                now = at;
                let e = &mut engines[b];
                e.waiting.push_back(seq);
                if e.step_end.is_none() {
                    e.plan(now, &mut hit_tokens);
                }
                continue;
            }
        }
        let first_event = next_arrival
            .map(|(_, &(at, _))| at)
            .into_iter()
            .chain(next_step.map(|(t, _)| t))
            .fold(f64::INFINITY, f64::min);
        if next_exchange <= first_event {
            now = next_exchange;
            let reports: Vec<_> = pools
                .iter_mut()
                .map(|p| p.load_report(now as u64))
                .collect();
            for (i, pool) in pools.iter_mut().enumerate() {
                for (j, report) in reports.iter().enumerate() {
                    if i != j {
                        pool.accept_load_report(report.clone(), now as u64);
                    }
                }
            }
            next_exchange += conditions.exchange_ms as f64;
            continue;
        }
        match (next_arrival, next_step) {
            (Some((pi, &(at, client))), step) if step.is_none_or(|(t, _)| at <= t) => {
                if scheduled.is_some() {
                    pending.pop();
                } else {
                    pending.swap_remove(pi);
                }
                now = at;
                let Some((f, output)) = workload.next(client, &mut wrng) else {
                    continue;
                };
                if open && scheduled.is_none() {
                    // The next arrival, whoever it is: exponential gaps at the open rate.
                    let gap = -(1.0 - arrivals.unit()).ln() * 1000.0 / conditions.open_rate;
                    pending.push((now + gap, (client + 1) % workload.clients()));
                }
                let s = shard::shard_for(
                    shards,
                    f.routing_key.as_deref(),
                    f.block_hashes.first().copied(),
                    rng.next_u64(),
                ) as usize;
                if trace_timing && now >= next_timing {
                    next_timing += 250.0;
                    let views: Vec<String> = pools[0]
                        .backends()
                        .map(|v| {
                            format!(
                                "{:.0}/{:.0}/{:.0}/{}k/{}",
                                v.timing.prefill_us_per_token,
                                v.timing.overhead_ms,
                                v.timing.prefill_backlog_ms,
                                v.inflight_prompt_tokens / 1000,
                                v.leases_in_flight
                            )
                        })
                        .collect();
                    let real: Vec<String> = engines
                        .iter()
                        .map(|e| {
                            format!(
                                "{}+{}/{}k",
                                e.waiting.len(),
                                e.running.len(),
                                e.used_blocks() as u64 * e.shape.block_tokens / 1000
                            )
                        })
                        .collect();
                    println!(
                        "      t={now:.0} us/tok/overhead/backlog {} | engine {}",
                        views.join(" "),
                        real.join(" ")
                    );
                }
                let place = Place::new("sim", s as u32, &f.model);
                let guess = guesses.guess(&place, &f.block_hashes, now as u64);
                // With `SIM_ROUTE_AHEAD`, the guessed backend is told to the pool as sent to,
                // the others a re-send (`SIM_RTT_MS`) away.
                let mut f = f;
                if let (Some(rtt), Some(g)) = (route_ahead_rtt, guess.as_ref().filter(|g| g.send)) {
                    f.sent_ahead = Some(SentAhead {
                        backend: g.backend.id.0.clone(),
                        resend_ms: rtt,
                    });
                    guesses.sending(&place);
                }
                let grant = pools[s].acquire(&f, now as u64, &mut rng).unwrap();
                let alt_id = grant.receipt.as_ref().and_then(|r| r.alt.clone());
                let learned = Learned {
                    backend: &grant.candidates[0],
                    paired: false,
                    queued: false,
                    alt: alt_id
                        .as_ref()
                        .and_then(|a| grant.candidates.iter().find(|c| &c.id == a)),
                    alt_margin_ms: grant.receipt.as_ref().and_then(|r| {
                        Some(r.alt_predicted_ttft_ms?.saturating_sub(r.predicted_ttft_ms))
                    }),
                    prices_resend: policy == PolicyKind::PredictedLatency,
                };
                let guessed = guess.as_ref().map(|g| Scored {
                    backend: &g.backend.id,
                    sent: g.send && route_ahead_rtt.is_some(),
                    resend_ms: route_ahead_rtt.unwrap_or(0),
                });
                guesses.granted(&place, &f.block_hashes, learned, guessed, now as u64);
                let ahead = guess
                    .filter(|g| g.send && route_ahead_rtt.is_some())
                    .map(|g| g.backend.id == grant.backend);
                lease_shard.insert(grant.lease_id, s);
                let b = index[&grant.backend];
                prompt_tokens += u64::from(f.prompt_tokens);
                let state = |e: &Engine| (e.waiting.len(), e.running.len());
                let receipt = grant.receipt.clone().unwrap_or_default();
                let alt = receipt.alt.as_ref().map(|a| index[a]);
                records.insert(
                    grant.lease_id,
                    Record {
                        arrival_ms: now,
                        backend: b,
                        prompt: u64::from(f.prompt_tokens),
                        output,
                        predicted_ttft_ms: f64::from(receipt.predicted_ttft_ms),
                        alt,
                        alt_predicted_ttft_ms: receipt.alt_predicted_ttft_ms.map_or(0.0, f64::from),
                        chosen_state: state(&engines[b]),
                        alt_state: alt.map_or((0, 0), |a| state(&engines[a])),
                        ahead,
                        ..Record::default()
                    },
                );
                let seq = Seq {
                    client,
                    lease: grant.lease_id,
                    blocks: conditions.engine.engine_blocks(&f.block_hashes),
                    prompt: u64::from(f.prompt_tokens),
                    prefill_left: 0,
                    started: false,
                    output,
                    produced: 0,
                    arrival_ms: now,
                    ttft_ms: None,
                    uncached: 0,
                    shared: Vec::new(),
                    admitted_ms: None,
                    first_token_ms: None,
                    stalled_by: Vec::new(),
                };
                let delay = conditions.dispatch_jitter_ms * drng.unit();
                if delay > 0.0 {
                    in_transit.push((now + delay, b, seq));
                } else {
                    let e = &mut engines[b];
                    e.waiting.push_back(seq);
                    if e.step_end.is_none() {
                        e.plan(now, &mut hit_tokens);
                    }
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
                    if let Some(mut r) = records.remove(&s.lease) {
                        let admitted = s.admitted_ms.unwrap_or(s.arrival_ms);
                        let first = s.first_token_ms.unwrap_or(now);
                        r.ttft_ms = ttft;
                        r.e2e_ms = e2e;
                        r.queue_ms = admitted - s.arrival_ms;
                        r.prefill_ms = first - admitted;
                        r.decode_ms = now - first;
                        r.uncached = s.uncached;
                        r.lease = s.lease;
                        r.stalled_by = s.stalled_by;
                        done_records.push(r);
                    }
                    // The gateway measures the first byte a network hop later than the engine,
                    // and a busy gateway later still (its own delay, the same on the last byte).
                    let delay = jitter_ms * jrng.unit();
                    let outcome = Outcome {
                        ttfb_ms: Some((ttft + NETWORK_MS + delay) as u64),
                        completion_tokens: Some(s.produced),
                        ..Outcome::from_status(200)
                    };
                    let shard = lease_shard.remove(&s.lease).unwrap();
                    assert!(pools[shard].release(
                        s.lease,
                        &outcome,
                        (now + NETWORK_MS + delay) as u64
                    ));
                    workload.answered(s.client, &mut wrng);
                    if !open {
                        let [lo, hi] = conditions.think_ms;
                        pending.push((now + lo + (hi - lo) * wrng.unit(), s.client));
                    }
                    debug_assert!(s.started);
                }
                engines[b].plan(now, &mut hit_tokens);
                last_end = now;
            }
            _ => unreachable!(),
        }
    }
    for pool in &pools {
        pool.check_counters().unwrap();
    }
    let computed: Vec<f64> = engines.iter().map(|e| e.computed_tokens as f64).collect();
    let mean = computed.iter().sum::<f64>() / computed.len() as f64;
    let n = ttfts.len() as f64;
    let report = Report {
        ttft_p50: pct(&mut ttfts, 0.5),
        ttft_p90: pct(&mut ttfts, 0.9),
        ttft_p99: pct(&mut ttfts, 0.99),
        e2e_p50: pct(&mut e2es, 0.5),
        e2e_p99: pct(&mut e2es, 0.99),
        throughput: n / (last_end / 1000.0),
        hit_rate: hit_tokens as f64 / prompt_tokens as f64,
        busiest_over_mean: computed.iter().cloned().fold(0.0, f64::max) / mean,
        preempted: 100.0 * engines.iter().map(|e| e.preempted).sum::<u64>() as f64 / n,
        records: done_records,
    };
    (report, pools)
}

/// `make`'s workload through `policy` on engines of `speeds`, averaged over `seeds` seeds (one
/// run's p99 rests on a handful of requests).
pub fn averaged(
    policy: PolicyKind,
    make: &dyn Fn(u64) -> Box<dyn Workload>,
    speeds: &[Speed],
    kv_blocks: usize,
    gateway: Conditions,
    seeds: u64,
) -> Report {
    // `SIM_RNG` shifts the pools' random seeds: the same windows under other coin tosses, to see
    // how much of a difference between two runs is chance.
    let rng_shift: u64 = std::env::var("SIM_RNG")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let runs: Vec<Report> = (0..seeds)
        .map(|seed| {
            let mut w = make(seed);
            simulate(
                policy,
                w.as_mut(),
                speeds,
                kv_blocks,
                0x5eed + seed + rng_shift * 1_000,
                gateway,
            )
            .0
        })
        .collect();
    if std::env::var("SIM_VERBOSE").is_ok() {
        let p99: Vec<String> = runs.iter().map(|r| format!("{:.0}", r.ttft_p99)).collect();
        let e2e: Vec<String> = runs.iter().map(|r| format!("{:.0}", r.e2e_p99)).collect();
        println!(
            "    {} TTFT p99 by window: {}; e2e p99: {}",
            policy.as_str(),
            p99.join(" "),
            e2e.join(" ")
        );
    }
    let mean = |f: &dyn Fn(&Report) -> f64| runs.iter().map(f).sum::<f64>() / runs.len() as f64;
    Report {
        ttft_p50: mean(&|r| r.ttft_p50),
        ttft_p90: mean(&|r| r.ttft_p90),
        ttft_p99: mean(&|r| r.ttft_p99),
        e2e_p50: mean(&|r| r.e2e_p50),
        e2e_p99: mean(&|r| r.e2e_p99),
        throughput: mean(&|r| r.throughput),
        hit_rate: mean(&|r| r.hit_rate),
        busiest_over_mean: mean(&|r| r.busiest_over_mean),
        preempted: mean(&|r| r.preempted),
        records: runs.into_iter().flat_map(|r| r.records).collect(),
    }
}
