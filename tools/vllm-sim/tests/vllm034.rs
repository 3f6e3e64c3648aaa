//! The behaviours of vLLM 0.34.0 that the sim copies (issue 41), checked on the built binary over
//! real HTTP on 127.0.0.1: load shedding (503 with vLLM's body, `vllm:admission_rejections`), routes
//! by task (404 for an unserved task), errors inside a stream and a decode server's failed KV load,
//! `min_tokens` / `max_tokens` validation, connections refused while loading, SSE keep-alive
//! comments, `cache_salt` and LoRA adapters in the block hashes, `/version` and `/metrics`. The
//! README's conformance table names the vLLM file each behaviour comes from and the test pinning it.
//!
//! Each test starts its own sim (`--port 0`) and uses the raw HTTP/1.1 client of `common`.

use std::io::Read;
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
        ];
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (child, address) = common::spawn(&args);
        let sim = Sim { child, address };
        sim.wait_listening();
        sim
    }

    /// Waits until the port accepts connections (it refuses them while loading).
    fn wait_listening(&self) {
        let deadline = Instant::now() + PATIENCE;
        while TcpStream::connect(&self.address).is_err() {
            assert!(Instant::now() < deadline, "the sim never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn exchange(&self, method: &str, path: &str, body: &Value) -> Reply {
        let body = if body.is_null() {
            String::new()
        } else {
            body.to_string()
        };
        let mut stream = common::send(&self.address, method, path, &body);
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).expect("reads to the end");
        Reply::parse(&raw)
    }

    fn post(&self, path: &str, body: Value) -> Reply {
        self.exchange("POST", path, &body)
    }

    fn get(&self, path: &str) -> Reply {
        self.exchange("GET", path, &Value::Null)
    }

    fn faults(&self, settings: Value) {
        let reply = self.post("/sim/faults", settings);
        assert_eq!(reply.status, 200, "{}", reply.text());
    }

    fn metrics(&self) -> String {
        self.get("/metrics").text()
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn chat(content: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens, "ignore_eos": true, "stream": stream})
}

/// Reads a stream until `needle` has arrived; returns what was read.
fn read_until(stream: &mut TcpStream, needle: &str) -> String {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&raw).into_owned();
        if text.contains(needle) {
            return text;
        }
        let n = stream.read(&mut buf).expect("the stream stays readable");
        assert!(n > 0, "closed before {needle:?}: {text}");
        raw.extend_from_slice(&buf[..n]);
    }
}

const STREAM_ERROR: &str = r#"{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}"#;

#[test]
fn load_shedding_answers_503_with_vllms_body_and_counts_rejections() {
    let sim = Sim::start(&["--max-num-queued-reqs", "1"]);
    // One request held in the engine (stalled after its first token) fills the limit.
    sim.faults(json!({"stall_after_tokens": 1}));
    let mut held = common::send(
        &sim.address,
        "POST",
        "/v1/chat/completions",
        &chat("hold", 8, true).to_string(),
    );
    read_until(&mut held, "\"content\"");
    let shed = sim.post("/v1/chat/completions", chat("more", 4, false));
    assert_eq!(shed.status, 503, "{}", shed.text());
    assert_eq!(
        shed.header("retry-after"),
        None,
        "vLLM sends no Retry-After"
    );
    assert_eq!(
        shed.json(),
        json!({"error": {
            "message": "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance.",
            "type": "Service Unavailable", "param": null, "code": 503}})
    );
    assert!(sim.metrics().contains(
        "vllm:admission_rejections_total{model_name=\"m\",reason=\"max_num_queued_reqs\"} 1.0"
    ));
    drop(held);

    // The prefill backlog: a request that never gets its first token keeps its prompt counted.
    let tokens = Sim::start(&["--max-num-queued-tokens", "1"]);
    tokens.faults(json!({"stall_after_tokens": 0}));
    let mut waiting = common::send(
        &tokens.address,
        "POST",
        "/v1/completions",
        &json!({"model": "m", "prompt": "hold", "max_tokens": 4, "stream": true}).to_string(),
    );
    read_until(&mut waiting, "\r\n\r\n");
    let shed = tokens.post(
        "/v1/completions",
        json!({"model": "m", "prompt": "x", "max_tokens": 2}),
    );
    assert_eq!(shed.status, 503, "{}", shed.text());
    assert_eq!(
        shed.json()["error"]["message"],
        "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."
    );
    assert!(tokens.metrics().contains(
        "vllm:admission_rejections_total{model_name=\"m\",reason=\"max_num_queued_tokens\"} 1.0"
    ));
}

