//! A pool's recent past, minute by minute: what the dashboard's charts draw.
//!
//! The pool already keeps cumulative counters (requests, outcomes, a time-to-first-byte histogram
//! per backend, prefix blocks routed and probably cached) and the probes read each backend's vLLM
//! prefix-cache counters. [`History::record`] takes a snapshot of those totals ([`totals`]) now and
//! then (every probe round, and whenever the history is read), and adds the difference since the
//! previous snapshot to the current minute's [`Minute`]. Nothing happens per request.
//!
//! It keeps at most `capacity` minutes (an hour by default), so its memory is bounded:
//! [`History::memory_bytes`] estimates it. Counters that go backwards (a backend removed and added
//! again, a vLLM server restarted) count from zero; a vLLM server seen for the first time only
//! sets its baseline, so its lifetime totals never land in one minute.

use crate::backend::BackendId;
use crate::metrics::LATENCY_BUCKETS_MS;
use crate::pool::Pool;
use crate::stream::outcome::OutcomeKind;
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};

/// Length of one aggregate.
pub const MINUTE_MS: u64 = 60_000;
/// Minutes kept by default: the dashboard's last hour.
pub const DEFAULT_HISTORY_MINUTES: usize = 60;
/// Time-to-first-byte buckets: the latency histogram's bounds plus one for anything slower.
pub const TTFB_BUCKETS: usize = LATENCY_BUCKETS_MS.len() + 1;

/// One backend's cumulative counters at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BackendTotals {
    /// Lease shares granted (first choices and retries).
    pub requests: u64,
    /// Released shares, whatever their outcome.
    pub finished: u64,
    /// Released shares that failed on the backend's side: 5xx, timeout, connection error, 429.
    pub errors: u64,
    /// Time-to-first-byte observations per bucket (not cumulative across buckets).
    pub ttfb: [u64; TTFB_BUCKETS],
    /// vLLM's prefix-cache queries, in tokens, as last scraped.
    pub cache_queries: Option<f64>,
    /// vLLM's prefix-cache hits, in tokens, as last scraped.
    pub cache_hits: Option<f64>,
}

/// A pool's cumulative counters at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Totals {
    /// Per backend.
    pub backends: BTreeMap<BackendId, BackendTotals>,
    /// Prompt prefix blocks of routed requests.
    pub prompt_blocks: u64,
    /// Of those, blocks the chosen backend probably had cached.
    pub cached_blocks: u64,
}

impl Totals {
    /// Adds a backend's scraped vLLM prefix-cache counters (the probe reads them; the pool does not).
    pub fn set_cache_counters(&mut self, id: &BackendId, queries: Option<f64>, hits: Option<f64>) {
        if let Some(b) = self.backends.get_mut(id) {
            b.cache_queries = queries;
            b.cache_hits = hits;
        }
    }
}

/// Reads the pool's cumulative counters.
pub fn totals(pool: &Pool) -> Totals {
    let mut out = Totals {
        prompt_blocks: pool.stats().prompt_blocks,
        cached_blocks: pool.stats().cached_blocks,
        ..Totals::default()
    };
    for r in pool.backend_reports() {
        let s = r.stats;
        let errors = OutcomeKind::ALL
            .iter()
            .filter(|k| k.is_backend_failure() || **k == OutcomeKind::RateLimited)
            .map(|k| s.outcomes[k.index()])
            .sum();
        let mut ttfb = [0u64; TTFB_BUCKETS];
        let bounded = s.ttfb.buckets();
        ttfb[..bounded.len()].copy_from_slice(bounded);
        ttfb[TTFB_BUCKETS - 1] = s.ttfb.count().saturating_sub(bounded.iter().sum());
        out.backends.insert(
            r.view.id,
            BackendTotals {
                requests: s.requests,
                finished: s.outcomes.iter().sum(),
                errors,
                ttfb,
                cache_queries: None,
                cache_hits: None,
            },
        );
    }
    out
}

/// What happened in one minute (or, for the newest, in the part of it so far).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Minute {
    /// Start of the minute, ms since the epoch (a multiple of [`MINUTE_MS`]).
    pub start_ms: u64,
    /// Lease shares granted.
    pub requests: u64,
    /// Shares released.
    pub finished: u64,
    /// Of those, backend-side failures.
    pub errors: u64,
    /// Time-to-first-byte observations per bucket.
    pub ttfb: [u32; TTFB_BUCKETS],
    /// Prompt prefix blocks routed.
    pub prompt_blocks: u64,
    /// Of those, probably cached on the chosen backend (the router's estimate).
    pub cached_blocks: u64,
    /// vLLM prefix-cache queries, in tokens (the backends' own count).
    pub cache_queries: f64,
    /// vLLM prefix-cache hits, in tokens.
    pub cache_hits: f64,
    /// Requests per backend (only backends that had some).
    pub backend_requests: Vec<(BackendId, u32)>,
}

