//! End-to-end checks of the built `vllm-sim` binary over real HTTP on 127.0.0.1: the faults a
//! gateway must survive (stall, truncated body, a stream dropped after N tokens or in the middle of
//! an event, a crash mid-stream), usage reporting, resuming a dropped answer through the prefix
//! cache (a continued final assistant message, a completion prompt extended by its partial text),
//! and the latency histograms.
//!
//! Each test starts its own sim process (`--port 0`, the address read from stdout) and talks to it
//! with a deliberately small HTTP/1.1 client over `std::net::TcpStream`, so that cut bodies, missing
//! terminating chunks and half-written events are seen exactly as they arrive on the wire. Waits poll
//! `/metrics` for a state with a generous deadline; no test asserts how fast anything happens.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::Child;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::{Reply, PATIENCE};

/// A running sim process, killed when dropped.
struct Sim {
    child: Child,
    address: String,
}

impl Sim {
    fn start(extra: &[&str]) -> Sim {
        let base = [
            "--model",
            "m",
            "--decode-ms-per-step",
            "2",
            "--prefill-us-per-token",
            "1",
            "--time-scale",
            "4",
            // The cache arithmetic below was written for 16-token blocks (vLLM 0.34's default is 64).
            "--block-size",
            "16",
        ];
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (child, address) = common::spawn(&args);
        Sim { child, address }
    }

    /// Opens a connection and sends one request (`Connection: close`).
    fn send(&self, method: &str, path: &str, body: &Value) -> TcpStream {
        let body = if body.is_null() {
            String::new()
        } else {
            body.to_string()
        };
        common::send(&self.address, method, path, &body)
    }

    /// One whole exchange, read until the server closes the connection.
    fn exchange(&self, method: &str, path: &str, body: &Value) -> Reply {
        let mut stream = self.send(method, path, body);
        let mut raw = Vec::new();
        stream
            .read_to_end(&mut raw)
            .expect("reads until the server closes");
        Reply::parse(&raw)
    }

    fn post(&self, path: &str, body: Value) -> Reply {
        self.exchange("POST", path, &body)
    }

    fn faults(&self, settings: Value) {
        let reply = self.post("/sim/faults", settings);
        assert_eq!(reply.status, 200, "{}", reply.text());
    }

