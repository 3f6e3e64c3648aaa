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

use super::error::{invalid, PromptError};
use serde_json::{Map, Value};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Tokens per hashed block (vLLM's default KV block size).
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

/// Bytes of canonical text assumed per token.
pub const BYTES_PER_TOKEN: usize = 4;

/// Seed of the first block's hash.
const CHAIN_SEED: u64 = 0x6c6c_6d5f_6761_7465;

/// Largest token id accepted in a token-array prompt (24 bits, four base-64 characters).
pub const MAX_TOKEN_ID: u64 = (1 << 24) - 1;

/// JSON nesting beyond which canonical JSON stops descending.
const MAX_JSON_DEPTH: usize = 128;

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
    block_hashes_seeded(canonical, block_tokens, CHAIN_SEED)
}

/// The chain's seed for requests to `model`: a request's features hash its prompt under its
/// model's name, so that the same prompt sent to a LoRA adapter and to its base model (or to two
/// models) never counts as the same prefix: their KV blocks differ (vLLM seeds an adapter's block
/// hashes with the adapter, `vllm/v1/core/kv_cache_utils.py`, `_gen_lora_extra_hash_keys`).
pub fn model_chain_seed(model: &str) -> u64 {
    xxh3_64_with_seed(model.as_bytes(), CHAIN_SEED)
}

/// The chain's seed for a request to `model` with vLLM's `cache_salt` (if it sent one): vLLM mixes
/// the salt into the first block's hash (`vllm/v1/core/kv_cache_utils.py`), so requests with
/// different salts (tenants isolated on purpose) never share a cached prefix, and the gateway must
/// not count one tenant's history as another's hit.
pub fn request_chain_seed(model: &str, cache_salt: Option<&str>) -> u64 {
    let seed = model_chain_seed(model);
    match cache_salt {
        Some(salt) if !salt.is_empty() => xxh3_64_with_seed(salt.as_bytes(), seed),
        _ => seed,
    }
}

/// [`block_hashes`] with the chain started from `seed` instead of the fixed one.
pub fn block_hashes_seeded(canonical: &[u8], block_tokens: usize, seed: u64) -> Vec<u64> {
    let block_bytes = block_tokens.max(1).saturating_mul(BYTES_PER_TOKEN);
    let mut out = Vec::with_capacity(canonical.len() / block_bytes);
    let mut h = seed;
    for block in canonical.chunks_exact(block_bytes) {
        h = xxh3_64_with_seed(block, h);
        out.push(h);
    }
    out
}
