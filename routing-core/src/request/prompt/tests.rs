//! Tests of the prompt's canonical text, its block hashes and the request features.

use super::*;
use serde_json::json;

fn no_headers(_: &str) -> Option<String> {
    None
}

#[test]
fn next_turn_extends_previous_turn() {
    let turn1 = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"}
    ]);
    let turn2 = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "More"}]}
    ]);
    let tools = json!([
        {"type": "function", "function": {"name": "b", "parameters": {"y": 1, "x": 2}}},
        {"type": "function", "function": {"name": "a"}}
    ]);
    let a = canonical_chat_prompt(&turn1, Some(&tools)).unwrap();
    let b = canonical_chat_prompt(&turn2, Some(&tools)).unwrap();
    assert!(b.starts_with(&a), "{a:?} is not a prefix of {b:?}");
    let ha = block_hashes(a.as_bytes(), 4);
    let hb = block_hashes(b.as_bytes(), 4);
    assert!(!ha.is_empty());
    assert_eq!(ha[..], hb[..ha.len()]);
}

#[test]
fn tool_order_and_key_order_do_not_matter() {
    let msgs = json!([{"role": "user", "content": "x"}]);
    let t1 = json!([
        {"type": "function", "function": {"name": "b", "parameters": {"y": 1, "x": 2}}},
        {"type": "function", "function": {"name": "a"}}
    ]);
    let t2: Value = serde_json::from_str(
        r#"[{"function": {"name": "a"}, "type": "function"},
            {"function": {"parameters": {"x": 2, "y": 1}, "name": "b"}, "type": "function"}]"#,
    )
    .unwrap();
    assert_eq!(
        canonical_chat_prompt(&msgs, Some(&t1)).unwrap(),
        canonical_chat_prompt(&msgs, Some(&t2)).unwrap()
    );
    let without = canonical_chat_prompt(&msgs, None).unwrap();
    assert_eq!(
        without,
        canonical_chat_prompt(&msgs, Some(&json!([]))).unwrap()
    );
    assert_eq!(
        without,
        canonical_chat_prompt(&msgs, Some(&Value::Null)).unwrap()
    );
}

#[test]
fn roles_names_and_tool_calls_are_rendered() {
    let msgs = json!([
        {"role": "user", "name": "ann", "content": "q"},
        {"role": "assistant", "content": null,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}
    ]);
    let text = canonical_chat_prompt(&msgs, None).unwrap();
    assert!(text.starts_with("<|user|><|name|>ann\nq\n<|end|>\n<|assistant|>\n\n<|tool_calls|>"));
    assert!(text.contains("<|tool|>\n42\n<|tool_call_id|>c1\n<|end|>\n"));
    let as_user = json!([{"role": "assistant", "content": "q"}]);
    let as_asst = json!([{"role": "user", "content": "q"}]);
    assert_ne!(
        canonical_chat_prompt(&as_user, None).unwrap(),
        canonical_chat_prompt(&as_asst, None).unwrap()
    );
}

#[test]
fn media_parts_become_short_digests() {
    let big = "A".repeat(100_000);
    let msgs = json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{big}")}},
        {"type": "text", "text": "what is this"}
    ]}]);
    let text = canonical_chat_prompt(&msgs, None).unwrap();
    assert!(text.len() < 200);
    assert!(text.contains("<|image_url:"));
}

#[test]
fn chat_errors_are_typed() {
    assert_eq!(
        canonical_chat_prompt(&json!({}), None),
        Err(invalid("messages", "an array of messages"))
    );
    assert_eq!(
        canonical_chat_prompt(&json!([]), None),
        Err(PromptError::EmptyMessages)
    );
    assert!(matches!(
        canonical_chat_prompt(&json!([{"content": "x"}]), None),
        Err(PromptError::InvalidMessage { index: 0, .. })
    ));
    assert!(matches!(
        canonical_chat_prompt(
            &json!([{"role": "user", "content": "x"}, {"role": "user", "content": 5}]),
            None
        ),
        Err(PromptError::InvalidMessage { index: 1, .. })
    ));
    assert!(canonical_chat_prompt(
        &json!([{"role": "user", "content": [{"type": "text"}]}]),
        None
    )
    .is_err());
    assert!(
        canonical_chat_prompt(&json!([{"role": "user", "content": "x"}]), Some(&json!({})))
            .is_err()
    );
}

