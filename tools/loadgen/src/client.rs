//! The HTTP side: one keep-alive HTTP/1.1 client, a streamed chat completion (or Responses /
//! Messages request, whose events [`crate::api`] reads) timed token by token, and the small JSON
//! calls the harness makes (admin API, `/metrics`).
//!
//! Time to first token is measured to the first server-sent event that carries output text (the
//! opening `{"role": "assistant", "content": ""}` delta does not count), so it includes queueing and
//! prefill but not an early empty chunk.

use crate::api::{read_messages_event, read_responses_event, Api, EventOutcome};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use std::time::{Duration, Instant};

/// How long an idle pooled connection is kept for reuse: under the 5 s after which workerd (the
/// local gateway's runtime: KJ's HTTP server, whose idle "pipeline" timeout is fixed at 5 s and not
/// configurable) closes an idle keep-alive connection without warning. A client that keeps idle
/// connections longer (aiohttp's default is 15 s) sometimes sends a request on a connection the
/// server is closing at that moment and gets "server disconnected" / a reset; the more connections
/// a burst opened (the longer the waits), the more sit idle past 5 s in the next lull.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// A shared keep-alive client.
#[derive(Clone)]
pub struct Http {
    inner: Client<HttpConnector, Full<Bytes>>,
}

/// What one streamed completion did.
#[derive(Debug, Clone, Default)]
pub struct StreamResult {
    /// HTTP status (0: no response).
    pub status: u16,
    /// Transport or protocol error, or the error body of a non-200 answer.
    pub error: Option<String>,
    /// Send to first output text.
    pub ttft: Option<Duration>,
    /// Send to the end of the stream.
    pub e2e: Duration,
    /// Output tokens (`usage.completion_tokens`, else text events).
    pub output_tokens: u32,
    /// `usage.prompt_tokens`, when the stream carried usage.
    pub prompt_tokens: Option<u32>,
    /// `usage.prompt_tokens_details.cached_tokens`, when present.
    pub cached_tokens: Option<u32>,
    /// The answer text (needed to send the next turn of a conversation).
    pub text: String,
    /// `x-gateway-backend` response header.
    pub backend: Option<String>,
    /// `x-gateway-decision` response header.
    pub decision: Option<String>,
    /// `server-timing` response header (the gateway's `route;dur=.., upstream;dur=..`).
    pub server_timing: Option<String>,
    /// `x-gateway-predicted-ttft-ms`: the gateway's predicted time to first token there.
    pub predicted_ttft_ms: Option<f64>,
    /// vllm-sim's `usage.sim_engine_ttft_ms` (`--report-engine-timing`): the engine's own time
    /// from the request's arrival to its first token.
    pub engine_ttft_ms: Option<f64>,
    /// vllm-sim's split of that time (`--report-engine-timing`).
    pub engine_split: Option<EngineSplit>,
    /// vllm-sim's `usage.sim_engine_e2e_ms` (`--report-engine-timing`): the engine's own time
    /// from the request's arrival to its last token.
    pub engine_e2e_ms: Option<f64>,
    /// vllm-sim's `usage.sim_engine_decode_stall_ms` (`--report-engine-timing`): after its first
    /// token, the share of the steps it decoded in that went to other prompts' prefill, ms.
    pub engine_decode_stall_ms: Option<f64>,
    /// `x-gateway-route-receipt`: what the router predicted for the chosen backend and the
    /// runner-up.
    pub route_receipt: Option<RouteReceipt>,
    /// `x-gateway-ahead`: what became of a fetch sent ahead of the lease call (`ROUTE_AHEAD`).
    pub ahead: Option<String>,
}

