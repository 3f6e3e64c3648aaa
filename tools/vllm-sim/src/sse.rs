//! Streaming responses: engine events turned into OpenAI server-sent events, as vLLM sends them.
//!
//! A chat stream opens with a chunk whose delta is `{"role": "assistant", "content": ""}` (sent with
//! the first token, after prefill), then one chunk per token with `{"content": ...}`, a last chunk
//! carrying `finish_reason` and `stop_reason`, a usage chunk with `"choices": []` when
//! `stream_options.include_usage` is set, and `data: [DONE]`. Completion streams are the same with
//! `text` choices. Events that arrive together are written in one frame. When the fault
//! `disconnect_after_tokens` applies, the stream ends with an error after that many tokens, which makes
//! hyper drop the connection without the terminating chunk, as a crashed server would. With
//! `disconnect_mid_event_after_tokens`, the first half of one more event (`data: {"id":...` with no
//! blank line after it) goes out before the cut, as when a server dies in the middle of a write.
//!
//! Two behaviours of vLLM 0.34.0 live here too. A failure after the headers (a `GenerationError`:
//! `finish_reason == "error"`, e.g. a KV load failure) is sent as one more event,
//! `data: {"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}`,
//! then `data: [DONE]` (the except branches of `chat_completion_stream_generator` in
//! `vllm/entrypoints/openai/chat_completion/serving.py`; completions the same); see
//! [`StreamError`]. With `--sse-keep-alive-interval`, a stream silent that long (queued, in
//! prefill, or between tokens) gets the comment `: keep-alive\n\n`
//! (`vllm/entrypoints/serve/utils/sse_keep_alive.py`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::time::Sleep;

use crate::disagg::{KvTransferParams, TransferAuthority};
use crate::engine::SeqEvent;
use crate::faults::StreamCutAt;
use crate::openai::{
    ChatChunk, ChatChunkChoice, ChatDelta, CompletionChoice, CompletionChunk, Usage,
};
use crate::scheduler::Finish;
use crate::state::InFlight;

/// The comment line vLLM sends on an idle stream (`SSE_KEEP_ALIVE_COMMENT`).
pub const KEEP_ALIVE_COMMENT: &[u8] = b": keep-alive\n\n";

/// The error event of a stream that fails after its headers, as vLLM 0.34 serializes its
/// `ErrorResponse` (pydantic's compact JSON), including the `data: ` prefix and blank line.
pub const STREAM_ERROR_EVENT: &[u8] = b"data: {\"error\":{\"message\":\"Internal server error\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}\n\n";

/// Where a stream fails with vLLM's error event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamError {
    /// After this many output tokens (0: before any).
    pub after: u32,
    /// A chat stream sends its role chunk first (vLLM sends it with the first output, which is
    /// the one carrying `finish_reason: "error"` when a KV load fails).
    pub role_first: bool,
}

/// How long a stream that is about to be cut waits so its last chunks reach the client first.
const DISCONNECT_GRACE: Duration = Duration::from_millis(30);
/// Largest frame written at once when events pile up.
const MAX_FRAME: usize = 64 * 1024;

/// Which OpenAI endpoint a generation serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// A prefill server's promise to describe its blocks when the sequence finishes.
#[derive(Debug, Clone)]
pub struct HandOff {
    /// Issues the params.
    pub authority: Arc<TransferAuthority>,
    /// Digest of the prompt the params are for.
    pub prompt_digest: u64,
}

impl HandOff {
    /// The `kv_transfer_params` for a finished prefill.
    pub fn params(&self, finish: &Finish) -> KvTransferParams {
        self.authority
            .issue(finish.block_ids.clone(), self.prompt_digest, unix_ms())
    }
}

/// Wall-clock milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Writes the chunks of one response.
#[derive(Debug)]
pub struct ChunkEncoder {
    /// Chat or completion.
    pub endpoint: Endpoint,
    /// Response id (`chatcmpl-...` / `cmpl-...`).
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name as requested.
    pub model: String,
    /// Send a usage chunk at the end.
    pub include_usage: bool,
    /// Put usage in every chunk.
    pub continuous_usage: bool,
    /// Prompt tokens, for usage.
    pub prompt_tokens: u32,
    /// Set for a prefill hand-off.
    pub handoff: Option<HandOff>,
    /// Put `prompt_tokens_details.cached_tokens` in the usage chunk (`--enable-prompt-tokens-details`;
    /// on unless changed after [`ChunkEncoder::new`]).
    pub prompt_tokens_details: bool,
    /// Put the engine's time to first token, end-to-end time and decode stall in the usage chunk
    /// (`--report-engine-timing`).
    pub engine_timing: bool,
    role_sent: bool,
}

