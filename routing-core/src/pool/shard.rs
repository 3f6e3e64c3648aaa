//! Coordinator shards: which shard of a pool a request goes to, and the load shards tell each other.
//!
//! A pool can run its coordination on several Durable Objects, its shards. Every shard knows every
//! backend; each owns its own leases, its own part of the prefix-affinity table and its own queue.
//! A request goes to the shard chosen by its routing key, or else by its first prefix block, so a
//! conversation (one key) and a shared system prompt (one first block) always meet the same shard
//! and their affinity stays exact. Only load is shared, and only approximately: every shard sends
//! its per-backend load ([`LoadReport`]) to its siblings at a bounded interval, and ranks on its own
//! exact load plus the siblings' last reports ([`SiblingLoads`]). A sibling's prefill backlog is
//! aged by the time since its report (a backlog drains in real time), and a report older than
//! [`STALE_AFTER_INTERVALS`] intervals counts for nothing, so a shard that went away stops weighing
//! on the others. With one shard nothing here runs and routing is exactly the single coordinator's.
//!
//! Between reports a shard also guesses what its siblings placed: each of its own placements since
//! its last report counts [`SIBLING_ECHO`] × (shards − 1) times on that backend. Shards whose
//! traffic shares a prefix (one system prompt behind every conversation) choose alike, and without
//! the guess they all send work to the backend that looked idle at the last report; shards with
//! prefixes of their own choose independently, and counting every placement once per sibling
//! pushes their requests off their caches. In the timed fleet simulation (`tests/shard_sim.rs`),
//! 0 let multi-turn chat's busiest backend reach 1.33x the mean at 4 shards (1.17x with one
//! coordinator), 1 cost shared-prefix groups 3 points of hit rate at 8 shards; 0.5 keeps both
//! within the bounds.

use crate::backend::cost::InFlight;
use crate::backend::BackendId;
use crate::policy::ring::key_hash;
use crate::request::prompt::RequestFeatures;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Most shards a pool may have.
pub const MAX_SHARDS: u32 = 64;

/// Default interval between a shard's load reports to its siblings, in milliseconds.
pub const DEFAULT_EXCHANGE_MS: u64 = 200;

/// Each own placement since the last report counts this many times per sibling shard.
pub const SIBLING_ECHO: f64 = 0.5;

/// A sibling's report counts for this many exchange intervals, then is ignored.
pub const STALE_AFTER_INTERVALS: u64 = 5;

/// The shard (0-based) a request belongs to among `shards`.
///
/// By routing key when the request has one, else by its first prefix block, else by `fallback`
/// (for example the request id's hash): requests with neither key nor prompt share nothing worth
/// keeping together. Any `shards` of 0 or 1 gives shard 0.
pub fn shard_for(
    shards: u32,
    routing_key: Option<&str>,
    first_block: Option<u64>,
    fallback: u64,
) -> u32 {
    if shards <= 1 {
        return 0;
    }
    let h = match (routing_key, first_block) {
        (Some(key), _) => key_hash(key),
        (None, Some(block)) => mix(block),
        (None, None) => mix(fallback),
    };
    // Lemire's multiply-shift: uniform over [0, shards) without a division.
    ((u128::from(h) * u128::from(shards)) >> 64) as u32
}

/// The shard of a request with these features: [`shard_for`] with its routing key, its first
/// prefix block, and its request id as the fallback; shard 0 for a stateful Responses request.
///
/// A Responses request that stores its response (`store`, the API's default) or names a
/// `previous_response_id` goes to shard 0, as do `GET /v1/responses/{id}` and its cancel: the
/// pool's record of which backend holds each stored response (`pool::responses`) must be
/// where every later call about that response looks. The response id is known only once the
/// backend has answered, after the shard granted the lease, and ids are the backends' own (the
/// gateway writes nothing into them), so no hash of the follow-up could find the shard of the
/// first turn; and shards share only load, so a record kept in the granting shard would be
/// invisible to the others. One shard per pool for stateful Responses calls keeps the record
/// exact with no extra round trip. The price: those calls are coordinated by one shard of the
/// pool (its queue, its prefix-affinity table); Responses requests with `store: false`, chat
/// and Messages are spread over the shards as before.
pub fn shard_of_request(shards: u32, features: &RequestFeatures) -> u32 {
    if features.is_stateful() {
        return 0;
    }
    shard_for(
        shards,
        features.routing_key.as_deref(),
        features.block_hashes.first().copied(),
        key_hash(&features.request_id),
    )
}

/// A 64-bit finaliser, so that nearby block hashes or ids spread over shards.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// One backend's load as one shard sees it: its own leases and its virtual prefill queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ShardLoad {
    /// The shard's live leases on the backend, and their expected tokens.
    pub leases: u32,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// The shard's predicted prefill backlog on the backend at the report's time, in ms.
    pub backlog_ms: f64,
}