    /// The value of one unlabelled-beyond-defaults series (or one with `extra` labels) in `/metrics`.
    fn metric(&self, series: &str, extra: &str) -> f64 {
        let text = self.exchange("GET", "/metrics", &Value::Null).text();
        let labels = if extra.is_empty() {
            "model_name=\"m\",engine=\"0\"}".to_string()
        } else {
            format!("model_name=\"m\",engine=\"0\",{extra}}}")
        };
        let prefix = format!("{series}{{{labels} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("no {series} {extra} in /metrics"))
            .parse()
            .expect("a number")
    }

    /// Waits until `condition` holds, polling `/metrics`.
    fn wait_for(&self, what: &str, condition: impl Fn(&Sim) -> bool) {
        let deadline = Instant::now() + PATIENCE;
        while !condition(self) {
            assert!(Instant::now() < deadline, "gave up waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A chat request for `max_tokens` tokens that ignores EOS.
fn chat(messages: Value, max_tokens: u32, stream: bool) -> Value {
    json!({"model": "m", "messages": messages, "max_tokens": max_tokens, "ignore_eos": true, "stream": stream})
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Reads a stream until `events` whole SSE events have arrived; returns what was read.
fn read_events(stream: &mut TcpStream, events: usize) -> String {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&raw).into_owned();
        if text.matches("\n\n").count() > events {
            // The head's blank line is "\r\n\r\n", so every "\n\n" is an event's end.
            return text;
        }
        let n = stream.read(&mut buf).expect("the stream stays readable");
        assert!(n > 0, "the server closed the stream early: {text}");
        raw.extend_from_slice(&buf[..n]);
    }
}

#[test]
fn a_stalled_stream_sends_n_tokens_then_holds_its_slot_until_the_client_leaves() {
    let sim = Sim::start(&[]);
    sim.faults(json!({"stall_after_tokens": 3}));
    let settings = sim.exchange("GET", "/sim/faults", &Value::Null).json();
    assert_eq!(settings["settings"]["stall_after_tokens"], 3);

    let mut stream = sim.send(
        "POST",
        "/v1/chat/completions",
        &chat(user("hello"), 50, true),
    );
    // The role chunk and three content chunks.
    let text = read_events(&mut stream, 3);
    sim.wait_for("the stall", |s| {
        s.metric("vllm_sim:num_requests_stalled", "") == 1.0
    });
    assert_eq!(sim.metric("vllm:num_requests_running", ""), 1.0);
    assert_eq!(sim.metric("vllm:generation_tokens_total", ""), 3.0);
    assert!(
        !text.contains("[DONE]") && !text.contains("\"finish_reason\":\"length\""),
        "{text}"
    );
    assert_eq!(
        text.matches("\"content\":\"").count(),
        4,
        "role chunk + 3 tokens: {text}"
    );
    // The connection is open and silent.
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 64];
    match stream.read(&mut buf) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        other => panic!("expected silence, got {other:?}"),
    }

    drop(stream);
    sim.wait_for("the abort", |s| {
        s.metric("vllm:num_requests_running", "") == 0.0
    });
    assert_eq!(
        sim.metric("vllm:request_success_total", "finished_reason=\"abort\""),
        1.0
    );
    assert_eq!(sim.metric("vllm_sim:num_requests_stalled", ""), 0.0);
    assert_eq!(sim.metric("vllm:kv_cache_usage_perc", ""), 0.0);

    // Cleared, the next request runs to the end.
    sim.faults(json!({}));
    let reply = sim.post("/v1/chat/completions", chat(user("hello"), 5, true));
    assert!(reply.complete && reply.text().ends_with("data: [DONE]\n\n"));
}

#[test]
fn a_stalled_non_streamed_request_never_answers_and_is_freed_on_disconnect() {
    let sim = Sim::start(&["--fault-stall-after-tokens", "2", "--max-num-seqs", "1"]);
    let mut first = sim.send(
        "POST",
        "/v1/completions",
        &json!({"prompt": "abcd", "max_tokens": 9, "ignore_eos": true}),
    );
    sim.wait_for("the stall", |s| {
        s.metric("vllm_sim:num_requests_stalled", "") == 1.0
    });
    // The hung sequence holds the only slot: the next one waits behind it.
    let second = sim.send(
        "POST",
        "/v1/completions",
        &json!({"prompt": "efgh", "max_tokens": 1}),
    );
    sim.wait_for("the queue", |s| {
        s.metric("vllm:num_requests_waiting", "") == 1.0
    });
    assert_eq!(sim.metric("vllm:generation_tokens_total", ""), 2.0);
    first
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 64];
    match first.read(&mut buf) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        other => panic!("expected no answer, got {other:?}"),
    }

    drop(first);
    // The slot is freed; the waiting request (max_tokens 1, within the stall) finishes.
    let mut second = second;
    let mut raw = Vec::new();
    second.read_to_end(&mut raw).unwrap();
    let reply = Reply::parse(&raw);
    assert_eq!(reply.json()["usage"]["completion_tokens"], 1);
    assert_eq!(
        sim.metric("vllm:request_success_total", "finished_reason=\"abort\""),
        1.0
    );
}

#[test]
fn a_truncated_body_announces_its_length_and_stops_half_way() {
    let sim = Sim::start(&["--fault-truncate-body"]);
    let reply = sim.post("/v1/chat/completions", chat(user("hello"), 20, false));
    assert_eq!(reply.status, 200);
    let announced: usize = reply.header("content-length").unwrap().parse().unwrap();
    assert!(!reply.complete);
    assert_eq!(reply.body.len(), announced / 2);
    assert!(
        reply.text().starts_with("{\"id\":\"chatcmpl-"),
        "{}",
        reply.text()
    );
    assert!(serde_json::from_slice::<Value>(&reply.body).is_err());

    // Streams are not affected, and the fault is visible and can be cleared.
    let stream = sim.post(
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 3, "stream": true}),
    );
    assert!(stream.complete && stream.text().ends_with("data: [DONE]\n\n"));
    let settings = sim.exchange("GET", "/sim/faults", &Value::Null).json();
    assert_eq!(settings["settings"]["truncate_body"], true);
    sim.faults(json!({"truncate_body": false}));
    let whole = sim.post("/v1/completions", json!({"prompt": "x", "max_tokens": 3}));
    assert_eq!(whole.json()["usage"]["completion_tokens"], 3);
}

