//! Tests of [`super`]: step timing, prefill then decode, prefix caching, the batch and token
//! budgets, preemption, stopping, remote prefill, aborts and stalls.

use super::*;

fn config() -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 1024,
        num_blocks: 64,
        block_size: 4,
        max_model_len: 4096,
        spec_tokens: 0,
        timing: StepTiming {
            base_us: 1000.0,
            per_decode_seq_us: 100.0,
            per_prefill_token_us: 10.0,
        },
    }
}

fn spec(prompt: &[u8], max_output_tokens: u32) -> SequenceSpec {
    SequenceSpec {
        prompt: prompt.to_vec(),
        max_output_tokens,
        text_seed: 7,
        stream: true,
        ..SequenceSpec::default()
    }
}

/// Runs steps until every sequence finishes; returns the outputs in order and the plans.
fn run(s: &mut Scheduler) -> (Vec<SeqOutput>, Vec<StepPlan>) {
    let mut outputs = Vec::new();
    let mut plans = Vec::new();
    for _ in 0..10_000 {
        if s.is_idle() {
            break;
        }
        let plan = s.schedule();
        plans.push(plan.clone());
        outputs.extend(s.complete(plan));
    }
    assert!(s.is_idle(), "scheduler did not drain");
    (outputs, plans)
}

fn finish_of(outputs: &[SeqOutput], id: SeqId) -> Finish {
    outputs
        .iter()
        .find_map(|o| (o.id == id).then(|| o.finish.clone()).flatten())
        .expect("finished")
}

#[test]
fn step_time_grows_with_batch_and_prefill_tokens() {
    let t = config().timing;
    assert_eq!(t.step_us(0, 0), 1000.0);
    assert_eq!(t.step_us(8, 0), 1800.0);
    assert_eq!(t.step_us(1, 100), 2100.0);
}

#[test]
fn a_sequence_prefills_then_decodes_to_max_tokens() {
    let mut s = Scheduler::new(config());
    s.add(1, spec(&[b'x'; 40], 3)); // 10 tokens
    let (outputs, plans) = run(&mut s);
    assert_eq!(plans[0].work, vec![(1, 10)]);
    assert_eq!(plans[0].prefill_tokens, 10);
    assert_eq!(plans[1].decode_seqs, 1);
    assert_eq!(plans.len(), 3);
    assert!(outputs[0].first_token);
    let f = finish_of(&outputs, 1);
    assert_eq!(f.reason, FinishReason::Length);
    assert_eq!((f.prompt_tokens, f.output_tokens), (10, 3));
    let streamed: String = outputs.iter().filter_map(|o| o.delta.clone()).collect();
    assert_eq!(format!("{streamed}{}", f.text).len(), 12);
    assert_eq!(s.stats().generation_tokens, 3);
    assert_eq!(s.stats().prompt_tokens, 10);
    assert_eq!(s.pool().num_free(), 64);
}

#[test]
fn a_shared_prefix_hits_the_cache_and_prefills_less() {
    let mut s = Scheduler::new(config());
    let prompt = vec![b'p'; 4 * 40]; // 40 tokens = 10 blocks
    s.add(1, spec(&prompt, 1));
    run(&mut s);
    let mut longer = prompt.clone();
    longer.extend_from_slice(b"more text");
    s.add(2, spec(&longer, 1));
    let plan = s.schedule();
    // 10 cached blocks = 40 tokens; 3 new tokens to compute.
    assert_eq!(plan.prefill_tokens, 3);
    let outputs = s.complete(plan);
    assert_eq!(outputs[0].finish.as_ref().unwrap().cached_tokens, 40);
    assert_eq!(s.stats().prefix_hits, 40);
    assert_eq!(s.stats().prefix_queries, 40 + 43);
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut s = Scheduler::new(config());
    let prompt = vec![b'q'; 4 * 8]; // exactly 2 blocks
    s.add(1, spec(&prompt, 1));
    run(&mut s);
    s.add(2, spec(&prompt, 1));
    let plan = s.schedule();
    assert_eq!(plan.prefill_tokens, 4); // the second block is recomputed
    s.complete(plan);
}