impl ChunkEncoder {
    /// An encoder for one response.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        endpoint: Endpoint,
        id: String,
        created: u64,
        model: String,
        include_usage: bool,
        continuous_usage: bool,
        prompt_tokens: u32,
        handoff: Option<HandOff>,
    ) -> Self {
        ChunkEncoder {
            endpoint,
            id,
            created,
            model,
            include_usage,
            continuous_usage,
            prompt_tokens,
            handoff,
            prompt_tokens_details: true,
            engine_timing: false,
            role_sent: false,
        }
    }

    fn usage(&self, output_tokens: u32) -> Option<Usage> {
        self.continuous_usage
            .then(|| Usage::new(self.prompt_tokens, output_tokens, None))
    }

    fn write_role(&mut self, out: &mut Vec<u8>, output_tokens: u32) {
        if self.endpoint != Endpoint::Chat || self.role_sent {
            return;
        }
        self.role_sent = true;
        let chunk = ChatChunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta {
                    role: Some("assistant"),
                    content: "",
                },
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            }],
            usage: self.usage(output_tokens.saturating_sub(1)),
            kv_transfer_params: None,
        };
        write_event(out, &chunk);
    }

    /// Writes the chunk(s) for new text.
    pub fn token(&mut self, out: &mut Vec<u8>, delta: &str, output_tokens: u32) {
        self.write_role(out, output_tokens);
        if delta.is_empty() {
            return;
        }
        self.write_choice(out, delta, None, output_tokens, None);
    }

    /// Writes the last chunk, the usage chunk if asked for, and `[DONE]`.
    pub fn finish(&mut self, out: &mut Vec<u8>, finish: &Finish) {
        self.write_role(out, finish.output_tokens);
        let params = self.handoff.as_ref().map(|h| h.params(finish));
        self.write_choice(
            out,
            &finish.text,
            Some((finish.reason.as_str(), finish.stop_reason.as_deref())),
            finish.output_tokens,
            params.as_ref(),
        );
        if self.include_usage {
            let cached = self.prompt_tokens_details.then_some(finish.cached_tokens);
            let mut usage = Usage::new(finish.prompt_tokens, finish.output_tokens, cached);
            if self.engine_timing {
                usage.sim_engine_ttft_ms = finish.engine_ttft_ms;
                usage.sim_engine_e2e_ms = finish.engine_e2e_ms;
                usage.sim_engine_decode_stall_ms = finish.engine_decode_stall_ms;
                if let Some(split) = finish.engine_split {
                    usage.sim_engine_queue_ms = Some(split.queue_ms);
                    usage.sim_engine_prefill_ms = Some(split.prefill_ms);
                    usage.sim_engine_shared_prefill_ms = Some(split.shared_prefill_ms);
                    usage.sim_engine_decode_interference_ms = Some(split.decode_interference_ms);
                }
            }
            let usage = Some(usage);
            match self.endpoint {
                Endpoint::Chat => write_event(
                    out,
                    &ChatChunk {
                        id: &self.id,
                        object: "chat.completion.chunk",
                        created: self.created,
                        model: &self.model,
                        choices: Vec::new(),
                        usage,
                        kv_transfer_params: None,
                    },
                ),
                Endpoint::Completion => write_event(
                    out,
                    &CompletionChunk {
                        id: &self.id,
                        object: "text_completion",
                        created: self.created,
                        model: &self.model,
                        choices: Vec::new(),
                        usage,
                        kv_transfer_params: None,
                    },
                ),
            }
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }

    /// Writes the first half of a content event, without its terminating blank line: what a client
    /// receives when the server dies in the middle of writing an event.
    pub fn partial_event(&self, out: &mut Vec<u8>, output_tokens: u32) {
        let mut event = Vec::new();
        self.write_choice(&mut event, " ...", None, output_tokens + 1, None);
        out.extend_from_slice(&event[..event.len() / 2]);
    }

    fn write_choice(
        &self,
        out: &mut Vec<u8>,
        text: &str,
        finish: Option<(&str, Option<&str>)>,
        output_tokens: u32,
        params: Option<&KvTransferParams>,
    ) {
        let usage = self.usage(output_tokens);
        match self.endpoint {
            Endpoint::Chat => write_event(
                out,
                &ChatChunk {
                    id: &self.id,
                    object: "chat.completion.chunk",
                    created: self.created,
                    model: &self.model,
                    choices: vec![ChatChunkChoice {
                        index: 0,
                        delta: ChatDelta {
                            role: None,
                            content: text,
                        },
                        logprobs: None,
                        finish_reason: finish.map(|f| f.0),
                        stop_reason: finish.map(|f| f.1),
                    }],
                    usage,
                    kv_transfer_params: params,
                },
            ),
            Endpoint::Completion => write_event(
                out,
                &CompletionChunk {
                    id: &self.id,
                    object: "text_completion",
                    created: self.created,
                    model: &self.model,
                    choices: vec![CompletionChoice {
                        index: 0,
                        text,
                        logprobs: None,
                        finish_reason: finish.map(|f| f.0),
                        stop_reason: finish.and_then(|f| f.1),
                    }],
                    usage,
                    kv_transfer_params: params,
                },
            ),
        }
    }
}

