//! The pool coordinator's own metric families (retries, spills, the load summary, probes), beside
//! the pool's ([`crate::metrics`]) and the queue's, written with the crate's one Prometheus writer
//! (so label values are escaped the same way everywhere).

use super::load::PoolLoad;
use crate::metrics::{header, sample};

/// The coordinator's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CoordinatorCounters {
    /// Leases moved to the next candidate after a failure.
    pub retries: u64,
    /// Retries the retry budget refused.
    pub retry_budget_exhausted: u64,
    /// Acquires refused so that a further pool takes them.
    pub spills: u64,
    /// Probe rounds run.
    pub probe_rounds: u64,
    /// Probes that succeeded.
    pub probes_ok: u64,
    /// Probes that failed.
    pub probes_failed: u64,
}

/// One backend's last probe.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LastProbe<'a> {
    /// The backend's id.
    pub backend: &'a str,
    /// Whether it succeeded.
    pub ok: bool,
    /// How long it took.
    pub duration_ms: u64,
    /// When it ran (ms since the epoch).
    pub at_ms: u64,
}

/// Renders the coordinator's families for `pool`. `probes` should be sorted by backend.
pub fn render(
    out: &mut String,
    pool: &str,
    counters: &CoordinatorCounters,
    load: &PoolLoad,
    autoscale_target_waiting: f64,
    probes: &[LastProbe<'_>],
) {
    let mut one = |name: &str, kind: &str, help: &str, value: f64| {
        header(out, name, kind, help);
        sample(out, name, pool, &[], value);
    };
    one(
        "llm_gateway_retries_total",
        "counter",
        "Leases moved to the next candidate after a failure before the first byte.",
        counters.retries as f64,
    );
    one(
        "llm_gateway_retry_budget_exhausted_total",
        "counter",
        "Retries refused by the pool's retry budget.",
        counters.retry_budget_exhausted as f64,
    );
    one(
        "llm_gateway_pool_spills_total",
        "counter",
        "Requests refused because the pool was saturated and a further pool could take them.",
        counters.spills as f64,
    );
    one(
        "llm_gateway_pool_ready_backends",
        "gauge",
        "Backends ready and healthy.",
        load.ready as f64,
    );
    one(
        "llm_gateway_pool_waiting",
        "gauge",
        "Requests waiting in the backends' queues (scraped), summed.",
        load.waiting,
    );
    one(
        "llm_gateway_pool_running",
        "gauge",
        "Requests running on the backends (scraped), summed.",
        load.running,
    );
    one(
        "llm_gateway_pool_desired_replicas",
        "gauge",
        "Replicas an autoscaler should aim for at the configured waiting-per-replica target.",
        load.desired_replicas as f64,
    );
    one(
        "llm_gateway_pool_autoscale_target_waiting",
        "gauge",
        "The waiting-per-replica target of the autoscaling signal.",
        autoscale_target_waiting,
    );
    one(
        "llm_gateway_probe_rounds_total",
        "counter",
        "Probe rounds run by the pool's alarm.",
        counters.probe_rounds as f64,
    );
    let name = "llm_gateway_probes_total";
    header(out, name, "counter", "Backend probes by result.");
    sample(
        out,
        name,
        pool,
        &[("result", "ok")],
        counters.probes_ok as f64,
    );
    sample(
        out,
        name,
        pool,
        &[("result", "failed")],
        counters.probes_failed as f64,
    );
    let per_backend = |out: &mut String, name: &str, help: &str, f: &dyn Fn(&LastProbe) -> f64| {
        header(out, name, "gauge", help);
        for p in probes {
            sample(out, name, pool, &[("backend", p.backend)], f(p));
        }
    };
    per_backend(
        out,
        "llm_gateway_probe_success",
        "Whether the backend's last probe succeeded.",
        &|p| if p.ok { 1.0 } else { 0.0 },
    );
    per_backend(
        out,
        "llm_gateway_probe_duration_seconds",
        "Duration of the backend's last probe.",
        &|p| p.duration_ms as f64 / 1000.0,
    );
    per_backend(
        out,
        "llm_gateway_probe_timestamp_seconds",
        "When the backend's last probe ran (Unix time).",
        &|p| p.at_ms as f64 / 1000.0,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_with_escaped_labels() {
        let mut out = String::new();
        let counters = CoordinatorCounters {
            retries: 3,
            probes_ok: 5,
            probes_failed: 1,
            ..CoordinatorCounters::default()
        };
        let load = PoolLoad {
            ready: 2,
            desired_replicas: 2,
            ..PoolLoad::default()
        };
        let probes = [LastProbe {
            backend: "b-1",
            ok: true,
            duration_ms: 1500,
            at_ms: 2000,
        }];
        render(&mut out, "eu\"west", &counters, &load, 4.0, &probes);
        assert!(out.contains("# TYPE llm_gateway_retries_total counter\n"));
        assert!(
            out.contains("llm_gateway_retries_total{pool=\"eu\\\"west\"} 3\n"),
            "{out}"
        );
        assert!(out.contains("llm_gateway_probes_total{pool=\"eu\\\"west\",result=\"failed\"} 1\n"));
        assert!(out.contains(
            "llm_gateway_probe_duration_seconds{pool=\"eu\\\"west\",backend=\"b-1\"} 1.5\n"
        ));
        assert!(out.contains("llm_gateway_pool_desired_replicas{pool=\"eu\\\"west\"} 2\n"));
        assert_eq!(out.matches("# HELP").count(), 13);
    }
}
