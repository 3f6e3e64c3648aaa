//! Prometheus text rendering of a pool's state and statistics.
//!
//! Every metric name starts with `llm_gateway_`; series carry a `pool` label and, per backend, a
//! `backend` label with the backend's id (never its URL or API key). The Worker's `/metrics`
//! endpoint concatenates each pool's rendering. Counters live here too: [`BackendStats`] per
//! backend (gone with the backend) and [`PoolStats`] per pool.

use crate::backend::Lifecycle;
use crate::breaker::BreakerState;
use crate::health::HealthState;
use crate::outcome::{Outcome, OutcomeKind, StreamResume};
use crate::policy::{DecisionKind, PolicyKind};
use crate::pool::Pool;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Upper bounds of the latency histograms' buckets, in milliseconds.
pub const LATENCY_BUCKETS_MS: [u64; 12] = [
    25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 120_000,
];

/// A latency histogram with [`LATENCY_BUCKETS_MS`] buckets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Histogram {
    buckets: [u64; LATENCY_BUCKETS_MS.len()],
    count: u64,
    sum_ms: u64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&mut self, ms: u64) {
        if let Some(i) = LATENCY_BUCKETS_MS.iter().position(|&b| ms <= b) {
            self.buckets[i] += 1;
        }
        self.count += 1;
        self.sum_ms = self.sum_ms.saturating_add(ms);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Observations per bucket of [`LATENCY_BUCKETS_MS`] (not cumulative; slower ones are in
    /// `count` only).
    pub fn buckets(&self) -> &[u64; LATENCY_BUCKETS_MS.len()] {
        &self.buckets
    }
}

/// Per-backend counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Lease shares granted on the backend (first choices and reassigned retries).
    pub requests: u64,
    /// Released shares by outcome, indexed by [`OutcomeKind::index`].
    pub outcomes: [u64; 7],
    /// Shares that expired unreleased.
    pub expired: u64,
    /// Time to first byte.
    pub ttfb: Histogram,
    /// Time from grant to release.
    pub duration: Histogram,
    /// Prompt tokens reported by releases.
    pub prompt_tokens: u64,
    /// Of those, prompt tokens the backend served from its prefix cache.
    pub cached_tokens: u64,
    /// Completion tokens reported by releases.
    pub completion_tokens: u64,
    /// Streams that failed after their first byte, by [`StreamResume::index`].
    pub stream_resumes: [u64; StreamResume::LABELS.len()],
}

impl BackendStats {
    /// Counts one released share.
    pub fn record_outcome(&mut self, outcome: &Outcome, duration_ms: u64) {
        self.outcomes[outcome.kind.index()] += 1;
        if let Some(ttfb) = outcome.ttfb_ms {
            self.ttfb.observe(ttfb);
        }
        self.duration.observe(duration_ms);
        self.prompt_tokens += u64::from(outcome.prompt_tokens.unwrap_or(0));
        self.cached_tokens += u64::from(outcome.cached_tokens.unwrap_or(0));
        self.completion_tokens += u64::from(outcome.completion_tokens.unwrap_or(0));
        if let Some(resume) = outcome.resume {
            self.stream_resumes[resume.index(outcome.kind)] += 1;
        }
    }
}

/// Per-pool counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Decisions by policy and kind.
    pub decisions: BTreeMap<(PolicyKind, DecisionKind), u64>,
    /// Failed acquires: `[model_not_found, no_backend]`.
    pub acquire_errors: [u64; 2],
    /// Leases that expired unreleased.
    pub leases_expired: u64,
    /// Releases of leases that were not live (double, late or unknown).
    pub unknown_releases: u64,
    /// Prompt blocks of routed requests.
    pub prompt_blocks: u64,
    /// Of those, blocks the chosen backend probably had cached.
    pub cached_blocks: u64,
}

impl PoolStats {
    /// Counts one decision.
    pub fn record_decision(&mut self, policy: PolicyKind, decision: DecisionKind) {
        *self.decisions.entry((policy, decision)).or_insert(0) += 1;
    }
}

