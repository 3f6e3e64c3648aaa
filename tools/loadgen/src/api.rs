//! The three conversation APIs a workload's sessions can be sent through, as the clients of each
//! send them: OpenAI chat completions (`messages`), the OpenAI Responses API (`instructions` and
//! the whole history as `input` items, `store: false`, so no `previous_response_id`) and
//! Anthropic's Messages API (`system` and `messages`); every one streamed. For each, the request
//! body of a turn given the earlier answers, and what one server-sent event of its stream says:
//! output text (for the time to first token), the usage (prompt, cached and output tokens) and the
//! end of the stream. Chat's events are read in [`crate::client`]; this file reads the other two.
//!
//! Usage, as vLLM (and vllm-sim) report it: Responses in the terminal `response.completed` (or
//! `response.incomplete`, when `max_output_tokens` cut the answer, as it does for every turn of
//! the benchmark) event's `response.usage`: `input_tokens`, `input_tokens_details.cached_tokens`,
//! `output_tokens`. Messages in `message_start`'s `message.usage` and the final `message_delta`'s
//! `usage`: `input_tokens` counts the prompt tokens **not** read from the cache and
//! `cache_read_input_tokens` the cached ones (Anthropic's convention, which vLLM follows), so the
//! prompt is their sum (plus `cache_creation_input_tokens`, if a server reports it).

use crate::client::StreamResult;
use crate::plan::{messages, Session};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Which API a request is sent through.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/chat/completions`.
    #[default]
    Chat,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /v1/messages`.
    Messages,
}

/// The `anthropic-version` an Anthropic client sends.
const ANTHROPIC_VERSION: &str = "2023-06-01";

/// What one event of a stream said.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventOutcome {
    /// It carried output text.
    pub text: bool,
    /// It ends the stream (`[DONE]`, `response.completed`, `message_stop`).
    pub done: bool,
}

impl EventOutcome {
    /// The stream's last event.
    pub const END: EventOutcome = EventOutcome {
        text: false,
        done: true,
    };
}

impl Api {
    /// `chat`, `responses`, `messages`.
    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Responses => "responses",
            Api::Messages => "messages",
        }
    }

    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    /// Headers the API's clients send besides the JSON content type.
    pub fn headers(self) -> Vec<(String, String)> {
        match self {
            Api::Messages => vec![("anthropic-version".into(), ANTHROPIC_VERSION.into())],
            _ => Vec::new(),
        }
    }

    /// The streamed request of turn `turn` of `session`, given the answers to the earlier turns:
    /// the same conversation in each API's shape, asking for the turn's output length at
    /// temperature 0. Chat also sends `ignore_eos` (a vLLM extension; the other two APIs have no
    /// such field, so their answers end at `max_output_tokens` / `max_tokens` only if the server
    /// draws no earlier end of sequence: the bench's fleet runs vllm-sim with a long mean output).
    pub fn body(self, model: &str, session: &Session, turn: usize, answers: &[String]) -> Value {
        let max_tokens = session.turns[turn].output_tokens;
        let history = messages(session, turn, answers);
        match self {
            Api::Chat => json!({
                "model": model,
                "messages": history,
                "max_tokens": max_tokens,
                "ignore_eos": true,
                "temperature": 0,
                "stream": true,
                "stream_options": {"include_usage": true},
            }),
            Api::Responses => {
                let input: Vec<Value> = history
                    .iter()
                    .filter(|m| m.role != "system")
                    .map(|m| match m.role {
                        // An earlier answer goes back as the output message it came as.
                        "assistant" => json!({
                            "type": "message",
                            "role": "assistant",
                            "content": [{"type": "output_text", "text": m.content}],
                        }),
                        role => json!({"type": "message", "role": role, "content": m.content}),
                    })
                    .collect();
                let mut body = json!({
                    "model": model,
                    "input": input,
                    "max_output_tokens": max_tokens,
                    "temperature": 0,
                    "stream": true,
                    "store": false,
                });
                if let Some(system) = &session.system {
                    body["instructions"] = json!(system);
                }
                body
            }
            Api::Messages => {
                let turns: Vec<Value> = history
                    .iter()
                    .filter(|m| m.role != "system")
                    .map(|m| json!({"role": m.role, "content": m.content}))
                    .collect();
                let mut body = json!({
                    "model": model,
                    "messages": turns,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": true,
                });
                if let Some(system) = &session.system {
                    body["system"] = json!(system);
                }
                body
            }
        }
    }
}