/// The last `capacity` minutes of a pool.
#[derive(Debug, Clone)]
pub struct History {
    capacity: usize,
    minutes: VecDeque<Minute>,
    last: Totals,
}

impl Default for History {
    fn default() -> Self {
        History::new(DEFAULT_HISTORY_MINUTES)
    }
}

/// `now - before` for a counter that may have restarted from zero in between.
fn delta(now: u64, before: u64) -> u64 {
    if now >= before {
        now - before
    } else {
        now
    }
}

/// The same for a scraped counter: no delta until there is a baseline.
fn scraped_delta(now: Option<f64>, before: Option<f64>) -> f64 {
    match (now, before) {
        (Some(n), Some(b)) if n >= b => n - b,
        (Some(n), Some(_)) => n,
        _ => 0.0,
    }
}

fn to_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

impl History {
    /// An empty history of at most `capacity` minutes (at least one). The baseline is all zeros:
    /// create it together with the pool whose counters it follows.
    pub fn new(capacity: usize) -> History {
        History {
            capacity: capacity.max(1),
            minutes: VecDeque::new(),
            last: Totals::default(),
        }
    }

    /// Adds what changed since the previous snapshot to the minute of `now_ms`, and makes `totals`
    /// the new baseline. A clock that went backwards adds to the newest minute.
    pub fn record(&mut self, now_ms: u64, mut totals: Totals) {
        let start = now_ms - now_ms % MINUTE_MS;
        let newest = self.minutes.back().map(|m| m.start_ms);
        if newest.is_none_or(|n| start > n) {
            // The previous minute is complete: give back its spare capacity.
            if let Some(done) = self.minutes.back_mut() {
                done.backend_requests.shrink_to_fit();
            }
            self.minutes.push_back(Minute {
                start_ms: start,
                ..Minute::default()
            });
        }
        let oldest_kept = start.saturating_sub((self.capacity as u64 - 1) * MINUTE_MS);
        while self.minutes.len() > self.capacity
            || self
                .minutes
                .front()
                .is_some_and(|m| m.start_ms < oldest_kept)
        {
            self.minutes.pop_front();
        }
        let minute = self.minutes.back_mut().expect("a minute was just ensured");

        let zero = BackendTotals::default();
        for (id, now) in totals.backends.iter_mut() {
            let before = self.last.backends.get(id).unwrap_or(&zero);
            let requests = delta(now.requests, before.requests);
            minute.requests += requests;
            minute.finished += delta(now.finished, before.finished);
            minute.errors += delta(now.errors, before.errors);
            // One reset check for the whole histogram, so its buckets stay consistent.
            let reset = now.ttfb.iter().zip(&before.ttfb).any(|(n, b)| n < b);
            for (i, slot) in minute.ttfb.iter_mut().enumerate() {
                let d = if reset {
                    now.ttfb[i]
                } else {
                    now.ttfb[i] - before.ttfb[i]
                };
                *slot = slot.saturating_add(to_u32(d));
            }
            minute.cache_queries += scraped_delta(now.cache_queries, before.cache_queries);
            minute.cache_hits += scraped_delta(now.cache_hits, before.cache_hits);
            // A probe that could not read the counters keeps the previous baseline.
            if now.cache_queries.is_none() {
                now.cache_queries = before.cache_queries;
            }
            if now.cache_hits.is_none() {
                now.cache_hits = before.cache_hits;
            }
            if requests > 0 {
                match minute.backend_requests.iter_mut().find(|(b, _)| b == id) {
                    Some((_, n)) => *n = n.saturating_add(to_u32(requests)),
                    None => minute.backend_requests.push((id.clone(), to_u32(requests))),
                }
            }
        }
        minute.prompt_blocks += delta(totals.prompt_blocks, self.last.prompt_blocks);
        minute.cached_blocks += delta(totals.cached_blocks, self.last.cached_blocks);
        self.last = totals;
    }

    /// The kept minutes, oldest first.
    pub fn minutes(&self) -> impl Iterator<Item = &Minute> {
        self.minutes.iter()
    }

