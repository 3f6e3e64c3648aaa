//! Token usage as a backend reports it, read from a non-streamed body or from a passing SSE stream.
//!
//! The gateway counts what the backends say they did (`usage.prompt_tokens`,
//! `usage.prompt_tokens_details.cached_tokens`, `usage.completion_tokens`): for streams it asks the
//! backend for `stream_options.include_usage`, and when the client did not ask for that itself the
//! final usage event (`"choices": []` with `usage`) is taken out, so the client sees exactly what it
//! asked for. [`StreamScanner`] does this on the byte path: it is fed each chunk as it passes, lets
//! whole events through untouched, holds back only a trailing partial event until its end arrives
//! (so an event can be dropped whole, and whatever the backend leaves unfinished never reaches the
//! client), and parses JSON only for events that mention `"usage"` or `"error"`. Held-back bytes
//! are bounded by [`MAX_HELD_BYTES`]: a longer event is let through as it comes.
//!
//! Two kinds of event carry no answer. An SSE comment (`: ...`, vLLM's keep-alive with
//! `--sse-keep-alive-interval`) passes to the client but counts as no token: it is no first token
//! ([`first_chunk`]), and it neither resets the relay's idle timer ([`StreamScanner::progress`])
//! nor counts as output the key is charged for. An error event (`data: {"error": {...}}`, how
//! vLLM reports a failure after its headers, followed by `data: [DONE]`) is the backend's failure,
//! not the end of an answer: the scanner takes it and everything after it out of the client's
//! stream ([`StreamScanner::error`]), the stream is not [`complete`](StreamScanner::complete), and
//! the relay ends or resumes it as it does a broken connection. The events that open a Responses
//! or Messages stream before any output (`response.created`, `message_start`, ...: vLLM sends them
//! as soon as it accepts the request, before the prefill) are no first token either
//! ([`first_chunk`]), so the time to first token the pool learns from is the prefill's, as chat's.

use serde::de::IgnoredAny;
use serde::Deserialize;

/// Largest partial event held back; beyond this the event streams through unparsed.
pub const MAX_HELD_BYTES: usize = 64 * 1024;

/// Token counts reported by a backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens` (cached ones included, as OpenAI counts them).
    pub prompt_tokens: u32,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u32>,
    /// `usage.completion_tokens`.
    pub completion_tokens: u32,
}

impl Usage {
    /// Prompt plus completion tokens (what a per-key token limit charges).
    pub fn total(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.completion_tokens)
    }
}

/// A `usage` object in any of the three shapes: OpenAI's completions (`prompt_tokens`,
/// `completion_tokens`), the Responses API's (`input_tokens` with cached ones included,
/// `input_tokens_details.cached_tokens`, `output_tokens`) and Anthropic's (`input_tokens` without
/// the `cache_read_input_tokens` and `cache_creation_input_tokens` it also reports).
#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
    #[serde(default)]
    prompt_tokens_details: Option<DetailsJson>,
    #[serde(default)]
    input_tokens: Option<u32>,
    #[serde(default)]
    output_tokens: Option<u32>,
    #[serde(default)]
    input_tokens_details: Option<DetailsJson>,
    #[serde(default)]
    cache_read_input_tokens: Option<u32>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct DetailsJson {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

/// Where a Responses or Messages event carries its usage: `response.usage`, `message.usage`
/// (and a Responses event's `response.id`).
#[derive(Deserialize)]
struct Nested {
    #[serde(default)]
    usage: Option<UsageJson>,
    #[serde(default)]
    id: Option<String>,
}

/// The parts of a response object (or chunk) that matter here; everything else is skipped, but the
/// whole document must still be valid JSON.
#[derive(Deserialize)]
struct Envelope {
    #[serde(default)]
    choices: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    usage: Option<UsageJson>,
    /// The event's type (Responses and Messages streams).
    #[serde(default, rename = "type")]
    kind: Option<String>,
    /// `response.completed` and the other Responses events carry the response object.
    #[serde(default)]
    response: Option<Nested>,
    /// Anthropic's `message_start` carries the message.
    #[serde(default)]
    message: Option<Nested>,
    /// A whole Responses API answer's `id` (with `object: "response"`).
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    object: Option<String>,
}

impl Envelope {
    /// The Responses API response id the document names: a whole answer's `id`, or a
    /// `response.*` event's `response.id`.
    fn response_id(&mut self) -> Option<String> {
        match (self.object.as_deref(), self.kind.as_deref()) {
            (Some("response"), _) => self.id.take(),
            (_, Some(kind)) if kind.starts_with("response.") => {
                self.response.as_mut().and_then(|r| r.id.take())
            }
            _ => None,
        }
    }

    /// The usage the document reports, wherever its shape keeps it.
    fn usage(self) -> Option<UsageJson> {
        self.usage
            .or(self.response.and_then(|r| r.usage))
            .or(self.message.and_then(|m| m.usage))
    }
}

impl From<UsageJson> for Usage {
    fn from(u: UsageJson) -> Usage {
        let anthropic_cache =
            u.cache_read_input_tokens.is_some() || u.cache_creation_input_tokens.is_some();
        let cache_read = u.cache_read_input_tokens.unwrap_or(0);
        let prompt_tokens = match u.input_tokens {
            None => u.prompt_tokens,
            // Anthropic counts cached input apart from `input_tokens`.
            Some(input) if anthropic_cache => input
                .saturating_add(cache_read)
                .saturating_add(u.cache_creation_input_tokens.unwrap_or(0)),
            Some(input) => input,
        };
        let cached_tokens = u
            .prompt_tokens_details
            .or(u.input_tokens_details)
            .and_then(|d| d.cached_tokens)
            .or(u.cache_read_input_tokens);
        Usage {
            prompt_tokens,
            cached_tokens,
            completion_tokens: u.output_tokens.unwrap_or(u.completion_tokens),
        }
    }
}

impl Usage {
    /// `newer` over `self`, keeping what `newer` leaves out: Anthropic's `message_delta` may
    /// report only the output tokens, its `message_start` the input.
    fn merged(self, newer: Usage) -> Usage {
        Usage {
            prompt_tokens: match newer.prompt_tokens {
                0 => self.prompt_tokens,
                n => n,
            },
            cached_tokens: newer.cached_tokens.or(self.cached_tokens),
            completion_tokens: newer.completion_tokens,
        }
    }
}

/// The event types that end a Responses or Messages stream as `data: [DONE]` ends an OpenAI one.
const TERMINAL_EVENTS: [&str; 4] = [
    "response.completed",
    "response.incomplete",
    "response.failed",
    "message_stop",
];

/// A complete non-streamed JSON answer's usage: `Err` when the body is not one whole JSON object
/// (truncated or otherwise broken), `Ok(None)` when it is but reports no usage.
pub fn body_usage(body: &[u8]) -> Result<Option<Usage>, String> {
    body_report(body).map(|r| r.usage)
}

/// What a complete non-streamed JSON answer reports: its usage, and the id of the response it
/// is (a Responses API answer).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyReport {
    /// The usage, when reported.
    pub usage: Option<Usage>,
    /// A Responses API answer's `id`.
    pub response_id: Option<String>,
}

