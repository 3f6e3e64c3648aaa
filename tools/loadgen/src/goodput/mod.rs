//! `loadgen goodput` (`make bench-goodput`, issue 44): the most load each router serves within an
//! SLO. For every trace workload of a bench config (`bench/config/traces.json`) and every router
//! (each policy of the gateway, and external routers such as smg in front of the same fleet), it
//! raises the replay speed-up step by step and bisects ([`search`]) until the SLO breaks
//! ([`slo`]: TTFT p99 and e2e p99 within multiples of the window's idle figures, on the median of
//! several trace windows per load). Each window is one run of `loadgen bench`'s own machinery on a
//! fresh fleet ([`crate::bench::run`]); [`report`] writes `<date>-goodput.{json,md}` and a chart
//! per trace.

mod external;
mod report;
mod search;
mod slo;

use crate::bench::fleet::Fleet;
use crate::bench::gateway::Gateway;
use crate::bench::machine::{machine, utc_now};
use crate::bench::run::{measure, run_one};
use crate::bench::{BenchConfig, Harness, Mode, WorkloadRun};
use crate::client::Http;
use crate::driver::{Load, Target};
use crate::report::{IdleModel, RunReport};
use crate::workload::Workload;
use external::ExternalRouter;
use search::{Search, SearchConfig};
use serde::{Deserialize, Serialize};
use slo::{Point, SloBounds, SloConfig, WindowFigures};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The smoke mode's reductions (`--quick`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuickConfig {
    /// Requests per window.
    pub requests: usize,
    /// Windows per load.
    pub windows: usize,
    /// Probes per router and trace.
    pub steps: usize,
    /// The routers run.
    pub routers: Vec<String>,
}

/// A goodput configuration (`bench/config/goodput.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GoodputConfig {
    /// The bench config whose fleet, seed, policies and trace workloads are used; each workload
    /// starts its search at its lowest `replay_speedups` entry.
    pub bench: PathBuf,
    /// Trace windows per load: window `i` starts `i` x `requests` after the workload's `start`.
    pub windows: usize,
    /// The SLO.
    pub slo: SloConfig,
    /// The search over speed-ups.
    #[serde(default)]
    pub search: SearchConfig,
    /// Routers that are not policies of the gateway, run in front of the same fleet.
    #[serde(default)]
    pub external_routers: Vec<ExternalRouter>,
    /// The smoke mode.
    pub quick: QuickConfig,
}

impl GoodputConfig {
    /// Reads a config file and the bench config it names.
    pub fn load(path: &Path) -> Result<(GoodputConfig, BenchConfig), String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let cfg: GoodputConfig =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let bench = BenchConfig::load(&cfg.bench)?;
        if cfg.windows == 0 || cfg.quick.windows == 0 {
            return Err(format!("{}: windows must be at least 1", path.display()));
        }
        let s = &cfg.search;
        if !(s.growth > 1.0 && s.min > 0.0 && s.max >= s.min && s.steps > 0) {
            return Err(format!(
                "{}: search needs growth > 1, 0 < min <= max, steps > 0",
                path.display()
            ));
        }
        Ok((cfg, bench))
    }
}

/// Options of `loadgen goodput` besides the config.
pub struct GoodputOptions {
    /// The gateway, the fleet's binary, the output directories.
    pub harness: Harness,
    /// What runs, against the config's defaults.
    pub choices: Choices,
}

/// The command line's choices of what runs.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Choices {
    /// The smoke mode: the config's `quick` windows, probes and routers.
    #[arg(long)]
    pub quick: bool,
    /// Only these trace workloads, by name (default: all).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// These routers, in order, comma-separated: gateway policies (`name+{json}` with knobs,
    /// whose commas stay inside) or external routers' names (default: every policy of the bench
    /// config, then every external router).
    #[arg(long)]
    pub routers: Vec<String>,
    /// Trace windows per load (default: the config's).
    #[arg(long)]
    pub windows: Option<usize>,
    /// Probes per router and trace (default: the config's).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Requests per window (default: the workload's).
    #[arg(long)]
    pub requests: Option<usize>,
    /// A screen: probe exactly these speed-ups, in order, instead of searching (e.g. 19,20.7,22.6).
    #[arg(long, value_delimiter = ',')]
    pub at: Vec<f64>,
}

