//! The decision end to end: filtering, ranking by each policy, pairing, the lease's counters.

use crate::backend::cost::InFlight;
use crate::backend::scrape::{ScrapedGauges, VllmMetrics};
use crate::backend::BackendId;
use crate::backend::BackendSpec;
use crate::backend::Lifecycle;
use crate::policy::{DecisionKind, PolicyKind};
use crate::pool::test_support::{add_ready, features, pool_with, spec, up};
use crate::pool::{AcquireError, Pool, PoolConfig, ProbeResult};
use crate::random::SplitMix64;
use crate::request::role::Role;
use crate::stream::outcome::Outcome;

#[test]
fn unknown_model_is_model_not_found() {
    let mut pool = pool_with(PolicyKind::LeastLoad, 2);
    let mut f = features("x");
    f.model = "gpt-9".into();
    assert_eq!(
        pool.acquire(&f, 0, &mut SplitMix64::new(0)),
        Err(AcquireError::ModelNotFound {
            model: "gpt-9".into()
        })
    );
}

#[test]
fn grants_rank_distinct_candidates_and_count_leases() {
    let mut pool = pool_with(PolicyKind::RoundRobin, 4);
    let mut rng = SplitMix64::new(0);
    let g = pool.acquire(&features("hello"), 0, &mut rng).unwrap();
    assert_eq!(g.candidates.len(), 3);
    assert_eq!(g.decision, Some(DecisionKind::RoundRobin));
    assert_eq!(pool.in_flight_total(), 1);
    assert_eq!(pool.in_flight(&g.backend).unwrap().leases, 1);
    assert_eq!(pool.next_deadline(), Some(60_000));
    assert!(pool.release(g.lease_id, &Outcome::from_status(200), 10));
    assert!(
        !pool.release(g.lease_id, &Outcome::from_status(200), 11),
        "double release is a no-op"
    );
    assert_eq!(pool.in_flight_total(), 0);
    assert_eq!(pool.in_flight(&g.backend).unwrap(), InFlight::default());
}

#[test]
fn cache_aware_follows_the_prefix() {
    let mut pool = pool_with(PolicyKind::CacheAware, 4);
    let mut rng = SplitMix64::new(0);
    let doc = "shared system prompt ".repeat(100);
    let g1 = pool.acquire(&features(&doc), 0, &mut rng).unwrap();
    assert_eq!(g1.decision, Some(DecisionKind::CacheMiss));
    pool.release(g1.lease_id, &Outcome::from_status(200), 1);
    let g2 = pool
        .acquire(&features(&format!("{doc} and more")), 2, &mut rng)
        .unwrap();
    assert_eq!(g2.decision, Some(DecisionKind::CacheHit));
    assert_eq!(g2.backend, g1.backend);
    assert!(g2.cached_blocks > 25, "{}", g2.cached_blocks);
    assert!((0..4).map(|b| pool.affinity().backend_len(b)).sum::<u64>() > 25);
}

#[test]
fn consistent_hash_is_sticky_per_key() {
    let mut pool = pool_with(PolicyKind::ConsistentHash, 5);
    let mut rng = SplitMix64::new(0);
    let mut f = features("x");
    f.routing_key = Some("session-42".into());
    let first = pool.acquire(&f, 0, &mut rng).unwrap();
    assert_eq!(first.decision, Some(DecisionKind::Sticky));
    pool.release(first.lease_id, &Outcome::default(), 1);
    for t in 2..10 {
        let g = pool.acquire(&f, t, &mut rng).unwrap();
        assert_eq!(g.backend, first.backend);
        pool.release(g.lease_id, &Outcome::default(), t);
    }
    f.routing_key = None;
    assert_eq!(
        pool.acquire(&f, 20, &mut rng).unwrap().decision,
        Some(DecisionKind::NoKey)
    );
}