#[test]
fn a_stream_can_be_cut_in_the_middle_of_an_event() {
    let sim = Sim::start(&[]);
    sim.faults(json!({"disconnect_mid_event_after_tokens": 2}));
    let reply = sim.post("/v1/chat/completions", chat(user("hello"), 10, true));
    assert_eq!(reply.status, 200);
    assert!(!reply.complete, "no terminating chunk");
    let (events, tail) = reply.events();
    assert_eq!(events.len(), 3, "role chunk and two tokens: {events:?}");
    for event in &events {
        let chunk: Value = serde_json::from_str(event).unwrap();
        assert_eq!(chunk["object"], "chat.completion.chunk");
    }
    assert!(tail.starts_with("data: {\"id\":\"chatcmpl-"), "{tail:?}");
    assert!(serde_json::from_str::<Value>(&tail["data: ".len()..]).is_err());
    assert!(!reply.text().contains("[DONE]"));

    // The flag does the same; completions streams too; non-streamed requests are served.
    let sim = Sim::start(&["--fault-disconnect-mid-event-after-tokens", "1"]);
    let reply = sim.post(
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 5, "stream": true}),
    );
    let (events, tail) = reply.events();
    assert_eq!(events.len(), 1);
    assert!(tail.starts_with("data: {\"id\":\"cmpl-") && !reply.complete);
    let whole = sim.post("/v1/completions", json!({"prompt": "x", "max_tokens": 5}));
    assert_eq!(whole.json()["usage"]["completion_tokens"], 5);
}

#[test]
fn a_stream_can_be_reset_after_its_done() {
    let sim = Sim::start(&[]);
    sim.faults(json!({"reset_after_done": true}));
    let mut body = chat(user("hello"), 4, true);
    body["stream_options"] = json!({"include_usage": true});
    let reply = sim.post("/v1/chat/completions", body);
    assert_eq!(reply.status, 200);
    // Every event arrived, the end included, but not the terminating chunk: the connection was
    // reset instead of closed.
    assert!(!reply.complete, "no terminating chunk");
    let (events, tail) = reply.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert_eq!(tail, "");
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    // Non-streamed answers are untouched; without the fault a stream ends cleanly.
    let whole = sim.post("/v1/chat/completions", chat(user("hello"), 4, false));
    assert_eq!(whole.json()["usage"]["completion_tokens"], 4);
    sim.faults(json!({}));
    let clean = sim.post("/v1/chat/completions", chat(user("hello"), 4, true));
    assert!(clean.complete);
}

/// The text of a stream's whole events: chat deltas or completion texts, in order.
fn streamed_text(events: &[String]) -> String {
    events
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).expect("a JSON chunk"))
        .filter_map(|chunk| {
            let choice = &chunk["choices"][0];
            choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())
                .map(str::to_string)
        })
        .collect()
}

#[test]
fn a_stream_dropped_after_n_tokens_resumes_through_the_prefix_cache() {
    let sim = Sim::start(&[]);
    sim.faults(json!({"disconnect_after_tokens": 20}));
    let text = long_text(616); // rendered prompt: 640 bytes, 160 tokens
    let mut request = chat(user(&text), 40, true);
    request["stream_options"] = json!({"include_usage": true});
    let dropped = sim.post("/v1/chat/completions", request);
    assert_eq!(dropped.status, 200);
    assert!(!dropped.complete, "no terminating chunk");
    let (events, tail) = dropped.events();
    // Cut cleanly between events: the role chunk and 20 tokens, no usage, no [DONE].
    assert_eq!(tail, "");
    assert_eq!(events.len(), 21, "{events:?}");
    assert!(!dropped.text().contains("[DONE]") && !dropped.text().contains("\"usage\""));
    let partial = streamed_text(&events);
    assert_eq!(partial.len(), 80, "20 tokens of 4 bytes");
    // The sequence ends (aborted, or finished first if it was quicker than the cut).
    sim.wait_for("the end of the sequence", |s| {
        s.metric("vllm:num_requests_running", "") == 0.0
    });

    // The resume: the partial answer as a final assistant message to continue. Its prompt is the
    // original 160 tokens plus the 20 of the partial answer; the first request computed 160 + 19
    // tokens or more, so at least 11 full blocks are cached, and the 11 the prompt fills are used.
    sim.faults(json!({"reset": true}));
    let mut resume = chat(
        json!([{"role": "user", "content": text}, {"role": "assistant", "content": partial}]),
        20,
        true,
    );
    resume["continue_final_message"] = json!(true);
    resume["add_generation_prompt"] = json!(false);
    resume["stream_options"] = json!({"include_usage": true});
    let resumed = sim.post("/v1/chat/completions", resume);
    assert!(resumed.complete, "{}", resumed.text());
    let (events, _) = resumed.events();
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": 180, "completion_tokens": 20, "total_tokens": 200,
               "prompt_tokens_details": {"cached_tokens": 176}})
    );
    assert_eq!(streamed_text(&events).len(), 80);
}

