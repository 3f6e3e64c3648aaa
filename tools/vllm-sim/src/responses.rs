//! The OpenAI Responses API as vLLM 0.34 serves it without harmony (the "simple" path of
//! `vllm/entrypoints/openai/responses/serving.py`): `POST /v1/responses` (whole or streamed),
//! `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.
//!
//! A request's messages are built as vLLM's `construct_input_messages` builds them
//! (`responses/utils.py`): `instructions` as a system message, then the previous response's
//! conversation without its system message, then the previous response's output as an assistant
//! message, then the new `input` (a string is one user message; items are messages). The sim's
//! chat template renders them, so a follow-up with `previous_response_id` extends the earlier
//! prompt and hits the prefix cache of the server that stored it. Responses are stored as vLLM
//! stores them with `VLLM_ENABLE_RESPONSES_API_STORE=1` (vLLM's default ignores `store`), in
//! memory, bounded to [`STORE_LIMIT`] responses (oldest dropped first). An unknown id gets vLLM's
//! 404 (`Response with id '...' not found.`, `param: response_id`).
//!
//! A stream's events are vLLM's, in its order, each `event: <type>` + `data: <json>` with a
//! `sequence_number` counted from 0: `response.created`, `response.in_progress`,
//! `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
//! `response.output_text.done`, `response.content_part.done`, `response.output_item.done`, then
//! `response.completed` (or `response.incomplete` when `max_output_tokens` cut it) with `usage`
//! `{input_tokens, input_tokens_details.cached_tokens, output_tokens,
//! output_tokens_details.reasoning_tokens, total_tokens}`. No `[DONE]`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use hyper::{Method, Response, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{bad_request, parse, prepare};
use crate::body::{self, SimBody};
use crate::engine::SeqEvent;
use crate::error::ApiError;
use crate::faults::FaultDecision;
use crate::openai::SamplingRequest;
use crate::prompt::{render_chat, ChatEnding, ChatMessage, ContentPart, MessageContent};
use crate::scheduler::Finish;
use crate::sse::{unix_ms, Endpoint};
use crate::state::AppState;

/// Most responses a server keeps; the oldest goes first.
pub const STORE_LIMIT: usize = 10_000;

/// Whether `path` is a generation route of this module.
pub fn is_generation_path(path: &str) -> bool {
    path == "/v1/responses"
}

/// One stored response: the response object and the conversation that produced it (without the
/// system message, with the output as the last assistant message).
#[derive(Debug, Clone)]
struct Stored {
    response: Value,
    conversation: Vec<ChatMessage>,
}

/// The stored responses of one server (a handle: clones share the store).
#[derive(Debug, Default, Clone)]
pub struct ResponseStore {
    inner: Arc<Mutex<StoreInner>>,
}

#[derive(Debug, Default)]
struct StoreInner {
    by_id: HashMap<String, Stored>,
    order: VecDeque<String>,
}

impl ResponseStore {
    fn get(&self, id: &str) -> Option<Stored> {
        self.inner.lock().ok()?.by_id.get(id).cloned()
    }

    fn put(&self, id: String, stored: Stored) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        if inner.by_id.insert(id.clone(), stored).is_none() {
            inner.order.push_back(id);
        }
        while inner.order.len() > STORE_LIMIT {
            if let Some(old) = inner.order.pop_front() {
                inner.by_id.remove(&old);
            }
        }
    }

    /// How many responses are stored.
    pub fn len(&self) -> usize {
        self.inner.lock().map(|i| i.by_id.len()).unwrap_or(0)
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// vLLM's 404 for an unknown response id.
pub fn not_found(id: &str) -> Response<SimBody> {
    body::json(
        StatusCode::NOT_FOUND,
        &json!({"error": {
            "message": format!("Response with id '{id}' not found."),
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }}),
    )
}

/// `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`; `None` for other paths.
pub fn stored_route(
    state: &AppState,
    path: &str,
    method: &Method,
) -> Option<Result<Response<SimBody>, ApiError>> {
    let rest = path.strip_prefix("/v1/responses/")?;
    let (id, cancel) = match rest.strip_suffix("/cancel") {
        Some(id) => (id, true),
        None => (rest, false),
    };
    if id.is_empty() || id.contains('/') {
        return Some(Err(ApiError::RouteNotFound));
    }
    let answer = match (cancel, method) {
        (false, &Method::GET) => match state.responses.get(id) {
            Some(stored) => Ok(body::json(StatusCode::OK, &stored.response)),
            None => Ok(not_found(id)),
        },
        (true, &Method::POST) => match state.responses.get(id) {
            // Every sim response is synchronous and finished when stored.
            Some(_) => Ok(body::json(
                StatusCode::BAD_REQUEST,
                &json!({"error": {
                    "message": "Cannot cancel a synchronous response.",
                    "type": "invalid_request_error",
                    "param": "response_id",
                    "code": 400,
                }}),
            )),
            None => Ok(not_found(id)),
        },
        _ => Err(ApiError::MethodNotAllowed),
    };
    Some(answer)
}

/// The fields of a Responses request the sim reads.
#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    #[serde(default)]
    model: Option<String>,
    input: Value,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    max_output_tokens: Option<u32>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    background: Option<bool>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    metadata: Option<Value>,
}

