//! The engine's scheduler: continuous batching over the KV cache, modelled on vLLM V1's scheduler,
//! plus the time each step takes. Pure logic: no clocks, channels or tasks (see [`crate::engine`]).
//!
//! **Each step** first gives every running sequence its tokens (one for a decode, the next chunk for a
//! prefill), allocating KV blocks as they grow; when blocks run out, the most recently admitted running
//! sequence is preempted (its blocks are freed and it goes back to the front of the queue, to be
//! recomputed later, mostly from the prefix cache). If nothing was preempted, waiting sequences are
//! then admitted in FIFO order while fewer than `max_num_seqs` run, the step's token budget
//! (`max_num_batched_tokens`) lasts and their blocks fit. An admitted sequence's leading full blocks
//! found in the prefix cache count as computed, except that the last prompt token is always computed
//! (as in vLLM, a fully cached prompt still runs one token). A decode server given verified
//! `kv_transfer_params` also counts the prompt as computed remotely ([`SequenceSpec::remote_prefill`]).
//!
//! **A step's duration** is `decode_ms_per_step + decode_ms_per_seq * decode sequences +
//! prefill_us_per_token * prefill tokens` ([`StepTiming`]): the weights are read once per step, every
//! sequence in the batch adds attention and sampling work, and prefill is compute-bound per token.
//!
//! **After the step** every sequence whose tokens are all computed samples one token; blocks that
//! became full and computed are registered in the prefix cache (generated blocks too); sequences that
//! hit EOS, a stop string, their `max_tokens` or `max_model_len` finish and release their blocks.

use std::collections::{HashMap, VecDeque};

use crate::kv_cache::{block_hashes, extend_block_hashes, BlockHash, BlockId, BlockPool};
use crate::sampler::SplitMix64;
use crate::stop::StopChecker;
use crate::tokenizer::{count_tokens, piece};

/// Identifies a sequence inside the engine.
pub type SeqId = u64;

/// How long a step takes, in simulated microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTiming {
    /// Fixed cost of one forward pass (reading the weights).
    pub base_us: f64,
    /// Extra cost per decoding sequence in the batch.
    pub per_decode_seq_us: f64,
    /// Cost per prompt token computed in the step.
    pub per_prefill_token_us: f64,
}

impl StepTiming {
    /// Duration of a step with `decode_seqs` decodes and `prefill_tokens` prompt tokens.
    pub fn step_us(&self, decode_seqs: usize, prefill_tokens: u32) -> f64 {
        self.base_us
            + self.per_decode_seq_us * decode_seqs as f64
            + self.per_prefill_token_us * f64::from(prefill_tokens)
    }
}

/// Limits and timing of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// At most this many sequences run at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Tokens computed per step at most (`--max-num-batched-tokens`); longer prompts are chunked.
    pub max_num_batched_tokens: u32,
    /// Blocks in the KV cache (`--kv-blocks`).
    pub num_blocks: u32,
    /// Tokens per block (`--block-size`).
    pub block_size: u32,
    /// Longest sequence, prompt plus output (`--max-model-len`).
    pub max_model_len: u32,
    /// Step duration model.
    pub timing: StepTiming,
}

/// What a new sequence needs, already validated by the API layer.
#[derive(Debug, Clone, Default)]
pub struct SequenceSpec {
    /// The rendered prompt.
    pub prompt: Vec<u8>,
    /// Output tokens at most (`max_tokens` / `max_completion_tokens` or the default).
    pub max_output_tokens: u32,
    /// No EOS and no stop string before this many output tokens.
    pub min_tokens: u32,
    /// The output token that is EOS, if EOS is not ignored (see [`crate::sampler::eos_after`]).
    pub eos_after: Option<u32>,
    /// Stop strings.
    pub stops: Vec<String>,
    /// Seed of the generated text.
    pub text_seed: u64,
    /// Verified `kv_transfer_params` from a prefill server: the prompt's KV arrives remotely.
    pub remote_prefill: bool,
    /// Report the sequence's block ids when it finishes (a prefill server's hand-off).
    pub report_blocks: bool,
    /// Emit text as it is generated (streaming) rather than only at the end.
    pub stream: bool,
    /// Fault: after this many output tokens the sequence stops computing and sampling but keeps its
    /// slot and blocks (a hung engine), until it is aborted.
    pub stall_after: Option<u32>,
}

