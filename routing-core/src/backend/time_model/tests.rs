//! Tests of [`super`]: the virtual prefill queue, cache hits, the wait for room, learning the
//! rates and the overhead apart, and the output ratio.

use super::*;

fn cfg() -> TimeModelConfig {
    TimeModelConfig::default()
}

#[test]
fn prefill_queue_adds_up_and_drains_in_real_time() {
    let c = cfg();
    let mut t = BackendTiming::default();
    let a = t.admit(&c, 1_200, 0.0, 1.0, 1_000);
    assert_eq!(a.prefill_us, 120_000);
    let b = t.admit(&c, 1_200, 0.0, 1.0, 1_000);
    assert_eq!(
        b.queued_prefill_us, 240_000,
        "the second waits behind the first"
    );
    assert!((t.backlog_ms(1_000) - 240.0).abs() < 1e-9);
    assert!((t.backlog_ms(1_100) - 140.0).abs() < 1e-9);
    assert_eq!(t.backlog_ms(2_000), 0.0);
    let p = t.predict(&c, 1_200, 100.0, 0.0, 0.0, 1_000);
    assert!((p.ttft_ms - (240.0 + 120.0 + 10.0)).abs() < 1e-9);
}

#[test]
fn a_cache_hit_saves_its_prefill_here_and_for_the_running_sequences() {
    let c = cfg();
    let t = BackendTiming::default();
    let cold = t.predict(&c, 1_000, 100.0, 8.0, 0.0, 0);
    let warm = t.predict(&c, 100, 100.0, 8.0, 0.0, 0);
    assert!((cold.ttft_ms - warm.ttft_ms - 90.0).abs() < 1e-9);
    assert!((cold.harm_ms - warm.harm_ms - 8.0 * 90.0).abs() < 1e-9);
    assert_eq!(cold.decode_ms, warm.decode_ms);
    assert!((warm.decode_ms - 100.0 * (10.0 + 9.0 * 0.15)).abs() < 1e-9);
}

#[test]
fn a_full_backend_makes_requests_wait_for_room() {
    let idle = (0.0, 0.0);
    assert_eq!(room_wait_ms(4_000, 1_000, 8_192, 4, 64, 1_000.0, idle), 0.0);
    // 8,000 tokens in flight, 1,192 over with this request: a decode x 1,192 / 8,192.
    let w = room_wait_ms(8_000, 1_384, 8_192, 8, 64, 1_000.0, idle);
    assert!((w - 1_000.0 * 1_192.0 / 8_192.0).abs() < 1e-9, "{w}");
    // Twice the capacity queued: the wait grows with it, it does not saturate.
    let w2 = room_wait_ms(16_000, 1_384, 8_192, 8, 64, 1_000.0, idle);
    assert!((w2 - 1_000.0 * 9_192.0 / 8_192.0).abs() < 1e-9, "{w2}");
    // Every slot taken: a decode x 1 / 4.
    assert!((room_wait_ms(100, 10, 8_192, 4, 4, 1_000.0, idle) - 250.0).abs() < 1e-9);
    assert_eq!(room_wait_ms(0, 100, 50, 0, 0, 1_000.0, idle), 1_000.0);
    // The server queues 6 requests itself while 12 run: 250 ms x 6 / 12.
    let w = room_wait_ms(100, 10, 8_192, 4, 64, 1_000.0, (6.0, 12.0));
    assert!((w - 125.0).abs() < 1e-9, "{w}");
}

#[test]
fn a_cancelled_prefill_leaves_the_queue() {
    let c = cfg();
    let mut t = BackendTiming::default();
    let a = t.admit(&c, 1_000, 0.0, 1.0, 0);
    let b = t.admit(&c, 1_000, 0.0, 1.0, 0);
    t.leave(&a, 50);
    assert!(
        (t.backlog_ms(50) - 100.0).abs() < 1e-9,
        "{}",
        t.backlog_ms(50)
    );
    t.leave(&b, 60);
    assert_eq!(t.backlog_ms(60), 0.0);
}

