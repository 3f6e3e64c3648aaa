//! How a request ended, as the Worker reports it when it releases a lease.
//!
//! The [`OutcomeKind`] decides who is to blame: only server errors, timeouts and transport errors
//! count against a backend's circuit breaker. A 4xx is the client's fault, a client disconnect is
//! nobody's, and a 429 means "busy", which marks the backend saturated for a moment instead.
//!
//! A backend's error answer before any byte reached the client is judged by [`judge_answer`] from
//! its status and body, because vLLM says different things with the same status: a 503 with its
//! load-shedding body (`--max-num-queued-reqs` / `--max-num-queued-tokens`: type `Service
//! Unavailable`) is load, like a 429, not a failure; a 404 with its model-not-found body is a
//! model the backend no longer serves; a 404 with FastAPI's `{"detail":"Not Found"}` is a route
//! the server did not register for its model's task (embeddings on a chat model): an answer
//! about the model, not a failure of the backend.

use crate::request::prompt::RequestFeatures;
use serde::{Deserialize, Serialize};

/// The class of a request's ending.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeKind {
    /// 2xx/3xx: the backend answered.
    #[default]
    Success,
    /// 4xx other than 429: the client's fault; never counts against the backend.
    ClientError,
    /// 5xx: counts against the backend.
    ServerError,
    /// No first byte (or no completion) in time: counts against the backend.
    Timeout,
    /// Connection refused, reset, TLS or DNS failure: counts against the backend.
    Transport,
    /// 429: the backend is saturated; it is avoided for a short while, the breaker is untouched.
    RateLimited,
    /// The client went away; nobody's fault.
    Cancelled,
}

impl OutcomeKind {
    /// Every kind, in a stable order (for metrics).
    pub const ALL: [OutcomeKind; 7] = [
        OutcomeKind::Success,
        OutcomeKind::ClientError,
        OutcomeKind::ServerError,
        OutcomeKind::Timeout,
        OutcomeKind::Transport,
        OutcomeKind::RateLimited,
        OutcomeKind::Cancelled,
    ];

    /// The kind's name as used in JSON and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeKind::Success => "success",
            OutcomeKind::ClientError => "client_error",
            OutcomeKind::ServerError => "server_error",
            OutcomeKind::Timeout => "timeout",
            OutcomeKind::Transport => "transport",
            OutcomeKind::RateLimited => "rate_limited",
            OutcomeKind::Cancelled => "cancelled",
        }
    }

    /// Position in [`OutcomeKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether the backend answered successfully.
    pub fn is_success(self) -> bool {
        self == OutcomeKind::Success
    }

    /// Whether this outcome is the backend's fault (opens breakers).
    pub fn is_backend_failure(self) -> bool {
        matches!(
            self,
            OutcomeKind::ServerError | OutcomeKind::Timeout | OutcomeKind::Transport
        )
    }

    /// Classifies an HTTP status from the backend.
    pub fn from_status(status: u16) -> OutcomeKind {
        match status {
            429 => OutcomeKind::RateLimited,
            // 408 from a server means it timed out waiting for us; 499 is nginx's client-closed.
            499 => OutcomeKind::Cancelled,
            400..=499 => OutcomeKind::ClientError,
            500..=599 => OutcomeKind::ServerError,
            100..=399 => OutcomeKind::Success,
            _ => OutcomeKind::ServerError,
        }
    }
}

/// What the Worker knows about a finished request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Outcome {
    /// The backend's HTTP status, when it answered.
    pub status: Option<u16>,
    /// The class of ending; see [`Outcome::from_status`] to derive it from a status.
    pub kind: OutcomeKind,
    /// Time to first byte of the response body, in milliseconds.
    pub ttfb_ms: Option<u64>,
    /// Prompt tokens the backend reported (`usage.prompt_tokens`, cached ones included).
    pub prompt_tokens: Option<u32>,
    /// Of those, tokens served from its prefix cache (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: Option<u32>,
    /// Completion tokens the backend reported or the Worker counted.
    pub completion_tokens: Option<u32>,
    /// Set on a streamed request's share when a stream failed after its first byte (counted in
    /// `llm_gateway_stream_resumes_total`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resume: Option<StreamResume>,
    /// A stream the client held up: it stopped reading until the relay filled, so the backend
    /// was paused; its timing says nothing about the engine's decode speed.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub held_by_client: bool,
    /// The Worker found the failure to be the request's, not a backend's: the same 5xx class
    /// came back from a second backend for it. No breaker is charged for it, and the pool
    /// withdraws the charge it deferred for the first backend's 5xx.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub request_fault: bool,
    /// The response the backend stored (a Responses API request with `store`): the pool records
    /// that the backend holds it (`crate::pool::responses`). Boxed: most outcomes have none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stored_response: Option<Box<StoredResponse>>,
}

