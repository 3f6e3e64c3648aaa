//! The upper bound: the prefix-cache hit rate an oracle router would reach on a workload.
//!
//! The oracle replays the workload's requests in order against one cache that holds every block
//! any backend of the fleet could hold. It counts exactly what vllm-sim counts (see
//! `tools/vllm-sim/README.md`), calling the sim's own library: a prompt is rendered with the sim's
//! chat template and cut into blocks of `block_tokens` x 4 bytes with the sim's chained hashes; its *queries* are its tokens, its *hits* the
//! leading blocks found in the cache, never counting the last prompt token (a fully cached prompt
//! still computes one token); after the answer, the full blocks of prompt + answer except the one
//! holding the last token are cached, as vLLM caches generated blocks.
//!
//! Two bounds come out:
//! - **unbounded**: the cache never evicts, so only compulsory misses remain (the first sight of
//!   every block). No router on any fleet can do better.
//! - **fleet** (the figure results are divided by): the cache holds `backends x kv_blocks` blocks
//!   and evicts the least recently used. A router that could place every prefix where it is cached,
//!   with no duplicate copies and no load constraint, reaches it. When the workload's working set
//!   fits in the fleet, both are equal.
//!
//! Concurrency is ignored (requests are replayed one at a time), which can only raise the bound:
//! in a real run, two requests of a cold prefix that arrive together both miss.

use crate::plan::{messages, words, Message, Plan};
use crate::rng::Rng;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use vllm_sim::prompt::{ChatEnding, ChatMessage, MessageContent};

/// Renders chat messages with vllm-sim's template (generation prompt included), by calling it.
pub fn render_chat(messages: &[Message]) -> Vec<u8> {
    let messages: Vec<ChatMessage> = messages
        .iter()
        .map(|m| ChatMessage {
            role: m.role.to_string(),
            content: Some(MessageContent::Text(m.content.clone())),
        })
        .collect();
    // The only error is an empty list, whose rendering is empty.
    vllm_sim::prompt::render_chat(&messages, ChatEnding::GenerationPrompt).unwrap_or_default()
}

/// Tokens of `bytes` under vllm-sim's tokenizer approximation.
fn tokens(bytes: usize) -> usize {
    vllm_sim::tokenizer::count_tokens(bytes) as usize
}

/// Chained hashes of every full block of `bytes`, by vllm-sim's own function.
fn block_hashes(bytes: &[u8], block_tokens: usize) -> Vec<u64> {
    vllm_sim::kv_cache::block_hashes(bytes, u32::try_from(block_tokens).unwrap_or(u32::MAX))
}

/// A set of cached blocks, unbounded or LRU-bounded.
struct BlockCache {
    capacity: Option<usize>,
    stamp: u64,
    last_use: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
}

impl BlockCache {
    fn new(capacity: Option<usize>) -> Self {
        BlockCache {
            capacity,
            stamp: 0,
            last_use: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    fn contains(&self, h: u64) -> bool {
        self.last_use.contains_key(&h)
    }

    /// Marks `h` used now, inserting it (and evicting the least recently used block) if needed.
    fn touch(&mut self, h: u64) {
        self.stamp += 1;
        if let Some(old) = self.last_use.insert(h, self.stamp) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.stamp, h);
        if let Some(cap) = self.capacity {
            while self.last_use.len() > cap {
                let Some((_, victim)) = self.by_age.pop_first() else {
                    break;
                };
                self.last_use.remove(&victim);
            }
        }
    }
}

/// One request as the oracle sees it.
#[derive(Debug, Clone)]
pub struct OracleRequest {
    /// Rendered prompt bytes.
    pub prompt: Vec<u8>,
    /// The answer's bytes (any unique text of the right length will do).
    pub answer: Vec<u8>,
}

/// Hit counts under one cache model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct HitCount {
    /// Prompt tokens looked up.
    pub queries: u64,
    /// Of those, tokens found cached.
    pub hits: u64,
}

impl HitCount {
    /// `hits / queries` (0 when nothing was queried).
    pub fn rate(&self) -> f64 {
        if self.queries == 0 {
            0.0
        } else {
            self.hits as f64 / self.queries as f64
        }
    }
}

