//! What routing needs to know about one OpenAI request ([`RequestFeatures`]), read from its body
//! by [`endpoint_features`] with one set of errors for every endpoint: chat and completions
//! through [`request_features`] (a chat needs `messages`, a completion `prompt`), embeddings from
//! their `input` alone (no prefix reuse, no output). The model id is checked the same way
//! everywhere: an absurd one (over [`MAX_MODEL_BYTES`], or with control characters) is refused
//! before it reaches a pool, a log line or a backend.
//!
//! The prompt's canonical text and its chained block hashes are `canonical.rs`'s; the errors are
//! `error.rs`'s; the Responses and Messages APIs' requests, rewritten into chat messages, are
//! `api_shapes.rs`'s.

mod api_shapes;
mod canonical;
mod error;
#[cfg(test)]
mod tests;

pub use api_shapes::{anthropic_messages, previous_response_id, responses_messages};
pub use canonical::{
    block_hashes, block_hashes_seeded, canonical_chat_prompt, canonical_completion_prompt,
    canonical_json, estimate_tokens, request_chain_seed, BYTES_PER_TOKEN, DEFAULT_BLOCK_TOKENS,
    MAX_TOKEN_ID,
};
pub(crate) use error::invalid;
pub use error::PromptError;

use crate::request::endpoint::Endpoint;
use crate::request::role::Role;
use crate::request::routing_key::routing_key;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Most block hashes a request carries by default (65,536 tokens of prefix at 16 per block).
pub const DEFAULT_MAX_BLOCKS: usize = 4096;

/// Default `max_tokens` when the request sets none.
pub const DEFAULT_MAX_TOKENS: u32 = 256;

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

/// What routing needs to know about one request; computed once by the Worker and sent to the
/// pool's Durable Object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RequestFeatures {
    /// The gateway's request id (from `x-request-id` if the client sent one; the Worker sets it
    /// otherwise).
    pub request_id: String,
    /// The endpoint the request was sent to (`"kind"` on the wire: `"chat"`, `"completion"` or
    /// `"embeddings"`).
    pub kind: Endpoint,
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
    /// [`crate::request::block_hash_encoding`]).
    #[serde(with = "crate::request::block_hash_encoding")]
    pub block_hashes: Vec<u64>,
    /// Restricts candidates to backends of this role (for callers that stage prefill and decode
    /// themselves); `None` lets the pool's policy decide.
    pub role_hint: Option<Role>,
    /// The backend the Worker sent the request to ahead of this lease call (`ROUTE_AHEAD`), and
    /// what a re-send elsewhere would cost. Set by the pool's coordinator from the acquire call,
    /// which carries it beside the features (only the first pool asked gets it).
    #[serde(skip)]
    pub sent_ahead: Option<SentAhead>,
    /// A Responses request's `previous_response_id`: the pool sends it only to the backend
    /// holding that response (`crate::pool::responses`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_response_id: Option<String>,
    /// A Responses request whose response the backend stores (`store` is not `false`): its id
    /// is reported to the pool with the release, and it goes to the pool's shard 0.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stores_response: bool,
    /// For a stateful Responses request, the hash of the client's key (`None` without client
    /// keys): a stored response is followed up only by the key that made it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

impl RequestFeatures {
    /// Whether the request reads or leaves a stored response in one backend's memory (a
    /// Responses request with `store`, or one naming `previous_response_id`): the pool must
    /// record or find its holder.
    pub fn is_stateful(&self) -> bool {
        self.stores_response || self.previous_response_id.is_some()
    }
}

/// A request's fetch sent ahead of its lease call: where to, and how long (ms) sending it to any
/// other backend instead would take.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentAhead {
    /// The id of the backend the fetch went to.
    pub backend: String,
    /// The round trip of a re-send from the Worker, ms.
    pub resend_ms: u32,
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