/// A response a backend stored, as the Worker reports it with the release.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The response id the backend answered with.
    pub id: String,
    /// The hash of the client key that made it (`None` on a gateway without client keys): only
    /// that key may follow it up or retrieve it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

impl StoredResponse {
    /// The response a backend answered with `id` for a request with these features, when the
    /// request stores its response: owned by the request's client.
    pub fn answered(features: &RequestFeatures, id: Option<String>) -> Option<Box<StoredResponse>> {
        id.filter(|_| features.stores_response).map(|id| {
            Box::new(StoredResponse {
                id,
                owner: features.owner.clone(),
            })
        })
    }
}

/// What became of a stream that failed after its first byte, as told with the share it concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamResume {
    /// This share served the continuation of a stream another backend failed; the outcome's
    /// kind says how the continuation ended.
    Continuation,
    /// The stream failed on this share and the request rules a resumption out.
    NotResumable,
    /// The stream failed on this share and could have been resumed, but no backend, retry budget
    /// or resumption (`MAX_STREAM_RESUMES`) was left.
    NotResumed,
}

impl StreamResume {
    /// The `outcome` label of `llm_gateway_stream_resumes_total` for a share ending with `kind`.
    pub fn label(self, kind: OutcomeKind) -> &'static str {
        match self {
            StreamResume::Continuation => kind.as_str(),
            StreamResume::NotResumable => "not_resumable",
            StreamResume::NotResumed => "not_resumed",
        }
    }

    /// Every label, in a stable order: the kinds of a continuation, then the two others.
    pub const LABELS: [&'static str; 9] = [
        "success",
        "client_error",
        "server_error",
        "timeout",
        "transport",
        "rate_limited",
        "cancelled",
        "not_resumable",
        "not_resumed",
    ];

    /// Position of [`StreamResume::label`] in [`StreamResume::LABELS`].
    pub fn index(self, kind: OutcomeKind) -> usize {
        match self {
            StreamResume::Continuation => kind.index(),
            StreamResume::NotResumable => 7,
            StreamResume::NotResumed => 8,
        }
    }
}

/// What a backend's error answer (before the first byte reached the client) means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerVerdict {
    /// The backend's failure (a 5xx, a 3xx, a 401/403 for the gateway's key, a 404 that is no
    /// answer vLLM gives): charged to its breaker, retried elsewhere.
    Backend,
    /// Load: a 429, or vLLM's 503 load shedding. No breaker charge; the backend is avoided for a
    /// moment and the next one tried.
    Load {
        /// vLLM's 503 load shedding (counted as shed), not a 429.
        shed: bool,
    },
    /// vLLM's 404 "model does not exist": the backend does not serve the model (any more).
    ModelNotFound,
    /// A 404 from the server's router (FastAPI's `{"detail":"Not Found"}`): the backend's model
    /// does not serve the endpoint (its task has no such route). No breaker charge.
    EndpointNotServed,
    /// Any other 4xx: the request's, passed on to the client.
    Client,
}

/// Judges a backend's non-2xx answer from its status and (the start of) its body.
pub fn judge_answer(status: u16, body: &[u8]) -> AnswerVerdict {
    match status {
        429 => AnswerVerdict::Load { shed: false },
        503 if is_load_shedding(body) => AnswerVerdict::Load { shed: true },
        404 if is_model_not_found(body) => AnswerVerdict::ModelNotFound,
        404 if is_route_not_found(body) => AnswerVerdict::EndpointNotServed,
        401 | 403 | 404 => AnswerVerdict::Backend,
        400..=499 => AnswerVerdict::Client,
        _ => AnswerVerdict::Backend,
    }
}

