//! End-to-end checks of the sim's Responses API and Anthropic Messages routes over real HTTP: the
//! whole and streamed shapes (event types, their order, `sequence_number`s, usage), stored
//! responses (`previous_response_id` extending the earlier prompt so the prefix cache hits,
//! `GET /v1/responses/{id}`, an unknown id's 404), and Messages' errors in Anthropic's shape and
//! `count_tokens`. Each test starts its own sim process, as `tests/http.rs` does.

use std::io::Read;
use std::process::Child;

use serde_json::{json, Value};

mod common;
use common::Reply;

struct Sim {
    child: Child,
    address: String,
}

impl Sim {
    fn start() -> Sim {
        let args = [
            "--model",
            "m",
            "--decode-ms-per-step",
            "1",
            "--prefill-us-per-token",
            "1",
            "--enable-prompt-tokens-details",
        ];
        let (child, address) = common::spawn(&args);
        Sim { child, address }
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
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `(event type, data)` of each named event of a stream.
fn named_events(reply: &Reply) -> Vec<(String, Value)> {
    reply
        .text()
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut lines = e.lines();
            let kind = lines
                .next()
                .and_then(|l| l.strip_prefix("event: "))
                .expect("an event line")
                .to_string();
            let data = lines
                .next()
                .and_then(|l| l.strip_prefix("data: "))
                .expect("a data line");
            (kind, serde_json::from_str(data).expect("JSON data"))
        })
        .collect()
}

// Over two of vLLM 0.34's 64-token blocks, so a repeat has a cached prefix.
const LONG: &str = "You are a careful assistant that answers questions about routing, caching and \
    the many ways a fleet of inference servers can be kept busy without wasting prefill work. \
    Cite the configuration you rely on, say which server held which prefix and why, and never \
    guess at a number you were not given: an operator reads every answer against the metrics. \
    When two servers could serve a request, prefer the one whose cache holds the conversation.";

#[test]
fn responses_stream_in_vllms_order_with_sequence_numbers_and_usage() {
    let sim = Sim::start();
    let reply = sim.exchange(
        "POST",
        "/v1/responses",
        &json!({"model": "m", "input": "Hello there", "instructions": LONG, "max_output_tokens": 8, "stream": true}),
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    let events = named_events(&reply);
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    let mut deduped = kinds.clone();
    deduped.dedup();
    let terminal = *kinds.last().unwrap();
    assert!(terminal == "response.completed" || terminal == "response.incomplete");
    assert_eq!(
        &deduped[..6],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
        ]
    );
    assert_eq!(
        &deduped[6..],
        [
            "response.content_part.done",
            "response.output_item.done",
            terminal
        ]
    );
    for (i, (kind, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], kind.as_str());
        assert_eq!(data["sequence_number"], i as u64);
    }
    let (_, done) = events.last().unwrap();
    let usage = &done["response"]["usage"];
    let input = usage["input_tokens"].as_u64().unwrap();
    let output = usage["output_tokens"].as_u64().unwrap();
    assert!(input > 20 && (1..=8).contains(&output), "{usage}");
    assert_eq!(usage["total_tokens"].as_u64(), Some(input + output));
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    assert!(events[0].1["response"]["id"]
        .as_str()
        .unwrap()
        .starts_with("resp_"));
}

