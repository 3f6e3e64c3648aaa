//! Replaying a production request trace (Mooncake's FAST'25 format, `bench/traces/`): reading it,
//! cutting a window out of it, and turning each request into a prompt whose prefix sharing is the
//! trace's own.
//!
//! The format is JSON lines (gzipped when the file name ends in `.gz`), one request a line:
//! `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [..]}`. Each
//! hash id names one block of `block_tokens` (512) prompt tokens; two requests whose first k ids
//! are equal share their first k blocks. The trace has no text, so every id becomes a fixed text
//! block drawn from a generator seeded with the id: equal ids give equal text, the prompts share
//! exactly the prefixes the trace says, and a backend's prefix cache (vllm-sim's, which hashes the
//! rendered prompt) sees equal tokens there.
//!
//! Lengths are divided by `scale` (a 512-token block becomes 32 tokens at scale 16) so that an
//! hour of a large model's traffic fits a small simulated fleet; arrival times are divided by the
//! replay's speed-up (the driver's [`crate::driver::Load::Replay`]).

use crate::plan::{words, Plan, Session, Turn};
use crate::rng::Rng;
use serde::Deserialize;
use std::io::Read;
use std::path::Path;

/// One request of a trace, as stored.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TraceRequest {
    /// Arrival, ms from the trace's start.
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Output tokens.
    pub output_length: u64,
    /// Ids of the prompt's blocks, in order.
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

/// Which part of a trace to replay and how to shrink it.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceWindow {
    /// Token lengths are divided by this (>= 1).
    pub scale: f64,
    /// Output lengths are divided by this (>= 1).
    pub output_scale: f64,
    /// Index of the first request replayed (in timestamp order).
    pub start: usize,
    /// Requests replayed (0: up to the end, or the duration).
    pub requests: usize,
    /// Trace-time length of the window, seconds (0: no limit).
    pub duration_s: f64,
    /// Tokens one hash id stands for in the trace (Mooncake: 512).
    pub block_tokens: u64,
    /// Scaled prompts longer than this are cut to it, keeping their prefix (0: no cap). A prompt
    /// must fit one backend's KV cache, or it can never run.
    pub max_input_tokens: usize,
}

/// Reads a trace file (gzipped if its name ends in `.gz`), sorted by timestamp.
pub fn read(path: &Path) -> Result<Vec<TraceRequest>, String> {
    let raw = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let text = if path.extension().is_some_and(|e| e == "gz") {
        let mut s = String::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_string(&mut s)
            .map_err(|e| format!("{}: not gzip-compressed text: {e}", path.display()))?;
        s
    } else {
        String::from_utf8(raw).map_err(|e| format!("{}: not UTF-8: {e}", path.display()))?
    };
    parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parses trace lines (blank lines skipped), sorted by timestamp (stable).
pub fn parse(text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRequest =
            serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        if !r.timestamp.is_finite() || r.timestamp < 0.0 {
            return Err(format!("line {}: bad timestamp {}", i + 1, r.timestamp));
        }
        out.push(r);
    }
    out.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    Ok(out)
}

/// The random stream block texts are drawn from (the hash id is the seed).
const BLOCK_STREAM: u64 = 0x626c_6f63;
/// The random stream of a request's tokens beyond its blocks (the request index is the seed).
const TAIL_STREAM: u64 = 0x7461_696c;

/// `tokens` tokens of the text block of hash id `id` (a prefix of the block's full text, so a
/// request ending inside a block shares that block's beginning with the others).
fn block_text(id: u64, tokens: usize) -> String {
    words(&mut Rng::new(id, BLOCK_STREAM), tokens)
}

