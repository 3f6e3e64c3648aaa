//! `/tokenize` and `/detokenize` with vLLM 0.34's shapes (`vllm/entrypoints/serve/tokenize/protocol.py`):
//! a `prompt` or chat `messages` (rendered with the sim's template, [`crate::prompt::render_chat`])
//! becomes `{"count", "max_model_len", "tokens", "token_strs"?}`; `tokens` become `{"prompt"}`.
//!
//! The sim's tokenizer is one token per 4 bytes ([`crate::tokenizer`]), so a token id here is the
//! little-endian `u32` of its 4 bytes (the last one zero-padded): `count` agrees with the `usage`
//! of a completion of the same prompt, and detokenizing the ids gives the text back exactly.

use hyper::{Response, StatusCode};
use serde::Deserialize;
use serde_json::json;

use crate::api::resolve_model;
use crate::body::{self, SimBody};
use crate::error::ApiError;
use crate::prompt::{render_chat, ChatEnding, ChatMessage};
use crate::tokenizer::BYTES_PER_TOKEN;

#[derive(Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    return_token_strs: Option<bool>,
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u64>,
}

fn bad(message: impl std::fmt::Display) -> ApiError {
    ApiError::BadRequest(message.to_string())
}

/// The sim's token ids of `bytes`: one per 4 bytes.
pub fn token_ids(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(BYTES_PER_TOKEN)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

/// The bytes of token ids (the inverse of [`token_ids`]; the padding of the last one dropped).
pub fn token_bytes(ids: &[u32]) -> Vec<u8> {
    let mut out: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    while out.last() == Some(&0) {
        out.pop();
    }
    out
}

/// `POST /tokenize`.
pub fn tokenize(
    state: &crate::state::AppState,
    body: &[u8],
) -> Result<Response<SimBody>, ApiError> {
    let request: TokenizeRequest =
        serde_json::from_slice(body).map_err(|e| bad(format!("Invalid request body: {e}")))?;
    resolve_model(state, request.model)?;
    let bytes = match (request.prompt, request.messages) {
        (Some(p), None) => p.into_bytes(),
        (None, Some(messages)) => {
            let ending = ChatEnding::from_request(
                &messages,
                request.add_generation_prompt,
                request.continue_final_message,
            )
            .map_err(bad)?;
            render_chat(&messages, ending).map_err(bad)?
        }
        (Some(_), Some(_)) => {
            return Err(bad("Either `prompt` or `messages` must be given, not both"))
        }
        (None, None) => return Err(bad("Field required: `prompt` or `messages`")),
    };
    let tokens = token_ids(&bytes);
    let mut answer = json!({
        "count": tokens.len(),
        "max_model_len": state.config.max_model_len,
        "tokens": tokens,
        "token_strs": null,
    });
    if request.return_token_strs == Some(true) {
        let strs: Vec<String> = bytes
            .chunks(BYTES_PER_TOKEN)
            .map(|c| String::from_utf8_lossy(c).into_owned())
            .collect();
        answer["token_strs"] = json!(strs);
    }
    Ok(body::json(StatusCode::OK, &answer))
}

/// `POST /detokenize`.
pub fn detokenize(
    state: &crate::state::AppState,
    body: &[u8],
) -> Result<Response<SimBody>, ApiError> {
    let request: DetokenizeRequest =
        serde_json::from_slice(body).map_err(|e| bad(format!("Invalid request body: {e}")))?;
    resolve_model(state, request.model)?;
    let mut ids = Vec::with_capacity(request.tokens.len());
    for id in request.tokens {
        ids.push(
            u32::try_from(id).map_err(|_| bad(format!("Token id {id} is out of vocabulary")))?,
        );
    }
    let prompt = String::from_utf8_lossy(&token_bytes(&ids)).into_owned();
    Ok(body::json(StatusCode::OK, &json!({ "prompt": prompt })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::count_tokens;

    #[test]
    fn ids_count_like_the_tokenizer_and_round_trip() {
        for text in ["", "a", "abcd", "hello world, héllo", "exactly8"] {
            let ids = token_ids(text.as_bytes());
            assert_eq!(ids.len() as u32, count_tokens(text.len()), "{text:?}");
            assert_eq!(token_bytes(&ids), text.as_bytes());
        }
    }
}
