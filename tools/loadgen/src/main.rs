//! `loadgen`: the load generator and benchmark harness of the gateway.
//!
//! - `loadgen run`: one workload against any OpenAI-compatible endpoint (the gateway, or backends
//!   directly), streamed, open or closed loop; prints a JSON report.
//! - `loadgen oracle`: the prefix-cache hit rate an oracle router would reach on a workload.
//! - `loadgen overhead`: the gateway's added latency over direct calls.
//! - `loadgen bench`: everything, on a fleet of vllm-sim processes it manages (`make bench`).
//! - `loadgen goodput`: each router's highest trace replay speed-up within an SLO
//!   (`make bench-goodput`).
//!
//! Modules: [`workload`] generates the workloads from a seed, [`driver`] sends them,
//! [`client`] times each stream, [`metrics`] reads the backends' counters, [`oracle`] computes the
//! upper bound, [`report`] summarises and draws, [`bench`] orchestrates, [`goodput`] searches for the
//! load where an SLO breaks.

mod api;
mod bench;
mod client;
mod driver;
mod goodput;
mod metrics;
mod oracle;
mod plan;
mod report;
mod rng;
mod stats;
mod trace;
mod workload;

use clap::{Args, Parser, Subcommand};
use driver::{Limits, Load, Target};
use std::path::PathBuf;
use std::time::Duration;
use workload::Workload;

#[derive(Parser)]
#[command(
    name = "loadgen",
    about = "Load generator and benchmark harness for OpenAI-compatible endpoints"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

/// Which workload: a named one from a bench config, or a JSON spec.
#[derive(Args, Clone)]
struct WorkloadArgs {
    /// Bench config to take the workload (and fleet, seed) from.
    #[arg(long, default_value = "bench/config/full.json")]
    config: PathBuf,
    /// Workload name in the config (its `name`, or its kind: prefix-groups, multi-turn, ...).
    #[arg(long)]
    workload: Option<String>,
    /// A workload as JSON instead, e.g. '{"kind":"no-sharing","requests":100,"prompt_tokens":64,"output_tokens":16}'.
    #[arg(long)]
    spec: Option<String>,
    /// Seed (default: the config's).
    #[arg(long)]
    seed: Option<u64>,
    /// Replay this request trace instead (JSON lines, `.gz` for gzipped; Mooncake's format,
    /// bench/traces/README.md).
    #[arg(long, conflicts_with_all = ["workload", "spec"])]
    trace: Option<String>,
    /// Trace: prompt (and block) lengths are divided by this.
    #[arg(long, default_value_t = 16.0)]
    trace_scale: f64,
    /// Trace: output lengths are divided by this (default: --trace-scale).
    #[arg(long)]
    trace_output_scale: Option<f64>,
    /// Trace: index of the first request replayed.
    #[arg(long, default_value_t = 0)]
    trace_start: usize,
    /// Trace: requests replayed (0: all, or up to --trace-duration-s).
    #[arg(long, default_value_t = 0)]
    trace_requests: usize,
    /// Trace: trace-time length of the window, seconds (0: no limit).
    #[arg(long, default_value_t = 0.0)]
    trace_duration_s: f64,
    /// Trace: tokens one hash id stands for.
    #[arg(long, default_value_t = 512)]
    trace_block_tokens: u64,
    /// Trace: scaled prompts longer than this are cut to it, keeping the prefix (0: no cap).
    #[arg(long, default_value_t = 0)]
    trace_max_input_tokens: usize,
}