/// Appends `data: <json>\n\n`.
fn write_event(out: &mut Vec<u8>, value: &impl Serialize) {
    out.extend_from_slice(b"data: ");
    // Serializing these plain structs cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
    out.extend_from_slice(b"\n\n");
}

/// The stream was cut on purpose (fault injection) or the engine went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamCut;

impl std::fmt::Display for StreamCut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stream cut (simulated disconnect)")
    }
}

impl std::error::Error for StreamCut {}

enum State {
    Open,
    Closing(Pin<Box<Sleep>>),
    Done,
}

/// A streaming response body fed by one sequence's engine events.
pub struct SseStream {
    events: mpsc::UnboundedReceiver<SeqEvent>,
    encoder: ChunkEncoder,
    cut: Option<StreamCutAt>,
    /// Reset the connection after `data: [DONE]` instead of ending cleanly.
    reset_after_done: bool,
    /// End with vLLM's error event after this many tokens.
    error: Option<StreamError>,
    /// Send a keep-alive comment after this much silence.
    keep_alive: Option<Duration>,
    /// When the next keep-alive comment is due.
    keep_alive_timer: Option<Pin<Box<Sleep>>>,
    /// The request's share of the load-shedding counters.
    in_flight: Option<InFlight>,
    state: State,
}

impl SseStream {
    /// A stream of `events`, cut as `cut` says when set.
    pub fn new(
        events: mpsc::UnboundedReceiver<SeqEvent>,
        encoder: ChunkEncoder,
        cut: Option<StreamCutAt>,
    ) -> Self {
        SseStream {
            events,
            encoder,
            cut,
            reset_after_done: false,
            error: None,
            keep_alive: None,
            keep_alive_timer: None,
            in_flight: None,
            state: State::Open,
        }
    }

    /// The stream fails with vLLM's error event as `error` says, if set.
    pub fn error_after(mut self, error: Option<StreamError>) -> Self {
        self.error = error;
        self
    }

    /// Silence longer than `interval` gets a keep-alive comment, if set.
    pub fn keep_alive(mut self, interval: Option<Duration>) -> Self {
        self.keep_alive = interval.filter(|i| !i.is_zero());
        self.keep_alive_timer = self.keep_alive.map(|i| Box::pin(tokio::time::sleep(i)));
        self
    }

