//! `GET /v1/models`: the models the pools serve, as the OpenAI model list, LoRA adapters with
//! their `parent` (base model) and `root` as the backends list them.

use crate::platform::do_client::{self, To};
use coordinator_protocol::call::Models;
use coordinator_protocol::ApiError;
use futures_util::future::join_all;
use serde_json::{json, Value};
use worker::{console_error, Env, Response};

/// Every model some pool has a backend serving now (`routing_core::backend::serving`, the rule
/// the pools' time cards and acquires follow: a loading backend's models are not listed). A pool
/// that cannot answer is skipped (and logged), never turned into an error for the client.
pub async fn list_models(env: &Env) -> Result<Response, ApiError> {
    let mut models: Vec<String> = Vec::new();
    let mut adapters = Vec::new();
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
            Err(e) => console_error!("models: pool {}: {e}", pool.name),
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
    Ok(Response::from_json(
        &json!({ "object": "list", "data": data }),
    )?)
}
