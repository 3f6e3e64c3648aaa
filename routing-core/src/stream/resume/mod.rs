//! Resuming a stream whose backend failed after its first byte: the pure half of it.
//!
//! When a streamed chat or completion request breaks off mid-answer, the gateway can ask another
//! backend to go on from what the client has already received and splice that continuation into
//! the same client stream. This module decides and computes, with no I/O:
//!
//! - [`check_request`]: whether the request allows it at all (decided before the first byte, so
//!   the answer is collected only for requests that could be resumed);
//! - [`Partial`]: the answer so far, read from the events the client was sent (id, `created`,
//!   model, text, tokens), and what in it rules a resumption out (a tool call in progress,
//!   reasoning, a finished choice);
//! - [`continuation_body`]: the request that continues it (chat: the partial answer as a final
//!   assistant message with vLLM's `continue_final_message: true` and `add_generation_prompt:
//!   false`; completions: the prompt with the partial text appended; `max_tokens`,
//!   `max_completion_tokens` and `min_tokens` shrink by the tokens already sent);
//! - [`Splice`]: rewrites the continuation's events into the client's stream (the first
//!   answer's id, `created` and model, no second role chunk, usage as one total).
//!
//! Tokens already sent are read from `usage.completion_tokens` when the client asked for
//! `continuous_usage_stats`; otherwise the Worker has the resuming backend's tokenizer count the
//! text sent ([`Partial::uncounted_text`], vLLM's `POST /tokenize`) and passes that count in
//! ([`Partial::tokens_sent_with`]), because a content event is one token only without speculative
//! decoding: with it, vLLM streams each step's accepted draft tokens and the sampled one as one
//! event. Only when the tokenizer cannot answer is the count one per content event (too low under
//! speculative decoding, never too high). The continuation's `usage.prompt_tokens` counts the prompt and the
//! partial answer; the client's total counts the prompt once and every completion token:
//! `prompt = continuation prompt - tokens sent`, `completion = tokens sent + continuation
//! completion`, and `cached_tokens` is the resuming backend's figure, capped at that prompt.

#[cfg(test)]
mod tests;

use crate::request::endpoint::Endpoint;
use crate::stream::usage::Usage;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Value};
use std::borrow::Cow;

/// Why a stream cannot be resumed faithfully (the client then gets the SSE error event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotResumable {
    /// The body is not a JSON object.
    Unreadable,
    /// `n` or `best_of` above 1: several answers interleave in one stream.
    SeveralChoices,
    /// `logprobs`, `top_logprobs` or `prompt_logprobs`: the continuation's would not line up.
    Logprobs,
    /// `echo`: the prompt is part of the answer.
    Echo,
    /// `response_format` with a JSON schema or object, or a guided-decoding field: the grammar
    /// would restart in the middle of the document.
    StructuredOutput,
    /// `tool_choice` forcing a tool call, or a tool call already streaming.
    ToolCall,
    /// The client drives the chat template itself (`continue_final_message`,
    /// `add_generation_prompt: false`).
    OwnTemplate,
    /// A completions prompt that is not one string (token ids, or several prompts).
    PromptShape,
    /// The answer streamed reasoning: it cannot be continued in the same channel.
    Reasoning,
    /// The answer already finished (a `finish_reason` went out); only its ending was lost.
    Finished,
    /// `max_tokens` was already reached.
    NothingLeft,
    /// The failure cut a long event the client already got part of.
    MidEvent,
    /// The endpoint's answers are not continued (embeddings: chat and completions are).
    Endpoint,
}

impl NotResumable {
    /// A short name for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            NotResumable::Unreadable => "unreadable",
            NotResumable::SeveralChoices => "several_choices",
            NotResumable::Logprobs => "logprobs",
            NotResumable::Echo => "echo",
            NotResumable::StructuredOutput => "structured_output",
            NotResumable::ToolCall => "tool_call",
            NotResumable::OwnTemplate => "own_template",
            NotResumable::PromptShape => "prompt_shape",
            NotResumable::Reasoning => "reasoning",
            NotResumable::Finished => "finished",
            NotResumable::NothingLeft => "nothing_left",
            NotResumable::MidEvent => "mid_event",
            NotResumable::Endpoint => "endpoint",
        }
    }
}

