//! The overdue-lease rule against the real pool: a burst of streams on one backend, no scrape
//! since, first tokens reported for some and the rest reported overdue at the time their grants
//! gave; what the prices, the receipt, the card and the scrape trigger make of it.

use super::EVIDENCE_SCRAPE_INTERVAL_MS;
use crate::backend::scrape::{ScrapedGauges, VllmMetrics};
use crate::backend::BackendId;
use crate::policy::PolicyKind;
use crate::pool::lease::LeaseId;
use crate::pool::test_support::{add_ready, features, spec, up};
use crate::pool::{Pool, PoolConfig, ProbeResult};
use crate::random::SplitMix64;
use crate::stream::outcome::Outcome;

/// A probe of a backend whose scrape reports `running` sequences and `waiting` requests.
fn scraped(running: f64, waiting: f64) -> ProbeResult {
    ProbeResult {
        metrics: VllmMetrics {
            gauges: ScrapedGauges {
                running: Some(running),
                waiting: Some(waiting),
                kv_usage: Some(0.01),
                ..ScrapedGauges::default()
            },
            ..VllmMetrics::default()
        },
        ..up()
    }
}

/// A `predicted_latency` pool (with `overdue_factor`) whose backend `b0`, scraped idle at 0,
/// took a burst of 10 long streams at 10 ms; `b1` is registered and scraped idle after it.
fn burst(overdue_factor: f64) -> (Pool, Vec<(LeaseId, Option<u32>)>) {
    let mut config = PoolConfig::default();
    config.time_model.overdue_factor = overdue_factor;
    let (mut pool, leases) = burst_on_one(config);
    let b1 = pool.add_backend(spec("b1"), 20).unwrap();
    pool.record_probe(&b1, &scraped(0.0, 0.0), 20).unwrap();
    (pool, leases)
}

/// A `predicted_latency` pool of `config` whose one backend `b0`, scraped idle at 0, took a burst
/// of 10 long streams at 10 ms: the leases and their due times.
fn burst_on_one(config: PoolConfig) -> (Pool, Vec<(LeaseId, Option<u32>)>) {
    let config = PoolConfig {
        policy: PolicyKind::PredictedLatency,
        ..config
    };
    let mut pool = Pool::new("p", config);
    let b0 = add_ready(&mut pool, spec("b0"));
    pool.record_probe(&b0, &scraped(0.0, 0.0), 0).unwrap();
    let mut rng = SplitMix64::new(7);
    let mut leases = Vec::new();
    for i in 0..10 {
        let mut f = features(&format!("write a long story, number {i}"));
        f.stream = true;
        f.max_tokens = 2_000;
        let grant = pool.acquire(&f, 10, &mut rng).unwrap();
        assert_eq!(grant.backend, BackendId::new("b0"));
        leases.push((grant.lease_id, grant.first_token_due_ms));
    }
    (pool, leases)
}

fn short() -> crate::request::prompt::RequestFeatures {
    let mut f = features("hi");
    f.stream = true;
    f.max_tokens = 16;
    f
}

#[test]
fn ten_streams_two_started_eight_overdue_is_a_queue_and_the_idle_backend_wins() {
    let (mut pool, leases) = burst(3.0);
    // Predicted within a few ms: each stream is due by the 500 ms floor (and its overhead).
    for &(_, due) in &leases {
        assert!((500..600).contains(&due.unwrap()), "{due:?}");
    }
    // Two streams had their first token at once (reported on a renewal); the Worker reported the
    // eight others overdue at their due time, and no scrape came since the burst.
    assert!(pool.note_first_token(leases[0].0, 40));
    assert!(pool.note_first_token(leases[1].0, 45));
    for &(id, _) in &leases[2..] {
        assert!(pool.note_overdue(id));
    }
    let now = 2_000;
    let mut rng = SplitMix64::new(1);
    let grant = pool.acquire(&short(), now, &mut rng).unwrap();
    assert_eq!(grant.backend, BackendId::new("b1"), "{grant:?}");
    let receipt = grant.receipt.clone().unwrap();
    assert_eq!(receipt.alt, Some(BackendId::new("b0")));
    assert_eq!(receipt.alt_queued_by_leases, Some(8));
    assert_eq!(receipt.queued_by_leases, None);
    // Eight streams behind two running ones, each 2,000 tokens of decode away: seconds.
    let alt_ms = receipt.alt_predicted_ttft_ms.unwrap();
    assert!(alt_ms > 1_000, "{receipt:?}");
    assert!(receipt
        .header_value(&grant.backend)
        .ends_with(";alt_queued_by_leases=8"));
    let ev = pool.lease_evidence(&BackendId::new("b0")).unwrap();
    assert_eq!((ev.started, ev.overdue, ev.queued), (2, 8, 8));
    // The batch limit is learned as a scrape's would be: two running behind a queue.
    let card = pool.time_card(now, 0, 0);
    assert_eq!(card.queued_by_leases, 8);
    assert_eq!(card.max_seqs, 2 + 256, "{card:?}");
    assert!(pool.release(grant.lease_id, &Outcome::from_status(200), now + 5));
}

