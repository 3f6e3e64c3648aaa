//! Turning records into results: one [`RunReport`] per (workload, policy) run, the benchmark's
//! JSON document, its markdown tables, the target-figure verdicts, and SVG charts (plotters).

use crate::driver::{Load, Record};
use crate::metrics::Counters;
use crate::oracle::OracleBound;
use crate::stats::{imbalance, Summary};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// One backend's share of a run.
#[derive(Debug, Clone, Serialize)]
pub struct BackendShare {
    /// Requests the client saw it serve (response header).
    pub requests: u64,
    /// Its counters' change over the run (`/metrics`).
    pub counters: Counters,
}

/// Everything measured in one run.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// Workload name.
    pub workload: String,
    /// Routing policy (`direct` when no gateway).
    pub policy: String,
    /// How load was offered.
    pub load: Load,
    /// vllm-sim's `--time-scale` (model time = wall time x this).
    pub time_scale: f64,
    /// Wall-clock seconds.
    pub duration_s: f64,
    /// Requests sent.
    pub sent: usize,
    /// Requests that streamed to the end.
    pub ok: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Up to five distinct error texts.
    pub error_samples: Vec<String>,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Time to first token, wall ms.
    pub ttft_ms: Summary,
    /// Time per output token after the first, wall ms.
    pub tpot_ms: Summary,
    /// End-to-end latency, wall ms.
    pub e2e_ms: Summary,
    /// Time to first token in model ms (wall x time scale): what the modelled GPU would show.
    pub ttft_model_ms: Summary,
    /// `long-short` only: time to first token of the short requests, the ones a router can save
    /// from waiting behind a long prefill (a long prompt's own prefill no routing can shorten).
    pub ttft_short_ms: Option<Summary>,
    /// `long-short` only: end-to-end latency of the short requests.
    pub e2e_short_ms: Option<Summary>,
    /// Time to first token as the backends measured it (vLLM's histogram, interpolated inside its
    /// coarse buckets), ms: the client's figure minus this is the gateway's and the network's share.
    pub backend_ttft_ms: Option<Quantiles>,
    /// Per backend.
    pub backends: BTreeMap<String, BackendShare>,
    /// Busiest backend's requests over the mean.
    pub request_imbalance: f64,
    /// Busiest backend's computed tokens (uncached prompt + output) over the mean.
    pub work_imbalance: f64,
    /// Fleet-wide counters' change.
    pub fleet: Counters,
    /// Fleet prefix-cache hit rate (`/metrics`, tokens).
    pub hit_rate: f64,
    /// Hit rate from the responses' `cached_tokens` / `prompt_tokens`.
    pub usage_hit_rate: f64,
    /// The oracle's bound for this workload on this fleet.
    pub oracle: Option<OracleBound>,
    /// `hit_rate / oracle.hit_rate`.
    pub fraction_of_oracle: Option<f64>,
}

/// What a run was: workload, policy, load and the backends' time scale.
#[derive(Debug, Clone, Copy)]
pub struct RunLabel<'a> {
    /// Workload name.
    pub workload: &'a str,
    /// Routing policy.
    pub policy: &'a str,
    /// How load was offered.
    pub load: Load,
    /// vllm-sim's `--time-scale`.
    pub time_scale: f64,
}