impl WorkloadArgs {
    fn resolve(
        &self,
    ) -> Result<
        (
            Workload,
            Option<bench::WorkloadRun>,
            bench::BenchConfig,
            u64,
        ),
        String,
    > {
        let cfg = bench::BenchConfig::load(&self.config)?;
        let seed = self.seed.unwrap_or(cfg.seed);
        if let Some(path) = &self.trace {
            let w = Workload::Trace {
                path: path.clone(),
                scale: self.trace_scale,
                output_scale: self.trace_output_scale,
                start: self.trace_start,
                requests: self.trace_requests,
                duration_s: self.trace_duration_s,
                block_tokens: self.trace_block_tokens,
                max_input_tokens: self.trace_max_input_tokens,
            };
            w.check()?;
            return Ok((w, None, cfg, seed));
        }
        if let Some(spec) = &self.spec {
            let w: Workload = serde_json::from_str(spec).map_err(|e| format!("--spec: {e}"))?;
            w.check()?;
            return Ok((w, None, cfg, seed));
        }
        let name = self
            .workload
            .as_deref()
            .ok_or("give --workload NAME or --spec JSON")?;
        let run = cfg
            .workloads
            .iter()
            .find(|w| w.name() == name)
            .or_else(|| cfg.workloads.iter().find(|w| w.workload.kind() == name))
            .cloned()
            .ok_or_else(|| format!("no workload `{name}` in {}", self.config.display()))?;
        Ok((run.workload.clone(), Some(run), cfg, seed))
    }
}

/// Where `loadgen bench` and `loadgen goodput` find the gateway and the fleet's binary, and where
/// they write.
#[derive(Args)]
struct HarnessArgs {
    /// Gateway base URL.
    #[arg(long, default_value = "http://127.0.0.1:8799")]
    gateway: String,
    /// Admin token (or ADMIN_TOKEN in the environment).
    #[arg(long, env = "ADMIN_TOKEN", hide_env_values = true)]
    admin_token: String,
    /// The vllm-sim binary.
    #[arg(long, default_value = "target/release/vllm-sim")]
    sim_bin: PathBuf,
    /// Results directory.
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
    /// Logs directory.
    #[arg(long, default_value = "bench/tmp")]
    tmp_dir: PathBuf,
}

