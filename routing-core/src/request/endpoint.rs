//! The OpenAI endpoints the gateway routes: one enum for the Worker's route table, the request's
//! features (`RequestFeatures::kind`, `crate::request::prompt`) and a stream's resumption
//! (`crate::stream::resume`).

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
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
            Endpoint::MessagesCountTokens => "/v1/messages/count_tokens",
        }
    }

    /// Whether a broken stream of this endpoint may be continued on another backend: chat and
    /// completions only. The Responses and Messages streams carry sequence numbers, item and
    /// message ids and a start event that a continuation would repeat, so they are not spliced.
    pub fn resumable(self) -> bool {
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
}
