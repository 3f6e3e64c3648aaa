//! Pins the Prometheus text a pool and its admission queue write, byte for byte, against
//! `data/metrics_page.txt`: family order, `# HELP` text, label order and escaping, number
//! formatting (the coordinator's own families are pinned beside their writer). The Worker's `/metrics` and
//! the Miniflare tests read this page, so a change of writer must leave it as it is.

use routing_core::admission::{AdmissionConfig, AdmissionQueue, DropReason, Waiting};
use routing_core::backend::scrape::{ScrapedGauges, VllmMetrics};
use routing_core::request::prompt::{request_features, FeatureConfig, RequestFeatures};
use routing_core::stream::outcome::StreamResume;
use routing_core::{BackendSpec, Outcome, Pool, PoolConfig, ProbeResult, RandomSource, SplitMix64};
use serde_json::json;

const POOL: &str = "eu\"1";

fn features(text: &str, max_tokens: u32) -> RequestFeatures {
    let body = json!({"model": "m", "max_tokens": max_tokens,
                      "messages": [{"role": "user", "content": text}]});
    request_features(&body, &|_| None, &FeatureConfig::default()).unwrap()
}

/// A pool of two backends (one with characters to escape) after a few requests, probes and
/// failures.
fn pool_page() -> String {
    let mut pool = Pool::new(POOL, PoolConfig::default());
    let mut rng = SplitMix64::new(7);
    for (id, waiting) in [("gpu\\a", Some(2.0)), ("gpu-b", None)] {
        let id = pool
            .add_backend(
                BackendSpec {
                    id: id.into(),
                    url: "http://secret-host:8000".into(),
                    models: vec!["m".into()],
                    ..BackendSpec::default()
                },
                0,
            )
            .unwrap();
        let probe = ProbeResult {
            ok: true,
            metrics: VllmMetrics {
                gauges: ScrapedGauges {
                    waiting,
                    running: Some(1.0),
                    kv_usage: Some(0.25),
                    ..ScrapedGauges::default()
                },
                ..VllmMetrics::default()
            },
            ..ProbeResult::default()
        };
        pool.record_probe(&id, &probe, 0).unwrap();
    }
    let long = "a shared system prompt that is long enough to fill several blocks ".repeat(40);
    let outcomes = [
        Outcome {
            ttfb_ms: Some(120),
            prompt_tokens: Some(700),
            cached_tokens: Some(400),
            completion_tokens: Some(5),
            ..Outcome::from_status(200)
        },
        Outcome {
            ttfb_ms: Some(3_000),
            ..Outcome::from_status(503)
        },
        Outcome {
            ttfb_ms: Some(40),
            completion_tokens: Some(9),
            resume: Some(StreamResume::NotResumed),
            ..Outcome::from_status(200)
        },
        Outcome::from_status(400),
    ];
    let mut now = 1_000;
    for (i, outcome) in outcomes.iter().enumerate() {
        let f = features(&format!("{long} question {i}"), 16);
        let grant = pool.acquire(&f, now, &mut rng).unwrap();
        now += 700;
        pool.release(grant.lease_id, outcome, now);
    }
    // Five failures in a row open a breaker (a 429 saturates another backend first).
    let f = features("a request of its own", 4);
    let grant = pool.acquire(&f, now, &mut rng).unwrap();
    pool.release(grant.lease_id, &Outcome::from_status(429), now);
    for _ in 0..5 {
        let grant = pool.acquire(&f, now, &mut rng).unwrap();
        now += 10;
        pool.release(grant.lease_id, &Outcome::from_status(502), now);
    }
    now += 3_000;
    // One lease still live, one unknown release, one request for no model.
    pool.acquire(&features("still running", 8), now, &mut rng)
        .unwrap();
    pool.release(rng.next_u64(), &Outcome::from_status(200), now);
    let mut unknown = features("unknown model", 8);
    unknown.model = "nope".into();
    assert!(pool.acquire(&unknown, now, &mut rng).is_err());
    let mut out = String::new();
    pool.render_metrics(&mut out);
    out
}

/// A queue with requests in two bands, drops, and one granted after a wait.
fn queue_page() -> String {
    let config = AdmissionConfig {
        enabled: true,
        ..AdmissionConfig::default()
    };
    let mut pool = Pool::new(POOL, PoolConfig::default());
    let id = pool
        .add_backend(
            BackendSpec {
                id: "gpu-q".into(),
                url: "http://q:8000".into(),
                models: vec!["m".into()],
                ..BackendSpec::default()
            },
            0,
        )
        .unwrap();
    pool.record_probe(
        &id,
        &ProbeResult {
            ok: true,
            ..ProbeResult::default()
        },
        0,
    )
    .unwrap();
    let mut q = AdmissionQueue::new();
    let waiting = |ticket, priority, model: &str, at| Waiting {
        ticket,
        tenant: "t\"1".into(),
        priority,
        cost: 20,
        arrived_ms: at,
        deadline_ms: at + 60_000,
        features: RequestFeatures {
            model: model.into(),
            ..features("queued", 8)
        },
    };
    q.offer(waiting(1, 0, "m", 0), &config).unwrap();
    q.offer(waiting(2, 5, "other", 10), &config).unwrap();
    q.offer(waiting(3, -1, "other", 20), &config).unwrap();
    q.record_immediate();
    q.record_immediate();
    q.record_drop(DropReason::Timeout);
    let mut departures = Vec::new();
    let mut rng = SplitMix64::new(3);
    q.dispatch(&mut pool, &config, &[], 1_234, &mut rng, &mut departures);
    assert!(!departures.is_empty());
    // Two left waiting in two bands.
    q.offer(waiting(4, 5, "m", 1_300), &config).unwrap();
    q.offer(waiting(5, -1, "m", 1_400), &config).unwrap();
    let mut out = String::new();
    q.render_metrics(POOL, &mut out);
    let mut empty = String::new();
    AdmissionQueue::new().render_metrics("empty", &mut empty);
    out + &empty
}

#[test]
fn the_page_is_as_pinned() {
    let page = pool_page() + &queue_page();
    // `BLESS=1 cargo test --test metrics_page` rewrites the pin after a deliberate change (review
    // the diff: the writer must not change a line by itself).
    if std::env::var_os("BLESS").is_some() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/metrics_page.txt");
        std::fs::write(path, &page).unwrap();
        return;
    }
    let pinned = include_str!("data/metrics_page.txt");
    if page != pinned {
        for (i, (got, want)) in page.lines().zip(pinned.lines()).enumerate() {
            assert_eq!(got, want, "line {}", i + 1);
        }
        assert_eq!(page.lines().count(), pinned.lines().count(), "{page}");
    }
}