impl ShardLoad {
    /// The shard's in-flight counters.
    pub fn in_flight(&self) -> InFlight {
        InFlight {
            leases: self.leases,
            prompt_tokens: self.prompt_tokens,
            output_tokens: self.output_tokens,
        }
    }

    fn add(&mut self, other: &ShardLoad, backlog_ms: f64) {
        self.leases = self.leases.saturating_add(other.leases);
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.backlog_ms += backlog_ms;
    }

    fn is_idle(&self) -> bool {
        self.leases == 0 && self.backlog_ms <= 0.0
    }
}

/// What one shard tells its siblings: its load on every backend it has leases on, as of `at_ms`.
/// Backends it does not list carry none of its load.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadReport {
    /// The reporting shard.
    pub shard: u32,
    /// When the report was made (the reporter's clock; shards of a pool share one clock source).
    pub at_ms: u64,
    /// Per-backend load, busy backends only.
    pub backends: Vec<(BackendId, ShardLoad)>,
    /// Backends whose model this shard's lease evidence showed wrong ([`crate::pool::evidence`]):
    /// shard 0, which alone probes, scrapes them now (each at most once per
    /// [`crate::pool::evidence::EVIDENCE_SCRAPE_INTERVAL_MS`]). The other shards ignore it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub scrape: Vec<BackendId>,
}

impl LoadReport {
    /// A report from `(backend, load)` pairs, leaving out backends with nothing in flight.
    pub fn new(
        shard: u32,
        at_ms: u64,
        loads: impl IntoIterator<Item = (BackendId, ShardLoad)>,
    ) -> Self {
        LoadReport {
            shard,
            at_ms,
            backends: loads.into_iter().filter(|(_, l)| !l.is_idle()).collect(),
            scrape: Vec::new(),
        }
    }
}

/// The siblings' last reports, summed per backend on demand.
#[derive(Debug, Clone, Default)]
pub struct SiblingLoads {
    /// This shard's own index (its own reports are ignored).
    me: u32,
    exchange_ms: u64,
    /// Latest report per sibling shard.
    reports: HashMap<u32, LoadReport>,
}

impl SiblingLoads {
    /// Loads for shard `me`, whose siblings report every `exchange_ms`.
    pub fn new(me: u32, exchange_ms: u64) -> Self {
        SiblingLoads {
            me,
            exchange_ms: exchange_ms.max(1),
            reports: HashMap::new(),
        }
    }

    /// Keeps a sibling's report; returns false (and keeps the older state) for the shard's own
    /// report or one older than the one held.
    pub fn accept(&mut self, report: LoadReport) -> bool {
        if report.shard == self.me {
            return false;
        }
        match self.reports.get(&report.shard) {
            Some(held) if held.at_ms > report.at_ms => false,
            _ => {
                self.reports.insert(report.shard, report);
                true
            }
        }
    }

    /// The interval at which siblings report.
    pub fn exchange_ms(&self) -> u64 {
        self.exchange_ms
    }

    /// Forgets every report (the pool's shard count changed).
    pub fn clear(&mut self) {
        self.reports.clear();
    }

    /// Siblings whose reports still count at `now_ms`.
    pub fn fresh(&self, now_ms: u64) -> usize {
        self.reports
            .values()
            .filter(|r| self.is_fresh(r, now_ms))
            .count()
    }

    fn is_fresh(&self, report: &LoadReport, now_ms: u64) -> bool {
        now_ms.saturating_sub(report.at_ms) <= self.exchange_ms * STALE_AFTER_INTERVALS
    }