/// The request fields that decide resumability; everything else is skipped unread.
#[derive(Deserialize)]
struct RequestShape {
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    best_of: Option<u64>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    top_logprobs: Option<Value>,
    #[serde(default)]
    prompt_logprobs: Option<Value>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    response_format: Option<Value>,
    #[serde(default)]
    guided_json: Option<IgnoredAny>,
    #[serde(default)]
    guided_regex: Option<IgnoredAny>,
    #[serde(default)]
    guided_choice: Option<IgnoredAny>,
    #[serde(default)]
    guided_grammar: Option<IgnoredAny>,
    #[serde(default)]
    structured_outputs: Option<IgnoredAny>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    prompt: Option<Value>,
}

/// Whether a streamed request to `endpoint` could be resumed if its stream broke, judged from its
/// body alone (the parsed body the Worker read its features from).
pub fn check_request(body: &Value, endpoint: Endpoint) -> Result<(), NotResumable> {
    if !endpoint.is_generation() {
        return Err(NotResumable::Endpoint);
    }
    // A derived struct would also accept a JSON array.
    if !body.is_object() {
        return Err(NotResumable::Unreadable);
    }
    let shape = RequestShape::deserialize(body).map_err(|_| NotResumable::Unreadable)?;
    if shape.n.is_some_and(|n| n > 1) || shape.best_of.is_some_and(|n| n > 1) {
        return Err(NotResumable::SeveralChoices);
    }
    let asked = |v: &Option<Value>| {
        v.as_ref()
            .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
    };
    if asked(&shape.logprobs) || asked(&shape.top_logprobs) || asked(&shape.prompt_logprobs) {
        return Err(NotResumable::Logprobs);
    }
    if shape.echo == Some(true) {
        return Err(NotResumable::Echo);
    }
    let format = shape
        .response_format
        .as_ref()
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str);
    let guided = shape.guided_json.is_some()
        || shape.guided_regex.is_some()
        || shape.guided_choice.is_some()
        || shape.guided_grammar.is_some()
        || shape.structured_outputs.is_some();
    if guided || format.is_some_and(|t| t != "text") {
        return Err(NotResumable::StructuredOutput);
    }
    let forced_tool = match &shape.tool_choice {
        Some(Value::String(s)) => s == "required",
        Some(Value::Object(_)) => true,
        _ => false,
    };
    if forced_tool {
        return Err(NotResumable::ToolCall);
    }
    if shape.continue_final_message == Some(true) || shape.add_generation_prompt == Some(false) {
        return Err(NotResumable::OwnTemplate);
    }
    if endpoint == Endpoint::Completions {
        prompt_text(shape.prompt.as_ref())?;
    }
    Ok(())
}

/// A completions prompt's text, when it is one string (or a list of one string).
fn prompt_text(prompt: Option<&Value>) -> Result<&str, NotResumable> {
    match prompt {
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(a)) if a.len() == 1 => a[0].as_str().ok_or(NotResumable::PromptShape),
        _ => Err(NotResumable::PromptShape),
    }
}

/// Cuts a byte stream into SSE events and hands over each event's `data` (the `data:` lines
/// joined), whatever the chunking. Both [`Partial`] and [`Splice`] read events through it.
#[derive(Debug, Default)]
struct Events {
    held: Vec<u8>,
}

impl Events {
    /// Feeds bytes; calls `each(event bytes, data)` for every event completed by them. Whole
    /// events are read in place; only a trailing partial event is copied and held.
    fn push(&mut self, bytes: &[u8], mut each: impl FnMut(&[u8], &[u8])) {
        if self.held.is_empty() {
            let rest = frame(bytes, &mut each);
            self.held.extend_from_slice(&bytes[rest..]);
            return;
        }
        self.held.extend_from_slice(bytes);
        let rest = frame(&self.held, &mut each);
        self.held.drain(..rest);
    }

    /// Whether a partial event is pending.
    fn pending(&self) -> bool {
        !self.held.is_empty()
    }
}

