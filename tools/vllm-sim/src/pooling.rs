//! The pooling routes with vLLM 0.34's shapes (`vllm/entrypoints/pooling/`): `/v1/rerank` (and
//! `/rerank`, `/v2/rerank`), `/v1/score` (and `/score`), `/pooling` and `/classify`.
//!
//! Scores are deterministic: a pair's score is mostly the share of the query's words found in the
//! document (so a relevant document ranks first, as tests expect), plus a small hash of the pair.
//! Every scored pair is one prompt (query + document tokens, as a cross-encoder sees it) and the
//! usage counts them all (`prompt_tokens` = `total_tokens`); rerank results are sorted by
//! relevance and cut to `top_n` when it is set. Like embeddings, each request is admitted under the
//! load-shedding limits and waits one prefill of its tokens. Score inputs pair 1:1, 1:N or N:N;
//! other lengths get vLLM's 400.

use std::collections::HashSet;
use std::time::Duration;

use hyper::{Response, StatusCode};
use serde_json::{json, Map, Value};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::api::{embedding, resolve_model, unix_s};
use crate::body::{self, SimBody};
use crate::error::ApiError;
use crate::prompt::{render_chat, ChatEnding, ChatMessage};
use crate::state::AppState;
use crate::tokenizer::count_tokens;

fn bad(message: impl std::fmt::Display) -> ApiError {
    ApiError::BadRequest(message.to_string())
}

fn parse(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(bad("Invalid request body: expected a JSON object")),
        Err(e) => Err(bad(format!("Invalid request body: {e}"))),
    }
}

fn model_of(state: &AppState, obj: &Map<String, Value>) -> Result<String, ApiError> {
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(_) => return Err(bad("model must be a string")),
    };
    Ok(resolve_model(state, model)?.0)
}

/// One side of a score/rerank request: a string, a `{"content": [...]}` item, or a list of them,
/// as the texts scored.
fn texts(v: Option<&Value>, field: &str) -> Result<Vec<String>, ApiError> {
    let one = |item: &Value| -> Result<String, ApiError> {
        match item {
            Value::String(s) => Ok(s.clone()),
            Value::Object(o) => Ok(o
                .get("content")
                .and_then(Value::as_array)
                .map(|parts| {
                    parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect::<String>()
                })
                .unwrap_or_default()),
            _ => Err(bad(format!(
                "{field} must be a string or a list of strings"
            ))),
        }
    };
    match v {
        None | Some(Value::Null) => Err(bad(format!("Field required: {field}"))),
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(item) => Ok(vec![one(item)?]),
    }
}

fn words(text: &str) -> HashSet<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// The sim's relevance of `doc` to `query`, in [0, 1].
pub fn pair_score(query: &str, doc: &str, seed: u64) -> f64 {
    let q = words(query);
    let d = words(doc);
    let overlap = match q.len() {
        0 => 0.0,
        n => q.intersection(&d).count() as f64 / n as f64,
    };
    let mut pair = query.as_bytes().to_vec();
    pair.push(0);
    pair.extend_from_slice(doc.as_bytes());
    let jitter = (xxh3_64_with_seed(&pair, seed) >> 11) as f64 / (1u64 << 53) as f64;
    0.9 * overlap + 0.1 * jitter
}

/// The scored pairs (1:1, 1:N or N:N), as vLLM pairs them.
fn pairs(first: &[String], second: &[String]) -> Result<Vec<(String, String)>, ApiError> {
    if first.is_empty() {
        return Err(bad("At least one text element must be given"));
    }
    if second.is_empty() {
        return Err(bad("At least one text_pair element must be given"));
    }
    if first.len() > 1 && first.len() != second.len() {
        return Err(bad("Input lengths must be either 1:1, 1:N or N:N"));
    }
    Ok(second
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (
                first[if first.len() == 1 { 0 } else { i }].clone(),
                d.clone(),
            )
        })
        .collect())
}

/// Admits `tokens` prompt tokens and waits one prefill of them; checks the context length.
async fn compute(state: &AppState, prompts: &[u32]) -> Result<u32, ApiError> {
    let config = &state.config;
    for &tokens in prompts {
        if tokens > config.max_model_len {
            return Err(bad(format!(
                "This model's maximum context length is {} tokens. However, your request has {tokens} \
                 input tokens. Please reduce the length of the input.",
                config.max_model_len
            )));
        }
    }
    let total = prompts.iter().fold(0u32, |a, t| a.saturating_add(*t));
    let inflight = state.admit(total).map_err(ApiError::Shed)?;
    let delay_us = config.step_timing().step_us(0, total) / config.time_scale;
    tokio::time::sleep(Duration::from_secs_f64(delay_us / 1e6)).await;
    drop(inflight);
    Ok(total)
}