#[test]
fn learns_a_slower_backend_within_bounds() {
    let c = cfg();
    let mut t = BackendTiming::default();
    // The real backend prefills at 300 us/token and steps at 3x the configured cost.
    for i in 0..40u64 {
        let now = i * 10_000;
        let share = t.admit(&c, 1_000, 0.0, 1.0, now);
        let ttfb = 300 + 30;
        let seen = Observation {
            ttfb_ms: Some(ttfb),
            duration_ms: ttfb + 99 * 30,
            completion_tokens: Some(100),
            streamed: true,
            held_by_client: false,
            at_ms: 0,
            pool_overhead_ms: None,
        };
        t.leave(&share, now + seen.duration_ms);
        t.learn(&c, &share, &seen);
    }
    let v = t.view(&c, 0);
    assert!((v.prefill_us_per_token - 300.0).abs() < 30.0, "{v:?}");
    assert!((v.decode_ms_per_step - 30.0).abs() < 3.0, "{v:?}");
    assert_eq!(v.observations, 40);
    let mut wild = BackendTiming::default();
    for _ in 0..200 {
        let share = wild.admit(&c, 10_000, 0.0, 1.0, 0);
        let seen = Observation {
            ttfb_ms: Some(10_000_000),
            duration_ms: 10_000_000,
            completion_tokens: Some(1),
            streamed: true,
            held_by_client: false,
            at_ms: 0,
            pool_overhead_ms: None,
        };
        wild.leave(&share, 0);
        wild.learn(&c, &share, &seen);
    }
    assert!((wild.view(&c, 0).prefill_us_per_token - 1_000.0).abs() < 1e-6);
}

#[test]
fn prefill_admitted_during_a_decode_is_not_learned_as_slow_decoding() {
    let c = cfg();
    let (mut plain, mut busy) = (BackendTiming::default(), BackendTiming::default());
    // A backend at the configured rates (10 ms steps). On `busy`, another request with 2,000
    // uncached tokens (200 ms of prefill) arrives just after each one, and its prefill runs in
    // the steps of the first one's decode: 100 tokens take 990 ms + 200 ms.
    for i in 0..40u64 {
        let now = i * 10_000;
        for (t, extra) in [(&mut plain, 0), (&mut busy, 200)] {
            let share = t.admit(&c, 0, 0.0, 1.0, now);
            let other = (extra > 0).then(|| t.admit(&c, 2_000, 1.0, 1.0, now + 1));
            let seen = Observation {
                ttfb_ms: Some(10),
                duration_ms: 10 + 990 + extra,
                completion_tokens: Some(100),
                streamed: true,
                held_by_client: false,
                at_ms: 0,
                pool_overhead_ms: None,
            };
            t.leave(&share, now + seen.duration_ms);
            t.learn(&c, &share, &seen);
            if let Some(other) = other {
                t.leave(&other, now + seen.duration_ms);
            }
        }
    }
    let (p, b) = (plain.view(&c, 0), busy.view(&c, 0));
    assert!((p.decode_ms_per_step - 10.0).abs() < 0.5, "{p:?}");
    assert!((b.decode_ms_per_step - 10.0).abs() < 0.5, "{b:?}");
}

#[test]
fn network_overhead_is_learned_apart_from_the_prefill_rate() {
    let c = cfg();
    let mut t = BackendTiming::default();
    // A backend at exactly the configured rates, 40 ms of gateway and network away: cache
    // hits (nothing to prefill) and cold prompts of several sizes.
    for i in 0..200u64 {
        let now = i * 10_000;
        let uncached = [0, 200, 1_000, 3_000][(i % 4) as usize];
        let share = t.admit(&c, uncached, 0.0, 1.0, now);
        let ttfb = 40 + uncached / 10 + 10;
        let seen = Observation {
            ttfb_ms: Some(ttfb),
            duration_ms: ttfb,
            completion_tokens: Some(1),
            streamed: true,
            held_by_client: false,
            at_ms: 0,
            pool_overhead_ms: None,
        };
        t.leave(&share, now + ttfb);
        t.learn(&c, &share, &seen);
    }
    let v = t.view(&c, 0);
    assert!((v.prefill_us_per_token - 100.0).abs() < 5.0, "{v:?}");
    assert!((v.overhead_ms - 40.0).abs() < 3.0, "{v:?}");
}

