//! The benchmark's SVG charts (plotters): hit rate against the oracle, TTFT p99 and balance per
//! policy, TTFT p99 against offered load for every open-loop sweep, and the gateway's overhead.

use super::format::load_label;
use super::result::BenchResult;
use super::run::RunReport;
use crate::driver::Load;
use plotters::prelude::*;
use std::path::Path;

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
    for (w, m) in trace_modes(&result.runs) {
        out.push((
            format!("{w}-{m}-ttft-cdf.svg"),
            format!("{w} {m}: TTFT distribution per policy"),
        ));
    }
    if !result.overhead.is_empty() {
        out.push(("overhead.svg".into(), "gateway added latency".into()));
    }
    out
}

/// (workload, mode) pairs of trace replays, in run order.
fn trace_modes(runs: &[RunReport]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for r in runs.iter().filter(|r| r.trace.is_some()) {
        let key = (r.workload.clone(), r.mode.clone());
        if !out.contains(&key) {
            out.push(key);
        }
    }
    out
}

/// The TTFT distribution of each policy (fraction of sent requests answered within x ms, x on a
/// log scale): a line that ends below 1 is a policy whose requests failed.
pub fn ttft_cdf(
    path: &Path,
    title: &str,
    lines: &[(String, Vec<(f64, f64)>)],
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let root = SVGBackend::new(path, (960, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let xs = || lines.iter().flat_map(|(_, v)| v.iter().map(|p| p.0));
    let x_min = xs().fold(f64::INFINITY, f64::min).clamp(1.0, 1e6) * 0.8;
    let x_max = xs().fold(0.0f64, f64::max).max(x_min * 2.0) * 1.2;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d((x_min..x_max).log_scale(), 0f64..1.02f64)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("TTFT, ms (wall clock, log scale)")
        .y_desc("fraction of requests sent")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (name, pts)) in lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        // A step function: the fraction rises at each sample.
        let mut steps: Vec<(f64, f64)> = Vec::with_capacity(pts.len() * 2);
        let mut last = 0.0;
        for &(x, y) in pts {
            steps.push((x.max(x_min), last));
            steps.push((x.max(x_min), y));
            last = y;
        }
        steps.push((x_max, last));
        chart
            .draw_series(LineSeries::new(steps, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
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
    let root = SVGBackend::new(path, (960, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let axes = Axes {
        title,
        x_desc: "offered load, requests per second (open loop, Poisson)",
        y_desc: "TTFT p99, ms (wall clock)",
    };
    draw_lines(&root, &axes, lines, &[])?;
    root.present().map_err(|e| e.to_string())
}

/// The title and axis descriptions of a line chart.
pub struct Axes<'a> {
    /// The chart's caption.
    pub title: &'a str,
    /// What x is.
    pub x_desc: &'a str,
    /// What y is.
    pub y_desc: &'a str,
}

/// Draws one line per series (a point per value, sorted by x) on `area`, and each of `limits` as
/// a dashed black horizontal line with its label (an SLO's bound); non-finite points are left out.
/// The legend is at the upper left, or the lower right when there are bounds.
pub fn draw_lines<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    axes: &Axes,
    lines: &[(String, Vec<(f64, f64)>)],
    limits: &[(String, f64)],
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let finite = |p: &(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let points = || {
        lines
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .filter(finite)
    };
    let x_max = points().map(|p| p.0).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let y_max = points()
        .map(|p| p.1)
        .chain(limits.iter().map(|l| l.1).filter(|y| y.is_finite()))
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(axes.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(axes.x_desc)
        .y_desc(axes.y_desc)
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (name, pts)) in lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let mut pts: Vec<(f64, f64)> = pts.iter().copied().filter(finite).collect();
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
    for (name, y) in limits.iter().filter(|l| l.1.is_finite()) {
        // Dashes: short segments along the bound.
        let dashes = (0..40).map(|k| {
            let x0 = x_max * f64::from(k) / 40.0;
            PathElement::new(
                vec![(x0, *y), (x0 + x_max / 80.0, *y)],
                BLACK.stroke_width(2),
            )
        });
        chart
            .draw_series(dashes)
            .map_err(|e| err(&e))?
            .label(name.clone())
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 6, y)], BLACK.stroke_width(2)));
    }
    // Latencies rise with load: with a bound across the top, the legend goes to the lower right.
    let legend = if limits.is_empty() {
        SeriesLabelPosition::UpperLeft
    } else {
        SeriesLabelPosition::LowerRight
    };
    chart
        .configure_series_labels()
        .position(legend)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
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
                        Load::Concurrency(_) | Load::Replay(_) => None,
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
    for (w, m) in trace_modes(&result.runs) {
        let lines: Vec<(String, Vec<(f64, f64)>)> = result
            .runs
            .iter()
            .filter(|r| r.workload == w && r.mode == m)
            .filter_map(|r| Some((r.policy.clone(), r.trace.as_ref()?.ttft_cdf.clone())))
            .collect();
        ttft_cdf(
            &dir.join(format!("{prefix}{w}-{m}-ttft-cdf.svg")),
            &format!("{w} {m}: TTFT CDF (failed requests never arrive)"),
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
