//! Why a request body yields no routing features: one error type for every endpoint, each
//! variant naming the parameter at fault and a stable code for the OpenAI error.

use std::fmt;

/// Why a request body could not be read. Each maps to an HTTP 400 with [`PromptError::param`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptError {
    /// The body is not a JSON object.
    NotAnObject,
    /// No `model` field.
    MissingModel,
    /// Neither `messages` nor `prompt`.
    MissingPrompt,
    /// `messages` is an empty array.
    EmptyMessages,
    /// A field has the wrong type or value.
    InvalidField {
        /// The field's name.
        field: &'static str,
        /// What was expected instead.
        expected: &'static str,
    },
    /// One message is malformed.
    InvalidMessage {
        /// Index of the message in `messages`.
        index: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The endpoint's own input is missing: `messages` for chat, `prompt` for completions,
    /// `input` for embeddings.
    MissingInput {
        /// The field the endpoint needs.
        field: &'static str,
    },
}

impl PromptError {
    /// The request parameter at fault, for the OpenAI error's `param` field.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            PromptError::NotAnObject => None,
            PromptError::MissingModel => Some("model"),
            PromptError::MissingPrompt | PromptError::EmptyMessages => Some("messages"),
            PromptError::InvalidField { field, .. } => Some(field),
            PromptError::InvalidMessage { .. } => Some("messages"),
            PromptError::MissingInput { field } => Some(field),
        }
    }

    /// A stable machine-readable code for the OpenAI error's `code` field.
    pub fn code(&self) -> &'static str {
        match self {
            PromptError::NotAnObject => "invalid_body",
            PromptError::MissingModel => "missing_model",
            PromptError::MissingPrompt => "missing_prompt",
            PromptError::EmptyMessages => "empty_messages",
            PromptError::InvalidField { .. } => "invalid_type",
            PromptError::InvalidMessage { .. } => "invalid_message",
            PromptError::MissingInput { .. } => "missing_prompt",
        }
    }
}

impl fmt::Display for PromptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PromptError::NotAnObject => f.write_str("the request body must be a JSON object"),
            PromptError::MissingModel => f.write_str("you must provide a model parameter"),
            PromptError::MissingPrompt => f.write_str(
                "the request must have either `messages` (chat) or `prompt` (completion)",
            ),
            PromptError::EmptyMessages => f.write_str("`messages` must not be empty"),
            PromptError::InvalidField { field, expected } => {
                write!(f, "`{field}` must be {expected}")
            }
            PromptError::InvalidMessage { index, reason } => {
                write!(f, "messages[{index}] {reason}")
            }
            PromptError::MissingInput { field } => write!(f, "`{field}` is required"),
        }
    }
}

impl std::error::Error for PromptError {}

pub(crate) fn invalid(field: &'static str, expected: &'static str) -> PromptError {
    PromptError::InvalidField { field, expected }
}