    /// The siblings' summed load per backend at `now_ms`: fresh reports only, each backlog aged by
    /// its report's age. Calls `each` once per backend some sibling loads.
    pub fn for_each_total(&self, now_ms: u64, mut each: impl FnMut(&BackendId, ShardLoad)) {
        let mut totals: HashMap<&BackendId, ShardLoad> = HashMap::new();
        for report in self.reports.values().filter(|r| self.is_fresh(r, now_ms)) {
            let age = now_ms.saturating_sub(report.at_ms) as f64;
            for (id, load) in &report.backends {
                let backlog = (load.backlog_ms - age).max(0.0);
                totals.entry(id).or_default().add(load, backlog);
            }
        }
        for (id, total) in totals {
            each(id, total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(leases: u32, backlog_ms: f64) -> ShardLoad {
        ShardLoad {
            leases,
            prompt_tokens: u64::from(leases) * 1000,
            output_tokens: u64::from(leases) * 100,
            backlog_ms,
        }
    }

    fn totals(s: &SiblingLoads, now_ms: u64) -> HashMap<String, ShardLoad> {
        let mut out = HashMap::new();
        s.for_each_total(now_ms, |id, l| {
            out.insert(id.0.clone(), l);
        });
        out
    }

    #[test]
    fn one_shard_is_always_shard_zero() {
        assert_eq!(shard_for(1, Some("alice"), Some(7), 3), 0);
        assert_eq!(shard_for(0, None, None, 99), 0);
    }

    #[test]
    fn the_key_decides_before_the_prompt() {
        let by_key = shard_for(8, Some("alice"), Some(1), 0);
        for block in 0..50 {
            assert_eq!(shard_for(8, Some("alice"), Some(block), block), by_key);
        }
        let by_block = shard_for(8, None, Some(12345), 0);
        for fallback in 0..50 {
            assert_eq!(shard_for(8, None, Some(12345), fallback), by_block);
        }
    }

    #[test]
    fn a_request_goes_by_its_key_then_its_first_block_then_its_id() {
        let mut f = RequestFeatures {
            request_id: "req-1".into(),
            routing_key: Some("alice".into()),
            block_hashes: vec![42, 7],
            ..RequestFeatures::default()
        };
        assert_eq!(
            shard_of_request(8, &f),
            shard_for(8, Some("alice"), None, 0)
        );
        f.routing_key = None;
        assert_eq!(shard_of_request(8, &f), shard_for(8, None, Some(42), 0));
        f.block_hashes.clear();
        let by_id = shard_of_request(8, &f);
        assert_eq!(by_id, shard_for(8, None, None, key_hash("req-1")));
        assert_eq!(shard_of_request(1, &f), 0);
    }

    #[test]
    fn stateful_responses_requests_all_go_to_shard_0() {
        // Keys that would spread over the shards otherwise.
        let keyed = |key: &str| RequestFeatures {
            routing_key: Some(key.into()),
            ..RequestFeatures::default()
        };
        assert!((0..32).any(|i| shard_of_request(8, &keyed(&format!("k{i}"))) != 0));
        for i in 0..32 {
            let mut f = keyed(&format!("k{i}"));
            f.stores_response = true;
            assert_eq!(shard_of_request(8, &f), 0);
            f.stores_response = false;
            f.previous_response_id = Some(format!("resp_{i}"));
            assert_eq!(shard_of_request(8, &f), 0);
        }
    }

    #[test]
    fn requests_spread_evenly_over_shards() {
        let mut counts = [0u32; 4];
        for i in 0..4000u64 {
            counts[shard_for(4, None, Some(i), 0) as usize] += 1;
        }
        for c in counts {
            assert!((850..=1150).contains(&c), "uneven spread: {counts:?}");
        }
        let mut keyed = [0u32; 4];
        for i in 0..4000 {
            keyed[shard_for(4, Some(&format!("user-{i}")), None, 0) as usize] += 1;
        }
        for c in keyed {
            assert!((850..=1150).contains(&c), "uneven spread: {keyed:?}");
        }
    }

    #[test]
    fn reports_add_up_across_siblings_and_age() {
        let mut s = SiblingLoads::new(0, 200);
        let a = BackendId::new("a");
        let b = BackendId::new("b");
        assert!(s.accept(LoadReport::new(1, 1000, [(a.clone(), load(2, 300.0))])));
        assert!(s.accept(LoadReport::new(
            2,
            1100,
            [(a.clone(), load(1, 50.0)), (b.clone(), load(3, 0.0))]
        )));
        let t = totals(&s, 1100);
        assert_eq!(t["a"].leases, 3);
        assert_eq!(t["a"].prompt_tokens, 3000);
        // Shard 1's 300 ms backlog is 100 ms old; shard 2's is fresh.
        assert!((t["a"].backlog_ms - 250.0).abs() < 1e-9);
        assert_eq!(t["b"].leases, 3);
        // A newer report from shard 1 replaces its older one wholesale.
        assert!(s.accept(LoadReport::new(1, 1200, [(b.clone(), load(1, 0.0))])));
        let t = totals(&s, 1200);
        assert_eq!(t["a"].leases, 1);
        assert_eq!(t["b"].leases, 4);
    }

    #[test]
    fn own_older_and_stale_reports_do_not_count() {
        let mut s = SiblingLoads::new(3, 100);
        let a = BackendId::new("a");
        assert!(!s.accept(LoadReport::new(3, 10, [(a.clone(), load(9, 0.0))])));
        assert!(s.accept(LoadReport::new(1, 500, [(a.clone(), load(2, 0.0))])));
        assert!(!s.accept(LoadReport::new(1, 400, [(a.clone(), load(7, 0.0))])));
        assert_eq!(totals(&s, 500)["a"].leases, 2);
        assert_eq!(s.fresh(500 + 100 * STALE_AFTER_INTERVALS), 1);
        assert!(totals(&s, 501 + 100 * STALE_AFTER_INTERVALS).is_empty());
        assert_eq!(s.fresh(501 + 100 * STALE_AFTER_INTERVALS), 0);
    }

    #[test]
    fn idle_backends_are_left_out_of_reports() {
        let r = LoadReport::new(
            0,
            0,
            [
                (BackendId::new("a"), load(0, 0.0)),
                (BackendId::new("b"), load(1, 0.0)),
            ],
        );
        assert_eq!(r.backends.len(), 1);
        assert_eq!(r.backends[0].0, BackendId::new("b"));
    }
}
