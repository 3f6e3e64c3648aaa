//! The benchmark workloads, generated from a seed into a [`Plan`] of sessions.
//!
//! A session is a conversation: an optional system prompt and one or more user turns, each sent
//! after the previous answer arrived (with the whole history, as chat clients do). Single-shot
//! workloads are sessions of one turn, so one driver and one oracle serve every workload.
//!
//! | workload | modelled on | what it exposes |
//! |---|---|---|
//! | `shared-prefix` | SGLang's `generated-shared-prefix` benchmark: G groups x P prompts, a long system prompt per group, a short question | prefix-cache affinity |
//! | `prefix-groups` | the same, with new groups arriving all through the run and the newest ones the most asked (a fresh document everyone queries) | hot-spotting: affinity piling a hot group onto one backend |
//! | `multi-turn` | vLLM production-stack's multi-round QA: U users x R rounds, one shared system prompt, the history resent each turn, `x-user-id` | session affinity as the history grows |
//! | `long-short` | a few very long prompts among many short ones | load imbalance (head-of-line prefill) |
//! | `no-sharing` | unique prompts | pure load balance |
//! | `trace` | a production trace (Mooncake's FAST'25 traces, `bench/traces/`): its lengths, prefix sharing and arrival times ([`crate::trace`]) | all of it, as a real service sees it |
//!
//! Text is made of four-byte words (`" abc"`), so a content of N tokens is exactly N x 4 bytes under
//! the 4-bytes-per-token approximation the gateway and vllm-sim share.