/// [`body_usage`] with the Responses API answer's id.
pub fn body_report(body: &[u8]) -> Result<BodyReport, String> {
    let mut envelope: Envelope = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let response_id = envelope.response_id();
    Ok(BodyReport {
        usage: envelope.usage().map(Usage::from),
        response_id,
    })
}

/// What to send the client for one chunk fed to [`StreamScanner::push`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Emit {
    /// The chunk as it came (the common case: no copy needed).
    Whole,
    /// The chunk's first `n` bytes (the rest is a partial event, held back).
    Prefix(usize),
    /// These bytes instead (held bytes joined, or an event taken out); may be empty.
    Bytes(Vec<u8>),
}

/// Reads usage from an SSE stream as it passes; see the module documentation.
#[derive(Debug, Default)]
pub struct StreamScanner {
    strip_usage_event: bool,
    /// A partial event held back (empty at an event boundary).
    held: Vec<u8>,
    /// Inside an event longer than [`MAX_HELD_BYTES`], being let through as it comes.
    passing_long_event: bool,
    /// The last two bytes let through while passing a long event (to find its end).
    tail: [u8; 2],
    usage: Option<Usage>,
    stripped: bool,
    done: bool,
    /// Events seen that carry an answer (neither `data: [DONE]` nor a usage-only event, a comment
    /// or an error).
    answer_events: u32,
    /// The backend's error event, when one came (everything from it on is taken out).
    error: Option<String>,
    /// Events other than comments seen, plus chunks of a long event let through: the backend's
    /// progress, which a keep-alive comment does not make.
    progress: u64,
    /// The Responses API response id the stream's terminal event named.
    response_id: Option<String>,
}

impl StreamScanner {
    /// A scanner; `strip_usage_event` when the client did not ask for the usage chunk.
    pub fn new(strip_usage_event: bool) -> StreamScanner {
        StreamScanner {
            strip_usage_event,
            ..StreamScanner::default()
        }
    }

    /// The last usage the stream reported.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// How many events carrying an answer passed (each of vLLM's holds one token; the first and
    /// last may hold none): what a stream cut before its usage event is charged by.
    pub fn answer_events(&self) -> u32 {
        self.answer_events
    }

    /// The id of the response a Responses API stream answered with (read from its
    /// `response.completed`, `response.incomplete` or `response.failed` event).
    pub fn response_id(&self) -> Option<&str> {
        self.response_id.as_deref()
    }

    /// Whether a usage event was taken out of the stream.
    pub fn stripped(&self) -> bool {
        self.stripped
    }

    /// Whether the stream so far is a complete stream: `data: [DONE]` seen (or a Responses or
    /// Messages stream's last event: `response.completed`, `response.incomplete`,
    /// `response.failed`, `message_stop`), no partial event pending and no error event. A backend
    /// stream that ends without this was cut short (or failed).
    pub fn complete(&self) -> bool {
        self.done && self.held.is_empty() && !self.passing_long_event && self.error.is_none()
    }

    /// The message of the error event the backend sent, if it sent one: its failure.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// The backend's progress so far: events other than comments, and chunks of a long event.
    /// A chunk that leaves it unchanged (a keep-alive comment) is not a sign of life from the
    /// engine.
    pub fn progress(&self) -> u64 {
        self.progress
    }

