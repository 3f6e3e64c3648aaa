//! Property tests of the routing core's promises, over generated inputs.
//!
//! - The ring: adding one backend to `n` moves about `1/(n+1)` of the keys, all to the newcomer.
//! - Bounded loads: no backend ever holds more than `ceil((1 + eps) * average)` leases.
//! - Leases: any interleaving of acquire, reassign, release, expire, probe and backend removal
//!   leaves every backend's counters equal to its live leases.
//! - Affinity: the table never exceeds its global or per-backend bounds and stays consistent.
//! - Parsers: no input makes any of them panic.
//!
//! Case counts are kept small so `cargo test -p routing-core` stays fast in debug builds.

use proptest::prelude::*;
use routing_core::policy::ring::{bounded_load_cap, key_hash, HashRing, RingMember};
use routing_core::pool::affinity::PrefixAffinity;
use routing_core::request::{prompt, routing_key};
use routing_core::{
    BackendId, BackendPatch, BackendSpec, Capacity, FeatureConfig, Lifecycle, Outcome, OutcomeKind,
    PolicyKind, Pool, PoolConfig, ProbeResult, RequestFeatures, Role, SplitMix64,
};
use serde_json::Value;

fn ring_of(ids: &[String]) -> HashRing {
    HashRing::new(ids.iter().enumerate().map(|(i, id)| RingMember {
        node: i as u32,
        id,
        weight: 1,
    }))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Adding one backend to `n` moves between 0.5 and 1.6 times `1/(n+1)` of 4,000 keys (the
    /// spread of 100 virtual nodes per backend plus sampling noise), and only onto the newcomer.
    #[test]
    fn adding_a_backend_moves_about_one_in_n_plus_one(n in 2usize..40, salt in any::<u64>()) {
        let ids: Vec<String> = (0..=n).map(|i| format!("b{i}-{salt}")).collect();
        let before = ring_of(&ids[..n]);
        let after = ring_of(&ids);
        let keys = 4_000;
        let mut moved = 0;
        for k in 0..keys {
            let h = key_hash(&format!("key-{k}-{salt}"));
            let (a, b) = (before.owner(h).unwrap(), after.owner(h).unwrap());
            if a != b {
                prop_assert_eq!(b as usize, n, "a moved key goes to the new backend");
                moved += 1;
            }
        }
        let expected = keys as f64 / (n + 1) as f64;
        prop_assert!(
            (moved as f64) >= 0.5 * expected && (moved as f64) <= 1.6 * expected,
            "moved {} of {} keys, expected about {:.0}", moved, keys, expected
        );
    }

    /// Placing keys one by one with bounded loads never puts a backend above the cap.
    #[test]
    fn bounded_loads_hold_while_placing(
        n in 1usize..24,
        eps in 0.05f64..1.0,
        keys in prop::collection::vec(any::<u64>(), 1..400),
        unavailable in prop::collection::vec(any::<bool>(), 24),
    ) {
        let ids: Vec<String> = (0..n).map(|i| format!("b{i}")).collect();
        let ring = ring_of(&ids);
        let avail: Vec<bool> = (0..n).map(|i| i == 0 || !unavailable[i]).collect();
        let available = avail.iter().filter(|&&a| a).count();
        let mut loads = vec![0u64; n];
        let mut out = Vec::new();
        for (placed, k) in keys.iter().enumerate() {
            let total = placed as u64;
            ring.rank_bounded(*k, eps, available, total, 1, |node| {
                avail[node as usize].then_some(loads[node as usize])
            }, &mut out);
            prop_assert_eq!(out.len(), 1);
            let chosen = out[0] as usize;
            prop_assert!(avail[chosen]);
            loads[chosen] += 1;
            let cap = bounded_load_cap(total, available, eps);
            prop_assert!(loads.iter().all(|&l| l <= cap), "loads {:?} above cap {}", loads, cap);
        }
    }

    /// The same through the pool's consistent_hash policy, counting live leases.
    #[test]
    fn pool_consistent_hash_respects_the_cap(
        n in 1usize..12,
        eps in 0.05f64..1.0,
        keys in prop::collection::vec("[a-z]{1,6}", 1..120),
    ) {
        let config = PoolConfig {
            policy: PolicyKind::ConsistentHash,
            consistent_hash: routing_core::policy::ConsistentHashConfig { eps },
            ..PoolConfig::default()
        };
        let mut pool = Pool::new("p", config);
        for i in 0..n {
            let id = pool.add_backend(spec(&format!("b{i}")), 0).unwrap();
            pool.record_probe(&id, &ProbeResult { ok: true, ..ProbeResult::default() }, 0).unwrap();
        }
        let mut rng = SplitMix64::new(1);
        for (placed, key) in keys.iter().enumerate() {
            let f = RequestFeatures {
                model: "m".into(),
                routing_key: Some(key.clone()),
                ..RequestFeatures::default()
            };
            pool.acquire(&f, 0, &mut rng).unwrap();
            let cap = bounded_load_cap(placed as u64, n, eps);
            for b in pool.backends() {
                prop_assert!(u64::from(b.leases_in_flight) <= cap);
            }
        }
    }
}

fn spec(id: &str) -> BackendSpec {
    BackendSpec {
        id: id.into(),
        url: format!("http://{id}:8000"),
        models: vec!["m".into()],
        capacity: Capacity {
            kv_blocks: 64,
            block_size: 16,
            ..Capacity::default()
        },
        ..BackendSpec::default()
    }
}

/// One step of a random pool history.
#[derive(Debug, Clone)]
enum Op {
    Acquire { prefix: u8, key: Option<u8> },
    Release { pick: usize, status: u16 },
    Reassign { pick: usize, to: u8 },
    Expire { advance_ms: u64 },
    Remove { backend: u8 },
    Add { backend: u8, role: u8 },
    Probe { backend: u8, ok: bool },
    Drain { backend: u8, ready: bool },
    Weight { backend: u8, weight: u32 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<u8>(), proptest::option::of(0u8..5)).prop_map(|(prefix, key)| Op::Acquire { prefix, key }),
        3 => (any::<usize>(), prop::sample::select(vec![200u16, 400, 429, 499, 500, 503, 0])).prop_map(|(pick, status)| Op::Release { pick, status }),
        1 => (any::<usize>(), 0u8..8).prop_map(|(pick, to)| Op::Reassign { pick, to }),
        1 => (0u64..40_000).prop_map(|advance_ms| Op::Expire { advance_ms }),
        1 => (0u8..8).prop_map(|backend| Op::Remove { backend }),
        1 => (0u8..8, 0u8..3).prop_map(|(backend, role)| Op::Add { backend, role }),
        1 => (0u8..8, any::<bool>()).prop_map(|(backend, ok)| Op::Probe { backend, ok }),
        1 => (0u8..8, any::<bool>()).prop_map(|(backend, ready)| Op::Drain { backend, ready }),
        1 => (0u8..8, 1u32..5).prop_map(|(backend, weight)| Op::Weight { backend, weight }),
    ]
}

