//! The OpenAI wire format as vLLM's server speaks it: request bodies (the fields the sim reads; all
//! others are accepted and ignored), responses, stream chunks and error bodies. Serde types only.

use serde::{Deserialize, Serialize};

use crate::disagg::KvTransferParams;
use crate::prompt::{ChatMessage, PromptInput};

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    /// Served model name; vLLM defaults to the first one when absent.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// vLLM extension: end the rendering with the generation prompt (default true).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// vLLM extension: leave the final (assistant) message open so the model continues it.
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    /// Sampling and streaming fields shared with completions.
    #[serde(flatten)]
    pub sampling: SamplingRequest,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// Served model name; vLLM defaults to the first one when absent.
    #[serde(default)]
    pub model: Option<String>,
    /// The prompt.
    pub prompt: PromptInput,
    /// Sampling and streaming fields shared with chat.
    #[serde(flatten)]
    pub sampling: SamplingRequest,
}

/// `POST /v1/embeddings`.
#[derive(Debug, Deserialize)]
pub struct EmbeddingRequest {
    /// Served model name.
    #[serde(default)]
    pub model: Option<String>,
    /// One or more inputs.
    pub input: PromptInput,
    /// Vector length (default `--embedding-dim`).
    #[serde(default)]
    pub dimensions: Option<usize>,
    /// `float` (default) or `base64` (little-endian f32; the openai client asks for this).
    #[serde(default)]
    pub encoding_format: Option<String>,
}

/// Fields of chat and completion requests that the sim reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SamplingRequest {
    /// Output token limit (completions default 16; chat defaults to what fits in max_model_len).
    pub max_tokens: Option<u32>,
    /// The newer name of `max_tokens`; wins when both are set.
    pub max_completion_tokens: Option<u32>,
    /// No EOS or stop string before this many tokens.
    pub min_tokens: Option<u32>,
    /// Generate until `max_tokens`.
    pub ignore_eos: Option<bool>,
    /// 0 is greedy (the request seed is then irrelevant).
    pub temperature: Option<f64>,
    /// Per-request seed of the generated text.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<StopStrings>,
    /// Accepted and ignored.
    pub user: Option<String>,
    /// Choices; only 1 is supported.
    pub n: Option<u32>,
    /// Stream server-sent events.
    pub stream: Option<bool>,
    /// Streaming usage options.
    pub stream_options: Option<StreamOptions>,
    /// Prefill/decode disaggregation (see [`crate::disagg`]); kept raw, because params that do
    /// not even parse are recomputed locally, as vLLM does, rather than refused.
    pub kv_transfer_params: Option<serde_json::Value>,
    /// vLLM's prefix-cache salt: the same prompt under another salt shares no cached block.
    pub cache_salt: Option<String>,
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopStrings {
    /// `"stop": "\n"`.
    One(String),
    /// `"stop": ["\n", "END"]`.
    Many(Vec<String>),
}

impl StopStrings {
    /// The strings as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopStrings::One(s) => vec![s],
            StopStrings::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` and no choices.
    pub include_usage: Option<bool>,
    /// Put `usage` in every chunk (vLLM extension).
    pub continuous_usage_stats: Option<bool>,
}

/// `usage`.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt plus completion tokens.
    pub total_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Cached prompt tokens (vLLM with `--enable-prompt-tokens-details`).
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    /// The sim's own extension with `--report-engine-timing` (vLLM has no such field): arrival
    /// at the engine to the first token, ms, so a benchmark can read each request's engine-side
    /// time to first token exactly instead of from the histogram's coarse buckets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_engine_ttft_ms: Option<f64>,
    /// With `sim_engine_ttft_ms`: arrival to the first step that computed the request, ms
    /// ([`crate::scheduler::EngineSplit`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_engine_queue_ms: Option<f64>,
    /// With `sim_engine_ttft_ms`: its own share of its prefill steps, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_engine_prefill_ms: Option<f64>,
    /// With `sim_engine_ttft_ms`: other prompts' share of its prefill steps, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_engine_shared_prefill_ms: Option<f64>,
    /// With `sim_engine_ttft_ms`: the decoding sequences' share of its prefill steps, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_engine_decode_interference_ms: Option<f64>,
    /// With `sim_engine_ttft_ms`: arrival at the engine to the last token, ms (wall clock, like
    /// `sim_engine_ttft_ms`), so a benchmark can tell the engine's end-to-end time from the
    /// client's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_engine_e2e_ms: Option<f64>,
    /// With `sim_engine_ttft_ms`: after the first token, other sequences' prompt tokens' share of
    /// the steps it decoded in, ms (each step's wall time times their share of its modelled
    /// duration): how long other prompts' prefill held up its decode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_engine_decode_stall_ms: Option<f64>,
}

impl Usage {
    /// Usage of a request with these counts.
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: Option<u32>) -> Self {
        Usage {
            prompt_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            completion_tokens,
            prompt_tokens_details: cached_tokens
                .map(|cached_tokens| PromptTokensDetails { cached_tokens }),
            sim_engine_ttft_ms: None,
            sim_engine_queue_ms: None,
            sim_engine_prefill_ms: None,
            sim_engine_shared_prefill_ms: None,
            sim_engine_decode_interference_ms: None,
            sim_engine_e2e_ms: None,
            sim_engine_decode_stall_ms: None,
        }
    }
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

/// A non-streamed chat completion.
#[derive(Debug, Serialize)]
pub struct ChatCompletion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: [ChatChoice<'a>; 1],
    pub usage: Usage,
    pub prompt_logprobs: Option<()>,
    pub kv_transfer_params: Option<&'a KvTransferParams>,
}

/// The choice of a non-streamed chat completion.
#[derive(Debug, Serialize)]
pub struct ChatChoice<'a> {
    pub index: u32,
    pub message: AssistantMessage<'a>,
    pub logprobs: Option<()>,
    pub finish_reason: &'a str,
    pub stop_reason: Option<&'a str>,
}

/// The generated message.
#[derive(Debug, Serialize)]
pub struct AssistantMessage<'a> {
    pub role: &'static str,
    pub content: &'a str,
    pub reasoning_content: Option<()>,
    pub tool_calls: [(); 0],
}

/// A non-streamed completion.
#[derive(Debug, Serialize)]
pub struct Completion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: [CompletionChoice<'a>; 1],
    pub usage: Usage,
    pub kv_transfer_params: Option<&'a KvTransferParams>,
}

/// The choice of a completion or completion chunk.
#[derive(Debug, Serialize)]
pub struct CompletionChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'a str>,
    pub stop_reason: Option<&'a str>,
}

/// One streamed chat chunk (`object: "chat.completion.chunk"`).
#[derive(Debug, Serialize)]
pub struct ChatChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChatChunkChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<&'a KvTransferParams>,
}

/// The choice of a chat chunk.
#[derive(Debug, Serialize)]
pub struct ChatChunkChoice<'a> {
    pub index: u32,
    pub delta: ChatDelta<'a>,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Option<&'a str>>,
}

/// A chat chunk's delta.
#[derive(Debug, Serialize)]
pub struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    pub content: &'a str,
}

/// One streamed completion chunk (`object: "text_completion"`).
#[derive(Debug, Serialize)]
pub struct CompletionChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<CompletionChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<&'a KvTransferParams>,
}

/// vLLM's error body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

/// See [`ErrorBody`].
#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: u16,
}