#[test]
fn a_completion_prompt_extended_by_its_partial_text_hits_the_prefix_cache() {
    let sim = Sim::start(&["--fault-disconnect-after-tokens", "20"]);
    let prompt = long_text(640); // 160 tokens
    let dropped = sim.post(
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 40, "ignore_eos": true, "stream": true}),
    );
    let (events, tail) = dropped.events();
    assert!(!dropped.complete && tail.is_empty());
    assert_eq!(events.len(), 20, "{events:?}");
    let partial = streamed_text(&events);
    assert_eq!(partial.len(), 80);
    sim.wait_for("the end of the sequence", |s| {
        s.metric("vllm:num_requests_running", "") == 0.0
    });

    sim.faults(json!({}));
    let resumed = sim
        .post(
            "/v1/completions",
            json!({"prompt": format!("{prompt}{partial}"), "max_tokens": 20, "ignore_eos": true}),
        )
        .json();
    assert_eq!(resumed["usage"]["prompt_tokens"], 180);
    assert_eq!(resumed["usage"]["completion_tokens"], 20);
    assert_eq!(
        resumed["usage"]["prompt_tokens_details"]["cached_tokens"],
        176
    );
    // A different continuation of the same prompt shares only the prompt's blocks.
    let other = sim
        .post(
            "/v1/completions",
            json!({"prompt": format!("{prompt}{}", "z".repeat(80)), "max_tokens": 1}),
        )
        .json();
    assert_eq!(
        other["usage"]["prompt_tokens_details"]["cached_tokens"],
        160
    );
}

#[test]
fn a_crash_kills_the_process_in_the_middle_of_a_stream() {
    let mut sim = Sim::start(&[]);
    // Long enough that it is still generating when the crash comes.
    let mut stream = sim.send(
        "POST",
        "/v1/chat/completions",
        &chat(user("hello"), 30_000, true),
    );
    let mut text = read_events(&mut stream, 3);
    let reply = sim.post("/sim/faults", json!({"crash": true}));
    assert_eq!(reply.json(), json!({"crashing": true}));
    let status = sim.child.wait().expect("the process ends");
    assert_eq!(status.code(), Some(1));
    // The stream ends without its terminating chunk or [DONE], closed or reset by the kernel.
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest) {
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the stream did not end: {e}"),
    }
    text.push_str(&String::from_utf8_lossy(&rest));
    assert!(
        !text.contains("[DONE]") && !text.contains("\r\n0\r\n\r\n"),
        "{text}"
    );
}

/// A user message of `len` bytes whose rendered prompt is a whole number of tokens.
fn long_text(len: usize) -> String {
    "abcdefghijklmnopqrstuvwxyz0123456789"
        .chars()
        .cycle()
        .take(len)
        .collect()
}

