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
            state: State::Open,
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
            if !self.cut_if_due(&mut out, 0) {
                while out.len() < MAX_FRAME {
                    match self.events.poll_recv(cx) {
                        Poll::Ready(Some(SeqEvent::Token {
                            delta,
                            output_tokens,
                        })) => {
                            self.encoder.token(&mut out, &delta, output_tokens);
                            if self.cut_if_due(&mut out, output_tokens) {
                                break;
                            }
                        }
                        Poll::Ready(Some(SeqEvent::Finished(finish))) => {
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
                return Poll::Ready(Some(Ok(Bytes::from(out))));
            }
            if matches!(self.state, State::Open) {
                return Poll::Pending;
            }
        }
    }
}

#[cfg(test)]
mod tests;