/// Calls `each` for every whole event in `bytes`; returns where the trailing partial one starts.
fn frame(bytes: &[u8], each: &mut impl FnMut(&[u8], &[u8])) -> usize {
    let mut start = 0;
    while let Some(end) = event_end(&bytes[start..]) {
        let event = &bytes[start..start + end];
        each(event, &event_data(event));
        start += end;
    }
    start
}

/// The end of the first event in `bytes` (just past its blank line), if it is complete.
fn event_end(bytes: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(off) = bytes[i..].iter().position(|&b| b == b'\n') {
        let lf = i + off;
        match (bytes.get(lf + 1), bytes.get(lf + 2)) {
            (Some(b'\n'), _) => return Some(lf + 2),
            (Some(b'\r'), Some(b'\n')) => return Some(lf + 3),
            _ => i = lf + 1,
        }
    }
    None
}

/// An event's `data:` lines joined by newlines (the SSE rule); borrowed when there is one.
fn event_data(event: &[u8]) -> Cow<'_, [u8]> {
    let mut lines = event
        .split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .filter_map(|line| line.strip_prefix(b"data:"))
        .map(|rest| rest.strip_prefix(b" ").unwrap_or(rest));
    let Some(first) = lines.next() else {
        return Cow::Borrowed(&[]);
    };
    let Some(second) = lines.next() else {
        return Cow::Borrowed(first);
    };
    let mut data = [first, b"\n", second].concat();
    for line in lines {
        data.push(b'\n');
        data.extend_from_slice(line);
    }
    Cow::Owned(data)
}

/// One streamed chunk, as far as a resumption reads it.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(default)]
    created: Option<u64>,
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    choices: Vec<Choice<'a>>,
    #[serde(default)]
    usage: Option<ChunkUsage>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: u32,
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(default)]
    finish_reason: Option<IgnoredAny>,
    #[serde(default)]
    logprobs: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<Vec<IgnoredAny>>,
    #[serde(borrow, default)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    reasoning: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ChunkUsage {
    #[serde(default)]
    completion_tokens: u32,
}

/// The answer the client has received so far; see the module documentation.
#[derive(Debug, Default)]
pub struct Partial {
    events: Events,
    /// The first chunk's `id`, `created` and `model`: every later chunk carries them.
    pub id: Option<String>,
    /// The first chunk's `created`.
    pub created: Option<u64>,
    /// The first chunk's `model`.
    pub model: Option<String>,
    /// The text so far.
    pub text: String,
    /// Content events sent so far (one token each without speculative decoding, at least one).
    pub tokens: u32,
    /// The last `usage.completion_tokens` the client saw (continuous usage), if any.
    reported_tokens: Option<u32>,
    /// What in the answer rules out a resumption, once seen.
    blocked: Option<NotResumable>,
}

impl Partial {
    /// An empty answer.
    pub fn new() -> Partial {
        Partial::default()
    }

    /// Reads bytes as the client receives them (whole events, in order).
    pub fn observe(&mut self, bytes: &[u8]) {
        let mut events = std::mem::take(&mut self.events);
        events.push(bytes, |_, data| self.event(data));
        self.events = events;
    }

    fn event(&mut self, data: &[u8]) {
        if data == b"[DONE]" || self.blocked.is_some() {
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk>(data) else {
            return;
        };
        if self.id.is_none() {
            self.id = chunk.id.map(Cow::into_owned);
            self.created = chunk.created;
            self.model = chunk.model.map(Cow::into_owned);
        }
        if let Some(u) = &chunk.usage {
            self.reported_tokens = Some(u.completion_tokens);
        }
        for choice in &chunk.choices {
            if choice.index != 0 {
                self.blocked = Some(NotResumable::SeveralChoices);
                return;
            }
            if choice.logprobs.is_some() {
                self.blocked = Some(NotResumable::Logprobs);
                return;
            }
            let text = match &choice.delta {
                Some(d) => {
                    if d.tool_calls.as_ref().is_some_and(|t| !t.is_empty()) {
                        self.blocked = Some(NotResumable::ToolCall);
                        return;
                    }
                    let reasoning = [&d.reasoning_content, &d.reasoning]
                        .into_iter()
                        .any(|r| r.as_ref().is_some_and(|r| !r.is_empty()));
                    if reasoning {
                        self.blocked = Some(NotResumable::Reasoning);
                        return;
                    }
                    d.content.as_deref()
                }
                None => choice.text.as_deref(),
            };
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                self.text.push_str(t);
                self.tokens += 1;
            }
            if choice.finish_reason.is_some() {
                self.blocked = Some(NotResumable::Finished);
            }
        }
    }