/// Why a sequence finished, as `finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens`, `max_model_len` or a KV cache too small to grow the sequence.
    Length,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// The end of a sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    /// `finish_reason`.
    pub reason: FinishReason,
    /// The stop string that ended it, if any (`stop_reason`).
    pub stop_reason: Option<String>,
    /// Text not delivered yet: the whole output when not streaming, else the held-back tail.
    pub text: String,
    /// Prompt tokens (`usage.prompt_tokens`).
    pub prompt_tokens: u32,
    /// Output tokens (`usage.completion_tokens`).
    pub output_tokens: u32,
    /// Prompt tokens served from the local prefix cache on first admission.
    pub cached_tokens: u32,
    /// The blocks holding the sequence, when [`SequenceSpec::report_blocks`] was set.
    pub block_ids: Vec<BlockId>,
    /// Arrival at the engine to the first token, ms (set by the engine, which times its clients).
    pub engine_ttft_ms: Option<f64>,
    /// Where that time went (set by the engine with `engine_ttft_ms`).
    pub engine_split: Option<EngineSplit>,
}

/// A sequence's engine time to first token in four parts that add up to it, ms (wall clock). Its
/// *prefill steps* are the steps that computed its prompt, up to and including the one that
/// sampled its first token; a step's cost is shared out as the step model adds it up
/// (`StepTiming`), each part's share of the modelled duration times the step's wall time:
///
/// - `queue_ms`: arrival at the engine to the start of its first prefill step (waiting for a free
///   slot, KV blocks, or the token budget of the steps before);
/// - `decode_interference_ms`: the decoding sequences' share of its prefill steps
///   (`decode_ms_per_seq x decodes`);
/// - `shared_prefill_ms`: other prompts' tokens' share of its prefill steps
///   (`prefill_us_per_token x their tokens`): head-of-line prefill in the same batch;
/// - `prefill_ms`: the rest: its own prompt tokens, each step's fixed cost, and any step between
///   its chunks that left it out (preemption).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineSplit {
    /// Arrival to its first prefill step, ms.
    pub queue_ms: f64,
    /// Its own share of its prefill steps (and any pause between them), ms.
    pub prefill_ms: f64,
    /// Other prompts' share of its prefill steps, ms.
    pub shared_prefill_ms: f64,
    /// Decoding sequences' share of its prefill steps, ms.
    pub decode_interference_ms: f64,
}

/// What one sequence produced in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqOutput {
    /// Which sequence.
    pub id: SeqId,
    /// Whether this step produced its first token (every step that samples a token reports it).
    pub first_token: bool,
    /// New text to stream (streaming sequences only; may be empty while text is held back).
    pub delta: Option<String>,
    /// Output tokens so far.
    pub output_tokens: u32,
    /// Set when the sequence finished.
    pub finish: Option<Finish>,
}

/// The work of one step, returned by [`Scheduler::schedule`] and handed back to
/// [`Scheduler::complete`].
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    /// Sequences and how many tokens each computes.
    pub work: Vec<(SeqId, u32)>,
    /// Decoding sequences in the batch.
    pub decode_seqs: usize,
    /// Prompt (or recomputed) tokens in the batch.
    pub prefill_tokens: u32,
    /// Simulated duration of the step.
    pub duration_us: f64,
}

impl StepPlan {
    /// Whether the step does nothing.
    pub fn is_empty(&self) -> bool {
        self.work.is_empty()
    }
}

