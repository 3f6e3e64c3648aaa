//! What the scheduler takes and gives: a sequence's spec, the step model and limits, a step's
//! plan, what each sequence produced and how it finished, and the cumulative counters.

use crate::kv_cache::BlockId;

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
    /// Draft tokens verified per decode step (`--spec-tokens`; 0: no speculative decoding). A
    /// decode step then yields 1 to `spec_tokens + 1` tokens, see `Scheduler::complete`.
    pub spec_tokens: u32,
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
    /// `prev_hash` of the first prompt block: 0, or [`crate::kv_cache::root_hash`] of the
    /// request's LoRA adapter and `cache_salt`.
    pub hash_root: crate::kv_cache::BlockHash,
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
    /// Arrival at the engine to the last token, ms (set by the engine; `None` when it produced
    /// no token).
    pub engine_e2e_ms: Option<f64>,
    /// After the first token: the wall time of the steps it decoded in that went to other
    /// sequences' prompt tokens, ms (each such step's wall time times those tokens' share of its
    /// modelled duration, as [`EngineSplit`] shares out a step; set by the engine, `None` before
    /// a first token).
    pub engine_decode_stall_ms: Option<f64>,
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

/// The work of one step, returned by [`Scheduler::schedule`](super::Scheduler::schedule) and handed back to
/// [`Scheduler::complete`](super::Scheduler::complete).
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