impl HarnessArgs {
    fn harness(self) -> bench::Harness {
        bench::Harness {
            gateway: self.gateway,
            admin_token: self.admin_token,
            sim_bin: self.sim_bin,
            out_dir: self.out_dir,
            tmp_dir: self.tmp_dir,
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one workload against an endpoint and print a JSON report.
    Run {
        #[command(flatten)]
        w: WorkloadArgs,
        /// Base URL(s); several are used in turn (e.g. backends directly).
        #[arg(long, required = true)]
        url: Vec<String>,
        /// Model name (default: the config's).
        #[arg(long)]
        model: Option<String>,
        /// The API the conversations are sent through: chat, responses or messages.
        #[arg(long, default_value = "chat", value_parser = parse_api)]
        api: api::Api,
        /// Open loop: Poisson arrivals per second.
        #[arg(long, conflicts_with = "concurrency")]
        rate: Option<f64>,
        /// Trace replay: arrival times divided by this (the default load of a trace workload).
        #[arg(long, conflicts_with_all = ["rate", "concurrency"])]
        trace_speedup: Option<f64>,
        /// Closed loop: concurrent clients.
        #[arg(long)]
        concurrency: Option<usize>,
        /// Closed loop: think time between a conversation's turns, ms (default: the config's).
        #[arg(long)]
        think_ms: Option<f64>,
        /// Wall-clock limit, seconds.
        #[arg(long, default_value_t = 60.0)]
        max_duration: f64,
        /// Backend base URLs whose /metrics to read before and after (for the hit rate).
        #[arg(long)]
        metrics: Vec<String>,
        /// The backends' --time-scale (to report model-time TTFT).
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
        /// Label for the policy column.
        #[arg(long, default_value = "unknown")]
        policy: String,
        /// Also write the per-request records (JSON lines) here.
        #[arg(long)]
        records: Option<PathBuf>,
    },
    /// Print the oracle's hit-rate bound for a workload on a fleet.
    Oracle {
        #[command(flatten)]
        w: WorkloadArgs,
        /// Backends in the fleet (default: the config's).
        #[arg(long)]
        backends: Option<usize>,
        /// KV blocks per backend (default: the config's).
        #[arg(long)]
        kv_blocks: Option<usize>,
    },
    /// Measure the gateway's added latency over direct calls (the gateway must already route to
    /// the given backends).
    Overhead {
        /// Gateway base URL.
        #[arg(long)]
        gateway: String,
        /// Backend base URLs (called in turn for the direct phase).
        #[arg(long, required = true)]
        direct: Vec<String>,
        /// Model name.
        #[arg(long)]
        model: String,
        /// Concurrencies.
        #[arg(long, value_delimiter = ',', default_value = "1,50,200")]
        concurrency: Vec<usize>,
        /// Requests per phase.
        #[arg(long, default_value_t = 500)]
        requests: usize,
        #[arg(long, default_value_t = 64)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 16)]
        output_tokens: u32,
    },
    /// Run the whole benchmark on a managed vllm-sim fleet behind a running gateway.
    Bench {
        /// Bench config.
        #[arg(long)]
        config: PathBuf,
        #[command(flatten)]
        h: HarnessArgs,
        /// Only these workloads, by name (`overhead` for the overhead benchmark); default all.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// These policies, in this order, instead of the config's list, comma-separated (a
        /// policy's JSON knobs may hold commas). A policy the gateway refuses (HTTP 400) is
        /// skipped and reported as not run.
        #[arg(long)]
        policies: Vec<String>,
        /// The policy the targets table is about (default: the config's `default_policy`).
        #[arg(long)]
        default_policy: Option<String>,
        /// Capacity of the open-loop levels, requests per second: `NAME=RPS` for one workload or
        /// a bare `RPS` for all (default: the config's, else the best closed-loop throughput at the
        /// highest concurrency measured in the same bench).
        #[arg(long, value_delimiter = ',')]
        capacity_rps: Vec<String>,
        /// Open-loop levels as fractions of the capacity, e.g. 0.5,0.7,0.9 (default: the config's).
        #[arg(long, value_delimiter = ',')]
        levels: Vec<f64>,
        /// Closed-loop concurrencies, e.g. 32,64, for workloads that have closed-loop modes
        /// (default: the config's).
        #[arg(long, value_delimiter = ',')]
        closed_loop: Vec<usize>,
        /// Trace replay speed-ups, e.g. 8,16, for trace workloads (default: the config's).
        #[arg(long, value_delimiter = ',')]
        speedups: Vec<f64>,
    },
    /// Each router's highest trace replay speed-up within an SLO (`make bench-goodput`).
    Goodput {
        /// Goodput config (it names the bench config of the fleet and traces).
        #[arg(long, default_value = "bench/config/goodput.json")]
        config: PathBuf,
        #[command(flatten)]
        h: HarnessArgs,
        #[command(flatten)]
        choices: goodput::Choices,
    },
}

fn load_of(
    rate: Option<f64>,
    concurrency: Option<usize>,
    default: Option<Load>,
) -> Result<Load, String> {
    match (rate, concurrency, default) {
        (Some(r), _, _) => Ok(Load::Rate(r)),
        (_, Some(c), _) => Ok(Load::Concurrency(c)),
        (_, _, Some(d)) => Ok(d),
        _ => Err("give --rate or --concurrency".into()),
    }
}

/// `--api`: `chat`, `responses` or `messages`.
fn parse_api(s: &str) -> Result<api::Api, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string()))
        .map_err(|_| format!("unknown API {s}: expected chat, responses or messages"))
}

