//! vLLM 0.34's routes beside the completion ones (issue 43), on the built binary over real HTTP:
//! tokenize/detokenize on any model, rerank/score/pooling/classify by task (a chat model answers
//! FastAPI's 404), the audio routes with a multipart WAV (whole and streamed), and a LoRA adapter
//! listed with `parent`/`root` and served by name.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Child;

use serde_json::{json, Value};

mod common;
use common::{Reply, PATIENCE};

struct Sim {
    child: Child,
    address: String,
}

impl Sim {
    fn start(extra: &[&str]) -> Sim {
        let mut args = vec!["--time-scale", "100"];
        args.extend_from_slice(extra);
        let (child, address) = common::spawn(&args);
        Sim { child, address }
    }

    fn post(&self, path: &str, body: Value) -> Reply {
        let mut stream = common::send(&self.address, "POST", path, &body.to_string());
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).expect("reads");
        Reply::parse(&raw)
    }

    fn get(&self, path: &str) -> Reply {
        let mut stream = common::send(&self.address, "GET", path, "");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).expect("reads");
        Reply::parse(&raw)
    }

    fn post_form(&self, path: &str, fields: &[(&str, &str)], file: &[u8]) -> Reply {
        let b = "simboundary42";
        let mut body = Vec::new();
        for (k, v) in fields {
            body.extend_from_slice(
                format!("--{b}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n")
                    .as_bytes(),
            );
        }
        body.extend_from_slice(format!("--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").as_bytes());
        body.extend_from_slice(file);
        body.extend_from_slice(format!("\r\n--{b}--\r\n").as_bytes());
        let mut stream = TcpStream::connect(&self.address).expect("connects");
        stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary={b}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).expect("writes");
        stream.write_all(&body).expect("writes");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).expect("reads");
        Reply::parse(&raw)
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wav(seconds: u32) -> Vec<u8> {
    let (rate, data) = (16_000u32, 32_000 * seconds);
    let mut w = b"RIFF".to_vec();
    w.extend_from_slice(&(36 + data).to_le_bytes());
    w.extend_from_slice(b"WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00");
    w.extend_from_slice(&rate.to_le_bytes());
    w.extend_from_slice(&(rate * 2).to_le_bytes());
    w.extend_from_slice(b"\x02\x00\x10\x00data");
    w.extend_from_slice(&data.to_le_bytes());
    w.resize(w.len() + data as usize, 0);
    w
}

