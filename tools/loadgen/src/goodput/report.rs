//! The goodput benchmark's outputs: the JSON document, the markdown tables (per trace: each
//! router's highest sustained speed-up with its throughput, hit rate and p99s, then every probe),
//! and one SVG per trace with TTFT p99 and e2e p99 against the replay speed-up per router, the
//! SLO's bounds dashed.

use super::slo::{Point, Spread};
use super::{GoodputResult, TraceResult};
use crate::report::{draw_lines, Axes};
use plotters::prelude::*;
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// Writes `<dir>/<stem>.json`, `<stem>.md` and `<stem>-<trace>.svg` per trace; returns the JSON
/// file's path.
pub fn write(result: &GoodputResult, dir: &Path, stem: &str) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let json = dir.join(format!("{stem}.json"));
    let text = serde_json::to_string_pretty(result).map_err(|e| e.to_string())?;
    std::fs::write(&json, text).map_err(|e| format!("{}: {e}", json.display()))?;
    for t in &result.traces {
        chart(t, &dir.join(chart_file(stem, t)))?;
    }
    let md = dir.join(format!("{stem}.md"));
    std::fs::write(&md, markdown(result, stem)).map_err(|e| format!("{}: {e}", md.display()))?;
    eprint!("{}", summary(result));
    Ok(json)
}

fn chart_file(stem: &str, t: &TraceResult) -> String {
    format!("{stem}-{}.svg", t.workload)
}

/// A latency in ms for the tables: `failed` when infinite.
fn ms(v: f64) -> String {
    if v.is_infinite() {
        "failed".into()
    } else {
        format!("{v:.0}")
    }
}

/// A median with its spread: `950 (900-1,200)`, or just the median for one window.
fn spread(s: &Spread) -> String {
    if s.min == s.max {
        ms(s.median)
    } else {
        format!("{} ({}-{})", ms(s.median), ms(s.min), ms(s.max))
    }
}

/// The one-line verdict of a point.
fn verdict(p: &Point) -> String {
    if p.held() {
        "held".into()
    } else {
        format!("broken: {}", p.broken())
    }
}

/// The per-trace summary table (also printed at the end of a run).
fn summary(result: &GoodputResult) -> String {
    let mut out = String::new();
    for t in &result.traces {
        let b = &t.bounds;
        let _ = writeln!(
            out,
            "\n{}: SLO TTFT p99 <= {:.0} ms, e2e p99 <= {:.0} ms; {} window(s) per load\n",
            t.workload,
            b.ttft_p99_ms,
            b.e2e_p99_ms,
            t.windows.len()
        );
        out.push_str("| router | highest sustained speed-up | req/s | output tok/s | hit rate | TTFT p99 ms | e2e p99 ms | lowest broken | probes |\n");
        out.push_str("|---|---|---|---|---|---|---|---|---|\n");
        for r in &t.routers {
            if let Some(reason) = &r.skipped {
                let _ = writeln!(out, "| {} | not run: {reason} | | | | | | | |", r.router);
                continue;
            }
            let broken = r.broken().map_or("none".to_string(), |p| {
                format!("x{} ({})", p.speedup, p.broken())
            });
            let probes = r.points.len();
            match r.sustained() {
                Some(p) => {
                    let _ = writeln!(
                        out,
                        "| {} | x{} | {:.1} | {:.0} | {:.1}% | {} | {} | {broken} | {probes} |",
                        r.router,
                        p.speedup,
                        p.requests_per_s,
                        p.output_tokens_per_s,
                        p.hit_rate * 100.0,
                        spread(&p.ttft_p99_ms),
                        spread(&p.e2e_p99_ms),
                    );
                }
                None => {
                    let _ = writeln!(
                        out,
                        "| {} | none (below x{}) | | | | | | {broken} | {probes} |",
                        r.router, result.plan.search.min
                    );
                }
            }
        }
    }
    out
}