/// Three percentiles, ms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Quantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// Builds a run's report. `backends` lists every backend of the fleet (id and counter deltas),
/// so idle backends count in the balance.
pub fn summarize(
    label: RunLabel<'_>,
    records: &[Record],
    duration_s: f64,
    backends: &[(String, Counters)],
    oracle: Option<OracleBound>,
) -> RunReport {
    let RunLabel {
        workload,
        policy,
        load,
        time_scale,
    } = label;
    let ok: Vec<&Record> = records
        .iter()
        .filter(|r| r.error.is_none() && r.ttft_ms.is_some())
        .collect();
    let mut samples: Vec<String> = Vec::new();
    for r in records.iter().filter_map(|r| r.error.as_ref()) {
        let short: String = r.chars().take(200).collect();
        if samples.len() < 5 && !samples.contains(&short) {
            samples.push(short);
        }
    }
    let ttft = Summary::of(ok.iter().filter_map(|r| r.ttft_ms));
    let mut shares: BTreeMap<String, BackendShare> = backends
        .iter()
        .map(|(id, c)| {
            (
                id.clone(),
                BackendShare {
                    requests: 0,
                    counters: *c,
                },
            )
        })
        .collect();
    for r in records {
        if let Some(b) = &r.backend {
            shares
                .entry(b.clone())
                .or_insert(BackendShare {
                    requests: 0,
                    counters: Counters::default(),
                })
                .requests += 1;
        }
    }
    let fleet = backends
        .iter()
        .fold(Counters::default(), |acc, (_, c)| acc.add(c));
    let reqs: Vec<f64> = shares.values().map(|s| s.requests as f64).collect();
    let work: Vec<f64> = shares.values().map(|s| s.counters.work_tokens()).collect();
    let (prompt, cached) = ok.iter().fold((0u64, 0u64), |(p, c), r| {
        (
            p + u64::from(r.prompt_tokens.unwrap_or(0)),
            c + u64::from(r.cached_tokens.unwrap_or(0)),
        )
    });
    let hit_rate = fleet.hit_rate();
    let fraction_of_oracle = oracle
        .as_ref()
        .filter(|o| o.hit_rate > 0.01)
        .map(|o| hit_rate / o.hit_rate);
    RunReport {
        workload: workload.to_string(),
        policy: policy.to_string(),
        load,
        time_scale,
        duration_s,
        sent: records.len(),
        ok: ok.len(),
        errors: records.len() - ok.len(),
        error_samples: samples,
        requests_per_s: ok.len() as f64 / duration_s.max(1e-9),
        output_tokens_per_s: ok.iter().map(|r| f64::from(r.output_tokens)).sum::<f64>()
            / duration_s.max(1e-9),
        ttft_ms: ttft,
        tpot_ms: Summary::of(ok.iter().filter_map(|r| r.tpot_ms())),
        e2e_ms: Summary::of(ok.iter().map(|r| r.e2e_ms)),
        ttft_model_ms: ttft.scaled(time_scale),
        ttft_short_ms: None,
        e2e_short_ms: None,
        backend_ttft_ms: None,
        backends: shares,
        request_imbalance: imbalance(&reqs, backends.len()),
        work_imbalance: imbalance(&work, backends.len()),
        fleet,
        hit_rate,
        usage_hit_rate: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        oracle,
        fraction_of_oracle,
    }
}

/// The gateway's added latency at one concurrency, measured against direct calls in the same run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OverheadPoint {
    /// How load was offered.
    pub load: Load,
    /// Concurrent streams (0 for an open-loop rate).
    pub concurrency: usize,
    /// Requests per phase.
    pub requests: usize,
    /// Direct TTFT p50 / p99, ms.
    pub direct_ttft_p50: f64,
    pub direct_ttft_p99: f64,
    /// Through the gateway, TTFT p50 / p99, ms.
    pub gateway_ttft_p50: f64,
    pub gateway_ttft_p99: f64,
    /// Direct and gateway end-to-end p50 / p99, ms.
    pub direct_e2e_p50: f64,
    pub direct_e2e_p99: f64,
    pub gateway_e2e_p50: f64,
    pub gateway_e2e_p99: f64,
    /// Throughput of each phase, requests per second.
    pub direct_rps: f64,
    pub gateway_rps: f64,
    /// Errors in each phase.
    pub direct_errors: usize,
    pub gateway_errors: usize,
}

impl OverheadPoint {
    /// Added TTFT at p50 and p99, ms.
    pub fn added_ttft(&self) -> (f64, f64) {
        (
            self.gateway_ttft_p50 - self.direct_ttft_p50,
            self.gateway_ttft_p99 - self.direct_ttft_p99,
        )
    }
}

/// The whole benchmark's result document.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// Config name (`full`, `quick`).
    pub name: String,
    /// UTC date and time of the start.
    pub started: String,
    /// Machine description (`nproc`, CPU model, memory).
    pub machine: BTreeMap<String, String>,
    /// The config as run.
    pub config: serde_json::Value,
    /// Every run.
    pub runs: Vec<RunReport>,
    /// The overhead benchmark.
    pub overhead: Vec<OverheadPoint>,
    /// Target figures and verdicts.
    pub targets: Vec<Verdict>,
}

/// A target figure of issue 7 and how the run did.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// What the target says.
    pub target: String,
    /// What was measured.
    pub measured: String,
    /// Met or not (None: not measured in this run).
    pub met: Option<bool>,
}