#[test]
fn completion_prompt_shapes() {
    assert_eq!(canonical_completion_prompt(&json!("abc")).unwrap(), "abc");
    assert_eq!(
        canonical_completion_prompt(&json!(["ab", "cd"])).unwrap(),
        "ab\u{1e}cd"
    );
    let toks = canonical_completion_prompt(&json!([0, 1, 16777215])).unwrap();
    assert_eq!(toks, "AAAAAAAB____");
    assert_eq!(estimate_tokens(&toks), 3);
    let batch = canonical_completion_prompt(&json!([[1], [2, 3]])).unwrap();
    assert_eq!(batch.len(), 4 + 1 + 8);
    for bad in [
        json!([]),
        json!(5),
        json!([1, "a"]),
        json!([-1]),
        json!([1.5]),
        json!([16777216]),
        json!([[1], ["a"]]),
        json!(null),
    ] {
        assert!(canonical_completion_prompt(&bad).is_err(), "{bad}");
    }
}

#[test]
fn block_hashes_cover_full_blocks_only_and_chain() {
    let text = "x".repeat(64 * 3 + 10);
    let h = block_hashes(text.as_bytes(), 16);
    assert_eq!(h.len(), 3);
    assert_ne!(
        h[0], h[1],
        "equal blocks at different positions hash differently"
    );
    assert!(block_hashes(b"short", 16).is_empty());
    let other = format!("y{}", &text[1..]);
    let h2 = block_hashes(other.as_bytes(), 16);
    assert!(
        h.iter().zip(&h2).all(|(a, b)| a != b),
        "a change in block 0 changes every hash"
    );
    assert_eq!(
        block_hashes(b"abcd", 0).len(),
        1,
        "block size 0 is treated as 1 token"
    );
}

#[test]
fn estimate_rounds_up() {
    assert_eq!(estimate_tokens(""), 0);
    assert_eq!(estimate_tokens("a"), 1);
    assert_eq!(estimate_tokens("abcd"), 1);
    assert_eq!(estimate_tokens("abcde"), 2);
}

#[test]
fn features_of_a_chat_request() {
    let body = json!({
        "model": "llama", "stream": true, "max_tokens": 50, "max_completion_tokens": 70,
        "user": "u-1",
        "messages": [{"role": "user", "content": "x".repeat(200)}]
    });
    let headers = |name: &str| (name == "x-request-id").then(|| "req-9".to_string());
    let f = request_features(&body, &headers, &FeatureConfig::default()).unwrap();
    assert_eq!(f.request_id, "req-9");
    assert_eq!(f.kind, Endpoint::Chat);
    assert_eq!(f.model, "llama");
    assert!(f.stream);
    assert_eq!(f.max_tokens, 70);
    assert_eq!(f.routing_key.as_deref(), Some("u-1"));
    assert!(f.prompt_tokens >= 50);
    assert_eq!(f.block_hashes.len(), f.prompt_tokens as usize / 16);
    assert_eq!(f.block_tokens, 16);
}

#[test]
fn features_of_a_completion_request_with_defaults_and_cap() {
    let body = json!({"model": "m", "prompt": "p".repeat(64 * 10)});
    let cfg = FeatureConfig {
        max_blocks: 4,
        default_max_tokens: 99,
        ..FeatureConfig::default()
    };
    let f = request_features(&body, &no_headers, &cfg).unwrap();
    assert_eq!(f.kind, Endpoint::Completions);
    assert_eq!(f.max_tokens, 99);
    assert!(!f.stream);
    assert_eq!(f.block_hashes.len(), 4);
    assert_eq!(f.prompt_tokens, 160);
}

#[test]
fn feature_errors_name_the_parameter() {
    let cfg = FeatureConfig::default();
    let cases = [
        (json!([]), None),
        (json!({"messages": []}), Some("model")),
        (json!({"model": 3, "prompt": "x"}), Some("model")),
        (json!({"model": "m"}), Some("messages")),
        (
            json!({"model": "m", "prompt": "x", "stream": "yes"}),
            Some("stream"),
        ),
        (
            json!({"model": "m", "prompt": "x", "max_tokens": -1}),
            Some("max_tokens"),
        ),
        (json!({"model": "m", "messages": "hi"}), Some("messages")),
    ];
    for (body, param) in cases {
        let err = request_features(&body, &no_headers, &cfg).unwrap_err();
        assert_eq!(err.param(), param, "{body}: {err}");
        assert!(!err.to_string().is_empty());
    }
}

#[test]
fn deep_json_does_not_overflow() {
    let mut v = json!(1);
    for _ in 0..1000 {
        v = json!([v]);
    }
    let mut out = String::new();
    canonical_json(&v, &mut out, 0);
    assert!(out.contains("null"));
}