    /// Holds the request's load-shedding share until the stream is dropped; its prompt leaves the
    /// prefill backlog with the first token.
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = Some(in_flight);
        self
    }

    /// Ends `out` with the error event and `[DONE]` if the error is due after `output_tokens`.
    fn error_if_due(&mut self, out: &mut Vec<u8>, output_tokens: u32) -> bool {
        let Some(error) = self.error.filter(|e| output_tokens >= e.after) else {
            return false;
        };
        if error.role_first {
            self.encoder.token(out, "", output_tokens);
        }
        out.extend_from_slice(STREAM_ERROR_EVENT);
        out.extend_from_slice(b"data: [DONE]\n\n");
        self.state = State::Done;
        true
    }

    /// A keep-alive comment if the stream has been silent for the interval (and re-arms the
    /// timer); registers the waker otherwise.
    fn keep_alive_due(&mut self, cx: &mut Context<'_>) -> bool {
        let (Some(interval), Some(timer)) = (self.keep_alive, self.keep_alive_timer.as_mut())
        else {
            return false;
        };
        if timer.as_mut().poll(cx).is_pending() {
            return false;
        }
        timer.as_mut().reset(tokio::time::Instant::now() + interval);
        // Register the re-armed timer's waker.
        let _ = timer.as_mut().poll(cx);
        true
    }

    fn rearm_keep_alive(&mut self) {
        if let (Some(interval), Some(timer)) = (self.keep_alive, self.keep_alive_timer.as_mut()) {
            timer.as_mut().reset(tokio::time::Instant::now() + interval);
        }
    }

    /// The stream is reset after its `data: [DONE]` (fault `reset_after_done`) when `reset`.
    pub fn reset_after_done(mut self, reset: bool) -> Self {
        self.reset_after_done = reset;
        self
    }

    fn closing(grace: Duration) -> State {
        State::Closing(Box::pin(tokio::time::sleep(grace)))
    }

    /// Ends `out` (holding everything up to token `output_tokens`) as the cut says, if it is due.
    fn cut_if_due(&mut self, out: &mut Vec<u8>, output_tokens: u32) -> bool {
        let Some(cut) = self.cut.filter(|c| output_tokens >= c.after) else {
            return false;
        };
        if cut.mid_event {
            self.encoder.partial_event(out, output_tokens);
        }
        self.state = Self::closing(DISCONNECT_GRACE);
        true
    }

    /// The next frame: `Ok(bytes)`, `Err` to cut the connection, or `None` at the end.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, StreamCut>>> {
        loop {
            match &mut self.state {
                State::Done => return Poll::Ready(None),
                State::Closing(grace) => {
                    if grace.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.state = State::Done;
                    return Poll::Ready(Some(Err(StreamCut)));
                }
                State::Open => {}
            }
            let mut out = Vec::new();
            if !self.error_if_due(&mut out, 0) && !self.cut_if_due(&mut out, 0) {
                while out.len() < MAX_FRAME {
                    match self.events.poll_recv(cx) {
                        Poll::Ready(Some(SeqEvent::Token {
                            delta,
                            output_tokens,
                        })) => {
                            if let Some(f) = &self.in_flight {
                                f.first_token();
                            }
                            self.encoder.token(&mut out, &delta, output_tokens);
                            if self.error_if_due(&mut out, output_tokens)
                                || self.cut_if_due(&mut out, output_tokens)
                            {
                                break;
                            }
                        }
                        Poll::Ready(Some(SeqEvent::Finished(finish))) => {
                            if let Some(f) = &self.in_flight {
                                f.first_token();
                            }
                            if self.error.is_some_and(|e| finish.output_tokens >= e.after)
                                && self.error_if_due(&mut out, finish.output_tokens)
                            {
                                break;
                            }
                            self.encoder.finish(&mut out, &finish);
                            self.state = if self.reset_after_done {
                                // The end goes out first, then the connection is cut.
                                Self::closing(DISCONNECT_GRACE)
                            } else {
                                State::Done
                            };
                            break;
                        }
                        Poll::Ready(None) => {
                            // The engine dropped the sequence without finishing it.
                            self.state = Self::closing(Duration::ZERO);
                            break;
                        }
                        Poll::Pending => break,
                    }
                }
            }
            if !out.is_empty() {
                self.rearm_keep_alive();
                return Poll::Ready(Some(Ok(Bytes::from(out))));
            }
            if matches!(self.state, State::Open) {
                if self.keep_alive_due(cx) {
                    return Poll::Ready(Some(Ok(Bytes::from_static(KEEP_ALIVE_COMMENT))));
                }
                return Poll::Pending;
            }
        }
    }
}

#[cfg(test)]
mod tests;