fn find<'a>(runs: &'a [RunReport], workload: &str, policy: &str) -> Option<&'a RunReport> {
    runs.iter()
        .find(|r| r.workload == workload && r.policy == policy)
}

/// Checks the target figures against the runs.
pub fn verdicts(runs: &[RunReport]) -> Vec<Verdict> {
    let mut out = Vec::new();
    for w in ["shared-prefix", "multi-turn"] {
        let ca = find(runs, w, "cache_aware");
        out.push(
            match ca.and_then(|r| r.fraction_of_oracle.map(|f| (r, f))) {
                Some((r, f)) => Verdict {
                    target: format!("{w}: cache_aware hit rate >= 90% of the oracle's"),
                    measured: format!(
                        "{:.1}% of {:.1}% = {:.0}% of the bound ({:+.0} points vs the 90% target)",
                        r.hit_rate * 100.0,
                        r.oracle.as_ref().map_or(0.0, |o| o.hit_rate * 100.0),
                        f * 100.0,
                        (f - 0.9) * 100.0
                    ),
                    met: Some(f >= 0.9),
                },
                None => Verdict {
                    target: format!("{w}: cache_aware hit rate >= 90% of the oracle's"),
                    measured: "not run".into(),
                    met: None,
                },
            },
        );
        out.push(match ca {
            Some(r) => Verdict {
                target: format!("{w}: cache_aware busiest backend <= 1.3x mean load"),
                measured: format!(
                    "requests {:.2}x, computed tokens {:.2}x",
                    r.request_imbalance, r.work_imbalance
                ),
                met: Some(r.request_imbalance <= 1.3),
            },
            None => Verdict {
                target: format!("{w}: cache_aware busiest backend <= 1.3x mean load"),
                measured: "not run".into(),
                met: None,
            },
        });
    }
    let target = "shared-prefix: cache_aware p99 TTFT <= 0.5x round_robin's".to_string();
    out.push(
        match (
            find(runs, "shared-prefix", "cache_aware"),
            find(runs, "shared-prefix", "round_robin"),
        ) {
            (Some(ca), Some(rr)) => {
                let ratio = ca.ttft_ms.p99 / rr.ttft_ms.p99.max(1e-9);
                Verdict {
                    target,
                    measured: format!(
                        "{:.1} ms vs {:.1} ms = {:.2}x",
                        ca.ttft_ms.p99, rr.ttft_ms.p99, ratio
                    ),
                    met: Some(ratio <= 0.5),
                }
            }
            _ => Verdict {
                target,
                measured: "not run".into(),
                met: None,
            },
        },
    );
    for p in ["power_of_two", "least_load"] {
        let target = format!("long-short: {p} p99 TTFT of short requests < round_robin's");
        out.push(match (find(runs, "long-short", p), find(runs, "long-short", "round_robin")) {
            (Some(a), Some(rr)) => {
                let short = |r: &RunReport| r.ttft_short_ms.unwrap_or(r.ttft_ms).p99;
                let short_e2e = |r: &RunReport| r.e2e_short_ms.unwrap_or(r.e2e_ms).p99;
                Verdict {
                    target,
                    measured: format!(
                        "short TTFT p99 {:.1} vs {:.1} ms ({:.2}x); short E2E p99 {:.0} vs {:.0} ms; all-request TTFT p99 {:.1} vs {:.1} ms",
                        short(a),
                        short(rr),
                        short(a) / short(rr).max(1e-9),
                        short_e2e(a),
                        short_e2e(rr),
                        a.ttft_ms.p99,
                        rr.ttft_ms.p99
                    ),
                    met: Some(short(a) < short(rr)),
                }
            }
            _ => Verdict { target, measured: "not run".into(), met: None },
        });
    }
    out
}

