//! The Prometheus text format: escaped labels, `# HELP`/`# TYPE` headers, samples and latency
//! histograms. Every metric name starts with `llm_gateway_`; series carry a `pool` label and, per
//! backend, a `backend` label with the backend's id (never its URL or API key).
//!
//! A page is written from tables: each metric family is a [`Family`] (its name, type, help text
//! and how one source's samples are produced), named once, and [`write`] writes a table's
//! families in order for a list of sources (the pool's backends, the pool, its admission queue,
//! the coordinator's figures and probes). The Worker's `/metrics` endpoint concatenates each
//! pool's page, after adding up the pages of a pool's coordinator shards ([`sum_shard_pages`]).

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

/// A metric family's Prometheus type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A value that only grows.
    Counter,
    /// A value that goes up and down.
    Gauge,
    /// Cumulative buckets, a sum and a count ([`Samples::histogram`], [`Samples::buckets`]).
    Histogram,
}

impl Kind {
    /// The word of the `# TYPE` line.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }

    /// A family of this type: its name, its help text and how one source's samples are written.
    pub const fn family<S: ?Sized>(
        self,
        name: &'static str,
        help: &'static str,
        samples: fn(&S, &mut Samples<'_>),
    ) -> Family<S> {
        Family {
            name,
            kind: self,
            help,
            samples,
        }
    }
}

/// One metric family, named once: its name, type and help text, and how the samples of one
/// source `S` (a backend's report, a pool, a queue, a probe) are written. The pool, the admission
/// queue and the coordinator each keep a table of these, written by [`write`].
pub struct Family<S: ?Sized> {
    /// The family's name (`llm_gateway_...`).
    pub name: &'static str,
    /// Its type.
    pub kind: Kind,
    /// Its `# HELP` text.
    pub help: &'static str,
    /// Writes one source's samples of the family.
    pub samples: fn(&S, &mut Samples<'_>),
}

/// Writes each of `families` in order: its `# HELP` and `# TYPE` lines, then the samples of each
/// of `sources` in turn, every series labelled with `pool` first.
pub fn write<S>(out: &mut String, pool: &str, families: &[Family<S>], sources: &[S]) {
    for family in families {
        header(out, family.name, family.kind.as_str(), family.help);
        let mut samples = Samples {
            out,
            name: family.name,
            pool,
        };
        for source in sources {
            (family.samples)(source, &mut samples);
        }
    }
}

/// Where one family's samples go: the page, with the family's name and the pool's label.
pub struct Samples<'a> {
    out: &'a mut String,
    name: &'a str,
    pool: &'a str,
}

impl Samples<'_> {
    /// One sample: `name{pool="..",k="v",..} value`.
    pub fn value(&mut self, labels: &[(&str, &str)], value: f64) {
        series(self.out, self.name, "", self.pool, labels, None, value);
    }

    /// The family's one unlabelled sample, a count.
    pub fn total(&mut self, count: u64) {
        self.value(&[], count as f64);
    }

    /// One sample per `(label value, value)` of `values`, labelled `key` after `labels`.
    pub fn each<'v>(
        &mut self,
        labels: &[(&str, &str)],
        key: &str,
        values: impl IntoIterator<Item = (&'v str, f64)>,
    ) {
        for (label, value) in values {
            let extra = Some((key, label));
            series(self.out, self.name, "", self.pool, labels, extra, value);
        }
    }

    /// A latency histogram's cumulative buckets, sum and count.
    pub fn histogram(&mut self, labels: &[(&str, &str)], h: &Histogram) {
        self.buckets(labels, &LATENCY_BUCKETS_MS, &h.buckets, h.count, h.sum_ms);
    }

    /// A histogram of `counts` per bucket (not cumulative) with upper bounds `bounds_ms` in
    /// milliseconds, written in seconds: cumulative `_bucket` series (`+Inf` is `count`), `_sum`
    /// and `_count`.
    pub fn buckets(
        &mut self,
        labels: &[(&str, &str)],
        bounds_ms: &[u64],
        counts: &[u64],
        count: u64,
        sum_ms: u64,
    ) {
        let (out, name, pool) = (&mut *self.out, self.name, self.pool);
        let mut cumulative = 0;
        for (bound, n) in bounds_ms.iter().zip(counts) {
            cumulative += n;
            let le = format!("{}", *bound as f64 / 1000.0);
            let extra = Some(("le", le.as_str()));
            series(out, name, "_bucket", pool, labels, extra, cumulative as f64);
        }
        let extra = Some(("le", "+Inf"));
        series(out, name, "_bucket", pool, labels, extra, count as f64);
        let sum = sum_ms as f64 / 1000.0;
        series(out, name, "_sum", pool, labels, None, sum);
        series(out, name, "_count", pool, labels, None, count as f64);
    }
}

/// Writes a metric family's `# HELP` and `# TYPE` lines.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Writes one sample: `name{pool="..",k="v",..} value`.
pub fn sample(out: &mut String, name: &str, pool: &str, labels: &[(&str, &str)], value: f64) {
    series(out, name, "", pool, labels, None, value);
}

