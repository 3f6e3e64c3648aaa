//! End-to-end checks of `--report-engine-timing`'s split of each streamed request's engine time
//! to first token (queue wait, own prefill, shared prefill, decode interference;
//! `usage.sim_engine_*_ms`) and of the rest of its answer (`sim_engine_e2e_ms`,
//! `sim_engine_decode_stall_ms`), over real HTTP on 127.0.0.1 against the built `vllm-sim` binary:
//! the parts add up to the engine TTFT, a request alone shares nothing and stalls on nothing, one
//! that waits for a slot has its wait as queue time, one whose prefill shares steps with decoding
//! sequences or with another prompt is charged for them, a decode whose steps carry another
//! prompt's prefill is stalled by about that prefill, and without the flag nothing is reported.
//!
//! Each test starts its own sim (`--port 0`) and speaks HTTP/1.1 over `std::net::TcpStream` with
//! `Connection: close`. The assertions compare the sim's own figures with each other (sums,
//! zero / non-zero, which part dominates), never against a clock.

use std::io::Read;
use std::process::Child;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::{Reply, PATIENCE};

/// A running sim, killed when dropped.
struct Sim {
    child: Child,
    client: Client,
}

/// Talks to a sim (cloneable into the threads that send concurrent requests).
#[derive(Clone)]
struct Client {
    address: String,
}

impl Sim {
    fn start(extra: &[&str]) -> Sim {
        let args: Vec<&str> = ["--model", "m", "--time-scale", "4"]
            .iter()
            .chain(extra)
            .copied()
            .collect();
        let (child, address) = common::spawn(&args);
        Sim {
            child,
            client: Client { address },
        }
    }
}