#[test]
fn generated_blocks_are_cached_for_the_next_turn() {
    let mut s = Scheduler::new(config());
    let prompt = vec![b'a'; 16]; // 4 tokens = 1 block
    let mut first = spec(&prompt, 8);
    first.stream = false;
    s.add(1, first);
    let (outputs, _) = run(&mut s);
    let reply = finish_of(&outputs, 1).text;
    let mut next = prompt.clone();
    next.extend_from_slice(reply.as_bytes());
    next.extend_from_slice(b"\nnew question");
    s.add(2, spec(&next, 1));
    let plan = s.schedule();
    s.complete(plan);
    // 4 prompt tokens + 8 reply tokens = 3 blocks; the last generated token's KV was never
    // computed, so its block is not cached: 2 blocks hit.
    assert_eq!(s.stats().prefix_hits, 8);
}

#[test]
fn at_most_max_num_seqs_run_and_the_rest_wait_in_order() {
    let mut s = Scheduler::new(config());
    for id in 0..6 {
        s.add(id, spec(&[b'a' + id as u8; 8], 5));
    }
    let plan = s.schedule();
    assert_eq!(
        plan.work.iter().map(|w| w.0).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert_eq!((s.num_running(), s.num_waiting()), (4, 2));
    s.complete(plan);
    let (outputs, _) = run(&mut s);
    let order: Vec<SeqId> = outputs
        .iter()
        .filter(|o| o.first_token)
        .map(|o| o.id)
        .collect();
    assert_eq!(order, vec![4, 5]);
}

#[test]
fn long_prompts_are_chunked_by_the_token_budget() {
    let mut cfg = config();
    cfg.max_num_batched_tokens = 16;
    let mut s = Scheduler::new(cfg);
    s.add(1, spec(&[b'z'; 4 * 40], 1));
    let (outputs, plans) = run(&mut s);
    let chunks: Vec<u32> = plans.iter().map(|p| p.prefill_tokens).collect();
    assert_eq!(chunks, vec![16, 16, 8]);
    assert_eq!(outputs.len(), 1);
}

#[test]
fn preempts_the_newest_sequence_when_blocks_run_out() {
    let mut cfg = config();
    cfg.num_blocks = 6;
    let mut s = Scheduler::new(cfg);
    s.add(1, spec(&[b'a'; 4 * 7], 12)); // 7 tokens: 2 blocks, grows to 19 tokens: 5 blocks
    s.add(2, spec(&[b'b'; 4 * 7], 12));
    let (outputs, _) = run(&mut s);
    assert!(s.stats().preemptions > 0);
    let f1 = finish_of(&outputs, 1);
    let f2 = finish_of(&outputs, 2);
    assert_eq!((f1.output_tokens, f2.output_tokens), (12, 12));
    assert_eq!(s.pool().num_free(), 6);
}

#[test]
fn a_sequence_that_outgrows_the_whole_cache_finishes_with_length() {
    let mut cfg = config();
    cfg.num_blocks = 2;
    let mut s = Scheduler::new(cfg);
    s.add(1, spec(&[b'a'; 4 * 6], 100));
    let (outputs, _) = run(&mut s);
    let f = finish_of(&outputs, 1);
    assert_eq!(f.reason, FinishReason::Length);
    // 6 prompt tokens + 2 computed outputs fill both blocks; the third output cannot be computed.
    assert_eq!(f.output_tokens, 3);
}

#[test]
fn eos_stops_and_ignore_eos_runs_to_max_tokens() {
    let mut s = Scheduler::new(config());
    let mut with_eos = spec(b"hello", 50);
    with_eos.eos_after = Some(5);
    s.add(1, with_eos);
    s.add(2, spec(b"hello", 50));
    let (outputs, _) = run(&mut s);
    let f1 = finish_of(&outputs, 1);
    assert_eq!((f1.reason, f1.output_tokens), (FinishReason::Stop, 5));
    let f2 = finish_of(&outputs, 2);
    assert_eq!((f2.reason, f2.output_tokens), (FinishReason::Length, 50));
}

#[test]
fn same_seed_same_text_and_stop_strings_cut_it() {
    let text_of = |seed: u64, stops: Vec<String>| {
        let mut s = Scheduler::new(config());
        let mut sp = spec(b"prompt", 30);
        sp.text_seed = seed;
        sp.stream = false;
        sp.stops = stops;
        s.add(1, sp);
        finish_of(&run(&mut s).0, 1)
    };
    let a = text_of(1, vec![]);
    assert_eq!(a, text_of(1, vec![]));
    assert_ne!(a.text, text_of(2, vec![]).text);
    let stop: String = a.text[8..14].to_string();
    let cut = text_of(1, vec![stop.clone()]);
    assert_eq!(cut.reason, FinishReason::Stop);
    assert_eq!(cut.stop_reason.as_deref(), Some(stop.as_str()));
    assert!(a.text.starts_with(&cut.text));
    assert!(!cut.text.contains(&stop));
}

#[test]
fn remote_prefill_skips_the_prompt() {
    let mut s = Scheduler::new(config());
    let mut sp = spec(&[b'r'; 4 * 100], 2);
    sp.remote_prefill = true;
    s.add(1, sp);
    let plan = s.schedule();
    assert_eq!(plan.prefill_tokens, 1);
    s.complete(plan);
    // The remotely computed blocks are now cached locally.
    assert_eq!(s.pool().num_cached(), 25);
}

#[test]
fn aborting_frees_blocks_and_reported_blocks_come_back() {
    let mut s = Scheduler::new(config());
    s.add(1, spec(&[b'a'; 4 * 20], 100));
    let plan = s.schedule();
    s.complete(plan);
    assert!(s.pool().num_free() < 64);
    s.abort(1);
    assert_eq!(s.pool().num_free(), 64);
    assert!(s.is_idle());
    assert_eq!(s.stats().finished_abort, 1);

    let mut sp = spec(&[b'b'; 4 * 20], 1);
    sp.report_blocks = true;
    s.add(2, sp);
    let (outputs, _) = run(&mut s);
    assert_eq!(finish_of(&outputs, 2).block_ids.len(), 5); // the 20 computed prompt tokens
}

#[test]
fn a_stalled_sequence_keeps_its_slot_and_blocks_until_aborted() {
    let mut s = Scheduler::new(config());
    let mut sp = spec(&[b's'; 4 * 10], 100);
    sp.stall_after = Some(3);
    s.add(1, sp);
    let mut tokens = 0;
    for _ in 0..50 {
        let plan = s.schedule();
        tokens += s
            .complete(plan)
            .iter()
            .filter(|o| o.delta.is_some())
            .count();
    }
    assert_eq!(tokens, 3);
    assert_eq!(s.stats().generation_tokens, 3);
    assert_eq!((s.num_running(), s.num_stalled()), (1, 1));
    assert!(
        s.schedule().is_empty(),
        "a stalled sequence computes nothing"
    );
    assert!(!s.is_idle());
    assert!(s.pool().num_free() < 64);
    s.abort(1);
    assert_eq!(s.pool().num_free(), 64);
    assert!(s.is_idle());
}

#[test]
fn a_stall_at_zero_prefills_but_never_samples_and_short_requests_finish() {
    let mut s = Scheduler::new(config());
    let mut hung = spec(&[b'h'; 4 * 10], 5);
    hung.stall_after = Some(0);
    s.add(1, hung);
    let mut short = spec(b"short", 2);
    short.stall_after = Some(2);
    s.add(2, short);
    let mut outputs = Vec::new();
    for _ in 0..20 {
        let plan = s.schedule();
        outputs.extend(s.complete(plan));
    }
    assert!(outputs.iter().all(|o| o.id == 2));
    assert_eq!(finish_of(&outputs, 2).output_tokens, 2);
    assert_eq!((s.num_running(), s.num_stalled()), (1, 1));
    assert_eq!(
        s.stats().prompt_tokens,
        2,
        "only the short request produced a first token"
    );
}

#[test]
fn a_request_is_admitted_only_when_its_whole_prompt_fits_not_its_first_chunk() {
    // 16 blocks of 4 tokens; chunks of 8 tokens. One sequence of 10 prompt tokens holds 3 blocks
    // (plus a 4th as it decodes); a second of 56 tokens (14 blocks) has a first chunk that fits
    // (2 blocks) but not its whole prompt: it waits (vLLM's scheduler_reserve_full_isl).
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 16,
        max_num_batched_tokens: 8,
        ..config()
    });
    s.add(1, spec(&[b'a'; 40], 20));
    s.add(2, spec(&[b'b'; 224], 2));
    let first = s.schedule();
    assert_eq!(first.work, vec![(1, 8)]);
    s.complete(first);
    let second = s.schedule();
    assert_eq!(s.num_waiting(), 1, "the long prompt does not fit whole");
    assert!(second.work.iter().all(|&(id, _)| id == 1));
    s.complete(second);
    let (outputs, _) = run(&mut s);
    assert_eq!(
        finish_of(&outputs, 2).output_tokens,
        2,
        "admitted once it fits"
    );
}