/// What was run, after the options: the routers, windows, steps and requests per window.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// The routers in order.
    pub routers: Vec<String>,
    /// Windows per load.
    pub windows: usize,
    /// The search (its `steps` after the options).
    pub search: SearchConfig,
    /// Requests per window, if cut.
    pub requests: Option<usize>,
    /// A screen's fixed speed-ups (empty: the search).
    pub at: Vec<f64>,
}

impl Plan {
    /// The plan of `cfg` and `bench` under `opts`.
    pub fn of(cfg: &GoodputConfig, bench: &BenchConfig, opts: &Choices) -> Plan {
        let (routers, windows, steps, requests) = if opts.quick {
            let q = &cfg.quick;
            (q.routers.clone(), q.windows, q.steps, Some(q.requests))
        } else {
            let mut all = bench.policies.clone();
            all.extend(cfg.external_routers.iter().map(|r| r.name.clone()));
            (all, cfg.windows, cfg.search.steps, None)
        };
        Plan {
            routers: if opts.routers.is_empty() {
                routers
            } else {
                crate::bench::gateway::split_policies(&opts.routers)
            },
            windows: opts.windows.unwrap_or(windows).max(1),
            search: SearchConfig {
                steps: opts.steps.unwrap_or(steps).max(1),
                ..cfg.search
            },
            requests: opts.requests.or(requests),
            at: opts.at.clone(),
        }
    }
}

/// Window `index` of a trace workload: shifted by `index` windows, cut to `requests` if given,
/// and named `<name>-w<index>` (its records and state files are its own).
pub fn window(w: &WorkloadRun, index: usize, requests: Option<usize>) -> WorkloadRun {
    let mut w = w.clone();
    let name = format!("{}-w{index}", w.name());
    if let Workload::Trace {
        start, requests: n, ..
    } = &mut w.workload
    {
        if let Some(r) = requests {
            *n = r;
        }
        *start += index * *n;
    }
    w.name = Some(name);
    w
}

/// The `count` windows of trace workload `w`, of `requests` each if given (else the workload's).
fn trace_windows(
    w: &WorkloadRun,
    count: usize,
    requests: Option<usize>,
) -> Result<Vec<WorkloadRun>, String> {
    let whole = w
        .workload
        .trace_window()
        .is_some_and(|(_, t)| t.requests == 0);
    if count > 1 && whole && requests.is_none() {
        return Err(format!(
            "{}: several windows need a window of some requests (the workload's `requests`, or --requests)",
            w.name()
        ));
    }
    Ok((0..count).map(|i| window(w, i, requests)).collect())
}

/// What the SLO and the time limits need of some windows: every request's (prompt tokens, output
/// tokens), and each window's span in trace time, seconds.
type WindowFacts = (Vec<(u32, u32)>, Vec<f64>);

/// The [`WindowFacts`] of `windows`.
fn window_facts(windows: &[WorkloadRun]) -> Result<WindowFacts, String> {
    let mut requests = Vec::new();
    let mut spans = Vec::new();
    // The windows of one workload share its trace: read once.
    let mut read: Option<(&str, Vec<crate::trace::TraceRequest>)> = None;
    for w in windows {
        let (path, tw) = w
            .workload
            .trace_window()
            .ok_or_else(|| format!("{}: not a trace workload", w.name()))?;
        if read.as_ref().is_none_or(|(p, _)| *p != path) {
            read = Some((path, crate::trace::read(Path::new(path))?));
        }
        let trace = read.as_ref().map_or(&[][..], |(_, t)| &t[..]);
        let selected = tw.select(trace);
        let (Some(first), Some(last)) = (selected.first(), selected.last()) else {
            return Err(format!("{}: the window is past the trace's end", w.name()));
        };
        spans.push((last.timestamp - first.timestamp) / 1e3);
        requests.extend(selected.iter().map(|r| {
            (
                u32::try_from(tw.input_tokens(r)).unwrap_or(u32::MAX),
                tw.output_tokens(r),
            )
        }));
    }
    Ok((requests, spans))
}

/// One router's search on one trace.
#[derive(Debug, Clone, Serialize)]
pub struct RouterResult {
    /// The router: a gateway policy, or an external router's name.
    pub router: String,
    /// `gateway` or `external`.
    pub kind: &'static str,
    /// Why it did not run, if it did not.
    pub skipped: Option<String>,
    /// The highest speed-up at which the SLO held (below every one at which it broke).
    pub sustained_speedup: Option<f64>,
    /// The lowest speed-up at which it broke.
    pub broken_speedup: Option<f64>,
    /// Every probe, in order.
    pub points: Vec<Point>,
}