/// The messages of `input`: a string is one user message; items are messages (`type` absent or
/// `"message"`) whose content is a string or parts with `text` (`input_text`, `output_text`).
fn input_messages(input: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    match input {
        Value::String(text) => Ok(vec![user(text)]),
        Value::Array(items) => items.iter().map(input_item).collect(),
        _ => Err(bad_request("input must be a string or an array of items")),
    }
}

fn user(text: &str) -> ChatMessage {
    message("user", text)
}

fn message(role: &str, text: &str) -> ChatMessage {
    ChatMessage {
        role: role.to_string(),
        content: Some(MessageContent::Text(text.to_string())),
    }
}

fn input_item(item: &Value) -> Result<ChatMessage, ApiError> {
    let obj = item
        .as_object()
        .ok_or_else(|| bad_request("each input item must be an object"))?;
    match obj.get("type").and_then(Value::as_str) {
        None | Some("message") => {}
        Some(other) => {
            return Err(bad_request(format!(
                "vllm-sim does not support input items of type '{other}'"
            )))
        }
    }
    let role = obj
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| bad_request("an input message needs a string `role`"))?;
    let content = match obj.get("content") {
        Some(Value::String(text)) => MessageContent::Text(text.clone()),
        Some(Value::Array(parts)) => MessageContent::Parts(
            parts
                .iter()
                .map(|p| ContentPart {
                    kind: Some("text".to_string()),
                    text: p.get("text").and_then(Value::as_str).map(str::to_string),
                })
                .collect(),
        ),
        _ => return Err(bad_request("an input message needs `content`")),
    };
    Ok(ChatMessage {
        role: role.to_string(),
        content: Some(content),
    })
}

/// A generation started on the engine for the Responses or Messages API.
pub(crate) struct Started {
    pub(crate) model: String,
    pub(crate) prompt_tokens: u32,
    pub(crate) events: mpsc::UnboundedReceiver<SeqEvent>,
}

/// Validates and submits one generation of `messages` (rendered with the generation prompt).
pub(crate) fn start(
    state: &AppState,
    model: Option<String>,
    messages: &[ChatMessage],
    sampling: SamplingRequest,
    faults: &FaultDecision,
) -> Result<Started, ApiError> {
    let prompt = render_chat(messages, ChatEnding::GenerationPrompt).map_err(bad_request)?;
    let mut generation = prepare(
        state,
        Endpoint::Chat,
        String::new(),
        model,
        prompt,
        sampling,
    )?;
    generation.spec.stall_after = faults.stall_after_tokens;
    let events = state
        .engine
        .submit(generation.spec, Instant::now())
        .map_err(|_| ApiError::EngineGone)?;
    Ok(Started {
        model: generation.model,
        prompt_tokens: generation.prompt_tokens,
        events,
    })
}

/// Waits for a generation's end.
pub(crate) async fn finish(
    events: &mut mpsc::UnboundedReceiver<SeqEvent>,
) -> Result<Finish, ApiError> {
    loop {
        match events.recv().await {
            Some(SeqEvent::Finished(finish)) => return Ok(finish),
            Some(SeqEvent::Token { .. }) => continue,
            None => return Err(ApiError::EngineGone),
        }
    }
}

/// What a response object is built from.
struct Shape {
    id: String,
    created_at: u64,
    model: String,
    instructions: Option<String>,
    max_output_tokens: u32,
    previous_response_id: Option<String>,
    temperature: f64,
    top_p: f64,
    background: bool,
    metadata: Value,
}

