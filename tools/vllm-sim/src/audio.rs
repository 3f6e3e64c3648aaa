//! `/v1/audio/transcriptions` and `/v1/audio/translations` with vLLM 0.34's shapes
//! (`vllm/entrypoints/speech_to_text/`): a multipart/form-data body with a `file` part and
//! `model`, `language`, `response_format`, `stream`, `stream_include_usage` fields.
//!
//! The audio's duration is read from a WAV header (byte rate and data size) or, for another
//! format, taken as 16 kB per second; the "transcript" is deterministic text from the sim's
//! vocabulary, three tokens per second of audio (at least one), seeded by the file's bytes. A
//! transcription answers `{"text", "usage": {"type": "duration", "seconds"}}` (seconds rounded
//! up, as vLLM does); a translation `{"text"}` without usage; `verbose_json` adds `language`,
//! `duration` and `segments`. `stream=true` answers `transcription.chunk` / `translation.chunk`
//! events (one per token, the last with `finish_reason: "stop"`), then a usage chunk with
//! `choices: []` when `stream_include_usage` is set, then `data: [DONE]`; the sim sends them as one
//! body after the request's compute time rather than token by token.

use std::time::Duration;

use hyper::{Response, StatusCode};
use serde_json::json;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::api::{resolve_model, unix_s};
use crate::body::{self, SimBody};
use crate::error::ApiError;
use crate::state::AppState;
use crate::tokenizer::piece;

fn bad(message: impl std::fmt::Display) -> ApiError {
    ApiError::BadRequest(message.to_string())
}

/// One part of a multipart body: its name and content.
#[derive(Debug, PartialEq)]
pub struct Part<'a> {
    /// The `name` of its `Content-Disposition`.
    pub name: String,
    /// Its bytes.
    pub content: &'a [u8],
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<&str> {
    let mut parts = content_type.split(';');
    if !parts
        .next()?
        .trim()
        .eq_ignore_ascii_case("multipart/form-data")
    {
        return None;
    }
    parts.find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"'))
            .filter(|v| !v.is_empty())
    })
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| i + from)
}

/// The parts of a multipart body (FastAPI's 400 on a malformed one).
pub fn parts<'a>(body: &'a [u8], boundary: &str) -> Result<Vec<Part<'a>>, ApiError> {
    let malformed = || bad("There was an error parsing the body");
    let delimiter = format!("--{boundary}");
    let delimiter = delimiter.as_bytes();
    let mut out = Vec::new();
    let mut at = find(body, delimiter, 0).ok_or_else(malformed)?;
    loop {
        at += delimiter.len();
        if body[at..].starts_with(b"--") {
            return Ok(out);
        }
        let start = at
            + if body[at..].starts_with(b"\r\n") {
                2
            } else {
                0
            };
        let headers_end = find(body, b"\r\n\r\n", start).ok_or_else(malformed)?;
        let headers = String::from_utf8_lossy(&body[start..headers_end]);
        let content_start = headers_end + 4;
        let next = find(body, delimiter, content_start).ok_or_else(malformed)?;
        let content_end = next.saturating_sub(2).max(content_start);
        let name = headers.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            if !k.trim().eq_ignore_ascii_case("content-disposition") {
                return None;
            }
            v.split(';').find_map(|p| {
                let (k, v) = p.trim().split_once('=')?;
                (k.trim() == "name").then(|| v.trim().trim_matches('"').to_string())
            })
        });
        if let Some(name) = name {
            out.push(Part {
                name,
                content: &body[content_start..content_end],
            });
        }
        at = next;
    }
}