    /// Feeds one chunk; says what to send the client for it.
    pub fn push(&mut self, chunk: &[u8]) -> Emit {
        if self.error.is_some() {
            // After an error event nothing of this backend's reaches the client.
            return Emit::Bytes(Vec::new());
        }
        if self.passing_long_event {
            self.progress += 1;
            return self.push_long(chunk);
        }
        if self.held.is_empty() {
            // The common chunk: whole events, none of them usage, an error or the end. Nothing
            // to parse.
            let whole_events = chunk.ends_with(b"\n\n") || chunk.ends_with(b"\n\r\n");
            if whole_events
                && !contains(chunk, b"usage\"")
                && !contains(chunk, b"[DONE]")
                && !contains(chunk, b"\"error\"")
                && !contains(chunk, b"message_stop")
            {
                // Every event here that is not a comment carries an answer.
                let (answers, _comments) = event_ends(chunk);
                self.answer_events = self.answer_events.saturating_add(answers);
                self.progress += u64::from(answers);
                return Emit::Whole;
            }
            let (end, drop) = self.scan(chunk);
            if drop.is_empty() {
                if end == chunk.len() {
                    return Emit::Whole;
                }
                let n = end;
                return self.hold(&chunk[n..], Emit::Prefix(n), chunk);
            }
            let out = without(&chunk[..end], &drop);
            return self.hold(&chunk[end..], Emit::Bytes(out), chunk);
        }
        let mut joined = std::mem::take(&mut self.held);
        joined.extend_from_slice(chunk);
        let (end, drop) = self.scan(&joined);
        let out = without(&joined[..end], &drop);
        let rest = joined[end..].to_vec();
        self.hold(&rest, Emit::Bytes(out), &[])
    }

    /// The stream ended cleanly: the held partial event, if any, goes out as it is.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }

    /// The stream failed: drops the held partial event and says whether the client's stream is in
    /// the middle of an event (only after a long event was let through), in which case an error
    /// event must be preceded by a blank line.
    pub fn abandon(&mut self) -> bool {
        self.held.clear();
        self.passing_long_event
    }

    /// Keeps `rest` (a partial event) back; past the bound, lets it through instead.
    fn hold(&mut self, rest: &[u8], emit: Emit, chunk: &[u8]) -> Emit {
        if rest.len() <= MAX_HELD_BYTES {
            self.held.extend_from_slice(rest);
            return emit;
        }
        self.passing_long_event = true;
        self.answer_events = self.answer_events.saturating_add(1);
        self.progress += 1;
        self.tail = last_two(rest);
        match emit {
            Emit::Prefix(_) if !chunk.is_empty() => Emit::Whole,
            Emit::Prefix(_) | Emit::Whole => Emit::Bytes(rest.to_vec()),
            Emit::Bytes(mut out) => {
                out.extend_from_slice(rest);
                Emit::Bytes(out)
            }
        }
    }

    /// Inside a long event: everything up to its end goes out, then scanning resumes.
    fn push_long(&mut self, chunk: &[u8]) -> Emit {
        let mut context = [0u8; 2];
        context.copy_from_slice(&self.tail);
        match boundary_after(&context, chunk) {
            None => {
                let mut t = [self.tail[0], self.tail[1]];
                for &b in chunk {
                    t = [t[1], b];
                }
                self.tail = t;
                Emit::Whole
            }
            Some(end) => {
                self.passing_long_event = false;
                self.tail = [0, 0];
                let rest = &chunk[end..];
                if rest.is_empty() {
                    return Emit::Whole;
                }
                let mut out = chunk[..end].to_vec();
                match self.push(rest) {
                    Emit::Whole => return Emit::Whole,
                    Emit::Prefix(n) => out.extend_from_slice(&rest[..n]),
                    Emit::Bytes(b) => out.extend_from_slice(&b),
                }
                Emit::Bytes(out)
            }
        }
    }

    /// Finds the complete events in `bytes`: returns the end of the last one and the ranges of
    /// events to take out; records usage on the way.
    fn scan(&mut self, bytes: &[u8]) -> (usize, Vec<(usize, usize)>) {
        let mut drop = Vec::new();
        let mut start = 0;
        let mut end = 0;
        let mut i = 0;
        while let Some(off) = bytes[i..].iter().position(|&b| b == b'\n') {
            let lf = i + off;
            let after = match (bytes.get(lf + 1), bytes.get(lf + 2)) {
                (Some(b'\n'), _) => Some(lf + 2),
                (Some(b'\r'), Some(b'\n')) => Some(lf + 3),
                _ => None,
            };
            match after {
                Some(event_end) => {
                    if self.error.is_some() || self.event(&bytes[start..event_end]) {
                        drop.push((start, event_end));
                    }
                    start = event_end;
                    end = event_end;
                    i = event_end;
                }
                None => i = lf + 1,
            }
            if i >= bytes.len() {
                break;
            }
        }
        if self.error.is_some() && end < bytes.len() {
            // The partial event after an error is dropped too: nothing is held for it.
            drop.push((end, bytes.len()));
            end = bytes.len();
        }
        (end, drop)
    }

