//! Fault injection: the ways a real vLLM server misbehaves, switchable from flags and at run time.
//!
//! `GET /sim/faults` returns the current [`FaultSettings`]; `POST /sim/faults` with a JSON
//! [`FaultUpdate`] *replaces* them (omitted fields take their no-fault defaults, so `{}` or
//! `{"reset": true}` clears everything), may start a loading phase (`loading_s`) and may crash the
//! process (`crash`). Faults apply to the generation endpoints (`/v1/chat/completions`,
//! `/v1/completions`, `/v1/embeddings`); `health_fail` and loading apply to `/health` (loading to all
//! of `/v1` too). Fault timings are wall-clock and **not** divided by `--time-scale`: they model the
//! network and the process, not the GPU.
//!
//! Three faults model a backend that answers something other than vLLM's answer: `poison_marker`
//! (a request whose body contains the marker gets vLLM's 500, on every server with the fault set:
//! a request-specific engine error), `login_page` (every request but `/sim/*` gets a 200
//! `text/html` login page, as from a proxy in front of the server) and `redirect_to` (every
//! request but `/sim/*` gets a 307 to that URL); and `route_not_found` makes the generation
//! endpoints answer a plain 404, as a server without the route does (`tokenize_not_found`: `/tokenize`
//! and `/detokenize` do). See [`FaultSettings::front_door`] and
//! [`FaultSettings::poisons`]. `request_id_linger_ms` refuses a second request with an
//! `X-Request-Id` still taken (vLLM's 400 "already running"), as vLLM before PR #27987 does while
//! an aborted request's abort has not reached its engine.
//!
//! Each request draws exactly three numbers from one generator seeded by `--seed` (hang, 429, error, in
//! that order), whatever the rates, so a run is reproducible; rates 0.0 and 1.0 are exact.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::sampler::SplitMix64;

/// Current fault settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultSettings {
    /// Fraction of requests answered with `error_status` instead of being served.
    pub error_rate: f64,
    /// Status of injected errors (500 to 599; 500 and 503 are the usual ones).
    pub error_status: u16,
    /// Fraction of requests answered `429 Too Many Requests` (with `Retry-After: 1`). No vLLM
    /// release sends 429 by itself (its load shedding is a 503, see `--max-num-queued-reqs`): this
    /// is a rate-limiting proxy in front of the server.
    pub rate_limit_rate: f64,
    /// Fraction of requests that hang before the first byte (no headers, ever, until the client
    /// gives up; the server drops them after an hour).
    pub hang_rate: f64,
    /// Delay before the first byte (the response headers) of every request, in milliseconds.
    pub first_byte_delay_ms: u64,
    /// Drop the connection after this many output tokens: mid-stream for streams, instead of the
    /// response for non-streamed requests.
    pub disconnect_after_tokens: Option<u32>,
    /// Stop generating after this many output tokens and go silent with the connection open (an
    /// engine hang): streams have sent that many tokens, non-streamed requests never answer. The
    /// sequence keeps its slot and its KV blocks until the client goes away. Requests that finish
    /// within that many tokens are unaffected.
    pub stall_after_tokens: Option<u32>,
    /// Non-streamed generation answers send their 200 headers (with the full `content-length`) and
    /// about half of the body, then the connection closes.
    pub truncate_body: bool,
    /// Streams only: after this many output tokens, send the first half of the next event (no
    /// terminating blank line) and close the connection.
    pub disconnect_mid_event_after_tokens: Option<u32>,
    /// `/health` answers 503.
    pub health_fail: bool,
    /// Streams only: the whole stream goes out, `data: [DONE]` included, and then the connection
    /// is reset instead of closed cleanly (no terminating chunk): a server or proxy that dies
    /// right after the end.
    pub reset_after_done: bool,
    /// Generation requests whose raw body contains this text get vLLM's 500 (a request-specific
    /// engine error), whatever the other faults say.
    pub poison_marker: Option<String>,
    /// Every request but `/sim/*` gets a 200 `text/html` login page.
    pub login_page: bool,
    /// Every request but `/sim/*` gets a 307 redirect to this URL (`Location`).
    pub redirect_to: Option<String>,
    /// Generation endpoints answer 404 `{"detail":"Not Found"}`, as a server without the route
    /// does (a backend registered with a wrong base URL): not vLLM's model-not-found answer.
    pub route_not_found: bool,
    /// `/tokenize` and `/detokenize` answer 404 `{"detail":"Not Found"}`: a server (or a proxy in
    /// front of it) that does not expose them, though vLLM 0.34 serves them with every model.
    pub tokenize_not_found: bool,
    /// A generation request's `X-Request-Id` stays taken this long after it arrived (0: off),
    /// and a second request with the same id meanwhile gets vLLM's 400 "Request id ... already
    /// running". vLLM uses the header as its engine's request id and, from about 0.6.5 until a
    /// random suffix was added (vllm-project/vllm PR #27987, November 2025), refuses an id it
    /// still tracks; a request whose client left stays tracked until the abort reaches the
    /// engine, which behind a proxy or across a WAN can be late. Only the id is modelled: the
    /// first request runs as usual.
    pub request_id_linger_ms: u64,
    /// After this many output tokens (0: before any), a stream sends vLLM's error event
    /// `data: {"error": {"message": "Internal server error", "type": "InternalServerError",
    /// "param": null, "code": 500}}` then `data: [DONE]` (a `GenerationError` inside vLLM 0.34's
    /// stream generator: `finish_reason == "error"`, e.g. a KV load failure); a non-streamed
    /// request that reaches that many tokens gets vLLM's 500 with the same error body.
    pub stream_error_after_tokens: Option<u32>,
    /// While loading, answer `/health` and `/v1/*` with 503 instead of refusing connections:
    /// the sim's behaviour before it followed vLLM 0.34, whose socket is bound but not
    /// listening until the engine is up (so connections are refused).
    pub loading_answers_503: bool,
}

