//! Prompt canonicalisation and chained block hashing: what a request's prefix looks like to the
//! prefix-affinity table.
//!
//! vLLM's automatic prefix caching reuses the KV blocks of a prompt's longest cached prefix. To
//! guess which server holds a request's prefix, the gateway renders the request into one canonical
//! string and hashes it in fixed-size blocks, each hash seeded with the previous one, so block `i`'s
//! hash identifies the whole prefix up to and including block `i`.
//!
//! Chat requests render tools first (sorted by name, canonical JSON with sorted keys), then each
//! message as `<|role|>`, optional `<|name|>`, a newline, its content, then its tool calls, and an
//! end marker. Nothing in a message depends on what follows it, so the next turn of a conversation
//! (the same messages plus the reply plus a new question) extends the previous turn's rendering.
//! Completion prompts render as their text, or for token ids as four characters per token.
//!
//! Tokens are approximated as [`BYTES_PER_TOKEN`] bytes of the canonical text (English averages
//! about four bytes per token for Llama-family tokenizers; token-id prompts are exact); a block is
//! [`DEFAULT_BLOCK_TOKENS`] tokens, vLLM's default block size, so a block is 64 bytes. Only full
//! blocks are hashed, as only full blocks are cached.

use crate::backend::Role;
use crate::routing_key::routing_key;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::fmt;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Tokens per hashed block (vLLM's default KV block size).
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

/// Bytes of canonical text assumed per token.
pub const BYTES_PER_TOKEN: usize = 4;

/// Most block hashes a request carries by default (65,536 tokens of prefix at 16 per block).
pub const DEFAULT_MAX_BLOCKS: usize = 4096;

/// Default `max_tokens` when the request sets none.
pub const DEFAULT_MAX_TOKENS: u32 = 256;

/// Seed of the first block's hash.
const CHAIN_SEED: u64 = 0x6c6c_6d5f_6761_7465;

/// Largest token id accepted in a token-array prompt (24 bits, four base-64 characters).
pub const MAX_TOKEN_ID: u64 = (1 << 24) - 1;

/// JSON nesting beyond which canonical JSON stops descending.
const MAX_JSON_DEPTH: usize = 128;

/// Why a request body could not be read. Each maps to an HTTP 400 with [`PromptError::param`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptError {
    /// The body is not a JSON object.
    NotAnObject,
    /// No `model` field.
    MissingModel,
    /// Neither `messages` nor `prompt`.
    MissingPrompt,
    /// `messages` is an empty array.
    EmptyMessages,
    /// A field has the wrong type or value.
    InvalidField {
        /// The field's name.
        field: &'static str,
        /// What was expected instead.
        expected: &'static str,
    },
    /// One message is malformed.
    InvalidMessage {
        /// Index of the message in `messages`.
        index: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The endpoint's own input is missing: `messages` for chat, `prompt` for completions,
    /// `input` for embeddings.
    MissingInput {
        /// The field the endpoint needs.
        field: &'static str,
    },
}

impl PromptError {
    /// The request parameter at fault, for the OpenAI error's `param` field.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            PromptError::NotAnObject => None,
            PromptError::MissingModel => Some("model"),
            PromptError::MissingPrompt | PromptError::EmptyMessages => Some("messages"),
            PromptError::InvalidField { field, .. } => Some(field),
            PromptError::InvalidMessage { .. } => Some("messages"),
            PromptError::MissingInput { field } => Some(field),
        }
    }

    /// A stable machine-readable code for the OpenAI error's `code` field.
    pub fn code(&self) -> &'static str {
        match self {
            PromptError::NotAnObject => "invalid_body",
            PromptError::MissingModel => "missing_model",
            PromptError::MissingPrompt => "missing_prompt",
            PromptError::EmptyMessages => "empty_messages",
            PromptError::InvalidField { .. } => "invalid_type",
            PromptError::InvalidMessage { .. } => "invalid_message",
            PromptError::MissingInput { .. } => "missing_prompt",
        }
    }
}