#[test]
fn routes_follow_the_task_and_unserved_ones_are_fastapis_404() {
    let generate = Sim::start(&[]);
    let embeddings = generate.post("/v1/embeddings", json!({"model": "m", "input": "hi"}));
    assert_eq!(embeddings.status, 404);
    assert_eq!(embeddings.json(), json!({"detail": "Not Found"}));
    for path in ["/pooling", "/score", "/v1/rerank", "/classify"] {
        assert_eq!(generate.post(path, json!({})).status, 404, "{path}");
    }
    assert_eq!(
        generate
            .post("/v1/chat/completions", chat("hi", 2, false))
            .status,
        200
    );

    let embed = Sim::start(&["--runner", "pooling", "--convert", "embed"]);
    let ok = embed.post("/v1/embeddings", json!({"model": "m", "input": "hi"}));
    assert_eq!(ok.status, 200, "{}", ok.text());
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let missing = embed.post(path, chat("hi", 2, false));
        assert_eq!(missing.status, 404, "{path}");
        assert_eq!(missing.json(), json!({"detail": "Not Found"}));
    }
    let alias = Sim::start(&["--task", "embed"]);
    assert_eq!(
        alias
            .post("/v1/embeddings", json!({"model": "m", "input": "hi"}))
            .status,
        200
    );
}

#[test]
fn stream_error_after_tokens_sends_vllms_error_event_then_done() {
    let sim = Sim::start(&[]);
    sim.faults(json!({"stream_error_after_tokens": 2}));
    let reply = sim.post("/v1/chat/completions", chat("hi", 8, true));
    assert_eq!(reply.status, 200);
    assert!(reply.complete, "the stream ends cleanly");
    let (events, tail) = reply.events();
    assert!(tail.is_empty());
    let n = events.len();
    assert_eq!(events[n - 1], "[DONE]");
    assert_eq!(events[n - 2], STREAM_ERROR);
    let contents = events
        .iter()
        .filter(|e| e.contains("\"content\":\"") && !e.contains("\"content\":\"\""))
        .count();
    assert_eq!(contents, 2, "two tokens before the error: {events:?}");

    // 0: the error is the first event.
    sim.faults(json!({"stream_error_after_tokens": 0}));
    let first = sim.post(
        "/v1/completions",
        json!({"model": "m", "prompt": "x", "max_tokens": 4, "stream": true}),
    );
    assert_eq!(
        first.events().0,
        vec![STREAM_ERROR.to_string(), "[DONE]".to_string()]
    );
    // Not streamed: vLLM's 500.
    let whole = sim.post("/v1/chat/completions", chat("hi", 4, false));
    assert_eq!(whole.status, 500);
    assert_eq!(
        whole.json(),
        serde_json::from_str::<Value>(STREAM_ERROR).unwrap()
    );
    // From the flag too.
    let flagged = Sim::start(&["--stream-error-after-tokens", "1"]);
    let reply = flagged.post("/v1/chat/completions", chat("hi", 4, true));
    assert_eq!(
        reply
            .events()
            .0
            .iter()
            .filter(|e| *e == STREAM_ERROR)
            .count(),
        1
    );
}

#[test]
fn a_decode_server_fails_unknown_or_expired_transfers_in_the_stream_and_recomputes_bad_ones() {
    let decode = Sim::start(&["--role", "decode"]);
    let forged = json!({"do_remote_prefill": true, "remote_engine_id": "x", "remote_block_ids": [1],
                        "remote_host": "127.0.0.1", "remote_port": 1, "sim_expires_at_ms": 1, "sim_tag": "00"});
    let mut request = chat("hello there", 4, true);
    request["kv_transfer_params"] = forged.clone();
    let reply = decode.post("/v1/chat/completions", request.clone());
    assert_eq!(reply.status, 200, "not a 400: {}", reply.text());
    let events = reply.events().0;
    // vLLM sends the role chunk with the first output, which carries finish_reason "error".
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(events[0].contains("\"role\":\"assistant\""));
    assert_eq!(events[1], STREAM_ERROR);
    assert_eq!(events[2], "[DONE]");
    request["stream"] = json!(false);
    assert_eq!(
        decode.post("/v1/chat/completions", request.clone()).status,
        500
    );
    // Incomplete or malformed params are ignored: the prompt is computed here.
    for params in [
        json!({"do_remote_prefill": true}),
        json!({"do_remote_prefill": "yes"}),
    ] {
        request["kv_transfer_params"] = params;
        let served = decode.post("/v1/chat/completions", request.clone());
        assert_eq!(served.status, 200, "{}", served.text());
        assert_eq!(served.json()["usage"]["completion_tokens"], 4);
    }
}