#[test]
fn every_endpoint_names_its_own_missing_input() {
    let config = FeatureConfig::default();
    let none = |_: &str| None;
    let call = |endpoint, body: Value| endpoint_features(endpoint, &body, &none, &config);
    let chat_with_prompt = call(Endpoint::Chat, json!({"model": "m", "prompt": "x"}));
    assert_eq!(
        chat_with_prompt,
        Err(PromptError::MissingInput { field: "messages" })
    );
    let completion_with_messages = call(
        Endpoint::Completions,
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(
        completion_with_messages.unwrap_err().param(),
        Some("prompt")
    );
    let e = call(Endpoint::Embeddings, json!({"model": "m"})).unwrap_err();
    assert_eq!(
        (e.param(), e.to_string().as_str()),
        (Some("input"), "`input` is required")
    );
}

#[test]
fn embeddings_share_the_chat_errors_for_model_and_body() {
    let config = FeatureConfig::default();
    let none = |_: &str| None;
    for endpoint in [Endpoint::Chat, Endpoint::Embeddings] {
        let call = |body: Value| endpoint_features(endpoint, &body, &none, &config);
        assert_eq!(call(json!([1])), Err(PromptError::NotAnObject));
        assert_eq!(
            call(json!({"input": "x", "messages": []})),
            Err(PromptError::MissingModel)
        );
        assert_eq!(
            call(json!({"model": 5, "input": "x"})),
            Err(invalid("model", "a non-empty string"))
        );
    }
    let bad_input = endpoint_features(
        Endpoint::Embeddings,
        &json!({"model": "m", "input": {}}),
        &none,
        &config,
    );
    assert_eq!(bad_input, Err(invalid("input", "a string or an array")));
}

#[test]
fn absurd_model_ids_are_refused_on_every_endpoint() {
    let config = FeatureConfig::default();
    let none = |_: &str| None;
    let long = "m".repeat(MAX_MODEL_BYTES + 1);
    let longest = "m".repeat(MAX_MODEL_BYTES);
    let endpoints = [
        Endpoint::Chat,
        Endpoint::Completions,
        Endpoint::Embeddings,
        Endpoint::Responses,
        Endpoint::Messages,
        Endpoint::MessagesCountTokens,
        Endpoint::Rerank,
    ];
    for endpoint in endpoints {
        let call = |model: &str| {
            let body = match endpoint {
                Endpoint::Chat => {
                    json!({"model": model, "messages": [{"role": "user", "content": "x"}]})
                }
                Endpoint::Completions => json!({"model": model, "prompt": "x"}),
                Endpoint::Embeddings | Endpoint::Responses => json!({"model": model, "input": "x"}),
                Endpoint::Messages | Endpoint::MessagesCountTokens => {
                    json!({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
                }
                _ => json!({"model": model, "query": "q", "documents": ["x"]}),
            };
            endpoint_features(endpoint, &body, &none, &config)
        };
        for bad in [long.as_str(), "llama\n", "a\u{0}b", "x\u{7f}"] {
            let e = call(bad).unwrap_err();
            assert_eq!(
                (e.param(), e.code()),
                (Some("model"), "invalid_type"),
                "{bad:?}"
            );
        }
        assert!(call(&longest).is_ok());
        assert!(call("meta-llama/Llama-3.1-8B-Instruct").is_ok());
    }
}

#[test]
fn embeddings_count_their_input_and_expect_no_output() {
    let none = |_: &str| None;
    let body = json!({"model": "m", "input": ["abcdefgh", [1, 2, 3], 7]});
    let f = endpoint_features(
        Endpoint::Embeddings,
        &body,
        &none,
        &FeatureConfig::default(),
    )
    .unwrap();
    assert_eq!(
        (f.model.as_str(), f.prompt_tokens, f.max_tokens),
        ("m", 2 + 3 + 1, 0)
    );
    assert!(f.block_hashes.is_empty());
}

/// vLLM mixes a request's `cache_salt` into its block hashes: the same prompt under two salts
/// (two tenants isolated on purpose) shares no cached prefix, so it shares no affinity either;
/// under one salt it does.
#[test]
fn a_cache_salt_starts_its_own_prefix_chain() {
    let config = FeatureConfig::default();
    let text = "a long shared system prompt ".repeat(40);
    let hashes = |salt: Option<&str>| {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": text}]});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        request_features(&body, &no_headers, &config)
            .unwrap()
            .block_hashes
    };
    let (none, a, a_again, b) = (
        hashes(None),
        hashes(Some("tenant-a")),
        hashes(Some("tenant-a")),
        hashes(Some("tenant-b")),
    );
    assert!(!none.is_empty());
    assert_eq!(a, a_again);
    assert_ne!(a[0], none[0]);
    assert_ne!(a[0], b[0]);
    // An empty salt is no salt.
    assert_eq!(hashes(Some("")), none);
}
