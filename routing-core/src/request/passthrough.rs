//! Routing features of vLLM's own routes that the gateway passes through by model (issue 43):
//! `/tokenize`, `/detokenize`, `/v1/rerank`, `/v1/score`, `/pooling`, `/classify` (JSON bodies,
//! [`passthrough_features`]) and the audio routes (multipart/form-data, [`multipart_features`]).
//! Each is routed on its `model` alone (no prefix reuse: none of these answers fills a prefix
//! cache a later request could hit, so no block hashes), with an estimate of its prompt tokens
//! where the body has text (the pool's time model and the client's token reservation use it) and
//! no output. The request shapes are vLLM 0.34's (`vllm/entrypoints/serve/tokenize/protocol.py`,
//! `vllm/entrypoints/pooling/*/protocol.py`, `vllm/entrypoints/speech_to_text/*/protocol.py`);
//! vLLM lets `model` default to its first served model, the gateway needs it to choose a backend.
//!
//! A multipart body is read for its `model` and `stream` fields only: the parser walks the parts'
//! headers and skips every other part's bytes (the audio file) without copying them.

use super::endpoint::Endpoint;
use super::prompt::{
    canonical_chat_prompt, check_model, client_request_id, estimate_tokens, invalid,
    object_and_model, PromptError, RequestFeatures,
};
use super::routing_key::routing_key;
use serde_json::{Map, Value};

/// Longest value of a multipart text field the gateway reads (`model`, `stream`).
pub const MAX_FORM_FIELD_BYTES: usize = 1024;

/// The routing features of a JSON request to a pass-through `endpoint` (not the audio routes,
/// which are multipart: [`multipart_features`]).
pub fn passthrough_features(
    endpoint: Endpoint,
    body: &Value,
    header: &dyn Fn(&str) -> Option<String>,
    routing_header: Option<&str>,
) -> Result<RequestFeatures, PromptError> {
    let (obj, model) = object_and_model(body)?;
    let prompt_tokens = match endpoint {
        Endpoint::Tokenize => prompt_or_messages(obj, "prompt")?,
        Endpoint::Detokenize => match obj.get("tokens") {
            Some(Value::Array(ids)) => count(ids.len()),
            None | Some(Value::Null) => return Err(PromptError::MissingInput { field: "tokens" }),
            Some(_) => return Err(invalid("tokens", "an array of token ids")),
        },
        Endpoint::Rerank => {
            let query = required(obj, "query")?;
            let documents = required(obj, "documents")?;
            scored_pairs(&texts(query, "query")?, &texts(documents, "documents")?)
        }
        Endpoint::Score => score_tokens(obj)?,
        Endpoint::Pooling | Endpoint::Classify => prompt_or_messages(obj, "input")?,
        _ => return Err(invalid("body", "the body of a pass-through route")),
    };
    Ok(RequestFeatures {
        request_id: client_request_id(header),
        kind: endpoint,
        model,
        stream: false,
        prompt_tokens,
        max_tokens: 0,
        routing_key: routing_key(header, body, routing_header),
        ..RequestFeatures::default()
    })
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn required<'a>(
    obj: &'a Map<String, Value>,
    field: &'static str,
) -> Result<&'a Value, PromptError> {
    match obj.get(field) {
        None | Some(Value::Null) => Err(PromptError::MissingInput { field }),
        Some(v) => Ok(v),
    }
}

/// Tokens of `input`/`prompt` (a string, strings, token ids or lists of them) or, when absent,
/// of the rendered `messages`.
fn prompt_or_messages(obj: &Map<String, Value>, field: &'static str) -> Result<u32, PromptError> {
    match (obj.get(field), obj.get("messages")) {
        (Some(v), _) if !v.is_null() => input_tokens(v, field),
        (_, Some(messages)) if !messages.is_null() => {
            Ok(estimate_tokens(&canonical_chat_prompt(messages, None)?))
        }
        _ => Err(PromptError::MissingInput { field }),
    }
}

fn input_tokens(v: &Value, field: &'static str) -> Result<u32, PromptError> {
    match v {
        Value::String(s) => Ok(estimate_tokens(s)),
        Value::Array(items) => Ok(items
            .iter()
            .map(|i| match i {
                Value::String(s) => estimate_tokens(s),
                Value::Array(ids) => count(ids.len()),
                _ => 1,
            })
            .fold(0u32, u32::saturating_add)),
        _ => Err(invalid(field, "a string, a list of strings or token ids")),
    }
}

/// The token estimate of each text of a score/rerank side: a string, a list of them, or a
/// multimodal `{"content": [...]}` item (its text parts counted).
fn texts(v: &Value, field: &'static str) -> Result<Vec<u32>, PromptError> {
    let one = |item: &Value| -> Result<u32, PromptError> {
        match item {
            Value::String(s) => Ok(estimate_tokens(s)),
            Value::Object(o) => Ok(o
                .get("content")
                .and_then(Value::as_array)
                .map(|parts| {
                    parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .map(estimate_tokens)
                        .fold(0u32, u32::saturating_add)
                })
                .unwrap_or(0)),
            _ => Err(invalid(
                field,
                "a string, a list of strings or content items",
            )),
        }
    };
    match v {
        Value::Array(items) if items.is_empty() => Err(invalid(field, "a non-empty list")),
        Value::Array(items) => items.iter().map(one).collect(),
        item => Ok(vec![one(item)?]),
    }
}