    /// Most minutes kept.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Heap and inline bytes held, estimated from sizes and capacities (the dashboard shows it;
    /// the README quotes it): about 150 bytes per minute, plus 32 and the id's length per backend
    /// with traffic in that minute, plus the baseline's ~250 bytes per backend.
    pub fn memory_bytes(&self) -> usize {
        let id_bytes = |id: &BackendId| std::mem::size_of::<BackendId>() + id.0.capacity();
        let minutes: usize = self
            .minutes
            .iter()
            .map(|m| {
                std::mem::size_of::<Minute>()
                    + m.backend_requests.capacity() * std::mem::size_of::<(BackendId, u32)>()
                    + m.backend_requests
                        .iter()
                        .map(|(id, _)| id.0.capacity())
                        .sum::<usize>()
            })
            .sum();
        // A B-tree entry costs its key and value plus roughly a pointer of node overhead.
        let baseline: usize = self
            .last
            .backends
            .keys()
            .map(|id| id_bytes(id) + std::mem::size_of::<BackendTotals>() + 8)
            .sum();
        std::mem::size_of::<History>()
            + (self.minutes.capacity() - self.minutes.len()) * std::mem::size_of::<Minute>()
            + minutes
            + baseline
    }

    /// The history as the dashboard reads it, at `now_ms`: per-minute rates and percentiles,
    /// and each backend's share of the requests in the window.
    pub fn report(&self, now_ms: u64) -> HistoryReport {
        let mut per_backend: BTreeMap<&BackendId, u64> = BTreeMap::new();
        let minutes: Vec<MinuteReport> = self
            .minutes
            .iter()
            .map(|m| {
                for (id, n) in &m.backend_requests {
                    *per_backend.entry(id).or_insert(0) += u64::from(*n);
                }
                MinuteReport::of(m, now_ms)
            })
            .collect();
        let total: u64 = per_backend.values().sum();
        let backends = per_backend
            .into_iter()
            .map(|(id, requests)| BackendShare {
                id: id.clone(),
                requests,
                share: if total > 0 {
                    requests as f64 / total as f64
                } else {
                    0.0
                },
            })
            .collect();
        HistoryReport {
            minute_ms: MINUTE_MS,
            window_minutes: self.capacity,
            now_ms,
            memory_bytes: self.memory_bytes(),
            minutes,
            backends,
        }
    }
}

/// The `q` quantile (0 to 1) of a bucketed latency distribution, in ms, interpolating linearly
/// within the bucket (as Prometheus' `histogram_quantile` does); observations past the last bound
/// report that bound. `None` without observations.
pub fn ttfb_quantile_ms(buckets: &[u32; TTFB_BUCKETS], q: f64) -> Option<f64> {
    let total: u64 = buckets.iter().map(|&b| u64::from(b)).sum();
    if total == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let mut below = 0u64;
    for (i, &count) in buckets.iter().enumerate() {
        let count = u64::from(count);
        if count > 0 && (below + count) as f64 >= rank {
            let Some(&upper) = LATENCY_BUCKETS_MS.get(i) else {
                return Some(*LATENCY_BUCKETS_MS.last().unwrap_or(&0) as f64);
            };
            let lower = if i == 0 { 0 } else { LATENCY_BUCKETS_MS[i - 1] };
            let within = ((rank - below as f64) / count as f64).clamp(0.0, 1.0);
            return Some(lower as f64 + (upper - lower) as f64 * within);
        }
        below += count;
    }
    Some(*LATENCY_BUCKETS_MS.last().unwrap_or(&0) as f64)
}

/// One minute as the dashboard draws it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MinuteReport {
    /// Start of the minute, ms since the epoch.
    pub start_ms: u64,
    /// How much of the minute this covers: 60,000 except for the current minute.
    pub span_ms: u64,
    /// Lease shares granted.
    pub requests: u64,
    /// Requests per second over the span.
    pub requests_per_s: f64,
    /// Shares released.
    pub finished: u64,
    /// Backend-side failures among them.
    pub errors: u64,
    /// `errors / finished`, when anything finished.
    pub error_rate: Option<f64>,
    /// Median time to first byte, ms.
    pub ttfb_p50_ms: Option<f64>,
    /// 99th percentile time to first byte, ms.
    pub ttfb_p99_ms: Option<f64>,
    /// vLLM's prefix-cache hit rate in tokens (hits / queries), when the backends report it.
    pub prefix_cache_hit_rate: Option<f64>,
    /// The router's estimate: prompt blocks it expected the chosen backend to have cached.
    pub routed_cache_hit_rate: Option<f64>,
}