impl Default for FaultSettings {
    fn default() -> Self {
        FaultSettings {
            error_rate: 0.0,
            error_status: 500,
            rate_limit_rate: 0.0,
            hang_rate: 0.0,
            first_byte_delay_ms: 0,
            disconnect_after_tokens: None,
            stall_after_tokens: None,
            truncate_body: false,
            disconnect_mid_event_after_tokens: None,
            health_fail: false,
            reset_after_done: false,
            poison_marker: None,
            login_page: false,
            redirect_to: None,
            route_not_found: false,
            tokenize_not_found: false,
            request_id_linger_ms: 0,
            stream_error_after_tokens: None,
            loading_answers_503: false,
        }
    }
}

/// The body of `POST /sim/faults`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultUpdate {
    /// See [`FaultSettings::error_rate`].
    pub error_rate: Option<f64>,
    /// See [`FaultSettings::error_status`].
    pub error_status: Option<u16>,
    /// See [`FaultSettings::rate_limit_rate`].
    pub rate_limit_rate: Option<f64>,
    /// See [`FaultSettings::hang_rate`].
    pub hang_rate: Option<f64>,
    /// See [`FaultSettings::first_byte_delay_ms`].
    pub first_byte_delay_ms: Option<u64>,
    /// See [`FaultSettings::disconnect_after_tokens`].
    pub disconnect_after_tokens: Option<u32>,
    /// See [`FaultSettings::stall_after_tokens`].
    pub stall_after_tokens: Option<u32>,
    /// See [`FaultSettings::truncate_body`].
    pub truncate_body: Option<bool>,
    /// See [`FaultSettings::disconnect_mid_event_after_tokens`].
    pub disconnect_mid_event_after_tokens: Option<u32>,
    /// See [`FaultSettings::health_fail`].
    pub health_fail: Option<bool>,
    /// See [`FaultSettings::reset_after_done`].
    pub reset_after_done: Option<bool>,
    /// See [`FaultSettings::poison_marker`].
    pub poison_marker: Option<String>,
    /// See [`FaultSettings::login_page`].
    pub login_page: Option<bool>,
    /// See [`FaultSettings::redirect_to`].
    pub redirect_to: Option<String>,
    /// See [`FaultSettings::route_not_found`].
    pub route_not_found: Option<bool>,
    /// See [`FaultSettings::tokenize_not_found`].
    pub tokenize_not_found: Option<bool>,
    /// See [`FaultSettings::request_id_linger_ms`].
    pub request_id_linger_ms: Option<u64>,
    /// See [`FaultSettings::stream_error_after_tokens`].
    pub stream_error_after_tokens: Option<u32>,
    /// See [`FaultSettings::loading_answers_503`].
    pub loading_answers_503: Option<bool>,
    /// Start a loading phase of this many seconds now: the listener closes and connections are
    /// refused meanwhile (or `/health` and `/v1/*` answer 503 with `loading_answers_503`).
    pub loading_s: Option<f64>,
    /// Exit the process right after answering.
    pub crash: bool,
    /// Clear every fault (the same as sending `{}`).
    pub reset: bool,
}