#[test]
fn min_tokens_above_max_tokens_is_400_and_an_oversized_max_tokens_is_lowered() {
    let sim = Sim::start(&["--max-model-len", "64"]);
    // The prefill half of a P/D request: max_tokens 1 beside min_tokens 2.
    let mut prefill = chat("hi", 1, false);
    prefill["min_tokens"] = json!(2);
    prefill["kv_transfer_params"] = json!({"do_remote_decode": true});
    let refused = sim.post("/v1/chat/completions", prefill.clone());
    assert_eq!(refused.status, 400);
    assert_eq!(
        refused.json()["error"]["message"],
        "min_tokens must be less than or equal to max_tokens=1, got 2."
    );
    // The prefill hand-off forces max_tokens 1, so any min_tokens >= 2 is refused there.
    prefill["max_tokens"] = json!(10);
    assert_eq!(sim.post("/v1/chat/completions", prefill).status, 400);
    let mut plain = chat("hi", 3, false);
    plain["min_tokens"] = json!(4);
    assert_eq!(sim.post("/v1/chat/completions", plain).status, 400);

    // "hi" renders as 26 bytes: 7 tokens; 57 fit.
    let lowered = sim.post("/v1/chat/completions", chat("hi", 1000, false));
    assert_eq!(lowered.status, 200, "{}", lowered.text());
    assert_eq!(lowered.json()["usage"]["completion_tokens"], 57);
    let long = sim.post("/v1/chat/completions", chat(&"x".repeat(400), 4, false));
    assert_eq!(long.status, 400);
    let error = long.json()["error"].clone();
    assert_eq!(error["param"], "input_tokens");
    assert!(error["message"]
        .as_str()
        .unwrap()
        .starts_with("This model's maximum context length is 64 tokens. However, your prompt contains 106 input tokens"));
}

#[test]
fn loading_refuses_connections_unless_the_503_fault_is_set() {
    let (child, address) = common::spawn(&["--startup-delay-s", "1"]);
    let sim = Sim { child, address };
    assert!(
        TcpStream::connect(&sim.address).is_err(),
        "refused while loading"
    );
    sim.wait_listening();
    assert_eq!(sim.get("/health").status, 200);
    // A loading phase at run time closes the listener until it ends.
    sim.faults(json!({"loading_s": 0.6}));
    std::thread::sleep(Duration::from_millis(100));
    assert!(TcpStream::connect(&sim.address).is_err());
    sim.wait_listening();
    assert_eq!(sim.get("/health").status, 200);
    // The older answer: 503 while loading.
    sim.faults(json!({"loading_s": 30, "loading_answers_503": true}));
    assert_eq!(sim.get("/health").status, 503);
    let early = sim.post("/v1/chat/completions", chat("hi", 2, false));
    assert_eq!(early.status, 503);
    let flagged = Sim::start(&["--startup-delay-s", "30", "--fault-loading-answers-503"]);
    assert_eq!(flagged.get("/health").status, 503);
}

#[test]
fn keep_alive_comments_fill_a_silent_stream() {
    let sim = Sim::start(&["--sse-keep-alive-interval", "0.05"]);
    sim.faults(json!({"stall_after_tokens": 1}));
    let mut stream = common::send(
        &sim.address,
        "POST",
        "/v1/chat/completions",
        &chat("hi", 8, true).to_string(),
    );
    read_until(&mut stream, "\"content\":\" ");
    // The stream is silent after its first token: comments follow (each its own HTTP chunk).
    let more = read_until(&mut stream, ": keep-alive\n\n");
    assert!(!more.contains("data:"), "{more}");
    // Off by default: nothing but events.
    let plain = Sim::start(&[]);
    let reply = plain.post("/v1/chat/completions", chat("hi", 3, true));
    assert!(!reply.text().contains("keep-alive"));
    drop(stream);
}

