//! The pool's metrics in the Prometheus text format: two tables of families, one written per
//! backend from its [`BackendReport`], one for the pool as a whole from [`Pool`] and its
//! [`PoolStats`](super::PoolStats), both by [`crate::metrics::write`].

use super::{BackendReport, Pool};
use crate::backend::breaker::BreakerState;
use crate::backend::health::HealthState;
use crate::backend::Lifecycle;
use crate::metrics::{write, Family, Kind, Samples};
use crate::stream::outcome::{OutcomeKind, StreamResume};

impl Pool {
    /// Renders the pool's metrics in the Prometheus text format, appending to `out`.
    pub fn render_metrics(&self, out: &mut String) {
        let reports: Vec<_> = self.backend_reports().collect();
        write(out, self.name(), &backend_families(), &reports);
        write(out, self.name(), &POOL_FAMILIES, std::slice::from_ref(self));
    }
}

/// A backend's own sample of a family: `{backend="id"}`.
fn one(s: &mut Samples<'_>, e: &BackendReport<'_>, value: f64) {
    s.value(&[("backend", e.view.id.as_str())], value);
}

/// A backend's samples of a family labelled `key`: one per `(label value, value)`.
fn each<'v>(
    s: &mut Samples<'_>,
    e: &BackendReport<'_>,
    key: &str,
    values: impl IntoIterator<Item = (&'v str, f64)>,
) {
    s.each(&[("backend", e.view.id.as_str())], key, values);
}

/// A backend's counts of a family labelled `key`: the count `values[i]` with `labels[i]`.
fn counts(s: &mut Samples<'_>, e: &BackendReport<'_>, key: &str, labels: &[&str], values: &[u64]) {
    each(
        s,
        e,
        key,
        labels.iter().zip(values).map(|(&l, &n)| (l, n as f64)),
    );
}

/// 1 for what is, 0 for the rest.
fn is(yes: bool) -> f64 {
    f64::from(u8::from(yes))
}

