//! Driving a workload against an endpoint: open-loop Poisson arrivals or closed-loop concurrency,
//! bounded by a request count (the plan) and a wall-clock limit.
//!
//! - **Open loop** (`rate`): sessions start at the arrivals of a Poisson process of `rate` per second,
//!   whatever the server does; a conversation's next turn is due `sessions / rate` seconds after its
//!   previous one was sent (or as soon as the answer arrives, if later), so the offered load stays
//!   near `rate` as in vLLM production-stack's multi-round QA benchmark. With `random_turn_gaps`
//!   each spacing is drawn uniformly within +-25% of that mean (seeded per session), so the turns of
//!   many users do not come round in the same order every round (with a fixed spacing and a user count
//!   that is a multiple of the fleet size, round robin would send each user to the same backend
//!   every turn and look cache-aware).
//! - **Closed loop** (`concurrency`): that many clients each take the next session and send its
//!   turns one after the other, each as soon as the previous answer arrived (after an optional think
//!   time), then take the next session.
//!
//! - **Replay** (`speedup`): each session (a trace's request) is sent at its trace arrival time
//!   divided by the speed-up, whatever the server does.
//!
//! The arrival times come from the seed (or the trace), so two runs offer the same load at the
//! same moments.

use crate::api::Api;
use crate::client::{EngineSplit, Http, RouteReceipt, StreamResult};
use crate::plan::Plan;
use crate::rng::Rng;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How load is offered.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Load {
    /// Open loop: Poisson arrivals, requests per second.
    Rate(f64),
    /// Closed loop: clients each with one request in flight.
    Concurrency(usize),
    /// Open loop at a trace's own arrival times ([`Plan::trace_ms`]), this many times faster.
    Replay(f64),
}

/// Where requests go.
#[derive(Debug, Clone)]
pub struct Target {
    /// Request URLs (the API's path, e.g. `/v1/chat/completions`), used in turn (one: the
    /// gateway; several: direct to backends).
    pub urls: Vec<String>,
    /// The API the requests are sent through (the URLs' path must be its [`Api::path`]).
    pub api: Api,
    /// The `model` field.
    pub model: String,
    /// Extra headers on every request.
    pub headers: Vec<(String, String)>,
}

/// Limits of one run.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// No request is sent after this long.
    pub max_duration: Duration,
    /// A request still running after this long counts as an error.
    pub request_timeout: Duration,
    /// Closed loop: a client's pause between an answer and the conversation's next turn.
    pub think: Duration,
    /// Open loop: draw each conversation's turn spacing uniformly within +-25% of its mean
    /// (`sessions / rate`) instead of using the mean as a fixed spacing. (Not exponential: its long
    /// tail would leave a few conversations running alone long after the others.)
    pub random_turn_gaps: bool,
}

/// One request's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Session index in the plan.
    pub session: usize,
    /// Turn within the session.
    pub turn: usize,
    /// Seconds from the start of the run to the send.
    pub sent_s: f64,
    /// HTTP status (0: none).
    pub status: u16,
    /// Error text, if it failed.
    pub error: Option<String>,
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// End-to-end latency, ms.
    pub e2e_ms: f64,
    /// Output tokens received.
    pub output_tokens: u32,
    /// Prompt tokens (usage).
    pub prompt_tokens: Option<u32>,
    /// Cached prompt tokens (usage).
    pub cached_tokens: Option<u32>,
    /// Backend that served it (`x-gateway-backend`, or `direct-N`).
    pub backend: Option<String>,
    /// `x-gateway-decision`.
    pub decision: Option<String>,
    /// `server-timing`: where the gateway's time to first byte went (routing, upstream).
    pub server_timing: Option<String>,
    /// The engine's own time to first token (vllm-sim `--report-engine-timing`), ms.
    pub engine_ttft_ms: Option<f64>,
    /// `x-gateway-predicted-ttft-ms`: the time model's prediction for the chosen backend.
    pub predicted_ttft_ms: Option<f64>,
    /// Where the engine's time to first token went (vllm-sim `--report-engine-timing`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_split: Option<EngineSplit>,
    /// The engine's own arrival-to-last-token time (vllm-sim `--report-engine-timing`), ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_e2e_ms: Option<f64>,
    /// After its first token, the share of the steps it decoded in that went to other prompts'
    /// prefill (vllm-sim `--report-engine-timing`), ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_decode_stall_ms: Option<f64>,
    /// `x-gateway-route-receipt`: the predictions for the chosen backend and the runner-up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route_receipt: Option<RouteReceipt>,
    /// `x-gateway-ahead`: `kept`, `missed` or `queued` when a fetch went ahead of the lease call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ahead: Option<String>,
}