#[test]
fn usage_reports_cached_tokens_in_streams_only_when_asked_and_in_every_answer() {
    let sim = Sim::start(&[]);
    // "<|user|>\n" + 616 bytes + "\n<|assistant|>\n" = 640 bytes = 160 tokens = 10 blocks.
    let messages = user(&long_text(616));
    let first = sim
        .post("/v1/chat/completions", chat(messages.clone(), 4, false))
        .json();
    assert_eq!(first["usage"]["prompt_tokens"], 160);
    assert_eq!(first["usage"]["completion_tokens"], 4);
    assert_eq!(first["usage"]["total_tokens"], 164);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // Streamed with include_usage: a last chunk with no choices and the usage, cache hits included.
    let mut request = chat(messages.clone(), 4, true);
    request["stream_options"] = json!({"include_usage": true});
    let reply = sim.post("/v1/chat/completions", request);
    let (events, tail) = reply.events();
    assert_eq!(tail, "");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let usage_chunk: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    // The last prompt token is always computed: 9 of the 10 blocks hit.
    assert_eq!(
        usage_chunk["usage"],
        json!({"prompt_tokens": 160, "completion_tokens": 4, "total_tokens": 164,
               "prompt_tokens_details": {"cached_tokens": 144}})
    );
    for event in &events[..events.len() - 2] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        assert!(chunk.get("usage").is_none(), "{event}");
        assert_eq!(chunk["choices"].as_array().unwrap().len(), 1);
    }
    assert_eq!(sim.metric("vllm:prefix_cache_hits_total", ""), 144.0);

    // Without include_usage no chunk carries usage.
    let plain = sim.post("/v1/chat/completions", chat(messages.clone(), 4, true));
    assert!(!plain.text().contains("\"usage\""), "{}", plain.text());
    let mut no_usage = chat(messages.clone(), 4, true);
    no_usage["stream_options"] = json!({"include_usage": false});
    assert!(!sim
        .post("/v1/chat/completions", no_usage)
        .text()
        .contains("\"usage\""));

    // Non-streamed completions carry the same details.
    let completion = sim
        .post(
            "/v1/completions",
            json!({"prompt": long_text(640), "max_tokens": 2, "ignore_eos": true}),
        )
        .json();
    assert_eq!(
        completion["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let again = sim
        .post(
            "/v1/completions",
            json!({"prompt": long_text(640), "max_tokens": 2, "ignore_eos": true}),
        )
        .json();
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        144
    );

    // --enable-prompt-tokens-details=false leaves the details out, as vLLM without the flag.
    let plain_sim = Sim::start(&["--enable-prompt-tokens-details=false"]);
    let answer = plain_sim
        .post("/v1/chat/completions", chat(messages, 2, false))
        .json();
    assert!(answer["usage"]["prompt_tokens_details"].is_null());
    assert_eq!(answer["usage"]["prompt_tokens"], 160);
}