/// Writes one series `{name}{suffix}{pool="..",k="v",..,extra} value`.
fn series(
    out: &mut String,
    name: &str,
    suffix: &str,
    pool: &str,
    labels: &[(&str, &str)],
    extra: Option<(&str, &str)>,
    value: f64,
) {
    out.push_str(name);
    out.push_str(suffix);
    out.push_str("{pool=\"");
    label(out, pool);
    out.push('"');
    for (k, v) in labels.iter().chain(extra.as_ref()) {
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
    merge_shard_pages(pages, true)
}

/// The gauge `/metrics` writes for every pool: how many of its coordinator shards did not answer
/// this scrape (0: the pool's page is complete).
pub const SHARDS_MISSING: &str = "llm_gateway_metrics_shards_missing";

/// One pool's page for `/metrics` from the pages its shards answered (shard 0 first when it
/// answered), `missing` shards not having answered, followed by [`SHARDS_MISSING`].
///
/// A sum over fewer shards than the last scrape's would make every counter of the pool look
/// lower, and Prometheus reads a counter that went down as a reset: `rate()` and `increase()`
/// would count the whole remaining value again. So a scrape that misses a shard leaves out the
/// pool's counters, histograms and summed load gauges altogether (a gap, which `rate()` spans),
/// keeps the state gauges of the shards that answered, and says how many shards it missed. No
/// counter the gateway exposes ever goes backwards because a call failed.
pub fn pool_page(pool: &str, pages: &[String], missing: u32) -> String {
    let mut out = match (pages, missing) {
        ([], _) => String::new(),
        ([one], 0) => one.clone(),
        (_, 0) => merge_shard_pages(pages, true),
        _ => merge_shard_pages(pages, false),
    };
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    header(
        &mut out,
        SHARDS_MISSING,
        "gauge",
        "Coordinator shards of the pool that did not answer this scrape; while above 0 the pool's counters, histograms and summed load gauges are left out rather than summed over fewer shards.",
    );
    sample(&mut out, SHARDS_MISSING, pool, &[], f64::from(missing));
    out
}

/// [`sum_shard_pages`], or with `summed` false the pages without the families it would sum.
fn merge_shard_pages(pages: &[String], summed_too: bool) -> String {
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
        if family.summed && !summed_too {
            continue;
        }
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
        /// One shard's figures for backend `a` (and, if it has one, a backend only it knows).
        struct Shard {
            leases: u32,
            requests: u32,
            healthy: u32,
            only: Option<&'static str>,
        }
        let families: [Family<Shard>; 4] = [
            Kind::Counter.family("llm_gateway_requests_total", "Requests.", |f, s| {
                s.value(&[("backend", "a")], f.requests.into());
                if let Some(b) = f.only {
                    s.value(&[("backend", b)], 1.0);
                }
            }),
            Kind::Gauge.family("llm_gateway_leases_in_flight", "Leases.", |f, s| {
                s.value(&[("backend", "a")], f.leases.into())
            }),
            Kind::Gauge.family("llm_gateway_backend_healthy", "Healthy.", |f, s| {
                s.value(&[("backend", "a")], f.healthy.into())
            }),
            Kind::Counter.family(
                "llm_gateway_health_transitions_total",
                "Transitions.",
                |_, s| s.value(&[], 2.0),
            ),
        ];
        let page = |leases, requests, healthy, only| {
            let mut out = String::new();
            let shard = Shard {
                leases,
                requests,
                healthy,
                only,
            };
            write(&mut out, "p", &families, &[shard]);
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

    /// Issue 42 (still open from the last round): a scrape that missed a shard summed the
    /// others, so every counter of the pool went down and Prometheus counted a reset.
    #[test]
    fn a_missing_shard_leaves_the_counters_out_instead_of_lowering_them() {
        let page = |requests: u32, leases: u32| {
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
            header(
                &mut out,
                "llm_gateway_latency_seconds",
                "histogram",
                "Latency.",
            );
            sample(
                &mut out,
                "llm_gateway_latency_seconds_count",
                "p",
                &[],
                requests.into(),
            );
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
                1.0,
            );
            out
        };
        let complete = pool_page("p", &[page(10, 1), page(5, 2)], 0);
        assert!(complete.contains("llm_gateway_requests_total{pool=\"p\",backend=\"a\"} 15\n"));
        assert!(complete.contains("llm_gateway_metrics_shards_missing{pool=\"p\"} 0\n"));
        // Shard 1 did not answer: no requests_total at all (not 10), no histogram, no summed
        // gauge, the state gauge kept, the gap said.
        let gap = pool_page("p", &[page(10, 1)], 1);
        assert!(!gap.contains("llm_gateway_requests_total"), "{gap}");
        assert!(!gap.contains("llm_gateway_latency_seconds"), "{gap}");
        assert!(!gap.contains("llm_gateway_leases_in_flight"), "{gap}");
        assert!(
            gap.contains("llm_gateway_backend_healthy{pool=\"p\",backend=\"a\"} 1\n"),
            "{gap}"
        );
        assert!(
            gap.contains("# TYPE llm_gateway_metrics_shards_missing gauge\n"),
            "{gap}"
        );
        assert!(
            gap.contains("llm_gateway_metrics_shards_missing{pool=\"p\"} 1\n"),
            "{gap}"
        );
        // A one-shard pool whose shard failed, and one that answered.
        let none = pool_page("p", &[], 1);
        assert!(
            none.starts_with("# HELP llm_gateway_metrics_shards_missing"),
            "{none}"
        );
        let one = pool_page("p", &[page(3, 0)], 0);
        assert!(one.contains("llm_gateway_requests_total{pool=\"p\",backend=\"a\"} 3\n"));
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
        let families = [
            Kind::Histogram.family("llm_gateway_t", "T.", |h: &Histogram, s| {
                s.histogram(&[("backend", "b")], h)
            }),
        ];
        write(&mut out, "p", &families, &[h]);
        assert!(out.starts_with("# HELP llm_gateway_t T.\n# TYPE llm_gateway_t histogram\n"));
        assert!(out.contains("llm_gateway_t_bucket{pool=\"p\",backend=\"b\",le=\"0.05\"} 2\n"));
        assert!(out.contains("llm_gateway_t_bucket{pool=\"p\",backend=\"b\",le=\"+Inf\"} 2\n"));
        assert!(out.contains("llm_gateway_t_sum{pool=\"p\",backend=\"b\"} 0.06\n"));
    }
}