/// Writes records as JSON lines (`loadgen run --records`, and every bench run's records in its
/// tmp dir, for looking into a run afterwards).
pub fn write_records(path: &std::path::Path, records: &[Record]) -> Result<(), String> {
    let lines: Vec<String> = records
        .iter()
        .filter_map(|r| serde_json::to_string(r).ok())
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").map_err(|e| format!("{}: {e}", path.display()))
}

impl Record {
    /// Time per output token after the first, ms.
    pub fn tpot_ms(&self) -> Option<f64> {
        let ttft = self.ttft_ms?;
        (self.output_tokens > 1 && self.error.is_none())
            .then(|| (self.e2e_ms - ttft) / f64::from(self.output_tokens - 1))
    }
}

/// The request body of one turn in `api`'s shape.
pub fn api_body(
    api: Api,
    model: &str,
    plan: &Plan,
    session: usize,
    turn: usize,
    answers: &[String],
) -> Bytes {
    let body = api.body(model, &plan.sessions[session], turn, answers);
    Bytes::from(serde_json::to_vec(&body).expect("a JSON value serialises"))
}

/// Start offsets of `n` sessions under open-loop `rate`.
pub fn arrivals(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    let mut rng = Rng::new(seed, 0x6172_7269);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            t += rng.exponential(1.0 / rate.max(1e-9));
            t
        })
        .collect()
}

struct Shared {
    http: Http,
    target: Target,
    plan: Plan,
    limits: Limits,
    start: Instant,
    next_url: AtomicUsize,
    records: Mutex<Vec<Record>>,
}

impl Shared {
    fn expired(&self) -> bool {
        self.start.elapsed() >= self.limits.max_duration
    }

    async fn send(&self, session: usize, turn: usize, answers: &[String]) -> StreamResult {
        let i = self.next_url.fetch_add(1, Ordering::Relaxed) % self.target.urls.len();
        let api = self.target.api;
        let mut headers = self.target.headers.clone();
        headers.extend(api.headers());
        if let Some(user) = &self.plan.sessions[session].user_id {
            headers.push(("x-user-id".into(), user.clone()));
        }
        let body = api_body(api, &self.target.model, &self.plan, session, turn, answers);
        let sent_s = self.start.elapsed().as_secs_f64();
        let mut r = self
            .http
            .stream_api(
                api,
                &self.target.urls[i],
                body,
                &headers,
                self.limits.request_timeout,
            )
            .await;
        if r.backend.is_none() && self.target.urls.len() > 1 && r.status != 0 {
            r.backend = Some(format!("direct-{i}"));
        }
        self.records.lock().expect("records lock").push(Record {
            session,
            turn,
            sent_s,
            status: r.status,
            error: r.error.clone(),
            ttft_ms: r.ttft.map(|d| d.as_secs_f64() * 1e3),
            e2e_ms: r.e2e.as_secs_f64() * 1e3,
            output_tokens: r.output_tokens,
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens,
            backend: r.backend.clone(),
            decision: r.decision.clone(),
            server_timing: r.server_timing.clone(),
            engine_ttft_ms: r.engine_ttft_ms,
            predicted_ttft_ms: r.predicted_ttft_ms,
            engine_split: r.engine_split,
            engine_e2e_ms: r.engine_e2e_ms,
            engine_decode_stall_ms: r.engine_decode_stall_ms,
            route_receipt: r.route_receipt.clone(),
            ahead: r.ahead.clone(),
        });
        r
    }