fn load_label(l: Load) -> String {
    match l {
        Load::Concurrency(c) => format!("{c} concurrent streams"),
        Load::Rate(r) => format!("open loop {r} req/s"),
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// The markdown tables of a result (one per workload, the overhead, the verdicts).
pub fn markdown(result: &BenchResult, chart_prefix: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Benchmark results: `{}` run of {}\n",
        result.name, result.started
    );
    let _ = writeln!(
        s,
        "Machine: {}\n",
        result
            .machine
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let _ = writeln!(
        s,
        "## Target figures\n\n| target | measured | verdict |\n|---|---|---|"
    );
    for v in &result.targets {
        let verdict = match v.met {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "not run",
        };
        let _ = writeln!(s, "| {} | {} | {} |", v.target, v.measured, verdict);
    }
    let mut workloads: Vec<&str> = Vec::new();
    for r in &result.runs {
        if !workloads.contains(&r.workload.as_str()) {
            workloads.push(&r.workload);
        }
    }
    for w in workloads {
        let runs: Vec<&RunReport> = result.runs.iter().filter(|r| r.workload == w).collect();
        let first = runs[0];
        let load = match first.load {
            Load::Rate(r) => format!("open loop, {r} req/s Poisson"),
            Load::Concurrency(c) => format!("closed loop, {c} concurrent"),
        };
        let _ = writeln!(s, "\n## {w} ({load}, time scale {})\n", first.time_scale);
        if let Some(o) = &first.oracle {
            let _ = writeln!(
                s,
                "Oracle bound: **{}** hit rate (unbounded cache: {}); working set {} blocks, fleet holds {} blocks.\n",
                pct(o.hit_rate),
                pct(o.unbounded.rate()),
                o.working_set_blocks,
                o.fleet_blocks
            );
        }
        if runs.iter().any(|r| r.ttft_short_ms.is_some()) {
            let _ = writeln!(s, "Short requests only (the ones a router can spare from waiting behind a long prefill):\n");
            let _ = writeln!(s, "| policy | short TTFT p50 | short TTFT p90 | short TTFT p99 | short TTFT p99.9 | short E2E p99 |\n|---|---|---|---|---|---|");
            for r in &runs {
                if let (Some(t), Some(e)) = (r.ttft_short_ms, r.e2e_short_ms) {
                    let _ = writeln!(
                        s,
                        "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} |",
                        r.policy, t.p50, t.p90, t.p99, t.p999, e.p99
                    );
                }
            }
            let _ = writeln!(s, "\nAll requests:\n");
        }
        let _ = writeln!(
            s,
            "| policy | hit rate | of oracle | TTFT p50 | TTFT p90 | TTFT p99 | TTFT p99.9 | backend TTFT p50 / p99 | TPOT p50 | E2E p50 | E2E p99 | req/s | out tok/s | busiest/mean req | busiest/mean work | ok / sent |"
        );
        let _ = writeln!(
            s,
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for r in runs {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.2} | {:.0} | {:.0} | {:.1} | {:.0} | {:.2} | {:.2} | {} / {} |",
                r.policy,
                pct(r.hit_rate),
                r.fraction_of_oracle.map_or("-".into(), pct),
                r.ttft_ms.p50,
                r.ttft_ms.p90,
                r.ttft_ms.p99,
                r.ttft_ms.p999,
                r.backend_ttft_ms
                    .map_or("-".into(), |b| format!("{:.1} / {:.1}", b.p50, b.p99)),
                r.tpot_ms.p50,
                r.e2e_ms.p50,
                r.e2e_ms.p99,
                r.requests_per_s,
                r.output_tokens_per_s,
                r.request_imbalance,
                r.work_imbalance,
                r.ok,
                r.sent
            );
        }
    }
    if !result.overhead.is_empty() {
        let _ = writeln!(
            s,
            "\n## Gateway overhead (same run, same backends, direct vs through the gateway)\n"
        );
        let _ = writeln!(s, "| load | direct TTFT p50 / p99 | gateway TTFT p50 / p99 | added p50 / p99 | ratio p50 / p99 | direct E2E p50 / p99 | gateway E2E p50 / p99 | direct / gateway req/s | errors |");
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
        for o in &result.overhead {
            let (a50, a99) = o.added_ttft();
            let _ = writeln!(
                s,
                "| {} | {:.1} / {:.1} ms | {:.1} / {:.1} ms | **+{:.1} / +{:.1} ms** | {:.2}x / {:.2}x | {:.1} / {:.1} ms | {:.1} / {:.1} ms | {:.0} / {:.0} | {} / {} |",
                load_label(o.load),
                o.direct_ttft_p50,
                o.direct_ttft_p99,
                o.gateway_ttft_p50,
                o.gateway_ttft_p99,
                a50,
                a99,
                o.gateway_ttft_p50 / o.direct_ttft_p50.max(1e-9),
                o.gateway_ttft_p99 / o.direct_ttft_p99.max(1e-9),
                o.direct_e2e_p50,
                o.direct_e2e_p99,
                o.gateway_e2e_p50,
                o.gateway_e2e_p99,
                o.direct_rps,
                o.gateway_rps,
                o.direct_errors,
                o.gateway_errors
            );
        }
    }
    let _ = writeln!(s, "\n## Charts\n");
    for (file, what) in CHARTS {
        let _ = writeln!(s, "![{what}]({chart_prefix}{file})");
    }
    s
}

/// Chart files (suffixes) and captions.
pub const CHARTS: [(&str, &str); 4] = [
    (
        "hit-rate.svg",
        "prefix-cache hit rate per policy against the oracle",
    ),
    ("ttft-p99.svg", "p99 time to first token per policy"),
    ("balance.svg", "busiest backend over mean, requests"),
    ("overhead.svg", "gateway added latency"),
];

const PALETTE: [RGBColor; 8] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x9c, 0x75, 0x5f),
];

