//! The benchmark's markdown document: the targets table, then per workload and mode the policies'
//! figures, the overhead measurement, and links to the charts.

use super::charts::chart_files;
use super::format::{load_label, pct};
use super::result::BenchResult;
use super::run::RunReport;
use super::targets::TailTarget;
use crate::driver::Load;
use std::fmt::Write as _;

/// Target labels and the column headings of the targets table.
const TAIL_COLUMNS: [(&str, &str); 7] = [
    ("ttft_p99_vs_best", "TTFT p99 / best baseline"),
    (
        "engine_ttft_p99_vs_best",
        "engine-side TTFT p99 / best baseline",
    ),
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
        (Load::Replay(x), _, _) => format!("trace replay at {x}x its arrival rate"),
    }
}

/// The runs of one workload and mode.
fn runs_of<'a>(result: &'a BenchResult, w: &str, m: &str) -> Vec<&'a RunReport> {
    result
        .runs
        .iter()
        .filter(|r| r.workload == w && r.mode == m)
        .collect()
}

/// The runs through other APIs beside their chat run: per workload they sent and mode, the chat
/// run of the same policy, then each other API's, with the hit rate (the fleet's counters and the
/// answers' usage) and the client's TTFT.
fn apis_markdown(result: &BenchResult, s: &mut String) {
    let others: Vec<&RunReport> = result.runs.iter().filter(|r| r.api_of.is_some()).collect();
    if others.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "## The same conversations through chat, Responses and Messages\n\n\
         Each workload's sessions sent as chat completions, as Responses requests (the whole \
         history as `input` items, `store: false`) and as Messages requests, each on a fresh \
         fleet under the same policy. Hit rate: the fleet's prefix-cache counters; usage hit \
         rate: the answers' cached over prompt tokens (`prompt_tokens_details.cached_tokens`, \
         `input_tokens_details.cached_tokens`, `cache_read_input_tokens`).\n"
    );
    let _ = writeln!(
        s,
        "| workload | mode | policy | API | hit rate | usage hit rate | TTFT p50 | TTFT p99 | E2E p50 | req/s | ok / sent |
|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let mut seen: Vec<(&str, &str, &str)> = Vec::new();
    for o in &others {
        let base = o.api_of.as_deref().unwrap_or_default();
        let key = (base, o.mode.as_str(), o.policy.as_str());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        let chat = result
            .runs
            .iter()
            .filter(|r| r.workload == base && r.mode == o.mode && r.policy == o.policy);
        let through = others.iter().copied().filter(|r| {
            r.api_of.as_deref() == Some(base) && r.mode == o.mode && r.policy == o.policy
        });
        for r in chat.chain(through) {
            let _ = writeln!(
                s,
                "| {base} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.1} | {} / {} |",
                r.mode,
                r.policy,
                r.api.name(),
                pct(r.hit_rate),
                pct(r.usage_hit_rate),
                r.ttft_ms.p50,
                r.ttft_ms.p99,
                r.e2e_ms.p50,
                r.requests_per_s,
                r.ok,
                r.sent
            );
        }
    }
    let _ = writeln!(s);
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
    apis_markdown(result, &mut s);
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
                mode_description(
                    runs[0],
                    // A run through another API was offered its chat workload's load.
                    result
                        .capacity_rps
                        .get(runs[0].api_of.as_deref().unwrap_or(w))
                        .copied()
                ),
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
            super::trace::markdown_section(&runs_of(result, w, m), &mut s);
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