/// An error event: `what` and the error object become the stream's error.
fn failed(out: &mut StreamResult, what: &str, error: Option<&Value>) -> EventOutcome {
    out.error = Some(format!("{what}: {}", error.unwrap_or(&Value::Null)));
    EventOutcome::default()
}

/// A piece of output text (an event with an empty one carries none).
fn output_text(
    piece: Option<&Value>,
    out: &mut StreamResult,
    text_events: &mut u32,
) -> EventOutcome {
    let piece = piece.and_then(Value::as_str).unwrap_or("");
    if !piece.is_empty() {
        out.text.push_str(piece);
        *text_events += 1;
    }
    EventOutcome {
        text: !piece.is_empty(),
        done: false,
    }
}

/// Reads one event's data of a Responses stream into `out`; `usage_tokens` gets the output
/// tokens of the usage.
pub fn read_responses_event(
    data: &str,
    out: &mut StreamResult,
    text_events: &mut u32,
    usage_tokens: &mut Option<u32>,
) -> EventOutcome {
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return EventOutcome::default();
    };
    let count = |u: &Value, p: &str| u.pointer(p).and_then(Value::as_u64).map(|x| x as u32);
    match v.get("type").and_then(Value::as_str).unwrap_or("") {
        "response.output_text.delta" => output_text(v.get("delta"), out, text_events),
        "response.completed" | "response.incomplete" => {
            if let Some(u) = v.pointer("/response/usage").filter(|u| !u.is_null()) {
                out.prompt_tokens = count(u, "/input_tokens");
                out.cached_tokens = count(u, "/input_tokens_details/cached_tokens");
                *usage_tokens = count(u, "/output_tokens");
            }
            EventOutcome::END
        }
        "response.failed" => failed(out, "response failed", v.pointer("/response/error")),
        "error" => failed(out, "stream error", Some(&v)),
        _ => EventOutcome::default(),
    }
}

/// Reads one event's data of a Messages stream into `out`; `usage_tokens` gets the output tokens
/// of the final usage.
pub fn read_messages_event(
    data: &str,
    out: &mut StreamResult,
    text_events: &mut u32,
    usage_tokens: &mut Option<u32>,
) -> EventOutcome {
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return EventOutcome::default();
    };
    match v.get("type").and_then(Value::as_str).unwrap_or("") {
        "message_start" => {
            if let Some(u) = v.pointer("/message/usage") {
                read_anthropic_usage(u, out);
            }
            EventOutcome::default()
        }
        "content_block_delta" => output_text(v.pointer("/delta/text"), out, text_events),
        "message_delta" => {
            if let Some(u) = v.get("usage") {
                read_anthropic_usage(u, out);
                if let Some(n) = u.get("output_tokens").and_then(Value::as_u64) {
                    *usage_tokens = Some(n as u32);
                }
            }
            EventOutcome::default()
        }
        "message_stop" => EventOutcome::END,
        "error" => failed(out, "stream error", v.get("error")),
        _ => EventOutcome::default(),
    }
}

