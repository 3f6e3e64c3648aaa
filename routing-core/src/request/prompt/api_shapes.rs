//! Routing features of the two non-chat conversation APIs the gateway routes like chat: OpenAI's
//! Responses API (`/v1/responses`) and Anthropic's Messages API (`/v1/messages`, and its
//! `count_tokens`).
//!
//! Both are rewritten into chat `messages` and canonicalised by
//! [`super::canonical_chat_prompt`], so their prefixes hash exactly as chat's do:
//! a conversation's next turn extends the previous turn's blocks whichever of the three APIs
//! carries it. Responses: `instructions` is a system message, then `input` (a string is one user
//! message; items of type `message` (or without a type) are messages whose `input_text` /
//! `output_text` parts render as text parts; other items (function calls, their outputs,
//! reasoning) are rendered as a digest of their canonical JSON under their type). A request with
//! `previous_response_id` carries only the new turn: the backend holding the earlier response adds
//! the conversation, so its blocks cannot extend the earlier turn's here; the Worker pins it to that
//! backend instead ([`previous_response_id`]). Messages: `system` (a string or text blocks) is a
//! system message, then each message, its content a string or blocks (`text` blocks render as text
//! parts, the others as digests, as chat's media parts do). `max_output_tokens` / `max_tokens` is
//! the output bound.

use super::{
    canonical_chat_prompt, client_request_id, estimate_tokens, invalid, object_and_model,
    optional_u32, prefix_hashes, stream_flag, FeatureConfig, PromptError, RequestFeatures,
};
use crate::request::endpoint::Endpoint;
use crate::request::routing_key::routing_key;
use serde_json::{json, Map, Value};

/// The `previous_response_id` of a Responses request body, if it names one.
pub fn previous_response_id(body: &Value) -> Option<&str> {
    body.get("previous_response_id")
        .and_then(Value::as_str)
        .filter(|id| !id.is_empty())
}

/// A Responses request's `previous_response_id`, and whether its response is stored (`store`,
/// true unless the request says `false`).
fn stored_state(obj: &Map<String, Value>) -> Result<(Option<String>, bool), PromptError> {
    let previous = match obj.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) if id.is_empty() => None,
        Some(Value::String(id)) => Some(id.clone()),
        Some(_) => return Err(invalid("previous_response_id", "a string")),
    };
    let store = match obj.get("store") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("store", "a boolean")),
    };
    Ok((previous, store))
}

/// The chat messages a Responses request's `instructions` and `input` stand for.
pub fn responses_messages(obj: &Map<String, Value>) -> Result<Value, PromptError> {
    let mut messages = Vec::new();
    match obj.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(invalid("instructions", "a string")),
    }
    match obj.get("input") {
        None | Some(Value::Null) => return Err(PromptError::MissingInput { field: "input" }),
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if !items.is_empty() => {
            for item in items {
                messages.push(response_item(item)?);
            }
        }
        Some(_) => return Err(invalid("input", "a string or a non-empty array of items")),
    }
    Ok(Value::Array(messages))
}

fn response_item(item: &Value) -> Result<Value, PromptError> {
    let obj = item
        .as_object()
        .ok_or(invalid("input", "an array of item objects"))?;
    let kind = obj.get("type").and_then(Value::as_str).unwrap_or("message");
    if kind != "message" {
        // Tool calls, their outputs, reasoning: one part digested under the item's type.
        return Ok(json!({"role": kind, "content": [item]}));
    }
    let role = obj
        .get("role")
        .and_then(Value::as_str)
        .ok_or(invalid("input", "message items with a string `role`"))?;
    let content = match obj.get("content") {
        Some(Value::String(s)) => json!(s),
        Some(Value::Array(parts)) => Value::Array(parts.iter().map(text_part).collect()),
        _ => return Err(invalid("input", "message items with `content`")),
    };
    Ok(json!({"role": role, "content": content}))
}

/// A Responses or Messages content part as a chat part: text kinds become `text` parts, the
/// others stay as they are (and are digested).
fn text_part(part: &Value) -> Value {
    let kind = part.get("type").and_then(Value::as_str);
    match (kind, part.get("text").and_then(Value::as_str)) {
        (Some("input_text" | "output_text" | "text"), Some(text)) => {
            json!({"type": "text", "text": text})
        }
        _ => part.clone(),
    }
}