async fn main_inner(cli: Cli) -> Result<(), String> {
    let http = client::Http::new();
    match cli.command {
        Cmd::Run {
            w,
            url,
            model,
            api,
            rate,
            trace_speedup,
            concurrency,
            think_ms,
            max_duration,
            metrics: metric_urls,
            time_scale,
            policy,
            records: records_path,
        } => {
            let (workload, run, cfg, seed) = w.resolve()?;
            let default_load = run.as_ref().and_then(|r| {
                r.load
                    .or(r.replay_speedups.first().map(|&x| Load::Replay(x)))
                    .or(r.closed_loop.first().map(|&c| driver::Load::Concurrency(c)))
            });
            let is_trace = workload.trace_window().is_some();
            let default_load = match trace_speedup {
                Some(x) if x > 0.0 && x.is_finite() => Some(Load::Replay(x)),
                Some(x) => return Err(format!("--trace-speedup {x}: must be positive")),
                None if is_trace => default_load.or(Some(Load::Replay(1.0))),
                None => default_load,
            };
            let load = load_of(rate, concurrency, default_load)?;
            let think = think_ms.or(run.as_ref().map(|r| r.think_ms)).unwrap_or(0.0);
            let plan = workload.generate(seed);
            let fetch = |urls: Vec<String>| {
                let http = http.clone();
                async move {
                    let mut out = Vec::new();
                    for u in urls {
                        let text = match http
                            .call(hyper::Method::GET, &format!("{u}/metrics"), None, None)
                            .await
                        {
                            Ok((200, t)) => t,
                            _ => String::new(),
                        };
                        out.push((u, metrics::Counters::from_text(&text)));
                    }
                    out
                }
            };
            let before = fetch(metric_urls.clone()).await;
            let target = Target {
                urls: url
                    .iter()
                    .map(|u| format!("{}{}", u.trim_end_matches('/'), api.path()))
                    .collect(),
                api,
                model: model.unwrap_or(cfg.model.clone()),
                headers: vec![],
            };
            let limits = Limits {
                max_duration: Duration::from_secs_f64(max_duration),
                request_timeout: Duration::from_secs_f64(cfg.request_timeout_s),
                think: Duration::from_secs_f64(think.max(0.0) / 1e3),
                random_turn_gaps: run.as_ref().is_some_and(|r| r.random_turn_gaps),
            };
            let (records, elapsed) =
                driver::drive(http.clone(), target, plan.clone(), load, seed, limits).await;
            let after = fetch(metric_urls).await;
            let deltas: Vec<(String, metrics::Counters)> = after
                .iter()
                .zip(&before)
                .map(|((u, a), (_, b))| (u.clone(), a.since(b)))
                .collect();
            // `run` sends no warm-up, so the bound counts every request.
            let fleet_blocks = cfg.fleet.backends * cfg.fleet.kv_blocks;
            let block_tokens = cfg.fleet.block_tokens();
            let bound = oracle::bound(
                &oracle::requests_of(&plan, seed),
                0,
                block_tokens,
                fleet_blocks,
            );
            let mut report = report::summarize(
                report::RunLabel {
                    workload: run.as_ref().map_or(workload.kind(), |r| r.name()),
                    kind: workload.kind(),
                    mode: &bench::Mode::of(load, None).label,
                    policy: &policy,
                    load,
                    level: None,
                    time_scale,
                },
                &records,
                elapsed,
                &deltas,
                Some(bound),
            );
            if is_trace {
                let idle = report::IdleModel::of_fleet(&cfg.fleet.extra_args, time_scale);
                report.trace = Some(report::trace_figures(&records, &idle));
            }
            if let Some(p) = records_path {
                driver::write_records(&p, &records)?;
            }
            println!(
                "{}",
                serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
            );
        }
        Cmd::Oracle {
            w,
            backends,
            kv_blocks,
        } => {
            let (workload, _, cfg, seed) = w.resolve()?;
            let plan = workload.generate(seed);
            let fleet_blocks =
                backends.unwrap_or(cfg.fleet.backends) * kv_blocks.unwrap_or(cfg.fleet.kv_blocks);
            let bound =
                oracle::workload_bound(&workload, seed, cfg.fleet.block_tokens(), fleet_blocks);
            let out = serde_json::json!({"workload": workload, "seed": seed, "requests": plan.requests(), "bound": bound});
            println!(
                "{}",
                serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?
            );
        }
        Cmd::Overhead {
            gateway,
            direct,
            model,
            concurrency,
            requests,
            prompt_tokens,
            output_tokens,
        } => {
            let oc = bench::OverheadConfig {
                requests: vec![requests; concurrency.len()],
                concurrency,
                prompt_tokens,
                output_tokens,
                max_duration_s: 120.0,
                rates: vec![],
            };
            let mut points = Vec::new();
            for (i, &c) in oc.concurrency.iter().enumerate() {
                let w = Workload::NoSharing {
                    requests: oc.requests[i],
                    prompt_tokens,
                    output_tokens,
                };
                let limits = Limits {
                    max_duration: Duration::from_secs_f64(oc.max_duration_s),
                    request_timeout: Duration::from_secs(60),
                    think: Duration::ZERO,
                    random_turn_gaps: false,
                };
                let d = Target {
                    urls: direct
                        .iter()
                        .map(|u| format!("{u}/v1/chat/completions"))
                        .collect(),
                    api: crate::api::Api::Chat,
                    model: model.clone(),
                    headers: vec![],
                };
                let g = Target {
                    urls: vec![format!("{gateway}/v1/chat/completions")],
                    api: crate::api::Api::Chat,
                    model: model.clone(),
                    headers: vec![],
                };
                let (dr, ds) = driver::drive(
                    http.clone(),
                    d,
                    w.generate(10 + i as u64),
                    Load::Concurrency(c),
                    10,
                    limits,
                )
                .await;
                let (gr, gs) = driver::drive(
                    http.clone(),
                    g,
                    w.generate(20 + i as u64),
                    Load::Concurrency(c),
                    20,
                    limits,
                )
                .await;
                let s = |v: &[driver::Record], f: &dyn Fn(&driver::Record) -> Option<f64>| {
                    stats::Summary::of(v.iter().filter(|r| r.error.is_none()).filter_map(f))
                };
                let (dt, gt) = (s(&dr, &|r| r.ttft_ms), s(&gr, &|r| r.ttft_ms));
                let (de, ge) = (s(&dr, &|r| Some(r.e2e_ms)), s(&gr, &|r| Some(r.e2e_ms)));
                points.push(report::OverheadPoint {
                    load: Load::Concurrency(c),
                    concurrency: c,
                    requests: oc.requests[i],
                    direct_ttft_p50: dt.p50,
                    direct_ttft_p99: dt.p99,
                    gateway_ttft_p50: gt.p50,
                    gateway_ttft_p99: gt.p99,
                    direct_e2e_p50: de.p50,
                    direct_e2e_p99: de.p99,
                    gateway_e2e_p50: ge.p50,
                    gateway_e2e_p99: ge.p99,
                    direct_rps: dt.count as f64 / ds,
                    gateway_rps: gt.count as f64 / gs,
                    direct_errors: dr.len() - dt.count,
                    gateway_errors: gr.len() - gt.count,
                });
            }
            println!(
                "{}",
                serde_json::to_string_pretty(&points).map_err(|e| e.to_string())?
            );
        }
        Cmd::Bench {
            config,
            h,
            only,
            policies,
            default_policy,
            capacity_rps,
            levels,
            closed_loop,
            speedups,
        } => {
            let cfg = bench::BenchConfig::load(&config)?;
            let opts = bench::BenchOptions {
                harness: h.harness(),
                only_workloads: only,
                policies: bench::gateway::split_policies(&policies),
                capacity_rps: bench::parse_capacities(&capacity_rps)?,
                levels,
                closed_loop,
                speedups,
                default_policy,
            };
            let path = bench::bench(cfg, opts).await?;
            println!("{}", path.display());
        }
        Cmd::Goodput { config, h, choices } => {
            let (cfg, bench_cfg) = goodput::GoodputConfig::load(&config)?;
            // As run, for the report; an admin token given on the command line is left out.
            let mut command: Vec<String> = Vec::new();
            let mut args = std::env::args().skip(1);
            while let Some(a) = args.next() {
                if a == "--admin-token" {
                    args.next();
                } else if !a.starts_with("--admin-token=") {
                    command.push(a);
                }
            }
            let command = command.join(" ");
            let opts = goodput::GoodputOptions {
                harness: h.harness(),
                choices,
            };
            let path = goodput::goodput(cfg, bench_cfg, opts, format!("loadgen {command}")).await?;
            println!("{}", path.display());
        }
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if let Err(e) = rt.block_on(main_inner(cli)) {
        eprintln!("loadgen: {e}");
        std::process::exit(1);
    }
}