use crate::rng::{Rng, Zipf};
use crate::trace::TraceWindow;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A workload and its parameters (JSON: `{"kind": "shared-prefix", ...}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Workload {
    /// G groups x P prompts sharing a long per-group system prompt.
    SharedPrefix {
        /// Number of groups (distinct system prompts).
        groups: usize,
        /// Distinct questions per group.
        prompts_per_group: usize,
        /// Tokens of each group's system prompt.
        system_tokens: usize,
        /// Tokens of each question.
        question_tokens: usize,
        /// Output tokens per request.
        output_tokens: u32,
        /// Requests to send (drawn with replacement).
        requests: usize,
        /// Zipf exponent of group popularity (0: uniform).
        #[serde(default)]
        zipf: f64,
        /// Unmeasured requests per group sent first (see [`Workload::warmup`]).
        #[serde(default)]
        warmup_per_group: usize,
    },
    /// Groups with a long prompt each, new groups arriving over the whole run: `initial_groups`
    /// exist from the start (and are warmed up), the others appear one by one at evenly spaced
    /// points of the request sequence. Each request asks a fresh question of one active group,
    /// chosen by recency: the group introduced `k`-th most recently has weight `1 / (k + 1)^s`.
    PrefixGroups {
        /// Groups over the whole run.
        groups: usize,
        /// Groups active from the first request.
        initial_groups: usize,
        /// Tokens of each group's prompt.
        system_tokens: usize,
        /// Tokens of each (unique) question.
        question_tokens: usize,
        /// Output tokens per request.
        output_tokens: u32,
        /// Requests to send.
        requests: usize,
        /// Zipf exponent over the active groups by recency (0: uniform over the active groups).
        #[serde(default)]
        recency_zipf: f64,
        /// Unmeasured requests per initial group sent first (later groups arrive cold).
        #[serde(default)]
        warmup_per_group: usize,
    },
    /// U users x R rounds of chat over one shared system prompt.
    MultiTurn {
        /// Users (conversations).
        users: usize,
        /// Rounds (turns) per user.
        rounds: usize,
        /// Tokens of the shared system prompt.
        system_tokens: usize,
        /// Tokens of each user message.
        question_tokens: usize,
        /// Output tokens per turn.
        output_tokens: u32,
        /// Tokens of a per-user document opening the first message (as the per-user context of
        /// production-stack's benchmark), so each conversation has a sizeable prefix of its own.
        #[serde(default)]
        user_context_tokens: usize,
        /// Unmeasured single-turn requests over the shared system prompt sent first (see
        /// [`Workload::warmup`]).
        #[serde(default)]
        warmup_requests: usize,
    },
    /// Short prompts with a few long ones among them.
    LongShort {
        /// Requests to send.
        requests: usize,
        /// Fraction of long requests.
        long_fraction: f64,
        /// Tokens of a long prompt.
        long_tokens: usize,
        /// Tokens of a short prompt.
        short_tokens: usize,
        /// Output tokens per request.
        output_tokens: u32,
    },
    /// Unique prompts, nothing shared.
    NoSharing {
        /// Requests to send.
        requests: usize,
        /// Tokens per prompt.
        prompt_tokens: usize,
        /// Output tokens per request.
        output_tokens: u32,
    },
    /// A window of a request trace, replayed at its own arrival times (divided by the mode's
    /// speed-up, [`crate::driver::Load::Replay`]); see [`crate::trace`].
    Trace {
        /// The trace file (JSON lines, `.gz` for gzipped), relative to the working directory.
        path: String,
        /// Prompt lengths (and the trace's blocks) are divided by this: 16 makes a 512-token
        /// block 32 tokens.
        #[serde(default = "default_trace_scale")]
        scale: f64,
        /// Output lengths are divided by this (default: `scale`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        output_scale: Option<f64>,
        /// Index of the first request replayed, in timestamp order.
        #[serde(default)]
        start: usize,
        /// Requests replayed (0: to the end of the trace or of `duration_s`).
        #[serde(default)]
        requests: usize,
        /// Trace-time length of the window, seconds (0: no limit).
        #[serde(default)]
        duration_s: f64,
        /// Tokens one hash id stands for in the trace (Mooncake: 512).
        #[serde(default = "default_trace_block_tokens")]
        block_tokens: u64,
        /// Scaled prompts longer than this are cut to it, keeping the prefix (0: no cap).
        #[serde(default)]
        max_input_tokens: usize,
    },
}

fn default_trace_scale() -> f64 {
    16.0
}

fn default_trace_block_tokens() -> u64 {
    512
}

/// One user message and the answer length asked for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The user message.
    pub user: String,
    /// `max_tokens` (sent with `ignore_eos`, so the answer has exactly this many tokens).
    pub output_tokens: u32,
}

/// A conversation: sent turn after turn, each with the full history.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// Sent as `x-user-id` when set.
    pub user_id: Option<String>,
    /// The system prompt, if any.
    pub system: Option<String>,
    /// The user turns in order.
    pub turns: Vec<Turn>,
}

/// A generated workload: its sessions in dispatch order.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The sessions, in the order they start.
    pub sessions: Vec<Session>,
    /// A trace's arrival times, ms from its first request, one per session (empty for the
    /// generated workloads, whose arrivals the driver draws).
    pub trace_ms: Vec<f64>,
}

impl Plan {
    /// Requests in the plan (turns of every session).
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }
}

/// `tokens` tokens of random four-byte words.
pub fn words(rng: &mut Rng, tokens: usize) -> String {
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz";
    let mut s = String::with_capacity(tokens * 4);
    for _ in 0..tokens {
        s.push(' ');
        for _ in 0..3 {
            s.push(LETTERS[rng.below(26) as usize] as char);
        }
    }
    s
}

/// The random stream plans are drawn from.
const PLAN_STREAM: u64 = 0x776f_726b;

/// The system prompts of `groups` groups (`system_tokens` tokens each, numbered so they differ from
/// the first block on).
fn group_systems(rng: &mut Rng, groups: usize, system_tokens: usize) -> Vec<String> {
    (0..groups)
        .map(|g| {
            format!(
                "Group {g:04}.{}",
                words(rng, system_tokens.saturating_sub(3))
            )
        })
        .collect()
}

/// The shared system prompt of `multi-turn` (drawn first from the plan's stream).
fn shared_system(rng: &mut Rng, system_tokens: usize) -> String {
    format!(
        "Shared system.{}",
        words(rng, system_tokens.saturating_sub(4))
    )
}

impl Workload {
    /// The workload's short name (`shared-prefix`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Workload::SharedPrefix { .. } => "shared-prefix",
            Workload::PrefixGroups { .. } => "prefix-groups",
            Workload::MultiTurn { .. } => "multi-turn",
            Workload::LongShort { .. } => "long-short",
            Workload::NoSharing { .. } => "no-sharing",
            Workload::Trace { .. } => "trace",
        }
    }

    /// The unmeasured warm-up sent before the plan, if the workload has one: for `shared-prefix`,
    /// `warmup_per_group` requests of every group with questions of their own, so that the measured
    /// requests see the steady state (caches holding the system prompts) rather than the one-off
    /// compulsory misses, which would otherwise set the tail of a short run.
    ///
    /// For `prefix-groups`, the same for the initial groups only: the later ones arrive cold.
    ///
    /// For `multi-turn`, `warmup_requests` single questions over the shared system prompt: in a
    /// service that has been up for a while every backend holds that prompt, so new conversations
    /// are not drawn to the few backends that happened to compute it first.
    pub fn warmup(&self, seed: u64) -> Option<Plan> {
        if let Workload::MultiTurn {
            system_tokens,
            question_tokens,
            output_tokens,
            warmup_requests,
            ..
        } = *self
        {
            if warmup_requests == 0 {
                return None;
            }
            let system = shared_system(&mut Rng::new(seed, PLAN_STREAM), system_tokens);
            let mut rng = Rng::new(seed, 0x7761_726d);
            let sessions = (0..warmup_requests)
                .map(|_| Session {
                    user_id: None,
                    system: Some(system.clone()),
                    turns: vec![Turn {
                        user: words(&mut rng, question_tokens),
                        output_tokens,
                    }],
                })
                .collect();
            return Some(Plan {
                sessions,
                trace_ms: Vec::new(),
            });
        }
        let (groups, system_tokens, question_tokens, output_tokens, warmup_per_group, warm) =
            match *self {
                Workload::SharedPrefix {
                    groups,
                    system_tokens,
                    question_tokens,
                    output_tokens,
                    warmup_per_group,
                    ..
                } => (
                    groups,
                    system_tokens,
                    question_tokens,
                    output_tokens,
                    warmup_per_group,
                    groups,
                ),
                Workload::PrefixGroups {
                    groups,
                    initial_groups,
                    system_tokens,
                    question_tokens,
                    output_tokens,
                    warmup_per_group,
                    ..
                } => (
                    groups,
                    system_tokens,
                    question_tokens,
                    output_tokens,
                    warmup_per_group,
                    initial_groups,
                ),
                _ => return None,
            };
        if warmup_per_group == 0 {
            return None;
        }
        // The system prompts are the plan's own (the plan draws them first from the same stream);
        // questions come from a separate stream so that the warm-up never changes the plan.
        let mut systems = group_systems(
            &mut Rng::new(seed, PLAN_STREAM),
            groups.max(1),
            system_tokens,
        );
        systems.truncate(warm.clamp(1, groups.max(1)));
        let mut rng = Rng::new(seed, 0x7761_726d);
        let mut sessions = Vec::new();
        for _ in 0..warmup_per_group {
            let mut order: Vec<usize> = (0..systems.len()).collect();
            rng.shuffle(&mut order);
            for g in order {
                sessions.push(Session {
                    user_id: None,
                    system: Some(systems[g].clone()),
                    turns: vec![Turn {
                        user: words(&mut rng, question_tokens),
                        output_tokens,
                    }],
                });
            }
        }
        Some(Plan {
            sessions,
            trace_ms: Vec::new(),
        })
    }

    /// Generates the plan; the same workload and seed always give the same plan.
    pub fn generate(&self, seed: u64) -> Plan {
        if let Some((path, window)) = self.trace_window() {
            // Read when the config was loaded ([`Workload::check`]); a file gone since is fatal.
            let trace = crate::trace::read(Path::new(path))
                .unwrap_or_else(|e| panic!("trace workload: {e}"));
            return window.plan(&trace);
        }
        let mut rng = Rng::new(seed, PLAN_STREAM);
        let sessions = match *self {
            Workload::SharedPrefix {
                groups,
                prompts_per_group,
                system_tokens,
                question_tokens,
                output_tokens,
                requests,
                zipf,
                ..
            } => {
                let groups = groups.max(1);
                let per_group = prompts_per_group.max(1);
                let systems = group_systems(&mut rng, groups, system_tokens);
                let questions: Vec<Vec<String>> = (0..groups)
                    .map(|_| {
                        (0..per_group)
                            .map(|_| words(&mut rng, question_tokens))
                            .collect()
                    })
                    .collect();
                let popularity = Zipf::new(groups, zipf);
                // Group ranks are shuffled so that the popular groups are not always the first ones
                // generated (which a hash ring would place arbitrarily anyway).
                let mut rank_to_group: Vec<usize> = (0..groups).collect();
                rng.shuffle(&mut rank_to_group);
                (0..requests)
                    .map(|_| {
                        let g = rank_to_group[popularity.sample(&mut rng)];
                        let q = rng.below(per_group as u64) as usize;
                        Session {
                            user_id: None,
                            system: Some(systems[g].clone()),
                            turns: vec![Turn {
                                user: questions[g][q].clone(),
                                output_tokens,
                            }],
                        }
                    })
                    .collect()
            }
            Workload::PrefixGroups {
                groups,
                initial_groups,
                system_tokens,
                question_tokens,
                output_tokens,
                requests,
                recency_zipf,
                ..
            } => {
                let groups = groups.max(1);
                let initial = initial_groups.clamp(1, groups);
                let systems = group_systems(&mut rng, groups, system_tokens);
                let by_recency: Vec<Zipf> =
                    (1..=groups).map(|n| Zipf::new(n, recency_zipf)).collect();
                (0..requests)
                    .map(|i| {
                        let active = active_groups(i, requests, initial, groups);
                        let newest_first = by_recency[active - 1].sample(&mut rng);
                        let g = active - 1 - newest_first;
                        Session {
                            user_id: None,
                            system: Some(systems[g].clone()),
                            turns: vec![Turn {
                                user: words(&mut rng, question_tokens),
                                output_tokens,
                            }],
                        }
                    })
                    .collect()
            }
            Workload::MultiTurn {
                users,
                rounds,
                system_tokens,
                question_tokens,
                output_tokens,
                user_context_tokens,
                ..
            } => {
                let system = shared_system(&mut rng, system_tokens);
                (0..users)
                    .map(|u| {
                        let context = words(&mut rng, user_context_tokens);
                        Session {
                            user_id: Some(format!("user-{u:05}")),
                            system: Some(system.clone()),
                            turns: (0..rounds)
                                .map(|r| {
                                    let q = words(&mut rng, question_tokens);
                                    Turn {
                                        user: if r == 0 { context.clone() + &q } else { q },
                                        output_tokens,
                                    }
                                })
                                .collect(),
                        }
                    })
                    .collect()
            }
            Workload::LongShort {
                requests,
                long_fraction,
                long_tokens,
                short_tokens,
                output_tokens,
            } => (0..requests)
                .map(|_| {
                    let tokens = if rng.next_f64() < long_fraction {
                        long_tokens
                    } else {
                        short_tokens
                    };
                    Session {
                        user_id: None,
                        system: None,
                        turns: vec![Turn {
                            user: words(&mut rng, tokens),
                            output_tokens,
                        }],
                    }
                })
                .collect(),
            Workload::NoSharing {
                requests,
                prompt_tokens,
                output_tokens,
            } => (0..requests)
                .map(|_| Session {
                    user_id: None,
                    system: None,
                    turns: vec![Turn {
                        user: words(&mut rng, prompt_tokens),
                        output_tokens,
                    }],
                })
                .collect(),
            Workload::Trace { .. } => unreachable!("handled above"),
        };
        Plan {
            sessions,
            trace_ms: Vec::new(),
        }
    }

    /// The trace window of a `trace` workload.
    pub fn trace_window(&self) -> Option<(&str, TraceWindow)> {
        match self {
            Workload::Trace {
                path,
                scale,
                output_scale,
                start,
                requests,
                duration_s,
                block_tokens,
                max_input_tokens,
            } => Some((
                path,
                TraceWindow {
                    scale: *scale,
                    output_scale: output_scale.unwrap_or(*scale),
                    start: *start,
                    requests: *requests,
                    duration_s: *duration_s,
                    block_tokens: *block_tokens,
                    max_input_tokens: *max_input_tokens,
                },
            )),
            _ => None,
        }
    }

    /// Checks what generating needs beyond the parameters: a `trace` workload's file can be read.
    pub fn check(&self) -> Result<(), String> {
        if let Some((path, _)) = self.trace_window() {
            crate::trace::read(Path::new(path))?;
        }
        Ok(())
    }
}

/// Groups of `prefix-groups` active at request `i` of `requests`: the `initial` ones, then one more
/// at each of `groups - initial` evenly spaced points, the last one well before the end (so it
/// gets traffic too).
pub fn active_groups(i: usize, requests: usize, initial: usize, groups: usize) -> usize {
    let later = groups.saturating_sub(initial);
    if later == 0 || requests == 0 {
        return initial.max(1).min(groups.max(1));
    }
    (initial + i * (later + 1) / requests).min(groups)
}

/// A chat message as sent on the wire.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: &'static str,
    /// The text.
    pub content: String,
}

/// The messages of turn `turn` of `session`, given the answers to the earlier turns.
pub fn messages(session: &Session, turn: usize, answers: &[String]) -> Vec<Message> {
    let mut out = Vec::with_capacity(2 * turn + 2);
    if let Some(system) = &session.system {
        out.push(Message {
            role: "system",
            content: system.clone(),
        });
    }
    for (i, t) in session.turns.iter().take(turn + 1).enumerate() {
        out.push(Message {
            role: "user",
            content: t.user.clone(),
        });
        if i < turn {
            out.push(Message {
                role: "assistant",
                content: answers.get(i).cloned().unwrap_or_default(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(zipf: f64) -> Workload {
        Workload::SharedPrefix {
            groups: 4,
            prompts_per_group: 3,
            system_tokens: 100,
            question_tokens: 10,
            output_tokens: 8,
            requests: 200,
            zipf,
            warmup_per_group: 1,
        }
    }

    #[test]
    fn generation_is_deterministic_per_seed() {
        for w in [
            shared(0.0),
            shared(1.2),
            Workload::MultiTurn {
                users: 3,
                rounds: 4,
                system_tokens: 50,
                question_tokens: 5,
                output_tokens: 4,
                user_context_tokens: 20,
                warmup_requests: 2,
            },
            Workload::LongShort {
                requests: 50,
                long_fraction: 0.1,
                long_tokens: 400,
                short_tokens: 20,
                output_tokens: 4,
            },
            Workload::NoSharing {
                requests: 20,
                prompt_tokens: 30,
                output_tokens: 4,
            },
        ] {
            assert_eq!(w.generate(42), w.generate(42), "{}", w.kind());
            assert_ne!(w.generate(42), w.generate(43), "{}", w.kind());
        }
    }

    #[test]
    fn shared_prefix_uses_g_system_prompts_of_the_right_length() {
        let plan = shared(0.0).generate(1);
        assert_eq!(plan.requests(), 200);
        let mut systems: Vec<&String> = plan
            .sessions
            .iter()
            .map(|s| s.system.as_ref().unwrap())
            .collect();
        systems.sort();
        systems.dedup();
        assert_eq!(systems.len(), 4);
        assert!(
            systems.iter().all(|s| s.len().div_ceil(4) == 100),
            "{}",
            systems[0].len()
        );
        assert!(plan.sessions.iter().all(|s| s.turns[0].user.len() == 40));
    }

    #[test]
    fn warmup_covers_every_group_once_with_fresh_questions() {
        let w = shared(0.0);
        let warm = w.warmup(1).unwrap();
        let main = w.generate(1);
        assert_eq!(warm.sessions.len(), 4);
        let systems = |p: &Plan| {
            let mut v: Vec<String> = p.sessions.iter().filter_map(|s| s.system.clone()).collect();
            v.sort();
            v.dedup();
            v
        };
        assert_eq!(systems(&warm), systems(&main));
        assert!(warm.sessions.iter().all(|s| main
            .sessions
            .iter()
            .all(|m| m.turns[0].user != s.turns[0].user)));
        assert_eq!(w.warmup(1), w.warmup(1));
        assert!(Workload::NoSharing {
            requests: 1,
            prompt_tokens: 1,
            output_tokens: 1
        }
        .warmup(1)
        .is_none());
    }

    fn groups(recency_zipf: f64) -> Workload {
        Workload::PrefixGroups {
            groups: 12,
            initial_groups: 4,
            system_tokens: 80,
            question_tokens: 6,
            output_tokens: 4,
            requests: 360,
            recency_zipf,
            warmup_per_group: 1,
        }
    }

    #[test]
    fn prefix_groups_keep_arriving_over_the_run() {
        let w = groups(1.0);
        let plan = w.generate(9);
        assert_eq!(plan, w.generate(9));
        assert_ne!(plan, w.generate(10));
        assert_eq!(plan.requests(), 360);
        // The request index at which each system prompt is first seen.
        let mut first: Vec<(String, usize)> = Vec::new();
        for (i, s) in plan.sessions.iter().enumerate() {
            let sys = s.system.clone().unwrap();
            if !first.iter().any(|(f, _)| *f == sys) {
                first.push((sys, i));
            }
        }
        assert_eq!(first.len(), 12, "every group gets traffic");
        // Groups are numbered in the order they appear, and the later ones appear late.
        let order: Vec<usize> = first
            .iter()
            .map(|(s, _)| s[6..10].parse().unwrap())
            .collect();
        assert_eq!(order[4..].to_vec(), (4..12).collect::<Vec<_>>());
        let last_start = first.last().unwrap().1;
        assert!(last_start > 360 * 3 / 4, "{last_start}");
        // No request goes to a group before its start.
        for (i, s) in plan.sessions.iter().enumerate() {
            let g: usize = s.system.as_ref().unwrap()[6..10].parse().unwrap();
            assert!(g < active_groups(i, 360, 4, 12), "request {i} group {g}");
        }
        // Unique questions: a prompt never repeats.
        let mut users: Vec<&String> = plan.sessions.iter().map(|s| &s.turns[0].user).collect();
        users.sort();
        users.dedup();
        assert_eq!(users.len(), 360);
    }

    #[test]
    fn prefix_groups_favour_the_newest_group_and_warm_only_the_initial_ones() {
        // With a steep recency exponent most requests go to the newest active group.
        let plan = groups(2.0).generate(4);
        let newest = plan
            .sessions
            .iter()
            .enumerate()
            .filter(|(i, s)| {
                let g: usize = s.system.as_ref().unwrap()[6..10].parse().unwrap();
                g + 1 == active_groups(*i, 360, 4, 12)
            })
            .count();
        assert!(newest > 360 / 2, "{newest}");
        let warm = groups(0.0).warmup(4).unwrap();
        assert_eq!(warm.sessions.len(), 4);
        let mut systems: Vec<String> = warm
            .sessions
            .iter()
            .map(|s| s.system.clone().unwrap()[6..10].to_string())
            .collect();
        systems.sort();
        assert_eq!(systems, ["0000", "0001", "0002", "0003"]);
        assert_eq!(active_groups(0, 360, 4, 12), 4);
        assert_eq!(active_groups(359, 360, 4, 12), 12);
        assert_eq!(active_groups(5, 10, 3, 3), 3);
    }

    #[test]
    fn zipf_concentrates_on_few_groups() {
        let count_top = |plan: &Plan| {
            let mut counts = std::collections::HashMap::new();
            for s in &plan.sessions {
                *counts.entry(s.system.clone()).or_insert(0) += 1;
            }
            *counts.values().max().unwrap()
        };
        assert!(count_top(&shared(1.5).generate(5)) > count_top(&shared(0.0).generate(5)));
    }

    #[test]
    fn multi_turn_resends_the_history() {
        let w = Workload::MultiTurn {
            users: 2,
            rounds: 3,
            system_tokens: 20,
            question_tokens: 5,
            output_tokens: 4,
            user_context_tokens: 10,
            warmup_requests: 3,
        };
        let plan = w.generate(3);
        let warm = w.warmup(3).unwrap();
        assert_eq!(warm.sessions.len(), 3);
        assert_eq!(warm.sessions[0].system, plan.sessions[0].system);
        assert_eq!(
            plan.sessions[0].turns[0].user.len(),
            4 * 15,
            "context + question"
        );
        assert_eq!(plan.sessions[0].turns[1].user.len(), 4 * 5);
        assert_eq!(plan.sessions.len(), 2);
        assert_eq!(plan.sessions[0].system, plan.sessions[1].system);
        let s = &plan.sessions[1];
        let m = messages(s, 2, &["a1".into(), "a2".into()]);
        let roles: Vec<&str> = m.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "user", "assistant", "user"]
        );
        assert_eq!(m[2].content, "a1");
        assert_eq!(m[5].content, s.turns[2].user);
    }

    #[test]
    fn long_short_mixes_in_the_requested_fraction() {
        let plan = Workload::LongShort {
            requests: 2000,
            long_fraction: 0.05,
            long_tokens: 100,
            short_tokens: 10,
            output_tokens: 4,
        }
        .generate(8);
        let long = plan
            .sessions
            .iter()
            .filter(|s| s.turns[0].user.len() == 400)
            .count();
        assert!((60..=140).contains(&long), "{long}");
    }
}