/// A backend's samples of a state family labelled `key`: 1 for `now`, 0 for the other `states`.
fn state<T: Copy + PartialEq>(
    s: &mut Samples<'_>,
    e: &BackendReport<'_>,
    key: &str,
    (states, now, name): (&[T], T, fn(T) -> &'static str),
) {
    each(s, e, key, states.iter().map(|&t| (name(t), is(t == now))));
}

/// Health states in the order `llm_gateway_backend_health_state` lists them.
const HEALTH_STATES: [HealthState; 4] = [
    HealthState::Unknown,
    HealthState::Healthy,
    HealthState::Unhealthy,
    HealthState::Loading,
];

/// The families with a series per backend, in page order.
fn backend_families<'r>() -> [Family<BackendReport<'r>>; 22] {
    [
        Kind::Counter.family(
            "llm_gateway_requests_total",
            "Requests routed to the backend.",
            |e, s| one(s, e, e.stats.requests as f64),
        ),
        Kind::Counter.family(
            "llm_gateway_request_outcomes_total",
            "Released requests by outcome.",
            |e, s| {
                let outcomes = OutcomeKind::ALL.map(|k| (k.as_str(), e.stats.outcomes[k.index()]));
                each(s, e, "outcome", outcomes.map(|(k, n)| (k, n as f64)))
            },
        ),
        Kind::Counter.family(
            "llm_gateway_backend_shed_total",
            "Requests the backend shed with vLLM's 503 load shedding (load, not failure: the next backend was tried).",
            |e, s| one(s, e, e.stats.shed as f64),
        ),
        Kind::Gauge.family(
            "llm_gateway_backend_load_unknown",
            "1 when the backend's last scrape reported no load (no vllm:* series, e.g. --disable-log-stats): it is priced as the most loaded known backend.",
            |e, s| one(s, e, f64::from(u8::from(e.view.load_unknown))),
        ),
        Kind::Counter.family(
            "llm_gateway_stream_resumes_total",
            "Streams that failed after their first byte: continuations served by the backend (by outcome), or failures on it not resumed.",
            |e, s| {
                let resumes = &e.stats.stream_resumes;
                counts(s, e, "outcome", &StreamResume::LABELS, resumes)
            },
        ),
        Kind::Counter.family(
            "llm_gateway_leases_expired_by_backend_total",
            "Leases on the backend that expired unreleased.",
            |e, s| one(s, e, e.stats.expired as f64),
        ),
        Kind::Counter.family(
            "llm_gateway_tokens_total",
            "Tokens the backend reported in usage, by kind: prompt (cached included), cached, completion.",
            |e, s| {
                let t = e.stats;
                let tokens = [t.prompt_tokens, t.cached_tokens, t.completion_tokens];
                counts(s, e, "kind", &["prompt", "cached", "completion"], &tokens)
            },
        ),
        Kind::Gauge.family(
            "llm_gateway_leases_in_flight",
            "Live leases on the backend.",
            |e, s| one(s, e, f64::from(e.view.leases_in_flight)),
        ),
        Kind::Gauge.family(
            "llm_gateway_inflight_tokens",
            "Tokens of live leases: uncached prompt and expected output.",
            |e, s| {
                let v = &e.view;
                let tokens = [v.inflight_prompt_tokens, v.inflight_output_tokens];
                counts(s, e, "kind", &["prompt", "output"], &tokens)
            },
        ),
        Kind::Gauge.family(
            "llm_gateway_backend_load",
            "Load by the cost model, a fraction of KV capacity.",
            |e, s| one(s, e, e.reported_load),
        ),
        Kind::Gauge.family(
            "llm_gateway_backend_healthy",
            "1 if the backend passes its health probes.",
            |e, s| one(s, e, is(e.view.health == HealthState::Healthy)),
        ),
        Kind::Gauge.family(
            "llm_gateway_backend_health_state",
            "1 for the backend's current health state.",
            |e, s| state(s, e, "state", (&HEALTH_STATES, e.view.health, HealthState::as_str)),
        ),
        Kind::Counter.family(
            "llm_gateway_health_transitions_total",
            "Health state changes.",
            |e, s| one(s, e, e.health_transitions as f64),
        ),
        Kind::Gauge.family(
            "llm_gateway_backend_lifecycle",
            "1 for the backend's current lifecycle state.",
            |e, s| state(s, e, "lifecycle", (&Lifecycle::ALL, e.view.lifecycle, Lifecycle::as_str)),
        ),
        Kind::Gauge.family(
            "llm_gateway_breaker_state",
            "1 for the breaker's current state.",
            |e, s| state(s, e, "state", (&BreakerState::ALL, e.view.breaker, BreakerState::as_str)),
        ),
        Kind::Counter.family(
            "llm_gateway_breaker_transitions_total",
            "Breaker transitions by target state.",
            |e, s| {
                let to = BreakerState::ALL.iter().zip(e.breaker_transitions);
                each(s, e, "to", to.map(|(b, n)| (b.as_str(), n as f64)))
            },
        ),
        Kind::Gauge.family(
            "llm_gateway_backend_scraped",
            "Gauges scraped from the backend's /metrics.",
            |e, s| {
                let g = &e.view.scraped;
                let gauges = [
                    ("waiting", g.waiting),
                    ("running", g.running),
                    ("kv_usage", g.kv_usage),
                ];
                each(s, e, "gauge", gauges.into_iter().filter_map(|(k, v)| Some((k, v?))))
            },
        ),
        Kind::Gauge.family(
            "llm_gateway_affinity_backend_entries",
            "Prefix-affinity entries held for the backend.",
            |e, s| one(s, e, e.view.affinity_blocks as f64),
        ),
        Kind::Histogram.family(
            "llm_gateway_ttfb_seconds",
            "Time to first byte.",
            |e, s| s.histogram(&[("backend", e.view.id.as_str())], &e.stats.ttfb),
        ),
        Kind::Histogram.family(
            "llm_gateway_request_duration_seconds",
            "Time from grant to release.",
            |e, s| s.histogram(&[("backend", e.view.id.as_str())], &e.stats.duration),
        ),
        Kind::Histogram.family(
            "llm_gateway_ttft_prediction_error_seconds",
            "How far a successful request's first byte came from the time to first token predicted when its backend was chosen, either way.",
            |e, s| s.histogram(&[("backend", e.view.id.as_str())], &e.stats.prediction_error),
        ),
        Kind::Counter.family(
            "llm_gateway_ttft_predicted_late_total",
            "Successful requests whose first byte came later than predicted.",
            |e, s| one(s, e, e.stats.predicted_late as f64),
        ),
    ]
}

