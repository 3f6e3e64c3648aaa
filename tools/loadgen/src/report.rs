//! Turning records into results: one [`RunReport`] per (workload, mode, policy) run, the
//! benchmark's JSON document, its markdown tables, the target figures (issue 7's hit-rate and
//! balance verdicts, issue 11's tail-latency targets of the default policy against the best
//! baseline), and SVG charts (plotters), among them TTFT p99 against offered load.

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
    /// Workload kind (`prefix-groups`, `multi-turn`, ...).
    pub kind: String,
    /// Mode: `closed-64`, `open-0.9`, ...
    pub mode: String,
    /// Routing policy (`direct` when no gateway).
    pub policy: String,
    /// How load was offered.
    pub load: Load,
    /// Open-loop sweep: the offered rate as a fraction of the workload's capacity.
    pub level: Option<f64>,
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
    /// Busiest backend's computed prompt tokens (prompt tokens not found in its prefix cache: its
    /// prefill work) over the mean.
    pub prefill_imbalance: f64,
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

/// What a run was: workload, mode, policy, load and the backends' time scale.
#[derive(Debug, Clone, Copy)]
pub struct RunLabel<'a> {
    /// Workload name.
    pub workload: &'a str,
    /// Workload kind.
    pub kind: &'a str,
    /// Mode label.
    pub mode: &'a str,
    /// Routing policy.
    pub policy: &'a str,
    /// How load was offered.
    pub load: Load,
    /// Fraction of the capacity (open-loop sweeps).
    pub level: Option<f64>,
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
        kind,
        mode,
        policy,
        load,
        level,
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
    let prefill: Vec<f64> = shares
        .values()
        .map(|s| (s.counters.prefix_queries - s.counters.prefix_hits).max(0.0))
        .collect();
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
        kind: kind.to_string(),
        mode: mode.to_string(),
        policy: policy.to_string(),
        load,
        level,
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
        prefill_imbalance: imbalance(&prefill, backends.len()),
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
    /// Issue 7's target figures and verdicts (hit rate and balance of cache_aware).
    pub targets: Vec<Verdict>,
    /// The policy the tail-latency targets are about.
    pub default_policy: String,
    /// The policies it is compared with.
    pub baselines: Vec<String>,
    /// Issue 11's tail-latency targets, per workload and mode.
    pub tail_targets: Vec<TailTarget>,
    /// The capacity each open-loop sweep's levels are fractions of, requests per second.
    pub capacity_rps: BTreeMap<String, f64>,
    /// Policies the gateway refused (not run).
    pub skipped: Vec<Skipped>,
}

/// A policy the gateway refused, so not benchmarked.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    /// The policy.
    pub policy: String,
    /// The gateway's answer.
    pub reason: String,
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

/// Issue 11's targets for the default policy, each against the best of the baselines.
pub mod bounds {
    /// TTFT p99 over the best baseline's.
    pub const TTFT_P99_VS_BEST: f64 = 0.8;
    /// TTFT p99 over round_robin's, on shared-prefix workloads.
    pub const TTFT_P99_VS_ROUND_ROBIN: f64 = 0.5;
    /// E2E p50 over the best baseline's: no worse, within 5% of run-to-run noise.
    pub const E2E_P50_VS_BEST: f64 = 1.05;
    /// Completed requests per second over the best baseline's: no worse, within 5%.
    pub const THROUGHPUT_VS_BEST: f64 = 0.95;
    /// Hit rate as a fraction of the oracle's: within 5%.
    pub const HIT_RATE_OF_ORACLE: f64 = 0.95;
    /// Busiest backend's computed prompt tokens over the mean.
    pub const PREFILL_IMBALANCE: f64 = 1.3;
}

