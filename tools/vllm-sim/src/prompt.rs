//! Turning request bodies into prompt bytes: the sim's chat template and the shapes of `prompt` and
//! `input` that vLLM accepts.
//!
//! **Chat template.** Each message, in order, renders as `"<|" + role + "|>\n" + content + "\n"`, where
//! content is the string, or the `text` of every `{"type": "text"}` part concatenated (other parts, such
//! as images, and a `null` content render as nothing). A generation prompt `"<|assistant|>\n"` follows
//! the last message. That marker is exactly the header an assistant message renders with, so when a
//! client sends the next turn (the history, the assistant's reply, the new user message), the new
//! prompt begins with the whole previous prompt followed by the reply text: turn N+1 hits the prefix
//! cache on every full block of turn N's prompt, and on the reply's blocks too, since the sim caches
//! generated blocks as vLLM does.
//!
//! **Continuing a message.** vLLM's chat extensions choose how the rendering ends
//! ([`ChatEnding::from_request`]): `add_generation_prompt: false` leaves the generation prompt out, and
//! `continue_final_message: true` (which needs `add_generation_prompt: false` and a final assistant
//! message) leaves that final message open: no newline after it, no generation prompt. The rendering
//! of [history + partial answer] is then exactly the original request's prompt (which ended with the
//! generation prompt) followed by the partial answer's text, so a continued request extends its
//! original prompt and hits the prefix cache on it.
//!
//! `/v1/completions` takes a string, a list of one string, a list of token ids or a list of one list
//! of token ids (see [`crate::tokenizer::token_ids_to_bytes`]). `/v1/embeddings` takes the same shapes
//! but any number of inputs.

use serde::Deserialize;

use crate::tokenizer::token_ids_to_bytes;

/// The generation prompt appended after the last chat message.
pub const GENERATION_PROMPT: &str = "<|assistant|>\n";

/// Why a request's prompt could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptError {
    /// `messages` or `prompt` holds nothing.
    Empty,
    /// More than one prompt in one `/v1/completions` request (vLLM batches them; the sim does not).
    Batched,
    /// `continue_final_message` with `add_generation_prompt` true (explicitly or by default).
    GenerationPromptConflict,
    /// `continue_final_message` while the last message is not the assistant's.
    NothingToContinue,
}

impl std::fmt::Display for PromptError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PromptError::Empty => f.write_str("the prompt is empty"),
            PromptError::Batched => {
                f.write_str("vllm-sim accepts one prompt per /v1/completions request")
            }
            // vLLM's own message (its request validator).
            PromptError::GenerationPromptConflict => f.write_str(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ),
            PromptError::NothingToContinue => f.write_str(
                "continue_final_message is set but the final message is not an assistant message",
            ),
        }
    }
}

/// One chat message as the OpenAI API sends it; fields other than `role` and `content` are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// A string, a list of content parts, or absent/`null` (an assistant message with tool calls).
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// A message's content: plain text or a list of typed parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// `"content": "text"`.
    Text(String),
    /// `"content": [{"type": "text", "text": "..."}, {"type": "image_url", ...}]`.
    Parts(Vec<ContentPart>),
}

/// One content part; only text parts contribute to the prompt.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// The part's type; `text` parts (or parts without a type that carry `text`) are rendered.
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// The text of a text part.
    #[serde(default)]
    pub text: Option<String>,
}

/// How a rendered chat ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatEnding {
    /// After the last message, the generation prompt (vLLM's default, `add_generation_prompt: true`).
    GenerationPrompt,
    /// After the last message, nothing (`add_generation_prompt: false`).
    Closed,
    /// The last (assistant) message left open: no newline, no generation prompt
    /// (`continue_final_message: true`).
    ContinueFinal,
}