    /// Looks at one complete event; returns whether to take it out of the stream.
    fn event(&mut self, event: &[u8]) -> bool {
        if is_comment(event) {
            return false;
        }
        self.progress += 1;
        if event.starts_with(b"data: [DONE]") || event.starts_with(b"data:[DONE]") {
            self.done = true;
            return false;
        }
        if contains(event, b"\"error\"") {
            if let Some(message) = error_message(&event_data(event)) {
                self.error = Some(message);
                return true;
            }
        }
        if !contains(event, b"usage\"") && !contains(event, b"message_stop") {
            self.answer_events = self.answer_events.saturating_add(1);
            return false;
        }
        let data = event_data(event);
        let Ok(mut envelope) = serde_json::from_slice::<Envelope>(&data) else {
            self.answer_events = self.answer_events.saturating_add(1);
            return false;
        };
        let usage_only = envelope.choices.as_ref().is_some_and(|c| c.is_empty());
        if !usage_only {
            self.answer_events = self.answer_events.saturating_add(1);
        }
        if envelope
            .kind
            .as_deref()
            .is_some_and(|k| TERMINAL_EVENTS.contains(&k))
        {
            self.done = true;
            if let Some(id) = envelope.response_id() {
                self.response_id = Some(id);
            }
        }
        let Some(usage) = envelope.usage() else {
            return false;
        };
        let usage = Usage::from(usage);
        self.usage = Some(match self.usage {
            Some(before) => before.merged(usage),
            None => usage,
        });
        if self.strip_usage_event && usage_only {
            self.stripped = true;
            return true;
        }
        false
    }
}

/// How many events end in `chunk` (blank lines, `\n\n` or `\n\r\n`), for a chunk of whole events:
/// those that carry data, and those that are only comments.
fn event_ends(chunk: &[u8]) -> (u32, u32) {
    let (mut data, mut comments) = (0u32, 0u32);
    let (mut start, mut i) = (0, 0);
    while let Some(off) = chunk[i..].iter().position(|&b| b == b'\n') {
        let lf = i + off;
        let end = match (chunk.get(lf + 1), chunk.get(lf + 2)) {
            (Some(b'\n'), _) => Some(lf + 2),
            (Some(b'\r'), Some(b'\n')) => Some(lf + 3),
            _ => None,
        };
        match end {
            Some(end) => {
                if is_comment(&chunk[start..end]) {
                    comments += 1;
                } else {
                    data += 1;
                }
                start = end;
                i = end;
            }
            None => i = lf + 1,
        }
        if i >= chunk.len() {
            break;
        }
    }
    (data, comments)
}

/// Whether a chunk is only SSE comments and blank lines (vLLM's keep-alive): no sign of the
/// engine's progress. A chunk with anything else (a whole event or part of one) is.
pub fn is_keep_alive(chunk: &[u8]) -> bool {
    !chunk.is_empty() && is_comment(chunk)
}

/// Whether an event is only SSE comments (lines starting with `:`, such as vLLM's keep-alive)
/// and blank lines: no data, no token.
fn is_comment(event: &[u8]) -> bool {
    event
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .all(|l| l.is_empty() || l.starts_with(b":"))
}

/// The message of an error event's data (`{"error": {"message": ...}}`, vLLM's error in a
/// stream, or `{"error": "..."}`): `None` when the data is no error object. At most 512 bytes
/// of the message are kept, for the log.
fn error_message(data: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct ErrorEvent {
        #[serde(default)]
        error: Option<serde_json::Value>,
    }
    let event: ErrorEvent = serde_json::from_slice(data).ok()?;
    let message = match &event.error? {
        serde_json::Value::Object(e) => e
            .get("message")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("")
            .to_string(),
        serde_json::Value::String(s) => s.clone(),
        _ => return None,
    };
    let mut cut = message.len().min(512);
    while !message.is_char_boundary(cut) {
        cut -= 1;
    }
    Some(message[..cut].to_string())
}

/// Whether a partial line could be the start of an error event (`data: {"error"`).
fn may_be_error(line: &[u8]) -> bool {
    let compact: Vec<u8> = line.iter().copied().filter(|b| *b != b' ').collect();
    let want: &[u8] = b"data:{\"error\"";
    let n = compact.len().min(want.len());
    compact[..n] == want[..n]
}

/// What a stream's first chunk (or the first chunks read so far, joined) says of the answer,
/// before the client is sent anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FirstChunk {
    /// An answer begins: the first-byte check passes.
    Answer,
    /// Only keep-alive comments (or nothing whole yet): no first token yet, read on.
    NoTokenYet,
    /// The backend's first event is an error event (its message): the attempt failed, like a
    /// first byte that never came.
    Error(String),
}

/// Judges the first chunks of a stream: an error event before any answer fails the attempt, and
/// comments alone are no first token. A partial event counts as an answer beginning unless it
/// could still be an error event (`data: {"error"`), in which case more is read.
pub fn first_chunk(bytes: &[u8]) -> FirstChunk {
    let mut start = 0;
    let mut i = 0;
    while let Some(off) = bytes[i..].iter().position(|&b| b == b'\n') {
        let lf = i + off;
        let end = match (bytes.get(lf + 1), bytes.get(lf + 2)) {
            (Some(b'\n'), _) => Some(lf + 2),
            (Some(b'\r'), Some(b'\n')) => Some(lf + 3),
            _ => None,
        };
        match end {
            Some(end) => {
                let event = &bytes[start..end];
                if !is_comment(event) && !is_opening(event) {
                    return match error_message(&event_data(event)) {
                        Some(m) => FirstChunk::Error(m),
                        None => FirstChunk::Answer,
                    };
                }
                start = end;
                i = end;
            }
            None => i = lf + 1,
        }
        if i >= bytes.len() {
            break;
        }
    }
    let rest = &bytes[start..];
    let text = rest
        .split(|&b| b == b'\n')
        .find(|l| !l.is_empty() && !l.starts_with(b":") && l != b"\r");
    match text {
        None => FirstChunk::NoTokenYet,
        // A partial event that may be an error, or that opens a Responses or Messages stream:
        // wait for its end (bounded by the deadline and the held bytes).
        Some(l) if rest.len() <= MAX_HELD_BYTES && (may_be_error(l) || opening_name(l)) => {
            FirstChunk::NoTokenYet
        }
        Some(_) => FirstChunk::Answer,
    }
}

