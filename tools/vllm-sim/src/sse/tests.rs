//! Tests of [`super`]: the chunks of chat and completion streams and their usage chunk.

use super::*;
use crate::scheduler::FinishReason;

fn finish(text: &str) -> Finish {
    Finish {
        reason: FinishReason::Length,
        stop_reason: None,
        text: text.into(),
        prompt_tokens: 5,
        output_tokens: 2,
        cached_tokens: 0,
        block_ids: vec![],
        engine_ttft_ms: None,
        engine_split: None,
        engine_e2e_ms: None,
        engine_decode_stall_ms: None,
    }
}

fn events(out: &[u8]) -> Vec<serde_json::Value> {
    let text = std::str::from_utf8(out).unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"));
    text.split("\n\n")
        .filter(|e| !e.is_empty() && *e != "data: [DONE]")
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect()
}

#[test]
fn chat_streams_role_then_content_then_finish_then_usage() {
    let mut enc = ChunkEncoder::new(
        Endpoint::Chat,
        "chatcmpl-1".into(),
        7,
        "m".into(),
        true,
        false,
        5,
        None,
    );
    let mut out = Vec::new();
    enc.token(&mut out, " the", 1);
    enc.finish(&mut out, &finish(" cat"));
    let ev = events(&out);
    assert_eq!(ev.len(), 4);
    assert_eq!(ev[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(ev[1]["choices"][0]["delta"]["content"], " the");
    assert_eq!(ev[1]["object"], "chat.completion.chunk");
    assert_eq!(ev[2]["choices"][0]["finish_reason"], "length");
    assert_eq!(ev[2]["choices"][0]["delta"]["content"], " cat");
    assert_eq!(ev[3]["choices"].as_array().unwrap().len(), 0);
    assert_eq!(ev[3]["usage"]["total_tokens"], 7);
    assert!(ev[1].get("usage").is_none());
}

#[test]
fn completion_streams_text_and_continuous_usage() {
    let mut enc = ChunkEncoder::new(
        Endpoint::Completion,
        "cmpl-1".into(),
        7,
        "m".into(),
        false,
        true,
        5,
        None,
    );
    let mut out = Vec::new();
    enc.token(&mut out, " the", 1);
    enc.token(&mut out, "", 2); // held back: no chunk
    enc.finish(&mut out, &finish(" cat"));
    let ev = events(&out);
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[0]["choices"][0]["text"], " the");
    assert_eq!(ev[0]["usage"]["completion_tokens"], 1);
    assert_eq!(ev[1]["choices"][0]["finish_reason"], "length");
    assert_eq!(ev[1]["object"], "text_completion");
}

#[tokio::test]
async fn a_stream_is_cut_after_n_tokens() {
    let (tx, rx) = mpsc::unbounded_channel();
    let enc = ChunkEncoder::new(
        Endpoint::Completion,
        "c".into(),
        0,
        "m".into(),
        false,
        false,
        1,
        None,
    );
    let mut stream = SseStream::new(
        rx,
        enc,
        Some(StreamCutAt {
            after: 2,
            mid_event: false,
        }),
    );
    for n in 1..=3 {
        tx.send(SeqEvent::Token {
            delta: " the".into(),
            output_tokens: n,
        })
        .unwrap();
    }
    let first = std::future::poll_fn(|cx| stream.poll_next(cx))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        std::str::from_utf8(&first)
            .unwrap()
            .matches("data: ")
            .count(),
        2
    );
    let second = std::future::poll_fn(|cx| stream.poll_next(cx))
        .await
        .unwrap();
    assert_eq!(second, Err(StreamCut));
    assert!(std::future::poll_fn(|cx| stream.poll_next(cx))
        .await
        .is_none());
}