/// Where a request's engine time to first token went, as vllm-sim reports it in the usage chunk
/// (`usage.sim_engine_queue_ms`, `sim_engine_prefill_ms`, `sim_engine_shared_prefill_ms`,
/// `sim_engine_decode_interference_ms`): the parts add up to `sim_engine_ttft_ms`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct EngineSplit {
    /// Arrival at the engine to the first step that computed it.
    pub queue_ms: f64,
    /// Its own share of its prefill steps (its tokens, each step's fixed cost, any pause between
    /// its chunks).
    pub prefill_ms: f64,
    /// Other prompts' share of its prefill steps (0 when the sim does not report it).
    pub shared_prefill_ms: f64,
    /// The share of its prefill steps that decoding sequences batched with it cost.
    pub decode_interference_ms: f64,
}

/// The gateway's `x-gateway-route-receipt` header:
/// `backend=<id>;predicted_ttft_ms=<n>;alt=<id>;alt_predicted_ttft_ms=<n>`, read leniently (any
/// order, unknown keys ignored, a missing or unparsable part left out).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RouteReceipt {
    /// The chosen backend.
    pub backend: Option<String>,
    /// Its predicted time to first token, ms.
    pub predicted_ttft_ms: Option<f64>,
    /// The runner-up.
    pub alt: Option<String>,
    /// The runner-up's predicted time to first token, ms.
    pub alt_predicted_ttft_ms: Option<f64>,
}

impl RouteReceipt {
    /// Parses the header; `None` when it names nothing.
    pub fn parse(header: &str) -> Option<RouteReceipt> {
        let mut r = RouteReceipt::default();
        for part in header.split([';', ',']) {
            let Some((k, v)) = part.split_once('=') else {
                continue;
            };
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().trim_matches('"'));
            let num = || {
                v.trim_end_matches("ms")
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite())
            };
            match k.as_str() {
                "backend" if !v.is_empty() => r.backend = Some(v.to_string()),
                "predicted_ttft_ms" => r.predicted_ttft_ms = num(),
                "alt" if !v.is_empty() && v != "none" => r.alt = Some(v.to_string()),
                "alt_predicted_ttft_ms" => r.alt_predicted_ttft_ms = num(),
                _ => {}
            }
        }
        (r != RouteReceipt::default()).then_some(r)
    }
}

impl StreamResult {
    /// A 200 stream that ended with output.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none() && self.ttft.is_some()
    }
}

/// Pulls the text and usage out of one SSE event's data of a chat (or text) completion.
fn read_event(
    data: &str,
    out: &mut StreamResult,
    text_events: &mut u32,
    usage_tokens: &mut Option<u32>,
) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return false;
    };
    if let Some(err) = v.get("error") {
        out.error = Some(format!("stream error: {err}"));
        return false;
    }
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        out.prompt_tokens = u
            .get("prompt_tokens")
            .and_then(Value::as_u64)
            .map(|x| x as u32);
        *usage_tokens = u
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .map(|x| x as u32);
        out.cached_tokens = u
            .pointer("/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .map(|x| x as u32);
        out.engine_ttft_ms = u.get("sim_engine_ttft_ms").and_then(Value::as_f64);
        let ms = |k: &str| u.get(k).and_then(Value::as_f64);
        out.engine_e2e_ms = ms("sim_engine_e2e_ms");
        out.engine_decode_stall_ms = ms("sim_engine_decode_stall_ms");
        if let (Some(q), Some(p), Some(d)) = (
            ms("sim_engine_queue_ms"),
            ms("sim_engine_prefill_ms"),
            ms("sim_engine_decode_interference_ms"),
        ) {
            out.engine_split = Some(EngineSplit {
                queue_ms: q,
                prefill_ms: p,
                shared_prefill_ms: ms("sim_engine_shared_prefill_ms").unwrap_or(0.0),
                decode_interference_ms: d,
            });
        }
    }
    let mut got_text = false;
    if let Some(choice) = v.get("choices").and_then(|c| c.get(0)) {
        let piece = choice
            .pointer("/delta/content")
            .or_else(|| choice.get("text"))
            .and_then(Value::as_str)
            .unwrap_or("");
        if !piece.is_empty() {
            out.text.push_str(piece);
            *text_events += 1;
            got_text = true;
        }
    }
    got_text
}

