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

use crate::plan::{words, Plan, Session, Turn};
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

#[cfg(test)]
mod tests;