/// The error object of an OpenAI-style body: nested under `error`, or (older vLLM) the body.
fn error_object(body: &[u8]) -> Option<serde_json::Map<String, serde_json::Value>> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let serde_json::Value::Object(mut top) = v else {
        return None;
    };
    match top.remove("error") {
        Some(serde_json::Value::Object(inner)) => Some(inner),
        _ => Some(top),
    }
}

fn text_field<'a>(obj: &'a serde_json::Map<String, serde_json::Value>, key: &str) -> &'a str {
    obj.get(key)
        .and_then(serde_json::Value::as_str)
        .unwrap_or("")
}

/// Whether a 503 body is vLLM's load shedding (`QueueOverflowError`, `MaxQueuedTokensError`,
/// `vllm/exceptions.py` 0.34): an OpenAI error of type `Service Unavailable` (exactly: other
/// 503s, such as a server error of type `ServiceUnavailableError`, are failures), or one of
/// their two messages.
pub fn is_load_shedding(body: &[u8]) -> bool {
    let Some(e) = error_object(body) else {
        return false;
    };
    let message = text_field(&e, "message").to_ascii_lowercase();
    text_field(&e, "type").eq_ignore_ascii_case("Service Unavailable")
        || message.contains("cannot accept new requests")
        || message.contains("prefill token backlog limit")
}

/// Whether a 404 body is vLLM's "model does not exist" answer: an OpenAI-style error (nested
/// under `error` or, in older vLLM, at the top) of type `NotFoundError` or whose message says
/// the model does not exist. A bare `{"detail":"Not Found"}` (no such route) is not.
pub fn is_model_not_found(body: &[u8]) -> bool {
    let Some(e) = error_object(body) else {
        return false;
    };
    let message = text_field(&e, "message");
    text_field(&e, "type") == "NotFoundError"
        || (message.contains("model") && message.contains("does not exist"))
}

/// Whether a 404 body is FastAPI's answer for a route the server did not register
/// (`{"detail":"Not Found"}`): vLLM registers only the routes of its model's task.
pub fn is_route_not_found(body: &[u8]) -> bool {
    let Ok(serde_json::Value::Object(v)) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    v.len() == 1 && v.get("detail").and_then(serde_json::Value::as_str) == Some("Not Found")
}

impl Outcome {
    /// Whether this is vLLM's load shedding: a 503 judged as load (see [`judge_answer`]).
    pub fn is_load_shed(&self) -> bool {
        self.kind == OutcomeKind::RateLimited && self.status == Some(503)
    }

    /// An outcome classified from an HTTP status, with no timing or token figures.
    pub fn from_status(status: u16) -> Outcome {
        Outcome {
            status: Some(status),
            kind: OutcomeKind::from_status(status),
            ..Outcome::default()
        }
    }

    /// Whether this is a backend's 5xx answer: a failure that may be the request's own (vLLM
    /// answers 500 for a request-specific engine error), so its breaker charge waits until the
    /// request shows whether another backend fails it too.
    pub fn is_suspect_5xx(&self) -> bool {
        self.kind == OutcomeKind::ServerError
            && self.status.is_some_and(|s| (500..=599).contains(&s))
    }