impl fmt::Display for PromptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PromptError::NotAnObject => f.write_str("the request body must be a JSON object"),
            PromptError::MissingModel => f.write_str("you must provide a model parameter"),
            PromptError::MissingPrompt => f.write_str(
                "the request must have either `messages` (chat) or `prompt` (completion)",
            ),
            PromptError::EmptyMessages => f.write_str("`messages` must not be empty"),
            PromptError::InvalidField { field, expected } => {
                write!(f, "`{field}` must be {expected}")
            }
            PromptError::InvalidMessage { index, reason } => {
                write!(f, "messages[{index}] {reason}")
            }
            PromptError::MissingInput { field } => write!(f, "`{field}` is required"),
        }
    }
}

impl std::error::Error for PromptError {}

pub(crate) fn invalid(field: &'static str, expected: &'static str) -> PromptError {
    PromptError::InvalidField { field, expected }
}

/// Renders chat `messages` (and optional `tools`) into the canonical prompt text.
pub fn canonical_chat_prompt(
    messages: &Value,
    tools: Option<&Value>,
) -> Result<String, PromptError> {
    let list = messages
        .as_array()
        .ok_or(invalid("messages", "an array of messages"))?;
    if list.is_empty() {
        return Err(PromptError::EmptyMessages);
    }
    let mut out = String::with_capacity(256);
    if let Some(tools) = tools.filter(|t| !t.is_null()) {
        render_tools(tools, &mut out)?;
    }
    for (index, message) in list.iter().enumerate() {
        render_message(index, message, &mut out)?;
    }
    Ok(out)
}

fn render_tools(tools: &Value, out: &mut String) -> Result<(), PromptError> {
    let list = tools
        .as_array()
        .ok_or(invalid("tools", "an array of tool definitions"))?;
    if list.is_empty() {
        return Ok(());
    }
    let mut rendered = Vec::with_capacity(list.len());
    for tool in list {
        if !tool.is_object() {
            return Err(invalid("tools", "an array of tool objects"));
        }
        let name = tool
            .pointer("/function/name")
            .or_else(|| tool.get("name"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let mut json = String::new();
        canonical_json(tool, &mut json, 0);
        rendered.push((name, json));
    }
    rendered.sort();
    out.push_str("<|tools|>\n");
    for (_, json) in rendered {
        out.push_str(&json);
        out.push('\n');
    }
    Ok(())
}

fn render_message(index: usize, message: &Value, out: &mut String) -> Result<(), PromptError> {
    let bad = |reason| PromptError::InvalidMessage { index, reason };
    let obj = message.as_object().ok_or(bad("must be an object"))?;
    let role = obj
        .get("role")
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty())
        .ok_or(bad("must have a non-empty string `role`"))?;
    out.push_str("<|");
    out.push_str(role);
    out.push_str("|>");
    match obj.get("name") {
        None | Some(Value::Null) => {}
        Some(Value::String(name)) => {
            out.push_str("<|name|>");
            out.push_str(name);
        }
        Some(_) => return Err(bad("has a `name` that is not a string")),
    }
    out.push('\n');
    match obj.get("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => out.push_str(text),
        Some(Value::Array(parts)) => render_parts(index, parts, out)?,
        Some(_) => {
            return Err(bad(
                "has `content` that is neither a string nor an array of parts",
            ))
        }
    }
    for field in ["tool_calls", "function_call"] {
        if let Some(v) = obj.get(field).filter(|v| !v.is_null()) {
            out.push_str("\n<|");
            out.push_str(field);
            out.push_str("|>");
            canonical_json(v, out, 0);
        }
    }
    match obj.get("tool_call_id") {
        None | Some(Value::Null) => {}
        Some(Value::String(id)) => {
            out.push_str("\n<|tool_call_id|>");
            out.push_str(id);
        }
        Some(_) => return Err(bad("has a `tool_call_id` that is not a string")),
    }
    out.push_str("\n<|end|>\n");
    Ok(())
}

fn render_parts(index: usize, parts: &[Value], out: &mut String) -> Result<(), PromptError> {
    let bad = |reason| PromptError::InvalidMessage { index, reason };
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let obj = part
            .as_object()
            .ok_or(bad("has a content part that is not an object"))?;
        let kind = obj
            .get("type")
            .and_then(Value::as_str)
            .ok_or(bad("has a content part without a string `type`"))?;
        match kind {
            "text" => {
                let text = obj
                    .get("text")
                    .and_then(Value::as_str)
                    .ok_or(bad("has a text part without a string `text`"))?;
                out.push_str(text);
            }
            // Media is represented by a digest: the same image gives the same prefix, and a
            // megabyte data URL does not count as a quarter of a million tokens.
            _ => {
                let mut json = String::new();
                canonical_json(part, &mut json, 0);
                out.push_str("<|");
                out.push_str(kind);
                out.push(':');
                push_hex(xxh3_64(json.as_bytes()), out);
                out.push_str("|>");
            }
        }
    }
    Ok(())
}