    /// Sends a session's turns; `gap` is the open-loop spacing of its turns (zero: back to back),
    /// drawn anew for each turn from `gaps` if given; `think` the pause after each answer.
    async fn session(&self, session: usize, gap: Duration, mut gaps: Option<Rng>, think: Duration) {
        let turns = self.plan.sessions[session].turns.len();
        let mut answers: Vec<String> = Vec::with_capacity(turns);
        for turn in 0..turns {
            if self.expired() {
                return;
            }
            let gap = match gaps.as_mut() {
                Some(rng) => gap.mul_f64(0.75 + 0.5 * rng.next_f64()),
                None => gap,
            };
            let due = Instant::now() + gap;
            let r = self.send(session, turn, &answers).await;
            if !r.ok() {
                return; // a conversation cannot go on without its answer
            }
            answers.push(r.text);
            if turn + 1 < turns {
                tokio::time::sleep_until(due.into()).await;
                if !think.is_zero() {
                    tokio::time::sleep(think).await;
                }
            }
        }
    }
}

/// Runs `plan` against `target`; returns every request's record (sorted by send time) and the
/// wall-clock duration of the run.
pub async fn drive(
    http: Http,
    target: Target,
    plan: Plan,
    load: Load,
    seed: u64,
    limits: Limits,
) -> (Vec<Record>, f64) {
    let shared = Arc::new(Shared {
        http,
        target,
        plan,
        limits,
        start: Instant::now(),
        next_url: AtomicUsize::new(0),
        records: Mutex::new(Vec::new()),
    });
    let n = shared.plan.sessions.len();
    let mut tasks = Vec::new();
    match load {
        Load::Rate(rate) => {
            let gap = Duration::from_secs_f64(n as f64 / rate.max(1e-9));
            for (i, at) in arrivals(n, rate, seed).into_iter().enumerate() {
                let s = shared.clone();
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until((s.start + Duration::from_secs_f64(at)).into()).await;
                    let gaps = s
                        .limits
                        .random_turn_gaps
                        .then(|| Rng::new(seed ^ i as u64, 0x6761_7073));
                    s.session(i, gap, gaps, Duration::ZERO).await;
                }));
            }
        }
        Load::Replay(speedup) => {
            let speedup = speedup.max(1e-9);
            for (i, &at_ms) in shared.plan.trace_ms.iter().enumerate().take(n) {
                let s = shared.clone();
                tasks.push(tokio::spawn(async move {
                    let at = Duration::from_secs_f64(at_ms.max(0.0) / 1e3 / speedup);
                    tokio::time::sleep_until((s.start + at).into()).await;
                    s.session(i, Duration::ZERO, None, Duration::ZERO).await;
                }));
            }
        }
        Load::Concurrency(c) => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..c.max(1) {
                let (s, next) = (shared.clone(), next.clone());
                tasks.push(tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n || s.expired() {
                            break;
                        }
                        s.session(i, Duration::ZERO, None, s.limits.think).await;
                    }
                }));
            }
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = shared.start.elapsed().as_secs_f64();
    let mut records = std::mem::take(&mut *shared.records.lock().expect("records lock"));
    records.sort_by(|a, b| a.sent_s.total_cmp(&b.sent_s));
    (records, elapsed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Workload;

    #[test]
    fn arrivals_are_seeded_and_at_the_rate() {
        let a = arrivals(5000, 50.0, 1);
        assert_eq!(a, arrivals(5000, 50.0, 1));
        assert_ne!(a, arrivals(5000, 50.0, 2));
        let rate = 5000.0 / a[4999];
        assert!((rate - 50.0).abs() < 2.5, "{rate}");
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn bodies_ask_for_exact_streamed_lengths() {
        let plan = Workload::NoSharing {
            requests: 1,
            prompt_tokens: 3,
            output_tokens: 7,
        }
        .generate(1);
        let v: serde_json::Value =
            serde_json::from_slice(&api_body(Api::Chat, "m", &plan, 0, 0, &[])).unwrap();
        assert_eq!(v["max_tokens"], 7);
        assert_eq!(v["ignore_eos"], true);
        assert_eq!(v["stream"], true);
        assert_eq!(v["messages"][0]["role"], "user");
    }
}