impl ChatEnding {
    /// The ending a request asks for, validated as vLLM does: `add_generation_prompt` defaults to
    /// true, so `continue_final_message` needs it explicitly false. The sim also requires a final
    /// assistant message to continue.
    pub fn from_request(
        messages: &[ChatMessage],
        add_generation_prompt: Option<bool>,
        continue_final_message: Option<bool>,
    ) -> Result<Self, PromptError> {
        let add = add_generation_prompt.unwrap_or(true);
        if !continue_final_message.unwrap_or(false) {
            return Ok(if add {
                ChatEnding::GenerationPrompt
            } else {
                ChatEnding::Closed
            });
        }
        if add {
            return Err(PromptError::GenerationPromptConflict);
        }
        match messages.last() {
            Some(m) if m.role == "assistant" => Ok(ChatEnding::ContinueFinal),
            _ => Err(PromptError::NothingToContinue),
        }
    }
}

/// Renders chat messages with the sim's template (see the module docs), ending as `ending` says.
pub fn render_chat(messages: &[ChatMessage], ending: ChatEnding) -> Result<Vec<u8>, PromptError> {
    if messages.is_empty() {
        return Err(PromptError::Empty);
    }
    let mut out = String::new();
    for (i, message) in messages.iter().enumerate() {
        out.push_str("<|");
        out.push_str(&message.role);
        out.push_str("|>\n");
        match &message.content {
            Some(MessageContent::Text(text)) => out.push_str(text),
            Some(MessageContent::Parts(parts)) => {
                for part in parts {
                    let is_text = part.kind.as_deref().is_none_or(|k| k == "text");
                    if let (true, Some(text)) = (is_text, &part.text) {
                        out.push_str(text);
                    }
                }
            }
            None => {}
        }
        let open = ending == ChatEnding::ContinueFinal && i + 1 == messages.len();
        if !open {
            out.push('\n');
        }
    }
    if ending == ChatEnding::GenerationPrompt {
        out.push_str(GENERATION_PROMPT);
    }
    Ok(out.into_bytes())
}

/// The shapes vLLM accepts for `prompt` (completions) and `input` (embeddings).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// `"text"`.
    Text(String),
    /// `["text", ...]`.
    Texts(Vec<String>),
    /// `[1, 2, 3]`.
    Tokens(Vec<u32>),
    /// `[[1, 2], [3]]`.
    TokenLists(Vec<Vec<u32>>),
}

impl PromptInput {
    /// Every prompt in the input, as bytes, in order.
    pub fn into_prompts(self) -> Vec<Vec<u8>> {
        match self {
            PromptInput::Text(text) => vec![text.into_bytes()],
            PromptInput::Texts(texts) => texts.into_iter().map(String::into_bytes).collect(),
            PromptInput::Tokens(ids) => vec![token_ids_to_bytes(&ids)],
            PromptInput::TokenLists(lists) => {
                lists.iter().map(|ids| token_ids_to_bytes(ids)).collect()
            }
        }
    }

