//! Native tests of the pass-through routes' features: each vLLM 0.34 request shape read for its
//! model and prompt estimate, bad bodies refused with a named parameter, multipart forms read
//! for `model`/`stream` without the file, and usage read from each route's answer.

use super::*;
use crate::request::prompt::{endpoint_features, FeatureConfig};
use crate::stream::usage::body_usage;
use serde_json::json;

fn no_header(_: &str) -> Option<String> {
    None
}

fn features(endpoint: Endpoint, body: Value) -> Result<RequestFeatures, PromptError> {
    endpoint_features(endpoint, &body, &no_header, &FeatureConfig::default())
}

#[test]
fn tokenize_reads_prompt_or_messages() {
    let f = features(
        Endpoint::Tokenize,
        json!({"model": "m", "prompt": "abcdefgh"}),
    )
    .unwrap();
    assert_eq!(
        (f.kind, f.model.as_str(), f.prompt_tokens),
        (Endpoint::Tokenize, "m", 2)
    );
    assert!(f.block_hashes.is_empty() && !f.stream && f.max_tokens == 0);
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}]});
    assert!(features(Endpoint::Tokenize, chat).unwrap().prompt_tokens > 2);
    let err = features(Endpoint::Tokenize, json!({"model": "m"})).unwrap_err();
    assert_eq!(err.param(), Some("prompt"));
    // vLLM would take its first model; the gateway needs one to choose a backend.
    let err = features(Endpoint::Tokenize, json!({"prompt": "x"})).unwrap_err();
    assert_eq!(err, PromptError::MissingModel);
}

#[test]
fn detokenize_counts_its_tokens() {
    let f = features(
        Endpoint::Detokenize,
        json!({"model": "m", "tokens": [1, 2, 3]}),
    )
    .unwrap();
    assert_eq!(f.prompt_tokens, 3);
    let err = features(Endpoint::Detokenize, json!({"model": "m", "tokens": "x"})).unwrap_err();
    assert_eq!(err.param(), Some("tokens"));
}

#[test]
fn rerank_and_score_estimate_every_scored_pair() {
    // 1:N: the query (2 tokens) with each of 3 documents (1 token each).
    let body = json!({"model": "r", "query": "abcdefgh", "documents": ["a", "b", "c"], "top_n": 2});
    assert_eq!(
        features(Endpoint::Rerank, body).unwrap().prompt_tokens,
        3 * 2 + 3
    );
    let err = features(Endpoint::Rerank, json!({"model": "r", "query": "q"})).unwrap_err();
    assert_eq!(err.param(), Some("documents"));
    let err = features(
        Endpoint::Rerank,
        json!({"model": "r", "query": "q", "documents": []}),
    )
    .unwrap_err();
    assert_eq!(err.param(), Some("documents"));
    // Score's four shapes; N:N pairs in order.
    for (a, b) in [
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
        ("text_1", "text_2"),
    ] {
        let body = json!({"model": "r", a: ["abcd", "abcd"], b: ["abcdefgh", "a"]});
        assert_eq!(
            features(Endpoint::Score, body).unwrap().prompt_tokens,
            2 + 3,
            "{a}/{b}"
        );
    }
    let body = json!({"model": "r", "text_1": "abcd", "text_2": ["a", "b"]});
    assert_eq!(
        features(Endpoint::Score, body).unwrap().prompt_tokens,
        2 + 2
    );
    let err = features(Endpoint::Score, json!({"model": "r", "query": "q"})).unwrap_err();
    assert_eq!(err.code(), "missing_prompt");
    // Multimodal content items count their text parts.
    let body = json!({"model": "r", "query": {"content": [{"type": "text", "text": "abcd"}]}, "documents": "ab"});
    assert_eq!(features(Endpoint::Rerank, body).unwrap().prompt_tokens, 2);
}

#[test]
fn pooling_and_classify_read_input_or_messages() {
    for e in [Endpoint::Pooling, Endpoint::Classify] {
        let f = features(e, json!({"model": "c", "input": ["abcd", "abcdabcd"]})).unwrap();
        assert_eq!((f.kind, f.prompt_tokens), (e, 3));
        let f = features(e, json!({"model": "c", "input": [[1, 2, 3]]})).unwrap();
        assert_eq!(f.prompt_tokens, 3);
        let err = features(e, json!({"model": "c", "input": 5})).unwrap_err();
        assert_eq!(err.param(), Some("input"));
        let chat = json!({"model": "c", "messages": [{"role": "user", "content": "hi"}]});
        assert!(features(e, chat).unwrap().prompt_tokens > 0);
    }
}