#[test]
fn a_continued_answer_extends_the_original_prompt_and_hits_the_cache() {
    let sim = Sim::start(&[]);
    let text = long_text(616); // rendered prompt: 640 bytes, 160 tokens
    let first = sim
        .post("/v1/chat/completions", chat(user(&text), 40, false))
        .json();
    let answer = first["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(answer.len(), 160, "40 tokens of 4 bytes");
    let hits_before = sim.metric("vllm:prefix_cache_hits_total", "");

    let mut request = chat(
        json!([{"role": "user", "content": text}, {"role": "assistant", "content": answer}]),
        8,
        false,
    );
    request["continue_final_message"] = json!(true);
    request["add_generation_prompt"] = json!(false);
    let continued = sim.post("/v1/chat/completions", request.clone()).json();
    // The prompt is the original 160 tokens plus the 40-token partial answer.
    assert_eq!(continued["usage"]["prompt_tokens"], 200);
    // Request 1 computed 160 + 39 tokens (the last sampled token never is): 12 full blocks cached,
    // and all 12 are usable (the last prompt token is always computed).
    assert_eq!(
        continued["usage"]["prompt_tokens_details"]["cached_tokens"],
        192
    );
    assert_eq!(
        sim.metric("vllm:prefix_cache_hits_total", "") - hits_before,
        192.0
    );

    // vLLM's validation: add_generation_prompt defaults to true and conflicts with continuing.
    request
        .as_object_mut()
        .unwrap()
        .remove("add_generation_prompt");
    let refused = sim.post("/v1/chat/completions", request.clone());
    assert_eq!(refused.status, 400);
    assert_eq!(
        refused.json()["error"]["message"],
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    );
    request["add_generation_prompt"] = json!(true);
    assert_eq!(
        sim.post("/v1/chat/completions", request.clone()).status,
        400
    );
    // Continuing needs a final assistant message.
    request["add_generation_prompt"] = json!(false);
    request["messages"] = user("hi");
    let refused = sim.post("/v1/chat/completions", request);
    assert_eq!(refused.status, 400);
    assert_eq!(refused.json()["error"]["type"], "BadRequestError");
}

#[test]
fn latency_histograms_count_requests_and_tokens() {
    let sim = Sim::start(&[]);
    let reply = sim.post("/v1/chat/completions", chat(user("hello"), 5, true));
    assert!(reply.complete);
    sim.wait_for("the finish", |s| {
        s.metric("vllm:e2e_request_latency_seconds_count", "") == 1.0
    });
    // One observation per token after the first (vLLM 0.34 has only the newer name).
    assert_eq!(
        sim.metric("vllm:inter_token_latency_seconds_count", ""),
        4.0
    );
    assert_eq!(
        sim.metric("vllm:inter_token_latency_seconds_bucket", "le=\"+Inf\""),
        4.0
    );
    assert!(sim.metric("vllm:inter_token_latency_seconds_sum", "") > 0.0);
    for name in [
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
    ] {
        assert_eq!(sim.metric(&format!("{name}_count"), ""), 1.0, "{name}");
        assert_eq!(
            sim.metric(&format!("{name}_bucket"), "le=\"7680.0\""),
            1.0,
            "{name}"
        );
    }
    assert!(sim.metric("vllm:request_prefill_time_seconds_sum", "") > 0.0);
    assert!(sim.metric("vllm:request_decode_time_seconds_sum", "") > 0.0);
    // Decode and prefill are parts of inference (the RUNNING phase).
    let inference = sim.metric("vllm:request_inference_time_seconds_sum", "");
    let parts = sim.metric("vllm:request_prefill_time_seconds_sum", "")
        + sim.metric("vllm:request_decode_time_seconds_sum", "");
    assert!((inference - parts).abs() < 1e-9, "{inference} vs {parts}");
}

#[test]
fn a_poison_marker_gets_vllms_500_on_every_endpoint_and_only_for_its_requests() {
    let sim = Sim::start(&[]);
    sim.faults(json!({"poison_marker": "POISON-7f3"}));
    for (path, body) in [
        (
            "/v1/chat/completions",
            chat(user("please POISON-7f3 now"), 5, false),
        ),
        (
            "/v1/chat/completions",
            chat(user("streamed POISON-7f3"), 5, true),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x POISON-7f3", "max_tokens": 3}),
        ),
    ] {
        let reply = sim.post(path, body);
        assert_eq!(reply.status, 500, "{path}: {}", reply.text());
        let error = &reply.json()["error"];
        assert_eq!(error["type"], "InternalServerError");
        assert_eq!(error["code"], 500);
        assert!(error["message"].is_string());
    }
    // Everything else is served as usual.
    let ok = sim.post(
        "/v1/chat/completions",
        chat(user("a clean prompt"), 5, false),
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(ok.json()["usage"]["completion_tokens"], 5);
    sim.faults(json!({}));
    let from_flag = Sim::start(&["--fault-poison-marker", "POISON-7f3"]);
    let poisoned = from_flag.post(
        "/v1/completions",
        json!({"prompt": "POISON-7f3", "max_tokens": 2}),
    );
    assert_eq!(poisoned.status, 500, "{}", poisoned.text());
    let cleared = sim.post(
        "/v1/chat/completions",
        chat(user("POISON-7f3 again"), 5, false),
    );
    assert_eq!(cleared.status, 200);
    // Refused settings say why.
    let bad = sim.post("/sim/faults", json!({"poison_marker": ""}));
    assert_eq!(bad.status, 400, "{}", bad.text());
}

#[test]
fn a_login_page_answers_every_request_but_the_sims_own_with_html() {
    let sim = Sim::start(&[]);
    sim.faults(json!({"login_page": true}));
    for (method, path, body) in [
        ("POST", "/v1/chat/completions", chat(user("hi"), 5, false)),
        ("POST", "/v1/chat/completions", chat(user("hi"), 5, true)),
        ("GET", "/v1/models", Value::Null),
        ("GET", "/health", Value::Null),
    ] {
        let reply = sim.exchange(method, path, &body);
        assert_eq!(reply.status, 200, "{path}");
        assert!(
            reply
                .header("content-type")
                .unwrap()
                .starts_with("text/html"),
            "{path}: {:?}",
            reply.header("content-type")
        );
        assert!(reply.text().contains("<form"), "{path}: {}", reply.text());
    }
    // The sim's own routes still answer, so the fault can be cleared.
    let settings = sim.exchange("GET", "/sim/faults", &Value::Null).json();
    assert_eq!(settings["settings"]["login_page"], true);
    sim.faults(json!({}));
    let models = sim.exchange("GET", "/v1/models", &Value::Null);
    assert_eq!(models.json()["data"][0]["id"], "m");
}

#[test]
fn a_redirect_sends_every_request_but_the_sims_own_elsewhere() {
    let sim = Sim::start(&[]);
    let target = "http://127.0.0.1:9/elsewhere";
    sim.faults(json!({"redirect_to": target}));
    for (method, path, body) in [
        ("POST", "/v1/chat/completions", chat(user("hi"), 5, false)),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 2}),
        ),
        ("GET", "/health", Value::Null),
    ] {
        let reply = sim.exchange(method, path, &body);
        assert_eq!(reply.status, 307, "{path}");
        assert_eq!(reply.header("location"), Some(target), "{path}");
        assert!(reply.body.is_empty());
    }
    let bad = sim.post("/sim/faults", json!({"redirect_to": "javascript:alert(1)"}));
    assert_eq!(bad.status, 400, "{}", bad.text());
    sim.faults(json!({}));
    assert_eq!(sim.exchange("GET", "/health", &Value::Null).status, 200);
}