#[test]
fn without_lease_evidence_the_same_burst_looks_idle() {
    // The blindness: lease evidence off, the pool believes b0 idle until a scrape.
    let (mut pool, leases) = burst(0.0);
    assert!(leases.iter().all(|(_, due)| due.is_none()), "no due time");
    pool.note_first_token(leases[0].0, 40);
    pool.note_first_token(leases[1].0, 45);
    for &(id, _) in &leases[2..] {
        pool.note_overdue(id);
    }
    let mut rng = SplitMix64::new(1);
    let grant = pool.acquire(&short(), 2_000, &mut rng).unwrap();
    let receipt = grant.receipt.unwrap();
    let b0_ms = if grant.backend == BackendId::new("b0") {
        receipt.predicted_ttft_ms
    } else {
        receipt.alt_predicted_ttft_ms.unwrap()
    };
    assert!(b0_ms < 200, "{receipt:?}");
    assert_eq!(receipt.alt_queued_by_leases, None);
    assert_eq!(pool.time_card(2_000, 0, 0).queued_by_leases, 0);
}

#[test]
fn only_streams_reported_overdue_count_and_a_first_token_ends_it() {
    let (mut pool, leases) = burst(3.0);
    let b0 = BackendId::new("b0");
    // Streams on time cost no call and count as nothing, however long they run.
    pool.refresh_evidence(60_000);
    let ev = pool.lease_evidence(&b0).unwrap();
    assert_eq!((ev.started, ev.overdue, ev.queued), (0, 0, 0));
    assert!(pool.evidence_scrapes(60_000).is_empty());
    for &(id, _) in &leases {
        pool.note_overdue(id);
    }
    pool.refresh_evidence(700);
    assert_eq!(pool.lease_evidence(&b0).unwrap().queued, 10);
    // A first token reported late ends its overdue count (a second report changes nothing).
    for &(id, _) in &leases[..3] {
        assert!(pool.note_first_token(id, 700));
        pool.note_overdue(id);
    }
    pool.refresh_evidence(800);
    let ev = pool.lease_evidence(&b0).unwrap();
    assert_eq!((ev.started, ev.overdue, ev.queued), (3, 7, 7));
    // A non-streamed request has no due time.
    let mut rng = SplitMix64::new(3);
    let whole = pool
        .acquire(&features("not streamed"), 800, &mut rng)
        .unwrap();
    assert_eq!(whole.first_token_due_ms, None);
    // Released leases leave no trace.
    for id in leases.iter().map(|l| l.0).chain([whole.lease_id]) {
        assert!(pool.release(id, &Outcome::from_status(200), 900));
    }
    assert!(!pool.note_overdue(leases[5].0), "released");
    pool.refresh_evidence(900);
    assert_eq!(pool.lease_evidence(&b0).unwrap().overdue, 0);
    assert_eq!(pool.live_leases(), 0);
    assert_eq!(pool.in_flight_total(), 0);
}