/// A grouped bar chart: one group per x label, one bar per series; `marks` draws a black tick per
/// group (the oracle), `line` a dashed horizontal reference.
pub fn grouped_bars(
    path: &Path,
    title: &str,
    y_label: &str,
    groups: &[String],
    series: &[(String, Vec<f64>)],
    marks: Option<(&str, Vec<f64>)>,
    line: Option<f64>,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let root = SVGBackend::new(path, (960, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let top = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .chain(marks.iter().flat_map(|(_, v)| v.iter().copied()))
        .chain(line)
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.15;
    let n = groups.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..n, 0f64..top)
        .map_err(|e| err(&e))?;
    let labels = groups.to_vec();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len() * 2 + 1)
        .x_label_formatter(&move |x| {
            let i = (x - 0.5).round();
            if (x - 0.5 - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                labels[i as usize].clone()
            } else {
                String::new()
            }
        })
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(&e))?;
    let k = series.len().max(1) as f64;
    let width = 0.8 / k;
    for (si, (name, values)) in series.iter().enumerate() {
        let color = PALETTE[si % PALETTE.len()];
        chart
            .draw_series(values.iter().enumerate().map(|(g, &v)| {
                let x0 = g as f64 + 0.1 + si as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.92, v)], color.filled())
            }))
            .map_err(|e| err(&e))?
            .label(name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    if let Some((name, values)) = marks {
        chart
            .draw_series(values.iter().enumerate().map(|(g, &v)| {
                PathElement::new(
                    vec![(g as f64 + 0.05, v), (g as f64 + 0.95, v)],
                    BLACK.stroke_width(3),
                )
            }))
            .map_err(|e| err(&e))?
            .label(name)
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 12, y)], BLACK.stroke_width(3)));
    }
    if let Some(y) = line {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(0.0, y), (n, y)],
                RED.stroke_width(1),
            )))
            .map_err(|e| err(&e))?
            .label(format!("{y}"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 12, y)], RED.stroke_width(1)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Writes the four charts as `<prefix>hit-rate.svg`, ... into `dir`.