impl TraceWindow {
    /// The requests of `trace` in the window.
    pub fn select<'a>(&self, trace: &'a [TraceRequest]) -> &'a [TraceRequest] {
        let from = self.start.min(trace.len());
        let mut to = if self.requests == 0 {
            trace.len()
        } else {
            (from + self.requests).min(trace.len())
        };
        if self.duration_s > 0.0 {
            if let Some(first) = trace.get(from) {
                let end = first.timestamp + self.duration_s * 1e3;
                to = from + trace[from..to].partition_point(|r| r.timestamp < end);
            }
        }
        &trace[from..to]
    }

    /// Scaled prompt tokens of one request.
    pub fn input_tokens(&self, r: &TraceRequest) -> usize {
        let n = ((r.input_length as f64 / self.scale.max(1.0)).round() as usize).max(1);
        if self.max_input_tokens > 0 {
            n.min(self.max_input_tokens)
        } else {
            n
        }
    }

    /// Scaled output tokens of one request (at least one).
    pub fn output_tokens(&self, r: &TraceRequest) -> u32 {
        ((r.output_length as f64 / self.output_scale.max(1.0)).round() as u32).max(1)
    }

    /// Scaled tokens of one block.
    pub fn scaled_block_tokens(&self) -> usize {
        ((self.block_tokens as f64 / self.scale.max(1.0)).round() as usize).max(1)
    }

    /// The plan of the window: one single-turn session per request (its prompt made of its
    /// blocks' texts), with the arrival times (ms from the window's first request) in
    /// [`Plan::trace_ms`].
    pub fn plan(&self, trace: &[TraceRequest]) -> Plan {
        let window = self.select(trace);
        let t0 = window.first().map_or(0.0, |r| r.timestamp);
        let bt = self.scaled_block_tokens();
        let mut sessions = Vec::with_capacity(window.len());
        let mut trace_ms = Vec::with_capacity(window.len());
        for (i, r) in window.iter().enumerate() {
            let want = self.input_tokens(r);
            let mut user = String::with_capacity(want * 4);
            let mut have = 0;
            for &id in &r.hash_ids {
                if have >= want {
                    break;
                }
                let n = bt.min(want - have);
                user.push_str(&block_text(id, n));
                have += n;
            }
            if have < want {
                // More tokens than blocks (not in Mooncake's traces): a tail of the request's own.
                let seed = (self.start + i) as u64;
                user.push_str(&words(&mut Rng::new(seed, TAIL_STREAM), want - have));
            }
            sessions.push(Session {
                user_id: None,
                system: None,
                turns: vec![Turn {
                    user,
                    output_tokens: self.output_tokens(r),
                }],
            });
            trace_ms.push(r.timestamp - t0);
        }
        Plan { sessions, trace_ms }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINES: &str = r#"{"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [0, 1]}
{"timestamp": 500, "input_length": 1300, "output_length": 10, "hash_ids": [0, 1, 2]}

{"timestamp": 250, "input_length": 700, "output_length": 3, "hash_ids": [0, 5]}
{"timestamp": 2000, "input_length": 512, "output_length": 1, "hash_ids": [9]}"#;

    fn window() -> TraceWindow {
        TraceWindow {
            scale: 16.0,
            output_scale: 16.0,
            start: 0,
            requests: 0,
            duration_s: 0.0,
            block_tokens: 512,
            max_input_tokens: 0,
        }
    }

    #[test]
    fn lines_parse_sorted_by_time() {
        let t = parse(LINES).unwrap();
        assert_eq!(
            t.iter().map(|r| r.timestamp).collect::<Vec<_>>(),
            [0.0, 250.0, 500.0, 2000.0]
        );
        assert!(parse("{\"timestamp\": 1}").is_err(), "lengths are required");
        assert!(parse("not json").unwrap_err().contains("line 1"));
    }

    #[test]
    fn equal_ids_give_equal_prefixes_and_lengths_scale() {
        let t = parse(LINES).unwrap();
        let plan = window().plan(&t);
        let user = |i: usize| plan.sessions[i].turns[0].user.clone();
        // 1024 / 16 = 64 tokens = two 32-token blocks; 700 / 16 = 44 tokens; 1300 / 16 = 81.
        assert_eq!(
            (user(0).len(), user(1).len(), user(2).len()),
            (256, 176, 324)
        );
        assert_eq!(user(0)[..128], user(1)[..128], "block 0 shared");
        assert_ne!(user(0)[128..136], user(1)[128..136], "block 1 vs block 5");
        assert_eq!(user(2)[..256], user(0)[..], "blocks 0, 1 shared in full");
        assert_eq!(
            plan.sessions
                .iter()
                .map(|s| s.turns[0].output_tokens)
                .collect::<Vec<_>>(),
            [4, 1, 1, 1]
        );
        assert_eq!(plan.trace_ms, [0.0, 250.0, 500.0, 2000.0]);
        assert_eq!(plan, window().plan(&t), "deterministic");
    }

    #[test]
    fn windows_cut_by_start_count_and_duration_and_cap_long_prompts() {
        let t = parse(LINES).unwrap();
        let w = TraceWindow {
            start: 1,
            requests: 2,
            max_input_tokens: 50,
            ..window()
        };
        let plan = w.plan(&t);
        assert_eq!(
            plan.trace_ms,
            [0.0, 250.0],
            "relative to the window's start"
        );
        assert_eq!(
            plan.sessions[1].turns[0].user.len(),
            200,
            "81 tokens capped at 50"
        );
        let w = TraceWindow {
            duration_s: 0.6,
            ..window()
        };
        assert_eq!(w.select(&t).len(), 3);
        assert!(TraceWindow {
            start: 9,
            ..window()
        }
        .select(&t)
        .is_empty());
    }

    #[test]
    fn gzipped_files_read_like_plain_ones() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("loadgen-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let gz = dir.join("t.jsonl.gz");
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(LINES.as_bytes()).unwrap();
        std::fs::write(&gz, e.finish().unwrap()).unwrap();
        let plain = dir.join("t.jsonl");
        std::fs::write(&plain, LINES).unwrap();
        assert_eq!(read(&gz).unwrap(), read(&plain).unwrap());
        assert!(read(&dir.join("missing.jsonl")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