#[test]
fn a_first_token_past_its_due_time_asks_for_a_scrape() {
    let (mut pool, leases) = burst(3.0);
    let b0 = BackendId::new("b0");
    pool.note_first_token(leases[0].0, 30);
    pool.refresh_evidence(1_000);
    assert!(pool.evidence_scrapes(1_000).is_empty(), "on time");
    let mut late = Outcome::from_status(200);
    late.ttfb_ms = Some(4_000);
    assert!(pool.release(leases[1].0, &late, 5_000));
    pool.refresh_evidence(5_000);
    assert_eq!(pool.evidence_scrapes(5_000), vec![b0]);
    for &(id, _) in &leases {
        pool.release(id, &Outcome::from_status(200), 5_100);
    }
    assert_eq!(pool.in_flight_total(), 0);
}

#[test]
fn the_model_being_wrong_asks_for_one_scrape_a_second_and_the_scrape_takes_over() {
    let (mut pool, leases) = burst(3.0);
    let b0 = BackendId::new("b0");
    for &(id, _) in &leases {
        pool.note_overdue(id);
    }
    pool.refresh_evidence(1_000);
    assert_eq!(pool.evidence_scrapes(1_000), vec![b0.clone()]);
    pool.refresh_evidence(1_500);
    assert!(pool.evidence_scrapes(1_500).is_empty(), "rate-limited");
    pool.refresh_evidence(1_000 + EVIDENCE_SCRAPE_INTERVAL_MS);
    assert_eq!(
        pool.evidence_scrapes(1_000 + EVIDENCE_SCRAPE_INTERVAL_MS),
        vec![b0.clone()]
    );
    // The scrape sees 2 running and 8 waiting: the streams granted before it are its to count,
    // and the queue it reports keeps the backend priced as queued.
    pool.record_probe(&b0, &scraped(2.0, 8.0), 2_100).unwrap();
    pool.refresh_evidence(2_200);
    let ev = pool.lease_evidence(&b0).unwrap();
    assert_eq!((ev.overdue, ev.queued), (10, 0));
    assert!(pool.evidence_scrapes(3_500).is_empty(), "the scrape agrees");
    let mut rng = SplitMix64::new(1);
    let grant = pool.acquire(&short(), 2_200, &mut rng).unwrap();
    assert_eq!(grant.backend, BackendId::new("b1"));
    let card = pool.time_card(2_200, 0, 0);
    assert_eq!((card.queued_by_leases, card.max_seqs), (0, 2 + 256));
    for id in leases.into_iter().map(|l| l.0).chain([grant.lease_id]) {
        assert!(pool.release(id, &Outcome::from_status(200), 2_300));
    }
    assert_eq!(pool.in_flight_total(), 0);
}

#[test]
fn under_admission_control_a_queue_from_the_leases_leaves_no_room_until_it_starts() {
    let mut config = PoolConfig::default();
    config.admission.enabled = true;
    config.admission.overcommit = 0.0;
    let (mut pool, leases) = burst_on_one(config);
    let leases: Vec<LeaseId> = leases.into_iter().map(|l| l.0).collect();
    let mut rng = SplitMix64::new(5);
    // 256 slots as configured: room for more.
    let room = pool.acquire(&short(), 600, &mut rng).unwrap();
    assert!(pool.release(room.lease_id, &Outcome::from_status(200), 601));
    for &id in &leases[2..] {
        pool.note_overdue(id);
    }
    // Eight queued behind two: the backend has no room, and the pool's card says it cannot take
    // a request now (the choice between pools reads that).
    assert_eq!(
        pool.acquire(&short(), 700, &mut rng).unwrap_err(),
        crate::pool::AcquireError::AtCapacity
    );
    assert_eq!(pool.time_card(700, 0, 0).cached_ms, None);
    // Their first tokens come: the queue is gone, and so is the bound.
    for &id in &leases[2..] {
        pool.note_first_token(id, 900);
    }
    let g = pool.acquire(&short(), 1_000, &mut rng).unwrap();
    for id in leases.into_iter().chain([g.lease_id]) {
        assert!(pool.release(id, &Outcome::from_status(200), 1_100));
    }
    assert_eq!(pool.in_flight_total(), 0);
}
