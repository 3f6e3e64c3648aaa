//! The Prometheus text format: escaped labels, `# HELP`/`# TYPE` headers, samples and latency
//! histograms. Every metric name starts with `llm_gateway_`; series carry a `pool` label and, per
//! backend, a `backend` label with the backend's id (never its URL or API key). What a pool
//! renders is the pool's own business (`Pool::render_metrics`); the admission
//! queue renders its figures with the same writer. The Worker's `/metrics` endpoint concatenates
//! each pool's rendering, after adding up the pages of a pool's coordinator shards
//! ([`sum_shard_pages`]).

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

/// Writes a metric family's `# HELP` and `# TYPE` lines.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Writes one sample: `name{pool="..",k="v",..} value`.
pub fn sample(out: &mut String, name: &str, pool: &str, labels: &[(&str, &str)], value: f64) {
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

/// Writes a latency histogram's cumulative buckets, sum and count for one backend.
pub fn histogram(out: &mut String, name: &str, pool: &str, backend: &str, h: &Histogram) {
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

/// Gauges that measure load or a per-shard table's size, summed over a pool's shards like the
/// counters (each shard holds its own leases, queue and part of the affinity table).
const SUMMED_GAUGES: [&str; 7] = [
    "llm_gateway_leases_in_flight",
    "llm_gateway_leases_live",
    "llm_gateway_inflight_tokens",
    "llm_gateway_queue_length",
    "llm_gateway_affinity_entries",
    "llm_gateway_affinity_backend_entries",
    "llm_gateway_affinity_memory_bytes",
];

/// Counters every shard advances alike (each shard applies shard 0's probe rounds), taken once.
const SHARED_COUNTERS: [&str; 1] = ["llm_gateway_health_transitions_total"];

/// One pool's pages from its coordinator shards (shard 0 first) as one page: counters, histograms
/// and load gauges ([`SUMMED_GAUGES`]) summed series by series; the other gauges (health, breaker
/// and lifecycle state, scraped and probe gauges, which every shard holds alike or only shard 0
/// knows) as the first page that has the series shows them.
pub fn sum_shard_pages(pages: &[String]) -> String {
    struct Family {
        headers: Vec<String>,
        summed: bool,
        series: Vec<String>,
    }
    let mut order: Vec<String> = Vec::new();
    let mut families: std::collections::HashMap<String, Family> = Default::default();
    let mut values: std::collections::HashMap<String, f64> = Default::default();
    for page in pages {
        let mut current = String::new();
        for line in page.lines().filter(|l| !l.trim().is_empty()) {
            if let Some(rest) = line.strip_prefix("# ") {
                let mut words = rest.split_whitespace();
                let (kind, name) = (words.next(), words.next().unwrap_or_default());
                current = name.to_string();
                let family = families.entry(current.clone()).or_insert_with(|| {
                    order.push(current.clone());
                    Family {
                        headers: Vec::new(),
                        summed: false,
                        series: Vec::new(),
                    }
                });
                if kind == Some("TYPE") {
                    let type_ = words.next().unwrap_or_default();
                    family.summed = (matches!(type_, "counter" | "histogram")
                        && !SHARED_COUNTERS.contains(&name))
                        || SUMMED_GAUGES.contains(&name);
                }
                if !family.headers.iter().any(|h| h == line) {
                    family.headers.push(line.to_string());
                }
                continue;
            }
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let value: f64 = value.parse().unwrap_or(f64::NAN);
            let Some(family) = families.get_mut(&current) else {
                continue;
            };
            match values.get_mut(series) {
                Some(total) if family.summed => *total += value,
                Some(_) => {}
                None => {
                    values.insert(series.to_string(), value);
                    family.series.push(series.to_string());
                }
            }
        }
    }
    let mut out = String::new();
    for name in order {
        let family = &families[&name];
        for h in &family.headers {
            out.push_str(h);
            out.push('\n');
        }
        for series in &family.series {
            out.push_str(series);
            out.push(' ');
            number(&mut out, values[series]);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_pages_add_counters_and_load_but_not_state() {
        let page = |leases: u32, requests: u32, healthy: u32, only: Option<&str>| {
            let mut out = String::new();
            header(
                &mut out,
                "llm_gateway_requests_total",
                "counter",
                "Requests.",
            );
            sample(
                &mut out,
                "llm_gateway_requests_total",
                "p",
                &[("backend", "a")],
                requests.into(),
            );
            if let Some(b) = only {
                sample(
                    &mut out,
                    "llm_gateway_requests_total",
                    "p",
                    &[("backend", b)],
                    1.0,
                );
            }
            header(&mut out, "llm_gateway_leases_in_flight", "gauge", "Leases.");
            sample(
                &mut out,
                "llm_gateway_leases_in_flight",
                "p",
                &[("backend", "a")],
                leases.into(),
            );
            header(&mut out, "llm_gateway_backend_healthy", "gauge", "Healthy.");
            sample(
                &mut out,
                "llm_gateway_backend_healthy",
                "p",
                &[("backend", "a")],
                healthy.into(),
            );
            header(
                &mut out,
                "llm_gateway_health_transitions_total",
                "counter",
                "Transitions.",
            );
            sample(
                &mut out,
                "llm_gateway_health_transitions_total",
                "p",
                &[],
                2.0,
            );
            out
        };
        let total = sum_shard_pages(&[
            page(1, 10, 1, None),
            page(2, 5, 0, Some("b")),
            page(3, 1, 0, None),
        ]);
        assert!(
            total.contains("llm_gateway_requests_total{pool=\"p\",backend=\"a\"} 16\n"),
            "{total}"
        );
        assert!(
            total.contains("llm_gateway_requests_total{pool=\"p\",backend=\"b\"} 1\n"),
            "{total}"
        );
        assert!(
            total.contains("llm_gateway_leases_in_flight{pool=\"p\",backend=\"a\"} 6\n"),
            "{total}"
        );
        assert!(
            total.contains("llm_gateway_backend_healthy{pool=\"p\",backend=\"a\"} 1\n"),
            "{total}"
        );
        assert!(
            total.contains("llm_gateway_health_transitions_total{pool=\"p\"} 2\n"),
            "{total}"
        );
        assert_eq!(
            total
                .matches("# TYPE llm_gateway_requests_total counter")
                .count(),
            1
        );
        // Each family's samples follow its own headers.
        let b = total.find("backend=\"b\"").unwrap();
        assert!(b < total.find("# HELP llm_gateway_leases_in_flight").unwrap());
    }

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
    fn samples_escape_labels_and_histograms_are_cumulative() {
        let mut out = String::new();
        header(&mut out, "llm_gateway_x", "gauge", "X.");
        sample(
            &mut out,
            "llm_gateway_x",
            "p\\1",
            &[("k", "a\"b\nc")],
            f64::INFINITY,
        );
        assert_eq!(
            out,
            "# HELP llm_gateway_x X.\n# TYPE llm_gateway_x gauge\nllm_gateway_x{pool=\"p\\\\1\",k=\"a\\\"b\\nc\"} +Inf\n"
        );
        let mut h = Histogram::default();
        h.observe(20);
        h.observe(40);
        let mut out = String::new();
        histogram(&mut out, "llm_gateway_t", "p", "b", &h);
        assert!(out.contains("llm_gateway_t_bucket{pool=\"p\",backend=\"b\",le=\"0.05\"} 2\n"));
        assert!(out.contains("llm_gateway_t_bucket{pool=\"p\",backend=\"b\",le=\"+Inf\"} 2\n"));
        assert!(out.contains("llm_gateway_t_sum{pool=\"p\",backend=\"b\"} 0.06\n"));
    }
}