    /// Tokens the client has received, as far as the stream itself tells: the reported count with
    /// continuous usage, else one per content event.
    pub fn tokens_sent(&self) -> u32 {
        self.tokens_sent_with(None)
    }

    /// The text whose tokens the stream did not count (no continuous usage reported them): what a
    /// resumption has a tokenizer count. `None` when the count is the backend's own, or nothing
    /// was sent.
    pub fn uncounted_text(&self) -> Option<&str> {
        (self.reported_tokens.is_none() && !self.text.is_empty()).then_some(self.text.as_str())
    }

    /// The text the client received, when the stream did not count its tokens and the whole
    /// answer was read: what a settlement has a tokenizer count (`crate::stream::settle`). `None`
    /// as for [`Partial::uncounted_text`], and when reading stopped early (several choices,
    /// logprobs, a tool call or reasoning: the text is not all the client got); a finished answer's
    /// text is whole.
    pub fn received_text(&self) -> Option<&str> {
        match self.blocked {
            None | Some(NotResumable::Finished) => self.uncounted_text(),
            Some(_) => None,
        }
    }

    /// Tokens the client has received, `tokenized` being a tokenizer's count of
    /// [`Partial::uncounted_text`] when there is one: the reported count wins, then the
    /// tokenizer's, then one per content event; never fewer than the content events (each carried
    /// at least one token).
    pub fn tokens_sent_with(&self, tokenized: Option<u32>) -> u32 {
        self.reported_tokens
            .or(tokenized)
            .unwrap_or(self.tokens)
            .max(self.tokens)
    }

    /// Whether the answer can still be continued (nothing in it rules that out).
    pub fn resumable(&self) -> Result<(), NotResumable> {
        if let Some(reason) = self.blocked {
            return Err(reason);
        }
        if self.events.pending() {
            return Err(NotResumable::MidEvent);
        }
        Ok(())
    }
}

/// The request that continues `partial`, of which the client received `sent` tokens
/// ([`Partial::tokens_sent_with`]): see the module documentation.
pub fn continuation_body(
    original: &[u8],
    endpoint: Endpoint,
    partial: &Partial,
    sent: u32,
) -> Result<Vec<u8>, NotResumable> {
    partial.resumable()?;
    let mut body: Value = serde_json::from_slice(original).map_err(|_| NotResumable::Unreadable)?;
    let sent = u64::from(sent);
    match endpoint {
        Endpoint::Chat => {
            let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) else {
                return Err(NotResumable::Unreadable);
            };
            messages.push(json!({ "role": "assistant", "content": partial.text }));
            body["continue_final_message"] = json!(true);
            body["add_generation_prompt"] = json!(false);
        }
        Endpoint::Completions => {
            let extended = format!("{}{}", prompt_text(body.get("prompt"))?, partial.text);
            body["prompt"] = json!(extended);
        }
        _ => return Err(NotResumable::Endpoint),
    }
    let Some(obj) = body.as_object_mut() else {
        return Err(NotResumable::Unreadable);
    };
    for field in ["max_tokens", "max_completion_tokens"] {
        if let Some(max) = obj.get(field).and_then(Value::as_u64) {
            let left = max.saturating_sub(sent);
            if left == 0 {
                return Err(NotResumable::NothingLeft);
            }
            obj.insert(field.into(), json!(left));
        }
    }
    if let Some(min) = obj.get("min_tokens").and_then(Value::as_u64) {
        obj.insert("min_tokens".into(), json!(min.saturating_sub(sent)));
    }
    serde_json::to_vec(&body).map_err(|_| NotResumable::Unreadable)
}