/// Why fault settings were refused.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultError {
    /// A rate outside `[0, 1]`.
    Rate(&'static str, f64),
    /// An error status outside 500..=599.
    Status(u16),
    /// A negative or non-finite loading time.
    Loading(f64),
    /// A poison marker that is empty or longer than 256 bytes.
    Marker,
    /// A redirect target that is not an `http://` or `https://` URL.
    RedirectTarget(String),
}

impl std::fmt::Display for FaultError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FaultError::Rate(name, v) => write!(f, "{name} must be between 0 and 1, got {v}"),
            FaultError::Status(s) => write!(f, "error_status must be a 5xx status, got {s}"),
            FaultError::Loading(s) => write!(f, "loading_s must be a non-negative number, got {s}"),
            FaultError::Marker => f.write_str("poison_marker must be 1 to 256 bytes"),
            FaultError::RedirectTarget(u) => {
                write!(
                    f,
                    "redirect_to must be an http:// or https:// URL, got {u:?}"
                )
            }
        }
    }
}

impl FaultUpdate {
    /// The settings this update asks for (everything omitted is off).
    pub fn settings(&self) -> Result<FaultSettings, FaultError> {
        if self.reset {
            return Ok(FaultSettings::default());
        }
        let defaults = FaultSettings::default();
        let settings = FaultSettings {
            error_rate: self.error_rate.unwrap_or(defaults.error_rate),
            error_status: self.error_status.unwrap_or(defaults.error_status),
            rate_limit_rate: self.rate_limit_rate.unwrap_or(defaults.rate_limit_rate),
            hang_rate: self.hang_rate.unwrap_or(defaults.hang_rate),
            first_byte_delay_ms: self.first_byte_delay_ms.unwrap_or(0),
            disconnect_after_tokens: self.disconnect_after_tokens,
            stall_after_tokens: self.stall_after_tokens,
            truncate_body: self.truncate_body.unwrap_or(false),
            disconnect_mid_event_after_tokens: self.disconnect_mid_event_after_tokens,
            health_fail: self.health_fail.unwrap_or(false),
            reset_after_done: self.reset_after_done.unwrap_or(false),
            poison_marker: self.poison_marker.clone(),
            login_page: self.login_page.unwrap_or(false),
            redirect_to: self.redirect_to.clone(),
            route_not_found: self.route_not_found.unwrap_or(false),
            tokenize_not_found: self.tokenize_not_found.unwrap_or(false),
            request_id_linger_ms: self.request_id_linger_ms.unwrap_or(0),
            stream_error_after_tokens: self.stream_error_after_tokens,
            loading_answers_503: self.loading_answers_503.unwrap_or(false),
        };
        settings.validate()?;
        if let Some(s) = self.loading_s {
            if !s.is_finite() || s < 0.0 {
                return Err(FaultError::Loading(s));
            }
        }
        Ok(settings)
    }
}