    /// The single prompt of a `/v1/completions` request.
    pub fn into_single_prompt(self) -> Result<Vec<u8>, PromptError> {
        let mut prompts = self.into_prompts();
        match prompts.len() {
            0 => Err(PromptError::Empty),
            1 => Ok(prompts.pop().unwrap_or_default()),
            _ => Err(PromptError::Batched),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(json: &str) -> Vec<ChatMessage> {
        serde_json::from_str(json).expect("valid messages")
    }

    fn render_chat_default(messages: &[ChatMessage]) -> Result<Vec<u8>, PromptError> {
        render_chat(messages, ChatEnding::GenerationPrompt)
    }

    #[test]
    fn renders_roles_contents_and_the_generation_prompt() {
        let rendered = render_chat_default(&messages(
            r#"[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]"#,
        ))
        .unwrap();
        assert_eq!(
            String::from_utf8(rendered).unwrap(),
            "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
        );
    }

    #[test]
    fn concatenates_text_parts_and_skips_other_parts_and_null_content() {
        let rendered = render_chat_default(&messages(
            r#"[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]},
                {"role":"assistant","content":null,"tool_calls":[]}]"#,
        ))
        .unwrap();
        assert_eq!(
            String::from_utf8(rendered).unwrap(),
            "<|user|>\nab\n<|assistant|>\n\n<|assistant|>\n"
        );
    }

    #[test]
    fn the_next_turn_extends_the_previous_prompt_and_reply() {
        let turn1 = render_chat_default(&messages(r#"[{"role":"user","content":"Q1"}]"#)).unwrap();
        let reply = " the cat";
        let turn2 = render_chat_default(&messages(&format!(
            r#"[{{"role":"user","content":"Q1"}},{{"role":"assistant","content":"{reply}"}},{{"role":"user","content":"Q2"}}]"#
        )))
        .unwrap();
        let mut expected_prefix = turn1.clone();
        expected_prefix.extend_from_slice(reply.as_bytes());
        assert!(turn2.starts_with(&expected_prefix));
    }

    #[test]
    fn a_continued_final_message_extends_the_original_prompt_by_the_partial_answer() {
        let history = r#"{"role":"system","content":"Be brief."},{"role":"user","content":"Q1"}"#;
        let original = render_chat_default(&messages(&format!("[{history}]"))).unwrap();
        let partial = " the cat sat";
        let continued_messages = messages(&format!(
            r#"[{history},{{"role":"assistant","content":"{partial}"}}]"#
        ));
        let ending =
            ChatEnding::from_request(&continued_messages, Some(false), Some(true)).unwrap();
        assert_eq!(ending, ChatEnding::ContinueFinal);
        let continued = render_chat(&continued_messages, ending).unwrap();
        let mut expected = original.clone();
        expected.extend_from_slice(partial.as_bytes());
        assert_eq!(continued, expected);
    }

    #[test]
    fn add_generation_prompt_false_closes_the_last_message_only() {
        let m = messages(r#"[{"role":"user","content":"Hi"}]"#);
        let ending = ChatEnding::from_request(&m, Some(false), None).unwrap();
        assert_eq!(ending, ChatEnding::Closed);
        assert_eq!(render_chat(&m, ending).unwrap(), b"<|user|>\nHi\n");
        assert_eq!(
            ChatEnding::from_request(&m, None, Some(false)),
            Ok(ChatEnding::GenerationPrompt)
        );
    }

    #[test]
    fn continuing_needs_add_generation_prompt_false_and_an_assistant_message() {
        let m =
            messages(r#"[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hel"}]"#);
        let conflict = Err(PromptError::GenerationPromptConflict);
        assert_eq!(ChatEnding::from_request(&m, None, Some(true)), conflict);
        assert_eq!(
            ChatEnding::from_request(&m, Some(true), Some(true)),
            conflict
        );
        assert_eq!(
            PromptError::GenerationPromptConflict.to_string(),
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        );
        let user_last = messages(r#"[{"role":"user","content":"Hi"}]"#);
        assert_eq!(
            ChatEnding::from_request(&user_last, Some(false), Some(true)),
            Err(PromptError::NothingToContinue)
        );
    }

    #[test]
    fn rejects_empty_messages_and_batched_prompts() {
        assert_eq!(render_chat_default(&[]), Err(PromptError::Empty));
        let batched: PromptInput = serde_json::from_str(r#"["a","b"]"#).unwrap();
        assert_eq!(batched.into_single_prompt(), Err(PromptError::Batched));
        let empty: PromptInput = serde_json::from_str("[]").unwrap();
        assert_eq!(empty.into_single_prompt(), Err(PromptError::Empty));
    }

    #[test]
    fn reads_every_prompt_shape() {
        let text: PromptInput = serde_json::from_str(r#""hello""#).unwrap();
        assert_eq!(text.into_single_prompt().unwrap(), b"hello");
        let one: PromptInput = serde_json::from_str(r#"["hello"]"#).unwrap();
        assert_eq!(one.into_single_prompt().unwrap(), b"hello");
        let ids: PromptInput = serde_json::from_str("[1,2]").unwrap();
        assert_eq!(ids.into_single_prompt().unwrap().len(), 8);
        let lists: PromptInput = serde_json::from_str("[[1,2,3]]").unwrap();
        assert_eq!(lists.into_single_prompt().unwrap().len(), 12);
    }
}