/// Rewrites a continuation's events into the client's stream; see the module documentation.
#[derive(Debug)]
pub struct Splice {
    events: Events,
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
    /// Tokens the client had received before this continuation.
    sent: u32,
}

impl Splice {
    /// A splice continuing `partial`, of which the client received `sent` tokens.
    pub fn new(partial: &Partial, sent: u32) -> Splice {
        Splice {
            events: Events::default(),
            id: partial.id.clone().map(Value::String),
            created: partial.created.map(Value::from),
            model: partial.model.clone().map(Value::String),
            sent,
        }
    }

    /// The client's bytes for bytes of the continuation (whole events; a partial event waits for
    /// its end).
    pub fn rewrite(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(bytes.len() + 64);
        let mut events = std::mem::take(&mut self.events);
        events.push(bytes, |event, data| match self.event(data) {
            Some(Some(rewritten)) => {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(&rewritten);
                out.extend_from_slice(b"\n\n");
            }
            Some(None) => {}
            None => out.extend_from_slice(event),
        });
        self.events = events;
        out
    }

    /// `None`: pass the event as it is; `Some(None)`: drop it; `Some(Some(data))`: send this.
    fn event(&self, data: &[u8]) -> Option<Option<Vec<u8>>> {
        let mut chunk: Value = serde_json::from_slice(data).ok()?;
        let obj = chunk.as_object_mut()?;
        for (key, value) in [
            ("id", &self.id),
            ("created", &self.created),
            ("model", &self.model),
        ] {
            if let (Some(v), true) = (value, obj.contains_key(key)) {
                obj.insert(key.into(), v.clone());
            }
        }
        if let Some(usage) = obj.get_mut("usage").filter(|u| u.is_object()) {
            self.total_usage(usage);
        }
        let mut role_only = false;
        if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut) {
            for choice in choices.iter_mut() {
                let finished = choice.get("finish_reason").is_some_and(|f| !f.is_null());
                let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) else {
                    continue;
                };
                if delta.remove("role").is_some() {
                    let empty = delta
                        .iter()
                        .all(|(k, v)| v.is_null() || (k == "content" && v.as_str() == Some("")));
                    role_only = empty && !finished;
                }
            }
        }
        let has_usage = obj.get("usage").is_some_and(|u| !u.is_null());
        if role_only && !has_usage {
            return Some(None);
        }
        serde_json::to_vec(&chunk).ok().map(Some)
    }

    /// The client's usage for the continuation's own `usage` (whose prompt holds the partial
    /// answer): the prompt once, every completion token, the cached count capped at that prompt,
    /// as the client is told it.
    pub fn client_usage(&self, usage: Usage) -> Usage {
        let (prompt, completion) = self.totals(
            u64::from(usage.prompt_tokens),
            u64::from(usage.completion_tokens),
        );
        let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        Usage {
            prompt_tokens: clamp(prompt),
            cached_tokens: usage.cached_tokens.map(|c| clamp(u64::from(c).min(prompt))),
            completion_tokens: clamp(completion),
        }
    }

    /// The prompt and completion tokens of the whole answer for the continuation's.
    fn totals(&self, prompt: u64, completion: u64) -> (u64, u64) {
        let sent = u64::from(self.sent);
        (prompt.saturating_sub(sent), completion + sent)
    }

    /// One total for the whole answer: the prompt once, every completion token.
    fn total_usage(&self, usage: &mut Value) {
        let get = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        let (prompt, completion) =
            self.totals(get(usage, "prompt_tokens"), get(usage, "completion_tokens"));
        usage["prompt_tokens"] = json!(prompt);
        usage["completion_tokens"] = json!(completion);
        usage["total_tokens"] = json!(prompt + completion);
        if let Some(details) = usage
            .get_mut("prompt_tokens_details")
            .and_then(Value::as_object_mut)
        {
            if let Some(cached) = details.get("cached_tokens").and_then(Value::as_u64) {
                details.insert("cached_tokens".into(), json!(cached.min(prompt)));
            }
        }
    }
}