#[test]
fn cache_salt_and_lora_adapters_change_the_block_hashes() {
    let sim = Sim::start(&["--lora-modules", "sql=/loras/sql", "--block-size", "16"]);
    let prompt = "a long shared prefix ".repeat(20);
    let cached = |body: Value| -> u64 {
        let reply = sim.post("/v1/chat/completions", body);
        assert_eq!(reply.status, 200, "{}", reply.text());
        reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let base = chat(&prompt, 2, false);
    cached(base.clone());
    assert!(cached(base.clone()) > 0, "the same prompt hits");
    let mut salted = base.clone();
    salted["cache_salt"] = json!("tenant-a");
    assert_eq!(cached(salted.clone()), 0, "another salt misses");
    assert!(cached(salted) > 0, "the same salt hits");
    let mut adapter = base;
    adapter["model"] = json!("sql");
    assert_eq!(cached(adapter.clone()), 0, "another adapter misses");
    assert!(cached(adapter) > 0);

    let models = sim.get("/v1/models").json();
    let data = models["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data[0]["id"], "m");
    assert_eq!(data[0]["parent"], Value::Null);
    assert_eq!(data[1]["id"], "sql");
    assert_eq!(data[1]["root"], "/loras/sql");
    assert_eq!(data[1]["parent"], "m");
    assert_eq!(data[1]["max_model_len"], Value::Null);
}

#[test]
fn version_defaults_and_metrics_are_vllm_0_34s() {
    let sim = Sim::start(&[]);
    assert_eq!(sim.get("/version").json(), json!({"version": "0.34.0"}));
    let info = sim.get("/sim/info").json();
    assert_eq!(info["block_size"], 64);
    assert_eq!(info["max_num_seqs"], 256);
    assert_eq!(info["max_num_batched_tokens"], 2048);
    assert_eq!(info["vllm_version"], "0.34.0");
    let h100 = Sim::start(&["--gpu-profile", "h100"])
        .get("/sim/info")
        .json();
    assert_eq!(
        (
            h100["max_num_seqs"].clone(),
            h100["max_num_batched_tokens"].clone()
        ),
        (json!(1024), json!(8192))
    );
    let text = sim.metrics();
    assert!(text.contains("vllm:cache_config_info{block_size=\"64\","));
    assert!(text.contains("kv_cache_size_tokens=\"262144\""));
    assert!(!text.contains("vllm:gpu_cache_usage_perc"));
    let quiet = Sim::start(&["--disable-log-stats"]);
    assert_eq!(
        quiet
            .post("/v1/chat/completions", chat("hi", 2, false))
            .status,
        200
    );
    assert!(!quiet.metrics().contains("vllm:"));
}

/// The text of each content-bearing chunk of a stream (chat `delta.content` or completions
/// `text`), and the usage of each chunk that has one.
fn contents_and_usages(events: &[String]) -> (Vec<String>, Vec<Value>) {
    let chunks: Vec<Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).expect("a JSON chunk"))
        .collect();
    let contents = chunks
        .iter()
        .filter_map(|c| {
            let choice = c["choices"].get(0)?;
            let text = choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())?;
            (!text.is_empty()).then(|| text.to_string())
        })
        .collect();
    let usages = chunks
        .iter()
        .filter(|c| c["usage"].is_object())
        .map(|c| c["usage"].clone())
        .collect();
    (contents, usages)
}

#[test]
fn speculative_decoding_streams_several_tokens_an_event_with_exact_usage() {
    // vLLM 0.34 with `--spec-tokens K` (or `num_speculative_tokens` in `--speculative-config`)
    // streams each step's accepted drafts and sampled token as one delta. The sim's tokens are 4
    // bytes each, so an event's length says how many it carries.
    let sim = Sim::start(&["--spec-tokens", "2"]);
    let mut body = chat("tell me", 10, true);
    body["stream_options"] = json!({"include_usage": true});
    let reply = sim.post("/v1/chat/completions", body);
    assert!(reply.complete);
    let (contents, usages) = contents_and_usages(&reply.events().0);
    let sizes: Vec<usize> = contents.iter().map(|c| c.len() / 4).collect();
    assert_eq!(sizes, vec![1, 3, 2, 1, 3], "tokens per event");
    assert_eq!(usages.len(), 1);
    assert_eq!(
        usages[0]["completion_tokens"], 10,
        "usage counts tokens, not events"
    );

    // Continuous usage: each chunk's count is the tokens so far.
    let mut body = chat("tell me", 7, true);
    body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let reply = sim.post("/v1/chat/completions", body);
    let (contents, usages) = contents_and_usages(&reply.events().0);
    assert_eq!(contents.concat().len(), 28);
    let counts: Vec<u64> = usages
        .iter()
        .map(|u| u["completion_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(
        counts,
        vec![0, 1, 4, 6, 7, 7],
        "role chunk, four steps, the usage chunk"
    );

    // Completions, and a whole answer.
    let reply = sim.post(
        "/v1/completions",
        json!({"model": "m", "prompt": "once", "max_tokens": 5, "ignore_eos": true,
               "stream": true, "stream_options": {"include_usage": true}}),
    );
    let (contents, usages) = contents_and_usages(&reply.events().0);
    assert_eq!(
        contents.iter().map(|c| c.len() / 4).collect::<Vec<_>>(),
        vec![1, 3, 1]
    );
    assert_eq!(usages[0]["completion_tokens"], 5);
    let whole = sim
        .post("/v1/chat/completions", chat("tell me", 10, false))
        .json();
    assert_eq!(whole["usage"]["completion_tokens"], 10);
    assert_eq!(
        whole["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .len(),
        40
    );

    // A drop after N tokens comes after the event that reaches N (events are never split).
    sim.faults(json!({"disconnect_after_tokens": 5}));
    let reply = sim.post("/v1/chat/completions", chat("tell me", 10, true));
    assert!(!reply.complete, "the connection was dropped");
    let (contents, _) = contents_and_usages(&reply.events().0);
    assert_eq!(
        contents.concat().len(),
        6 * 4,
        "1 + 3 + 2 tokens, then the drop"
    );
}