/// Writes `value` as a Prometheus label value (escaping `\`, `"` and newlines).
fn label(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn number(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else {
        let _ = write!(out, "{v}");
    }
}

pub(crate) fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Writes one sample: `name{pool="..",k="v",..} value`.
pub(crate) fn sample(
    out: &mut String,
    name: &str,
    pool: &str,
    labels: &[(&str, &str)],
    value: f64,
) {
    out.push_str(name);
    out.push_str("{pool=\"");
    label(out, pool);
    out.push('"');
    for (k, v) in labels {
        out.push(',');
        out.push_str(k);
        out.push_str("=\"");
        label(out, v);
        out.push('"');
    }
    out.push_str("} ");
    number(out, value);
    out.push('\n');
}

fn histogram(out: &mut String, name: &str, pool: &str, backend: &str, h: &Histogram) {
    let mut cumulative = 0;
    let bucket = format!("{name}_bucket");
    for (i, bound) in LATENCY_BUCKETS_MS.iter().enumerate() {
        cumulative += h.buckets[i];
        let le = format!("{}", *bound as f64 / 1000.0);
        sample(
            out,
            &bucket,
            pool,
            &[("backend", backend), ("le", &le)],
            cumulative as f64,
        );
    }
    sample(
        out,
        &bucket,
        pool,
        &[("backend", backend), ("le", "+Inf")],
        h.count as f64,
    );
    sample(
        out,
        &format!("{name}_sum"),
        pool,
        &[("backend", backend)],
        h.sum_ms as f64 / 1000.0,
    );
    sample(
        out,
        &format!("{name}_count"),
        pool,
        &[("backend", backend)],
        h.count as f64,
    );
}

/// Renders `pool`'s metrics, appending to `out`.
pub fn render(pool: &Pool, out: &mut String) {
    let name = pool.name();
    let entries: Vec<_> = pool.entries().collect();
    let queue_weight = pool.config().queue_weight;
    let per_backend =
        |out: &mut String,
         metric: &str,
         kind: &str,
         help: &str,
         f: &dyn Fn(&mut String, &str, &crate::pool::BackendEntry)| {
            header(out, metric, kind, help);
            for e in &entries {
                f(out, e.spec.id.as_str(), e);
            }
        };

    per_backend(
        out,
        "llm_gateway_requests_total",
        "counter",
        "Requests routed to the backend.",
        &|out, id, e| {
            sample(
                out,
                "llm_gateway_requests_total",
                name,
                &[("backend", id)],
                e.stats.requests as f64,
            )
        },
    );
    per_backend(
        out,
        "llm_gateway_request_outcomes_total",
        "counter",
        "Released requests by outcome.",
        &|out, id, e| {
            for kind in OutcomeKind::ALL {
                let v = e.stats.outcomes[kind.index()] as f64;
                sample(
                    out,
                    "llm_gateway_request_outcomes_total",
                    name,
                    &[("backend", id), ("outcome", kind.as_str())],
                    v,
                );
            }
        },
    );
    per_backend(
        out,
        "llm_gateway_stream_resumes_total",
        "counter",
        "Streams that failed after their first byte: continuations served by the backend (by outcome), or failures on it not resumed.",
        &|out, id, e| {
            for (i, label) in StreamResume::LABELS.iter().enumerate() {
                sample(
                    out,
                    "llm_gateway_stream_resumes_total",
                    name,
                    &[("backend", id), ("outcome", label)],
                    e.stats.stream_resumes[i] as f64,
                );
            }
        },
    );
    per_backend(
        out,
        "llm_gateway_leases_expired_by_backend_total",
        "counter",
        "Leases on the backend that expired unreleased.",
        &|out, id, e| {
            sample(
                out,
                "llm_gateway_leases_expired_by_backend_total",
                name,
                &[("backend", id)],
                e.stats.expired as f64,
            )
        },
    );
    per_backend(
        out,
        "llm_gateway_tokens_total",
        "counter",
        "Tokens the backend reported in usage, by kind: prompt (cached included), cached, completion.",
        &|out, id, e| {
            sample(
                out,
                "llm_gateway_tokens_total",
                name,
                &[("backend", id), ("kind", "prompt")],
                e.stats.prompt_tokens as f64,
            );
            sample(
                out,
                "llm_gateway_tokens_total",
                name,
                &[("backend", id), ("kind", "cached")],
                e.stats.cached_tokens as f64,
            );
            sample(
                out,
                "llm_gateway_tokens_total",
                name,
                &[("backend", id), ("kind", "completion")],
                e.stats.completion_tokens as f64,
            );
        },
    );
    per_backend(
        out,
        "llm_gateway_leases_in_flight",
        "gauge",
        "Live leases on the backend.",
        &|out, id, e| {
            sample(
                out,
                "llm_gateway_leases_in_flight",
                name,
                &[("backend", id)],
                f64::from(e.in_flight.leases),
            )
        },
    );
    per_backend(
        out,
        "llm_gateway_inflight_tokens",
        "gauge",
        "Tokens of live leases: uncached prompt and expected output.",
        &|out, id, e| {
            sample(
                out,
                "llm_gateway_inflight_tokens",
                name,
                &[("backend", id), ("kind", "prompt")],
                e.in_flight.prompt_tokens as f64,
            );
            sample(
                out,
                "llm_gateway_inflight_tokens",
                name,
                &[("backend", id), ("kind", "output")],
                e.in_flight.output_tokens as f64,
            );
        },
    );
    per_backend(
        out,
        "llm_gateway_backend_load",
        "gauge",
        "Load by the cost model, a fraction of KV capacity.",
        &|out, id, e| {
            sample(
                out,
                "llm_gateway_backend_load",
                name,
                &[("backend", id)],
                e.load(queue_weight, 0.0),
            )
        },
    );
    per_backend(
        out,
        "llm_gateway_backend_healthy",
        "gauge",
        "1 if the backend passes its health probes.",
        &|out, id, e| {
            sample(
                out,
                "llm_gateway_backend_healthy",
                name,
                &[("backend", id)],
                f64::from(u8::from(e.health.is_serving())),
            )
        },
    );
    per_backend(
        out,
        "llm_gateway_backend_health_state",
        "gauge",
        "1 for the backend's current health state.",
        &|out, id, e| {
            for s in [
                HealthState::Unknown,
                HealthState::Healthy,
                HealthState::Unhealthy,
                HealthState::Loading,
            ] {
                let v = f64::from(u8::from(e.health.state == s));
                sample(
                    out,
                    "llm_gateway_backend_health_state",
                    name,
                    &[("backend", id), ("state", s.as_str())],
                    v,
                );
            }
        },
    );
    per_backend(
        out,
        "llm_gateway_health_transitions_total",
        "counter",
        "Health state changes.",
        &|out, id, e| {
            sample(
                out,
                "llm_gateway_health_transitions_total",
                name,
                &[("backend", id)],
                e.health.transitions as f64,
            )
        },
    );
    per_backend(
        out,
        "llm_gateway_backend_lifecycle",
        "gauge",
        "1 for the backend's current lifecycle state.",
        &|out, id, e| {
            for l in Lifecycle::ALL {
                let v = f64::from(u8::from(e.lifecycle == l));
                sample(
                    out,
                    "llm_gateway_backend_lifecycle",
                    name,
                    &[("backend", id), ("lifecycle", l.as_str())],
                    v,
                );
            }
        },
    );
    per_backend(
        out,
        "llm_gateway_breaker_state",
        "gauge",
        "1 for the breaker's current state.",
        &|out, id, e| {
            for s in BreakerState::ALL {
                let v = f64::from(u8::from(e.breaker.state() == s));
                sample(
                    out,
                    "llm_gateway_breaker_state",
                    name,
                    &[("backend", id), ("state", s.as_str())],
                    v,
                );
            }
        },
    );
    per_backend(
        out,
        "llm_gateway_breaker_transitions_total",
        "counter",
        "Breaker transitions by target state.",
        &|out, id, e| {
            let t = e.breaker.transitions();
            for (i, s) in BreakerState::ALL.iter().enumerate() {
                sample(
                    out,
                    "llm_gateway_breaker_transitions_total",
                    name,
                    &[("backend", id), ("to", s.as_str())],
                    t[i] as f64,
                );
            }
        },
    );
    per_backend(
        out,
        "llm_gateway_backend_scraped",
        "gauge",
        "Gauges scraped from the backend's /metrics.",
        &|out, id, e| {
            for (gauge, v) in [
                ("waiting", e.scraped.waiting),
                ("running", e.scraped.running),
                ("kv_usage", e.scraped.kv_usage),
            ] {
                if let Some(v) = v {
                    sample(
                        out,
                        "llm_gateway_backend_scraped",
                        name,
                        &[("backend", id), ("gauge", gauge)],
                        v,
                    );
                }
            }
        },
    );
    per_backend(
        out,
        "llm_gateway_affinity_backend_entries",
        "gauge",
        "Prefix-affinity entries held for the backend.",
        &|out, id, e| {
            let v = pool.affinity().backend_len(e.key.slot) as f64;
            sample(
                out,
                "llm_gateway_affinity_backend_entries",
                name,
                &[("backend", id)],
                v,
            );
        },
    );
    per_backend(
        out,
        "llm_gateway_ttfb_seconds",
        "histogram",
        "Time to first byte.",
        &|out, id, e| histogram(out, "llm_gateway_ttfb_seconds", name, id, &e.stats.ttfb),
    );
    per_backend(
        out,
        "llm_gateway_request_duration_seconds",
        "histogram",
        "Time from grant to release.",
        &|out, id, e| {
            histogram(
                out,
                "llm_gateway_request_duration_seconds",
                name,
                id,
                &e.stats.duration,
            )
        },
    );

    let stats = &pool.stats;
    header(
        out,
        "llm_gateway_decisions_total",
        "counter",
        "Routing decisions by policy and kind.",
    );
    for ((policy, decision), count) in &stats.decisions {
        sample(
            out,
            "llm_gateway_decisions_total",
            name,
            &[("policy", policy.as_str()), ("decision", decision.as_str())],
            *count as f64,
        );
    }
    header(
        out,
        "llm_gateway_acquire_errors_total",
        "counter",
        "Requests that got no backend, by reason.",
    );
    sample(
        out,
        "llm_gateway_acquire_errors_total",
        name,
        &[("reason", "model_not_found")],
        stats.acquire_errors[0] as f64,
    );
    sample(
        out,
        "llm_gateway_acquire_errors_total",
        name,
        &[("reason", "no_backend")],
        stats.acquire_errors[1] as f64,
    );
    let pool_gauges: [(&str, &str, &str, f64); 10] = [
        (
            "llm_gateway_backends",
            "gauge",
            "Registered backends.",
            entries.len() as f64,
        ),
        (
            "llm_gateway_leases_live",
            "gauge",
            "Live leases, including those on removed backends.",
            pool.live_leases() as f64,
        ),
        (
            "llm_gateway_leases_expired_total",
            "counter",
            "Leases that expired unreleased.",
            stats.leases_expired as f64,
        ),
        (
            "llm_gateway_lease_unknown_releases_total",
            "counter",
            "Releases of leases that were not live.",
            stats.unknown_releases as f64,
        ),
        (
            "llm_gateway_affinity_entries",
            "gauge",
            "Prefix-affinity entries.",
            pool.affinity().len() as f64,
        ),
        (
            "llm_gateway_affinity_max_entries",
            "gauge",
            "Bound on prefix-affinity entries.",
            pool.affinity().max_entries() as f64,
        ),
        (
            "llm_gateway_affinity_evictions_total",
            "counter",
            "Prefix-affinity entries evicted or purged.",
            pool.affinity().evictions() as f64,
        ),
        (
            "llm_gateway_affinity_memory_bytes",
            "gauge",
            "Heap bytes of the prefix-affinity table.",
            pool.affinity().memory_bytes() as f64,
        ),
        (
            "llm_gateway_prefix_blocks_total",
            "counter",
            "Prompt prefix blocks of routed requests.",
            stats.prompt_blocks as f64,
        ),
        (
            "llm_gateway_prefix_cached_blocks_total",
            "counter",
            "Prompt prefix blocks probably cached on the chosen backend.",
            stats.cached_blocks as f64,
        ),
    ];
    for (metric, kind, help, v) in pool_gauges {
        header(out, metric, kind, help);
        sample(out, metric, name, &[], v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendSpec;
    use crate::pool::{PoolConfig, ProbeResult};
    use crate::prompt::RequestFeatures;
    use crate::random::SplitMix64;

    #[test]
    fn histogram_buckets() {
        let mut h = Histogram::default();
        h.observe(10);
        h.observe(30);
        h.observe(1_000_000);
        assert_eq!(h.buckets[0], 1);
        assert_eq!(h.buckets[1], 1);
        assert_eq!(h.count(), 3);
    }

    #[test]
    fn renders_every_family_with_prefix_and_escaped_labels() {
        let mut pool = Pool::new("eu\"1", PoolConfig::default());
        let id = pool
            .add_backend(
                BackendSpec {
                    id: "gpu\\a".into(),
                    url: "http://secret-host:8000".into(),
                    models: vec!["m".into()],
                    api_key: Some("sk-secret".into()),
                    ..BackendSpec::default()
                },
                0,
            )
            .unwrap();
        pool.record_probe(
            &id,
            &ProbeResult {
                ok: true,
                waiting: Some(2.0),
                ..ProbeResult::default()
            },
            0,
        )
        .unwrap();
        let f = RequestFeatures {
            model: "m".into(),
            prompt_tokens: 10,
            max_tokens: 5,
            ..RequestFeatures::default()
        };
        let g = pool.acquire(&f, 0, &mut SplitMix64::new(0)).unwrap();
        pool.release(
            g.lease_id,
            &Outcome {
                ttfb_ms: Some(120),
                prompt_tokens: Some(10),
                cached_tokens: Some(4),
                completion_tokens: Some(5),
                ..Outcome::from_status(200)
            },
            500,
        );
        let mut out = String::new();
        pool.render_metrics(&mut out);
        assert!(!out.contains("secret"), "no URL or key in metrics");
        for line in out.lines() {
            assert!(
                line.starts_with("# HELP llm_gateway_")
                    || line.starts_with("# TYPE llm_gateway_")
                    || line.starts_with("llm_gateway_"),
                "{line}"
            );
        }
        assert!(out.contains(r#"llm_gateway_requests_total{pool="eu\"1",backend="gpu\\a"} 1"#));
        for (kind, n) in [("prompt", 10), ("cached", 4), ("completion", 5)] {
            let line = format!(
                r#"llm_gateway_tokens_total{{pool="eu\"1",backend="gpu\\a",kind="{kind}"}} {n}"#
            );
            assert!(out.contains(&line), "{line}");
        }
        assert!(out.contains(r#"llm_gateway_request_outcomes_total{pool="eu\"1",backend="gpu\\a",outcome="success"} 1"#));
        assert!(out.contains(
            r#"llm_gateway_ttfb_seconds_bucket{pool="eu\"1",backend="gpu\\a",le="0.25"} 1"#
        ));
        assert!(out.contains(r#"llm_gateway_decisions_total{pool="eu\"1",policy="predicted_latency",decision="cache_miss"} 1"#));
        assert!(out.contains(
            r#"llm_gateway_breaker_state{pool="eu\"1",backend="gpu\\a",state="closed"} 1"#
        ));
        assert!(out.contains(r#"gauge="waiting"} 2"#));
        assert!(out.contains("llm_gateway_affinity_entries{pool="));
        let types = out.lines().filter(|l| l.starts_with("# TYPE")).count();
        let helps = out.lines().filter(|l| l.starts_with("# HELP")).count();
        assert_eq!(types, helps);
    }
}