/// Cumulative counters, published as vLLM's metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerStats {
    /// Prompt tokens of sequences that produced their first token.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Tokens looked up in the prefix cache at admission.
    pub prefix_queries: u64,
    /// Of those, tokens found.
    pub prefix_hits: u64,
    /// Sequences preempted for lack of blocks.
    pub preemptions: u64,
    /// Finished sequences by reason: stop (EOS or stop string), length, abort (client gone).
    pub finished_stop: u64,
    /// See `finished_stop`.
    pub finished_length: u64,
    /// See `finished_stop`.
    pub finished_abort: u64,
}

/// A sequence's state.
#[derive(Debug)]
struct Sequence {
    spec: SequenceSpec,
    /// Prompt bytes followed by the generated pieces.
    bytes: Vec<u8>,
    prompt_tokens: u32,
    output_tokens: u32,
    /// Tokens whose KV is computed.
    computed: u32,
    /// Blocks held, in order.
    blocks: Vec<BlockId>,
    /// Hashes of the full blocks of `bytes`.
    hashes: Vec<BlockHash>,
    /// Leading blocks already registered in (or hit from) the prefix cache.
    registered: usize,
    sampler: SplitMix64,
    text: StopChecker,
    cached_tokens: u32,
    admitted_before: bool,
}

impl Sequence {
    fn total_tokens(&self) -> u32 {
        self.prompt_tokens + self.output_tokens
    }

    /// Whether the stall fault holds the sequence: it computes and samples nothing more.
    fn stalled(&self) -> bool {
        self.spec
            .stall_after
            .is_some_and(|n| self.output_tokens >= n)
    }
}

/// Running and waiting sequences over one block pool.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    pool: BlockPool,
    seqs: HashMap<SeqId, Sequence>,
    running: Vec<SeqId>,
    waiting: VecDeque<SeqId>,
    /// Outputs decided while scheduling (sequences that can never fit), returned by the next
    /// [`Scheduler::complete`].
    pending: Vec<SeqOutput>,
    stats: SchedulerStats,
}

impl Scheduler {
    /// An idle scheduler with an empty cache.
    pub fn new(config: SchedulerConfig) -> Self {
        let pool = BlockPool::new(config.num_blocks);
        Scheduler {
            config,
            pool,
            seqs: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            pending: Vec::new(),
            stats: SchedulerStats::default(),
        }
    }

    /// Queues a new sequence.
    pub fn add(&mut self, id: SeqId, spec: SequenceSpec) {
        let prompt_tokens = count_tokens(spec.prompt.len());
        let hashes = block_hashes(&spec.prompt, self.config.block_size);
        let seq = Sequence {
            bytes: spec.prompt.clone(),
            prompt_tokens,
            output_tokens: 0,
            computed: 0,
            blocks: Vec::new(),
            hashes,
            registered: 0,
            sampler: SplitMix64::new(spec.text_seed),
            text: StopChecker::new(spec.stops.clone()),
            cached_tokens: 0,
            admitted_before: false,
            spec,
        };
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
    }

    /// Removes a sequence whose client went away; frees its blocks. Unknown ids are ignored.
    pub fn abort(&mut self, id: SeqId) {
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        self.pool.release(&seq.blocks);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        self.stats.finished_abort += 1;
    }

    /// Running sequences held by the stall fault.
    pub fn num_stalled(&self) -> usize {
        self.running
            .iter()
            .filter(|id| self.seqs.get(id).is_some_and(Sequence::stalled))
            .count()
    }