/// The events a Responses or Messages stream opens with before any output (vLLM sends them as
/// soon as the request is accepted, before its prefill): `response.created`,
/// `response.in_progress`, `response.queued`, `response.output_item.added`,
/// `response.content_part.added`; `message_start`, `content_block_start`, `ping`. Like a
/// comment they are no first token: the first token is the first event after them (a text or
/// arguments delta, or whatever else comes), so the first-token deadline, the retries before it
/// and the time to first token the pool learns from mean what they mean for chat.
const OPENING_EVENTS: [&str; 8] = [
    "response.created",
    "response.in_progress",
    "response.queued",
    "response.output_item.added",
    "response.content_part.added",
    "message_start",
    "content_block_start",
    "ping",
];

/// Whether a line is an `event:` line naming an opening event (see [`OPENING_EVENTS`]).
fn opening_name(line: &[u8]) -> bool {
    let Some(name) = line.strip_prefix(b"event:") else {
        return false;
    };
    let name = name.strip_suffix(b"\r").unwrap_or(name).trim_ascii();
    OPENING_EVENTS.iter().any(|e| e.as_bytes() == name)
}

/// Whether a whole event is an opening event, by its `event:` line or its data's `type`.
fn is_opening(event: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Typed<'a> {
        #[serde(default, borrow, rename = "type")]
        kind: Option<std::borrow::Cow<'a, str>>,
    }
    if event.split(|&b| b == b'\n').any(opening_name) {
        return true;
    }
    let data = event_data(event);
    let Ok(typed) = serde_json::from_slice::<Typed>(&data) else {
        return false;
    };
    typed
        .kind
        .is_some_and(|k| OPENING_EVENTS.contains(&k.as_ref()))
}

/// `bytes` without the given ranges (sorted, disjoint).
fn without(bytes: &[u8], drop: &[(usize, usize)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    for &(s, e) in drop {
        out.extend_from_slice(&bytes[at..s]);
        at = e;
    }
    out.extend_from_slice(&bytes[at.min(bytes.len())..]);
    out
}

fn last_two(bytes: &[u8]) -> [u8; 2] {
    match bytes {
        [.., a, b] => [*a, *b],
        [b] => [0, *b],
        [] => [0, 0],
    }
}

/// The end of the first blank line in `chunk`, given the two bytes before it.
fn boundary_after(context: &[u8; 2], chunk: &[u8]) -> Option<usize> {
    let at = |i: isize| -> Option<u8> {
        if i < 0 {
            context.get((2 + i) as usize).copied()
        } else {
            chunk.get(i as usize).copied()
        }
    };
    for i in 0..chunk.len() as isize {
        if at(i) != Some(b'\n') {
            continue;
        }
        if at(i - 1) == Some(b'\n') {
            return Some(i as usize + 1);
        }
        if at(i - 1) == Some(b'\r') && at(i - 2) == Some(b'\n') {
            return Some(i as usize + 1);
        }
    }
    None
}

/// Whether `hay` contains `needle`, anchored on the needle's first byte (cheap for JSON keys).
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    let Some(&first) = needle.first() else {
        return true;
    };
    let mut i = 0;
    while let Some(p) = hay[i..].iter().position(|&b| b == first) {
        if hay[i + p..].starts_with(needle) {
            return true;
        }
        i += p + 1;
    }
    false
}