fn push_hex(v: u64, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for shift in (0..16).rev() {
        out.push(HEX[((v >> (shift * 4)) & 0xf) as usize] as char);
    }
}

/// Writes `value` as JSON with object keys sorted, so equal values render identically whatever
/// order their keys arrived in.
pub fn canonical_json(value: &Value, out: &mut String, depth: usize) {
    if depth > MAX_JSON_DEPTH {
        out.push_str("null");
        return;
    }
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => push_json_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(item, out, depth + 1);
            }
            out.push(']');
        }
        Value::Object(map) => push_sorted_object(map, out, depth),
    }
}

fn push_sorted_object(map: &Map<String, Value>, out: &mut String, depth: usize) {
    let mut keys: Vec<&String> = map.keys().collect();
    keys.sort();
    out.push('{');
    for (i, key) in keys.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_json_string(key, out);
        out.push(':');
        if let Some(v) = map.get(key) {
            canonical_json(v, out, depth + 1);
        }
    }
    out.push('}');
}

fn push_json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                out.push_str("\\u00");
                push_hex_byte(c as u8, out);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn push_hex_byte(b: u8, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(HEX[(b >> 4) as usize] as char);
    out.push(HEX[(b & 0xf) as usize] as char);
}

const PROMPT_SHAPES: &str =
    "a string, an array of strings, an array of token ids or an array of token-id arrays";

/// Separator between the prompts of a batched completion request.
const PROMPT_SEPARATOR: char = '\u{1e}';

/// Renders a completion `prompt` into the canonical prompt text.
///
/// A string is itself. An array of strings (a batch) is the strings joined by U+001E, so the
/// first prompt's prefix is the rendering's prefix. A token-id array renders each id as four
/// base-64 characters, exactly [`BYTES_PER_TOKEN`] bytes per token, and an array of token-id
/// arrays joins those renderings by U+001E.
pub fn canonical_completion_prompt(prompt: &Value) -> Result<String, PromptError> {
    match prompt {
        Value::String(s) => Ok(s.clone()),
        Value::Array(items) if items.is_empty() => Err(invalid("prompt", "a non-empty prompt")),
        Value::Array(items) => {
            let mut out = String::new();
            if items.iter().all(Value::is_string) {
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(PROMPT_SEPARATOR);
                    }
                    out.push_str(item.as_str().unwrap_or_default());
                }
            } else if items.iter().all(Value::is_number) {
                push_tokens(items, &mut out)?;
            } else if items.iter().all(Value::is_array) {
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(PROMPT_SEPARATOR);
                    }
                    let tokens = item.as_array().map(Vec::as_slice).unwrap_or_default();
                    if !tokens.iter().all(Value::is_number) {
                        return Err(invalid("prompt", PROMPT_SHAPES));
                    }
                    push_tokens(tokens, &mut out)?;
                }
            } else {
                return Err(invalid("prompt", PROMPT_SHAPES));
            }
            Ok(out)
        }
        _ => Err(invalid("prompt", PROMPT_SHAPES)),
    }
}