/// An Anthropic `usage` object: the prompt is the uncached input plus the tokens read from (and
/// written to) the cache. A usage without `input_tokens` (a `message_delta` may carry only the
/// output) leaves the prompt as it was.
fn read_anthropic_usage(u: &Value, out: &mut StreamResult) {
    let n = |k: &str| u.get(k).and_then(Value::as_u64);
    let Some(input) = n("input_tokens") else {
        return;
    };
    let read = n("cache_read_input_tokens");
    let written = n("cache_creation_input_tokens").unwrap_or(0);
    out.prompt_tokens = Some((input + read.unwrap_or(0) + written) as u32);
    if read.is_some() || out.cached_tokens.is_none() {
        out.cached_tokens = read.map(|r| r as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Turn;

    fn session() -> Session {
        Session {
            user_id: Some("user-1".into()),
            system: Some("SYS".into()),
            turns: vec![
                Turn {
                    user: "Q1".into(),
                    output_tokens: 5,
                },
                Turn {
                    user: "Q2".into(),
                    output_tokens: 7,
                },
            ],
        }
    }

    #[test]
    fn the_three_bodies_carry_the_same_conversation() {
        let s = session();
        let answers = ["A1".to_string()];
        let chat = Api::Chat.body("m", &s, 1, &answers);
        assert_eq!(chat["messages"].as_array().unwrap().len(), 4);
        assert_eq!(
            chat["messages"][0],
            json!({"role": "system", "content": "SYS"})
        );
        assert_eq!(chat["max_tokens"], 7);
        assert_eq!(chat["ignore_eos"], true);
        assert_eq!(chat["stream_options"]["include_usage"], true);

        let r = Api::Responses.body("m", &s, 1, &answers);
        assert_eq!(r["instructions"], "SYS");
        assert_eq!(
            r["input"],
            json!([
                {"type": "message", "role": "user", "content": "Q1"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A1"}]},
                {"type": "message", "role": "user", "content": "Q2"},
            ])
        );
        assert_eq!(r["max_output_tokens"], 7);
        assert_eq!(
            (r["stream"].clone(), r["store"].clone()),
            (json!(true), json!(false))
        );
        assert!(r.get("previous_response_id").is_none() && r.get("messages").is_none());

        let m = Api::Messages.body("m", &s, 1, &answers);
        assert_eq!(m["system"], "SYS");
        assert_eq!(
            m["messages"],
            json!([
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "Q2"},
            ])
        );
        assert_eq!(
            (m["max_tokens"].clone(), m["stream"].clone()),
            (json!(7), json!(true))
        );

        // The first turn, and a session without a system prompt.
        let first = Api::Responses.body("m", &s, 0, &[]);
        assert_eq!(first["input"].as_array().unwrap().len(), 1);
        let bare = Session {
            system: None,
            ..session()
        };
        assert!(Api::Messages
            .body("m", &bare, 0, &[])
            .get("system")
            .is_none());
        assert!(Api::Responses
            .body("m", &bare, 0, &[])
            .get("instructions")
            .is_none());
    }

    #[test]
    fn paths_names_and_headers() {
        assert_eq!(Api::Chat.path(), "/v1/chat/completions");
        assert_eq!(Api::Responses.path(), "/v1/responses");
        assert_eq!(Api::Messages.path(), "/v1/messages");
        assert_eq!(Api::Messages.headers()[0].0, "anthropic-version");
        assert!(Api::Responses.headers().is_empty());
        let apis: Vec<Api> =
            serde_json::from_value(json!(["chat", "responses", "messages"])).unwrap();
        assert_eq!(apis, [Api::Chat, Api::Responses, Api::Messages]);
        assert_eq!(Api::default().name(), "chat");
    }

    #[test]
    fn responses_events_give_text_usage_and_the_end() {
        let mut out = StreamResult::default();
        let (mut n, mut usage) = (0, None);
        let mut read =
            |d: &str, out: &mut StreamResult| read_responses_event(d, out, &mut n, &mut usage);
        assert_eq!(
            read(
                r#"{"type":"response.created","sequence_number":0,"response":{"usage":null}}"#,
                &mut out
            ),
            EventOutcome::default()
        );
        assert_eq!(
            read(
                r#"{"type":"response.output_text.delta","delta":"","sequence_number":4}"#,
                &mut out
            ),
            EventOutcome::default()
        );
        assert!(
            read(
                r#"{"type":"response.output_text.delta","delta":" the","sequence_number":5}"#,
                &mut out
            )
            .text
        );
        assert!(
            read(
                r#"{"type":"response.output_text.delta","delta":" cat","sequence_number":6}"#,
                &mut out
            )
            .text
        );
        let end = read(
            r#"{"type":"response.incomplete","sequence_number":9,"response":{"status":"incomplete","usage":{"input_tokens":400,"input_tokens_details":{"cached_tokens":320},"output_tokens":2,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":402}}}"#,
            &mut out,
        );
        assert_eq!(
            end,
            EventOutcome {
                text: false,
                done: true
            }
        );
        assert_eq!(out.text, " the cat");
        assert_eq!(
            (out.prompt_tokens, out.cached_tokens),
            (Some(400), Some(320))
        );
        assert_eq!((n, usage), (2, Some(2)));
        // response.completed is the usual end.
        let mut done = StreamResult::default();
        assert!(
            read_responses_event(
                r#"{"type":"response.completed","response":{"usage":{"input_tokens":10,"input_tokens_details":{"cached_tokens":0},"output_tokens":3}}}"#,
                &mut done,
                &mut 0,
                &mut None
            )
            .done
        );
        assert_eq!(
            (done.prompt_tokens, done.cached_tokens),
            (Some(10), Some(0))
        );
        let mut failed = StreamResult::default();
        read_responses_event(
            r#"{"type":"response.failed","response":{"error":{"code":"server_error","message":"boom"}}}"#,
            &mut failed,
            &mut 0,
            &mut None,
        );
        assert!(failed.error.unwrap().contains("boom"));
    }

    #[test]
    fn messages_events_give_text_usage_and_the_end() {
        let mut out = StreamResult::default();
        let (mut n, mut usage) = (0, None);
        let mut read =
            |d: &str, out: &mut StreamResult| read_messages_event(d, out, &mut n, &mut usage);
        read(
            r#"{"type":"message_start","message":{"id":"msg_1","usage":{"input_tokens":400,"output_tokens":0}}}"#,
            &mut out,
        );
        // Before the final usage, the prompt is message_start's and nothing is known cached.
        assert_eq!((out.prompt_tokens, out.cached_tokens), (Some(400), None));
        assert!(!read(r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#, &mut out).text);
        assert!(read(r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" the"}}"#, &mut out).text);
        assert!(read(r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" cat"}}"#, &mut out).text);
        assert!(!read(r#"{"type":"content_block_stop","index":0}"#, &mut out).done);
        read(
            r#"{"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{"input_tokens":80,"output_tokens":2,"cache_read_input_tokens":320}}"#,
            &mut out,
        );
        // Anthropic's input_tokens leaves out the cached tokens: the prompt is the sum.
        assert_eq!(
            (out.prompt_tokens, out.cached_tokens),
            (Some(400), Some(320))
        );
        assert_eq!(
            read(r#"{"type":"message_stop"}"#, &mut out),
            EventOutcome {
                text: false,
                done: true
            }
        );
        assert_eq!(out.text, " the cat");
        assert_eq!((n, usage), (2, Some(2)));
        // A final usage with only the output keeps the prompt; cache writes count in it.
        let mut w = StreamResult::default();
        read_messages_event(
            r#"{"type":"message_start","message":{"usage":{"input_tokens":50,"cache_creation_input_tokens":30,"cache_read_input_tokens":20,"output_tokens":1}}}"#,
            &mut w,
            &mut 0,
            &mut None,
        );
        read_messages_event(
            r#"{"type":"message_delta","usage":{"output_tokens":9}}"#,
            &mut w,
            &mut 0,
            &mut None,
        );
        assert_eq!((w.prompt_tokens, w.cached_tokens), (Some(100), Some(20)));
        let mut e = StreamResult::default();
        read_messages_event(
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
            &mut e,
            &mut 0,
            &mut None,
        );
        assert!(e.error.unwrap().contains("overloaded_error"));
    }
}