#[test]
fn a_stream_the_client_held_up_does_not_teach_decode_speed() {
    let c = cfg();
    let (mut held, mut engine_slow) = (BackendTiming::default(), BackendTiming::default());
    // 100 tokens over 30 s: a client that stopped reading (the relay filled and the backend
    // was paused) on one backend, a backend really that slow on the other.
    for i in 0..40u64 {
        let now = i * 100_000;
        for (t, held_by_client) in [(&mut held, true), (&mut engine_slow, false)] {
            let share = t.admit(&c, 0, 0.0, 1.0, now);
            let seen = Observation {
                ttfb_ms: Some(10),
                duration_ms: 30_000,
                completion_tokens: Some(100),
                streamed: true,
                held_by_client,
                at_ms: now,
                pool_overhead_ms: None,
            };
            t.leave(&share, now + seen.duration_ms);
            t.learn(&c, &share, &seen);
        }
    }
    let configured = BackendTiming::default().view(&c, 0).decode_ms_per_step;
    assert_eq!(held.view(&c, 0).decode_ms_per_step, configured);
    assert!(engine_slow.view(&c, 0).decode_ms_per_step > 2.0 * configured);
}

#[test]
fn tiny_prefills_teach_nothing() {
    let c = cfg();
    let mut t = BackendTiming::default();
    let share = t.admit(&c, 10, 0.0, 1.0, 0);
    let seen = Observation {
        ttfb_ms: Some(500),
        duration_ms: 500,
        completion_tokens: Some(1),
        streamed: true,
        held_by_client: false,
        at_ms: 0,
        pool_overhead_ms: None,
    };
    t.learn(&c, &share, &seen);
    assert_eq!(t.view(&c, 0).observations, 0);
    assert_eq!(t.view(&c, 0).prefill_us_per_token, 100.0);
}

#[test]
fn output_ratio_learns_and_stays_bounded() {
    let mut r = OutputRatio::default();
    for _ in 0..200 {
        r.observe(64, 256);
    }
    assert!((r.get() - 0.25).abs() < 0.01);
    r.observe(10, 0);
    for _ in 0..500 {
        r.observe(0, 256);
    }
    assert!(r.get() >= 0.02);
    assert!((r.expected(100) - 100.0 * r.get()).abs() < 1e-9);
}