impl MinuteReport {
    fn of(m: &Minute, now_ms: u64) -> MinuteReport {
        let span_ms = now_ms.saturating_sub(m.start_ms).clamp(1_000, MINUTE_MS);
        let ratio = |num: f64, den: f64| (den > 0.0).then(|| num / den);
        MinuteReport {
            start_ms: m.start_ms,
            span_ms,
            requests: m.requests,
            requests_per_s: m.requests as f64 * 1000.0 / span_ms as f64,
            finished: m.finished,
            errors: m.errors,
            error_rate: ratio(m.errors as f64, m.finished as f64),
            ttfb_p50_ms: ttfb_quantile_ms(&m.ttfb, 0.5),
            ttfb_p99_ms: ttfb_quantile_ms(&m.ttfb, 0.99),
            prefix_cache_hit_rate: ratio(m.cache_hits, m.cache_queries),
            routed_cache_hit_rate: ratio(m.cached_blocks as f64, m.prompt_blocks as f64),
        }
    }
}

/// A backend's part of the requests in the window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BackendShare {
    /// The backend.
    pub id: BackendId,
    /// Its requests in the window.
    pub requests: u64,
    /// Its fraction of the pool's requests in the window (0 without traffic).
    pub share: f64,
}

/// The history as served to the dashboard.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HistoryReport {
    /// Length of one aggregate, ms.
    pub minute_ms: u64,
    /// Most minutes kept.
    pub window_minutes: usize,
    /// When the report was made.
    pub now_ms: u64,
    /// Estimated bytes the history holds.
    pub memory_bytes: usize,
    /// Minutes, oldest first; the last may be the current, partial one.
    pub minutes: Vec<MinuteReport>,
    /// Backends with requests in the window, by id.
    pub backends: Vec<BackendShare>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendSpec;
    use crate::pool::test_support::add_ready;
    use crate::pool::PoolConfig;
    use crate::random::SplitMix64;
    use crate::request::prompt::RequestFeatures;
    use crate::stream::outcome::Outcome;

    const T0: u64 = 1_700_000_040_000; // a minute boundary

    fn backend(requests: u64, finished: u64, errors: u64) -> BackendTotals {
        BackendTotals {
            requests,
            finished,
            errors,
            ..BackendTotals::default()
        }
    }

    fn snapshot(entries: &[(&str, BackendTotals)]) -> Totals {
        Totals {
            backends: entries
                .iter()
                .map(|(id, t)| (BackendId::from(*id), t.clone()))
                .collect(),
            ..Totals::default()
        }
    }

    #[test]
    fn deltas_land_in_the_minute_of_the_snapshot() {
        let mut h = History::new(60);
        h.record(T0 + 10_000, snapshot(&[("a", backend(5, 4, 1))]));
        h.record(T0 + 50_000, snapshot(&[("a", backend(8, 8, 1))]));
        h.record(T0 + 70_000, snapshot(&[("a", backend(10, 10, 2))]));
        let m: Vec<&Minute> = h.minutes().collect();
        assert_eq!(m.len(), 2);
        assert_eq!(
            (m[0].start_ms, m[0].requests, m[0].finished, m[0].errors),
            (T0, 8, 8, 1)
        );
        assert_eq!(
            (m[1].start_ms, m[1].requests, m[1].finished, m[1].errors),
            (T0 + 60_000, 2, 2, 1)
        );
        let r = h.report(T0 + 75_000);
        assert_eq!(r.minutes[1].span_ms, 15_000);
        assert!((r.minutes[1].requests_per_s - 2.0 / 15.0).abs() < 1e-9);
        assert_eq!(r.minutes[0].error_rate, Some(1.0 / 8.0));
    }

    #[test]
    fn bounded_to_capacity_and_to_the_window() {
        let mut h = History::new(5);
        for i in 0..50 {
            h.record(T0 + i * MINUTE_MS, snapshot(&[("a", backend(i, i, 0))]));
        }
        assert_eq!(h.minutes().count(), 5);
        let before = h.memory_bytes();
        for i in 50..500 {
            h.record(T0 + i * MINUTE_MS, snapshot(&[("a", backend(i, i, 0))]));
        }
        assert_eq!(h.minutes().count(), 5);
        assert!(h.memory_bytes() <= before + 64, "memory stays flat");
        // A gap longer than the window leaves only the newest minute.
        h.record(
            T0 + 10_000 * MINUTE_MS,
            snapshot(&[("a", backend(600, 600, 0))]),
        );
        assert_eq!(h.minutes().count(), 1);
    }

    #[test]
    fn counters_that_restart_count_from_zero() {
        let mut h = History::new(60);
        h.record(T0, snapshot(&[("a", backend(100, 100, 0))]));
        // Removed and added again: its counters restart.
        h.record(T0 + 1_000, snapshot(&[("a", backend(3, 3, 0))]));
        assert_eq!(h.minutes().last().unwrap().requests, 103);
    }

    #[test]
    fn scraped_counters_need_a_baseline_and_survive_a_failed_probe() {
        let mut h = History::new(60);
        let with_cache = |q: Option<f64>, hits: Option<f64>| {
            let mut t = snapshot(&[("a", backend(0, 0, 0))]);
            t.set_cache_counters(&BackendId::from("a"), q, hits);
            t
        };
        // Lifetime totals of a server seen for the first time are not this minute's.
        h.record(T0, with_cache(Some(1e6), Some(9e5)));
        assert_eq!(h.minutes().last().unwrap().cache_queries, 0.0);
        h.record(T0 + 1_000, with_cache(None, None));
        h.record(T0 + 2_000, with_cache(Some(1e6 + 100.0), Some(9e5 + 25.0)));
        let m = h.minutes().last().unwrap();
        assert_eq!((m.cache_queries, m.cache_hits), (100.0, 25.0));
        assert_eq!(
            h.report(T0 + 3_000).minutes[0].prefix_cache_hit_rate,
            Some(0.25)
        );
        // The server restarted: its counters count from zero.
        h.record(T0 + 4_000, with_cache(Some(40.0), Some(10.0)));
        assert_eq!(h.minutes().last().unwrap().cache_queries, 140.0);
    }

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let mut b = [0u32; TTFB_BUCKETS];
        assert_eq!(ttfb_quantile_ms(&b, 0.5), None);
        b[2] = 10; // (50, 100] ms
        assert_eq!(ttfb_quantile_ms(&b, 0.5), Some(75.0));
        assert_eq!(ttfb_quantile_ms(&b, 1.0), Some(100.0));
        b[TTFB_BUCKETS - 1] = 90; // slower than the last bound
        assert_eq!(ttfb_quantile_ms(&b, 0.99), Some(120_000.0));
        assert_eq!(ttfb_quantile_ms(&b, 0.05), Some(75.0));
    }

    #[test]
    fn shares_over_the_window() {
        let mut h = History::new(60);
        h.record(
            T0,
            snapshot(&[("a", backend(3, 0, 0)), ("b", backend(1, 0, 0))]),
        );
        h.record(
            T0 + MINUTE_MS,
            snapshot(&[("a", backend(3, 0, 0)), ("b", backend(5, 0, 0))]),
        );
        let r = h.report(T0 + MINUTE_MS);
        assert_eq!(r.backends.len(), 2);
        assert_eq!((r.backends[0].requests, r.backends[1].requests), (3, 5));
        assert!((r.backends[1].share - 5.0 / 8.0).abs() < 1e-9);
    }

    #[test]
    fn follows_a_real_pool() {
        let mut pool = Pool::new("p", PoolConfig::default());
        let id = add_ready(
            &mut pool,
            BackendSpec {
                id: "gpu-1".into(),
                url: "http://gpu-1:8000".into(),
                models: vec!["m".into()],
                ..BackendSpec::default()
            },
        );
        let mut h = History::new(60);
        let mut rng = SplitMix64::new(1);
        let f = RequestFeatures {
            model: "m".into(),
            prompt_tokens: 40,
            max_tokens: 5,
            block_hashes: vec![1, 2],
            ..RequestFeatures::default()
        };
        for (i, status) in [200u16, 200, 500].iter().enumerate() {
            let g = pool.acquire(&f, T0, &mut rng).unwrap();
            let outcome = Outcome {
                ttfb_ms: Some(30 + 10 * i as u64),
                ..Outcome::from_status(*status)
            };
            pool.release(g.lease_id, &outcome, T0 + 100);
        }
        h.record(T0 + 1_000, totals(&pool));
        let r = h.report(T0 + 1_000);
        let m = &r.minutes[0];
        assert_eq!((m.requests, m.finished, m.errors), (3, 3, 1));
        assert_eq!(m.ttfb_p50_ms.map(|v| v > 25.0 && v <= 50.0), Some(true));
        assert_eq!(
            m.routed_cache_hit_rate.map(|r| r > 0.0),
            Some(true),
            "later requests reuse the prefix"
        );
        assert_eq!(r.backends[0].id, id);
        assert_eq!(r.backends[0].share, 1.0);
    }
}
