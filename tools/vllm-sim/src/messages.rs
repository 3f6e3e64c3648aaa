//! Anthropic's Messages API as vLLM 0.34 serves it (`vllm/entrypoints/anthropic/`):
//! `POST /v1/messages` (whole or streamed) and `POST /v1/messages/count_tokens`.
//!
//! `system` (a string or text blocks) becomes a system message and each message's content (a
//! string or blocks: `text` blocks give their text, a `tool_result` its string content) a chat
//! message, rendered with the sim's chat template, so a conversation's next turn extends the last
//! one's prompt exactly as chat does. `max_tokens` is required, as in vLLM.
//!
//! A stream is vLLM's: `message_start` (the message with empty content and `usage.input_tokens`),
//! `content_block_start` (a text block), `content_block_delta` (`text_delta`)...,
//! `content_block_stop`, `message_delta` (`stop_reason`, `stop_sequence`, `usage` with
//! `output_tokens`), `message_stop`; each as `event: <type>` + `data: <json>`. With
//! `--enable-prompt-tokens-details` the final usage counts cached prompt tokens as
//! `cache_read_input_tokens` and leaves them out of `input_tokens`, as vLLM's
//! `_build_anthropic_usage` does. Errors are Anthropic's `{"type":"error","error":{"type",
//! "message"}}` with the error type vLLM's `translate_error_type` gives the status.

use bytes::Bytes;
use hyper::{Response, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{bad_request, parse};
use crate::body::{self, SimBody};
use crate::engine::SeqEvent;
use crate::error::ApiError;
use crate::faults::FaultDecision;
use crate::openai::{SamplingRequest, StopStrings};
use crate::prompt::{render_chat, ChatEnding, ChatMessage, MessageContent};
use crate::responses::{finish, start};
use crate::scheduler::Finish;
use crate::state::AppState;
use crate::tokenizer::count_tokens as tokens_of;

/// Whether `path` is one of this module's routes.
pub fn is_messages_path(path: &str) -> bool {
    matches!(path, "/v1/messages" | "/v1/messages/count_tokens")
}

/// Anthropic's error type for an HTTP status (vLLM's `translate_error_type`).
pub fn error_type(status: u16) -> &'static str {
    match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// An Anthropic error body.
pub fn anthropic_error(status: StatusCode, message: &str) -> Response<SimBody> {
    body::json(
        status,
        &json!({"type": "error", "error": {"type": error_type(status.as_u16()), "message": message}}),
    )
}

/// `e` as vLLM's Anthropic router answers it: the same status, the message in Anthropic's shape.
pub fn error_response(e: ApiError) -> Response<SimBody> {
    let rendered = e.into_response();
    let status = rendered.status();
    let message = match rendered.into_body() {
        SimBody::Full(Some(bytes)) => message_of(&bytes),
        _ => None,
    }
    .unwrap_or_else(|| status.canonical_reason().unwrap_or("error").to_string());
    anthropic_error(status, &message)
}

fn message_of(bytes: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(bytes).ok()?;
    let text = value
        .pointer("/error/message")
        .or_else(|| value.get("detail"))
        .or_else(|| value.get("error"))?;
    Some(match text {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    })
}

/// The fields of a Messages request the sim reads.
#[derive(Debug, Deserialize)]
struct MessagesRequest {
    #[serde(default)]
    model: Option<String>,
    messages: Vec<Value>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    temperature: Option<f64>,
}

/// The text of a `content` or `system` value: a string, or blocks whose text is taken from `text`
/// blocks and string `content` (tool results).
fn text_of(value: &Value) -> Result<String, ApiError> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for block in blocks {
                let obj = block
                    .as_object()
                    .ok_or_else(|| bad_request("each content block must be an object"))?;
                if let Some(text) = obj.get("text").and_then(Value::as_str) {
                    out.push_str(text);
                } else if let Some(text) = obj.get("content").and_then(Value::as_str) {
                    out.push_str(text);
                }
            }
            Ok(out)
        }
        _ => Err(bad_request(
            "content must be a string or an array of blocks",
        )),
    }
}