fn push_tokens(tokens: &[Value], out: &mut String) -> Result<(), PromptError> {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    out.reserve(tokens.len() * BYTES_PER_TOKEN);
    for token in tokens {
        let id = token
            .as_u64()
            .filter(|&id| id <= MAX_TOKEN_ID)
            .ok_or(invalid("prompt", "token ids between 0 and 16777215"))?;
        for shift in [18, 12, 6, 0] {
            out.push(ALPHABET[((id >> shift) & 63) as usize] as char);
        }
    }
    Ok(())
}

/// Estimated token count of canonical text: `ceil(bytes / BYTES_PER_TOKEN)`.
pub fn estimate_tokens(text: &str) -> u32 {
    u32::try_from(text.len().div_ceil(BYTES_PER_TOKEN)).unwrap_or(u32::MAX)
}

/// Chained xxh3 hashes of the full blocks of `canonical`, `block_tokens * BYTES_PER_TOKEN` bytes
/// each: `h[i] = xxh3_64_with_seed(block_i, h[i-1])`, with a fixed seed before block 0. A partial
/// last block is not hashed.
pub fn block_hashes(canonical: &[u8], block_tokens: usize) -> Vec<u64> {
    let block_bytes = block_tokens.max(1).saturating_mul(BYTES_PER_TOKEN);
    let mut out = Vec::with_capacity(canonical.len() / block_bytes);
    let mut h = CHAIN_SEED;
    for block in canonical.chunks_exact(block_bytes) {
        h = xxh3_64_with_seed(block, h);
        out.push(h);
    }
    out
}

/// How the Worker extracts [`RequestFeatures`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FeatureConfig {
    /// Tokens per hashed block (default 16; must match the pool's `block_tokens`).
    pub block_tokens: usize,
    /// `max_tokens` assumed when the request sets none (default 256).
    pub default_max_tokens: u32,
    /// Extra header consulted for the routing key after the standard ones (default none).
    pub routing_header: Option<String>,
    /// Most block hashes kept per request; longer prompts keep their first blocks (default 4096).
    pub max_blocks: usize,
}

impl Default for FeatureConfig {
    fn default() -> Self {
        FeatureConfig {
            block_tokens: DEFAULT_BLOCK_TOKENS,
            default_max_tokens: DEFAULT_MAX_TOKENS,
            routing_header: None,
            max_blocks: DEFAULT_MAX_BLOCKS,
        }
    }
}

/// Chat (`messages`) or completion (`prompt`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestKind {
    /// `/v1/chat/completions`.
    #[default]
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// What routing needs to know about one request; computed once by the Worker and sent to the
/// pool's Durable Object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RequestFeatures {
    /// The gateway's request id (from `x-request-id` if the client sent one; the Worker sets it
    /// otherwise).
    pub request_id: String,
    /// Chat or completion.
    pub kind: RequestKind,
    /// Requested model.
    pub model: String,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// Estimated prompt tokens.
    pub prompt_tokens: u32,
    /// `max_completion_tokens`, else `max_tokens`, else the configured default.
    pub max_tokens: u32,
    /// Key for sticky policies, if any.
    pub routing_key: Option<String>,
    /// Tokens per block the hashes were computed with.
    pub block_tokens: u32,
    /// Chained prefix-block hashes (base64 of little-endian `u64`s in JSON, see
    /// [`crate::block_hash_encoding`]).
    #[serde(with = "crate::block_hash_encoding")]
    pub block_hashes: Vec<u64>,
    /// Restricts candidates to backends of this role (for callers that stage prefill and decode
    /// themselves); `None` lets the pool's policy decide.
    pub role_hint: Option<Role>,
}

