//! The messages' own rules: compact hashes, small answers, shards added up, patches kept apart.

use super::*;

#[test]
fn a_reassign_carries_its_hashes_compactly_and_back() {
    let req = ReassignRequest {
        lease_id: 7,
        to: BackendId("b-2".into()),
        failure: Outcome::default(),
        terms: None,
        block_hashes: vec![1, u64::MAX, 42],
        missing_model: None,
    };
    let text = serde_json::to_string(&req).unwrap();
    assert!(
        text.contains(r#""block_hashes":"AQAAAAAAAAD//////////yoAAAAAAAAA""#),
        "{text}"
    );
    let back: ReassignRequest = serde_json::from_str(&text).unwrap();
    assert_eq!(back.block_hashes, req.block_hashes);
    let without: ReassignRequest =
        serde_json::from_str(r#"{"lease_id":7,"to":"b-2","failure":{"kind":"timeout"}}"#).unwrap();
    assert!(without.block_hashes.is_empty());
}

#[test]
fn small_answers_are_small() {
    let release = serde_json::to_string(&ReleaseAnswer { released: true }).unwrap();
    assert_eq!(release, r#"{"released":true}"#);
    let delete = DeleteAnswer {
        id: "b".into(),
        deleted: true,
        status: None,
        leases_in_flight: None,
    };
    assert_eq!(
        serde_json::to_string(&delete).unwrap(),
        r#"{"id":"b","deleted":true}"#
    );
}

#[test]
fn shard_zero_is_the_pools_own_object() {
    assert_eq!(shard_object_name("eu", 0), "eu");
    assert_eq!(shard_object_name("eu", 3), "eu#3");
    assert!(crate::settings::validate_name("pool", "eu#3").is_err());
    let entry: PoolEntry = serde_json::from_str(r#"{"name":"eu"}"#).unwrap();
    assert_eq!((entry.shards, entry.all_shards()), (1, 1));
    let shrunk: PoolEntry =
        serde_json::from_str(r#"{"name":"eu","shards":2,"shard_objects":4}"#).unwrap();
    assert_eq!(shrunk.all_shards(), 4);
}

#[test]
fn shard_summaries_add_load_and_counters_but_not_the_fleet() {
    let queue = |length: usize, admitted: u64| QueueSummary {
        enabled: true,
        length,
        by_priority: BTreeMap::from([("0".to_string(), length)]),
        tenants: 1,
        oldest_wait_ms: Some(length as u64 * 10),
        waiting_tokens: 100,
        admitted,
        queued: 1,
        reentered: 0,
        dropped: BTreeMap::from([("timeout".to_string(), 1)]),
    };
    let summary = |in_flight: usize, q: QueueSummary| PoolSummary {
        pool: "p".into(),
        region: String::new(),
        policy: PolicyKind::default(),
        backends: 4,
        ready_backends: 3,
        in_flight,
        in_flight_tokens: in_flight as u64 * 100,
        waiting: 2.0,
        running: 5.0,
        saturated: false,
        queue: q,
        autoscaling: Autoscaling {
            target_waiting_per_replica: 4.0,
            desired_replicas: 3,
        },
        retries: 1,
        spills: 2,
        last_probe_ms: Some(7),
        probe_rounds: 9,
        jurisdiction: String::new(),
        time_card: None,
        retry_budget_exhausted: 0,
    };
    let mut total = summary(2, queue(1, 5));
    total.add_shard(&summary(3, queue(4, 6)));
    assert_eq!((total.in_flight, total.in_flight_tokens), (5, 500));
    assert_eq!((total.retries, total.spills), (2, 4));
    assert_eq!((total.queue.length, total.queue.admitted), (5, 11));
    assert_eq!(total.queue.by_priority["0"], 5);
    assert_eq!(total.queue.dropped["timeout"], 2);
    assert_eq!(total.queue.oldest_wait_ms, Some(40));
    assert_eq!((total.backends, total.ready_backends), (4, 3));
    assert_eq!((total.probe_rounds, total.waiting), (9, 2.0));
}

#[test]
fn an_admin_patch_keeps_drain_apart_from_the_spec() {
    let p: AdminPatch = serde_json::from_str(r#"{"weight":3,"drain":true}"#).unwrap();
    assert_eq!((p.patch.weight, p.drain), (Some(3), Some(true)));
    let again: AdminPatch = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!((again.patch.weight, again.drain), (Some(3), Some(true)));
}