/// The oracle's answer for one workload and fleet.
#[derive(Debug, Clone, Serialize)]
pub struct OracleBound {
    /// Blocks the fleet can cache (`backends x kv_blocks`).
    pub fleet_blocks: usize,
    /// Distinct blocks the workload ever computes (its working set).
    pub working_set_blocks: usize,
    /// No eviction: only compulsory misses.
    pub unbounded: HitCount,
    /// One LRU cache of the fleet's total size: the figure results are compared with.
    pub fleet: HitCount,
    /// `fleet.rate()`, for convenience.
    pub hit_rate: f64,
}

/// Replays `requests` against both cache models; the first `warmup` requests fill the caches but
/// are not counted (as the benchmark does not measure its warm-up).
pub fn bound(
    requests: &[OracleRequest],
    warmup: usize,
    block_tokens: usize,
    fleet_blocks: usize,
) -> OracleBound {
    let mut unbounded = (BlockCache::new(None), HitCount::default());
    let mut fleet = (BlockCache::new(Some(fleet_blocks)), HitCount::default());
    let mut seen = HashSet::new();
    for (i, r) in requests.iter().enumerate() {
        let counted = i >= warmup;
        let prompt_tokens = tokens(r.prompt.len());
        let hashes = block_hashes(&r.prompt, block_tokens);
        let max_hit_blocks = prompt_tokens.saturating_sub(1) / block_tokens;
        let mut full = r.prompt.clone();
        full.extend_from_slice(&r.answer);
        let total_tokens = tokens(full.len());
        let seq_hashes = block_hashes(&full, block_tokens);
        let cached_after = seq_hashes
            .len()
            .min(total_tokens.saturating_sub(1) / block_tokens);
        for (cache, count) in [&mut unbounded, &mut fleet] {
            let hit_blocks = hashes
                .iter()
                .take(max_hit_blocks)
                .take_while(|h| cache.contains(**h))
                .count();
            if counted {
                count.queries += prompt_tokens as u64;
                count.hits += (hit_blocks * block_tokens) as u64;
            }
            for h in &seq_hashes[..cached_after] {
                cache.touch(*h);
            }
        }
        seen.extend(seq_hashes[..cached_after].iter().copied());
    }
    OracleBound {
        fleet_blocks,
        working_set_blocks: seen.len(),
        unbounded: unbounded.1,
        fleet: fleet.1,
        hit_rate: fleet.1.rate(),
    }
}

/// The oracle's bound for a workload: its warm-up (not counted) then its plan.
pub fn workload_bound(
    w: &crate::workload::Workload,
    seed: u64,
    block_tokens: usize,
    fleet_blocks: usize,
) -> OracleBound {
    let mut reqs = w
        .warmup(seed)
        .map(|p| requests_of(&p, seed ^ 0x5eed))
        .unwrap_or_default();
    let warmup = reqs.len();
    reqs.extend(requests_of(&w.generate(seed), seed));
    bound(&reqs, warmup, block_tokens, fleet_blocks)
}

/// The requests of a plan in the order an oracle replays them: turn by turn across sessions (every
/// session's first turn, then every second turn, ...), with placeholder answers of the right length.
pub fn requests_of(plan: &Plan, seed: u64) -> Vec<OracleRequest> {
    let mut rng = Rng::new(seed, 0x6f72_6163);
    let answers: Vec<Vec<String>> = plan
        .sessions
        .iter()
        .map(|s| {
            s.turns
                .iter()
                .map(|t| words(&mut rng, t.output_tokens as usize))
                .collect()
        })
        .collect();
    replay_order(plan)
        .map(|(s, turn)| OracleRequest {
            prompt: render_chat(&messages(&plan.sessions[s], turn, &answers[s])),
            answer: answers[s][turn].clone().into_bytes(),
        })
        .collect()
}