    /// Whether nothing is running or waiting.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty() && self.pending.is_empty()
    }

    /// Running sequences.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Waiting (queued or preempted) sequences.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The KV cache.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Cumulative counters.
    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    /// Plans the next step: which sequences compute how many tokens, and how long it takes.
    pub fn schedule(&mut self) -> StepPlan {
        let block_size = self.config.block_size;
        let mut budget = self.config.max_num_batched_tokens;
        let mut plan = StepPlan::default();
        let mut preempted = false;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            if seq.stalled() {
                i += 1;
                continue;
            }
            let n = (seq.total_tokens() - seq.computed).min(budget);
            let is_decode = seq.output_tokens > 0 && n == 1;
            let needed = blocks_for(seq.computed + n, block_size).saturating_sub(seq.blocks.len());
            let mut scheduled = true;
            while self.pool.num_free() < needed {
                if i + 1 < self.running.len() {
                    if let Some(victim) = self.running.pop() {
                        self.preempt(victim);
                        preempted = true;
                    }
                } else if i == 0 {
                    // Alone and still out of blocks: the cache cannot hold this sequence any longer.
                    self.running.remove(i);
                    self.finish_now(id, FinishReason::Length);
                    scheduled = false;
                    break;
                } else {
                    self.running.remove(i);
                    self.preempt(id);
                    preempted = true;
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                continue;
            }
            if needed > 0 {
                let Some(new_blocks) = self.pool.allocate(needed) else {
                    break;
                };
                if let Some(seq) = self.seqs.get_mut(&id) {
                    seq.blocks.extend(new_blocks);
                }
            }
            budget -= n;
            if is_decode {
                plan.decode_seqs += 1;
            } else {
                plan.prefill_tokens += n;
            }
            plan.work.push((id, n));
            i += 1;
        }

        while !preempted && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(seq) = self.seqs.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let total = seq.total_tokens();
            let max_hit_blocks = (total.saturating_sub(1) / block_size.max(1)) as usize;
            let hashes = &seq.hashes[..seq.hashes.len().min(max_hit_blocks)];
            let hits = self.pool.cached_prefix(hashes);
            let hit_tokens = hits.len() as u32 * block_size;
            let mut start = hit_tokens;
            if seq.spec.remote_prefill && !seq.admitted_before {
                start = start.max(seq.prompt_tokens.saturating_sub(1));
            }
            let n = (total - start).min(budget);
            let needed = blocks_for(start + n, block_size).saturating_sub(hits.len());
            if !self.pool.can_allocate(&hits, needed) {
                if self.running.is_empty() && plan.is_empty() {
                    // Even an empty cache cannot hold it.
                    self.waiting.pop_front();
                    self.finish_now(id, FinishReason::Length);
                    continue;
                }
                break;
            }
            self.pool.touch(&hits);
            let new_blocks = self.pool.allocate(needed).unwrap_or_default();
            self.waiting.pop_front();
            self.stats.prefix_queries += u64::from(total);
            self.stats.prefix_hits += u64::from(hit_tokens);
            if let Some(seq) = self.seqs.get_mut(&id) {
                if !seq.admitted_before {
                    seq.cached_tokens = hit_tokens.min(seq.prompt_tokens);
                    seq.admitted_before = true;
                }
                seq.registered = hits.len();
                seq.blocks = hits;
                seq.blocks.extend(new_blocks);
                seq.computed = start;
                let is_decode = seq.output_tokens > 0 && n == 1;
                if is_decode {
                    plan.decode_seqs += 1;
                } else {
                    plan.prefill_tokens += n;
                }
            }
            budget -= n;
            self.running.push(id);
            plan.work.push((id, n));
        }

        plan.duration_us = if plan.is_empty() {
            0.0
        } else {
            self.config
                .timing
                .step_us(plan.decode_seqs, plan.prefill_tokens)
        };
        plan
    }

    /// Applies a finished step: advances computed tokens, samples tokens, registers full blocks in the
    /// prefix cache and finishes sequences. Returns what each sequence produced.
    pub fn complete(&mut self, plan: StepPlan) -> Vec<SeqOutput> {
        let block_size = self.config.block_size;
        let max_model_len = self.config.max_model_len;
        let mut outputs = std::mem::take(&mut self.pending);
        let mut finished = Vec::new();
        for (id, n) in plan.work {
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
            };
            seq.computed += n;
            while seq.registered < seq.hashes.len()
                && seq.registered < seq.blocks.len()
                && (seq.registered as u32 + 1) * block_size <= seq.computed
            {
                self.pool
                    .register(seq.blocks[seq.registered], seq.hashes[seq.registered]);
                seq.registered += 1;
            }
            if seq.computed < seq.total_tokens() || seq.stalled() {
                continue; // a chunked prefill goes on next step; a stalled sequence never does
            }
            let first_token = seq.output_tokens == 0;
            if first_token {
                self.stats.prompt_tokens += u64::from(seq.prompt_tokens);
            }
            seq.output_tokens += 1;
            self.stats.generation_tokens += 1;
            let mut finish = None;
            if seq.spec.eos_after == Some(seq.output_tokens) {
                finish = Some((FinishReason::Stop, None));
            } else {
                let text = piece(seq.sampler.next_u64());
                seq.bytes.extend_from_slice(text.as_bytes());
                extend_block_hashes(&mut seq.hashes, &seq.bytes, block_size);
                let check_stops = seq.output_tokens >= seq.spec.min_tokens;
                if let Some(stop) = seq.text.push(text, check_stops) {
                    finish = Some((FinishReason::Stop, Some(stop)));
                } else if seq.output_tokens >= seq.spec.max_output_tokens
                    || seq.total_tokens() >= max_model_len
                {
                    finish = Some((FinishReason::Length, None));
                }
            }
            let delta = match (&finish, seq.spec.stream) {
                (None, true) => Some(seq.text.take_delta()),
                _ => None,
            };
            let finish = finish.map(|(reason, stop_reason)| {
                finished.push(id);
                Finish {
                    reason,
                    stop_reason,
                    text: seq.text.take_rest(),
                    prompt_tokens: seq.prompt_tokens,
                    output_tokens: seq.output_tokens,
                    cached_tokens: seq.cached_tokens,
                    block_ids: if seq.spec.report_blocks {
                        seq.blocks.clone()
                    } else {
                        Vec::new()
                    },
                    engine_ttft_ms: None,
                    engine_split: None,
                }
            });
            outputs.push(SeqOutput {
                id,
                first_token,
                delta,
                output_tokens: seq.output_tokens,
                finish,
            });
        }
        for output in &outputs {
            if let Some(finish) = &output.finish {
                match finish.reason {
                    FinishReason::Stop => self.stats.finished_stop += 1,
                    FinishReason::Length => self.stats.finished_length += 1,
                }
            }
        }
        if !finished.is_empty() {
            for id in &finished {
                if let Some(seq) = self.seqs.remove(id) {
                    self.pool.release(&seq.blocks);
                }
            }
            self.running.retain(|id| self.seqs.contains_key(id));
        }
        outputs
    }

    /// Frees a running sequence's blocks and puts it back at the front of the queue.
    fn preempt(&mut self, id: SeqId) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            self.pool.release(&seq.blocks);
            seq.blocks.clear();
            seq.computed = 0;
            seq.registered = 0;
            self.waiting.push_front(id);
            self.stats.preemptions += 1;
        }
    }

    /// Finishes a sequence outside a step (it can never fit); the output comes with the next
    /// [`Scheduler::complete`].
    fn finish_now(&mut self, id: SeqId, reason: FinishReason) {
        let Some(mut seq) = self.seqs.remove(&id) else {
            return;
        };
        self.pool.release(&seq.blocks);
        self.pending.push(SeqOutput {
            id,
            first_token: false,
            delta: None,
            output_tokens: seq.output_tokens,
            finish: Some(Finish {
                reason,
                stop_reason: None,
                text: seq.text.take_rest(),
                prompt_tokens: seq.prompt_tokens,
                output_tokens: seq.output_tokens,
                cached_tokens: seq.cached_tokens,
                block_ids: Vec::new(),
                engine_ttft_ms: None,
                engine_split: None,
            }),
        });
    }
}

/// Blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: u32, block_size: u32) -> usize {
    tokens.div_ceil(block_size.max(1)) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SchedulerConfig {
        SchedulerConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: 1024,
            num_blocks: 64,
            block_size: 4,
            max_model_len: 4096,
            timing: StepTiming {
                base_us: 1000.0,
                per_decode_seq_us: 100.0,
                per_prefill_token_us: 10.0,
            },
        }
    }

    fn spec(prompt: &[u8], max_output_tokens: u32) -> SequenceSpec {
        SequenceSpec {
            prompt: prompt.to_vec(),
            max_output_tokens,
            text_seed: 7,
            stream: true,
            ..SequenceSpec::default()
        }
    }

    /// Runs steps until every sequence finishes; returns the outputs in order and the plans.
    fn run(s: &mut Scheduler) -> (Vec<SeqOutput>, Vec<StepPlan>) {
        let mut outputs = Vec::new();
        let mut plans = Vec::new();
        for _ in 0..10_000 {
            if s.is_idle() {
                break;
            }
            let plan = s.schedule();
            plans.push(plan.clone());
            outputs.extend(s.complete(plan));
        }
        assert!(s.is_idle(), "scheduler did not drain");
        (outputs, plans)
    }

    fn finish_of(outputs: &[SeqOutput], id: SeqId) -> Finish {
        outputs
            .iter()
            .find_map(|o| (o.id == id).then(|| o.finish.clone()).flatten())
            .expect("finished")
    }

    #[test]
    fn step_time_grows_with_batch_and_prefill_tokens() {
        let t = config().timing;
        assert_eq!(t.step_us(0, 0), 1000.0);
        assert_eq!(t.step_us(8, 0), 1800.0);
        assert_eq!(t.step_us(1, 100), 2100.0);
    }

    #[test]
    fn a_sequence_prefills_then_decodes_to_max_tokens() {
        let mut s = Scheduler::new(config());
        s.add(1, spec(&[b'x'; 40], 3)); // 10 tokens
        let (outputs, plans) = run(&mut s);
        assert_eq!(plans[0].work, vec![(1, 10)]);
        assert_eq!(plans[0].prefill_tokens, 10);
        assert_eq!(plans[1].decode_seqs, 1);
        assert_eq!(plans.len(), 3);
        assert!(outputs[0].first_token);
        let f = finish_of(&outputs, 1);
        assert_eq!(f.reason, FinishReason::Length);
        assert_eq!((f.prompt_tokens, f.output_tokens), (10, 3));
        let streamed: String = outputs.iter().filter_map(|o| o.delta.clone()).collect();
        assert_eq!(format!("{streamed}{}", f.text).len(), 12);
        assert_eq!(s.stats().generation_tokens, 3);
        assert_eq!(s.stats().prompt_tokens, 10);
        assert_eq!(s.pool().num_free(), 64);
    }

    #[test]
    fn a_shared_prefix_hits_the_cache_and_prefills_less() {
        let mut s = Scheduler::new(config());
        let prompt = vec![b'p'; 4 * 40]; // 40 tokens = 10 blocks
        s.add(1, spec(&prompt, 1));
        run(&mut s);
        let mut longer = prompt.clone();
        longer.extend_from_slice(b"more text");
        s.add(2, spec(&longer, 1));
        let plan = s.schedule();
        // 10 cached blocks = 40 tokens; 3 new tokens to compute.
        assert_eq!(plan.prefill_tokens, 3);
        let outputs = s.complete(plan);
        assert_eq!(outputs[0].finish.as_ref().unwrap().cached_tokens, 40);
        assert_eq!(s.stats().prefix_hits, 40);
        assert_eq!(s.stats().prefix_queries, 40 + 43);
    }

    #[test]
    fn a_fully_cached_prompt_still_computes_its_last_token() {
        let mut s = Scheduler::new(config());
        let prompt = vec![b'q'; 4 * 8]; // exactly 2 blocks
        s.add(1, spec(&prompt, 1));
        run(&mut s);
        s.add(2, spec(&prompt, 1));
        let plan = s.schedule();
        assert_eq!(plan.prefill_tokens, 4); // the second block is recomputed
        s.complete(plan);
    }

    #[test]
    fn generated_blocks_are_cached_for_the_next_turn() {
        let mut s = Scheduler::new(config());
        let prompt = vec![b'a'; 16]; // 4 tokens = 1 block
        let mut first = spec(&prompt, 8);
        first.stream = false;
        s.add(1, first);
        let (outputs, _) = run(&mut s);
        let reply = finish_of(&outputs, 1).text;
        let mut next = prompt.clone();
        next.extend_from_slice(reply.as_bytes());
        next.extend_from_slice(b"\nnew question");
        s.add(2, spec(&next, 1));
        let plan = s.schedule();
        s.complete(plan);
        // 4 prompt tokens + 8 reply tokens = 3 blocks; the last generated token's KV was never
        // computed, so its block is not cached: 2 blocks hit.
        assert_eq!(s.stats().prefix_hits, 8);
    }

    #[test]
    fn at_most_max_num_seqs_run_and_the_rest_wait_in_order() {
        let mut s = Scheduler::new(config());
        for id in 0..6 {
            s.add(id, spec(&[b'a' + id as u8; 8], 5));
        }
        let plan = s.schedule();
        assert_eq!(
            plan.work.iter().map(|w| w.0).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        assert_eq!((s.num_running(), s.num_waiting()), (4, 2));
        s.complete(plan);
        let (outputs, _) = run(&mut s);
        let order: Vec<SeqId> = outputs
            .iter()
            .filter(|o| o.first_token)
            .map(|o| o.id)
            .collect();
        assert_eq!(order, vec![4, 5]);
    }

    #[test]
    fn long_prompts_are_chunked_by_the_token_budget() {
        let mut cfg = config();
        cfg.max_num_batched_tokens = 16;
        let mut s = Scheduler::new(cfg);
        s.add(1, spec(&[b'z'; 4 * 40], 1));
        let (outputs, plans) = run(&mut s);
        let chunks: Vec<u32> = plans.iter().map(|p| p.prefill_tokens).collect();
        assert_eq!(chunks, vec![16, 16, 8]);
        assert_eq!(outputs.len(), 1);
    }

    #[test]
    fn preempts_the_newest_sequence_when_blocks_run_out() {
        let mut cfg = config();
        cfg.num_blocks = 6;
        let mut s = Scheduler::new(cfg);
        s.add(1, spec(&[b'a'; 4 * 7], 12)); // 7 tokens: 2 blocks, grows to 19 tokens: 5 blocks
        s.add(2, spec(&[b'b'; 4 * 7], 12));
        let (outputs, _) = run(&mut s);
        assert!(s.stats().preemptions > 0);
        let f1 = finish_of(&outputs, 1);
        let f2 = finish_of(&outputs, 2);
        assert_eq!((f1.output_tokens, f2.output_tokens), (12, 12));
        assert_eq!(s.pool().num_free(), 6);
    }

    #[test]
    fn a_sequence_that_outgrows_the_whole_cache_finishes_with_length() {
        let mut cfg = config();
        cfg.num_blocks = 2;
        let mut s = Scheduler::new(cfg);
        s.add(1, spec(&[b'a'; 4 * 6], 100));
        let (outputs, _) = run(&mut s);
        let f = finish_of(&outputs, 1);
        assert_eq!(f.reason, FinishReason::Length);
        // 6 prompt tokens + 2 computed outputs fill both blocks; the third output cannot be computed.
        assert_eq!(f.output_tokens, 3);
    }

    #[test]
    fn eos_stops_and_ignore_eos_runs_to_max_tokens() {
        let mut s = Scheduler::new(config());
        let mut with_eos = spec(b"hello", 50);
        with_eos.eos_after = Some(5);
        s.add(1, with_eos);
        s.add(2, spec(b"hello", 50));
        let (outputs, _) = run(&mut s);
        let f1 = finish_of(&outputs, 1);
        assert_eq!((f1.reason, f1.output_tokens), (FinishReason::Stop, 5));
        let f2 = finish_of(&outputs, 2);
        assert_eq!((f2.reason, f2.output_tokens), (FinishReason::Length, 50));
    }

    #[test]
    fn same_seed_same_text_and_stop_strings_cut_it() {
        let text_of = |seed: u64, stops: Vec<String>| {
            let mut s = Scheduler::new(config());
            let mut sp = spec(b"prompt", 30);
            sp.text_seed = seed;
            sp.stream = false;
            sp.stops = stops;
            s.add(1, sp);
            finish_of(&run(&mut s).0, 1)
        };
        let a = text_of(1, vec![]);
        assert_eq!(a, text_of(1, vec![]));
        assert_ne!(a.text, text_of(2, vec![]).text);
        let stop: String = a.text[8..14].to_string();
        let cut = text_of(1, vec![stop.clone()]);
        assert_eq!(cut.reason, FinishReason::Stop);
        assert_eq!(cut.stop_reason.as_deref(), Some(stop.as_str()));
        assert!(a.text.starts_with(&cut.text));
        assert!(!cut.text.contains(&stop));
    }

    #[test]
    fn remote_prefill_skips_the_prompt() {
        let mut s = Scheduler::new(config());
        let mut sp = spec(&[b'r'; 4 * 100], 2);
        sp.remote_prefill = true;
        s.add(1, sp);
        let plan = s.schedule();
        assert_eq!(plan.prefill_tokens, 1);
        s.complete(plan);
        // The remotely computed blocks are now cached locally.
        assert_eq!(s.pool().num_cached(), 25);
    }

    #[test]
    fn aborting_frees_blocks_and_reported_blocks_come_back() {
        let mut s = Scheduler::new(config());
        s.add(1, spec(&[b'a'; 4 * 20], 100));
        let plan = s.schedule();
        s.complete(plan);
        assert!(s.pool().num_free() < 64);
        s.abort(1);
        assert_eq!(s.pool().num_free(), 64);
        assert!(s.is_idle());
        assert_eq!(s.stats().finished_abort, 1);

        let mut sp = spec(&[b'b'; 4 * 20], 1);
        sp.report_blocks = true;
        s.add(2, sp);
        let (outputs, _) = run(&mut s);
        assert_eq!(finish_of(&outputs, 2).block_ids.len(), 5); // the 20 computed prompt tokens
    }

    #[test]
    fn a_stalled_sequence_keeps_its_slot_and_blocks_until_aborted() {
        let mut s = Scheduler::new(config());
        let mut sp = spec(&[b's'; 4 * 10], 100);
        sp.stall_after = Some(3);
        s.add(1, sp);
        let mut tokens = 0;
        for _ in 0..50 {
            let plan = s.schedule();
            tokens += s
                .complete(plan)
                .iter()
                .filter(|o| o.delta.is_some())
                .count();
        }
        assert_eq!(tokens, 3);
        assert_eq!(s.stats().generation_tokens, 3);
        assert_eq!((s.num_running(), s.num_stalled()), (1, 1));
        assert!(
            s.schedule().is_empty(),
            "a stalled sequence computes nothing"
        );
        assert!(!s.is_idle());
        assert!(s.pool().num_free() < 64);
        s.abort(1);
        assert_eq!(s.pool().num_free(), 64);
        assert!(s.is_idle());
    }

    #[test]
    fn a_stall_at_zero_prefills_but_never_samples_and_short_requests_finish() {
        let mut s = Scheduler::new(config());
        let mut hung = spec(&[b'h'; 4 * 10], 5);
        hung.stall_after = Some(0);
        s.add(1, hung);
        let mut short = spec(b"short", 2);
        short.stall_after = Some(2);
        s.add(2, short);
        let mut outputs = Vec::new();
        for _ in 0..20 {
            let plan = s.schedule();
            outputs.extend(s.complete(plan));
        }
        assert!(outputs.iter().all(|o| o.id == 2));
        assert_eq!(finish_of(&outputs, 2).output_tokens, 2);
        assert_eq!((s.num_running(), s.num_stalled()), (1, 1));
        assert_eq!(
            s.stats().prompt_tokens,
            2,
            "only the short request produced a first token"
        );
    }
}