#[test]
fn disaggregated_pairs_prefill_and_decode() {
    let mut pool = Pool::new(
        "p",
        PoolConfig {
            policy: PolicyKind::Disaggregated,
            ..PoolConfig::default()
        },
    );
    for (id, role) in [
        ("pf", Role::Prefill),
        ("dc", Role::Decode),
        ("mx", Role::Mixed),
    ] {
        let id = pool
            .add_backend(BackendSpec { role, ..spec(id) }, 0)
            .unwrap();
        pool.record_probe(&id, &up(), 0).unwrap();
    }
    let mut rng = SplitMix64::new(0);
    let g = pool.acquire(&features("x"), 1, &mut rng).unwrap();
    assert_eq!(g.backend.as_str(), "pf");
    assert_eq!(g.decode_candidates[0].id.as_str(), "dc");
    assert_eq!(pool.in_flight_total(), 2);
    pool.release(g.lease_id, &Outcome::default(), 2);
    assert_eq!(pool.in_flight_total(), 0);
    pool.set_lifecycle(&"dc".into(), Lifecycle::Draining, 3)
        .unwrap();
    let g = pool.acquire(&features("x"), 4, &mut rng).unwrap();
    assert_eq!(
        g.backend.as_str(),
        "mx",
        "no decode backend: mixed fallback"
    );
    assert!(g.decode_candidates.is_empty());
    let mut f = features("x");
    f.role_hint = Some(Role::Decode);
    assert!(
        pool.acquire(&f, 5, &mut rng).is_err(),
        "the only decode backend is drained"
    );
}

#[test]
fn a_backend_busy_with_other_clients_is_avoided() {
    let mut pool = pool_with(PolicyKind::PredictedLatency, 2);
    let busy = ProbeResult {
        ok: true,
        metrics: VllmMetrics {
            gauges: ScrapedGauges {
                waiting: Some(20.0),
                running: Some(10.0),
                kv_usage: Some(1.0),
                ..ScrapedGauges::default()
            },
            ..VllmMetrics::default()
        },
        ..ProbeResult::default()
    };
    pool.record_probe(&BackendId::from("b0"), &busy, 1).unwrap();
    let mut rng = SplitMix64::new(3);
    for i in 0..4 {
        let g = pool
            .acquire(&features(&format!("q{i}")), 2, &mut rng)
            .unwrap();
        assert_eq!(g.backend.as_str(), "b1", "request {i}");
        assert!(pool.release(g.lease_id, &Outcome::from_status(200), 3));
    }
}

/// A prefix recorded by a request whose prefill has not started is no hit yet: a request the
/// engine admits beside it (queued with it, or arriving within the same engine step) computes
/// the prefix again. Once the first request's prefill is under way, later ones find it cached.
#[test]
fn a_prefix_still_queued_is_no_hit_yet() {
    let prefix = "the group prompt, ".repeat(150);
    let other = "an unrelated prompt ".repeat(135);
    // Predicted TTFT of a request behind `prefix` sent at `at` ms, after `first` (at 0) on one
    // backend, optionally behind a queue of cold prompts granted first.
    let predicted = |first: &str, queued: bool, at: u64| {
        let mut pool = pool_with(PolicyKind::PredictedLatency, 1);
        let mut rng = SplitMix64::new(5);
        if queued {
            for i in 0..4 {
                let cold = format!("{i} cold filler ").repeat(400);
                pool.acquire(&features(&cold), 0, &mut rng).unwrap();
            }
        }
        let a = pool.acquire(&features(first), 0, &mut rng).unwrap();
        let b = pool
            .acquire(&features(&format!("{prefix} and a question")), at, &mut rng)
            .unwrap();
        (
            a.cached_blocks,
            b.cached_blocks,
            b.predicted_ttft_ms.unwrap(),
        )
    };
    // Behind a queue: the prefix's first request has not started, so the second computes it as
    // if it had never been seen (the table still says it is there).
    let (_, cached, behind_queue) = predicted(&prefix, true, 1);
    assert!(cached > 30, "{cached}");
    let (_, _, unseen) = predicted(&other, true, 1);
    assert!(
        behind_queue.abs_diff(unseen) <= 1,
        "{behind_queue} vs {unseen}"
    );
    // Within the engine step the first one arrives in, the second is admitted beside it.
    let (_, _, same_step) = predicted(&prefix, false, 1);
    let (_, _, unseen_same_step) = predicted(&other, false, 1);
    assert!(same_step.abs_diff(unseen_same_step) <= 1);
    // No queue: the first request's prefill starts with the next step, so a second one sent
    // after that shares it.
    let (_, _, started) = predicted(&prefix, false, 40);
    let (_, _, unseen_idle) = predicted(&other, false, 40);
    assert!(started + 20 < unseen_idle, "{started} vs {unseen_idle}");
}

