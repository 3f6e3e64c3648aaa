//! `GET /v1/models`: the models the pools serve, as the OpenAI model list, LoRA adapters with
//! their `parent` (base model) and `root` as the backends list them.
//!
//! The list is kept in the isolate for [`MODELS_CACHE_MS`]: clients (the OpenAI SDKs, UIs, health
//! checks) list models often, and each listing asks every pool. One list per isolate, so the cache
//! is bounded by the list's own size. An admin change made through this isolate forgets it
//! ([`forget`]); a change made through another isolate, or a backend becoming ready or unhealthy,
//! shows within [`MODELS_CACHE_MS`]. A list that missed a pool, or that is empty, is not kept.

use crate::platform::do_client::{self, To};
use crate::platform::http::now_ms;
use crate::platform::isolate;
use coordinator_protocol::call::Models;
use coordinator_protocol::ApiError;
use futures_util::future::join_all;
use serde_json::{json, Value};
use worker::{console_error, Env, Response};

/// How long an isolate answers `/v1/models` from the list it last built.
pub const MODELS_CACHE_MS: u64 = 3_000;

/// Forgets the isolate's list: the admin API calls this after every change.
pub fn forget() {
    isolate::with_model_list(|l| l.borrow_mut().take());
}

/// Every model some pool has a backend serving now (`routing_core::backend::serving`, the rule
/// the pools' time cards and acquires follow: a loading backend's models are not listed). A pool
/// that cannot answer is skipped (and logged), never turned into an error for the client.
pub async fn list_models(env: &Env) -> Result<Response, ApiError> {
    let now = now_ms();
    let cached = isolate::with_model_list(|l| {
        l.borrow()
            .as_ref()
            .filter(|(at, _)| now.saturating_sub(*at) < MODELS_CACHE_MS)
            .map(|(_, list)| list.clone())
    });
    if let Some(list) = cached {
        return Ok(Response::from_json(&list)?);
    }
    let (list, complete) = build_list(env).await?;
    let has_models = list["data"].as_array().is_some_and(|d| !d.is_empty());
    if complete && has_models {
        isolate::with_model_list(|l| *l.borrow_mut() = Some((now, list.clone())));
    }
    Ok(Response::from_json(&list)?)
}

/// The list from every pool, and whether every pool answered.
async fn build_list(env: &Env) -> Result<(Value, bool), ApiError> {
    let mut models: Vec<String> = Vec::new();
    let mut adapters = Vec::new();
    let mut complete = true;
    // Every pool at once: the list costs one round trip to the farthest pool, not their sum.
    let pools = do_client::list_pools(env).await?;
    let asked = pools
        .iter()
        .map(|pool| do_client::call(env, To::Pool(&pool.name, 0), &Models));
    for (pool, answer) in pools.iter().zip(join_all(asked).await) {
        match answer {
            Ok(answer) => {
                models.extend(answer.models);
                adapters.extend(answer.adapters);
            }
            Err(e) => {
                complete = false;
                console_error!("models: pool {}: {e}", pool.name);
            }
        }
    }
    models.sort();
    models.dedup();
    // A LoRA adapter is listed as vLLM lists it: `parent` its base model, `root` its path.
    let data: Vec<Value> = models
        .iter()
        .map(|m| {
            let mut card =
                json!({ "id": m, "object": "model", "created": 0, "owned_by": "llm-gateway" });
            if let Some(a) = adapters.iter().find(|a| &a.id == m) {
                card["parent"] = json!(a.parent);
                card["root"] = json!(a.root);
            }
            card
        })
        .collect();
    Ok((json!({ "object": "list", "data": data }), complete))
}