/// `(session, turn)` in the order the oracle replays a plan: every session's first turn, then
/// every second turn, ...
fn replay_order(plan: &Plan) -> impl Iterator<Item = (usize, usize)> + '_ {
    let rounds = plan
        .sessions
        .iter()
        .map(|s| s.turns.len())
        .max()
        .unwrap_or(0);
    (0..rounds).flat_map(move |turn| {
        plan.sessions
            .iter()
            .enumerate()
            .filter(move |(_, session)| turn < session.turns.len())
            .map(move |(s, _)| (s, turn))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Workload;

    fn req(prompt: &str, answer_tokens: usize) -> OracleRequest {
        OracleRequest {
            prompt: prompt.as_bytes().to_vec(),
            answer: vec![b'x'; answer_tokens * 4],
        }
    }

    #[test]
    fn repeated_prompt_hits_all_but_the_last_token() {
        // 160 bytes = 40 tokens = 2 full blocks + 8 tokens; an exact repeat hits both blocks.
        let p = "y".repeat(160);
        let b = bound(&[req(&p, 1), req(&p, 1)], 0, 16, 1000);
        assert_eq!(
            b.unbounded,
            HitCount {
                queries: 80,
                hits: 32
            }
        );
        // A 128-byte prompt (32 tokens) hits only its first block: the last token is recomputed.
        let p = "z".repeat(128);
        let b = bound(&[req(&p, 1), req(&p, 1)], 0, 16, 1000);
        assert_eq!(b.unbounded.hits, 16);
    }

    #[test]
    fn answers_are_cached_for_the_next_turn() {
        // Turn 1: a 16-token prompt and a 17-token answer: 33 tokens, so blocks 0 and 1 are cached
        // (the 33rd token, whose KV is never computed, sits in block 2).
        let p1 = "a".repeat(64);
        let mut r1 = req(&p1, 17);
        r1.answer = vec![b'b'; 68];
        let mut p2 = p1.clone().into_bytes();
        p2.extend_from_slice(&r1.answer);
        p2.extend_from_slice(&[b'c'; 100]);
        let r2 = OracleRequest {
            prompt: p2,
            answer: vec![],
        };
        let b = bound(&[r1, r2], 0, 16, 1000);
        assert_eq!(b.unbounded.hits, 32);
    }

    #[test]
    fn a_small_fleet_evicts_and_the_bounds_differ() {
        let a = "a".repeat(64 * 10);
        let c = "c".repeat(64 * 10);
        let reqs = [req(&a, 1), req(&c, 1), req(&a, 1), req(&c, 1)];
        let big = bound(&reqs, 0, 16, 100);
        let small = bound(&reqs, 0, 16, 12);
        assert_eq!(big.fleet, big.unbounded);
        assert_eq!(big.working_set_blocks, 20);
        assert!(
            small.fleet.hits < big.fleet.hits,
            "{:?} {:?}",
            small.fleet,
            big.fleet
        );
        assert_eq!(small.unbounded, big.unbounded);
    }

    #[test]
    fn shared_prefix_bound_is_close_to_the_prefix_share() {
        // 2 groups, 400-token system prompts, 8-token questions: every request after the first of
        // its group hits the system prompt's full blocks.
        let w = Workload::SharedPrefix {
            groups: 2,
            prompts_per_group: 50,
            system_tokens: 400,
            question_tokens: 8,
            output_tokens: 4,
            requests: 100,
            zipf: 0.0,
            warmup_per_group: 0,
        };
        let plan = w.generate(1);
        let b = bound(&requests_of(&plan, 1), 0, 16, 10_000);
        assert!(b.hit_rate > 0.9 && b.hit_rate < 0.99, "{}", b.hit_rate);
        let no = Workload::NoSharing {
            requests: 50,
            prompt_tokens: 100,
            output_tokens: 4,
        }
        .generate(1);
        assert_eq!(bound(&requests_of(&no, 1), 0, 16, 10_000).unbounded.hits, 0);
    }

    #[test]
    fn warmup_requests_fill_the_cache_but_do_not_count() {
        let p = "w".repeat(64 * 4);
        let cold = bound(&[req(&p, 1)], 0, 16, 1000);
        let warm = bound(&[req(&p, 1), req(&p, 1)], 1, 16, 1000);
        assert_eq!(cold.fleet.queries, warm.fleet.queries);
        assert_eq!((cold.fleet.hits, warm.fleet.hits), (0, 48));
    }

    #[test]
    fn multi_turn_replays_round_by_round_and_hits_history() {
        let plan = Workload::MultiTurn {
            users: 3,
            rounds: 4,
            system_tokens: 64,
            question_tokens: 16,
            output_tokens: 16,
            user_context_tokens: 0,
            warmup_requests: 0,
        }
        .generate(2);
        let reqs = requests_of(&plan, 2);
        assert_eq!(reqs.len(), 12);
        // Round 2 of user 0 starts with round 1's prompt followed by its answer.
        assert!(reqs[3].prompt.starts_with(&reqs[0].prompt));
        assert!(bound(&reqs, 0, 16, 10_000).hit_rate > 0.5);
    }

    /// Starts an in-process vllm-sim on 127.0.0.1 (port chosen by the system) with `kv_blocks` blocks
    /// of 16 tokens; returns its chat completions URL.
    async fn start_sim(kv_blocks: u32) -> String {
        use clap::Parser;
        use vllm_sim::{config::Config, launch, server};
        let kv_blocks = kv_blocks.to_string();
        let mut config = Config::parse_from([
            "vllm-sim",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--model",
            "m",
            "--kv-blocks",
            &kv_blocks,
            "--block-size",
            "16",
            "--decode-ms-per-step",
            "1",
            "--prefill-us-per-token",
            "1",
        ]);
        let listener = launch::bind(&config.host, config.port)
            .await
            .expect("binds");
        config.port = listener.local_addr().expect("address").port();
        let url = format!("http://127.0.0.1:{}/v1/chat/completions", config.port);
        let state = std::sync::Arc::new(launch::app_state(config));
        tokio::spawn(server::serve(listener, state));
        url
    }

    /// The oracle's counts against a real vllm-sim's: the plan is sent to one sim one request at a
    /// time (turn by turn across sessions, real answers fed back as history, as the driver does),
    /// and the oracle replays the same prompts and answers. Its unbounded queries and hits must
    /// equal the sim's summed `prompt_tokens` and `cached_tokens`: any divergence in the template,
    /// the block hashes, the last-token rule or the caching of generated blocks shows up here.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn predicted_hits_equal_a_real_sims_cached_tokens() {
        let url = start_sim(4096).await;
        let http = crate::client::Http::new();
        for (name, plan) in [
            (
                "multi-turn",
                Workload::MultiTurn {
                    users: 3,
                    rounds: 3,
                    system_tokens: 70,
                    question_tokens: 9,
                    output_tokens: 13,
                    user_context_tokens: 21,
                    warmup_requests: 0,
                }
                .generate(5),
            ),
            (
                "shared-prefix",
                Workload::SharedPrefix {
                    groups: 2,
                    prompts_per_group: 3,
                    system_tokens: 50,
                    question_tokens: 7,
                    output_tokens: 3,
                    requests: 10,
                    zipf: 0.0,
                    warmup_per_group: 0,
                }
                .generate(6),
            ),
        ] {
            let mut answers: Vec<Vec<String>> = vec![Vec::new(); plan.sessions.len()];
            let mut replay = Vec::new();
            let (mut prompt_tokens, mut cached_tokens) = (0u64, 0u64);
            for (s, turn) in replay_order(&plan) {
                let body = crate::driver::api_body(
                    crate::api::Api::Chat,
                    "m",
                    &plan,
                    s,
                    turn,
                    &answers[s],
                );
                let r = http
                    .stream_api(
                        crate::api::Api::Chat,
                        &url,
                        body,
                        &[],
                        std::time::Duration::from_secs(60),
                    )
                    .await;
                assert!(r.ok(), "{name}: {r:?}");
                prompt_tokens += u64::from(r.prompt_tokens.expect("usage"));
                cached_tokens += u64::from(r.cached_tokens.expect("cached tokens"));
                replay.push(OracleRequest {
                    prompt: render_chat(&messages(&plan.sessions[s], turn, &answers[s])),
                    answer: r.text.clone().into_bytes(),
                });
                answers[s].push(r.text);
            }
            let predicted = bound(&replay, 0, 16, 4096).unbounded;
            assert!(predicted.hits > 0, "{name}: the workload shares nothing");
            assert_eq!(
                predicted,
                HitCount {
                    queries: prompt_tokens,
                    hits: cached_tokens
                },
                "{name}"
            );
        }
    }
}
