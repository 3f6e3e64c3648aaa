//! The pool coordinator's own metric families (retries, spills, the load summary, probes), beside
//! the pool's and the queue's: two tables written with the crate's one Prometheus writer
//! ([`crate::metrics::write`], so label values are escaped the same way everywhere).

use super::load::PoolLoad;
use crate::metrics::{write, Family, Kind};

/// The coordinator's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CoordinatorCounters {
    /// Leases moved to the next candidate after a failure.
    pub retries: u64,
    /// Retries the retry budget refused.
    pub retry_budget_exhausted: u64,
    /// Acquires refused so that a further pool takes them.
    pub spills: u64,
    /// Backends scraped outside the probe round because lease evidence showed their model wrong.
    pub evidence_scrapes: u64,
    /// Lease renewals received: `[other, overdue]` (the stream said it had no first token by its
    /// due time: lease evidence's early renewal).
    pub renewals: [u64; 2],
    /// Probe rounds run.
    pub probe_rounds: u64,
    /// Probes that succeeded.
    pub probes_ok: u64,
    /// Probes that failed.
    pub probes_failed: u64,
    /// Acquires whose fetch the Worker had sent ahead (`ROUTE_AHEAD`), by what became of it.
    pub sent_ahead: SentAheadCounts,
}

/// Acquires that came with a fetch sent ahead, by what became of it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SentAheadCounts {
    /// Granted at once on the backend it went to: the Worker keeps it.
    pub kept: u64,
    /// Granted at once on another backend: the Worker aborts it.
    pub missed: u64,
    /// Parked in the waiting room, refused or spilled: the Worker aborts it.
    pub not_granted: u64,
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
    let figures = Figures {
        counters: *counters,
        load: *load,
        autoscale_target_waiting,
    };
    write(out, pool, &POOL_FAMILIES, &[figures]);
    write(out, pool, &probe_families(), probes);
}

/// What the pool-wide families read.
struct Figures {
    counters: CoordinatorCounters,
    load: PoolLoad,
    autoscale_target_waiting: f64,
}

/// The pool-wide families, in page order.
const POOL_FAMILIES: [Family<Figures>; 13] = [
    Kind::Counter.family(
        "llm_gateway_retries_total",
        "Leases moved to the next candidate after a failure before the first byte.",
        |f, s| s.total(f.counters.retries),
    ),
    Kind::Counter.family(
        "llm_gateway_retry_budget_exhausted_total",
        "Retries refused by the pool's retry budget.",
        |f, s| s.total(f.counters.retry_budget_exhausted),
    ),
    Kind::Counter.family(
        "llm_gateway_pool_spills_total",
        "Requests refused because the pool was saturated and a further pool could take them.",
        |f, s| s.total(f.counters.spills),
    ),
    Kind::Counter.family(
        "llm_gateway_evidence_scrapes_total",
        "Backends scraped outside the probe round because overdue streams showed their model wrong.",
        |f, s| s.total(f.counters.evidence_scrapes),
    ),
    Kind::Counter.family(
        "llm_gateway_lease_renewals_total",
        "Lease renewals the pool received; overdue=\"true\": a stream with no first token by its due time said so early (lease evidence).",
        |f, s| {
            let [other, overdue] = f.counters.renewals;
            s.each(&[], "overdue", [("false", other as f64), ("true", overdue as f64)])
        },
    ),
    Kind::Gauge.family(
        "llm_gateway_pool_ready_backends",
        "Backends ready and healthy.",
        |f, s| s.value(&[], f.load.ready as f64),
    ),
    Kind::Gauge.family(
        "llm_gateway_pool_waiting",
        "Requests waiting in the backends' queues (scraped), summed.",
        |f, s| s.value(&[], f.load.waiting),
    ),
    Kind::Gauge.family(
        "llm_gateway_pool_running",
        "Requests running on the backends (scraped), summed.",
        |f, s| s.value(&[], f.load.running),
    ),
    Kind::Gauge.family(
        "llm_gateway_pool_desired_replicas",
        "Replicas an autoscaler should aim for at the configured waiting-per-replica target.",
        |f, s| s.total(f.load.desired_replicas),
    ),
    Kind::Gauge.family(
        "llm_gateway_pool_autoscale_target_waiting",
        "The waiting-per-replica target of the autoscaling signal.",
        |f, s| s.value(&[], f.autoscale_target_waiting),
    ),
    Kind::Counter.family(
        "llm_gateway_pool_sent_ahead_total",
        "Acquires whose backend fetch the Worker sent ahead of them (ROUTE_AHEAD): kept (granted on that backend), missed (granted on another) or not_granted (queued, refused or spilled); the Worker aborts all but the kept.",
        |f, s| {
            let a = f.counters.sent_ahead;
            let results = [
                ("kept", a.kept),
                ("missed", a.missed),
                ("not_granted", a.not_granted),
            ];
            s.each(&[], "result", results.map(|(r, n)| (r, n as f64)))
        },
    ),
    Kind::Counter.family(
        "llm_gateway_probe_rounds_total",
        "Probe rounds run by the pool's alarm.",
        |f, s| s.total(f.counters.probe_rounds),
    ),
    Kind::Counter.family(
        "llm_gateway_probes_total",
        "Backend probes by result.",
        |f, s| {
            let results = [
                ("ok", f.counters.probes_ok),
                ("failed", f.counters.probes_failed),
            ];
            s.each(&[], "result", results.map(|(r, n)| (r, n as f64)))
        },
    ),
];