#[test]
fn validation() {
    assert!(cfg().validate().is_ok());
    for bad in [
        TimeModelConfig {
            prefill_us_per_token: 0.0,
            ..cfg()
        },
        TimeModelConfig {
            learning_rate: 1.5,
            ..cfg()
        },
        TimeModelConfig {
            max_scale: 0.5,
            ..cfg()
        },
        TimeModelConfig {
            decode_ms_per_seq: f64::NAN,
            ..cfg()
        },
        TimeModelConfig {
            prefill_interference: -1.0,
            ..cfg()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
}

#[test]
fn a_prompt_longer_than_a_step_is_found_cached_only_from_its_last_chunk() {
    let c = cfg();
    let mut t = BackendTiming::default();
    // 8,192 tokens fit one step: later arrivals find them cached once that step is under way.
    let short = t.admit(&c, 8_192, 0.0, 1.0, 0);
    assert_eq!(
        short.start_ms(),
        10,
        "its prefill starts now, plus one step"
    );
    let mut t = BackendTiming::default();
    // 12,000 tokens take two steps: a chunk of 8,192 (819.2 ms), then the last 3,808; only a
    // request arriving after the last chunk's step starts finds the whole prompt.
    let long = t.admit(&c, 12_000, 0.0, 1.0, 0);
    assert_eq!(long.last_chunk_us, 380_800);
    assert_eq!(long.start_ms(), 829);
}

#[test]
fn the_recent_prefill_share_rises_with_admitted_prefill_and_decays() {
    let c = cfg();
    let mut t = BackendTiming::default();
    assert_eq!(t.prefill_share(0), 0.0);
    // 1 s of prefill admitted at once: a fifth of the 5 s window.
    t.admit(&c, 10_000, 0.0, 1.0, 1_000);
    assert!((t.prefill_share(1_000) - 0.2).abs() < 1e-9);
    // It decays with a 5 s time constant.
    assert!((t.prefill_share(6_000) - 0.2 * (-1.0f64).exp()).abs() < 1e-9);
    // Never credited with more than 0.9 of the backend's time.
    for _ in 0..10 {
        t.admit(&c, 100_000, 0.0, 1.0, 6_000);
    }
    assert_eq!(t.prefill_share(6_000), 0.9);
}

#[test]
fn prompts_arriving_later_stretch_a_prefill_by_the_recent_share_in_prefill() {
    // Off by default.
    let mut t = BackendTiming::default();
    t.admit(&cfg(), 10_000, 0.0, 1.0, 1_000);
    assert_eq!(t.interference_ms(&cfg(), 300.0, 1_000), 0.0);
    let c = TimeModelConfig {
        prefill_interference: 1.0,
        ..cfg()
    };
    let mut t = BackendTiming::default();
    // Nothing admitted lately: nothing arrives to share the steps.
    assert_eq!(t.interference_ms(&c, 300.0, 0), 0.0);
    // A fifth of the last 5 s in prefill: a 300 ms prefill gains a fifth of itself (k = 1).
    t.admit(&c, 10_000, 0.0, 1.0, 1_000);
    assert!((t.interference_ms(&c, 300.0, 1_000) - 60.0).abs() < 1e-9);
    // In proportion to k; off at 0; nothing to stretch without a prefill of its own.
    let half = TimeModelConfig {
        prefill_interference: 0.5,
        ..c
    };
    assert!((t.interference_ms(&half, 300.0, 1_000) - 30.0).abs() < 1e-9);
    let off = TimeModelConfig {
        prefill_interference: 0.0,
        ..c
    };
    assert_eq!(t.interference_ms(&off, 300.0, 1_000), 0.0);
    assert_eq!(t.interference_ms(&c, 0.0, 1_000), 0.0);
    // A hot backend is credited with at most 0.9 of its time in prefill.
    for _ in 0..10 {
        t.admit(&c, 100_000, 0.0, 1.0, 1_000);
    }
    assert!((t.interference_ms(&c, 300.0, 1_000) - 270.0).abs() < 1e-9);
}

#[test]
fn prompts_still_in_prefill_are_counted_until_their_predicted_end_or_their_leaving() {
    let c = cfg();
    let mut t = BackendTiming::default();
    let a = t.admit(&c, 1_000, 0.0, 1.0, 0); // prefill 0-100 ms
    let b = t.admit(&c, 1_000, 0.0, 1.0, 0); // 100-200 ms
    t.admit(&c, 0, 0.0, 1.0, 0); // nothing to prefill: never counted
    assert_eq!(t.prefilling(0), 2);
    assert_eq!(t.prefilling(150), 1);
    assert_eq!(t.prefilling(200), 0);
    // A share that leaves early is no longer prefilling.
    let mut t2 = BackendTiming::default();
    let a2 = t2.admit(&c, 1_000, 0.0, 1.0, 0);
    t2.admit(&c, 1_000, 0.0, 1.0, 0);
    t2.leave(&a2, 10);
    assert_eq!(t2.prefilling(10), 1);
    assert_eq!((a.prefill_end_us, b.prefill_end_us), (100_000, 200_000));
}

/// Teaches `t` releases whose time to first byte runs `extra_ms` over the configured prediction,
/// with prompts of 500 to 3,500 tokens, the pool's common overhead `pool_overhead_ms`.
fn teach_a_hidden_wait(t: &mut BackendTiming, extra_ms: u64, pool_overhead_ms: Option<f64>) {
    let c = cfg();
    for i in 0..60u64 {
        let now = i * 10_000;
        let tokens = 500 + (i % 7) * 500;
        let share = t.admit(&c, tokens, 0.0, 1.0, now);
        // Configured rates (100 us a token, 10 ms steps) plus a wait the model does not see.
        let ttfb = tokens / 10 + 10 + extra_ms;
        let seen = Observation {
            ttfb_ms: Some(ttfb),
            duration_ms: ttfb,
            completion_tokens: Some(1),
            streamed: true,
            held_by_client: false,
            at_ms: now,
            pool_overhead_ms,
        };
        t.leave(&share, now + seen.duration_ms);
        t.learn(&c, &share, &seen);
    }
}

#[test]
fn a_wait_of_its_own_beyond_the_pools_overhead_raises_the_prefill_rate() {
    let c = cfg();
    // Alone, a constant 170 ms more is learned as overhead, the rate left as configured.
    let mut alone = BackendTiming::default();
    teach_a_hidden_wait(&mut alone, 170, None);
    let v = alone.view(&c, 0);
    assert!((v.overhead_ms - 170.0).abs() < 15.0, "{v:?}");
    assert!((v.prefill_us_per_token - 100.0).abs() < 15.0, "{v:?}");
    // When the pool's backends have 5 ms in common, the same is this backend being slow: its
    // line goes through 5 ms and its rate rises, so its predictions and its queue grow.
    let mut in_pool = BackendTiming::default();
    teach_a_hidden_wait(&mut in_pool, 170, Some(5.0));
    let w = in_pool.view(&c, 0);
    assert!(w.prefill_us_per_token > 150.0, "{w:?}");
    // A backend at the pool's own overhead learns as before.
    let mut common = BackendTiming::default();
    teach_a_hidden_wait(&mut common, 5, Some(5.0));
    let x = common.view(&c, 0);
    assert!((x.prefill_us_per_token - 100.0).abs() < 15.0, "{x:?}");
}

#[test]
fn a_backend_running_late_has_its_prompts_counted_computed_later() {
    let c = cfg();
    let mut on_time = BackendTiming::default();
    teach_a_hidden_wait(&mut on_time, 0, None);
    assert_eq!(on_time.lateness(), 1.0);
    // Three times as long as predicted, with the scales held at the configured rates
    // (`max_scale` 1) so the model cannot catch up: its lateness is the ratio.
    let fixed = TimeModelConfig {
        max_scale: 1.0,
        ..cfg()
    };
    let mut late = BackendTiming::default();
    for i in 0..40u64 {
        let share = late.admit(&fixed, 1_000, 0.0, 1.0, i * 10_000);
        let seen = Observation {
            ttfb_ms: Some(330),
            duration_ms: 330,
            completion_tokens: Some(1),
            streamed: true,
            held_by_client: false,
            at_ms: i * 10_000,
            pool_overhead_ms: Some(0.0),
        };
        late.leave(&share, i * 10_000 + 330);
        late.learn(&fixed, &share, &seen);
    }
    assert!((late.lateness() - 3.0).abs() < 0.2, "{}", late.lateness());
    // A share with 200 ms of queue ahead and a 10 ms step: ready after the queue and the step
    // on time, after a stretched queue when the backend runs late.
    let mut t = BackendTiming::default();
    t.admit(&c, 2_000, 0.0, 1.0, 0);
    let share = t.admit(&c, 500, 0.0, 1.0, 0);
    assert_eq!(share.ready_ms(0, 1.0), share.start_ms());
    assert_eq!(share.ready_ms(0, 1.0), 210);
    assert_eq!(share.ready_ms(0, 2.0), 410);
}

#[test]
fn nothing_granted_after_a_request_waiting_for_room_starts_before_it() {
    let mut t = BackendTiming::default();
    assert_eq!(t.room_blocked_ms(0), 0.0);
    t.wait_for_room(1_000, 400.0);
    t.wait_for_room(1_100, 100.0);
    assert_eq!(t.room_blocked_ms(1_100), 300.0);
    assert_eq!(t.room_blocked_ms(1_500), 0.0);
}