/// The chat messages an Anthropic request's `system` and `messages` stand for.
pub fn anthropic_messages(obj: &Map<String, Value>) -> Result<Value, PromptError> {
    let list = match obj.get("messages") {
        None | Some(Value::Null) => return Err(PromptError::MissingInput { field: "messages" }),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(invalid("messages", "an array of messages")),
    };
    let mut messages = Vec::with_capacity(list.len() + 1);
    match obj.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            let parts: Vec<Value> = blocks.iter().map(text_part).collect();
            messages.push(json!({"role": "system", "content": parts}));
        }
        Some(_) => return Err(invalid("system", "a string or an array of text blocks")),
    }
    for (index, message) in list.iter().enumerate() {
        let bad = |reason| PromptError::InvalidMessage { index, reason };
        let m = message.as_object().ok_or(bad("must be an object"))?;
        let role = m.get("role").cloned().unwrap_or(Value::Null);
        let content = match m.get("content") {
            Some(Value::String(s)) => json!(s),
            Some(Value::Array(blocks)) => Value::Array(blocks.iter().map(text_part).collect()),
            _ => return Err(bad("must have `content`: a string or an array of blocks")),
        };
        messages.push(json!({"role": role, "content": content}));
    }
    Ok(Value::Array(messages))
}

/// The routing features of a Responses, Messages or count-tokens request.
pub fn api_features(
    endpoint: Endpoint,
    body: &Value,
    header: &dyn Fn(&str) -> Option<String>,
    config: &FeatureConfig,
) -> Result<RequestFeatures, PromptError> {
    let (obj, model) = object_and_model(body)?;
    let stream = stream_flag(obj)?;
    let (messages, max_field) = match endpoint {
        Endpoint::Responses => (responses_messages(obj)?, Some("max_output_tokens")),
        Endpoint::Messages => (anthropic_messages(obj)?, Some("max_tokens")),
        _ => (anthropic_messages(obj)?, None),
    };
    let max_tokens = match max_field {
        None => 0,
        Some(field) => match optional_u32(obj, field)? {
            Some(n) => n,
            None if endpoint == Endpoint::Messages => {
                return Err(PromptError::MissingInput {
                    field: "max_tokens",
                })
            }
            None => config.default_max_tokens,
        },
    };
    let (previous_response_id, stores_response) = match endpoint {
        Endpoint::Responses => stored_state(obj)?,
        _ => (None, false),
    };
    let canonical = canonical_chat_prompt(&messages, obj.get("tools"))?;
    let block_tokens = config.block_tokens.max(1);
    let counting = endpoint == Endpoint::MessagesCountTokens;
    // Counting tokens computes no KV blocks: nothing to place by prefix. The chain is seeded
    // with the model, as chat's is, so a conversation hashes the same on every API.
    let block_hashes = match counting {
        true => Vec::new(),
        false => prefix_hashes(&canonical, &model, body, config),
    };
    Ok(RequestFeatures {
        request_id: client_request_id(header),
        kind: endpoint,
        model,
        stream: stream && !counting,
        prompt_tokens: estimate_tokens(&canonical),
        max_tokens,
        routing_key: routing_key(header, body, config.routing_header.as_deref()),
        block_tokens: u32::try_from(block_tokens).unwrap_or(u32::MAX),
        block_hashes,
        role_hint: None,
        sent_ahead: None,
        previous_response_id,
        stores_response,
        owner: None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::endpoint_features;
    use super::*;

    fn no_header(_: &str) -> Option<String> {
        None
    }

    fn features(endpoint: Endpoint, body: Value) -> RequestFeatures {
        endpoint_features(endpoint, &body, &no_header, &FeatureConfig::default()).unwrap()
    }

    const SYSTEM: &str =
        "You are a meticulous assistant for an inference fleet; answer with care, \
        cite the configuration you rely on, and never guess at a number you were not given.";

    #[test]
    fn a_messages_conversation_hashes_exactly_as_the_same_chat() {
        let turn =
            json!([{"role": "user", "content": "What is prefix caching, in two sentences?"}]);
        let chat = features(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "system", "content": SYSTEM}, turn[0]]}),
        );
        let messages = features(
            Endpoint::Messages,
            json!({"model": "m", "max_tokens": 64, "system": SYSTEM, "messages": turn}),
        );
        assert_eq!(messages.block_hashes, chat.block_hashes);
        assert!(!messages.block_hashes.is_empty());
        assert_eq!(messages.kind, Endpoint::Messages);
        assert_eq!(messages.max_tokens, 64);
        // Text blocks render as the string would.
        let blocks = features(
            Endpoint::Messages,
            json!({"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": SYSTEM}],
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "What is prefix caching, in two sentences?"}]}]}),
        );
        assert_eq!(blocks.block_hashes, chat.block_hashes);
    }

    #[test]
    fn a_messages_turn_two_extends_turn_one() {
        let one = json!([{"role": "user", "content": "Explain the KV cache and why a second turn of a conversation reuses it."}]);
        let two = json!([one[0], {"role": "assistant", "content": "It holds keys and values."}, {"role": "user", "content": "And eviction?"}]);
        let first = features(
            Endpoint::Messages,
            json!({"model": "m", "max_tokens": 8, "system": SYSTEM, "messages": one}),
        );
        let second = features(
            Endpoint::Messages,
            json!({"model": "m", "max_tokens": 8, "system": SYSTEM, "messages": two}),
        );
        assert!(first.block_hashes.len() >= 3);
        assert_eq!(
            &second.block_hashes[..first.block_hashes.len()],
            &first.block_hashes[..]
        );
    }

    #[test]
    fn a_responses_request_hashes_as_its_chat_and_its_turns_extend() {
        let question = "Explain the KV cache and why a second turn of a conversation reuses it.";
        let chat = features(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}),
        );
        let one = features(
            Endpoint::Responses,
            json!({"model": "m", "instructions": SYSTEM, "input": question, "max_output_tokens": 32, "stream": true}),
        );
        assert_eq!(one.block_hashes, chat.block_hashes);
        assert_eq!(one.max_tokens, 32);
        assert!(one.stream);
        let two = features(
            Endpoint::Responses,
            json!({"model": "m", "instructions": SYSTEM, "input": [
                {"role": "user", "content": [{"type": "input_text", "text": question}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It holds keys."}]},
                {"role": "user", "content": "And eviction?"},
                {"type": "function_call_output", "call_id": "c1", "output": "{}"},
            ]}),
        );
        assert_eq!(
            &two.block_hashes[..one.block_hashes.len()],
            &one.block_hashes[..]
        );
        assert_eq!(two.max_tokens, FeatureConfig::default().default_max_tokens);
    }

    #[test]
    fn bad_input_gets_clear_errors() {
        let cfg = FeatureConfig::default();
        let err = |endpoint, body: Value| {
            endpoint_features(endpoint, &body, &no_header, &cfg)
                .unwrap_err()
                .to_string()
        };
        assert!(err(Endpoint::Responses, json!({"model": "m"})).contains("input"));
        assert!(err(Endpoint::Responses, json!({"model": "m", "input": 3})).contains("input"));
        assert!(err(Endpoint::Responses, json!({"model": "m", "input": []})).contains("input"));
        assert!(err(
            Endpoint::Responses,
            json!({"model": "m", "input": "x", "instructions": 1})
        )
        .contains("instructions"));
        assert!(err(
            Endpoint::Responses,
            json!({"model": "m", "input": "x", "max_output_tokens": -1})
        )
        .contains("max_output_tokens"));
        assert!(err(
            Endpoint::Messages,
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}]})
        )
        .contains("max_tokens"));
        assert!(err(
            Endpoint::Messages,
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user"}]})
        )
        .contains("content"));
        assert!(err(
            Endpoint::Messages,
            json!({"model": "m", "max_tokens": 1, "messages": []})
        )
        .contains("messages"));
        assert!(
            err(Endpoint::Messages, json!({"max_tokens": 1, "messages": []})).contains("model")
        );
    }

    #[test]
    fn count_tokens_needs_no_output_and_no_blocks() {
        let f = features(
            Endpoint::MessagesCountTokens,
            json!({"model": "m", "system": SYSTEM, "messages": [{"role": "user", "content": "hi"}], "stream": true}),
        );
        assert_eq!(f.max_tokens, 0);
        assert!(f.block_hashes.is_empty());
        assert!(!f.stream);
        assert!(f.prompt_tokens > 10);
    }

    #[test]
    fn stored_state_is_read_and_checked() {
        let f = features(Endpoint::Responses, json!({"model": "m", "input": "x"}));
        assert!(f.stores_response && f.is_stateful());
        assert_eq!(f.previous_response_id, None);
        let f = features(
            Endpoint::Responses,
            json!({"model": "m", "input": "x", "store": false}),
        );
        assert!(!f.is_stateful());
        let f = features(
            Endpoint::Responses,
            json!({"model": "m", "input": "x", "store": false, "previous_response_id": "resp_1"}),
        );
        assert_eq!(f.previous_response_id.as_deref(), Some("resp_1"));
        assert!(f.is_stateful() && !f.stores_response);
        // Chat and Messages carry no stored state.
        let m = features(
            Endpoint::Messages,
            json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
        );
        assert!(!m.is_stateful());
        let cfg = FeatureConfig::default();
        let err = |body: Value| {
            endpoint_features(Endpoint::Responses, &body, &no_header, &cfg).unwrap_err()
        };
        let e = err(json!({"model": "m", "input": "x", "previous_response_id": 3}));
        assert_eq!(e.param(), Some("previous_response_id"));
        let e = err(json!({"model": "m", "input": "x", "store": "yes"}));
        assert_eq!(e.param(), Some("store"));
    }

    #[test]
    fn previous_response_ids_are_read() {
        assert_eq!(
            previous_response_id(&json!({"previous_response_id": "resp_1"})),
            Some("resp_1")
        );
        assert_eq!(
            previous_response_id(&json!({"previous_response_id": ""})),
            None
        );
        assert_eq!(
            previous_response_id(&json!({"previous_response_id": 3})),
            None
        );
    }
}