/// `/v1/score`: one of vLLM's four pairs of fields; each scored pair is one prompt.
fn score_tokens(obj: &Map<String, Value>) -> Result<u32, PromptError> {
    const PAIRS: [(&str, &str); 4] = [
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
        ("text_1", "text_2"),
    ];
    let Some((a, b)) = PAIRS
        .into_iter()
        .find(|(a, b)| obj.get(*a).is_some_and(|v| !v.is_null()) && obj.contains_key(*b))
    else {
        return Err(PromptError::MissingInput { field: "queries" });
    };
    let first = texts(&obj[a], "queries")?;
    let second = texts(&obj[b], "documents")?;
    Ok(scored_pairs(&first, &second))
}

/// Prompt tokens of scoring `first` against `second`: 1:N pairs the one first text with each
/// second one, N:N pairs them in order (a mismatch is vLLM's 400; estimated as 1:N here).
pub fn scored_pairs(first: &[u32], second: &[u32]) -> u32 {
    let sum = |s: &[u32]| s.iter().fold(0u32, |acc, t| acc.saturating_add(*t));
    if first.len() == second.len() && first.len() > 1 {
        return sum(first).saturating_add(sum(second));
    }
    let one = first.first().copied().unwrap_or(0);
    one.saturating_mul(count(second.len()))
        .saturating_add(sum(second))
}

/// The routing features of a multipart/form-data request to an audio route: its `model` (and
/// `stream`) form fields, read without copying the file. `content_type` is the request's header.
pub fn multipart_features(
    endpoint: Endpoint,
    content_type: &str,
    body: &[u8],
    header: &dyn Fn(&str) -> Option<String>,
) -> Result<RequestFeatures, PromptError> {
    let boundary = multipart_boundary(content_type).ok_or(invalid(
        "content-type",
        "multipart/form-data with a boundary (the audio routes take a form with `file` and `model`)",
    ))?;
    let fields = form_fields(body, boundary, &["model", "stream"])?;
    let model = match &fields[0] {
        Some(m) if !m.trim().is_empty() => m.trim().to_string(),
        Some(_) => return Err(invalid("model", "a non-empty string")),
        None => return Err(PromptError::MissingModel),
    };
    let stream = match fields[1].as_deref().map(str::trim) {
        None | Some("false" | "False" | "0" | "") => false,
        Some("true" | "True" | "1") => true,
        Some(_) => return Err(invalid("stream", "a boolean")),
    };
    check_model(RequestFeatures {
        request_id: client_request_id(header),
        kind: endpoint,
        model,
        stream,
        ..RequestFeatures::default()
    })
}

/// The boundary of a `multipart/form-data` content type, if it is one.
pub fn multipart_boundary(content_type: &str) -> Option<&str> {
    let mut parts = content_type.split(';');
    let mime = parts.next()?.trim();
    if !mime.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    parts.find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("boundary") {
            return None;
        }
        let v = v.trim().trim_matches('"');
        (!v.is_empty() && v.len() <= 200).then_some(v)
    })
}

/// The values of the text fields `names` (in that order) of a multipart body; other parts'
/// contents are skipped. A body that is not multipart with this boundary is an error.
pub fn form_fields(
    body: &[u8],
    boundary: &str,
    names: &[&'static str],
) -> Result<Vec<Option<String>>, PromptError> {
    let not_form = || invalid("body", "a multipart/form-data body matching its boundary");
    let delimiter = format!("--{boundary}");
    let delimiter = delimiter.as_bytes();
    let mut out = vec![None; names.len()];
    let mut at = find(body, delimiter, 0).ok_or_else(not_form)?;
    loop {
        at += delimiter.len();
        if body[at..].starts_with(b"--") {
            return Ok(out);
        }
        // Headers: after the line break, up to a blank line.
        let headers_start = at + line_break_len(&body[at..]);
        let headers_end = find(body, b"\r\n\r\n", headers_start).ok_or_else(not_form)?;
        let headers = String::from_utf8_lossy(&body[headers_start..headers_end]);
        let content_start = headers_end + 4;
        let next = find(body, delimiter, content_start).ok_or_else(not_form)?;
        // The content ends before the line break preceding the next delimiter.
        let content_end = next.saturating_sub(2).max(content_start);
        if let Some(name) = part_name(&headers) {
            if let Some(i) = names.iter().position(|n| *n == name) {
                let value = &body[content_start..content_end];
                if value.len() > MAX_FORM_FIELD_BYTES {
                    return Err(invalid(names[i], "a short text field"));
                }
                out[i] = Some(String::from_utf8_lossy(value).into_owned());
            }
        }
        at = next;
    }
}

fn line_break_len(rest: &[u8]) -> usize {
    if rest.starts_with(b"\r\n") {
        2
    } else {
        0
    }
}

/// The `name` of a part's `Content-Disposition: form-data; name="..."` header.
fn part_name(headers: &str) -> Option<String> {
    headers.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        if !key.trim().eq_ignore_ascii_case("content-disposition") {
            return None;
        }
        value.split(';').find_map(|p| {
            let (k, v) = p.trim().split_once('=')?;
            (k.trim() == "name").then(|| v.trim().trim_matches('"').to_string())
        })
    })
}

fn find(haystack: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if from > haystack.len() || needle.is_empty() {
        return None;
    }
    haystack[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| i + from)
}

#[cfg(test)]
#[path = "passthrough_tests.rs"]
mod tests;
