//! Tests of the resumption's request check, partial answer, continuation and splice.

use super::*;

/// [`check_request`] on a body given as its JSON text.
fn check(body: &[u8], endpoint: Endpoint) -> Result<(), NotResumable> {
    let body: Value = serde_json::from_slice(body).expect("a JSON body");
    check_request(&body, endpoint)
}

fn chat_chunk(content: &str) -> String {
    format!("data: {{\"id\":\"chatcmpl-a\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n", json!(content))
}
const ROLE: &str = "data: {\"id\":\"chatcmpl-a\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";

fn events(bytes: &[u8]) -> Vec<Value> {
    let mut out = Vec::new();
    Events::default().push(bytes, |_, d| {
        out.push(serde_json::from_slice(d).unwrap_or(Value::Null));
    });
    out
}

#[test]
fn requests_that_rule_a_resume_out_are_recognised() {
    let ok = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"n":1,"logprobs":false,"response_format":{"type":"text"},"tool_choice":"auto"}"#;
    assert_eq!(check(ok, Endpoint::Chat), Ok(()));
    assert_eq!(check(ok, Endpoint::Embeddings), Err(NotResumable::Endpoint));
    let cases: [(&str, NotResumable); 9] = [
        (r#"{"n":2}"#, NotResumable::SeveralChoices),
        (r#"{"logprobs":true}"#, NotResumable::Logprobs),
        (r#"{"top_logprobs":3}"#, NotResumable::Logprobs),
        (
            r#"{"response_format":{"type":"json_schema","json_schema":{}}}"#,
            NotResumable::StructuredOutput,
        ),
        (r#"{"guided_regex":"a+"}"#, NotResumable::StructuredOutput),
        (r#"{"tool_choice":"required"}"#, NotResumable::ToolCall),
        (
            r#"{"tool_choice":{"type":"function","function":{"name":"f"}}}"#,
            NotResumable::ToolCall,
        ),
        (
            r#"{"add_generation_prompt":false}"#,
            NotResumable::OwnTemplate,
        ),
        (r#"{"echo":true}"#, NotResumable::Echo),
    ];
    for (body, why) in cases {
        assert_eq!(check(body.as_bytes(), Endpoint::Chat), Err(why), "{body}");
    }
    assert_eq!(check(b"[1]", Endpoint::Chat), Err(NotResumable::Unreadable));
    let prompt = |p: &str| format!(r#"{{"model":"m","prompt":{p},"logprobs":null}}"#);
    assert_eq!(
        check(prompt(r#""hi""#).as_bytes(), Endpoint::Completions),
        Ok(())
    );
    assert_eq!(
        check(prompt(r#"["hi"]"#).as_bytes(), Endpoint::Completions),
        Ok(())
    );
    for p in ["[1,2]", r#"["a","b"]"#, "[[1]]"] {
        assert_eq!(
            check(prompt(p).as_bytes(), Endpoint::Completions),
            Err(NotResumable::PromptShape),
            "{p}"
        );
    }
    let logprobs = br#"{"prompt":"hi","logprobs":2}"#;
    assert_eq!(
        check(logprobs, Endpoint::Completions),
        Err(NotResumable::Logprobs)
    );
}

#[test]
fn the_partial_answer_is_read_whatever_the_chunking() {
    let all = format!("{ROLE}{}{}", chat_chunk(" the"), chat_chunk(" \"cat\""));
    let bytes = all.as_bytes();
    for cut in 0..bytes.len() {
        let mut p = Partial::new();
        p.observe(&bytes[..cut]);
        p.observe(&bytes[cut..]);
        assert_eq!(p.text, " the \"cat\"", "cut at {cut}");
        assert_eq!(p.tokens_sent(), 2);
        assert_eq!(p.id.as_deref(), Some("chatcmpl-a"));
        assert_eq!((p.created, p.model.as_deref()), (Some(7), Some("m")));
        assert_eq!(p.resumable(), Ok(()));
    }
    let mut p = Partial::new();
    p.observe(&bytes[..bytes.len() - 3]);
    assert_eq!(p.resumable(), Err(NotResumable::MidEvent));
}

#[test]
fn events_with_several_data_lines_and_crlf_are_joined() {
    let mut seen = Vec::new();
    let mut events = Events::default();
    events.push(b"data: {\"a\":\r\ndata: 1}\r\n\r\ndata: [DO", |_, d| {
        seen.push(d.to_vec())
    });
    assert!(events.pending());
    events.push(b"NE]\n\n", |_, d| seen.push(d.to_vec()));
    assert!(!events.pending());
    assert_eq!(seen, [b"{\"a\":\n1}".to_vec(), b"[DONE]".to_vec()]);
}

#[test]
fn tool_calls_reasoning_and_finished_answers_block_a_resume() {
    let with = |delta: &str, finish: &str| {
        format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish}}}]}}\n\n")
    };
    let cases = [
        (
            with(r#"{"tool_calls":[{"index":0}]}"#, "null"),
            NotResumable::ToolCall,
        ),
        (
            with(r#"{"reasoning_content":"hm"}"#, "null"),
            NotResumable::Reasoning,
        ),
        (
            with(r#"{"content":"x"}"#, r#""stop""#),
            NotResumable::Finished,
        ),
    ];
    for (event, why) in cases {
        let mut p = Partial::new();
        p.observe(event.as_bytes());
        assert_eq!(p.resumable(), Err(why), "{event}");
        assert_eq!(
            continuation_body(b"{}", Endpoint::Chat, &p, p.tokens_sent()),
            Err(why),
            "{event}"
        );
    }
    let mut p = Partial::new();
    p.observe(with(r#"{"tool_calls":[],"content":"x"}"#, "null").as_bytes());
    assert_eq!(p.resumable(), Ok(()), "an empty tool_calls list is no call");
}

#[test]
fn continuous_usage_gives_the_token_count() {
    let mut p = Partial::new();
    let event = "data: {\"choices\":[{\"index\":0,\"text\":\" catdog\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n";
    p.observe(event.as_bytes());
    assert_eq!(p.tokens_sent(), 2);
}

#[test]
fn chat_continues_the_final_assistant_message_with_fewer_tokens() {
    let mut p = Partial::new();
    p.observe(format!("{ROLE}{}{}", chat_chunk(" the"), chat_chunk(" cat")).as_bytes());
    let original = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":10,"max_completion_tokens":12,"min_tokens":1,"stop":["x"],"temperature":0.5,"stream":true}"#;
    let body: Value = serde_json::from_slice(
        &continuation_body(original, Endpoint::Chat, &p, p.tokens_sent()).unwrap(),
    )
    .unwrap();
    assert_eq!(
        body["messages"],
        json!([{"role":"user","content":"hi"},{"role":"assistant","content":" the cat"}])
    );
    assert_eq!(body["continue_final_message"], json!(true));
    assert_eq!(body["add_generation_prompt"], json!(false));
    assert_eq!(body["max_tokens"], json!(8));
    assert_eq!(body["max_completion_tokens"], json!(10));
    assert_eq!(body["min_tokens"], json!(0));
    assert_eq!(body["stop"], json!(["x"]));
    assert_eq!(body["temperature"], json!(0.5));
    assert_eq!(body["stream"], json!(true));
    let spent = br#"{"messages":[],"max_tokens":2}"#;
    assert_eq!(
        continuation_body(spent, Endpoint::Chat, &p, p.tokens_sent()),
        Err(NotResumable::NothingLeft)
    );
}

#[test]
fn completions_continue_the_prompt_with_the_partial_text() {
    let mut p = Partial::new();
    p.observe(b"data: {\"id\":\"cmpl-a\",\"created\":3,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" sun\",\"logprobs\":null,\"finish_reason\":null}]}\n\n");
    for (prompt, want) in [
        (json!("Once"), json!("Once sun")),
        (json!(["Once"]), json!("Once sun")),
    ] {
        let original =
            serde_json::to_vec(&json!({"model":"m","prompt":prompt,"max_tokens":5})).unwrap();
        let body: Value = serde_json::from_slice(
            &continuation_body(&original, Endpoint::Completions, &p, p.tokens_sent()).unwrap(),
        )
        .unwrap();
        assert_eq!(body["prompt"], want);
        assert_eq!(body["max_tokens"], json!(4));
        assert!(body.get("continue_final_message").is_none());
    }
}

#[test]
fn the_continuation_is_spliced_into_the_first_answer() {
    let mut p = Partial::new();
    p.observe(format!("{ROLE}{}{}", chat_chunk(" the"), chat_chunk(" cat")).as_bytes());
    let mut s = Splice::new(&p, p.tokens_sent());
    let cont = concat!(
        "data: {\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":9,\"model\":\"m2\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":9,\"model\":\"m2\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" sat\"},\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\n",
        "data: {\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":9,\"model\":\"m2\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"total_tokens\":10,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n",
        "data: [DONE]\n\n",
    );
    let bytes = cont.as_bytes();
    let mut out = s.rewrite(&bytes[..100]);
    out.extend(s.rewrite(&bytes[100..]));
    let text = String::from_utf8(out).unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"));
    let got = events(text.as_bytes());
    assert_eq!(got.len(), 3, "the role chunk is dropped: {text}");
    for e in &got[..2] {
        assert_eq!(
            (&e["id"], &e["created"], &e["model"]),
            (&json!("chatcmpl-a"), &json!(7), &json!("m"))
        );
    }
    assert_eq!(got[0]["choices"][0]["delta"], json!({"content":" sat"}));
    assert_eq!(got[0]["choices"][0]["finish_reason"], json!("length"));
    assert_eq!(
        got[1]["usage"],
        json!({"prompt_tokens":7,"completion_tokens":3,"total_tokens":10,"prompt_tokens_details":{"cached_tokens":7}})
    );
}

#[test]
fn a_role_chunk_with_content_keeps_its_content() {
    let p = Partial::new();
    let mut s = Splice::new(&p, p.tokens_sent());
    let out = s.rewrite(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"x\"}}]}\n\n");
    assert_eq!(
        events(&out)[0]["choices"][0]["delta"],
        json!({"content":"x"})
    );
}

#[test]
fn a_second_resume_reads_the_spliced_stream() {
    // The client's stream after one resume: its own id, two tokens from each backend.
    let mut p = Partial::new();
    p.observe(format!("{ROLE}{}{}", chat_chunk(" a"), chat_chunk(" b")).as_bytes());
    let mut s = Splice::new(&p, p.tokens_sent());
    let cont = "data: {\"id\":\"x\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" c\"},\"finish_reason\":null}]}\n\n";
    p.observe(&s.rewrite(cont.as_bytes()));
    assert_eq!((p.text.as_str(), p.tokens_sent()), (" a b c", 3));
    assert_eq!(p.id.as_deref(), Some("chatcmpl-a"));
}

#[test]
fn embeddings_are_never_continued() {
    let body = br#"{"model":"m","input":"hi"}"#;
    assert_eq!(
        check(body, Endpoint::Embeddings),
        Err(NotResumable::Endpoint)
    );
    assert_eq!(
        continuation_body(body, Endpoint::Embeddings, &Partial::new(), 0),
        Err(NotResumable::Endpoint)
    );
    assert_eq!(NotResumable::Endpoint.as_str(), "endpoint");
}

#[test]
fn a_tokenizers_count_replaces_one_token_per_event() {
    // Speculative decoding: two events carried five tokens. The stream alone says two; the
    // tokenizer's count of the text is what the continuation and the usage total go by.
    let mut p = Partial::new();
    p.observe(
        format!(
            "{ROLE}{}{}",
            chat_chunk(" the cat"),
            chat_chunk(" sat on it")
        )
        .as_bytes(),
    );
    assert_eq!(p.uncounted_text(), Some(" the cat sat on it"));
    assert_eq!((p.tokens_sent(), p.tokens_sent_with(Some(5))), (2, 5));
    // Never fewer than the events (each carried a token).
    assert_eq!(p.tokens_sent_with(Some(1)), 2);
    let original = br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":12}"#;
    let body: Value = serde_json::from_slice(
        &continuation_body(original, Endpoint::Chat, &p, p.tokens_sent_with(Some(5))).unwrap(),
    )
    .unwrap();
    assert_eq!(body["max_tokens"], json!(7));
    let mut s = Splice::new(&p, 5);
    let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":15,\"completion_tokens\":7,\"total_tokens\":22}}\n\n";
    assert_eq!(
        events(&s.rewrite(usage.as_bytes()))[0]["usage"],
        json!({"prompt_tokens":10,"completion_tokens":12,"total_tokens":22})
    );
    // Continuous usage already counts tokens: nothing to ask a tokenizer, and its count wins.
    let mut c = Partial::new();
    c.observe(b"data: {\"choices\":[{\"index\":0,\"text\":\" catdog\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n");
    assert_eq!((c.uncounted_text(), c.tokens_sent_with(Some(9))), (None, 2));
    assert_eq!(Partial::new().uncounted_text(), None, "nothing sent");
}

#[test]
fn the_text_received_is_counted_only_when_all_of_it_was_read() {
    // A settlement counts the text the client received (issue 42): whole, or not at all.
    let mut p = Partial::new();
    p.observe(format!("{ROLE}{}", chat_chunk(" the cat")).as_bytes());
    assert_eq!(p.received_text(), Some(" the cat"));
    // A finished answer's text is whole.
    p.observe(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" sat\"},\"finish_reason\":\"length\"}]}\n\n");
    assert_eq!(p.received_text(), Some(" the cat sat"));
    // Reading stopped at a tool call: what came after it is not in the text.
    let mut t = Partial::new();
    t.observe(chat_chunk(" hm").as_bytes());
    t.observe(
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\n",
    );
    assert_eq!(t.received_text(), None);
}

#[test]
fn a_continuations_usage_is_the_clients_totals() {
    let mut p = Partial::new();
    p.observe(format!("{ROLE}{}", chat_chunk(" the cat sat")).as_bytes());
    // Three tokens sent; the continuation's prompt holds them.
    let s = Splice::new(&p, 3);
    let own = crate::stream::usage::Usage {
        prompt_tokens: 13,
        cached_tokens: Some(12),
        completion_tokens: 4,
    };
    let client = s.client_usage(own);
    assert_eq!(
        (
            client.prompt_tokens,
            client.cached_tokens,
            client.completion_tokens
        ),
        (10, Some(10), 7)
    );
    assert_eq!(client.total(), own.total());
}