/// The grant's receipt names the chosen backend's predicted time to first token (the same figure
/// as `predicted_ttft_ms`) and the lowest predicted among the others: behind a queue on `b0`,
/// the alternative `b1` is predicted faster than `b0` would have been.
#[test]
fn the_receipt_names_the_choice_and_the_best_alternative() {
    let mut pool = pool_with(PolicyKind::PredictedLatency, 2);
    let mut rng = SplitMix64::new(9);
    let first = pool
        .acquire(&features(&"cold filler ".repeat(400)), 0, &mut rng)
        .unwrap();
    let second = pool
        .acquire(&features(&"other filler ".repeat(400)), 0, &mut rng)
        .unwrap();
    assert_ne!(first.backend, second.backend);
    let r = second.receipt.clone().unwrap();
    assert_eq!(Some(r.predicted_ttft_ms), second.predicted_ttft_ms);
    assert_eq!(r.alt.as_ref(), Some(&first.backend));
    // The alternative holds the first request's prefill queue: it is predicted slower.
    assert!(
        r.alt_predicted_ttft_ms.unwrap() > r.predicted_ttft_ms,
        "{r:?}"
    );
    assert_eq!(
        r.header_value(&second.backend),
        format!(
            "backend={};predicted_ttft_ms={};alt={};alt_predicted_ttft_ms={}",
            second.backend.0,
            r.predicted_ttft_ms,
            first.backend.0,
            r.alt_predicted_ttft_ms.unwrap()
        )
    );
    let lone = pool_with(PolicyKind::PredictedLatency, 1)
        .acquire(&features("a question"), 0, &mut rng)
        .unwrap();
    let r = lone.receipt.unwrap();
    assert_eq!((&r.alt, r.alt_predicted_ttft_ms), (&None, None));
    assert!(!r.header_value(&lone.backend).contains("alt="));
}

/// A pool of one ready backend with `kv_blocks` of 16 tokens and `max_num_seqs` slots.
fn one_backend(kv_blocks: u64, max_num_seqs: u32) -> Pool {
    let mut pool = Pool::new("p1", PoolConfig::default());
    add_ready(
        &mut pool,
        BackendSpec {
            capacity: crate::backend::Capacity {
                kv_blocks,
                block_size: 16,
                max_num_seqs,
                kv_tokens: 0,
            },
            ..spec("b0")
        },
    );
    pool
}

/// A backend whose KV cache is full of long answers admits a new request only as they finish,
/// however idle its prefill queue looks: the wait for room is priced at how long the backend
/// takes to free its memory (its sequences' prefills one after another, then their decodes),
/// not at the new request's own decode. Priced at a 1-token answer's decode, as before, a request
/// behind 10 sequences on a 2-sequence cache was predicted 272 ms (its own prefill); now 31 s
/// (five more rounds of two 500-token answers, about 5 s each, and their prefills).
#[test]
fn a_request_queued_for_memory_is_predicted_to_wait_for_it() {
    let mut pool = one_backend(256, 64);
    let mut rng = SplitMix64::new(4);
    let long_answer = |i: usize| {
        let mut f = features(&format!("{i} a long prompt ").repeat(450));
        f.max_tokens = 500;
        f
    };
    for i in 0..10 {
        pool.acquire(&long_answer(i), 0, &mut rng).unwrap();
    }
    // Five seconds on, the virtual prefill queue has drained, but none has finished.
    let mut short = features(&"one more prompt ".repeat(500));
    short.max_tokens = 1;
    let g = pool.acquire(&short, 5_000, &mut rng).unwrap();
    let predicted = g.predicted_ttft_ms.unwrap();
    assert!(predicted > 2_000, "{predicted} ms");
}

