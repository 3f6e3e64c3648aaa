//! The engine's scheduler: continuous batching over the KV cache, modelled on vLLM V1's scheduler,
//! plus the time each step takes. Pure logic: no clocks, channels or tasks (see [`crate::engine`]).
//!
//! **Each step** first gives every running sequence its tokens (one for a decode, the next chunk for a
//! prefill), allocating KV blocks as they grow; when blocks run out, the most recently admitted running
//! sequence is preempted (its blocks are freed and it goes back to the front of the queue, to be
//! recomputed later, mostly from the prefix cache). If nothing was preempted, waiting sequences are
//! then admitted in FIFO order while fewer than `max_num_seqs` run, the step's token budget
//! (`max_num_batched_tokens`) lasts and the blocks of their whole prompt fit (vLLM 0.34's
//! `scheduler_reserve_full_isl`), though only the first chunk's blocks are allocated. An admitted sequence's leading full blocks
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

mod types;

use std::collections::{HashMap, VecDeque};
pub use types::{
    EngineSplit, Finish, FinishReason, SchedulerConfig, SchedulerStats, SeqId, SeqOutput,
    SequenceSpec, StepPlan, StepTiming,
};

use crate::kv_cache::{block_hashes_from, extend_block_hashes_from, BlockHash, BlockId, BlockPool};
use crate::sampler::SplitMix64;
use crate::stop::StopChecker;
use crate::tokenizer::{count_tokens, piece};

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
    /// Decode steps taken under speculative decoding (the place in the acceptance cycle).
    spec_steps: u32,
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
        let hashes = block_hashes_from(spec.hash_root, &spec.prompt, self.config.block_size);
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
            spec_steps: 0,
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
            // vLLM 0.34 admits a request only when its whole prompt fits in the free blocks
            // (`scheduler_reserve_full_isl`, on by default: vllm/config/scheduler.py), though a
            // step allocates only the chunk it computes.
            let whole = blocks_for(total, block_size)
                .saturating_sub(hits.len())
                .max(needed);
            if !self.pool.can_allocate(&hits, whole) {
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
            // Speculative decoding (`--spec-tokens K`): a decode step (not the prefill's first
            // token) keeps the drafts it accepted and samples one token after them, as vLLM's
            // scheduler hands the engine's `sampled_token_ids` on whole
            // (`vllm/v1/core/sched/scheduler.py`, `update_from_output`): one event of up to K+1
            // tokens. Accepted drafts cycle K, K-1, ..., 0.
            let k = self.config.spec_tokens;
            let accepted = if first_token || k == 0 {
                0
            } else {
                seq.spec_steps += 1;
                k - (seq.spec_steps - 1) % (k + 1)
            };
            let mut finish = None;
            let mut sampled = 0;
            while sampled <= accepted && finish.is_none() && !seq.stalled() {
                sampled += 1;
                seq.output_tokens += 1;
                self.stats.generation_tokens += 1;
                if seq.spec.eos_after == Some(seq.output_tokens) {
                    finish = Some((FinishReason::Stop, None));
                    break;
                }
                let text = piece(seq.sampler.next_u64());
                seq.bytes.extend_from_slice(text.as_bytes());
                extend_block_hashes_from(
                    seq.spec.hash_root,
                    &mut seq.hashes,
                    &seq.bytes,
                    block_size,
                );
                let check_stops = seq.output_tokens >= seq.spec.min_tokens;
                if let Some(stop) = seq.text.push(text, check_stops) {
                    finish = Some((FinishReason::Stop, Some(stop)));
                } else if seq.output_tokens >= seq.spec.max_output_tokens
                    || seq.total_tokens() >= max_model_len
                {
                    finish = Some((FinishReason::Length, None));
                }
            }
            // The accepted drafts' KV was computed while verifying them; only the last sampled
            // token's is not.
            seq.computed += sampled - 1;
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
                    engine_e2e_ms: None,
                    engine_decode_stall_ms: None,
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
                engine_e2e_ms: None,
                engine_decode_stall_ms: None,
            }),
        });
    }
}

/// Blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: u32, block_size: u32) -> usize {
    tokens.div_ceil(block_size.max(1)) as usize
}

#[cfg(test)]
mod tests;