    /// An outcome of the given kind with no status, timing or token figures.
    pub fn of_kind(kind: OutcomeKind) -> Outcome {
        Outcome {
            kind,
            ..Outcome::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        assert_eq!(OutcomeKind::from_status(200), OutcomeKind::Success);
        assert_eq!(OutcomeKind::from_status(404), OutcomeKind::ClientError);
        assert_eq!(OutcomeKind::from_status(429), OutcomeKind::RateLimited);
        assert_eq!(OutcomeKind::from_status(503), OutcomeKind::ServerError);
        assert_eq!(OutcomeKind::from_status(499), OutcomeKind::Cancelled);
        assert_eq!(OutcomeKind::from_status(0), OutcomeKind::ServerError);
    }

    #[test]
    fn only_server_side_failures_blame_the_backend() {
        let blamed: Vec<_> = OutcomeKind::ALL
            .iter()
            .filter(|k| k.is_backend_failure())
            .collect();
        assert_eq!(
            blamed,
            [
                &OutcomeKind::ServerError,
                &OutcomeKind::Timeout,
                &OutcomeKind::Transport
            ]
        );
        for (i, k) in OutcomeKind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i);
        }
    }

    #[test]
    fn resume_labels_line_up_with_their_index() {
        for kind in OutcomeKind::ALL {
            let c = StreamResume::Continuation;
            assert_eq!(StreamResume::LABELS[c.index(kind)], c.label(kind));
        }
        for r in [StreamResume::NotResumable, StreamResume::NotResumed] {
            let kind = OutcomeKind::Transport;
            assert_eq!(StreamResume::LABELS[r.index(kind)], r.label(kind));
        }
        let o: Outcome =
            serde_json::from_str(r#"{"kind":"success","resume":"continuation"}"#).unwrap();
        assert_eq!(o.resume, Some(StreamResume::Continuation));
        let plain = serde_json::to_string(&Outcome::default()).unwrap();
        assert!(!plain.contains("resume"), "{plain}");
    }

    #[test]
    fn only_answered_5xx_are_suspects_and_request_faults_round_trip() {
        assert!(Outcome::from_status(500).is_suspect_5xx());
        assert!(Outcome::from_status(503).is_suspect_5xx());
        assert!(!Outcome::of_kind(OutcomeKind::ServerError).is_suspect_5xx());
        let rewritten = Outcome {
            kind: OutcomeKind::ServerError,
            ..Outcome::from_status(403)
        };
        assert!(
            !rewritten.is_suspect_5xx(),
            "a rejected key is the backend's"
        );
        let plain = serde_json::to_string(&Outcome::from_status(500)).unwrap();
        assert!(!plain.contains("request_fault"), "{plain}");
        let o: Outcome =
            serde_json::from_str(r#"{"kind":"server_error","status":500,"request_fault":true}"#)
                .unwrap();
        assert!(o.request_fault);
    }

    #[test]
    fn vllm_error_answers_are_judged_by_status_and_body() {
        let busy = br#"{"error":{"message":"The engine is currently busy and cannot accept new requests. Please try again later or on a different instance.","type":"Service Unavailable","param":null,"code":503}}"#;
        assert_eq!(judge_answer(503, busy), AnswerVerdict::Load { shed: true });
        let tokens = br#"{"error":{"message":"The engine has reached its prefill token backlog limit. Please try again later or on a different instance.","type":"Service Unavailable","param":null,"code":503}}"#;
        assert_eq!(
            judge_answer(503, tokens),
            AnswerVerdict::Load { shed: true }
        );
        assert_eq!(judge_answer(503, b"upstream down"), AnswerVerdict::Backend);
        let failing = br#"{"error":{"message":"Simulated server error","type":"ServiceUnavailableError","code":503}}"#;
        assert_eq!(judge_answer(503, failing), AnswerVerdict::Backend);
        assert_eq!(
            judge_answer(
                503,
                br#"{"error":{"message":"boom","type":"InternalServerError"}}"#
            ),
            AnswerVerdict::Backend
        );
        assert_eq!(judge_answer(429, b""), AnswerVerdict::Load { shed: false });
        let gone = br#"{"error":{"message":"The model `m` does not exist.","type":"NotFoundError","param":"model","code":404}}"#;
        assert_eq!(judge_answer(404, gone), AnswerVerdict::ModelNotFound);
        assert_eq!(
            judge_answer(404, br#"{"detail":"Not Found"}"#),
            AnswerVerdict::EndpointNotServed
        );
        assert_eq!(
            judge_answer(404, b"<html>nginx</html>"),
            AnswerVerdict::Backend
        );
        assert_eq!(judge_answer(403, b""), AnswerVerdict::Backend);
        assert_eq!(judge_answer(400, b"{}"), AnswerVerdict::Client);
        assert_eq!(judge_answer(500, b"{}"), AnswerVerdict::Backend);
        let shed = Outcome {
            kind: OutcomeKind::RateLimited,
            ..Outcome::from_status(503)
        };
        assert!(shed.is_load_shed() && !shed.is_suspect_5xx());
        assert!(!Outcome::from_status(429).is_load_shed());
    }

    #[test]
    fn outcome_json_is_snake_case_and_partial() {
        let o: Outcome = serde_json::from_str(r#"{"kind":"rate_limited"}"#).unwrap();
        assert_eq!(o.kind, OutcomeKind::RateLimited);
        assert_eq!(o.status, None);
    }
}