impl Client {
    /// One request, read until the server closes; returns the de-chunked body.
    fn exchange(&self, method: &str, path: &str, body: &str) -> String {
        let mut stream = common::send(&self.address, method, path, body);
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).expect("reads to the end");
        Reply::parse(&raw).text()
    }

    /// A streamed chat completion of `prompt_tokens` tokens and exactly `max_tokens` output
    /// tokens; returns its usage object.
    fn stream_usage(&self, prompt_tokens: usize, max_tokens: u32, salt: &str) -> Value {
        let content: String = format!("{salt:>4}") + &" abc".repeat(prompt_tokens);
        let body = json!({
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string();
        let text = self.exchange("POST", "/v1/chat/completions", &body);
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        text.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
            .expect("a usage chunk")
    }

    fn running(&self) -> f64 {
        let text = self.exchange("GET", "/metrics", "");
        text.lines()
            .find_map(|l| {
                l.strip_prefix("vllm:num_requests_running{model_name=\"m\",engine=\"0\"} ")
            })
            .and_then(|v| v.parse().ok())
            .expect("vllm:num_requests_running")
    }

    fn wait_running(&self, n: f64) {
        let deadline = Instant::now() + PATIENCE;
        while self.running() < n {
            assert!(Instant::now() < deadline, "gave up waiting for {n} running");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Queue, own prefill, decode interference and the total, ms.
fn split(usage: &Value) -> (f64, f64, f64, f64) {
    let get = |k: &str| {
        usage
            .get(k)
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("no {k} in {usage}"))
    };
    (
        get("sim_engine_queue_ms"),
        get("sim_engine_prefill_ms"),
        get("sim_engine_decode_interference_ms"),
        get("sim_engine_ttft_ms"),
    )
}

/// Other prompts' share of its prefill steps, ms.
fn shared(usage: &Value) -> f64 {
    usage
        .get("sim_engine_shared_prefill_ms")
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("no sim_engine_shared_prefill_ms in {usage}"))
}

/// Arrival to the last token and the decode stall, ms.
fn e2e_and_stall(usage: &Value) -> (f64, f64) {
    let get = |k: &str| {
        usage
            .get(k)
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("no {k} in {usage}"))
    };
    (get("sim_engine_e2e_ms"), get("sim_engine_decode_stall_ms"))
}

fn assert_adds_up(usage: &Value) {
    let (q, p, d, ttft) = split(usage);
    let s = shared(usage);
    assert!(q >= 0.0 && p >= 0.0 && d >= 0.0 && s >= 0.0, "{usage}");
    assert!(
        (q + p + s + d - ttft).abs() < 1e-6 * ttft.max(1.0),
        "{usage}"
    );
}

#[test]
fn a_request_alone_has_prefill_and_no_decode_interference() {
    let sim = Sim::start(&["--report-engine-timing", "--prefill-us-per-token", "200"]);
    let usage = sim.client.stream_usage(400, 4, "a");
    assert_adds_up(&usage);
    let (q, p, d, _) = split(&usage);
    assert_eq!(d, 0.0, "nothing else decoded: {usage}");
    assert_eq!(shared(&usage), 0.0, "no other prompt: {usage}");
    assert!(p > q, "an idle engine starts it at once: {usage}");
    let (e2e, stall) = e2e_and_stall(&usage);
    assert_eq!(stall, 0.0, "no other prompt in its decode steps: {usage}");
    assert!(
        e2e > split(&usage).3,
        "3 decode steps after its first token: {usage}"
    );
}

#[test]
fn a_decode_whose_steps_carry_another_prompt_is_stalled_by_its_prefill() {
    // Chunks of 256 tokens at 0.1 ms a token against a 1 ms step: a 2,000-token prompt sent
    // while a long answer decodes takes some eight steps, each of them mostly its tokens and
    // each also one of the answer's decode steps.
    let sim = Sim::start(&[
        "--report-engine-timing",
        "--max-num-batched-tokens",
        "256",
        "--decode-ms-per-step",
        "1",
    ]);
    let client = sim.client.clone();
    let decoder = std::thread::spawn(move || client.stream_usage(8, 1000, "dec"));
    sim.client.wait_running(1.0);
    let prompt = sim.client.stream_usage(2000, 2, "long");
    let decoder = decoder.join().expect("the decoder");
    assert_adds_up(&decoder);
    assert_adds_up(&prompt);
    let (e2e, stall) = e2e_and_stall(&decoder);
    // The prompt's own share of its prefill steps is its tokens (about 96% of each step) plus
    // each step's fixed cost: the decoder's stall is most of it and never more.
    let (_, prefill, _, _) = split(&prompt);
    assert!(stall > 0.5 * prefill, "{decoder} vs {prompt}");
    assert!(stall <= prefill + 1e-6, "{decoder} vs {prompt}");
    assert!(e2e > stall + split(&decoder).3, "{decoder}");
    assert_eq!(
        e2e_and_stall(&prompt).1,
        0.0,
        "its one decode step: {prompt}"
    );
}

#[test]
fn waiting_for_a_slot_is_queue_time() {
    // One sequence at a time: the second request waits for the whole first answer.
    let sim = Sim::start(&[
        "--report-engine-timing",
        "--max-num-seqs",
        "1",
        "--decode-ms-per-step",
        "4",
    ]);
    let client = sim.client.clone();
    let first = std::thread::spawn(move || client.stream_usage(16, 120, "one"));
    sim.client.wait_running(1.0);
    let second = sim.client.stream_usage(16, 2, "two");
    let first = first.join().expect("the first request");
    assert_adds_up(&first);
    assert_adds_up(&second);
    let (q, p, d, _) = split(&second);
    assert!(
        q > p + d,
        "it waited for a slot more than it computed: {second}"
    );
    assert!(q > split(&first).0, "{second} vs {first}");
}

#[test]
fn prefill_sharing_steps_with_decodes_is_charged_to_them() {
    // Chunked prefill (64 tokens a step) next to decoding sequences that are costly per step.
    let sim = Sim::start(&[
        "--report-engine-timing",
        "--max-num-batched-tokens",
        "64",
        "--decode-ms-per-seq",
        "3",
        "--decode-ms-per-step",
        "1",
    ]);
    let decoders: Vec<_> = (0..3)
        .map(|i| {
            let client = sim.client.clone();
            std::thread::spawn(move || client.stream_usage(8, 400, &format!("d{i}")))
        })
        .collect();
    sim.client.wait_running(3.0);
    let long = sim.client.stream_usage(640, 2, "long");
    for d in decoders {
        assert_adds_up(&d.join().expect("a decoder"));
    }
    assert_adds_up(&long);
    let (_, p, d, _) = split(&long);
    assert!(d > 0.0, "its prefill steps carried decodes: {long}");
    // 3 decodes x 3 ms against 1 ms + 64 x 0.1 ms of prefill per step: the decodes cost more.
    assert!(d > p * 0.5, "{long}");
}

#[test]
fn a_prompt_that_joins_another_prompts_last_chunk_shares_its_step() {
    // Chunks of 64 tokens: the long prompt (4,000 tokens and the chat template, some 63 steps)
    // takes every step's whole budget until its last chunk, whose leftover budget starts the
    // short prompt that waited for it.
    let sim = Sim::start(&["--report-engine-timing", "--max-num-batched-tokens", "64"]);
    let client = sim.client.clone();
    let long = std::thread::spawn(move || client.stream_usage(4000, 2, "long"));
    sim.client.wait_running(1.0);
    let short = sim.client.stream_usage(16, 2, "short");
    let long = long.join().expect("the long request");
    assert_adds_up(&long);
    assert_adds_up(&short);
    assert!(
        shared(&short) > 0.0,
        "its first step was the long prompt's last: {short}"
    );
    assert!(split(&short).0 > 0.0, "it waited for the budget: {short}");
    assert!(
        shared(&long) > 0.0,
        "its last step carried the short prompt: {long}"
    );
}

#[test]
fn without_the_flag_no_split_is_reported() {
    let sim = Sim::start(&[]);
    let usage = sim.client.stream_usage(16, 2, "x");
    for k in [
        "sim_engine_ttft_ms",
        "sim_engine_queue_ms",
        "sim_engine_prefill_ms",
        "sim_engine_shared_prefill_ms",
        "sim_engine_decode_interference_ms",
        "sim_engine_e2e_ms",
        "sim_engine_decode_stall_ms",
    ] {
        assert!(usage.get(k).is_none(), "{k} in {usage}");
    }
}