fn policy() -> impl Strategy<Value = PolicyKind> {
    prop::sample::select(PolicyKind::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Whatever happens, every backend's counters equal its live leases, and once every lease
    /// is gone every counter is zero.
    #[test]
    fn counters_always_equal_live_leases(
        policy in policy(),
        ops in prop::collection::vec(op(), 1..120),
        seed in any::<u64>(),
    ) {
        let config = PoolConfig {
            policy,
            lease_ttl_ms: 30_000,
            affinity_max_entries: 200,
            breaker: routing_core::BreakerConfig { failure_threshold: 2, ..Default::default() },
            ..PoolConfig::default()
        };
        let mut pool = Pool::new("p", config);
        let mut rng = SplitMix64::new(seed);
        let mut now = 0u64;
        let mut granted: Vec<u64> = Vec::new();
        let roles = [Role::Mixed, Role::Prefill, Role::Decode];
        for b in 0..4u8 {
            let id = pool.add_backend(BackendSpec { role: roles[b as usize % 3], ..spec(&format!("b{b}")) }, 0).unwrap();
            pool.record_probe(&id, &ProbeResult { ok: true, ..ProbeResult::default() }, 0).unwrap();
        }
        for op in ops {
            now += 7;
            match op {
                Op::Acquire { prefix, key } => {
                    let text = format!("{}{}", "shared prefix ".repeat(prefix as usize % 8 * 10), prefix);
                    let f = RequestFeatures {
                        model: "m".into(),
                        prompt_tokens: prompt::estimate_tokens(&text),
                        max_tokens: 50,
                        block_tokens: 16,
                        block_hashes: prompt::block_hashes(text.as_bytes(), 16),
                        routing_key: key.map(|k| format!("user-{k}")),
                        ..RequestFeatures::default()
                    };
                    if let Ok(g) = pool.acquire(&f, now, &mut rng) {
                        prop_assert_eq!(&g.backend, &g.candidates[0].id);
                        granted.push(g.lease_id);
                    }
                }
                Op::Release { pick, status } => {
                    if !granted.is_empty() {
                        let id = granted[pick % granted.len()];
                        let outcome = if status == 0 { Outcome::of_kind(OutcomeKind::Timeout) } else { Outcome::from_status(status) };
                        let live = pool.lease(id).is_some();
                        prop_assert_eq!(pool.release(id, &outcome, now), live);
                    }
                }
                Op::Reassign { pick, to } => {
                    if !granted.is_empty() {
                        let id = granted[pick % granted.len()];
                        let _ = pool.reassign(id, &BackendId::from(format!("b{to}")), &Outcome::from_status(502), now);
                    }
                }
                Op::Expire { advance_ms } => {
                    now += advance_ms;
                    pool.expire(now);
                }
                Op::Remove { backend } => {
                    let _ = pool.remove_backend(&BackendId::from(format!("b{backend}")), now);
                }
                Op::Add { backend, role } => {
                    let s = BackendSpec { role: roles[role as usize], ..spec(&format!("b{backend}")) };
                    let _ = pool.add_backend(s, now);
                }
                Op::Probe { backend, ok } => {
                    let _ = pool.record_probe(&BackendId::from(format!("b{backend}")), &ProbeResult { ok, ..ProbeResult::default() }, now);
                }
                Op::Drain { backend, ready } => {
                    let to = if ready { Lifecycle::Ready } else { Lifecycle::Draining };
                    let _ = pool.set_lifecycle(&BackendId::from(format!("b{backend}")), to, now);
                }
                Op::Weight { backend, weight } => {
                    let patch = BackendPatch { weight: Some(weight), ..BackendPatch::default() };
                    let _ = pool.update_backend(&BackendId::from(format!("b{backend}")), &patch, now);
                }
            }
            if let Err(e) = pool.check_counters() {
                return Err(TestCaseError::fail(e));
            }
            prop_assert!(pool.in_flight_total() <= 2 * pool.live_leases() as u64);
            pool.affinity().verify().map_err(TestCaseError::fail)?;
        }
        pool.expire(now + 1_000_000);
        prop_assert_eq!(pool.live_leases(), 0);
        prop_assert_eq!(pool.in_flight_total(), 0);
        for b in pool.backends() {
            prop_assert_eq!((b.leases_in_flight, b.inflight_prompt_tokens, b.inflight_output_tokens), (0, 0, 0));
        }
    }

    /// The affinity table stays within its bounds and internally consistent under any mix of
    /// records, capacity changes, removals and bound changes.
    #[test]
    fn affinity_never_exceeds_its_bounds(
        max_entries in 0usize..300,
        ops in prop::collection::vec((0u8..4, 0u32..6, 0u64..40, 1usize..40), 1..200),
    ) {
        let mut table = PrefixAffinity::new(max_entries);
        let mut caps = [0u64; 6];
        for (kind, backend, seed, len) in ops {
            match kind {
                0 | 1 => {
                    let text = format!("{seed:08}").repeat(len * 8);
                    table.record(backend, &prompt::block_hashes(text.as_bytes(), 16));
                }
                2 => {
                    let cap = seed * 3;
                    table.set_backend_capacity(backend, cap);
                    caps[backend as usize] = cap;
                }
                _ => {
                    table.remove_backend(backend);
                    caps[backend as usize] = 0;
                }
            }
            prop_assert!(table.len() <= max_entries);
            for (b, &cap) in caps.iter().enumerate() {
                prop_assert!(table.backend_len(b as u32) <= cap);
            }
            table.verify().map_err(TestCaseError::fail)?;
        }
        table.set_max_entries(max_entries / 2);
        prop_assert!(table.len() <= max_entries / 2);
        table.verify().map_err(TestCaseError::fail)?;
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        ".{0,40}".prop_map(Value::String),
        prop::sample::select(vec![
            "user",
            "system",
            "assistant",
            "text",
            "image_url",
            "m",
            "tool"
        ])
        .prop_map(|s| Value::String(s.to_string())),
    ];
    leaf.prop_recursive(5, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "model",
                        "messages",
                        "prompt",
                        "role",
                        "content",
                        "type",
                        "text",
                        "name",
                        "tools",
                        "tool_calls",
                        "tool_call_id",
                        "max_tokens",
                        "max_completion_tokens",
                        "stream",
                        "user",
                        "function",
                        "image_url",
                    ]),
                    inner,
                ),
                0..6,
            )
            .prop_map(|pairs| {
                Value::Object(pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// No JSON value makes the request parsers panic; whatever they accept is consistent.
    #[test]
    fn parsers_never_panic_on_json(body in json_value(), header in proptest::option::of(".{0,300}")) {
        let headers = |name: &str| (name == "x-session-id").then(|| header.clone()).flatten();
        if let Ok(f) = prompt::request_features(&body, &headers, &FeatureConfig::default()) {
            prop_assert!(!f.model.is_empty());
            prop_assert!(f.block_hashes.len() <= FeatureConfig::default().max_blocks);
        }
        let _ = prompt::canonical_chat_prompt(&body, Some(&body));
        let _ = prompt::canonical_completion_prompt(&body);
        let _ = routing_key::routing_key(&headers, &body, Some("x-doc"));
        if let Some(messages) = body.get("messages") {
            let _ = prompt::canonical_chat_prompt(messages, body.get("tools"));
        }
    }

    /// No text makes the JSON boundary types panic, and block hashing accepts any bytes.
    #[test]
    fn boundary_types_never_panic_on_text(text in ".{0,200}", bytes in prop::collection::vec(any::<u8>(), 0..600), block in 0usize..40) {
        let _ = serde_json::from_str::<PoolConfig>(&text);
        let _ = serde_json::from_str::<BackendSpec>(&text);
        let _ = serde_json::from_str::<BackendPatch>(&text);
        let _ = serde_json::from_str::<Outcome>(&text);
        let _ = serde_json::from_str::<ProbeResult>(&text);
        let _ = serde_json::from_str::<RequestFeatures>(&text);
        let _ = text.parse::<PolicyKind>();
        let hashes = prompt::block_hashes(&bytes, block);
        prop_assert_eq!(hashes.len(), bytes.len() / (block.max(1) * prompt::BYTES_PER_TOKEN));
        prop_assert!(prompt::estimate_tokens(&text) as usize >= text.len() / 4);
    }

    /// Untrusted JSON configs either fail validation or drive a pool without panicking.
    #[test]
    fn any_valid_config_routes(body in json_value()) {
        if let Ok(config) = serde_json::from_value::<PoolConfig>(body) {
            let mut pool = Pool::new("p", config.clone());
            let valid = config.validate().is_ok();
            prop_assert_eq!(pool.set_config(config).is_ok(), valid);
            let id = pool.add_backend(spec("a"), 0).unwrap();
            pool.record_probe(&id, &ProbeResult { ok: true, ..ProbeResult::default() }, 0).unwrap();
            let f = RequestFeatures { model: "m".into(), prompt_tokens: 100, max_tokens: 10, ..RequestFeatures::default() };
            let g = pool.acquire(&f, 0, &mut SplitMix64::new(3));
            prop_assert!(g.is_ok());
        }
    }
}