#[tokio::test]
async fn a_mid_event_cut_ends_with_half_an_event() {
    let (tx, rx) = mpsc::unbounded_channel();
    let enc = ChunkEncoder::new(
        Endpoint::Chat,
        "chatcmpl-x".into(),
        0,
        "m".into(),
        false,
        false,
        1,
        None,
    );
    let mut stream = SseStream::new(
        rx,
        enc,
        Some(StreamCutAt {
            after: 1,
            mid_event: true,
        }),
    );
    for n in 1..=2 {
        tx.send(SeqEvent::Token {
            delta: " the".into(),
            output_tokens: n,
        })
        .unwrap();
    }
    let frame = std::future::poll_fn(|cx| stream.poll_next(cx))
        .await
        .unwrap()
        .unwrap();
    let text = std::str::from_utf8(&frame).unwrap();
    let (complete, partial) = text.rsplit_once("\n\n").unwrap();
    assert_eq!(
        complete.matches("data: ").count(),
        2,
        "role chunk and the first token"
    );
    assert!(
        partial.starts_with("data: {\"id\":\"chatcmpl-x\""),
        "{partial}"
    );
    assert!(serde_json::from_str::<serde_json::Value>(&partial["data: ".len()..]).is_err());
    let next = std::future::poll_fn(|cx| stream.poll_next(cx))
        .await
        .unwrap();
    assert_eq!(next, Err(StreamCut));
}

#[tokio::test]
async fn a_cut_at_zero_tokens_sends_only_the_partial_event() {
    let (_tx, rx) = mpsc::unbounded_channel();
    let enc = ChunkEncoder::new(
        Endpoint::Completion,
        "cmpl-z".into(),
        0,
        "m".into(),
        false,
        false,
        1,
        None,
    );
    let mut stream = SseStream::new(
        rx,
        enc,
        Some(StreamCutAt {
            after: 0,
            mid_event: true,
        }),
    );
    let frame = std::future::poll_fn(|cx| stream.poll_next(cx))
        .await
        .unwrap()
        .unwrap();
    assert!(frame.starts_with(b"data: {\"id\":\"cmpl-z\""));
    assert!(!frame.ends_with(b"\n\n"));
    assert_eq!(
        std::future::poll_fn(|cx| stream.poll_next(cx))
            .await
            .unwrap(),
        Err(StreamCut)
    );
}

/// A chat encoder that sends the usage chunk.
fn usage_encoder() -> ChunkEncoder {
    ChunkEncoder::new(
        Endpoint::Chat,
        "c".into(),
        0,
        "m".into(),
        true,
        false,
        5,
        None,
    )
}

#[test]
fn usage_chunk_reports_cached_tokens_unless_details_are_off() {
    let mut f = finish(" cat");
    f.cached_tokens = 3;
    let mut enc = usage_encoder();
    let mut out = Vec::new();
    enc.finish(&mut out, &f);
    let usage = events(&out).pop().unwrap()["usage"].clone();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 3);
    let mut enc = usage_encoder();
    enc.prompt_tokens_details = false;
    let mut out = Vec::new();
    enc.finish(&mut out, &f);
    assert!(events(&out).pop().unwrap()["usage"]["prompt_tokens_details"].is_null());
}

#[test]
fn usage_chunk_carries_the_engine_ttft_only_when_asked() {
    let mut f = finish(" cat");
    f.engine_ttft_ms = Some(42.5);
    let mut enc = usage_encoder();
    let mut out = Vec::new();
    enc.finish(&mut out, &f);
    assert!(events(&out).pop().unwrap()["usage"]
        .get("sim_engine_ttft_ms")
        .is_none());
    enc.engine_timing = true;
    let mut out = Vec::new();
    enc.finish(&mut out, &f);
    assert_eq!(
        events(&out).pop().unwrap()["usage"]["sim_engine_ttft_ms"],
        42.5
    );
}

#[test]
fn usage_chunk_carries_the_engine_e2e_and_decode_stall_only_when_asked() {
    let mut f = finish(" cat");
    f.engine_ttft_ms = Some(42.5);
    f.engine_e2e_ms = Some(120.0);
    f.engine_decode_stall_ms = Some(7.25);
    let mut enc = usage_encoder();
    let mut out = Vec::new();
    enc.finish(&mut out, &f);
    let usage = events(&out).pop().unwrap()["usage"].clone();
    assert!(usage.get("sim_engine_e2e_ms").is_none(), "{usage}");
    assert!(usage.get("sim_engine_decode_stall_ms").is_none(), "{usage}");
    enc.engine_timing = true;
    let mut out = Vec::new();
    enc.finish(&mut out, &f);
    let usage = events(&out).pop().unwrap()["usage"].clone();
    assert_eq!(usage["sim_engine_e2e_ms"], 120.0);
    assert_eq!(usage["sim_engine_decode_stall_ms"], 7.25);
}
