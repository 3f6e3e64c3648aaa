//! The OpenAI endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/models`.
//!
//! Each handler parses the body, validates it the way vLLM 0.34.0 does (and with its messages),
//! admits it under the load-shedding limits, turns it into a [`SequenceSpec`] and hands it to the
//! engine; streaming responses return at once with an [`SseStream`], non-streamed ones wait for the
//! sequence to finish. Errors are [`ApiError`]s. An oversized `max_tokens` is lowered to what fits
//! (a prompt longer than the context is still a 400); `min_tokens` above the (lowered, or for a
//! prefill hand-off forced to 1) `max_tokens` is a 400. A request's `cache_salt` and LoRA adapter
//! (a `model` among `--lora-modules`) seed its block hashes. Bad `kv_transfer_params` are computed
//! locally; expired or unknown ones on a decode server fail the request as vLLM's KV load failure
//! does (an error event in the stream, or a 500).

use std::time::{Duration, Instant};

use hyper::{Response, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::json;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::body::{self, SimBody};
use crate::disagg::{prompt_digest, KvIntent, KvTransferParams};
use crate::engine::SeqEvent;
use crate::error::ApiError;
use crate::faults::FaultDecision;
use crate::kv_cache::root_hash;
use crate::openai::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionRequest, Completion,
    CompletionChoice, CompletionRequest, EmbeddingRequest, SamplingRequest, Usage,
};
use crate::prompt::{render_chat, ChatEnding};
use crate::sampler::{eos_after, text_seed};
use crate::scheduler::{blocks_for, SequenceSpec};
use crate::sse::{unix_ms, ChunkEncoder, Endpoint, HandOff, SseStream, StreamError};
use crate::state::{AppState, InFlight};
use crate::tokenizer::count_tokens;

/// Default `max_tokens` of `/v1/completions`, as in vLLM.
const COMPLETION_DEFAULT_MAX_TOKENS: u32 = 16;

pub(crate) fn bad_request(message: impl std::fmt::Display) -> ApiError {
    ApiError::BadRequest(message.to_string())
}

pub(crate) fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| bad_request(format!("Invalid request body: {e}")))
}

/// The served model a request names (the first one when it names none), and the LoRA adapter
/// when it names one of `--lora-modules`.
pub(crate) fn resolve_model(
    state: &AppState,
    model: Option<String>,
) -> Result<(String, Option<String>), ApiError> {
    match model {
        None => Ok((state.config.models[0].clone(), None)),
        Some(m) if state.config.models.contains(&m) => Ok((m, None)),
        Some(m) if state.config.lora_modules.iter().any(|l| l.name == m) => {
            Ok((m.clone(), Some(m)))
        }
        Some(m) => Err(ApiError::ModelNotFound(m)),
    }
}

/// Unix seconds.
pub(crate) fn unix_s() -> u64 {
    unix_ms() / 1000
}

/// A request id: the client's `X-Request-Id` if any, else 32 fresh hex digits.
fn request_id(state: &AppState, prefix: &str, header: Option<&str>) -> String {
    match header {
        Some(h) if !h.is_empty() => format!("{prefix}-{h}"),
        _ => format!("{prefix}-{}", state.fresh_id()),
    }
}

/// A validated generation request, ready for the engine.
pub(crate) struct Generation {
    endpoint: Endpoint,
    id: String,
    created: u64,
    pub(crate) model: String,
    stream: bool,
    include_usage: bool,
    continuous_usage: bool,
    pub(crate) prompt_tokens: u32,
    handoff: Option<HandOff>,
    /// Failed KV transfer (expired or unknown params on a decode server): the answer is vLLM's
    /// in-stream error (or its 500) without computing anything.
    kv_load_failed: bool,
    inflight: InFlight,
    pub(crate) spec: SequenceSpec,
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    state: &AppState,
    body: &[u8],
    request_id_header: Option<&str>,
    faults: &FaultDecision,
) -> Result<Response<SimBody>, ApiError> {
    let request: ChatCompletionRequest = parse(body)?;
    let ending = ChatEnding::from_request(
        &request.messages,
        request.add_generation_prompt,
        request.continue_final_message,
    )
    .map_err(bad_request)?;
    let prompt = render_chat(&request.messages, ending).map_err(bad_request)?;
    let id = request_id(state, "chatcmpl", request_id_header);
    let generation = prepare(
        state,
        Endpoint::Chat,
        id,
        request.model,
        prompt,
        request.sampling,
    )?;
    generate(state, generation, faults).await
}