/// The event's `data:` lines, joined by newlines (the SSE rule).
fn event_data(event: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            if !data.is_empty() {
                data.push(b'\n');
            }
            data.extend_from_slice(rest.strip_prefix(b" ").unwrap_or(rest));
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
    const USAGE: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"total_tokens\":15,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    /// Feeds `chunks` and returns what the client received.
    fn run(s: &mut StreamScanner, chunks: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for c in chunks {
            match s.push(c) {
                Emit::Whole => out.extend_from_slice(c),
                Emit::Prefix(n) => out.extend_from_slice(&c[..n]),
                Emit::Bytes(b) => out.extend_from_slice(&b),
            }
        }
        out.extend_from_slice(&s.finish());
        out
    }

    fn expected_usage() -> Option<Usage> {
        Some(Usage {
            prompt_tokens: 12,
            cached_tokens: Some(8),
            completion_tokens: 3,
        })
    }

    #[test]
    fn whole_events_pass_untouched_and_usage_is_read() {
        let mut s = StreamScanner::new(false);
        assert_eq!(s.push(TOKEN.as_bytes()), Emit::Whole);
        assert_eq!(s.push(USAGE.as_bytes()), Emit::Whole);
        assert_eq!(s.push(DONE.as_bytes()), Emit::Whole);
        assert_eq!(s.usage(), expected_usage());
        assert!(!s.stripped());
        assert!(s.complete());
    }

    #[test]
    fn a_stream_without_done_or_with_a_partial_event_is_incomplete() {
        let mut s = StreamScanner::new(false);
        s.push(TOKEN.as_bytes());
        assert!(!s.complete(), "no [DONE] yet");
        s.push(&DONE.as_bytes()[..5]);
        assert!(!s.complete(), "[DONE] not finished");
        s.push(&DONE.as_bytes()[5..]);
        assert!(s.complete());
    }

    #[test]
    fn the_usage_event_is_taken_out_when_the_client_did_not_ask() {
        let all = format!("{TOKEN}{TOKEN}{USAGE}{DONE}");
        let mut s = StreamScanner::new(true);
        let out = run(&mut s, &[all.as_bytes()]);
        assert_eq!(out, format!("{TOKEN}{TOKEN}{DONE}").as_bytes());
        assert_eq!(s.usage(), expected_usage());
        assert!(s.stripped());
    }

    #[test]
    fn every_split_gives_the_same_stream_and_usage() {
        let all = format!("{TOKEN}{TOKEN}{USAGE}{DONE}");
        let bytes = all.as_bytes();
        for strip in [false, true] {
            let want = if strip {
                format!("{TOKEN}{TOKEN}{DONE}")
            } else {
                all.clone()
            };
            for a in 0..bytes.len() {
                for b in a..bytes.len() {
                    let mut s = StreamScanner::new(strip);
                    let out = run(&mut s, &[&bytes[..a], &bytes[a..b], &bytes[b..]]);
                    assert_eq!(out, want.as_bytes(), "split at {a}, {b}");
                    assert_eq!(s.usage(), expected_usage(), "split at {a}, {b}");
                }
            }
        }
    }

    #[test]
    fn crlf_events_are_understood() {
        let usage = USAGE.replace('\n', "\r\n");
        let token = TOKEN.replace('\n', "\r\n");
        let mut s = StreamScanner::new(true);
        let out = run(&mut s, &[token.as_bytes(), usage.as_bytes()]);
        assert_eq!(out, token.as_bytes());
        assert_eq!(s.usage(), expected_usage());
    }

    #[test]
    fn a_partial_event_is_held_and_dropped_on_failure() {
        let mut s = StreamScanner::new(false);
        let half = &TOKEN.as_bytes()[..40];
        let chunk = [TOKEN.as_bytes(), half].concat();
        assert_eq!(s.push(&chunk), Emit::Prefix(TOKEN.len()));
        assert!(!s.abandon(), "the client saw only whole events");
        assert!(s.finish().is_empty());
    }

    #[test]
    fn continuous_usage_keeps_the_last_figure_and_strips_nothing_with_choices() {
        let with = |n: u32| {
            format!("data: {{\"choices\":[{{\"index\":0}}],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{n}}}}}\n\n")
        };
        let mut s = StreamScanner::new(true);
        let all = format!("{}{}", with(1), with(2));
        assert_eq!(run(&mut s, &[all.as_bytes()]), all.as_bytes());
        assert_eq!(
            s.usage(),
            Some(Usage {
                prompt_tokens: 5,
                cached_tokens: None,
                completion_tokens: 2
            })
        );
    }

    #[test]
    fn a_long_event_streams_through_and_scanning_resumes_after_it() {
        let long = format!(
            "data: {{\"x\":\"{}\"}}\n\n",
            "a".repeat(MAX_HELD_BYTES + 10)
        );
        let bytes = long.as_bytes();
        let mut s = StreamScanner::new(true);
        let mid = MAX_HELD_BYTES + 5;
        let tail = [&bytes[mid..], USAGE.as_bytes(), DONE.as_bytes()].concat();
        let out = run(&mut s, &[&bytes[..mid], &tail]);
        assert_eq!(out, [bytes, DONE.as_bytes()].concat());
        assert_eq!(s.usage(), expected_usage());
        // Failing inside a long event needs a blank line before the error event.
        let mut s = StreamScanner::new(false);
        s.push(&bytes[..mid]);
        assert!(s.abandon());
    }

    #[test]
    fn bodies_must_be_whole_json() {
        let body = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":3,"prompt_tokens_details":null}}"#;
        assert_eq!(
            body_usage(body),
            Ok(Some(Usage {
                prompt_tokens: 12,
                cached_tokens: None,
                completion_tokens: 3
            }))
        );
        assert!(body_usage(&body[..body.len() - 5]).is_err());
        assert_eq!(body_usage(b"{\"data\":[]}"), Ok(None));
        assert!(body_usage(b"").is_err());
    }

    #[test]
    fn malformed_usage_events_pass_and_count_nothing() {
        let bad = "data: {\"usage\": oops}\n\n";
        let mut s = StreamScanner::new(true);
        assert_eq!(run(&mut s, &[bad.as_bytes()]), bad.as_bytes());
        assert_eq!(s.usage(), None);
    }

    const ERROR: &str = "data: {\"error\": {\"message\": \"KV load failed\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\n";
    const KEEP_ALIVE: &str = ": keep-alive\n\n";

    #[test]
    fn an_error_event_fails_the_stream_and_nothing_after_it_reaches_the_client() {
        let all = format!("{TOKEN}{TOKEN}{ERROR}{DONE}");
        let bytes = all.as_bytes();
        for a in 0..bytes.len() {
            let mut s = StreamScanner::new(true);
            let out = run(&mut s, &[&bytes[..a], &bytes[a..]]);
            assert_eq!(out, format!("{TOKEN}{TOKEN}").as_bytes(), "split at {a}");
            assert_eq!(s.error(), Some("KV load failed"), "split at {a}");
            assert!(!s.complete(), "[DONE] after an error is no success");
            assert_eq!(s.answer_events(), 2, "the error is no output");
        }
        // As the first event, too.
        let mut s = StreamScanner::new(false);
        let first = format!("{ERROR}{DONE}");
        assert!(run(&mut s, &[first.as_bytes()]).is_empty());
        assert!(!s.complete());
        // A chunk whose finish_reason is "error", or a content mentioning errors, is an answer.
        let text = TOKEN.replace("\"hi\"", "\"the \\\"error\\\" was\"");
        let reason = TOKEN.replace("}}]}", "},\"finish_reason\":\"error\"}]}");
        let mut s = StreamScanner::new(false);
        let ok = format!("{text}{reason}{DONE}");
        assert_eq!(run(&mut s, &[ok.as_bytes()]), ok.as_bytes());
        assert!(s.complete() && s.error().is_none());
    }

    #[test]
    fn keep_alive_comments_pass_but_are_no_token_and_no_progress() {
        let mut s = StreamScanner::new(false);
        assert_eq!(s.push(KEEP_ALIVE.as_bytes()), Emit::Whole);
        assert_eq!((s.answer_events(), s.progress()), (0, 0));
        let mixed = format!("{KEEP_ALIVE}{TOKEN}{KEEP_ALIVE}");
        assert_eq!(s.push(mixed.as_bytes()), Emit::Whole);
        assert_eq!((s.answer_events(), s.progress()), (1, 1));
        // Through the slow path (a usage event in the same chunk) too.
        let slow = format!("{KEEP_ALIVE}{USAGE}{DONE}");
        s.push(slow.as_bytes());
        assert_eq!(s.answer_events(), 1);
        assert_eq!(s.progress(), 3);
        assert!(s.complete());
        assert!(is_keep_alive(KEEP_ALIVE.as_bytes()));
        assert!(
            !is_keep_alive(&TOKEN.as_bytes()[..10]),
            "part of an event is progress"
        );
        assert!(!is_keep_alive(mixed.as_bytes()));
    }

    #[test]
    fn the_first_chunk_check_reads_past_comments_and_fails_on_an_error() {
        assert_eq!(first_chunk(TOKEN.as_bytes()), FirstChunk::Answer);
        assert_eq!(first_chunk(KEEP_ALIVE.as_bytes()), FirstChunk::NoTokenYet);
        assert_eq!(first_chunk(b""), FirstChunk::NoTokenYet);
        assert_eq!(
            first_chunk(format!("{KEEP_ALIVE}{ERROR}{DONE}").as_bytes()),
            FirstChunk::Error("KV load failed".into())
        );
        assert_eq!(
            first_chunk(format!("{KEEP_ALIVE}{TOKEN}").as_bytes()),
            FirstChunk::Answer
        );
        // A partial event: an error's beginning waits for its end, a token's is an answer.
        assert_eq!(first_chunk(&ERROR.as_bytes()[..20]), FirstChunk::NoTokenYet);
        assert_eq!(first_chunk(&ERROR.as_bytes()[..8]), FirstChunk::NoTokenYet);
        assert_eq!(first_chunk(&TOKEN.as_bytes()[..30]), FirstChunk::Answer);
    }

    #[test]
    fn the_opening_events_of_responses_and_messages_are_no_first_token() {
        let created = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\"},\"sequence_number\":0}\n\n";
        let in_progress = "event: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"sequence_number\":1}\n\n";
        let added = "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\"}\n\nevent: response.content_part.added\ndata: {\"type\":\"response.content_part.added\"}\n\n";
        let delta = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\" the\"}\n\n";
        let opening = format!("{created}{in_progress}{added}");
        assert_eq!(first_chunk(opening.as_bytes()), FirstChunk::NoTokenYet);
        assert_eq!(
            first_chunk(format!("{opening}{delta}").as_bytes()),
            FirstChunk::Answer
        );
        // Part of an opening event waits for the rest; part of a delta is an answer.
        assert_eq!(
            first_chunk(&created.as_bytes()[..40]),
            FirstChunk::NoTokenYet
        );
        assert_eq!(first_chunk(&delta.as_bytes()[..40]), FirstChunk::Answer);
        // Without `event:` lines, the data's type says it.
        assert_eq!(
            first_chunk(b"data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":4}}}\n\n"),
            FirstChunk::NoTokenYet
        );
        let start = "event: message_start\ndata: {\"type\":\"message_start\"}\n\nevent: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0}\n\nevent: ping\ndata: {\"type\":\"ping\"}\n\n";
        assert_eq!(first_chunk(start.as_bytes()), FirstChunk::NoTokenYet);
        let text = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n";
        assert_eq!(
            first_chunk(format!("{start}{text}").as_bytes()),
            FirstChunk::Answer
        );
        // An error after the opening fails the attempt as before.
        let error = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"boom\"}}\n\n";
        assert_eq!(
            first_chunk(format!("{start}{error}").as_bytes()),
            FirstChunk::Error("boom".into())
        );
        // Chat's chunks are untouched.
        assert_eq!(first_chunk(TOKEN.as_bytes()), FirstChunk::Answer);
    }

    #[test]
    fn answer_events_are_counted_whatever_the_chunking() {
        let stream = format!("{TOKEN}{TOKEN}{TOKEN}{USAGE}{DONE}");
        // Whole, then split at every byte, then in chunks of 7 bytes: the same three answer
        // events each time (the usage-only event and [DONE] carry no answer).
        let mut whole = StreamScanner::new(true);
        run(&mut whole, &[stream.as_bytes()]);
        assert_eq!(whole.answer_events(), 3);
        let bytes: Vec<&[u8]> = stream.as_bytes().chunks(1).collect();
        let mut split = StreamScanner::new(true);
        run(&mut split, &bytes);
        assert_eq!(split.answer_events(), 3);
        let sevens: Vec<&[u8]> = stream.as_bytes().chunks(7).collect();
        let mut seven = StreamScanner::new(false);
        run(&mut seven, &sevens);
        assert_eq!(seven.answer_events(), 3);
        // A stream cut after two tokens, before any usage: two answer events, no usage.
        let mut cut = StreamScanner::new(true);
        run(&mut cut, &[TOKEN.as_bytes(), TOKEN.as_bytes()]);
        assert_eq!((cut.answer_events(), cut.usage()), (2, None));
        // Per-token usage (`continuous_usage_stats`): each event carries an answer and usage.
        let continuous = TOKEN.replace(
            "}]}",
            "}],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}",
        );
        let mut c = StreamScanner::new(false);
        run(&mut c, &[continuous.as_bytes(), continuous.as_bytes()]);
        assert_eq!(c.answer_events(), 2);
    }

    #[test]
    fn a_responses_stream_reports_usage_on_response_completed_and_ends_there() {
        let created = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"usage\":null},\"sequence_number\":0}\n\n";
        let delta = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\",\"sequence_number\":1}\n\n";
        let done = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"usage\":{\"input_tokens\":40,\"input_tokens_details\":{\"cached_tokens\":32},\"output_tokens\":5,\"total_tokens\":45}},\"sequence_number\":2}\n\n";
        let mut s = StreamScanner::new(false);
        let out = run(&mut s, &[created.as_bytes(), delta.as_bytes()]);
        assert!(!s.complete());
        assert_eq!(s.usage(), None);
        let out2 = run(&mut s, &[done.as_bytes()]);
        assert!(s.complete());
        assert_eq!(
            out.len() + out2.len(),
            created.len() + delta.len() + done.len()
        );
        let usage = s.usage().unwrap();
        assert_eq!(
            (
                usage.prompt_tokens,
                usage.cached_tokens,
                usage.completion_tokens
            ),
            (40, Some(32), 5)
        );
        // The stored response's id, for the pool's record of its holder.
        assert_eq!(s.response_id(), Some("resp_1"));
        let mut chat = StreamScanner::new(false);
        run(&mut chat, &[b"data: {\"id\":\"chatcmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n"]);
        assert_eq!(chat.response_id(), None);
    }

    #[test]
    fn a_messages_stream_adds_message_start_and_message_delta() {
        let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":50,\"output_tokens\":0}}}\n\n";
        let delta = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n";
        let end = "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":7}}\n\n";
        let stop = "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let mut s = StreamScanner::new(false);
        run(
            &mut s,
            &[start.as_bytes(), delta.as_bytes(), end.as_bytes()],
        );
        assert!(!s.complete());
        run(&mut s, &[stop.as_bytes()]);
        assert!(s.complete());
        assert_eq!(
            s.usage(),
            Some(Usage {
                prompt_tokens: 50,
                cached_tokens: None,
                completion_tokens: 7
            })
        );
        // vLLM's final usage counts the cache apart, as Anthropic does: the prompt is the sum.
        let vllm_end = "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":10,\"output_tokens\":3,\"cache_read_input_tokens\":40}}\n\n";
        let mut s = StreamScanner::new(false);
        run(&mut s, &[start.as_bytes(), vllm_end.as_bytes()]);
        assert_eq!(
            s.usage(),
            Some(Usage {
                prompt_tokens: 50,
                cached_tokens: Some(40),
                completion_tokens: 3
            })
        );
    }

    #[test]
    fn whole_responses_and_messages_bodies_report_usage() {
        let responses = br#"{"id":"resp_1","object":"response","output":[],"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":0},"output_tokens":4,"total_tokens":16}}"#;
        let u = body_usage(responses).unwrap().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (12, 4));
        assert_eq!(
            body_report(responses).unwrap().response_id.as_deref(),
            Some("resp_1")
        );
        let messages = br#"{"id":"msg_1","type":"message","content":[],"usage":{"input_tokens":2,"output_tokens":9,"cache_read_input_tokens":16}}"#;
        assert_eq!(body_report(messages).unwrap().response_id, None);
        let chat = br#"{"id":"chatcmpl-1","object":"chat.completion","choices":[]}"#;
        assert_eq!(body_report(chat).unwrap().response_id, None);
        let u = body_usage(messages).unwrap().unwrap();
        assert_eq!(
            (u.prompt_tokens, u.cached_tokens, u.completion_tokens),
            (18, Some(16), 9)
        );
    }
}