/// The families with a series per backend's last probe, in page order.
fn probe_families<'a>() -> [Family<LastProbe<'a>>; 3] {
    [
        Kind::Gauge.family(
            "llm_gateway_probe_success",
            "Whether the backend's last probe succeeded.",
            |p, s| s.value(&[("backend", p.backend)], if p.ok { 1.0 } else { 0.0 }),
        ),
        Kind::Gauge.family(
            "llm_gateway_probe_duration_seconds",
            "Duration of the backend's last probe.",
            |p, s| s.value(&[("backend", p.backend)], p.duration_ms as f64 / 1000.0),
        ),
        Kind::Gauge.family(
            "llm_gateway_probe_timestamp_seconds",
            "When the backend's last probe ran (Unix time).",
            |p, s| s.value(&[("backend", p.backend)], p.at_ms as f64 / 1000.0),
        ),
    ]
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
        assert_eq!(out.matches("# HELP").count(), 16);
    }

    /// The whole page, byte for byte: family order, `# HELP` text, labels, numbers.
    #[test]
    fn the_page_is_as_pinned() {
        let counters = CoordinatorCounters {
            retries: 3,
            retry_budget_exhausted: 1,
            spills: 2,
            evidence_scrapes: 4,
            renewals: [6, 2],
            probe_rounds: 9,
            probes_ok: 17,
            probes_failed: 1,
            sent_ahead: SentAheadCounts {
                kept: 5,
                missed: 2,
                not_granted: 1,
            },
        };
        let load = PoolLoad {
            ready: 2,
            waiting: 1.5,
            running: 4.0,
            desired_replicas: 3,
            ..PoolLoad::default()
        };
        let probes = [
            LastProbe {
                backend: "gpu\\a",
                ok: true,
                duration_ms: 1_500,
                at_ms: 1_700_000_000_123,
            },
            LastProbe {
                backend: "gpu-b",
                ok: false,
                duration_ms: 20,
                at_ms: 1_700_000_000_456,
            },
        ];
        let mut out = String::new();
        render(&mut out, "eu\"1", &counters, &load, 4.0, &probes);
        assert_eq!(out, PINNED);
    }

    const PINNED: &str = r#"# HELP llm_gateway_retries_total Leases moved to the next candidate after a failure before the first byte.