impl Shape {
    /// The response object: `status` `in_progress` (no output, no usage) until `done` is given.
    fn object(&self, done: Option<(&str, &Finish)>, message_id: &str) -> Value {
        let (status, output, usage, incomplete) = match done {
            None => ("in_progress", json!([]), Value::Null, Value::Null),
            Some((text, finish)) => {
                let length = finish.reason.as_str() == "length";
                let status = if length { "incomplete" } else { "completed" };
                let content = if text.is_empty() {
                    json!([])
                } else {
                    json!([output_text(text)])
                };
                (
                    status,
                    json!([{
                        "id": message_id,
                        "content": content,
                        "role": "assistant",
                        "status": status,
                        "type": "message",
                    }]),
                    usage(finish),
                    if length {
                        json!({"reason": "max_output_tokens"})
                    } else {
                        Value::Null
                    },
                )
            }
        };
        json!({
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "metadata": self.metadata,
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": true,
            "temperature": self.temperature,
            "tool_choice": "auto",
            "tools": [],
            "top_p": self.top_p,
            "background": self.background,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": null,
            "previous_response_id": self.previous_response_id,
            "prompt": null,
            "reasoning": null,
            "service_tier": "auto",
            "status": status,
            "text": null,
            "top_logprobs": null,
            "truncation": "disabled",
            "usage": usage,
            "user": null,
        })
    }
}

fn output_text(text: &str) -> Value {
    json!({"annotations": [], "text": text, "type": "output_text", "logprobs": null})
}

/// The Responses `usage` of a finished generation.
fn usage(finish: &Finish) -> Value {
    json!({
        "input_tokens": finish.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finish.cached_tokens},
        "output_tokens": finish.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": finish.prompt_tokens + finish.output_tokens,
    })
}