/// A backend out of sequence slots but with memory to spare frees a slot as its first running
/// sequence ends: the drain is its slots' prefills and one decode, not as many sequences as its
/// memory would hold. Counting those (256 short prompts' prefills on this 65,536-token cache), a
/// short request behind 5 sequences on 4 slots was predicted to wait 2.8 s; the backend frees
/// its slots within one 60-token decode (about 650 ms).
#[test]
fn a_request_short_of_a_slot_waits_for_a_decode_not_for_the_memory_to_drain() {
    let mut pool = one_backend(4096, 4);
    let mut rng = SplitMix64::new(4);
    let short = |i: usize| {
        let mut f = features(&format!("{i} a short prompt ").repeat(40));
        f.max_tokens = 60;
        f
    };
    for i in 0..5 {
        pool.acquire(&short(i), 0, &mut rng).unwrap();
    }
    let g = pool.acquire(&short(99), 200, &mut rng).unwrap();
    let predicted = g.predicted_ttft_ms.unwrap();
    assert!((100..1_000).contains(&predicted), "{predicted} ms");
}

/// vLLM admits its queue in order: a short request granted after one that waits for memory waits
/// at least as long, even though it would fit by itself; once the backend has room again, nothing
/// holds it up.
#[test]
fn a_request_behind_one_waiting_for_memory_waits_as_long_until_there_is_room() {
    // 256 blocks of 16 tokens: 4,096 tokens.
    let mut pool = one_backend(256, 64);
    let mut rng = SplitMix64::new(5);
    let sized = |i: usize, words: usize, max_tokens: u32| {
        let mut f = features(&format!("{i} filler ").repeat(words));
        f.max_tokens = max_tokens;
        f
    };
    // A long running answer fills most of the memory; a long prompt behind it must wait for it.
    let running = pool.acquire(&sized(0, 900, 1_000), 0, &mut rng).unwrap();
    let waiting = pool.acquire(&sized(1, 900, 10), 0, &mut rng).unwrap();
    let long_wait = waiting.predicted_ttft_ms.unwrap();
    assert!(long_wait > 1_000, "{long_wait} ms");
    // A tiny request would fit beside the first (about 400 ms: the two prefills ahead), but is
    // queued behind the second: it starts when that one does, which is that one's wait less its
    // own prefill and the first's.
    let tiny = pool.acquire(&sized(2, 4, 1), 10, &mut rng).unwrap();
    let behind = tiny.predicted_ttft_ms.unwrap();
    assert!(
        behind + 500 >= long_wait && behind <= long_wait,
        "{behind} ms behind {long_wait} ms"
    );
    for g in [&running, &waiting, &tiny] {
        assert!(pool.release(g.lease_id, &Outcome::from_status(200), 20));
    }
    let after = pool.acquire(&sized(3, 4, 1), 30, &mut rng).unwrap();
    assert!(
        after.predicted_ttft_ms.unwrap() < 100,
        "{:?}",
        after.predicted_ttft_ms
    );
}

/// Tail harm: once the pool has learned its tail of end-to-end times (here about 1 s), a cold
/// prompt goes to the backend whose running answer ends well inside it rather than to the one
/// whose long answer (2,000 tokens, about 20 s) it would hold up further; with the weight at 0
/// the two are tied and either may take it.
#[test]
fn a_prompt_keeps_off_the_answer_that_ends_in_the_tail() {
    let place = |weight: f64, seed: u64| {
        let mut config = PoolConfig {
            policy: PolicyKind::PredictedLatency,
            ..PoolConfig::default()
        };
        config.predicted_latency.tail_harm_weight = weight;
        let mut pool = Pool::new("p1", config);
        add_ready(&mut pool, spec("b0"));
        add_ready(&mut pool, spec("b1"));
        let mut rng = SplitMix64::new(seed);
        let streamed = |text: &str, max_tokens: u32| {
            let mut f = features(text);
            f.stream = true;
            f.max_tokens = max_tokens;
            f
        };
        for i in 0..30u64 {
            let g = pool
                .acquire(&streamed(&format!("warm-up {i}"), 16), i * 2_000, &mut rng)
                .unwrap();
            assert!(pool.release(g.lease_id, &Outcome::from_status(200), i * 2_000 + 1_000));
        }
        assert!((900.0..=1_100.0).contains(&pool.e2e_tail_ms().unwrap()));
        let now = 100_000;
        let long = pool
            .acquire(&streamed("a story", 2_000), now, &mut rng)
            .unwrap();
        let short = pool
            .acquire(&streamed("yes or no", 1), now, &mut rng)
            .unwrap();
        assert_ne!(long.backend, short.backend);
        let cold = streamed(&"a long cold document ".repeat(100), 16);
        let g = pool.acquire(&cold, now + 1_000, &mut rng).unwrap();
        (g.backend == long.backend, g.backend == short.backend)
    };
    for seed in 0..8 {
        assert_eq!(place(0.5, seed), (false, true), "seed {seed}");
    }
    assert!(
        (0..8).any(|seed| place(0.0, seed).0),
        "without tail harm the two backends tie"
    );
}