impl RouterResult {
    /// The point at the sustained speed-up.
    pub fn sustained(&self) -> Option<&Point> {
        let x = self.sustained_speedup?;
        self.points.iter().find(|p| p.speedup == x)
    }

    /// The point at the lowest broken speed-up.
    pub fn broken(&self) -> Option<&Point> {
        let x = self.broken_speedup?;
        self.points.iter().find(|p| p.speedup == x)
    }
}

/// One trace's results.
#[derive(Debug, Clone, Serialize)]
pub struct TraceResult {
    /// The workload's name.
    pub workload: String,
    /// Each window's first request index and requests.
    pub windows: Vec<(usize, usize)>,
    /// The speed-up the search started at.
    pub start_speedup: f64,
    /// The SLO's bounds.
    pub bounds: SloBounds,
    /// Every router's search.
    pub routers: Vec<RouterResult>,
}

/// The goodput benchmark's document.
#[derive(Debug, Clone, Serialize)]
pub struct GoodputResult {
    /// `goodput` or `goodput-quick`.
    pub name: String,
    /// UTC date and time of the start.
    pub started: String,
    /// Wall seconds of the whole run.
    pub seconds: f64,
    /// The machine.
    pub machine: std::collections::BTreeMap<String, String>,
    /// The command that ran it.
    pub command: String,
    /// The goodput config.
    pub config: GoodputConfig,
    /// The fleet and seed of the bench config.
    pub bench: serde_json::Value,
    /// What ran after the options.
    pub plan: Plan,
    /// Per trace.
    pub traces: Vec<TraceResult>,
}

/// How one router is run: a policy of the gateway, or an external router.
enum Router<'a> {
    Policy(&'a str),
    External(&'a ExternalRouter),
}

/// Everything a window needs.
struct Bench<'a> {
    cfg: &'a BenchConfig,
    fleet: Fleet,
    gw: &'a Gateway,
    http: &'a Http,
    tmp_dir: &'a Path,
}

impl Bench<'_> {
    /// One window at one speed-up through `router`; `Err` when the router could not run (refused
    /// policy, external router that did not start): the reason to skip it.
    async fn window(
        &mut self,
        router: &Router<'_>,
        w: &WorkloadRun,
        mode: &Mode,
    ) -> Result<Result<RunReport, String>, String> {
        match router {
            Router::Policy(policy) => {
                run_one(
                    self.cfg,
                    &mut self.fleet,
                    self.gw,
                    self.http,
                    w,
                    mode,
                    policy,
                    crate::api::Api::Chat,
                    self.tmp_dir,
                )
                .await
            }
            Router::External(ext) => {
                self.fleet.restart().await?;
                let workers: Vec<String> =
                    self.fleet.members().into_iter().map(|(_, u)| u).collect();
                let mut running =
                    match external::start(ext, &workers, self.tmp_dir, self.http).await {
                        Ok(r) => r,
                        Err(e) => return Ok(Err(e)),
                    };
                let target = Target {
                    urls: vec![format!("{}/v1/chat/completions", running.url)],
                    api: crate::api::Api::Chat,
                    model: self.cfg.model.clone(),
                    headers: vec![],
                };
                let r = measure(
                    self.cfg,
                    &self.fleet,
                    self.http,
                    w,
                    mode,
                    &ext.name,
                    target,
                    self.tmp_dir,
                )
                .await;
                running.stop().await;
                Ok(Ok(r))
            }
        }
    }
}