# TYPE llm_gateway_retries_total counter
llm_gateway_retries_total{pool="eu\"1"} 3
# HELP llm_gateway_retry_budget_exhausted_total Retries refused by the pool's retry budget.
# TYPE llm_gateway_retry_budget_exhausted_total counter
llm_gateway_retry_budget_exhausted_total{pool="eu\"1"} 1
# HELP llm_gateway_pool_spills_total Requests refused because the pool was saturated and a further pool could take them.
# TYPE llm_gateway_pool_spills_total counter
llm_gateway_pool_spills_total{pool="eu\"1"} 2
# HELP llm_gateway_evidence_scrapes_total Backends scraped outside the probe round because overdue streams showed their model wrong.
# TYPE llm_gateway_evidence_scrapes_total counter
llm_gateway_evidence_scrapes_total{pool="eu\"1"} 4
# HELP llm_gateway_lease_renewals_total Lease renewals the pool received; overdue="true": a stream with no first token by its due time said so early (lease evidence).
# TYPE llm_gateway_lease_renewals_total counter
llm_gateway_lease_renewals_total{pool="eu\"1",overdue="false"} 6
llm_gateway_lease_renewals_total{pool="eu\"1",overdue="true"} 2
# HELP llm_gateway_pool_ready_backends Backends ready and healthy.
# TYPE llm_gateway_pool_ready_backends gauge
llm_gateway_pool_ready_backends{pool="eu\"1"} 2
# HELP llm_gateway_pool_waiting Requests waiting in the backends' queues (scraped), summed.
# TYPE llm_gateway_pool_waiting gauge
llm_gateway_pool_waiting{pool="eu\"1"} 1.5
# HELP llm_gateway_pool_running Requests running on the backends (scraped), summed.
# TYPE llm_gateway_pool_running gauge
llm_gateway_pool_running{pool="eu\"1"} 4
# HELP llm_gateway_pool_desired_replicas Replicas an autoscaler should aim for at the configured waiting-per-replica target.
# TYPE llm_gateway_pool_desired_replicas gauge
llm_gateway_pool_desired_replicas{pool="eu\"1"} 3
# HELP llm_gateway_pool_autoscale_target_waiting The waiting-per-replica target of the autoscaling signal.
# TYPE llm_gateway_pool_autoscale_target_waiting gauge
llm_gateway_pool_autoscale_target_waiting{pool="eu\"1"} 4
# HELP llm_gateway_pool_sent_ahead_total Acquires whose backend fetch the Worker sent ahead of them (ROUTE_AHEAD): kept (granted on that backend), missed (granted on another) or not_granted (queued, refused or spilled); the Worker aborts all but the kept.
# TYPE llm_gateway_pool_sent_ahead_total counter
llm_gateway_pool_sent_ahead_total{pool="eu\"1",result="kept"} 5
llm_gateway_pool_sent_ahead_total{pool="eu\"1",result="missed"} 2
llm_gateway_pool_sent_ahead_total{pool="eu\"1",result="not_granted"} 1
# HELP llm_gateway_probe_rounds_total Probe rounds run by the pool's alarm.
# TYPE llm_gateway_probe_rounds_total counter
llm_gateway_probe_rounds_total{pool="eu\"1"} 9
# HELP llm_gateway_probes_total Backend probes by result.
# TYPE llm_gateway_probes_total counter
llm_gateway_probes_total{pool="eu\"1",result="ok"} 17
llm_gateway_probes_total{pool="eu\"1",result="failed"} 1
# HELP llm_gateway_probe_success Whether the backend's last probe succeeded.
# TYPE llm_gateway_probe_success gauge
llm_gateway_probe_success{pool="eu\"1",backend="gpu\\a"} 1
llm_gateway_probe_success{pool="eu\"1",backend="gpu-b"} 0
# HELP llm_gateway_probe_duration_seconds Duration of the backend's last probe.
# TYPE llm_gateway_probe_duration_seconds gauge
llm_gateway_probe_duration_seconds{pool="eu\"1",backend="gpu\\a"} 1.5
llm_gateway_probe_duration_seconds{pool="eu\"1",backend="gpu-b"} 0.02
# HELP llm_gateway_probe_timestamp_seconds When the backend's last probe ran (Unix time).
# TYPE llm_gateway_probe_timestamp_seconds gauge
llm_gateway_probe_timestamp_seconds{pool="eu\"1",backend="gpu\\a"} 1700000000.123
llm_gateway_probe_timestamp_seconds{pool="eu\"1",backend="gpu-b"} 1700000000.456
"#;
}