/// The pool's families, after the backends', in page order.
const POOL_FAMILIES: [Family<Pool>; 14] = [
    Kind::Counter.family(
        "llm_gateway_decisions_total",
        "Routing decisions by policy and kind.",
        |p, s| {
            for ((policy, decision), n) in &p.stats().decisions {
                let labels = [("policy", policy.as_str()), ("decision", decision.as_str())];
                s.value(&labels, *n as f64);
            }
        },
    ),
    Kind::Counter.family(
        "llm_gateway_acquire_errors_total",
        "Requests that got no backend, by reason.",
        |p, s| {
            let [not_found, no_backend] = p.stats().acquire_errors;
            let reasons = [("model_not_found", not_found), ("no_backend", no_backend)];
            s.each(&[], "reason", reasons.map(|(r, n)| (r, n as f64)))
        },
    ),
    Kind::Gauge.family("llm_gateway_backends", "Registered backends.", |p, s| {
        s.value(&[], p.backend_count() as f64)
    }),
    Kind::Gauge.family(
        "llm_gateway_stored_responses",
        "Stored Responses API responses whose backend the pool recorded.",
        |p, s| s.value(&[], p.recorded_responses() as f64),
    ),
    Kind::Gauge.family(
        "llm_gateway_leases_live",
        "Live leases, including those on removed backends.",
        |p, s| s.value(&[], p.live_leases() as f64),
    ),
    Kind::Counter.family(
        "llm_gateway_leases_expired_total",
        "Leases that expired unreleased.",
        |p, s| s.value(&[], p.stats().leases_expired as f64),
    ),
    Kind::Counter.family(
        "llm_gateway_lease_unknown_releases_total",
        "Releases of leases that were not live.",
        |p, s| s.value(&[], p.stats().unknown_releases as f64),
    ),
    Kind::Gauge.family(
        "llm_gateway_affinity_entries",
        "Prefix-affinity entries.",
        |p, s| s.value(&[], p.affinity().len() as f64),
    ),
    Kind::Gauge.family(
        "llm_gateway_affinity_max_entries",
        "Bound on prefix-affinity entries.",
        |p, s| s.value(&[], p.affinity().max_entries() as f64),
    ),
    Kind::Counter.family(
        "llm_gateway_affinity_evictions_total",
        "Prefix-affinity entries evicted or purged.",
        |p, s| s.value(&[], p.affinity().evictions() as f64),
    ),
    Kind::Gauge.family(
        "llm_gateway_affinity_memory_bytes",
        "Heap bytes of the prefix-affinity table.",
        |p, s| s.value(&[], p.affinity().memory_bytes() as f64),
    ),
    Kind::Counter.family(
        "llm_gateway_prefix_blocks_total",
        "Prompt prefix blocks of routed requests.",
        |p, s| s.value(&[], p.stats().prompt_blocks as f64),
    ),
    Kind::Counter.family(
        "llm_gateway_prefix_cached_blocks_total",
        "Prompt prefix blocks probably cached on the chosen backend.",
        |p, s| s.value(&[], p.stats().cached_blocks as f64),
    ),
    Kind::Gauge.family(
        "llm_gateway_e2e_tail_seconds",
        "The learned tail (predicted_latency.tail_quantile) of successful streamed requests' times from grant to release.",
        |p, s| {
            if let Some(ms) = p.e2e_tail_ms() {
                s.value(&[], ms / 1000.0)
            }
        },
    ),
];

#[cfg(test)]
mod tests {
    use crate::backend::scrape::{ScrapedGauges, VllmMetrics};
    use crate::backend::BackendSpec;
    use crate::pool::{Pool, PoolConfig, ProbeResult};
    use crate::random::SplitMix64;
    use crate::request::prompt::RequestFeatures;
    use crate::stream::outcome::Outcome;

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

    /// The learned e2e tail appears once 20 streamed requests have taught it, in seconds.
    #[test]
    fn the_e2e_tail_shows_once_learned() {
        let mut pool = Pool::new("p", PoolConfig::default());
        let id = pool
            .add_backend(
                BackendSpec {
                    id: "b".into(),
                    url: "http://b:8000".into(),
                    models: vec!["m".into()],
                    ..BackendSpec::default()
                },
                0,
            )
            .unwrap();
        let up = ProbeResult {
            ok: true,
            ..ProbeResult::default()
        };
        pool.record_probe(&id, &up, 0).unwrap();
        let mut rng = SplitMix64::new(1);
        let page = |pool: &Pool| {
            let mut out = String::new();
            pool.render_metrics(&mut out);
            out
        };
        let features = RequestFeatures {
            model: "m".into(),
            prompt_tokens: 10,
            max_tokens: 5,
            stream: true,
            ..RequestFeatures::default()
        };
        for i in 0..20u64 {
            let g = pool.acquire(&features, i * 3_000, &mut rng).unwrap();
            assert!(!page(&pool).contains("llm_gateway_e2e_tail_seconds{"));
            pool.release(g.lease_id, &Outcome::from_status(200), i * 3_000 + 2_000);
        }
        assert!(page(&pool).contains(r#"llm_gateway_e2e_tail_seconds{pool="p"} 2"#));
    }
}