#[test]
fn route_not_found_answers_a_plain_404_that_is_not_model_not_found() {
    let sim = Sim::start(&[]);
    sim.faults(json!({"route_not_found": true}));
    let reply = sim.post("/v1/chat/completions", chat(user("hi"), 5, false));
    assert_eq!(reply.status, 404);
    assert_eq!(reply.json(), json!({"detail": "Not Found"}));
    // Probes still pass: the server is up, only the route is missing.
    assert_eq!(sim.exchange("GET", "/health", &Value::Null).status, 200);
    let models = sim.exchange("GET", "/v1/models", &Value::Null);
    assert_eq!(models.json()["data"][0]["id"], "m");
    // vLLM's own model-not-found answer, for comparison, names the model and its type.
    sim.faults(json!({}));
    let missing = sim.post(
        "/v1/chat/completions",
        json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["type"], "NotFoundError");
}

#[test]
fn tokenize_not_found_hides_tokenize_only() {
    let sim = Sim::start(&[]);
    let ask = json!({"model": "m", "prompt": "abcdefgh", "add_special_tokens": false});
    assert_eq!(sim.post("/tokenize", ask.clone()).json()["count"], 2);
    sim.faults(json!({"tokenize_not_found": true}));
    let reply = sim.post("/tokenize", ask.clone());
    assert_eq!(reply.status, 404);
    assert_eq!(reply.json(), json!({"detail": "Not Found"}));
    assert_eq!(sim.post("/detokenize", json!({"tokens": [1]})).status, 404);
    assert_eq!(
        sim.post("/v1/chat/completions", chat(user("hi"), 2, false))
            .status,
        200
    );
    sim.faults(json!({}));
    assert_eq!(sim.post("/tokenize", ask).status, 200);
}

/// One chat request with an `X-Request-Id`, read to the end.
fn post_with_id(sim: &Sim, id: &str) -> Reply {
    let body = chat(user("hi"), 3, false).to_string();
    let mut stream = TcpStream::connect(&sim.address).expect("connects");
    stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         X-Request-Id: {id}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        sim.address,
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("writes");
    stream.write_all(body.as_bytes()).expect("writes");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("reads");
    Reply::parse(&raw)
}

#[test]
fn request_id_linger_refuses_an_id_still_taken_as_vllm_does() {
    let sim = Sim::start(&[]);
    // Off by default: the same id twice is served twice.
    assert_eq!(post_with_id(&sim, "req-a").status, 200);
    assert_eq!(post_with_id(&sim, "req-a").status, 200);
    sim.faults(json!({"request_id_linger_ms": 60_000}));
    assert_eq!(post_with_id(&sim, "req-b").status, 200);
    let again = post_with_id(&sim, "req-b");
    assert_eq!(again.status, 400, "{}", again.text());
    assert_eq!(again.json()["error"]["type"], "BadRequestError");
    assert!(
        again.text().contains("req-b already running"),
        "{}",
        again.text()
    );
    // Another id is served; clearing the faults frees every id.
    assert_eq!(post_with_id(&sim, "req-c").status, 200);
    sim.faults(json!({}));
    assert_eq!(post_with_id(&sim, "req-b").status, 200);
}
