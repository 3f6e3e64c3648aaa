//! Tests of [`super`]: determinism per seed, shared prefixes, prefix groups, Zipf popularity,
//! multi-turn history and the long/short mix.

use super::*;
use crate::plan::messages;

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
