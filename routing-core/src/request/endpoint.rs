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

#[cfg(test)]
mod tests {
    use super::Endpoint;

    #[test]
    fn wire_names_are_the_request_kinds_of_before() {
        let names = [
            (Endpoint::Chat, "\"chat\""),
            (Endpoint::Completions, "\"completion\""),
            (Endpoint::Embeddings, "\"embeddings\""),
        ];
        for (endpoint, name) in names {
            assert_eq!(serde_json::to_string(&endpoint).unwrap(), name);
            assert_eq!(serde_json::from_str::<Endpoint>(name).unwrap(), endpoint);
        }
        assert_eq!(Endpoint::default(), Endpoint::Chat);
    }
}