#[test]
fn previous_response_id_extends_the_prompt_and_hits_the_cache() {
    let sim = Sim::start();
    let first = sim.exchange(
        "POST",
        "/v1/responses",
        &json!({"model": "m", "input": "What is a prefix cache?", "instructions": LONG, "max_output_tokens": 12}),
    );
    assert_eq!(first.status, 200, "{}", first.text());
    let first = first.json();
    assert_eq!(first["object"], "response");
    assert_eq!(first["output"][0]["type"], "message");
    assert_eq!(first["output"][0]["content"][0]["type"], "output_text");
    let id = first["id"].as_str().unwrap();
    let second = sim
        .exchange(
            "POST",
            "/v1/responses",
            &json!({"model": "m", "input": "And why does it matter?", "instructions": LONG, "previous_response_id": id, "max_output_tokens": 4}),
        )
        .json();
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let first_input = first["usage"]["input_tokens"].as_u64().unwrap();
    assert!(
        cached >= first_input - 16,
        "turn 2 reuses turn 1's prompt: {cached} of {first_input}"
    );
    assert!(second["usage"]["input_tokens"].as_u64().unwrap() > first_input);
    assert_eq!(second["previous_response_id"], id);

    let stored = sim.exchange("GET", &format!("/v1/responses/{id}"), &Value::Null);
    assert_eq!(stored.status, 200);
    assert_eq!(stored.json()["id"], id);

    let cancel = sim.exchange("POST", &format!("/v1/responses/{id}/cancel"), &json!({}));
    assert_eq!(cancel.status, 400);

    // vLLM 0.34 routes no DELETE for a stored response: FastAPI's 405 for the path's other method.
    let delete = sim.exchange("DELETE", &format!("/v1/responses/{id}"), &Value::Null);
    assert_eq!(delete.status, 405);
    let still = sim.exchange("GET", &format!("/v1/responses/{id}"), &Value::Null);
    assert_eq!(still.status, 200);

    let missing = sim.exchange(
        "POST",
        "/v1/responses",
        &json!({"model": "m", "input": "x", "previous_response_id": "resp_gone"}),
    );
    assert_eq!(missing.status, 404);
    let error = missing.json();
    assert_eq!(
        error["error"]["message"],
        "Response with id 'resp_gone' not found."
    );
    assert_eq!(error["error"]["param"], "response_id");
    let unknown = sim.exchange("GET", "/v1/responses/resp_gone", &Value::Null);
    assert_eq!(unknown.status, 404);

    let unstored = sim
        .exchange(
            "POST",
            "/v1/responses",
            &json!({"model": "m", "input": "not kept", "store": false, "max_output_tokens": 2}),
        )
        .json();
    let id = unstored["id"].as_str().unwrap();
    let gone = sim.exchange("GET", &format!("/v1/responses/{id}"), &Value::Null);
    assert_eq!(gone.status, 404);
}

#[test]
fn messages_whole_stream_errors_and_count_tokens() {
    let sim = Sim::start();
    let request = json!({"model": "m", "max_tokens": 6, "system": LONG, "messages": [{"role": "user", "content": "Hi"}]});
    let whole = sim.exchange("POST", "/v1/messages", &request);
    assert_eq!(whole.status, 200, "{}", whole.text());
    let whole = whole.json();
    assert_eq!(whole["type"], "message");
    assert_eq!(whole["role"], "assistant");
    assert_eq!(whole["content"][0]["type"], "text");
    assert!(whole["usage"]["output_tokens"].as_u64().unwrap() >= 1);
    assert!(whole["id"].as_str().unwrap().starts_with("msg_"));

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let reply = sim.exchange("POST", "/v1/messages", &streamed);
    assert_eq!(reply.status, 200);
    let events = named_events(&reply);
    let mut kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    kinds.dedup();
    assert_eq!(
        kinds,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert!(
        events[0].1["message"]["usage"]["input_tokens"]
            .as_u64()
            .unwrap()
            > 20
    );
    let delta = &events[events.len() - 2].1;
    assert!(delta["usage"]["output_tokens"].as_u64().unwrap() >= 1);
    // The same prompt again: its prefix is cached, counted as Anthropic counts it.
    assert!(delta["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0);
    assert!(delta["delta"]["stop_reason"].is_string());

    let missing_max = sim.exchange(
        "POST",
        "/v1/messages",
        &json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(missing_max.status, 400);
    let error = missing_max.json();
    assert_eq!(error["type"], "error");
    assert_eq!(error["error"]["type"], "invalid_request_error");

    let unknown = sim.exchange(
        "POST",
        "/v1/messages",
        &json!({"model": "nope", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.json()["error"]["type"], "not_found_error");

    let count = sim.exchange(
        "POST",
        "/v1/messages/count_tokens",
        &json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(count.status, 200);
    assert!(count.json()["input_tokens"].as_u64().unwrap() > 0);
}