/// The markdown document.
pub fn markdown(result: &GoodputResult, stem: &str) -> String {
    let mut out = String::new();
    let c = &result.config;
    let _ = writeln!(
        out,
        "# Goodput: the highest replay speed-up within the SLO ({})\n",
        result.started
    );
    if result.name.ends_with("quick") {
        out.push_str("**Smoke run (`--quick`): short windows, few probes; these figures show that the pipeline works, not how the routers compare.**\n\n");
    }
    let m = &result.machine;
    let _ = writeln!(
        out,
        "`{}` on {} cores ({}), {:.0} s. Bench config `{}` (fleet, seed, trace windows); {} window(s) per load (window i starts i x the window's requests later in the trace; the figures of a load are the median over its windows, with the lowest and highest in brackets); {}; every window on a fresh fleet and a re-registered pool (or a fresh external router).\n",
        result.command,
        m.get("nproc").map_or("?", String::as_str),
        m.get("cpu").map_or("?", String::as_str),
        result.seconds,
        c.bench.display(),
        result.plan.windows,
        if result.plan.at.is_empty() {
            format!(
                "search: start at the config's lowest speed-up, x{} per step while the SLO holds (/{} while it does not), then geometric bisection, at most {} probes, stop within {}%",
                c.search.growth,
                c.search.growth,
                result.plan.search.steps,
                c.search.tolerance * 100.0,
            )
        } else {
            let at: Vec<String> = result.plan.at.iter().map(|x| format!("x{x}")).collect();
            format!(
                "a screen, not a search: every router probed at {} only (its highest sustained load is the highest of these below every broken one)",
                at.join(", ")
            )
        },
    );
    let _ = writeln!(
        out,
        "SLO: TTFT p99 <= {}x and e2e p99 <= {}x the p{} of the windows' requests' own figures on an idle fleet (vllm-sim's cost model: each request's uncached prefill and one step; for e2e, one more step per output token). Failed requests count as infinitely slow.\n",
        c.slo.ttft_p99_factor, c.slo.e2e_p99_factor, c.slo.reference_percentile
    );
    out.push_str(&summary(result));
    for t in &result.traces {
        let b = &t.bounds;
        let _ = writeln!(
            out,
            "\n## {}\n\nBounds: idle TTFT of the p{} request {:.0} ms (of the median prompt: {:.0} ms), idle e2e {:.0} ms; TTFT p99 <= {:.0} ms, e2e p99 <= {:.0} ms. Windows (first request, requests): {:?}.\n",
            t.workload,
            c.slo.reference_percentile,
            b.idle_ttft_ms,
            b.median_prompt_idle_ttft_ms,
            b.idle_e2e_ms,
            b.ttft_p99_ms,
            b.e2e_p99_ms,
            t.windows
        );
        let _ = writeln!(
            out,
            "![TTFT p99 and e2e p99 against the speed-up]({})\n",
            chart_file(stem, t)
        );
        out.push_str("| router | speed-up | TTFT p99 ms | e2e p99 ms | req/s | output tok/s | hit rate | failed | SLO |\n|---|---|---|---|---|---|---|---|---|\n");
        for r in &t.routers {
            for p in &r.points {
                let _ = writeln!(
                    out,
                    "| {} | x{} | {} | {} | {:.1} | {:.0} | {:.1}% | {} | {} |",
                    r.router,
                    p.speedup,
                    spread(&p.ttft_p99_ms),
                    spread(&p.e2e_p99_ms),
                    p.requests_per_s,
                    p.output_tokens_per_s,
                    p.hit_rate * 100.0,
                    p.failed,
                    verdict(p)
                );
            }
        }
    }
    out
}

/// One panel of a chart: what it shows, its y axis, the figure of a point, the SLO's bound.
type Panel<'a> = (&'a str, &'a str, fn(&Point) -> f64, f64);

/// TTFT p99 (left) and e2e p99 (right) against the speed-up, a line per router, the bounds dashed.
fn chart(t: &TraceResult, path: &Path) -> Result<(), String> {
    let root = SVGBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((1, 2));
    let lines = |f: fn(&Point) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        t.routers
            .iter()
            .filter(|r| !r.points.is_empty())
            .map(|r| {
                let pts = r.points.iter().map(|p| (p.speedup, f(p))).collect();
                (r.router.clone(), pts)
            })
            .collect()
    };
    let panels_of: [Panel; 2] = [
        (
            "TTFT p99",
            "TTFT p99, ms",
            |p| p.ttft_p99_ms.median,
            t.bounds.ttft_p99_ms,
        ),
        (
            "e2e p99",
            "e2e p99, ms",
            |p| p.e2e_p99_ms.median,
            t.bounds.e2e_p99_ms,
        ),
    ];
    for (area, (what, y_desc, f, bound)) in panels.iter().zip(panels_of) {
        let title = format!("{}: {what} (median of windows)", t.workload);
        let axes = Axes {
            title: &title,
            x_desc: "replay speed-up",
            y_desc,
        };
        draw_lines(area, &axes, &lines(f), &[("SLO bound".into(), bound)])?;
    }
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::super::slo::fixtures::{bounds, window};
    use super::super::RouterResult;
    use super::*;

    #[test]
    fn the_chart_and_the_spread_cells() {
        let bounds = bounds();
        let w = |ttft: f64, e2e: f64| window(ttft, e2e, 20.0);
        let points = vec![
            Point::of(8.0, vec![w(600.0, 1100.0), w(650.0, 1200.0)], &bounds),
            Point::of(
                16.0,
                vec![w(900.0, 2000.0), w(f64::INFINITY, 2100.0)],
                &bounds,
            ),
        ];
        assert_eq!(spread(&points[0].ttft_p99_ms), "625 (600-650)");
        assert_eq!(spread(&points[1].ttft_p99_ms), "failed (900-failed)");
        assert_eq!(verdict(&points[1]), "broken: TTFT+e2e");
        let t = TraceResult {
            workload: "conv".into(),
            windows: vec![(0, 100), (100, 100)],
            start_speedup: 8.0,
            bounds,
            routers: vec![RouterResult {
                router: "predicted_latency".into(),
                kind: "gateway",
                skipped: None,
                sustained_speedup: Some(8.0),
                broken_speedup: Some(16.0),
                points,
            }],
        };
        let dir = std::env::temp_dir().join(format!("goodput-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(chart_file("stem", &t));
        chart(&t, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("SLO bound") && svg.contains("predicted_latency"));
        assert!(svg.contains("conv: TTFT p99") && svg.contains("conv: e2e p99"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
