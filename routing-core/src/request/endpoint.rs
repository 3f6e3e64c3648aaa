//! The OpenAI endpoints the gateway routes: one enum for the Worker's route table, the request's
//! features (`RequestFeatures::kind`, `crate::request::prompt`) and a stream's resumption
//! (`crate::stream::resume`). Besides the completion endpoints, vLLM's own routes pass through by
//! model (`crate::request::passthrough`): tokenize, detokenize, rerank, score, pooling, classify
//! and the audio routes.

use serde::{Deserialize, Serialize};

/// The OpenAI endpoints whose requests the gateway routes. On the wire (the request features'
/// `kind`) they are `"chat"`, `"completion"` and `"embeddings"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Endpoint {
    /// `/v1/chat/completions`: `messages`.
    #[default]
    #[serde(rename = "chat")]
    Chat,
    /// `/v1/completions`: `prompt`.
    #[serde(rename = "completion")]
    Completions,
    /// `/v1/embeddings`: `input`.
    #[serde(rename = "embeddings")]
    Embeddings,
    // Pass-through routes by model (`crate::request::passthrough`), vLLM 0.34's.
    /// `/tokenize`: `prompt` or `messages`; answers token ids, no usage.
    #[serde(rename = "tokenize")]
    Tokenize,
    /// `/detokenize`: `tokens`; answers the text.
    #[serde(rename = "detokenize")]
    Detokenize,
    /// `/v1/rerank` (also `/rerank`, `/v2/rerank`): `query` and `documents`.
    #[serde(rename = "rerank")]
    Rerank,
    /// `/v1/score` (also `/score`): two lists of texts (`queries`/`documents`, `queries`/`items`,
    /// `data_1`/`data_2` or `text_1`/`text_2`).
    #[serde(rename = "score")]
    Score,
    /// `/pooling`: `input` or `messages`.
    #[serde(rename = "pooling")]
    Pooling,
    /// `/classify`: `input` or `messages`.
    #[serde(rename = "classify")]
    Classify,
    /// `/v1/audio/transcriptions`: multipart/form-data with `file` and `model`.
    #[serde(rename = "transcriptions")]
    Transcriptions,
    /// `/v1/audio/translations`: multipart/form-data with `file` and `model`.
    #[serde(rename = "translations")]
    Translations,
    /// `/v1/responses` (OpenAI's Responses API): `instructions` and `input`.
    #[serde(rename = "responses")]
    Responses,
    /// `/v1/messages` (Anthropic's Messages API): `system` and `messages`.
    #[serde(rename = "messages")]
    Messages,
    /// `/v1/messages/count_tokens`: routed by model, no output.
    #[serde(rename = "messages_count_tokens")]
    MessagesCountTokens,
}