/// The chat messages of a request's `system` and `messages`.
fn chat_messages(system: Option<&Value>, messages: &[Value]) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = system.filter(|s| !s.is_null()) {
        out.push(ChatMessage {
            role: "system".to_string(),
            content: Some(MessageContent::Text(text_of(system)?)),
        });
    }
    for message in messages {
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad_request("each message needs a string `role`"))?;
        let content = message
            .get("content")
            .ok_or_else(|| bad_request("each message needs `content`"))?;
        out.push(ChatMessage {
            role: role.to_string(),
            content: Some(MessageContent::Text(text_of(content)?)),
        });
    }
    if out.iter().all(|m| m.role == "system") {
        return Err(bad_request("messages must not be empty"));
    }
    Ok(out)
}

/// `stop_reason` and `stop_sequence` of a finished generation.
fn stop_reason(finish: &Finish) -> (&'static str, Option<String>) {
    match (finish.reason.as_str(), &finish.stop_reason) {
        ("length", _) => ("max_tokens", None),
        (_, Some(stop)) => ("stop_sequence", Some(stop.clone())),
        _ => ("end_turn", None),
    }
}

/// The final `usage` (see the module docs for cached tokens).
fn final_usage(state: &AppState, finish: &Finish) -> Value {
    if state.config.enable_prompt_tokens_details {
        json!({
            "input_tokens": finish.prompt_tokens.saturating_sub(finish.cached_tokens),
            "output_tokens": finish.output_tokens,
            "cache_read_input_tokens": finish.cached_tokens,
        })
    } else {
        json!({"input_tokens": finish.prompt_tokens, "output_tokens": finish.output_tokens})
    }
}

/// `POST /v1/messages`.
pub async fn create(
    state: &AppState,
    bytes: &[u8],
    faults: &FaultDecision,
) -> Result<Response<SimBody>, ApiError> {
    let request: MessagesRequest = parse(bytes)?;
    let Some(max_tokens) = request.max_tokens else {
        return Err(bad_request("max_tokens: Field required"));
    };
    let messages = chat_messages(request.system.as_ref(), &request.messages)?;
    let stream = request.stream.unwrap_or(false);
    let sampling = SamplingRequest {
        max_tokens: Some(max_tokens),
        temperature: request.temperature,
        stop: request.stop_sequences.map(StopStrings::Many),
        stream: Some(stream),
        ..SamplingRequest::default()
    };
    let started = start(state, request.model, &messages, sampling, faults)?;
    let id = format!("msg_{}", state.fresh_id());
    let mut events = started.events;
    if !stream {
        let finish = finish(&mut events).await?;
        let (reason, sequence) = stop_reason(&finish);
        let mut message = json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": finish.text}],
            "model": started.model,
            "stop_reason": reason,
            "usage": final_usage(state, &finish),
        });
        if let Some(sequence) = sequence {
            message["stop_sequence"] = json!(sequence);
        }
        return Ok(body::json(StatusCode::OK, &message));
    }
    let start_event = json!({
        "type": "message_start",
        "message": {
            "id": id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": started.model,
            "stop_reason": null,
            "stop_sequence": null,
            "usage": {"input_tokens": started.prompt_tokens, "output_tokens": 0},
        },
    });
    let details = state.config.enable_prompt_tokens_details;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(stream_events(start_event, events, tx, details));
    Ok(body::channel_stream(rx))
}

fn write_event(out: &mut Vec<u8>, event: &Value) {
    let kind = event.get("type").and_then(Value::as_str).unwrap_or("error");
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    let _ = serde_json::to_writer(&mut *out, event);
    out.extend_from_slice(b"\n\n");
}

