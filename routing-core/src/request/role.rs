//! The part of inference a backend performs: prefill, decode or both.
//!
//! A backend's spec names its role (`BackendSpec::role`), and a request's
//! features may ask for one ([`RequestFeatures::role_hint`](crate::request::prompt::RequestFeatures::role_hint))
//! when its caller stages prefill and decode itself. It lives with the request so that the request's
//! features need nothing from the backend's folder.

use serde::{Deserialize, Serialize};

/// What part of inference a backend performs (and a request may ask for).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// An ordinary vLLM server doing both prefill and decode.
    #[default]
    Mixed,
    /// A disaggregated prefill server (vLLM `kv_producer`).
    Prefill,
    /// A disaggregated decode server (vLLM `kv_consumer`).
    Decode,
}

impl Role {
    /// The role's name as used in JSON and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Mixed => "mixed",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}