fn pair_tokens(pairs: &[(String, String)]) -> Vec<u32> {
    pairs
        .iter()
        .map(|(q, d)| count_tokens(q.len()).saturating_add(count_tokens(d.len())))
        .collect()
}

fn usage(total: u32) -> Value {
    json!({"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0, "prompt_tokens_details": null})
}

/// `POST /v1/rerank`, `/rerank`, `/v2/rerank`.
pub async fn rerank(state: &AppState, body: &[u8]) -> Result<Response<SimBody>, ApiError> {
    let obj = parse(body)?;
    let model = model_of(state, &obj)?;
    let query = texts(obj.get("query"), "query")?;
    if query.len() != 1 {
        return Err(bad("query must be a single text"));
    }
    let documents = texts(obj.get("documents"), "documents")?;
    let top_n = match obj.get("top_n") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| bad("top_n must be a non-negative integer"))?,
    };
    let pairs = pairs(&query, &documents)?;
    let total = compute(state, &pair_tokens(&pairs)).await?;
    let mut results: Vec<(usize, f64)> = pairs
        .iter()
        .enumerate()
        .map(|(i, (q, d))| (i, pair_score(q, d, state.config.seed)))
        .collect();
    results.sort_by(|a, b| b.1.total_cmp(&a.1));
    if top_n > 0 {
        results.truncate(usize::try_from(top_n).unwrap_or(usize::MAX));
    }
    let results: Vec<Value> = results
        .into_iter()
        .map(|(i, s)| {
            json!({"index": i, "document": {"text": documents[i], "multi_modal": null}, "relevance_score": s})
        })
        .collect();
    Ok(body::json(
        StatusCode::OK,
        &json!({
            "id": format!("score-{}", state.fresh_id()),
            "model": model,
            "usage": {"prompt_tokens": total, "total_tokens": total},
            "results": results,
        }),
    ))
}

/// `POST /v1/score`, `/score`.
pub async fn score(state: &AppState, body: &[u8]) -> Result<Response<SimBody>, ApiError> {
    let obj = parse(body)?;
    let model = model_of(state, &obj)?;
    let present = |k: &str| obj.get(k).is_some_and(|v| !v.is_null());
    let (a, b) = [
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
        ("text_1", "text_2"),
    ]
    .into_iter()
    .find(|(a, b)| present(a) && present(b))
    .ok_or_else(|| {
        bad("Field required: queries and documents (or items, data_1/data_2, text_1/text_2)")
    })?;
    let pairs = pairs(&texts(obj.get(a), a)?, &texts(obj.get(b), b)?)?;
    let total = compute(state, &pair_tokens(&pairs)).await?;
    let data: Vec<Value> = pairs
        .iter()
        .enumerate()
        .map(|(i, (q, d))| json!({"index": i, "object": "score", "score": pair_score(q, d, state.config.seed)}))
        .collect();
    Ok(body::json(
        StatusCode::OK,
        &json!({
            "id": format!("score-{}", state.fresh_id()),
            "object": "list",
            "created": unix_s(),
            "model": model,
            "data": data,
            "usage": usage(total),
        }),
    ))
}

/// The prompts of a `/pooling` or `/classify` request: its `input` or its rendered `messages`.
fn inputs(obj: &Map<String, Value>) -> Result<Vec<Vec<u8>>, ApiError> {
    match (obj.get("input"), obj.get("messages")) {
        (Some(v), _) if !v.is_null() => match v {
            Value::String(s) => Ok(vec![s.clone().into_bytes()]),
            Value::Array(items) if items.iter().all(Value::is_u64) => Ok(vec![ids_bytes(items)?]),
            Value::Array(items) => items
                .iter()
                .map(|i| match i {
                    Value::String(s) => Ok(s.clone().into_bytes()),
                    Value::Array(ids) => ids_bytes(ids),
                    _ => Err(bad("input must be a string, strings or token ids")),
                })
                .collect(),
            _ => Err(bad("input must be a string, strings or token ids")),
        },
        (_, Some(m)) if !m.is_null() => {
            let messages: Vec<ChatMessage> = serde_json::from_value(m.clone())
                .map_err(|e| bad(format!("Invalid messages: {e}")))?;
            Ok(vec![
                render_chat(&messages, ChatEnding::GenerationPrompt).map_err(bad)?
            ])
        }
        _ => Err(bad("Field required: input (or messages)")),
    }
}