/// The body as an object, and its `model` (every endpoint reads these the same way).
pub(crate) fn object_and_model(body: &Value) -> Result<(&Map<String, Value>, String), PromptError> {
    let obj = body.as_object().ok_or(PromptError::NotAnObject)?;
    match obj.get("model") {
        None | Some(Value::Null) => Err(PromptError::MissingModel),
        Some(Value::String(m)) if !m.is_empty() => Ok((obj, m.clone())),
        Some(_) => Err(invalid("model", "a non-empty string")),
    }
}

/// Extracts the routing features of an OpenAI request body.
///
/// `header` looks a request header up by lower-case name.
pub fn request_features(
    body: &Value,
    header: &dyn Fn(&str) -> Option<String>,
    config: &FeatureConfig,
) -> Result<RequestFeatures, PromptError> {
    let (obj, model) = object_and_model(body)?;
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("stream", "a boolean")),
    };
    let max_tokens = match optional_u32(obj, "max_completion_tokens")? {
        Some(n) => n,
        None => optional_u32(obj, "max_tokens")?.unwrap_or(config.default_max_tokens),
    };
    let (kind, canonical) = match (obj.get("messages"), obj.get("prompt")) {
        (Some(messages), _) if !messages.is_null() => (
            RequestKind::Chat,
            canonical_chat_prompt(messages, obj.get("tools"))?,
        ),
        (_, Some(prompt)) if !prompt.is_null() => (
            RequestKind::Completion,
            canonical_completion_prompt(prompt)?,
        ),
        _ => return Err(PromptError::MissingPrompt),
    };
    let block_tokens = config.block_tokens.max(1);
    let max_bytes = config
        .max_blocks
        .saturating_mul(block_tokens)
        .saturating_mul(BYTES_PER_TOKEN);
    let hashed = &canonical.as_bytes()[..canonical.len().min(max_bytes)];
    Ok(RequestFeatures {
        request_id: header("x-request-id")
            .map(|id| id.trim().to_string())
            .unwrap_or_default(),
        kind,
        model,
        stream,
        prompt_tokens: estimate_tokens(&canonical),
        max_tokens,
        routing_key: routing_key(header, body, config.routing_header.as_deref()),
        block_tokens: u32::try_from(block_tokens).unwrap_or(u32::MAX),
        block_hashes: block_hashes(hashed, block_tokens),
        role_hint: None,
    })
}