/// The whole goodput benchmark; writes `<out>/<date>-goodput[-quick].{json,md}` and the charts,
/// and returns the JSON file's path.
pub async fn goodput(
    cfg: GoodputConfig,
    bench_cfg: BenchConfig,
    opts: GoodputOptions,
    command: String,
) -> Result<PathBuf, String> {
    let http = Http::new();
    let (date, time) = utc_now();
    let plan = Plan::of(&cfg, &bench_cfg, &opts.choices);
    // Every trace's windows are cut and read before anything starts, so a window past a trace's
    // end stops the run at once, not after the traces before it have run.
    let workloads = bench_cfg
        .workloads
        .iter()
        .filter(|w| {
            w.workload.trace_window().is_some()
                && (opts.choices.only.is_empty() || opts.choices.only.iter().any(|o| o == w.name()))
        })
        .map(|w| {
            let windows = trace_windows(w, plan.windows, plan.requests)?;
            let facts = window_facts(&windows)?;
            Ok((w, windows, facts))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let (gw, fleet) = opts.harness.connect(&bench_cfg, &http).await?;
    let mut bench = Bench {
        cfg: &bench_cfg,
        fleet,
        gw: &gw,
        http: &http,
        tmp_dir: &opts.harness.tmp_dir,
    };
    let idle = IdleModel::of_fleet(&bench_cfg.fleet.extra_args, bench_cfg.fleet.time_scale);
    let started = Instant::now();
    let mut traces = Vec::new();
    // Routers that could not run once are not tried again.
    let mut unavailable: Vec<(String, String)> = Vec::new();
    for ext in cfg
        .external_routers
        .iter()
        .filter(|r| plan.routers.contains(&r.name))
    {
        if let Err(e) = external::set_up(ext).await {
            eprintln!("goodput: skipping {}: {e}", ext.name);
            unavailable.push((ext.name.clone(), e));
        }
    }
    for (w, windows, (requests, spans)) in workloads {
        let bounds = cfg.slo.bounds(&idle, &requests);
        let start = w
            .replay_speedups
            .iter()
            .copied()
            .reduce(f64::min)
            .unwrap_or(8.0);
        eprintln!(
            "goodput: {}: {} window(s) of {} requests; SLO: TTFT p99 <= {:.0} ms ({}x the p{} request's idle TTFT {:.0} ms; the median prompt's is {:.0} ms), e2e p99 <= {:.0} ms ({}x the p{} idle e2e {:.0} ms)",
            w.name(),
            windows.len(),
            requests.len() / windows.len(),
            bounds.ttft_p99_ms,
            cfg.slo.ttft_p99_factor,
            cfg.slo.reference_percentile,
            bounds.idle_ttft_ms,
            bounds.median_prompt_idle_ttft_ms,
            bounds.e2e_p99_ms,
            cfg.slo.e2e_p99_factor,
            cfg.slo.reference_percentile,
            bounds.idle_e2e_ms,
        );
        let mut routers = Vec::new();
        for name in &plan.routers {
            let external = cfg.external_routers.iter().find(|r| &r.name == name);
            let router = external.map_or(Router::Policy(name), Router::External);
            let mut result = RouterResult {
                router: name.clone(),
                kind: if external.is_some() {
                    "external"
                } else {
                    "gateway"
                },
                skipped: unavailable
                    .iter()
                    .find(|u| &u.0 == name)
                    .map(|u| u.1.clone()),
                sustained_speedup: None,
                broken_speedup: None,
                points: Vec::new(),
            };
            let mut search = if plan.at.is_empty() {
                Search::new(plan.search, start)
            } else {
                Search::fixed(plan.search, &plan.at)
            };
            while result.skipped.is_none() {
                let Some(x) = search.next() else { break };
                let mode = Mode::of(Load::Replay(x), None);
                let mut figures = Vec::new();
                for (win, span) in windows.iter().zip(&spans) {
                    // The whole window is replayed at any speed-up, its last answers included.
                    let mut win = win.clone();
                    win.max_duration_s = win
                        .max_duration_s
                        .max(span / x + bench_cfg.request_timeout_s);
                    match bench.window(&router, &win, &mode).await? {
                        Ok(r) => figures.push(WindowFigures::of(&r)),
                        Err(reason) => {
                            eprintln!("goodput: skipping {name}: {reason}");
                            unavailable.push((name.clone(), reason.clone()));
                            result.skipped = Some(reason);
                            break;
                        }
                    }
                }
                if result.skipped.is_some() {
                    break;
                }
                let point = Point::of(x, figures, &bounds);
                eprintln!(
                    "[{:>5.0}s] {:<22} {:<17} x{:<6} TTFT p99 {:>6.0} ms ({:.0}-{:.0})  e2e p99 {:>6.0} ms ({:.0}-{:.0})  {:>5.1} req/s {:>5.0} tok/s  hit {:>4.1}%  {}",
                    started.elapsed().as_secs_f64(),
                    w.name(),
                    name,
                    x,
                    point.ttft_p99_ms.median,
                    point.ttft_p99_ms.min,
                    point.ttft_p99_ms.max,
                    point.e2e_p99_ms.median,
                    point.e2e_p99_ms.min,
                    point.e2e_p99_ms.max,
                    point.requests_per_s,
                    point.output_tokens_per_s,
                    point.hit_rate * 100.0,
                    if point.held() {
                        "SLO held".to_string()
                    } else {
                        format!("SLO broken ({})", point.broken())
                    }
                );
                search.record(x, point.held());
                result.points.push(point);
            }
            result.sustained_speedup = search.sustained();
            result.broken_speedup = search.lowest_broken();
            routers.push(result);
        }
        traces.push(TraceResult {
            workload: w.name().to_string(),
            windows: windows
                .iter()
                .filter_map(|x| {
                    x.workload
                        .trace_window()
                        .map(|(_, t)| (t.start, t.requests))
                })
                .collect(),
            start_speedup: start,
            bounds,
            routers,
        });
    }
    bench.fleet.stop().await;
    let name = if opts.choices.quick {
        "goodput-quick"
    } else {
        "goodput"
    };
    let result = GoodputResult {
        name: name.into(),
        started: format!("{date} {time} UTC"),
        seconds: started.elapsed().as_secs_f64(),
        machine: machine(),
        command,
        bench: serde_json::json!({
            "config": cfg.bench,
            "fleet": bench_cfg.fleet,
            "seed": bench_cfg.seed,
            "model": bench_cfg.model,
            "request_timeout_s": bench_cfg.request_timeout_s,
        }),
        config: cfg,
        plan,
        traces,
    };
    report::write(&result, &opts.harness.out_dir, &format!("{date}-{name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_config_parses_and_its_quick_mode_is_small() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let text = std::fs::read_to_string(root.join("bench/config/goodput.json")).unwrap();
        let cfg: GoodputConfig = serde_json::from_str(&text).unwrap();
        // Parsed without `BenchConfig::load`'s checks, which open the traces relative to the
        // working directory.
        let bench: BenchConfig =
            serde_json::from_str(&std::fs::read_to_string(root.join(&cfg.bench)).unwrap()).unwrap();
        assert!(
            bench
                .workloads
                .iter()
                .filter(|w| w.workload.trace_window().is_some())
                .count()
                >= 2
        );
        assert!(cfg.windows >= 3 && cfg.slo.ttft_p99_factor > 1.0 && cfg.slo.e2e_p99_factor > 1.0);
        let opts = |quick| Choices {
            quick,
            ..Choices::default()
        };
        let full = Plan::of(&cfg, &bench, &opts(false));
        assert!(
            full.routers.len() > bench.policies.len(),
            "smg is in the full run"
        );
        assert_eq!(full.requests, None);
        let quick = Plan::of(&cfg, &bench, &opts(true));
        assert_eq!((quick.routers.len(), quick.search.steps), (2, 2));
        assert!(quick.requests.unwrap() <= 200);
    }

    #[test]
    fn windows_follow_each_other_in_the_trace() {
        let w: WorkloadRun = serde_json::from_value(serde_json::json!({
            "name": "conv",
            "workload": {"kind": "trace", "path": "t.jsonl", "start": 100, "requests": 1000},
            "replay_speedups": [8],
            "max_duration_s": 60
        }))
        .unwrap();
        let start = |w: &WorkloadRun| w.workload.trace_window().unwrap().1.start;
        assert_eq!(start(&window(&w, 0, None)), 100);
        assert_eq!(start(&window(&w, 2, None)), 2100);
        let cut = window(&w, 2, Some(50));
        assert_eq!(
            (start(&cut), cut.workload.trace_window().unwrap().1.requests),
            (200, 50)
        );
        assert_eq!(cut.name(), "conv-w2");
    }

    #[test]
    fn a_window_past_the_traces_end_is_found_before_anything_runs() {
        // The shipped synthetic trace has 3,993 requests: a 4th window of 1,000 is cut short, a
        // 5th starts past its end.
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let w: WorkloadRun = serde_json::from_value(serde_json::json!({
            "name": "synthetic",
            "workload": {"kind": "trace",
                "path": root.join("bench/traces/mooncake_synthetic_trace.jsonl.gz"),
                "start": 0, "requests": 1000},
            "replay_speedups": [12],
            "max_duration_s": 60
        }))
        .unwrap();
        let facts = |count: usize, requests: Option<usize>| {
            window_facts(&trace_windows(&w, count, requests).unwrap())
        };
        let (requests, spans) = facts(4, None).unwrap();
        assert_eq!((requests.len(), spans.len()), (3_993, 4));
        let err = facts(5, None).unwrap_err();
        assert!(
            err.contains("synthetic-w4: the window is past the trace's end"),
            "{err}"
        );
        assert_eq!(facts(5, Some(798)).unwrap().0.len(), 3_990);
    }
}