pub fn charts(result: &BenchResult, dir: &Path, prefix: &str) -> Result<(), String> {
    let mut workloads: Vec<String> = Vec::new();
    let mut policies: Vec<String> = Vec::new();
    for r in &result.runs {
        if !workloads.contains(&r.workload) {
            workloads.push(r.workload.clone());
        }
        if !policies.contains(&r.policy) {
            policies.push(r.policy.clone());
        }
    }
    let value =
        |w: &str, p: &str, f: &dyn Fn(&RunReport) -> f64| find(&result.runs, w, p).map_or(0.0, f);
    let by_policy = |ws: &[String], f: &dyn Fn(&RunReport) -> f64| -> Vec<(String, Vec<f64>)> {
        policies
            .iter()
            .map(|p| (p.clone(), ws.iter().map(|w| value(w, p, f)).collect()))
            .collect()
    };
    let cache_ws: Vec<String> = workloads
        .iter()
        .filter(|w| *w == "shared-prefix" || *w == "multi-turn")
        .cloned()
        .collect();
    let oracle: Vec<f64> = cache_ws
        .iter()
        .map(|w| {
            result
                .runs
                .iter()
                .find(|r| &r.workload == w)
                .and_then(|r| r.oracle.as_ref())
                .map_or(0.0, |o| o.hit_rate * 100.0)
        })
        .collect();
    grouped_bars(
        &dir.join(format!("{prefix}hit-rate.svg")),
        "Prefix-cache hit rate (fleet /metrics) vs oracle",
        "hit rate, % of prompt tokens",
        &cache_ws,
        &by_policy(&cache_ws, &|r| r.hit_rate * 100.0),
        Some(("oracle", oracle)),
        None,
    )?;
    grouped_bars(
        &dir.join(format!("{prefix}ttft-p99.svg")),
        "p99 time to first token (long-short: short requests)",
        "ms (wall clock)",
        &workloads,
        &by_policy(&workloads, &|r| r.ttft_short_ms.unwrap_or(r.ttft_ms).p99),
        None,
        None,
    )?;
    grouped_bars(
        &dir.join(format!("{prefix}balance.svg")),
        "Busiest backend / mean (requests)",
        "ratio",
        &workloads,
        &by_policy(&workloads, &|r| r.request_imbalance),
        None,
        Some(1.3),
    )?;
    let conc: Vec<String> = result.overhead.iter().map(|o| load_label(o.load)).collect();
    grouped_bars(
        &dir.join(format!("{prefix}overhead.svg")),
        "TTFT direct vs through the gateway",
        "ms",
        &conc,
        &[
            (
                "direct p50".into(),
                result.overhead.iter().map(|o| o.direct_ttft_p50).collect(),
            ),
            (
                "gateway p50".into(),
                result.overhead.iter().map(|o| o.gateway_ttft_p50).collect(),
            ),
            (
                "direct p99".into(),
                result.overhead.iter().map(|o| o.direct_ttft_p99).collect(),
            ),
            (
                "gateway p99".into(),
                result.overhead.iter().map(|o| o.gateway_ttft_p99).collect(),
            ),
        ],
        None,
        None,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(backend: &str, ttft: f64) -> Record {
        Record {
            session: 0,
            turn: 0,
            sent_s: 0.0,
            status: 200,
            error: None,
            ttft_ms: Some(ttft),
            e2e_ms: ttft + 10.0,
            output_tokens: 11,
            prompt_tokens: Some(100),
            cached_tokens: Some(50),
            backend: Some(backend.into()),
            decision: None,
        }
    }

    #[test]
    fn summarize_counts_balance_hits_and_errors() {
        let mut records = vec![rec("a", 1.0), rec("a", 2.0), rec("b", 3.0)];
        records.push(Record {
            error: Some("HTTP 503".into()),
            ttft_ms: None,
            ..rec("b", 0.0)
        });
        let c = Counters {
            prefix_queries: 100.0,
            prefix_hits: 25.0,
            ..Counters::default()
        };
        let backends = vec![
            ("a".to_string(), c),
            ("b".to_string(), c),
            ("c".to_string(), Counters::default()),
        ];
        let r = summarize(
            RunLabel {
                workload: "w",
                policy: "p",
                load: Load::Rate(1.0),
                time_scale: 4.0,
            },
            &records,
            2.0,
            &backends,
            None,
        );
        assert_eq!((r.sent, r.ok, r.errors), (4, 3, 1));
        assert_eq!(r.backends["a"].requests, 2);
        assert_eq!(r.request_imbalance, 2.0 / (4.0 / 3.0));
        assert_eq!(r.hit_rate, 0.25);
        assert_eq!(r.usage_hit_rate, 0.5);
        assert_eq!(r.ttft_model_ms.p50, 8.0);
        assert!((r.tpot_ms.p50 - 1.0).abs() < 1e-9);
        assert_eq!(r.requests_per_s, 1.5);
    }

    #[test]
    fn verdicts_compare_against_round_robin() {
        let mk = |w: &str, p: &str, p99: f64| {
            let mut r = summarize(
                RunLabel {
                    workload: w,
                    policy: p,
                    load: Load::Rate(1.0),
                    time_scale: 1.0,
                },
                &[rec("a", p99)],
                1.0,
                &[("a".into(), Counters::default())],
                None,
            );
            r.ttft_ms.p99 = p99;
            r
        };
        let runs = vec![
            mk("shared-prefix", "round_robin", 100.0),
            mk("shared-prefix", "cache_aware", 40.0),
            mk("long-short", "round_robin", 50.0),
            mk("long-short", "least_load", 60.0),
        ];
        let v = verdicts(&runs);
        let get = |t: &str| v.iter().find(|x| x.target.contains(t)).unwrap().met;
        assert_eq!(get("0.5x"), Some(true));
        assert_eq!(get("least_load"), Some(false));
        assert_eq!(get("power_of_two"), None);
    }
}