#[test]
fn tokenize_and_detokenize_on_a_chat_model() {
    let sim = Sim::start(&["--model", "chat"]);
    let r = sim.post(
        "/tokenize",
        json!({"model": "chat", "prompt": "hello world!"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(
        (v["count"].as_u64(), v["max_model_len"].as_u64()),
        (Some(3), Some(32768))
    );
    let back = sim.post(
        "/detokenize",
        json!({"model": "chat", "tokens": v["tokens"]}),
    );
    assert_eq!(back.json()["prompt"], "hello world!");
    let chat = sim.post(
        "/tokenize",
        json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert!(chat.json()["count"].as_u64().unwrap() > 1);
    assert_eq!(
        sim.post("/tokenize", json!({"model": "nope", "prompt": "x"}))
            .status,
        404
    );
    assert_eq!(sim.post("/tokenize", json!({"model": "chat"})).status, 400);
    assert_eq!(sim.post("/detokenize", json!({"tokens": [-1]})).status, 400);
    // A chat model has no scoring or pooling routes: FastAPI's 404.
    for path in [
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/v1/score",
        "/pooling",
        "/classify",
        "/v1/audio/transcriptions",
    ] {
        let r = sim.post(
            path,
            json!({"model": "chat", "query": "q", "documents": ["d"]}),
        );
        assert_eq!(
            (r.status, r.json()),
            (404, json!({"detail": "Not Found"})),
            "{path}"
        );
    }
}

#[test]
fn a_cross_encoder_reranks_scores_classifies_and_pools() {
    let sim = Sim::start(&["--model", "rr", "--task", "classify"]);
    let docs = [
        "bananas are yellow",
        "Paris is the capital of France",
        "the sky",
    ];
    for path in ["/v1/rerank", "/rerank", "/v2/rerank"] {
        let r = sim.post(
            path,
            json!({"model": "rr", "query": "capital of France", "documents": docs, "top_n": 2}),
        );
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        let v = r.json();
        assert_eq!(v["results"].as_array().unwrap().len(), 2);
        assert_eq!(v["results"][0]["index"], 1);
        assert_eq!(v["results"][0]["document"]["text"], docs[1]);
        let usage = &v["usage"];
        assert!(usage["prompt_tokens"].as_u64().unwrap() > 0);
        assert_eq!(usage["prompt_tokens"], usage["total_tokens"]);
        assert!(v["id"].as_str().unwrap().starts_with("score-"));
    }
    let s = sim
        .post(
            "/v1/score",
            json!({"model": "rr", "queries": "q", "documents": ["a", "b"]}),
        )
        .json();
    assert_eq!(s["object"], "list");
    assert_eq!(s["data"][1]["object"], "score");
    assert_eq!(s["usage"]["prompt_tokens"], 4);
    let mismatch = sim.post(
        "/score",
        json!({"model": "rr", "text_1": ["a", "b"], "text_2": ["a", "b", "c"]}),
    );
    assert_eq!(mismatch.status, 400);
    let c = sim
        .post(
            "/classify",
            json!({"model": "rr", "input": ["good", "bad"]}),
        )
        .json();
    assert_eq!(
        (
            c["data"][0]["num_classes"].as_u64(),
            c["usage"]["prompt_tokens"].as_u64()
        ),
        (Some(1), Some(2))
    );
    let p = sim
        .post("/pooling", json!({"model": "rr", "input": "text"}))
        .json();
    assert_eq!(p["data"][0]["object"], "pooling");
    assert_eq!(
        sim.post(
            "/v1/chat/completions",
            json!({"model": "rr", "messages": []})
        )
        .status,
        404
    );
    assert_eq!(
        sim.post("/v1/rerank", json!({"model": "rr", "query": "q"}))
            .status,
        400
    );
}

#[test]
fn an_embedding_model_scores_but_does_not_classify_and_a_multi_label_one_does_not_score() {
    let embed = Sim::start(&["--model", "e", "--task", "embed"]);
    assert_eq!(
        embed
            .post(
                "/score",
                json!({"model": "e", "text_1": "a", "text_2": "b"})
            )
            .status,
        200
    );
    assert_eq!(
        embed
            .post("/classify", json!({"model": "e", "input": "a"}))
            .status,
        404
    );
    let p = embed
        .post("/pooling", json!({"model": "e", "input": ["a", "b"]}))
        .json();
    assert_eq!(p["data"][0]["data"].as_array().unwrap().len(), 32);
    let labels = Sim::start(&["--model", "c", "--task", "classify", "--num-labels", "3"]);
    assert_eq!(
        labels
            .post(
                "/v1/rerank",
                json!({"model": "c", "query": "q", "documents": ["d"]})
            )
            .status,
        404
    );
    let c = labels
        .post("/classify", json!({"model": "c", "input": "a"}))
        .json();
    assert_eq!(c["data"][0]["probs"].as_array().unwrap().len(), 3);
}

#[test]
fn a_transcription_model_transcribes_and_translates() {
    let sim = Sim::start(&["--model", "whisper", "--task", "transcription"]);
    let audio = wav(2);
    let r = sim.post_form("/v1/audio/transcriptions", &[("model", "whisper")], &audio);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(!v["text"].as_str().unwrap().is_empty());
    assert_eq!(v["usage"], json!({"type": "duration", "seconds": 2}));
    let t = sim
        .post_form("/v1/audio/translations", &[("model", "whisper")], &audio)
        .json();
    assert!(t.get("usage").is_none() && t["text"] == v["text"]);
    let s = sim.post_form(
        "/v1/audio/transcriptions",
        &[
            ("model", "whisper"),
            ("stream", "true"),
            ("stream_include_usage", "true"),
        ],
        &audio,
    );
    assert!(s
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let text = s.text();
    assert!(
        text.contains("\"transcription.chunk\"") && text.contains("\"finish_reason\":\"stop\"")
    );
    assert!(text.contains("\"choices\":[],") && text.trim_end().ends_with("data: [DONE]"));
    let no_file = sim.post("/v1/audio/transcriptions", json!({"model": "whisper"}));
    assert_eq!(no_file.status, 400);
    assert_eq!(sim.post("/v1/chat/completions", json!({})).status, 404);
}

#[test]
fn lora_adapters_are_listed_with_parent_and_root_and_served() {
    let sim = Sim::start(&["--model", "base", "--lora-modules", "sql=/loras/sql"]);
    let models = sim.get("/v1/models").json();
    let sql = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "sql")
        .cloned()
        .unwrap();
    assert_eq!(
        (sql["parent"].as_str(), sql["root"].as_str()),
        (Some("base"), Some("/loras/sql"))
    );
    let r = sim.post(
        "/v1/chat/completions",
        json!({"model": "sql", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    );
    assert_eq!((r.status, r.json()["model"].as_str()), (200, Some("sql")));
    assert_eq!(
        sim.post("/tokenize", json!({"model": "sql", "prompt": "abcd"}))
            .json()["count"],
        1
    );
}