impl Endpoint {
    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Tokenize => "/tokenize",
            Endpoint::Detokenize => "/detokenize",
            Endpoint::Rerank => "/v1/rerank",
            Endpoint::Score => "/v1/score",
            Endpoint::Pooling => "/pooling",
            Endpoint::Classify => "/classify",
            Endpoint::Transcriptions => "/v1/audio/transcriptions",
            Endpoint::Translations => "/v1/audio/translations",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
            Endpoint::MessagesCountTokens => "/v1/messages/count_tokens",
        }
    }

    /// Every path a client may call the endpoint on; the first is [`Endpoint::path`], the one
    /// the request is sent upstream on (vLLM 0.34 serves the others with the same handler).
    pub fn paths(self) -> &'static [&'static str] {
        match self {
            Endpoint::Rerank => &["/v1/rerank", "/rerank", "/v2/rerank"],
            Endpoint::Score => &["/v1/score", "/score"],
            Endpoint::Chat => &["/v1/chat/completions"],
            Endpoint::Completions => &["/v1/completions"],
            Endpoint::Embeddings => &["/v1/embeddings"],
            Endpoint::Tokenize => &["/tokenize"],
            Endpoint::Detokenize => &["/detokenize"],
            Endpoint::Pooling => &["/pooling"],
            Endpoint::Classify => &["/classify"],
            Endpoint::Transcriptions => &["/v1/audio/transcriptions"],
            Endpoint::Translations => &["/v1/audio/translations"],
            Endpoint::Responses => &["/v1/responses"],
            Endpoint::Messages => &["/v1/messages"],
            Endpoint::MessagesCountTokens => &["/v1/messages/count_tokens"],
        }
    }

    /// The pass-through endpoints, in the order of the enum.
    pub const PASSTHROUGH: [Endpoint; 8] = [
        Endpoint::Tokenize,
        Endpoint::Detokenize,
        Endpoint::Rerank,
        Endpoint::Score,
        Endpoint::Pooling,
        Endpoint::Classify,
        Endpoint::Transcriptions,
        Endpoint::Translations,
    ];

    /// The pass-through endpoint a client path names (any of its [`Endpoint::paths`]).
    pub fn passthrough_for_path(path: &str) -> Option<Endpoint> {
        let path = match path.len() > 1 {
            true => path.trim_end_matches('/'),
            false => path,
        };
        Endpoint::PASSTHROUGH
            .into_iter()
            .find(|e| e.paths().contains(&path))
    }

    /// Whether the endpoint is one of vLLM's own routes passed through by model (not a
    /// completion endpoint): its answer is relayed as it comes, never resumed.
    pub fn is_passthrough(self) -> bool {
        Endpoint::PASSTHROUGH.contains(&self)
    }

    /// Whether the request body is multipart/form-data (the audio routes), not JSON.
    pub fn is_multipart(self) -> bool {
        matches!(self, Endpoint::Transcriptions | Endpoint::Translations)
    }

    /// Whether a stream to this endpoint can be made to report usage (`stream_options`) and,
    /// once broken, resumed: chat and completions only. The Responses and Messages streams
    /// report usage unasked, and carry sequence numbers, item and message ids and a start event
    /// that a continuation would repeat, so they are not spliced.
    pub fn is_generation(self) -> bool {
        matches!(self, Endpoint::Chat | Endpoint::Completions)
    }

    /// Whether the endpoint's answers are in Anthropic's shape (errors included).
    pub fn anthropic(self) -> bool {
        matches!(self, Endpoint::Messages | Endpoint::MessagesCountTokens)
    }
}

#[cfg(test)]
mod tests {
    use super::Endpoint;

    #[test]
    fn wire_names_are_the_request_kinds_of_before() {
        let names = [
            (Endpoint::Chat, "\"chat\""),
            (Endpoint::Completions, "\"completion\""),
            (Endpoint::Embeddings, "\"embeddings\""),
            (Endpoint::Responses, "\"responses\""),
            (Endpoint::Messages, "\"messages\""),
            (Endpoint::MessagesCountTokens, "\"messages_count_tokens\""),
        ];
        for (endpoint, name) in names {
            assert_eq!(serde_json::to_string(&endpoint).unwrap(), name);
            assert_eq!(serde_json::from_str::<Endpoint>(name).unwrap(), endpoint);
        }
        assert_eq!(Endpoint::default(), Endpoint::Chat);
    }

    #[test]
    fn passthrough_paths_name_their_endpoint_and_go_upstream_on_the_first() {
        for e in Endpoint::PASSTHROUGH {
            assert!(e.is_passthrough());
            assert_eq!(e.paths()[0], e.path());
            for p in e.paths() {
                assert_eq!(Endpoint::passthrough_for_path(p), Some(e), "{p}");
            }
            let wire = serde_json::to_string(&e).unwrap();
            assert_eq!(serde_json::from_str::<Endpoint>(&wire).unwrap(), e);
        }
        assert_eq!(
            Endpoint::passthrough_for_path("/v2/rerank/"),
            Some(Endpoint::Rerank)
        );
        assert_eq!(
            Endpoint::passthrough_for_path("/score"),
            Some(Endpoint::Score)
        );
        assert_eq!(Endpoint::passthrough_for_path("/v1/chat/completions"), None);
        assert_eq!(Endpoint::passthrough_for_path("/v1/tokenize"), None);
        assert!(Endpoint::Transcriptions.is_multipart() && !Endpoint::Rerank.is_multipart());
        assert!(!Endpoint::Embeddings.is_passthrough() && !Endpoint::Embeddings.is_generation());
    }
}