#[test]
fn a_salt_or_adapter_gives_the_same_prompt_other_blocks() {
    let mut s = Scheduler::new(config());
    let prompt = [b'p'; 64];
    s.add(1, spec(&prompt, 1));
    run(&mut s);
    let salted = SequenceSpec {
        hash_root: crate::kv_cache::root_hash(None, Some("tenant")),
        ..spec(&prompt, 1)
    };
    s.add(2, salted.clone());
    let (outputs, _) = run(&mut s);
    assert_eq!(finish_of(&outputs, 2).cached_tokens, 0);
    s.add(3, salted);
    let (outputs, _) = run(&mut s);
    assert!(finish_of(&outputs, 3).cached_tokens > 0);
    assert_ne!(
        crate::kv_cache::root_hash(Some("sql"), None),
        crate::kv_cache::root_hash(None, Some("sql"))
    );
    assert_eq!(crate::kv_cache::root_hash(None, None), 0);
}

#[test]
fn speculative_decoding_yields_up_to_k_plus_one_tokens_a_step_and_counts_each() {
    // K = 2: the first token alone (prefill), then steps of 3, 2, 1, 3, ... tokens; the last step
    // stops at max_tokens, and the same text as without speculation comes out.
    let mut s = Scheduler::new(SchedulerConfig {
        spec_tokens: 2,
        ..config()
    });
    s.add(1, spec(&[b'x'; 40], 10));
    let (outputs, plans) = run(&mut s);
    let counts: Vec<u32> = outputs.iter().map(|o| o.output_tokens).collect();
    assert_eq!(counts, vec![1, 4, 6, 7, 10], "tokens after each step");
    assert_eq!(plans.len(), 5, "five steps for ten tokens");
    assert!(plans[1..]
        .iter()
        .all(|p| p.work == vec![(1, 1)] && p.decode_seqs == 1));
    let deltas: Vec<usize> = outputs
        .iter()
        .filter_map(|o| o.delta.as_ref().map(String::len))
        .collect();
    assert_eq!(deltas, vec![4, 12, 8, 4], "each step's text in one delta");
    let f = finish_of(&outputs, 1);
    assert_eq!(
        (f.reason, f.output_tokens, f.text.len()),
        (FinishReason::Length, 10, 12)
    );
    assert_eq!(s.stats().generation_tokens, 10);
    assert_eq!(s.pool().num_free(), 64, "every block back");
    let mut plain = Scheduler::new(config());
    plain.add(1, spec(&[b'x'; 40], 10));
    let text = |outputs: &[SeqOutput]| -> String {
        let f = finish_of(outputs, 1);
        let streamed: String = outputs.iter().filter_map(|o| o.delta.clone()).collect();
        format!("{streamed}{}", f.text)
    };
    assert_eq!(text(&outputs), text(&run(&mut plain).0));

    // EOS, a stall and min_tokens cut a step's drafts short.
    let mut s = Scheduler::new(SchedulerConfig {
        spec_tokens: 3,
        ..config()
    });
    s.add(
        2,
        SequenceSpec {
            eos_after: Some(3),
            ..spec(&[b'y'; 40], 50)
        },
    );
    let (outputs, _) = run(&mut s);
    let f = finish_of(&outputs, 2);
    assert_eq!((f.reason, f.output_tokens), (FinishReason::Stop, 3));
    let mut s = Scheduler::new(SchedulerConfig {
        spec_tokens: 3,
        ..config()
    });
    s.add(
        3,
        SequenceSpec {
            stall_after: Some(2),
            ..spec(&[b'z'; 40], 50)
        },
    );
    for _ in 0..5 {
        let plan = s.schedule();
        s.complete(plan);
    }
    assert_eq!(
        s.stats().generation_tokens,
        2,
        "a stall after 2 holds the drafts too"
    );
}