async fn stream_events(
    start_event: Value,
    mut events: mpsc::UnboundedReceiver<SeqEvent>,
    tx: mpsc::UnboundedSender<Bytes>,
    details: bool,
) {
    let mut out = Vec::new();
    write_event(&mut out, &start_event);
    let _ = tx.send(Bytes::from(std::mem::take(&mut out)));
    let mut opened = false;
    let open = |out: &mut Vec<u8>| {
        write_event(
            out,
            &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        );
    };
    let delta = |out: &mut Vec<u8>, text: &str| {
        write_event(
            out,
            &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
        );
    };
    let finish = loop {
        match events.recv().await {
            Some(SeqEvent::Token { delta: text, .. }) if !text.is_empty() => {
                if !opened {
                    open(&mut out);
                    opened = true;
                }
                delta(&mut out, &text);
                if tx.send(Bytes::from(std::mem::take(&mut out))).is_err() {
                    return;
                }
            }
            Some(SeqEvent::Token { .. }) => continue,
            Some(SeqEvent::Finished(finish)) => break finish,
            None => {
                write_event(
                    &mut out,
                    &json!({"type": "error", "error": {"type": "api_error", "message": "The engine is not running"}}),
                );
                let _ = tx.send(Bytes::from(out));
                return;
            }
        }
    };
    if !finish.text.is_empty() {
        if !opened {
            open(&mut out);
            opened = true;
        }
        delta(&mut out, &finish.text);
    }
    if opened {
        write_event(&mut out, &json!({"type": "content_block_stop", "index": 0}));
    }
    let (reason, sequence) = stop_reason(&finish);
    let usage = if details {
        json!({
            "input_tokens": finish.prompt_tokens.saturating_sub(finish.cached_tokens),
            "output_tokens": finish.output_tokens,
            "cache_read_input_tokens": finish.cached_tokens,
        })
    } else {
        json!({"input_tokens": finish.prompt_tokens, "output_tokens": finish.output_tokens})
    };
    write_event(
        &mut out,
        &json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}),
    );
    write_event(&mut out, &json!({"type": "message_stop"}));
    let _ = tx.send(Bytes::from(out));
}

/// `POST /v1/messages/count_tokens`: the rendered prompt's tokens.
pub fn count_tokens(state: &AppState, bytes: &[u8]) -> Result<Response<SimBody>, ApiError> {
    #[derive(Deserialize)]
    struct CountRequest {
        #[serde(default)]
        model: Option<String>,
        messages: Vec<Value>,
        #[serde(default)]
        system: Option<Value>,
    }
    let request: CountRequest = parse(bytes)?;
    match request.model {
        Some(m) if state.config.models.contains(&m) => {}
        Some(m) => return Err(ApiError::ModelNotFound(m)),
        None => return Err(bad_request("model: Field required")),
    }
    let messages = chat_messages(request.system.as_ref(), &request.messages)?;
    let prompt = render_chat(&messages, ChatEnding::GenerationPrompt).map_err(bad_request)?;
    let input_tokens = tokens_of(prompt.len());
    Ok(body::json(
        StatusCode::OK,
        &json!({"input_tokens": input_tokens, "context_management": {"original_input_tokens": input_tokens}}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_types_follow_vllms_translation() {
        assert_eq!(error_type(400), "invalid_request_error");
        assert_eq!(error_type(401), "authentication_error");
        assert_eq!(error_type(404), "not_found_error");
        assert_eq!(error_type(429), "rate_limit_error");
        assert_eq!(error_type(503), "overloaded_error");
        assert_eq!(error_type(500), "api_error");
        assert_eq!(error_type(422), "invalid_request_error");
    }

    #[test]
    fn system_and_blocks_become_chat_messages() {
        let system = json!([{"type": "text", "text": "Be brief."}]);
        let messages = [
            json!({"role": "user", "content": "Hi"}),
            json!({"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}),
        ];
        let chat = chat_messages(Some(&system), &messages).unwrap();
        let roles: Vec<&str> = chat.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant"]);
        assert!(chat_messages(None, &[]).is_err());
        assert!(chat_messages(None, &[json!({"role": "user", "content": 3})]).is_err());
    }

    #[test]
    fn errors_render_in_anthropics_shape() {
        let response = error_response(ApiError::ModelNotFound("x".into()));
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        let SimBody::Full(Some(bytes)) = response.into_body() else {
            panic!("a whole body")
        };
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "not_found_error");
        assert_eq!(v["error"]["message"], "The model `x` does not exist.");
    }
}