fn ids_bytes(ids: &[Value]) -> Result<Vec<u8>, ApiError> {
    let ids: Option<Vec<u32>> = ids
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect();
    let ids = ids.ok_or_else(|| bad("token ids must be non-negative integers"))?;
    Ok(crate::tokenizer::token_ids_to_bytes(&ids))
}

fn prompt_tokens(prompts: &[Vec<u8>]) -> Result<Vec<u32>, ApiError> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(bad("input must not be empty"));
    }
    Ok(prompts.iter().map(|p| count_tokens(p.len())).collect())
}

/// The class probabilities of `prompt` for a model with `labels` labels (summing to 1; one label
/// is a relevance probability).
fn probs(prompt: &[u8], labels: u32, seed: u64) -> Vec<f64> {
    let raw: Vec<f64> = (0..labels)
        .map(|i| {
            let h = xxh3_64_with_seed(
                prompt,
                seed ^ u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            (h >> 11) as f64 / (1u64 << 53) as f64 + 1e-3
        })
        .collect();
    if labels == 1 {
        return raw;
    }
    let sum: f64 = raw.iter().sum();
    raw.iter().map(|x| x / sum).collect()
}

/// `POST /pooling`: the model's pooled output per input (an embedding model's unit vector, a
/// classifier's probabilities).
pub async fn pooling(state: &AppState, body: &[u8]) -> Result<Response<SimBody>, ApiError> {
    let obj = parse(body)?;
    let model = model_of(state, &obj)?;
    let prompts = inputs(&obj)?;
    let total = compute(state, &prompt_tokens(&prompts)?).await?;
    let c = &state.config;
    let data: Vec<Value> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let pooled = match c.task() {
                crate::config::Task::Classify => json!(probs(p, c.num_labels, c.seed)),
                _ => json!(embedding(p, c.embedding_dim, c.seed)),
            };
            json!({"index": i, "object": "pooling", "data": pooled})
        })
        .collect();
    Ok(body::json(
        StatusCode::OK,
        &json!({
            "id": format!("pooling-{}", state.fresh_id()),
            "object": "list",
            "created": unix_s(),
            "model": model,
            "data": data,
            "usage": usage(total),
        }),
    ))
}

/// `POST /classify`: each input's label and probabilities.
pub async fn classify(state: &AppState, body: &[u8]) -> Result<Response<SimBody>, ApiError> {
    let obj = parse(body)?;
    let model = model_of(state, &obj)?;
    let prompts = inputs(&obj)?;
    let total = compute(state, &prompt_tokens(&prompts)?).await?;
    let c = &state.config;
    let data: Vec<Value> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let probs = probs(p, c.num_labels, c.seed);
            let best = probs
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(k, _)| k);
            json!({"index": i, "label": format!("LABEL_{best}"), "probs": probs, "num_classes": probs.len()})
        })
        .collect();
    Ok(body::json(
        StatusCode::OK,
        &json!({
            "id": format!("classify-{}", state.fresh_id()),
            "object": "list",
            "created": unix_s(),
            "model": model,
            "data": data,
            "usage": usage(total),
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relevant_documents_score_higher_and_scores_are_deterministic() {
        let q = "what is the capital of France";
        let good = pair_score(q, "Paris is the capital of France", 0);
        let bad = pair_score(q, "bananas are yellow", 0);
        assert!(good > bad && (0.0..=1.0).contains(&good) && (0.0..=1.0).contains(&bad));
        assert_eq!(good, pair_score(q, "Paris is the capital of France", 0));
    }

    #[test]
    fn pairs_are_one_to_many_or_many_to_many() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(pairs(&s(&["q"]), &s(&["a", "b"])).unwrap().len(), 2);
        let nn = pairs(&s(&["q1", "q2"]), &s(&["a", "b"])).unwrap();
        assert_eq!(nn[1], ("q2".to_string(), "b".to_string()));
        assert!(pairs(&s(&["q1", "q2"]), &s(&["a", "b", "c"])).is_err());
        assert!(pairs(&s(&[]), &s(&["a"])).is_err() && pairs(&s(&["q"]), &s(&[])).is_err());
    }

    #[test]
    fn classifier_probabilities_sum_to_one() {
        let p = probs(b"text", 3, 0);
        assert_eq!(p.len(), 3);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert_eq!(probs(b"text", 1, 0).len(), 1);
    }
}