impl FaultSettings {
    /// Checks rates and the error status.
    pub fn validate(&self) -> Result<(), FaultError> {
        for (name, rate) in [
            ("error_rate", self.error_rate),
            ("rate_limit_rate", self.rate_limit_rate),
            ("hang_rate", self.hang_rate),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(FaultError::Rate(name, rate));
            }
        }
        if !(500..=599).contains(&self.error_status) {
            return Err(FaultError::Status(self.error_status));
        }
        if let Some(m) = &self.poison_marker {
            if m.is_empty() || m.len() > 256 {
                return Err(FaultError::Marker);
            }
        }
        if let Some(u) = &self.redirect_to {
            let scheme_ok = u.starts_with("http://") || u.starts_with("https://");
            if !scheme_ok || u.chars().any(|c| c.is_control() || c == ' ') {
                return Err(FaultError::RedirectTarget(u.clone()));
            }
        }
        Ok(())
    }

    /// What stands in front of the server for every request but `/sim/*`, if anything: a redirect
    /// (it wins over a login page when both are set) or a login page.
    pub fn front_door(&self) -> Option<FrontDoor> {
        match (&self.redirect_to, self.login_page) {
            (Some(url), _) => Some(FrontDoor::Redirect(url.clone())),
            (None, true) => Some(FrontDoor::LoginPage),
            (None, false) => None,
        }
    }

    /// Whether a generation request with this raw body gets the poison 500.
    pub fn poisons(&self, body: &[u8]) -> bool {
        let Some(marker) = self.poison_marker.as_deref().map(str::as_bytes) else {
            return false;
        };
        !marker.is_empty() && body.windows(marker.len()).any(|w| w == marker)
    }

    /// What happens to one generation request, drawing three numbers from `rng`.
    pub fn decide(&self, rng: &mut SplitMix64) -> FaultDecision {
        let hang = rng.next_unit() < self.hang_rate;
        let rate_limited = rng.next_unit() < self.rate_limit_rate;
        let error = rng.next_unit() < self.error_rate;
        let reject = if hang {
            None
        } else if rate_limited {
            Some(429)
        } else if error {
            Some(self.error_status)
        } else {
            None
        };
        FaultDecision {
            hang,
            reject,
            first_byte_delay: Duration::from_millis(self.first_byte_delay_ms),
            disconnect_after_tokens: self.disconnect_after_tokens,
            stall_after_tokens: self.stall_after_tokens,
            truncate_body: self.truncate_body,
            disconnect_mid_event_after_tokens: self.disconnect_mid_event_after_tokens,
            reset_after_done: self.reset_after_done,
            stream_error_after_tokens: self.stream_error_after_tokens,
        }
    }
}

/// The faults applied to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultDecision {
    /// Never answer.
    pub hang: bool,
    /// Answer with this status instead of serving.
    pub reject: Option<u16>,
    /// Wait this long before the first byte.
    pub first_byte_delay: Duration,
    /// Drop the connection after this many output tokens.
    pub disconnect_after_tokens: Option<u32>,
    /// Stop generating after this many output tokens, keeping the connection and the slot.
    pub stall_after_tokens: Option<u32>,
    /// Cut a non-streamed 200 answer's body in half.
    pub truncate_body: bool,
    /// Cut a stream in the middle of the event after this many output tokens.
    pub disconnect_mid_event_after_tokens: Option<u32>,
    /// Reset a whole stream's connection after its `data: [DONE]`.
    pub reset_after_done: bool,
    /// End with vLLM's in-stream error (or its 500) after this many output tokens.
    pub stream_error_after_tokens: Option<u32>,
}

impl FaultDecision {
    /// Where a stream is cut, if it is: the earlier of the two disconnect faults (the mid-event one
    /// when both name the same token).
    pub fn stream_cut(&self) -> Option<StreamCutAt> {
        let clean = self.disconnect_after_tokens.map(|after| StreamCutAt {
            after,
            mid_event: false,
        });
        let partial = self
            .disconnect_mid_event_after_tokens
            .map(|after| StreamCutAt {
                after,
                mid_event: true,
            });
        match (clean, partial) {
            (Some(c), Some(p)) => Some(if p.after <= c.after { p } else { c }),
            (c, p) => p.or(c),
        }
    }
}