#[test]
fn bad_bodies_are_errors_not_panics() {
    for e in Endpoint::PASSTHROUGH
        .into_iter()
        .filter(|e| !e.is_multipart())
    {
        for body in [
            json!([]),
            json!(null),
            json!({"model": 3}),
            json!({"model": ""}),
        ] {
            assert!(features(e, body).is_err(), "{e:?}");
        }
    }
    assert!(passthrough_features(
        Endpoint::Transcriptions,
        &json!({"model": "w"}),
        &no_header,
        None
    )
    .is_err());
}

fn form(boundary: &str, parts: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in parts {
        out.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        if *name == "file" {
            out.extend_from_slice(b"Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n");
        } else {
            out.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
            );
        }
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    out
}

#[test]
fn multipart_forms_give_model_and_stream_without_the_file() {
    // The file holds bytes that look like a delimiter's prefix and a model field.
    let file: &[u8] = b"RIFF\x00\x01-- name=\"model\"\r\n\r\nwrong\r\n";
    let body = form(
        "XyZ",
        &[
            ("file", file),
            ("model", b"whisper-small"),
            ("stream", b"true"),
        ],
    );
    let ct = "multipart/form-data; boundary=XyZ";
    let f = multipart_features(Endpoint::Transcriptions, ct, &body, &no_header).unwrap();
    assert_eq!(
        (f.kind, f.model.as_str(), f.stream),
        (Endpoint::Transcriptions, "whisper-small", true)
    );
    assert!(f.block_hashes.is_empty() && f.prompt_tokens == 0);
    let quoted = "Multipart/Form-Data; charset=utf-8; boundary=\"XyZ\"";
    assert_eq!(
        multipart_features(Endpoint::Translations, quoted, &body, &no_header)
            .unwrap()
            .model,
        "whisper-small"
    );

    let no_model = form("b", &[("file", b"abc")]);
    let err = multipart_features(
        Endpoint::Transcriptions,
        "multipart/form-data; boundary=b",
        &no_model,
        &no_header,
    )
    .unwrap_err();
    assert_eq!(err, PromptError::MissingModel);
    let err = multipart_features(
        Endpoint::Transcriptions,
        "application/json",
        &body,
        &no_header,
    )
    .unwrap_err();
    assert_eq!(err.param(), Some("content-type"));
    // A body that does not match its boundary, or is cut short.
    for broken in [&b"garbage"[..], &body[..body.len() / 2], b""] {
        assert!(multipart_features(Endpoint::Transcriptions, ct, broken, &no_header).is_err());
    }
    let bad_stream = form("b", &[("model", b"w"), ("stream", b"maybe")]);
    let err = multipart_features(
        Endpoint::Transcriptions,
        "multipart/form-data; boundary=b",
        &bad_stream,
        &no_header,
    )
    .unwrap_err();
    assert_eq!(err.param(), Some("stream"));
}

#[test]
fn usage_is_read_from_each_answer_that_has_it() {
    // vLLM 0.34's RerankResponse, ScoreResponse, PoolingResponse, ClassificationResponse.
    let rerank = br#"{"id":"rerank-1","model":"r","usage":{"prompt_tokens":12,"total_tokens":12},"results":[]}"#;
    assert_eq!(body_usage(rerank).unwrap().unwrap().prompt_tokens, 12);
    let score = br#"{"id":"score-1","object":"list","created":1,"model":"r","data":[],"usage":{"prompt_tokens":7,"total_tokens":7,"completion_tokens":0,"prompt_tokens_details":null}}"#;
    assert_eq!(body_usage(score).unwrap().unwrap().total(), 7);
    // A transcription's usage is audio seconds, not tokens: read, nothing charged.
    let audio = br#"{"text":"hi","usage":{"type":"duration","seconds":2}}"#;
    assert_eq!(body_usage(audio).unwrap().unwrap().total(), 0);
    // Tokenize and detokenize answer no usage.
    assert_eq!(
        body_usage(br#"{"count":2,"max_model_len":8,"tokens":[1,2]}"#).unwrap(),
        None
    );
}

#[test]
fn the_model_seeds_the_prefix_hashes() {
    let text = "x".repeat(256);
    let chat = |model: &str| {
        features(
            Endpoint::Completions,
            json!({"model": model, "prompt": text}),
        )
        .unwrap()
        .block_hashes
    };
    assert_eq!(chat("base"), chat("base"));
    assert_ne!(chat("base")[0], chat("sql-lora")[0]);
    assert_eq!(chat("base").len(), chat("sql-lora").len());
}