impl Http {
    /// A client with a large keep-alive pool (one connection per concurrent stream).
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let inner = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(4096)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .build(connector);
        Http { inner }
    }

    /// Sends `body`, a streamed request of `api`, to `url` and reads the SSE stream to its end (or
    /// `timeout`).
    pub async fn stream_api(
        &self,
        api: Api,
        url: &str,
        body: Bytes,
        headers: &[(String, String)],
        timeout: Duration,
    ) -> StreamResult {
        let start = Instant::now();
        let mut out = StreamResult::default();
        match tokio::time::timeout(
            timeout,
            self.stream_inner(api, url, body, headers, start, &mut out),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => out.error = Some(e),
            Err(_) => out.error = Some(format!("timed out after {:.0} s", timeout.as_secs_f64())),
        }
        out.e2e = start.elapsed();
        out
    }

    async fn stream_inner(
        &self,
        api: Api,
        url: &str,
        body: Bytes,
        headers: &[(String, String)],
        start: Instant,
        out: &mut StreamResult,
    ) -> Result<(), String> {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(url)
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
        let resp = self.inner.request(req).await.map_err(|e| {
            // hyper-util's error says only its kind (`SendRequest`); its sources say why.
            let mut text = format!("request failed: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                text.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            text
        })?;
        out.status = resp.status().as_u16();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        out.backend = header("x-gateway-backend");
        out.decision = header("x-gateway-decision");
        out.server_timing = header("server-timing");
        out.predicted_ttft_ms = header("x-gateway-predicted-ttft-ms").and_then(|v| v.parse().ok());
        out.route_receipt = header("x-gateway-route-receipt").and_then(|v| RouteReceipt::parse(&v));
        out.ahead = header("x-gateway-ahead");
        let mut body = resp.into_body();
        if out.status != 200 {
            let bytes = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            return Err(format!(
                "HTTP {}: {}",
                out.status,
                String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
            ));
        }
        let mut buf: Vec<u8> = Vec::new();
        let mut text_events = 0u32;
        let mut usage_tokens = None;
        let mut done = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("stream broken: {e}"))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..pos + 2).collect();
                let event = String::from_utf8_lossy(&event);
                for line in event.lines() {
                    let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                        continue;
                    };
                    let event = match api {
                        Api::Chat if data == "[DONE]" => EventOutcome::END,
                        Api::Chat => EventOutcome {
                            text: read_event(data, out, &mut text_events, &mut usage_tokens),
                            done: false,
                        },
                        Api::Responses => {
                            read_responses_event(data, out, &mut text_events, &mut usage_tokens)
                        }
                        Api::Messages => {
                            read_messages_event(data, out, &mut text_events, &mut usage_tokens)
                        }
                    };
                    done |= event.done;
                    if event.text && out.ttft.is_none() {
                        out.ttft = Some(start.elapsed());
                    }
                }
            }
        }
        out.output_tokens = usage_tokens.unwrap_or(text_events);
        if let Some(e) = &out.error {
            return Err(e.clone());
        }
        if !done {
            return Err(match api {
                Api::Chat => "stream ended without [DONE]".into(),
                Api::Responses => "stream ended without response.completed".into(),
                Api::Messages => "stream ended without message_stop".into(),
            });
        }
        Ok(())
    }

    /// A plain request; returns the status and body text.
    pub async fn call(
        &self,
        method: Method,
        url: &str,
        bearer: Option<&str>,
        body: Option<String>,
    ) -> Result<(u16, String), String> {
        let mut req = Request::builder().method(method).uri(url);
        if let Some(token) = bearer {
            req = req.header("authorization", format!("Bearer {token}"));
        }
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| e.to_string())?;
        let fut = async {
            let resp = self
                .inner
                .request(req)
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            let status = resp.status().as_u16();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
        };
        tokio::time::timeout(Duration::from_secs(15), fut)
            .await
            .map_err(|_| format!("{url}: timed out"))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_yield_text_usage_and_errors() {
        let mut out = StreamResult::default();
        let (mut n, mut usage) = (0, None);
        assert!(!read_event(
            r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
            &mut out,
            &mut n,
            &mut usage
        ));
        assert!(read_event(
            r#"{"choices":[{"delta":{"content":" the"}}]}"#,
            &mut out,
            &mut n,
            &mut usage
        ));
        assert!(read_event(
            r#"{"choices":[{"text":" cat"}]}"#,
            &mut out,
            &mut n,
            &mut usage
        ));
        assert!(!read_event(
            r#"{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}"#,
            &mut out,
            &mut n,
            &mut usage
        ));
        assert_eq!(out.text, " the cat");
        assert_eq!(
            (n, usage, out.prompt_tokens, out.cached_tokens),
            (2, Some(2), Some(40), Some(32))
        );
        read_event(
            r#"{"error":{"message":"boom"}}"#,
            &mut out,
            &mut n,
            &mut usage,
        );
        assert!(out.error.is_some());
    }

    #[test]
    fn the_engine_split_comes_from_the_usage_chunk() {
        let mut out = StreamResult::default();
        let (mut n, mut usage) = (0, None);
        read_event(
            r#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1,"sim_engine_ttft_ms":30.5,"sim_engine_queue_ms":10.0,"sim_engine_prefill_ms":15.0,"sim_engine_shared_prefill_ms":3.0,"sim_engine_decode_interference_ms":2.5}}"#,
            &mut out,
            &mut n,
            &mut usage,
        );
        assert_eq!(out.engine_ttft_ms, Some(30.5));
        assert_eq!(
            out.engine_split,
            Some(EngineSplit {
                queue_ms: 10.0,
                prefill_ms: 15.0,
                shared_prefill_ms: 3.0,
                decode_interference_ms: 2.5
            })
        );
        assert_eq!(
            (out.engine_e2e_ms, out.engine_decode_stall_ms),
            (None, None)
        );
    }

    #[test]
    fn the_engine_e2e_and_decode_stall_come_from_the_usage_chunk() {
        let mut out = StreamResult::default();
        let (mut n, mut usage) = (0, None);
        read_event(
            r#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":9,"sim_engine_ttft_ms":30.5,"sim_engine_queue_ms":10.0,"sim_engine_prefill_ms":15.0,"sim_engine_shared_prefill_ms":3.0,"sim_engine_decode_interference_ms":2.5,"sim_engine_e2e_ms":412.25,"sim_engine_decode_stall_ms":96.5}}"#,
            &mut out,
            &mut n,
            &mut usage,
        );
        assert_eq!(out.engine_ttft_ms, Some(30.5));
        assert_eq!(out.engine_e2e_ms, Some(412.25));
        assert_eq!(out.engine_decode_stall_ms, Some(96.5));
        assert_eq!(usage, Some(9));
    }

    #[test]
    fn route_receipts_parse_leniently() {
        let r = RouteReceipt::parse(
            "backend=b-3;predicted_ttft_ms=41.5;alt=b-7;alt_predicted_ttft_ms=58",
        )
        .unwrap();
        assert_eq!(r.backend.as_deref(), Some("b-3"));
        assert_eq!(r.predicted_ttft_ms, Some(41.5));
        assert_eq!(r.alt.as_deref(), Some("b-7"));
        assert_eq!(r.alt_predicted_ttft_ms, Some(58.0));
        // Any order, spaces, unknown keys, a unit suffix, a part missing or broken.
        let r = RouteReceipt::parse(
            " alt = x ; extra=1; backend=y; predicted_ttft_ms=12ms; alt_predicted_ttft_ms=oops",
        )
        .unwrap();
        assert_eq!(
            (
                r.backend.as_deref(),
                r.predicted_ttft_ms,
                r.alt.as_deref(),
                r.alt_predicted_ttft_ms
            ),
            (Some("y"), Some(12.0), Some("x"), None)
        );
        assert_eq!(RouteReceipt::parse("nothing here"), None);
        assert_eq!(RouteReceipt::parse("backend=a;alt=none").unwrap().alt, None);
    }
}