impl FaultDecision {
    /// Whether a stream that ends normally (`data: [DONE]` sent) is then reset rather than closed,
    /// unless a cut ends it first.
    pub fn resets_after_done(&self) -> bool {
        self.reset_after_done
    }
}

/// What answers instead of the server (see [`FaultSettings::front_door`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrontDoor {
    /// A 200 `text/html` login page.
    LoginPage,
    /// A 307 to this URL.
    Redirect(String),
}

/// The body of the [`FrontDoor::LoginPage`] answer.
pub const LOGIN_PAGE_HTML: &str = "<!doctype html>\n<html><head><title>Sign in</title></head>\n<body><form method=\"post\" action=\"/login\"><input name=\"user\"><input name=\"password\" type=\"password\"><button>Sign in</button></form></body></html>\n";

/// Where and how a stream is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamCutAt {
    /// After this many output tokens.
    pub after: u32,
    /// Whether half of one more event is written before the cut.
    pub mid_event: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(json: &str) -> Result<FaultSettings, FaultError> {
        serde_json::from_str::<FaultUpdate>(json)
            .expect("parses")
            .settings()
    }

    #[test]
    fn empty_and_reset_updates_clear_everything() {
        assert_eq!(update("{}").unwrap(), FaultSettings::default());
        assert_eq!(
            update(r#"{"reset":true,"error_rate":1}"#).unwrap(),
            FaultSettings::default()
        );
    }

    #[test]
    fn rejects_out_of_range_values_and_unknown_fields() {
        assert_eq!(
            update(r#"{"error_rate":1.5}"#),
            Err(FaultError::Rate("error_rate", 1.5))
        );
        assert_eq!(
            update(r#"{"error_status":404}"#),
            Err(FaultError::Status(404))
        );
        assert_eq!(
            update(r#"{"loading_s":-1}"#),
            Err(FaultError::Loading(-1.0))
        );
        assert!(serde_json::from_str::<FaultUpdate>(r#"{"eror_rate":1}"#).is_err());
    }

    #[test]
    fn rates_one_and_zero_are_exact() {
        let mut rng = SplitMix64::new(1);
        let always = update(r#"{"error_rate":1,"error_status":503}"#).unwrap();
        let never = FaultSettings::default();
        for _ in 0..1000 {
            assert_eq!(always.decide(&mut rng).reject, Some(503));
            assert_eq!(never.decide(&mut rng).reject, None);
        }
        let limited = update(r#"{"rate_limit_rate":1,"error_rate":1}"#).unwrap();
        assert_eq!(limited.decide(&mut rng).reject, Some(429));
        let hang = update(r#"{"hang_rate":1,"error_rate":1}"#)
            .unwrap()
            .decide(&mut rng);
        assert!(hang.hang);
        assert_eq!(hang.reject, None);
    }

    #[test]
    fn fractional_rates_are_reproducible_from_the_seed() {
        let half = update(r#"{"error_rate":0.5}"#).unwrap();
        let draws = |seed| {
            let mut rng = SplitMix64::new(seed);
            (0..200)
                .map(|_| half.decide(&mut rng).reject.is_some())
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(9), draws(9));
        let errors = draws(9).iter().filter(|e| **e).count();
        assert!((70..130).contains(&errors), "{errors}");
    }

    #[test]
    fn passes_delays_and_disconnects_through() {
        let s = update(r#"{"first_byte_delay_ms":250,"disconnect_after_tokens":3}"#).unwrap();
        let d = s.decide(&mut SplitMix64::new(0));
        assert_eq!(d.first_byte_delay, Duration::from_millis(250));
        assert_eq!(d.disconnect_after_tokens, Some(3));
        assert!(!d.hang);
        assert_eq!(d.stall_after_tokens, None);
        assert!(!d.truncate_body);
    }

    #[test]
    fn passes_stalls_truncation_and_mid_event_cuts_through() {
        let s = update(
            r#"{"stall_after_tokens":4,"truncate_body":true,"disconnect_mid_event_after_tokens":2}"#,
        )
        .unwrap();
        let d = s.decide(&mut SplitMix64::new(0));
        assert_eq!(d.stall_after_tokens, Some(4));
        assert!(d.truncate_body);
        assert_eq!(
            d.stream_cut(),
            Some(StreamCutAt {
                after: 2,
                mid_event: true
            })
        );
        assert_eq!(
            update("{}")
                .unwrap()
                .decide(&mut SplitMix64::new(0))
                .stream_cut(),
            None
        );
    }

    #[test]
    fn passes_a_reset_after_done_through() {
        let d = update(r#"{"reset_after_done":true}"#)
            .unwrap()
            .decide(&mut SplitMix64::new(0));
        assert!(d.resets_after_done());
        assert_eq!(d.stream_cut(), None);
        assert!(!update("{}")
            .unwrap()
            .decide(&mut SplitMix64::new(0))
            .resets_after_done());
    }

    #[test]
    fn poison_markers_login_pages_and_redirects_are_checked_and_applied() {
        let s = update(r#"{"poison_marker":"POISON-1"}"#).unwrap();
        assert!(s.poisons(br#"{"prompt":"a POISON-1 b"}"#));
        assert!(!s.poisons(br#"{"prompt":"a POISON-2 b"}"#));
        assert!(!FaultSettings::default().poisons(b"POISON-1"));
        assert_eq!(s.front_door(), None);
        let login = update(r#"{"login_page":true}"#).unwrap();
        assert_eq!(login.front_door(), Some(FrontDoor::LoginPage));
        let both = update(r#"{"login_page":true,"redirect_to":"http://127.0.0.1:9/x"}"#).unwrap();
        assert_eq!(
            both.front_door(),
            Some(FrontDoor::Redirect("http://127.0.0.1:9/x".into()))
        );
        assert_eq!(update(r#"{"poison_marker":""}"#), Err(FaultError::Marker));
        assert!(matches!(
            update(r#"{"redirect_to":"ftp://x"}"#),
            Err(FaultError::RedirectTarget(_))
        ));
        assert_eq!(
            update(r#"{"reset":true,"login_page":true}"#).unwrap(),
            FaultSettings::default()
        );
    }

    #[test]
    fn stream_errors_and_loading_503_are_settable_and_cleared() {
        let s = update(r#"{"stream_error_after_tokens":0,"loading_answers_503":true}"#).unwrap();
        assert_eq!(s.stream_error_after_tokens, Some(0));
        assert!(s.loading_answers_503);
        assert_eq!(
            s.decide(&mut SplitMix64::new(0)).stream_error_after_tokens,
            Some(0)
        );
        assert_eq!(update("{}").unwrap().stream_error_after_tokens, None);
        assert!(!update("{}").unwrap().loading_answers_503);
    }

    #[test]
    fn the_earlier_stream_cut_wins() {
        let cut = |json: &str| {
            update(json)
                .unwrap()
                .decide(&mut SplitMix64::new(0))
                .stream_cut()
        };
        assert_eq!(
            cut(r#"{"disconnect_after_tokens":1,"disconnect_mid_event_after_tokens":2}"#),
            Some(StreamCutAt {
                after: 1,
                mid_event: false
            })
        );
        assert_eq!(
            cut(r#"{"disconnect_after_tokens":2,"disconnect_mid_event_after_tokens":2}"#),
            Some(StreamCutAt {
                after: 2,
                mid_event: true
            })
        );
        assert_eq!(
            cut(r#"{"disconnect_after_tokens":0}"#),
            Some(StreamCutAt {
                after: 0,
                mid_event: false
            })
        );
    }
}