/// The block hashes of a request's canonical prompt, its first `max_blocks` blocks, chained from
/// its model's seed and `cache_salt` (what vLLM's own block hashes depend on besides the tokens).
pub(crate) fn prefix_hashes(
    canonical: &str,
    model: &str,
    body: &Value,
    config: &FeatureConfig,
) -> Vec<u64> {
    let block_tokens = config.block_tokens.max(1);
    let max_bytes = config
        .max_blocks
        .saturating_mul(block_tokens)
        .saturating_mul(BYTES_PER_TOKEN);
    let hashed = &canonical.as_bytes()[..canonical.len().min(max_bytes)];
    let salt = body.get("cache_salt").and_then(Value::as_str);
    block_hashes_seeded(hashed, block_tokens, request_chain_seed(model, salt))
}

/// Extracts the routing features of a chat or completion request body, whichever of the two it
/// is (`messages` or `prompt`); [`endpoint_features`] also holds it to its endpoint.
///
/// `header` looks a request header up by lower-case name.
pub fn request_features(
    body: &Value,
    header: &dyn Fn(&str) -> Option<String>,
    config: &FeatureConfig,
) -> Result<RequestFeatures, PromptError> {
    let (obj, model) = object_and_model(body)?;
    let stream = stream_flag(obj)?;
    let max_tokens = match optional_u32(obj, "max_completion_tokens")? {
        Some(n) => n,
        None => optional_u32(obj, "max_tokens")?.unwrap_or(config.default_max_tokens),
    };
    let (kind, canonical) = match (obj.get("messages"), obj.get("prompt")) {
        (Some(messages), _) if !messages.is_null() => (
            Endpoint::Chat,
            canonical_chat_prompt(messages, obj.get("tools"))?,
        ),
        (_, Some(prompt)) if !prompt.is_null() => {
            (Endpoint::Completions, canonical_completion_prompt(prompt)?)
        }
        _ => return Err(PromptError::MissingPrompt),
    };
    let block_tokens = config.block_tokens.max(1);
    Ok(RequestFeatures {
        request_id: client_request_id(header),
        kind,
        block_hashes: prefix_hashes(&canonical, &model, body, config),
        model,
        stream,
        prompt_tokens: estimate_tokens(&canonical),
        max_tokens,
        routing_key: routing_key(header, body, config.routing_header.as_deref()),
        block_tokens: u32::try_from(block_tokens).unwrap_or(u32::MAX),
        role_hint: None,
        sent_ahead: None,
        previous_response_id: None,
        stores_response: false,
        owner: None,
    })
}

/// The client's `x-request-id`, trimmed (empty when it sent none): the lease's id in the pool.
pub(crate) fn client_request_id(header: &dyn Fn(&str) -> Option<String>) -> String {
    header("x-request-id")
        .map(|id| id.trim().to_string())
        .unwrap_or_default()
}

/// The body's `stream` flag: absent or null is `false`, anything but a boolean is refused.
pub(crate) fn stream_flag(obj: &Map<String, Value>) -> Result<bool, PromptError> {
    match obj.get("stream") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid("stream", "a boolean")),
    }
}

/// An optional non-negative integer field (absent or null: `None`); anything else is refused.
pub(crate) fn optional_u32(
    obj: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<u32>, PromptError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or(invalid(field, "a non-negative integer")),
    }
}

/// Longest model id accepted, in bytes (vLLM's served names are paths or repository ids, far
/// shorter).
pub const MAX_MODEL_BYTES: usize = 256;

/// Refuses a model id no backend could serve: longer than [`MAX_MODEL_BYTES`] or holding control
/// characters (which would also reach log lines and headers).
pub(crate) fn check_model(features: RequestFeatures) -> Result<RequestFeatures, PromptError> {
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
    let field = match endpoint {
        Endpoint::Embeddings => return embedding_features(body),
        Endpoint::Responses | Endpoint::Messages | Endpoint::MessagesCountTokens => {
            return api_shapes::api_features(endpoint, body, header, config)
        }
        Endpoint::Chat => "messages",
        Endpoint::Completions => "prompt",
        // The JSON pass-through routes (a multipart body is read by `multipart_features`).
        e => {
            let routing_header = config.routing_header.as_deref();
            return crate::request::passthrough::passthrough_features(
                e,
                body,
                header,
                routing_header,
            );
        }
    };
    let features = request_features(body, header, config)?;
    if features.kind != endpoint {
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
        kind: Endpoint::Embeddings,
        model,
        prompt_tokens,
        max_tokens: 0,
        ..RequestFeatures::default()
    })
}