/// Arrival harm: a cold prompt priced on a backend that has just taken a long prefill carries its
/// own prefill there times `share / (1 - share)` (what it would make the later arrivals wait),
/// and nothing on an idle backend.
#[test]
fn a_busy_backend_prices_what_a_prefill_adds_for_later_arrivals() {
    let config = PoolConfig {
        policy: PolicyKind::PredictedLatency,
        ..PoolConfig::default()
    };
    let mut pool = Pool::new("p1", config);
    add_ready(&mut pool, spec("b0"));
    add_ready(&mut pool, spec("b1"));
    let mut rng = SplitMix64::new(5);
    let now = 10_000;
    let long = features(&"one long cold document ".repeat(400));
    let busy = pool.acquire(&long, now, &mut rng).unwrap().backend;
    let cold = features(&"another cold question ".repeat(40));
    // Each slot's share of time in prefill as the next request is priced (before it is
    // admitted anywhere).
    let shares: Vec<f64> = (0..2)
        .map(|slot| pool.entry(slot).unwrap().timing.prefill_share(now + 100))
        .collect();
    pool.acquire(&cold, now + 100, &mut rng).unwrap();
    let tm = pool.config.time_model;
    let mut seen = 0;
    for c in &pool.scratch.primary {
        let entry = pool.entry(c.slot).unwrap();
        let share = shares[c.slot as usize];
        if entry.spec.id == busy {
            assert!(share > 0.01, "{share}");
            let own_prefill = c.arrival_harm_ms * (1.0 - share) / share;
            let whole = f64::from(cold.prompt_tokens) * entry.timing.prefill_ms_per_token(&tm);
            assert!(
                (0.8 * whole..=whole + 1e-6).contains(&own_prefill),
                "{own_prefill} of {whole}"
            );
        } else {
            assert_eq!(share, 0.0);
            assert_eq!(c.arrival_harm_ms, 0.0);
        }
        seen += 1;
    }
    assert_eq!(seen, 2);
}

/// vLLM reuses whole KV blocks of its own size only: a prefix shared for 900 tokens is no hit
/// on a backend whose engine blocks are 1,024 tokens, and a hit on one whose blocks are 16 (the
/// gateway's own hashes are finer than either).
#[test]
fn a_prefix_shorter_than_the_engines_block_is_no_hit() {
    let shared = "a shared system prompt, ".repeat(150); // 3,600 bytes: about 900 tokens
    let predicted = |engine_block: u32, second: &str| {
        let mut pool = Pool::new("p1", PoolConfig::default());
        add_ready(
            &mut pool,
            BackendSpec {
                capacity: crate::backend::Capacity {
                    block_size: engine_block,
                    ..crate::backend::Capacity::default()
                },
                ..spec("b0")
            },
        );
        let mut rng = SplitMix64::new(9);
        let first = pool
            .acquire(
                &features(&format!("{shared}{}", "tail one ".repeat(300))),
                0,
                &mut rng,
            )
            .unwrap();
        pool.release(first.lease_id, &Outcome::from_status(200), 500);
        let g = pool.acquire(&features(second), 5_000, &mut rng).unwrap();
        g.predicted_ttft_ms.unwrap()
    };
    let follow_up = format!("{shared}{}", "other tail ".repeat(300));
    let unseen = format!(
        "{}{}",
        "an unrelated prompt ".repeat(180),
        "other tail ".repeat(300)
    );
    let (fine_hit, fine_cold) = (predicted(16, &follow_up), predicted(16, &unseen));
    assert!(fine_hit + 10 < fine_cold, "{fine_hit} vs {fine_cold}");
    let (coarse_hit, coarse_cold) = (predicted(1024, &follow_up), predicted(1024, &unseen));
    assert!(
        coarse_hit.abs_diff(coarse_cold) <= 1,
        "{coarse_hit} vs {coarse_cold}"
    );
}