/// Seconds of audio in `file`: from a WAV header when it is one, else 16 kB per second.
pub fn duration_s(file: &[u8]) -> f64 {
    let le32 = |at: usize| {
        file.get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if file.starts_with(b"RIFF") && file.get(8..12) == Some(b"WAVE") {
        if let (Some(byte_rate), Some(data_at)) = (le32(28), find(file, b"data", 12)) {
            let size = le32(data_at + 4).unwrap_or(0) as usize;
            let size = size.min(file.len().saturating_sub(data_at + 8));
            if byte_rate > 0 {
                return size as f64 / f64::from(byte_rate);
            }
        }
    }
    file.len() as f64 / 16_000.0
}

/// `POST /v1/audio/transcriptions` (`transcribe`) or `/v1/audio/translations`.
pub async fn speech_to_text(
    state: &AppState,
    content_type: &str,
    body: &[u8],
    transcribe: bool,
) -> Result<Response<SimBody>, ApiError> {
    let boundary = boundary(content_type)
        .ok_or_else(|| bad("Expected a multipart/form-data body with a boundary"))?;
    let parts = parts(body, boundary)?;
    let field = |name: &str| {
        parts
            .iter()
            .find(|p| p.name == name)
            .map(|p| String::from_utf8_lossy(p.content).trim().to_string())
    };
    let file = parts
        .iter()
        .find(|p| p.name == "file")
        .ok_or_else(|| bad("Field required: file"))?
        .content;
    let (model, _lora) = resolve_model(state, field("model").filter(|m| !m.is_empty()))?;
    let flag = |name: &str| matches!(field(name).as_deref(), Some("true" | "True" | "1"));
    let stream = flag("stream");
    let include_usage = flag("stream_include_usage");
    let format = field("response_format").unwrap_or_else(|| "json".to_string());
    if !["json", "text", "srt", "verbose_json", "vtt"].contains(&format.as_str()) {
        return Err(bad(format!("Unsupported response_format: {format}")));
    }
    let seconds = duration_s(file);
    let tokens = ((seconds * 3.0).ceil() as u32).clamp(1, 4096);
    let seed = xxh3_64_with_seed(file, state.config.seed);
    let pieces: Vec<&str> = (0..tokens)
        .map(|i| piece(seed.wrapping_add(u64::from(i).wrapping_mul(0x9E37_79B9))))
        .collect();
    let text = pieces.concat().trim_start().to_string();
    // The encoder's prefill of the audio (about 50 tokens a second) and one decode step per token.
    let audio_tokens = ((seconds * 50.0).ceil() as u32).max(1);
    let inflight = state.admit(audio_tokens).map_err(ApiError::Shed)?;
    let c = &state.config;
    let us = c.step_timing().step_us(0, audio_tokens)
        + f64::from(tokens) * c.step_timing().step_us(1, 0);
    tokio::time::sleep(Duration::from_secs_f64(us / c.time_scale / 1e6)).await;
    drop(inflight);
    let id = format!("trsc-{}", state.fresh_id());
    if stream {
        let object = if transcribe {
            "transcription.chunk"
        } else {
            "translation.chunk"
        };
        let created = unix_s();
        let mut out = String::new();
        for (i, p) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len();
            let choice = match last {
                true => {
                    json!({"delta": {"content": p}, "finish_reason": "stop", "stop_reason": null})
                }
                false => json!({"delta": {"content": p}}),
            };
            let chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
            out.push_str(&format!("data: {chunk}\n\n"));
        }
        if include_usage {
            let usage = json!({"prompt_tokens": audio_tokens, "completion_tokens": tokens, "total_tokens": audio_tokens + tokens});
            let chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage});
            out.push_str(&format!("data: {chunk}\n\n"));
        }
        out.push_str("data: [DONE]\n\n");
        return Ok(body::full(StatusCode::OK, "text/event-stream", out));
    }
    let answer = match (format.as_str(), transcribe) {
        ("verbose_json", _) => json!({
            "text": text,
            "language": field("language"),
            "duration": seconds,
            "segments": [],
        }),
        (_, true) => {
            json!({"text": text, "usage": {"type": "duration", "seconds": seconds.ceil() as u64}})
        }
        (_, false) => json!({"text": text}),
    };
    Ok(body::json(StatusCode::OK, &answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wav(seconds: u32) -> Vec<u8> {
        let (rate, data) = (16_000u32, 32_000 * seconds);
        let mut w = b"RIFF".to_vec();
        w.extend_from_slice(&(36 + data).to_le_bytes());
        w.extend_from_slice(b"WAVEfmt ");
        w.extend_from_slice(&16u32.to_le_bytes());
        w.extend_from_slice(&1u16.to_le_bytes());
        w.extend_from_slice(&1u16.to_le_bytes());
        w.extend_from_slice(&rate.to_le_bytes());
        w.extend_from_slice(&(rate * 2).to_le_bytes());
        w.extend_from_slice(&2u16.to_le_bytes());
        w.extend_from_slice(&16u16.to_le_bytes());
        w.extend_from_slice(b"data");
        w.extend_from_slice(&data.to_le_bytes());
        w.resize(w.len() + data as usize, 0);
        w
    }

    #[test]
    fn reads_a_wav_duration() {
        assert!((duration_s(&wav(2)) - 2.0).abs() < 1e-9);
        assert!((duration_s(&[0u8; 8000]) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn parses_multipart_forms_and_refuses_broken_ones() {
        let body = b"--xx\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF--x\r\n--xx\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--xx--\r\n";
        let p = parts(body, "xx").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(
            (p[0].name.as_str(), p[0].content),
            ("file", &b"RIFF--x"[..])
        );
        assert_eq!(
            (p[1].name.as_str(), p[1].content),
            ("model", &b"whisper"[..])
        );
        assert!(parts(b"nothing", "xx").is_err());
        assert!(parts(&body[..40], "xx").is_err());
        assert_eq!(boundary("multipart/form-data; boundary=\"b1\""), Some("b1"));
        assert_eq!(boundary("application/json"), None);
    }
}