fn optional_u32(obj: &Map<String, Value>, field: &'static str) -> Result<Option<u32>, PromptError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or(invalid(field, "a non-negative integer")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn no_headers(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn next_turn_extends_previous_turn() {
        let turn1 = json!([
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"}
        ]);
        let turn2 = json!([
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "More"}]}
        ]);
        let tools = json!([
            {"type": "function", "function": {"name": "b", "parameters": {"y": 1, "x": 2}}},
            {"type": "function", "function": {"name": "a"}}
        ]);
        let a = canonical_chat_prompt(&turn1, Some(&tools)).unwrap();
        let b = canonical_chat_prompt(&turn2, Some(&tools)).unwrap();
        assert!(b.starts_with(&a), "{a:?} is not a prefix of {b:?}");
        let ha = block_hashes(a.as_bytes(), 4);
        let hb = block_hashes(b.as_bytes(), 4);
        assert!(!ha.is_empty());
        assert_eq!(ha[..], hb[..ha.len()]);
    }

    #[test]
    fn tool_order_and_key_order_do_not_matter() {
        let msgs = json!([{"role": "user", "content": "x"}]);
        let t1 = json!([
            {"type": "function", "function": {"name": "b", "parameters": {"y": 1, "x": 2}}},
            {"type": "function", "function": {"name": "a"}}
        ]);
        let t2: Value = serde_json::from_str(
            r#"[{"function": {"name": "a"}, "type": "function"},
                {"function": {"parameters": {"x": 2, "y": 1}, "name": "b"}, "type": "function"}]"#,
        )
        .unwrap();
        assert_eq!(
            canonical_chat_prompt(&msgs, Some(&t1)).unwrap(),
            canonical_chat_prompt(&msgs, Some(&t2)).unwrap()
        );
        let without = canonical_chat_prompt(&msgs, None).unwrap();
        assert_eq!(
            without,
            canonical_chat_prompt(&msgs, Some(&json!([]))).unwrap()
        );
        assert_eq!(
            without,
            canonical_chat_prompt(&msgs, Some(&Value::Null)).unwrap()
        );
    }

    #[test]
    fn roles_names_and_tool_calls_are_rendered() {
        let msgs = json!([
            {"role": "user", "name": "ann", "content": "q"},
            {"role": "assistant", "content": null,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}
        ]);
        let text = canonical_chat_prompt(&msgs, None).unwrap();
        assert!(
            text.starts_with("<|user|><|name|>ann\nq\n<|end|>\n<|assistant|>\n\n<|tool_calls|>")
        );
        assert!(text.contains("<|tool|>\n42\n<|tool_call_id|>c1\n<|end|>\n"));
        let as_user = json!([{"role": "assistant", "content": "q"}]);
        let as_asst = json!([{"role": "user", "content": "q"}]);
        assert_ne!(
            canonical_chat_prompt(&as_user, None).unwrap(),
            canonical_chat_prompt(&as_asst, None).unwrap()
        );
    }

    #[test]
    fn media_parts_become_short_digests() {
        let big = "A".repeat(100_000);
        let msgs = json!([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{big}")}},
            {"type": "text", "text": "what is this"}
        ]}]);
        let text = canonical_chat_prompt(&msgs, None).unwrap();
        assert!(text.len() < 200);
        assert!(text.contains("<|image_url:"));
    }

    #[test]
    fn chat_errors_are_typed() {
        assert_eq!(
            canonical_chat_prompt(&json!({}), None),
            Err(invalid("messages", "an array of messages"))
        );
        assert_eq!(
            canonical_chat_prompt(&json!([]), None),
            Err(PromptError::EmptyMessages)
        );
        assert!(matches!(
            canonical_chat_prompt(&json!([{"content": "x"}]), None),
            Err(PromptError::InvalidMessage { index: 0, .. })
        ));
        assert!(matches!(
            canonical_chat_prompt(
                &json!([{"role": "user", "content": "x"}, {"role": "user", "content": 5}]),
                None
            ),
            Err(PromptError::InvalidMessage { index: 1, .. })
        ));
        assert!(canonical_chat_prompt(
            &json!([{"role": "user", "content": [{"type": "text"}]}]),
            None
        )
        .is_err());
        assert!(canonical_chat_prompt(
            &json!([{"role": "user", "content": "x"}]),
            Some(&json!({}))
        )
        .is_err());
    }

    #[test]
    fn completion_prompt_shapes() {
        assert_eq!(canonical_completion_prompt(&json!("abc")).unwrap(), "abc");
        assert_eq!(
            canonical_completion_prompt(&json!(["ab", "cd"])).unwrap(),
            "ab\u{1e}cd"
        );
        let toks = canonical_completion_prompt(&json!([0, 1, 16777215])).unwrap();
        assert_eq!(toks, "AAAAAAAB____");
        assert_eq!(estimate_tokens(&toks), 3);
        let batch = canonical_completion_prompt(&json!([[1], [2, 3]])).unwrap();
        assert_eq!(batch.len(), 4 + 1 + 8);
        for bad in [
            json!([]),
            json!(5),
            json!([1, "a"]),
            json!([-1]),
            json!([1.5]),
            json!([16777216]),
            json!([[1], ["a"]]),
            json!(null),
        ] {
            assert!(canonical_completion_prompt(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn block_hashes_cover_full_blocks_only_and_chain() {
        let text = "x".repeat(64 * 3 + 10);
        let h = block_hashes(text.as_bytes(), 16);
        assert_eq!(h.len(), 3);
        assert_ne!(
            h[0], h[1],
            "equal blocks at different positions hash differently"
        );
        assert!(block_hashes(b"short", 16).is_empty());
        let other = format!("y{}", &text[1..]);
        let h2 = block_hashes(other.as_bytes(), 16);
        assert!(
            h.iter().zip(&h2).all(|(a, b)| a != b),
            "a change in block 0 changes every hash"
        );
        assert_eq!(
            block_hashes(b"abcd", 0).len(),
            1,
            "block size 0 is treated as 1 token"
        );
    }

    #[test]
    fn estimate_rounds_up() {
        assert_eq!(estimate_tokens(""), 0);
        assert_eq!(estimate_tokens("a"), 1);
        assert_eq!(estimate_tokens("abcd"), 1);
        assert_eq!(estimate_tokens("abcde"), 2);
    }

    #[test]
    fn features_of_a_chat_request() {
        let body = json!({
            "model": "llama", "stream": true, "max_tokens": 50, "max_completion_tokens": 70,
            "user": "u-1",
            "messages": [{"role": "user", "content": "x".repeat(200)}]
        });
        let headers = |name: &str| (name == "x-request-id").then(|| "req-9".to_string());
        let f = request_features(&body, &headers, &FeatureConfig::default()).unwrap();
        assert_eq!(f.request_id, "req-9");
        assert_eq!(f.kind, RequestKind::Chat);
        assert_eq!(f.model, "llama");
        assert!(f.stream);
        assert_eq!(f.max_tokens, 70);
        assert_eq!(f.routing_key.as_deref(), Some("u-1"));
        assert!(f.prompt_tokens >= 50);
        assert_eq!(f.block_hashes.len(), f.prompt_tokens as usize / 16);
        assert_eq!(f.block_tokens, 16);
    }

    #[test]
    fn features_of_a_completion_request_with_defaults_and_cap() {
        let body = json!({"model": "m", "prompt": "p".repeat(64 * 10)});
        let cfg = FeatureConfig {
            max_blocks: 4,
            default_max_tokens: 99,
            ..FeatureConfig::default()
        };
        let f = request_features(&body, &no_headers, &cfg).unwrap();
        assert_eq!(f.kind, RequestKind::Completion);
        assert_eq!(f.max_tokens, 99);
        assert!(!f.stream);
        assert_eq!(f.block_hashes.len(), 4);
        assert_eq!(f.prompt_tokens, 160);
    }

    #[test]
    fn feature_errors_name_the_parameter() {
        let cfg = FeatureConfig::default();
        let cases = [
            (json!([]), None),
            (json!({"messages": []}), Some("model")),
            (json!({"model": 3, "prompt": "x"}), Some("model")),
            (json!({"model": "m"}), Some("messages")),
            (
                json!({"model": "m", "prompt": "x", "stream": "yes"}),
                Some("stream"),
            ),
            (
                json!({"model": "m", "prompt": "x", "max_tokens": -1}),
                Some("max_tokens"),
            ),
            (json!({"model": "m", "messages": "hi"}), Some("messages")),
        ];
        for (body, param) in cases {
            let err = request_features(&body, &no_headers, &cfg).unwrap_err();
            assert_eq!(err.param(), param, "{body}: {err}");
            assert!(!err.to_string().is_empty());
        }
    }

    #[test]
    fn deep_json_does_not_overflow() {
        let mut v = json!(1);
        for _ in 0..1000 {
            v = json!([v]);
        }
        let mut out = String::new();
        canonical_json(&v, &mut out, 0);
        assert!(out.contains("null"));
    }
}
