//! The request features of each OpenAI endpoint the gateway routes, with one set of errors for
//! all of them: chat and completions through [`crate::prompt::request_features`] (a chat needs
//! `messages`, a completion `prompt`), embeddings from their `input` alone (no prefix reuse, no
//! output). The model id is checked the same way everywhere: an absurd one (over
//! [`MAX_MODEL_BYTES`], or with control characters) is refused before it reaches a pool, a log
//! line or a backend.

use crate::prompt::{
    estimate_tokens, invalid, object_and_model, request_features, FeatureConfig, PromptError,
    RequestFeatures, RequestKind,
};
use serde_json::Value;

/// The OpenAI endpoints whose requests the gateway routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`: `messages`.
    Chat,
    /// `/v1/completions`: `prompt`.
    Completions,
    /// `/v1/embeddings`: `input`.
    Embeddings,
}

impl Endpoint {
    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Embeddings => "/v1/embeddings",
        }
    }
}

/// Longest model id accepted, in bytes (vLLM's served names are paths or repository ids, far
/// shorter).
pub const MAX_MODEL_BYTES: usize = 256;

/// Refuses a model id no backend could serve: longer than [`MAX_MODEL_BYTES`] or holding control
/// characters (which would also reach log lines and headers).
fn check_model(features: RequestFeatures) -> Result<RequestFeatures, PromptError> {
    let model = &features.model;
    if model.len() > MAX_MODEL_BYTES || model.chars().any(char::is_control) {
        return Err(invalid(
            "model",
            "a model id of at most 256 bytes without control characters",
        ));
    }
    Ok(features)
}

/// The routing features of a request to `endpoint`, with one set of errors for every endpoint: a
/// chat needs `messages`, a completion `prompt`, an embedding `input`.
pub fn endpoint_features(
    endpoint: Endpoint,
    body: &Value,
    header: &dyn Fn(&str) -> Option<String>,
    config: &FeatureConfig,
) -> Result<RequestFeatures, PromptError> {
    endpoint_features_unchecked(endpoint, body, header, config).and_then(check_model)
}

fn endpoint_features_unchecked(
    endpoint: Endpoint,
    body: &Value,
    header: &dyn Fn(&str) -> Option<String>,
    config: &FeatureConfig,
) -> Result<RequestFeatures, PromptError> {
    let (kind, field) = match endpoint {
        Endpoint::Embeddings => return embedding_features(body),
        Endpoint::Chat => (RequestKind::Chat, "messages"),
        Endpoint::Completions => (RequestKind::Completion, "prompt"),
    };
    let features = request_features(body, header, config)?;
    if features.kind != kind {
        return Err(PromptError::MissingInput { field });
    }
    Ok(features)
}

/// Routing features of an embeddings request: model and input size; no prefix reuse, no output.
fn embedding_features(body: &Value) -> Result<RequestFeatures, PromptError> {
    let (obj, model) = object_and_model(body)?;
    let prompt_tokens = match obj.get("input") {
        None | Some(Value::Null) => return Err(PromptError::MissingInput { field: "input" }),
        Some(Value::String(s)) => estimate_tokens(s),
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| match i {
                Value::String(s) => estimate_tokens(s),
                Value::Array(t) => t.len() as u32,
                _ => 1,
            })
            .fold(0u32, u32::saturating_add),
        Some(_) => return Err(invalid("input", "a string or an array")),
    };
    Ok(RequestFeatures {
        kind: RequestKind::Completion,
        model,
        prompt_tokens,
        max_tokens: 0,
        ..RequestFeatures::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_endpoint_names_its_own_missing_input() {
        let config = FeatureConfig::default();
        let none = |_: &str| None;
        let call = |endpoint, body: Value| endpoint_features(endpoint, &body, &none, &config);
        let chat_with_prompt = call(Endpoint::Chat, json!({"model": "m", "prompt": "x"}));
        assert_eq!(
            chat_with_prompt,
            Err(PromptError::MissingInput { field: "messages" })
        );
        let completion_with_messages = call(
            Endpoint::Completions,
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
        );
        assert_eq!(
            completion_with_messages.unwrap_err().param(),
            Some("prompt")
        );
        let e = call(Endpoint::Embeddings, json!({"model": "m"})).unwrap_err();
        assert_eq!(
            (e.param(), e.to_string().as_str()),
            (Some("input"), "`input` is required")
        );
    }

    #[test]
    fn embeddings_share_the_chat_errors_for_model_and_body() {
        let config = FeatureConfig::default();
        let none = |_: &str| None;
        for endpoint in [Endpoint::Chat, Endpoint::Embeddings] {
            let call = |body: Value| endpoint_features(endpoint, &body, &none, &config);
            assert_eq!(call(json!([1])), Err(PromptError::NotAnObject));
            assert_eq!(
                call(json!({"input": "x", "messages": []})),
                Err(PromptError::MissingModel)
            );
            assert_eq!(
                call(json!({"model": 5, "input": "x"})),
                Err(invalid("model", "a non-empty string"))
            );
        }
        let bad_input = endpoint_features(
            Endpoint::Embeddings,
            &json!({"model": "m", "input": {}}),
            &none,
            &config,
        );
        assert_eq!(bad_input, Err(invalid("input", "a string or an array")));
    }

    #[test]
    fn absurd_model_ids_are_refused_on_every_endpoint() {
        let config = FeatureConfig::default();
        let none = |_: &str| None;
        let long = "m".repeat(MAX_MODEL_BYTES + 1);
        let longest = "m".repeat(MAX_MODEL_BYTES);
        for endpoint in [Endpoint::Chat, Endpoint::Completions, Endpoint::Embeddings] {
            let call = |model: &str| {
                let body = match endpoint {
                    Endpoint::Chat => {
                        json!({"model": model, "messages": [{"role": "user", "content": "x"}]})
                    }
                    Endpoint::Completions => json!({"model": model, "prompt": "x"}),
                    Endpoint::Embeddings => json!({"model": model, "input": "x"}),
                };
                endpoint_features(endpoint, &body, &none, &config)
            };
            for bad in [long.as_str(), "llama\n", "a\u{0}b", "x\u{7f}"] {
                let e = call(bad).unwrap_err();
                assert_eq!(
                    (e.param(), e.code()),
                    (Some("model"), "invalid_type"),
                    "{bad:?}"
                );
            }
            assert!(call(&longest).is_ok());
            assert!(call("meta-llama/Llama-3.1-8B-Instruct").is_ok());
        }
    }

    #[test]
    fn embeddings_count_their_input_and_expect_no_output() {
        let none = |_: &str| None;
        let body = json!({"model": "m", "input": ["abcdefgh", [1, 2, 3], 7]});
        let f = endpoint_features(
            Endpoint::Embeddings,
            &body,
            &none,
            &FeatureConfig::default(),
        )
        .unwrap();
        assert_eq!(
            (f.model.as_str(), f.prompt_tokens, f.max_tokens),
            ("m", 2 + 3 + 1, 0)
        );
        assert!(f.block_hashes.is_empty());
    }
}