/// `POST /v1/responses`.
pub async fn create(
    state: &AppState,
    bytes: &[u8],
    faults: &FaultDecision,
) -> Result<Response<SimBody>, ApiError> {
    let request: ResponsesRequest = parse(bytes)?;
    let store = request.store.unwrap_or(true);
    let background = request.background.unwrap_or(false);
    if background && !store {
        return Err(bad_request(
            "background can only be used when `store` is true",
        ));
    }
    if background {
        return Err(bad_request(
            "vllm-sim does not run background responses (background: true)",
        ));
    }
    let previous = match &request.previous_response_id {
        None => None,
        Some(id) => match state.responses.get(id) {
            Some(stored) => Some(stored),
            None => return Ok(not_found(id)),
        },
    };
    let mut messages = Vec::new();
    if let Some(instructions) = request.instructions.as_deref().filter(|i| !i.is_empty()) {
        messages.push(message("system", instructions));
    }
    if let Some(previous) = &previous {
        messages.extend(previous.conversation.iter().cloned());
    }
    let new_input = input_messages(&request.input)?;
    messages.extend(new_input);
    let stream = request.stream.unwrap_or(false);
    let sampling = SamplingRequest {
        max_tokens: request.max_output_tokens,
        temperature: request.temperature,
        stream: Some(stream),
        ..SamplingRequest::default()
    };
    let started = start(state, request.model, &messages, sampling, faults)?;
    let max_output_tokens = request.max_output_tokens.unwrap_or_else(|| {
        state
            .config
            .max_model_len
            .saturating_sub(started.prompt_tokens)
    });
    let shape = Shape {
        id: format!("resp_{}", state.fresh_id()),
        created_at: unix_ms() / 1000,
        model: started.model.clone(),
        instructions: request.instructions.clone(),
        max_output_tokens,
        previous_response_id: request.previous_response_id.clone(),
        temperature: request.temperature.unwrap_or(1.0),
        top_p: request.top_p.unwrap_or(1.0),
        background,
        metadata: request.metadata.clone().unwrap_or(Value::Null),
    };
    let conversation: Vec<ChatMessage> = messages
        .into_iter()
        .filter(|m| m.role != "system")
        .collect();
    let message_id = format!("msg_{}", state.fresh_id());
    let keep = store.then_some(&state.responses);
    let mut events = started.events;
    if !stream {
        let finish = finish(&mut events).await?;
        let response = shape.object(Some((&finish.text, &finish)), &message_id);
        remember(keep, &shape, &response, conversation, &finish.text);
        return Ok(body::json(StatusCode::OK, &response));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(stream_events(
        shape,
        message_id,
        events,
        tx,
        conversation,
        keep.cloned(),
    ));
    Ok(body::channel_stream(rx))
}

fn remember(
    store: Option<&ResponseStore>,
    shape: &Shape,
    response: &Value,
    mut conversation: Vec<ChatMessage>,
    text: &str,
) {
    let Some(store) = store else { return };
    if !text.is_empty() {
        conversation.push(message("assistant", text));
    }
    store.put(
        shape.id.clone(),
        Stored {
            response: response.clone(),
            conversation,
        },
    );
}

/// One event: `event: <type>`, `data: <json>` with its `sequence_number`.
fn write_event(out: &mut Vec<u8>, sequence: &mut u64, mut event: Value) {
    let kind = event
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("error")
        .to_string();
    if let Some(obj) = event.as_object_mut() {
        obj.insert("sequence_number".to_string(), json!(*sequence));
    }
    *sequence += 1;
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    let _ = serde_json::to_writer(&mut *out, &event);
    out.extend_from_slice(b"\n\n");
}

async fn stream_events(
    shape: Shape,
    message_id: String,
    mut events: mpsc::UnboundedReceiver<SeqEvent>,
    tx: mpsc::UnboundedSender<Bytes>,
    conversation: Vec<ChatMessage>,
    store: Option<ResponseStore>,
) {
    let mut seq = 0u64;
    let mut out = Vec::new();
    let initial = shape.object(None, &message_id);
    write_event(
        &mut out,
        &mut seq,
        json!({"type": "response.created", "response": initial}),
    );
    write_event(
        &mut out,
        &mut seq,
        json!({"type": "response.in_progress", "response": initial}),
    );
    let _ = tx.send(Bytes::from(std::mem::take(&mut out)));
    let mut text = String::new();
    let mut opened = false;
    let open = |out: &mut Vec<u8>, seq: &mut u64| {
        write_event(
            out,
            seq,
            json!({
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {"id": message_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message"},
            }),
        );
        write_event(
            out,
            seq,
            json!({
                "type": "response.content_part.added",
                "output_index": 0,
                "item_id": message_id,
                "content_index": 0,
                "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []},
            }),
        );
    };
    let finish = loop {
        match events.recv().await {
            Some(SeqEvent::Token { delta, .. }) => {
                if delta.is_empty() {
                    continue;
                }
                if !opened {
                    open(&mut out, &mut seq);
                    opened = true;
                }
                text.push_str(&delta);
                write_event(
                    &mut out,
                    &mut seq,
                    json!({
                        "type": "response.output_text.delta",
                        "content_index": 0,
                        "output_index": 0,
                        "item_id": message_id,
                        "delta": delta,
                        "logprobs": [],
                    }),
                );
                if tx.send(Bytes::from(std::mem::take(&mut out))).is_err() {
                    return;
                }
            }
            Some(SeqEvent::Finished(finish)) => break finish,
            // The engine dropped the sequence: the stream just ends.
            None => return,
        }
    };
    if !finish.text.is_empty() {
        if !opened {
            open(&mut out, &mut seq);
            opened = true;
        }
        text.push_str(&finish.text);
        write_event(
            &mut out,
            &mut seq,
            json!({
                "type": "response.output_text.delta",
                "content_index": 0,
                "output_index": 0,
                "item_id": message_id,
                "delta": finish.text,
                "logprobs": [],
            }),
        );
    }
    let status = if finish.reason.as_str() == "length" {
        "incomplete"
    } else {
        "completed"
    };
    if opened {
        let part = output_text(&text);
        write_event(
            &mut out,
            &mut seq,
            json!({
                "type": "response.output_text.done",
                "output_index": 0,
                "content_index": 0,
                "text": text,
                "logprobs": [],
                "item_id": message_id,
            }),
        );
        write_event(
            &mut out,
            &mut seq,
            json!({
                "type": "response.content_part.done",
                "item_id": message_id,
                "output_index": 0,
                "content_index": 0,
                "part": part,
            }),
        );
        write_event(
            &mut out,
            &mut seq,
            json!({
                "type": "response.output_item.done",
                "output_index": 0,
                "item": {"id": message_id, "content": [part], "role": "assistant", "status": status, "type": "message"},
            }),
        );
    }
    let response = shape.object(Some((&text, &finish)), &message_id);
    remember(store.as_ref(), &shape, &response, conversation, &text);
    let terminal = if status == "incomplete" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    write_event(
        &mut out,
        &mut seq,
        json!({"type": terminal, "response": response}),
    );
    let _ = tx.send(Bytes::from(out));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_strings_and_items_become_messages() {
        let one = input_messages(&json!("Hi")).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].role, "user");
        let items = json!([
            {"role": "user", "content": "a"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        ]);
        assert_eq!(input_messages(&items).unwrap().len(), 2);
        assert!(input_messages(&json!(3)).is_err());
        assert!(input_messages(&json!([{"type": "function_call_output", "output": "x"}])).is_err());
    }

    #[test]
    fn the_store_is_bounded_oldest_first() {
        let store = ResponseStore::default();
        for i in 0..STORE_LIMIT + 2 {
            let stored = Stored {
                response: json!({}),
                conversation: vec![],
            };
            store.put(format!("resp_{i}"), stored);
        }
        assert_eq!(store.len(), STORE_LIMIT);
        assert!(store.get("resp_0").is_none());
        assert!(store.get("resp_1").is_none());
        assert!(store.get(&format!("resp_{}", STORE_LIMIT + 1)).is_some());
    }
}