/// One of issue 11's targets for one workload and mode.
#[derive(Debug, Clone, Serialize)]
pub struct TailTarget {
    /// Workload name.
    pub workload: String,
    /// Mode label.
    pub mode: String,
    /// Short key: `ttft_p99_vs_best`, `ttft_p99_vs_round_robin`, `e2e_p50_vs_best`,
    /// `throughput_vs_best`, `hit_rate_of_oracle`, `prefill_imbalance`.
    pub target: &'static str,
    /// The bound, as text (`<= 0.8x`).
    pub bound: String,
    /// The measured figure (a ratio), if both sides ran.
    pub value: Option<f64>,
    /// How it was computed.
    pub measured: String,
    /// Met or not (None: not measured).
    pub met: Option<bool>,
}

/// Workload kinds where requests share long prefixes by group (the round_robin target applies).
fn shared_prefix_kind(kind: &str) -> bool {
    kind == "shared-prefix" || kind == "prefix-groups"
}

/// Issue 11's targets, computed from the runs: for every workload and mode in which `default`
/// ran, its figures against the best of `baselines` in the same workload and mode.
pub fn tail_targets(runs: &[RunReport], default: &str, baselines: &[String]) -> Vec<TailTarget> {
    let mut out = Vec::new();
    let mut seen: Vec<(&str, &str)> = Vec::new();
    for d in runs.iter().filter(|r| r.policy == default) {
        if seen.contains(&(d.workload.as_str(), d.mode.as_str())) {
            continue;
        }
        seen.push((&d.workload, &d.mode));
        let same = |p: &str| {
            runs.iter()
                .find(|r| r.workload == d.workload && r.mode == d.mode && r.policy == p)
        };
        let base: Vec<&RunReport> = baselines.iter().filter_map(|p| same(p)).collect();
        let mut push = |target: &'static str,
                        bound: String,
                        value: Option<f64>,
                        measured: String,
                        ok: &dyn Fn(f64) -> bool| {
            out.push(TailTarget {
                workload: d.workload.clone(),
                mode: d.mode.clone(),
                target,
                bound,
                met: value.map(ok),
                value,
                measured,
            });
        };
        // The best baseline by a figure (lowest for latencies, highest for throughput).
        let best = |f: &dyn Fn(&RunReport) -> f64, lowest: bool| {
            base.iter().copied().filter(|r| r.ok > 0).reduce(|a, b| {
                if (f(b) < f(a)) == lowest {
                    b
                } else {
                    a
                }
            })
        };
        let ratio = |f: &dyn Fn(&RunReport) -> f64, lowest: bool, unit: &str| match best(f, lowest)
        {
            Some(b) if f(b) > 0.0 && d.ok > 0 => (
                Some(f(d) / f(b)),
                format!("{:.1} vs {:.1} {unit} ({})", f(d), f(b), b.policy),
            ),
            _ => (None, "no baseline ran".to_string()),
        };
        let (v, m) = ratio(&|r| r.ttft_ms.p99, true, "ms");
        push(
            "ttft_p99_vs_best",
            format!("<= {}x", bounds::TTFT_P99_VS_BEST),
            v,
            m,
            &|x| x <= bounds::TTFT_P99_VS_BEST,
        );
        if shared_prefix_kind(&d.kind) {
            let (v, m) = match same("round_robin") {
                Some(rr) if rr.ok > 0 && d.ok > 0 => (
                    Some(d.ttft_ms.p99 / rr.ttft_ms.p99.max(1e-9)),
                    format!("{:.1} vs {:.1} ms", d.ttft_ms.p99, rr.ttft_ms.p99),
                ),
                _ => (None, "round_robin did not run".to_string()),
            };
            push(
                "ttft_p99_vs_round_robin",
                format!("<= {}x", bounds::TTFT_P99_VS_ROUND_ROBIN),
                v,
                m,
                &|x| x <= bounds::TTFT_P99_VS_ROUND_ROBIN,
            );
        }
        let (v, m) = ratio(&|r| r.e2e_ms.p50, true, "ms");
        push(
            "e2e_p50_vs_best",
            format!("<= {}x", bounds::E2E_P50_VS_BEST),
            v,
            m,
            &|x| x <= bounds::E2E_P50_VS_BEST,
        );
        let (v, m) = ratio(&|r| r.requests_per_s, false, "req/s");
        let m = match best(&|r| r.requests_per_s, false) {
            Some(b) if v.is_some() => format!(
                "{m}; {:.0} vs {:.0} output tok/s",
                d.output_tokens_per_s, b.output_tokens_per_s
            ),
            _ => m,
        };
        push(
            "throughput_vs_best",
            format!(">= {}x", bounds::THROUGHPUT_VS_BEST),
            v,
            m,
            &|x| x >= bounds::THROUGHPUT_VS_BEST,
        );
        let m = match &d.oracle {
            Some(o) => format!("{} of {}", pct(d.hit_rate), pct(o.hit_rate)),
            None => "no oracle".into(),
        };
        push(
            "hit_rate_of_oracle",
            format!(">= {}x", bounds::HIT_RATE_OF_ORACLE),
            d.fraction_of_oracle,
            m,
            &|x| x >= bounds::HIT_RATE_OF_ORACLE,
        );
        push(
            "prefill_imbalance",
            format!("<= {}x", bounds::PREFILL_IMBALANCE),
            (d.ok > 0).then_some(d.prefill_imbalance),
            format!("requests {:.2}x", d.request_imbalance),
            &|x| x <= bounds::PREFILL_IMBALANCE,
        );
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

/// Target labels and the column headings of the targets table.
const TAIL_COLUMNS: [(&str, &str); 6] = [
    ("ttft_p99_vs_best", "TTFT p99 / best baseline"),
    ("ttft_p99_vs_round_robin", "TTFT p99 / round_robin"),
    ("e2e_p50_vs_best", "E2E p50 / best baseline"),
    ("throughput_vs_best", "req/s / best baseline"),
    ("hit_rate_of_oracle", "hit rate / oracle"),
    ("prefill_imbalance", "busiest/mean prefill"),
];

/// Workload names and, per workload, mode labels, in run order.
fn workloads_and_modes(runs: &[RunReport]) -> Vec<(&str, Vec<&str>)> {
    let mut out: Vec<(&str, Vec<&str>)> = Vec::new();
    for r in runs {
        match out.iter_mut().find(|(w, _)| *w == r.workload) {
            Some((_, modes)) => {
                if !modes.contains(&r.mode.as_str()) {
                    modes.push(&r.mode);
                }
            }
            None => out.push((&r.workload, vec![&r.mode])),
        }
    }
    out
}

fn mode_description(r: &RunReport, capacity: Option<f64>) -> String {
    match (r.load, r.level, capacity) {
        (Load::Concurrency(c), _, _) => format!("closed loop, {c} concurrent clients"),
        (Load::Rate(x), Some(f), Some(cap)) => {
            format!("open loop, Poisson {x} req/s = {f} x {cap:.1} req/s capacity")
        }
        (Load::Rate(x), _, _) => format!("open loop, Poisson {x} req/s"),
    }
}

/// The issue-11 targets as one table per workload: a row per mode, a column per target.
fn tail_targets_markdown(result: &BenchResult, s: &mut String) {
    let _ = writeln!(
        s,
        "## Targets: {} against the best of {}\n",
        result.default_policy,
        result.baselines.join(", ")
    );
    if result.tail_targets.is_empty() {
        let _ = writeln!(
            s,
            "Not computed: `{}` did not run{}.\n",
            result.default_policy,
            if result
                .skipped
                .iter()
                .any(|k| k.policy == result.default_policy)
            {
                " (the gateway refused it)"
            } else {
                ""
            }
        );
        return;
    }
    let _ = writeln!(
        s,
        "Each cell: the ratio, met or missed against the bound in the heading, and the figures it is computed from. \
         *Best baseline*: the best of {} in the same workload and mode (lowest latency, highest throughput).\n",
        result.baselines.join(", ")
    );
    let mut workloads: Vec<&str> = Vec::new();
    for t in &result.tail_targets {
        if !workloads.contains(&t.workload.as_str()) {
            workloads.push(&t.workload);
        }
    }
    for w in workloads {
        let rows: Vec<&TailTarget> = result
            .tail_targets
            .iter()
            .filter(|t| t.workload == w)
            .collect();
        let columns: Vec<(&str, &str)> = TAIL_COLUMNS
            .iter()
            .copied()
            .filter(|(k, _)| rows.iter().any(|t| t.target == *k))
            .collect();
        let bound_of = |k: &str| {
            rows.iter()
                .find(|t| t.target == k)
                .map_or(String::new(), |t| t.bound.clone())
        };
        let _ = writeln!(
            s,
            "**{w}**\n\n| mode | {} |\n|---|{}",
            columns
                .iter()
                .map(|(k, h)| format!("{h} ({})", bound_of(k)))
                .collect::<Vec<_>>()
                .join(" | "),
            "---|".repeat(columns.len())
        );
        let mut modes: Vec<&str> = Vec::new();
        for t in &rows {
            if !modes.contains(&t.mode.as_str()) {
                modes.push(&t.mode);
            }
        }
        for m in modes {
            let cells: Vec<String> = columns
                .iter()
                .map(
                    |(k, _)| match rows.iter().find(|t| t.mode == m && t.target == *k) {
                        Some(t) => match (t.value, t.met) {
                            (Some(v), Some(true)) => format!("{v:.2}x met: {}", t.measured),
                            (Some(v), _) => format!("**{v:.2}x missed**: {}", t.measured),
                            _ => format!("-: {}", t.measured),
                        },
                        None => "-".into(),
                    },
                )
                .collect();
            let _ = writeln!(s, "| {m} | {} |", cells.join(" | "));
        }
        let _ = writeln!(s);
    }
}

/// The markdown tables of a result: the targets, one table per workload and mode, the overhead.
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
    for k in &result.skipped {
        let _ = writeln!(
            s,
            "Not run: `{}`, refused by the gateway ({}).\n",
            k.policy, k.reason
        );
    }
    if !result.capacity_rps.is_empty() {
        let caps: Vec<String> = result
            .capacity_rps
            .iter()
            .map(|(w, c)| format!("{w} {c:.1} req/s"))
            .collect();
        let _ = writeln!(
            s,
            "Capacity the open-loop levels are fractions of: {}.\n",
            caps.join(", ")
        );
    }
    tail_targets_markdown(result, &mut s);
    if result.targets.iter().any(|v| v.met.is_some()) {
        let _ = writeln!(
            s,
            "## Target figures of issue 7\n\n| target | measured | verdict |\n|---|---|---|"
        );
        for v in result.targets.iter().filter(|v| v.met.is_some()) {
            let verdict = if v.met == Some(true) {
                "met"
            } else {
                "**missed**"
            };
            let _ = writeln!(s, "| {} | {} | {} |", v.target, v.measured, verdict);
        }
    }
    for (w, modes) in workloads_and_modes(&result.runs) {
        let first = result
            .runs
            .iter()
            .find(|r| r.workload == w)
            .expect("a workload has runs");
        let _ = writeln!(s, "\n## {w} (`{}`)\n", first.kind);
        if let Some(o) = &first.oracle {
            let _ = writeln!(
                s,
                "Oracle bound: **{}** hit rate (unbounded cache: {}); working set {} blocks, fleet holds {} blocks.",
                pct(o.hit_rate),
                pct(o.unbounded.rate()),
                o.working_set_blocks,
                o.fleet_blocks
            );
        }
        for m in modes {
            let runs: Vec<&RunReport> = result
                .runs
                .iter()
                .filter(|r| r.workload == w && r.mode == m)
                .collect();
            let _ = writeln!(
                s,
                "\n### {w}, {m} ({}, time scale {})\n",
                mode_description(runs[0], result.capacity_rps.get(w).copied()),
                runs[0].time_scale
            );
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
                "| policy | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 | req/s | out tok/s | hit rate | of oracle | busiest/mean prefill | busiest/mean req | TTFT p90 | TTFT p99.9 | backend TTFT p50 / p99 | TPOT p50 | preempted | ok / sent |"
            );
            let _ = writeln!(
                s,
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
            );
            for r in runs {
                let _ = writeln!(
                    s,
                    "| {} | {:.1} | {:.1} | {:.0} | {:.0} | {:.1} | {:.0} | {} | {} | {:.2} | {:.2} | {:.1} | {:.1} | {} | {:.2} | {:.0} | {} / {} |",
                    r.policy,
                    r.ttft_ms.p50,
                    r.ttft_ms.p99,
                    r.e2e_ms.p50,
                    r.e2e_ms.p99,
                    r.requests_per_s,
                    r.output_tokens_per_s,
                    pct(r.hit_rate),
                    r.fraction_of_oracle.map_or("-".into(), pct),
                    r.prefill_imbalance,
                    r.request_imbalance,
                    r.ttft_ms.p90,
                    r.ttft_ms.p999,
                    r.backend_ttft_ms
                        .map_or("-".into(), |b| format!("{:.1} / {:.1}", b.p50, b.p99)),
                    r.tpot_ms.p50,
                    r.fleet.preemptions,
                    r.ok,
                    r.sent
                );
            }
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
    for (file, what) in chart_files(result) {
        let _ = writeln!(s, "![{what}]({chart_prefix}{file})\n");
    }
    s
}

/// The chart files (suffixes after the prefix) a result has, and their captions.
pub fn chart_files(result: &BenchResult) -> Vec<(String, String)> {
    let mut out = vec![
        (
            "hit-rate.svg".to_string(),
            "prefix-cache hit rate per policy against the oracle".to_string(),
        ),
        (
            "ttft-p99.svg".into(),
            "p99 time to first token per policy".into(),
        ),
        (
            "balance.svg".into(),
            "busiest backend over mean, computed prompt tokens".into(),
        ),
    ];
    for w in sweep_workloads(&result.runs) {
        out.push((
            format!("{w}-ttft-p99-vs-load.svg"),
            format!("{w}: p99 time to first token against offered load"),
        ));
    }
    if !result.overhead.is_empty() {
        out.push(("overhead.svg".into(), "gateway added latency".into()));
    }
    out
}

/// Workloads with open-loop sweep runs (levels of a capacity).
fn sweep_workloads(runs: &[RunReport]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in runs.iter().filter(|r| r.level.is_some()) {
        if !out.contains(&r.workload) {
            out.push(r.workload.clone());
        }
    }
    out
}

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
    let width = (groups.len() * series.len().max(1) * 16 + 240).clamp(960, 2400) as u32;
    let root = SVGBackend::new(path, (width, 520)).into_drawing_area();
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

/// A line chart of TTFT p99 against offered load: one line per policy, a point per level.
pub fn ttft_vs_load(
    path: &Path,
    title: &str,
    lines: &[(String, Vec<(f64, f64)>)],
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let root = SVGBackend::new(path, (960, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let points = || lines.iter().flat_map(|(_, v)| v.iter().copied());
    let x_max = points().map(|p| p.0).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let y_max = points().map(|p| p.1).fold(0.0f64, f64::max).max(1e-9) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("offered load, requests per second (open loop, Poisson)")
        .y_desc("TTFT p99, ms (wall clock)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (name, pts)) in lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let mut pts = pts.clone();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Writes the charts of [`chart_files`] as `<prefix><file>` into `dir`.
pub fn charts(result: &BenchResult, dir: &Path, prefix: &str) -> Result<(), String> {
    let mut groups: Vec<(String, String)> = Vec::new();
    let mut policies: Vec<String> = Vec::new();
    for r in &result.runs {
        let key = (r.workload.clone(), r.mode.clone());
        if !groups.contains(&key) {
            groups.push(key);
        }
        if !policies.contains(&r.policy) {
            policies.push(r.policy.clone());
        }
    }
    let label = |(w, m): &(String, String)| format!("{w} {m}");
    let run = |(w, m): &(String, String), p: &str| {
        result
            .runs
            .iter()
            .find(|r| &r.workload == w && &r.mode == m && r.policy == p)
    };
    let by_policy =
        |gs: &[(String, String)], f: &dyn Fn(&RunReport) -> f64| -> Vec<(String, Vec<f64>)> {
            policies
                .iter()
                .map(|p| {
                    (
                        p.clone(),
                        gs.iter().map(|g| run(g, p).map_or(0.0, f)).collect(),
                    )
                })
                .collect()
        };
    let oracle_of = |g: &(String, String)| {
        result
            .runs
            .iter()
            .find(|r| r.workload == g.0 && r.mode == g.1)
            .and_then(|r| r.oracle.as_ref())
            .map_or(0.0, |o| o.hit_rate)
    };
    let cache_groups: Vec<(String, String)> = groups
        .iter()
        .filter(|g| oracle_of(g) > 0.01)
        .cloned()
        .collect();
    grouped_bars(
        &dir.join(format!("{prefix}hit-rate.svg")),
        "Prefix-cache hit rate (fleet /metrics) vs oracle",
        "hit rate, % of prompt tokens",
        &cache_groups.iter().map(label).collect::<Vec<_>>(),
        &by_policy(&cache_groups, &|r| r.hit_rate * 100.0),
        Some((
            "oracle",
            cache_groups.iter().map(|g| oracle_of(g) * 100.0).collect(),
        )),
        None,
    )?;
    let labels: Vec<String> = groups.iter().map(label).collect();
    grouped_bars(
        &dir.join(format!("{prefix}ttft-p99.svg")),
        "p99 time to first token (long-short: short requests)",
        "ms (wall clock)",
        &labels,
        &by_policy(&groups, &|r| r.ttft_short_ms.unwrap_or(r.ttft_ms).p99),
        None,
        None,
    )?;
    grouped_bars(
        &dir.join(format!("{prefix}balance.svg")),
        "Busiest backend / mean (computed prompt tokens)",
        "ratio",
        &labels,
        &by_policy(&groups, &|r| r.prefill_imbalance),
        None,
        Some(1.3),
    )?;
    for w in sweep_workloads(&result.runs) {
        let lines: Vec<(String, Vec<(f64, f64)>)> = policies
            .iter()
            .map(|p| {
                let pts = result
                    .runs
                    .iter()
                    .filter(|r| r.workload == w && &r.policy == p && r.level.is_some() && r.ok > 0)
                    .filter_map(|r| match r.load {
                        Load::Rate(x) => Some((x, r.ttft_ms.p99)),
                        Load::Concurrency(_) => None,
                    })
                    .collect();
                (p.clone(), pts)
            })
            .filter(|(_, pts): &(String, Vec<(f64, f64)>)| !pts.is_empty())
            .collect();
        let cap = result
            .capacity_rps
            .get(&w)
            .map_or(String::new(), |c| format!(", capacity {c:.1} req/s"));
        ttft_vs_load(
            &dir.join(format!("{prefix}{w}-ttft-p99-vs-load.svg")),
            &format!("{w}: TTFT p99 vs offered load{cap}"),
            &lines,
        )?;
    }
    if !result.overhead.is_empty() {
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
    }
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
                kind: "no-sharing",
                mode: "open-1rps",
                policy: "p",
                load: Load::Rate(1.0),
                level: None,
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
                    kind: w,
                    mode: "open-1rps",
                    policy: p,
                    load: Load::Rate(1.0),
                    level: None,
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

    /// A run of `policy` in `mode` with the given figures.
    #[allow(clippy::too_many_arguments)]
    fn run(
        workload: &str,
        kind: &str,
        mode: &str,
        policy: &str,
        ttft_p99: f64,
        e2e_p50: f64,
        rps: f64,
        prefill: [f64; 2],
    ) -> RunReport {
        let backends = [
            (
                "a".to_string(),
                Counters {
                    prefix_queries: 1000.0,
                    prefix_hits: 1000.0 - prefill[0],
                    ..Counters::default()
                },
            ),
            (
                "b".to_string(),
                Counters {
                    prefix_queries: 1000.0,
                    prefix_hits: 1000.0 - prefill[1],
                    ..Counters::default()
                },
            ),
        ];
        let oracle = OracleBound {
            fleet_blocks: 10,
            working_set_blocks: 5,
            unbounded: crate::oracle::HitCount::default(),
            fleet: crate::oracle::HitCount::default(),
            hit_rate: 0.9,
        };
        let mut r = summarize(
            RunLabel {
                workload,
                kind,
                mode,
                policy,
                load: Load::Rate(rps),
                level: Some(0.9),
                time_scale: 1.0,
            },
            &[rec("a", 1.0)],
            1.0,
            &backends,
            Some(oracle),
        );
        r.ttft_ms.p99 = ttft_p99;
        r.e2e_ms.p50 = e2e_p50;
        r.requests_per_s = rps;
        r
    }

    #[test]
    fn tail_targets_compare_the_default_with_the_best_baseline() {
        let baselines: Vec<String> = ["round_robin", "least_load", "consistent_hash"]
            .map(String::from)
            .to_vec();
        let g = |p: &str, ttft: f64, e2e: f64, rps: f64, prefill: [f64; 2]| {
            run(
                "groups",
                "prefix-groups",
                "open-0.9",
                p,
                ttft,
                e2e,
                rps,
                prefill,
            )
        };
        let runs = vec![
            g("round_robin", 500.0, 900.0, 40.0, [500.0, 500.0]),
            g("least_load", 200.0, 600.0, 41.0, [100.0, 100.0]),
            g("consistent_hash", 300.0, 500.0, 39.0, [100.0, 100.0]),
            // predicted: 150 ms p99 (0.75x least_load's, 0.30x round robin's), e2e p50 520 vs
            // the best 500 (1.04x), 40 vs the best 41 req/s (0.976x), prefill 120 vs 80 tokens
            // on its two backends (1.2x the mean), hit rate 100 - 10% = 90% = the oracle's.
            g("predicted_latency", 150.0, 520.0, 40.0, [120.0, 80.0]),
            run(
                "chat",
                "multi-turn",
                "closed-64",
                "predicted_latency",
                100.0,
                500.0,
                30.0,
                [200.0, 100.0],
            ),
            run(
                "chat",
                "multi-turn",
                "closed-64",
                "least_load",
                110.0,
                400.0,
                30.0,
                [100.0, 100.0],
            ),
        ];
        let t = tail_targets(&runs, "predicted_latency", &baselines);
        let get = |w: &str, k: &str| {
            t.iter()
                .find(|x| x.workload == w && x.target == k)
                .unwrap_or_else(|| panic!("{w} {k}: {t:?}"))
        };
        let close = |a: Option<f64>, b: f64| (a.unwrap() - b).abs() < 1e-9;
        let x = get("groups", "ttft_p99_vs_best");
        assert!(close(x.value, 0.75) && x.met == Some(true), "{x:?}");
        assert!(x.measured.contains("least_load"), "{}", x.measured);
        let x = get("groups", "ttft_p99_vs_round_robin");
        assert!(close(x.value, 0.3) && x.met == Some(true), "{x:?}");
        let x = get("groups", "e2e_p50_vs_best");
        assert!(
            close(x.value, 520.0 / 500.0) && x.met == Some(true),
            "{x:?}"
        );
        assert!(x.measured.contains("consistent_hash"));
        let x = get("groups", "throughput_vs_best");
        assert!(close(x.value, 40.0 / 41.0) && x.met == Some(true), "{x:?}");
        let x = get("groups", "hit_rate_of_oracle");
        assert!(close(x.value, 0.9 / 0.9) && x.met == Some(true), "{x:?}");
        let x = get("groups", "prefill_imbalance");
        assert!(close(x.value, 1.2) && x.met == Some(true), "{x:?}");
        // Chat: only least_load ran as a baseline; no round_robin target on a chat workload.
        let x = get("chat", "ttft_p99_vs_best");
        assert!(
            close(x.value, 100.0 / 110.0) && x.met == Some(false),
            "{x:?}"
        );
        assert!(get("chat", "e2e_p50_vs_best").met == Some(false));
        assert!(get("chat", "prefill_imbalance").met == Some(false));
        assert!(!t
            .iter()
            .any(|x| x.workload == "chat" && x.target == "ttft_p99_vs_round_robin"));
        // Without the default policy there is nothing to compute.
        assert!(tail_targets(&runs[..3], "predicted_latency", &baselines).is_empty());
    }

    #[test]
    fn markdown_and_charts_cover_every_mode_and_the_sweep() {
        let mut runs = Vec::new();
        for (mode, rate, level) in [("open-0.5", 20.0, 0.5), ("open-0.9", 36.0, 0.9)] {
            for (p, ttft) in [("round_robin", 300.0), ("predicted_latency", 100.0)] {
                let mut r = run(
                    "groups",
                    "prefix-groups",
                    mode,
                    p,
                    ttft * level,
                    400.0,
                    rate,
                    [10.0, 10.0],
                );
                r.load = Load::Rate(rate);
                r.level = Some(level);
                runs.push(r);
            }
        }
        let result = BenchResult {
            name: "test".into(),
            started: "now".into(),
            machine: BTreeMap::new(),
            config: serde_json::Value::Null,
            targets: verdicts(&runs),
            default_policy: "predicted_latency".into(),
            baselines: vec!["round_robin".into()],
            tail_targets: tail_targets(&runs, "predicted_latency", &["round_robin".into()]),
            capacity_rps: BTreeMap::from([("groups".to_string(), 40.0)]),
            skipped: vec![Skipped {
                policy: "power_of_two".into(),
                reason: "HTTP 400".into(),
            }],
            runs,
            overhead: vec![],
        };
        let md = markdown(&result, "x-");
        assert!(md.contains("## Targets: predicted_latency against the best of round_robin"));
        assert!(
            md.contains("| open-0.5 | 0.33x met: 50.0 vs 150.0 ms (round_robin) |"),
            "{md}"
        );
        assert!(md.contains(
            "### groups, open-0.9 (open loop, Poisson 36 req/s = 0.9 x 40.0 req/s capacity"
        ));
        assert!(md.contains("Not run: `power_of_two`"));
        assert!(
            !md.contains("issue 7"),
            "no classic verdicts without their runs"
        );
        assert!(md.contains("x-groups-ttft-p99-vs-load.svg"));
        let dir = std::env::temp_dir().join(format!("loadgen-charts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        charts(&result, &dir, "x-").unwrap();
        for (file, _) in chart_files(&result) {
            let svg = std::fs::read_to_string(dir.join(format!("x-{file}"))).unwrap();
            assert!(svg.starts_with("<svg"), "{file}");
        }
        let sweep = std::fs::read_to_string(dir.join("x-groups-ttft-p99-vs-load.svg")).unwrap();
        assert!(sweep.contains("predicted_latency") && sweep.contains("<circle"));
        assert!(!dir.join("x-overhead.svg").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