/// `POST /v1/completions`.
pub async fn completions(
    state: &AppState,
    body: &[u8],
    request_id_header: Option<&str>,
    faults: &FaultDecision,
) -> Result<Response<SimBody>, ApiError> {
    let request: CompletionRequest = parse(body)?;
    let prompt = request.prompt.into_single_prompt().map_err(bad_request)?;
    let id = request_id(state, "cmpl", request_id_header);
    let generation = prepare(
        state,
        Endpoint::Completion,
        id,
        request.model,
        prompt,
        request.sampling,
    )?;
    generate(state, generation, faults).await
}

/// Validates a chat or completion request and builds its sequence.
pub(crate) fn prepare(
    state: &AppState,
    endpoint: Endpoint,
    id: String,
    model: Option<String>,
    prompt: Vec<u8>,
    sampling: SamplingRequest,
) -> Result<Generation, ApiError> {
    let config = &state.config;
    let (model, lora) = resolve_model(state, model)?;
    if sampling.n.is_some_and(|n| n != 1) {
        return Err(bad_request(
            "vllm-sim generates one choice per request: n must be 1",
        ));
    }
    let prompt_tokens = count_tokens(prompt.len());
    // vLLM checks admission (load shedding) right after the model, before the prompt is rendered
    // and validated (`_preflight` in vllm/entrypoints/generate/base/serving.py).
    let inflight = state.admit(prompt_tokens).map_err(ApiError::Shed)?;
    let stream = sampling.stream.unwrap_or(false);
    if sampling.stream_options.is_some() && !stream {
        return Err(bad_request(
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    let temperature = sampling.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(bad_request(format!(
            "temperature must be non-negative, got {temperature}."
        )));
    }

    if prompt_tokens == 0 {
        return Err(bad_request("The decoder prompt cannot be empty"));
    }
    let max_len = config.max_model_len;
    // vllm/renderers/params.py (`_token_len_check`): a prompt longer than the context is refused.
    if prompt_tokens > max_len {
        return Err(ApiError::Invalid {
            message: format!(
                "This model's maximum context length is {max_len} tokens. However, your prompt \
                 contains {prompt_tokens} input tokens, which exceeds this limit even without any \
                 output tokens. Please reduce the length of the input prompt."
            ),
            param: "input_tokens",
            value: prompt_tokens.to_string(),
        });
    }
    // vllm/entrypoints/serve/utils/api_utils.py (`get_max_tokens`): the smallest of what fits,
    // what was asked for and the endpoint's default; an oversized max_tokens is lowered.
    let fits = max_len - prompt_tokens;
    let requested = sampling.max_completion_tokens.or(sampling.max_tokens);
    let mut max_tokens = match (requested, endpoint) {
        (Some(m), _) => m.min(fits),
        (None, Endpoint::Chat) => fits,
        (None, Endpoint::Completion) => COMPLETION_DEFAULT_MAX_TOKENS.min(fits),
    };
    let digest = prompt_digest(&prompt);
    let transfer = sampling
        .kv_transfer_params
        .filter(|v| !v.is_null())
        .map(|v| serde_json::from_value::<KvTransferParams>(v).ok());
    let intent = match transfer {
        None => Ok(KvIntent::Local),
        // Params that do not parse are ignored: the prompt is computed here (a cache miss).
        Some(None) => Ok(KvIntent::Local),
        Some(Some(p)) => state.transfer.classify(Some(&p), digest, unix_ms()),
    };
    let (intent, kv_load_failed) = match intent {
        Ok(i) => (i, false),
        Err(e) if e.fails_the_load() => (KvIntent::RemotePrefill, true),
        // Invalid params are recomputed silently, as vLLM's connector does.
        Err(_) => (KvIntent::Local, false),
    };
    if intent == KvIntent::HandOff {
        // The prefill half generates one token (vLLM's proxy sends max_tokens 1).
        max_tokens = 1;
    }
    // vllm/sampling_params.py (`_verify_args`).
    if max_tokens == 0 {
        return Err(ApiError::Invalid {
            message: "max_tokens must be at least 1, got 0.".into(),
            param: "max_tokens",
            value: "0".into(),
        });
    }
    let min_tokens = sampling.min_tokens.unwrap_or(0);
    if min_tokens > max_tokens {
        return Err(bad_request(format!(
            "min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )));
    }
    let needed_blocks = blocks_for(prompt_tokens + 1, config.block_size);
    if needed_blocks > config.kv_blocks as usize {
        return Err(bad_request(format!(
            "The prompt needs {needed_blocks} KV cache blocks but the cache has {} (--kv-blocks).",
            config.kv_blocks
        )));
    }
    let handoff = (intent == KvIntent::HandOff).then(|| HandOff {
        authority: state.transfer.clone(),
        prompt_digest: digest,
    });

    let seed = text_seed(config.seed, sampling.seed, temperature, &prompt);
    let options = sampling.stream_options.unwrap_or_default();
    let spec = SequenceSpec {
        max_output_tokens: max_tokens,
        min_tokens,
        eos_after: eos_after(
            seed,
            config.mean_output_tokens,
            min_tokens,
            sampling.ignore_eos.unwrap_or(false),
        ),
        stops: sampling.stop.map(|s| s.into_vec()).unwrap_or_default(),
        text_seed: seed,
        remote_prefill: intent == KvIntent::RemotePrefill,
        report_blocks: handoff.is_some(),
        stream,
        stall_after: None,
        hash_root: root_hash(lora.as_deref(), sampling.cache_salt.as_deref()),
        prompt,
    };
    Ok(Generation {
        endpoint,
        id,
        created: unix_s(),
        model,
        stream,
        include_usage: options.include_usage.unwrap_or(false),
        continuous_usage: options.continuous_usage_stats.unwrap_or(false),
        prompt_tokens,
        handoff,
        kv_load_failed,
        inflight,
        spec,
    })
}

/// Runs a generation on the engine and answers it.
async fn generate(
    state: &AppState,
    generation: Generation,
    faults: &FaultDecision,
) -> Result<Response<SimBody>, ApiError> {
    let Generation {
        endpoint,
        id,
        created,
        model,
        stream,
        include_usage,
        continuous_usage,
        prompt_tokens,
        handoff,
        kv_load_failed,
        inflight,
        mut spec,
    } = generation;
    spec.stall_after = faults.stall_after_tokens;
    let details = state.config.enable_prompt_tokens_details;
    if kv_load_failed && !stream {
        return Err(ApiError::Generation);
    }
    let mut events = if kv_load_failed {
        // Nothing is computed: the stream fails at once.
        tokio::sync::mpsc::unbounded_channel().1
    } else {
        state
            .engine
            .submit(spec, Instant::now())
            .map_err(|_| ApiError::EngineGone)?
    };
    if stream {
        let mut encoder = ChunkEncoder::new(
            endpoint,
            id,
            created,
            model,
            include_usage,
            continuous_usage,
            prompt_tokens,
            handoff,
        );
        encoder.prompt_tokens_details = details;
        encoder.engine_timing = state.config.report_engine_timing;
        let error = if kv_load_failed {
            // finish_reason "error" on the first output: a chat stream has sent its role chunk.
            Some(StreamError {
                after: 0,
                role_first: true,
            })
        } else {
            faults.stream_error_after_tokens.map(|after| StreamError {
                after,
                role_first: false,
            })
        };
        let keep_alive = (state.config.sse_keep_alive_interval > 0.0)
            .then(|| Duration::from_secs_f64(state.config.sse_keep_alive_interval));
        return Ok(body::event_stream(
            SseStream::new(events, encoder, faults.stream_cut())
                .reset_after_done(faults.resets_after_done())
                .error_after(error)
                .keep_alive(keep_alive)
                .in_flight(inflight),
        ));
    }
    let finish = loop {
        match events.recv().await {
            Some(SeqEvent::Finished(finish)) => break finish,
            Some(SeqEvent::Token { .. }) => inflight.first_token(),
            None => return Err(ApiError::EngineGone),
        }
    };
    drop(inflight);
    if faults
        .stream_error_after_tokens
        .is_some_and(|n| finish.output_tokens >= n)
    {
        return Err(ApiError::Generation);
    }
    if faults
        .disconnect_after_tokens
        .is_some_and(|n| finish.output_tokens >= n)
    {
        return Err(ApiError::Disconnect);
    }
    let params = handoff.as_ref().map(|h| h.params(&finish));
    let usage = Usage::new(
        finish.prompt_tokens,
        finish.output_tokens,
        details.then_some(finish.cached_tokens),
    );
    let finish_reason = finish.reason.as_str();
    let stop_reason = finish.stop_reason.as_deref();
    Ok(match endpoint {
        Endpoint::Chat => body::json(
            StatusCode::OK,
            &ChatCompletion {
                id: &id,
                object: "chat.completion",
                created,
                model: &model,
                choices: [ChatChoice {
                    index: 0,
                    message: AssistantMessage {
                        role: "assistant",
                        content: &finish.text,
                        reasoning_content: None,
                        tool_calls: [],
                    },
                    logprobs: None,
                    finish_reason,
                    stop_reason,
                }],
                usage,
                prompt_logprobs: None,
                kv_transfer_params: params.as_ref(),
            },
        ),
        Endpoint::Completion => body::json(
            StatusCode::OK,
            &Completion {
                id: &id,
                object: "text_completion",
                created,
                model: &model,
                choices: [CompletionChoice {
                    index: 0,
                    text: &finish.text,
                    logprobs: None,
                    finish_reason: Some(finish_reason),
                    stop_reason,
                }],
                usage,
                kv_transfer_params: params.as_ref(),
            },
        ),
    })
}

/// `POST /v1/embeddings`: a deterministic unit vector per input after a prefill-like delay.
pub async fn embeddings(state: &AppState, body: &[u8]) -> Result<Response<SimBody>, ApiError> {
    let config = &state.config;
    let request: EmbeddingRequest = parse(body)?;
    let (model, _lora) = resolve_model(state, request.model)?;
    let prompts = request.input.into_prompts();
    if prompts.is_empty() {
        return Err(bad_request("input must not be empty"));
    }
    let dims = request.dimensions.unwrap_or(config.embedding_dim);
    if dims == 0 || dims > 65536 {
        return Err(bad_request(format!(
            "dimensions must be between 1 and 65536, got {dims}"
        )));
    }
    let as_base64 = match request.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(bad_request(format!(
                "encoding_format must be 'float' or 'base64', got '{other}'"
            )))
        }
    };
    let mut total_tokens: u32 = 0;
    for prompt in &prompts {
        let tokens = count_tokens(prompt.len());
        if tokens == 0 {
            return Err(bad_request("input must not contain empty strings"));
        }
        if tokens > config.max_model_len {
            return Err(bad_request(format!(
                "This model's maximum context length is {} tokens. However, your request has {tokens} \
                 input tokens. Please reduce the length of the input.",
                config.max_model_len
            )));
        }
        total_tokens = total_tokens.saturating_add(tokens);
    }
    let inflight = state.admit(total_tokens).map_err(ApiError::Shed)?;
    let delay_us = config.step_timing().step_us(0, total_tokens) / config.time_scale;
    tokio::time::sleep(Duration::from_secs_f64(delay_us / 1e6)).await;
    drop(inflight);
    if let Ok(mut m) = state.metrics.lock() {
        m.embedding_prompt_tokens += u64::from(total_tokens);
    }
    let data: Vec<serde_json::Value> = prompts
        .iter()
        .enumerate()
        .map(|(index, prompt)| {
            let vector = embedding(prompt, dims, config.seed);
            let encoded = if as_base64 {
                json!(base64_f32(&vector))
            } else {
                json!(vector)
            };
            json!({"index": index, "object": "embedding", "embedding": encoded})
        })
        .collect();
    Ok(body::json(
        StatusCode::OK,
        &json!({
            "id": format!("embd-{}", state.fresh_id()),
            "object": "list",
            "created": unix_s(),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": total_tokens, "total_tokens": total_tokens, "completion_tokens": 0},
        }),
    ))
}

/// `GET /v1/models`: every served name, as aliases of one engine, then the LoRA adapters with
/// `root` their path and `parent` the base model (vllm/entrypoints/openai/models/serving.py,
/// `show_available_models`).
pub fn models(state: &AppState) -> Response<SimBody> {
    let base = &state.config.models[0];
    let card = |id: &str, root: &str, parent: Option<&str>, max_len: Option<u32>| {
        json!({
            "id": id,
            "object": "model",
            "created": state.started_unix,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_len,
            "permission": [{
                "id": format!("modelperm-{}", state.fresh_id()),
                "object": "model_permission",
                "created": state.started_unix,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }],
        })
    };
    let mut data: Vec<serde_json::Value> = state
        .config
        .models
        .iter()
        .map(|name| card(name, base, None, Some(state.config.max_model_len)))
        .collect();
    data.extend(
        state
            .config
            .lora_modules
            .iter()
            .map(|l| card(&l.name, &l.path, Some(base), None)),
    );
    body::json(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// A deterministic unit vector of `dims` numbers for `input`.
pub fn embedding(input: &[u8], dims: usize, seed: u64) -> Vec<f32> {
    let raw: Vec<f64> = (0..dims)
        .map(|i| {
            let h = xxh3_64_with_seed(input, seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            (h >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect();
    let norm = raw
        .iter()
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
        .max(f64::MIN_POSITIVE);
    raw.iter().map(|x| (x / norm) as f32).collect()
}

/// Little-endian f32s in standard base64, as OpenAI's `encoding_format: "base64"`.
pub fn base64_f32(values: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeddings_are_deterministic_unit_vectors() {
        let a = embedding(b"hello", 16, 0);
        assert_eq!(a.len(), 16);
        assert_eq!(a, embedding(b"hello", 16, 0));
        assert_ne!(a, embedding(b"hellO", 16, 0));
        let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4);
    }

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        // 1.0f32 = 00 00 80 3f
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[]), "");
        assert_eq!(base64_f32(&[1.0, 1.0, 1.0]).len(), 16);
    }

    #[test]
    fn errors_render_like_vllm() {
        let response = ApiError::ModelNotFound("x".into()).into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            ApiError::Unauthorized.into_response().status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            ApiError::Injected(503).into_response().status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            ApiError::RateLimited.into_response().status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }
}
