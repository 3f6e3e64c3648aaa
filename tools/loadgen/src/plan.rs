//! What a workload generates and the driver sends: a [`Plan`] of sessions, each a conversation of
//! [`Turn`]s; the text they are made of ([`words`]: four-byte words, so a content of N tokens is
//! exactly N x 4 bytes under the 4-bytes-per-token approximation the gateway and vllm-sim share);
//! and the chat messages of a turn with its history ([`messages`]).

use crate::rng::Rng;
use serde::Serialize;

/// One user message and the answer length asked for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The user message.
    pub user: String,
    /// `max_tokens` (sent with `ignore_eos`, so the answer has exactly this many tokens).
    pub output_tokens: u32,
}

/// A conversation: sent turn after turn, each with the full history.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// Sent as `x-user-id` when set.
    pub user_id: Option<String>,
    /// The system prompt, if any.
    pub system: Option<String>,
    /// The user turns in order.
    pub turns: Vec<Turn>,
}

/// A generated workload: its sessions in dispatch order.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The sessions, in the order they start.
    pub sessions: Vec<Session>,
    /// A trace's arrival times, ms from its first request, one per session (empty for the
    /// generated workloads, whose arrivals the driver draws).
    pub trace_ms: Vec<f64>,
}

impl Plan {
    /// Requests in the plan (turns of every session).
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }
}

/// `tokens` tokens of random four-byte words.
pub fn words(rng: &mut Rng, tokens: usize) -> String {
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz";
    let mut s = String::with_capacity(tokens * 4);
    for _ in 0..tokens {
        s.push(' ');
        for _ in 0..3 {
            s.push(LETTERS[rng.below(26) as usize] as char);
        }
    }
    s
}

/// A chat message as sent on the wire.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: &'static str,
    /// The text.
    pub content: String,
}

/// The messages of turn `turn` of `session`, given the answers to the earlier turns.
pub fn messages(session: &Session, turn: usize, answers: &[String]) -> Vec<Message> {
    let mut out = Vec::with_capacity(2 * turn + 2);
    if let Some(system) = &session.system {
        out.push(Message {
            role: "system",
            content: system.clone(),
        });
    }
    for (i, t) in session.turns.iter().take(turn + 1).enumerate() {
        out.push(Message {
            role: "user",
            content: t.user.clone(),
        });
        if i < turn {
            out.push(Message {
                role: "assistant",
                content: answers.get(i).cloned().unwrap_or_default(),
            });
        }
    }
    out
}
