//! The pool's metrics in the Prometheus text format, written with [`crate::metrics`]'s writer
//! from the pool's [`BackendReport`]s and [`PoolStats`](super::PoolStats).

use super::{BackendReport, Pool};
use crate::backend::Lifecycle;
use crate::breaker::BreakerState;
use crate::health::HealthState;
use crate::metrics::{header, histogram, sample};
use crate::outcome::{OutcomeKind, StreamResume};

impl Pool {
    /// Renders the pool's metrics in the Prometheus text format, appending to `out`.
    pub fn render_metrics(&self, out: &mut String) {
        let pool = self;
        let name = pool.name();
        let entries: Vec<_> = pool.backend_reports().collect();
        let per_backend =
            |out: &mut String,
             metric: &str,
             kind: &str,
             help: &str,
             f: &dyn Fn(&mut String, &str, &BackendReport<'_>)| {
                header(out, metric, kind, help);
                for e in &entries {
                    f(out, e.view.id.as_str(), e);
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
                    f64::from(e.view.leases_in_flight),
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
                    e.view.inflight_prompt_tokens as f64,
                );
                sample(
                    out,
                    "llm_gateway_inflight_tokens",
                    name,
                    &[("backend", id), ("kind", "output")],
                    e.view.inflight_output_tokens as f64,
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
                    e.reported_load,
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
                    f64::from(u8::from(e.view.health == HealthState::Healthy)),
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
                    let v = f64::from(u8::from(e.view.health == s));
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
                    e.health_transitions as f64,
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
                    let v = f64::from(u8::from(e.view.lifecycle == l));
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
                    let v = f64::from(u8::from(e.view.breaker == s));
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
                let t = e.breaker_transitions;
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
                    ("waiting", e.view.scraped.waiting),
                    ("running", e.view.scraped.running),
                    ("kv_usage", e.view.scraped.kv_usage),
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
                let v = e.view.affinity_blocks as f64;
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

        let stats = pool.stats();
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
}

#[cfg(test)]
mod tests {
    use crate::backend::BackendSpec;
    use crate::outcome::Outcome;
    use crate::pool::{Pool, PoolConfig, ProbeResult};
    use crate::prompt::RequestFeatures;
    use crate::random::SplitMix64;
    use crate::scrape::{ScrapedGauges, VllmMetrics};

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
                metrics: VllmMetrics {
                    gauges: ScrapedGauges {
                        waiting: Some(2.0),
                        ..ScrapedGauges::default()
                    },
                    ..VllmMetrics::default()
                },
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
