//! `loadgen bench`: the whole benchmark against a running gateway. It owns a fleet of vllm-sim
//! processes, and for every workload, mode (closed loop at N clients, open loop at a fraction of the
//! capacity the closed-loop runs measured, or a fixed load) and policy: restarts the fleet (cold
//! caches), re-registers it in the pool (which also purges the pool's prefix-affinity table), sets
//! the policy (skipping one the gateway refuses), waits until a probe has made every backend ready,
//! reads every backend's `/metrics`, runs the workload, reads `/metrics` again. Then it measures the
//! gateway's overhead against direct calls (if configured), and writes the JSON result, the
//! markdown tables and the charts.
//!
//! The parts: [`config`] (what runs), [`fleet`] (the vllm-sim processes), [`gateway`] (its admin
//! API), [`run`] (one measured run), [`overhead`] (direct against gateway), [`machine`] (where and
//! when); this file runs them all and writes the results.

mod config;
pub(crate) mod fleet;
pub(crate) mod gateway;
pub(crate) mod machine;
mod overhead;
pub(crate) mod run;

pub use config::{parse_capacities, BenchConfig, FleetConfig, Mode, OverheadConfig, WorkloadRun};

use crate::api::Api;
use crate::client::Http;
use crate::report::{self, BenchResult, RunReport, Skipped};
use config::capacity;
use fleet::Fleet;
use gateway::Gateway;
use machine::{machine, utc_now};
use overhead::overhead;
use run::run_one;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

/// Where a benchmark (`loadgen bench`, `loadgen goodput`) finds the gateway and the fleet's
/// binary, and where it writes.
pub struct Harness {
    /// Gateway base URL.
    pub gateway: String,
    /// Admin token.
    pub admin_token: String,
    /// The vllm-sim binary.
    pub sim_bin: PathBuf,
    /// Where results go (`bench/results`).
    pub out_dir: PathBuf,
    /// Where logs go (`bench/tmp`).
    pub tmp_dir: PathBuf,
}

impl Harness {
    /// The gateway's admin API for `cfg`'s pool, checked to answer, and `cfg`'s fleet (not
    /// started yet).
    pub(crate) async fn connect(
        &self,
        cfg: &BenchConfig,
        http: &Http,
    ) -> Result<(Gateway, Fleet), String> {
        let gw = Gateway::new(
            self.gateway.clone(),
            self.admin_token.clone(),
            cfg.pool.clone(),
            http.clone(),
        );
        gw.check().await?;
        let fleet = Fleet::new(
            cfg.fleet.clone(),
            cfg.model.clone(),
            self.sim_bin.clone(),
            self.tmp_dir.clone(),
            http.clone(),
        );
        Ok((gw, fleet))
    }
}

/// Options of `loadgen bench` besides the config.
pub struct BenchOptions {
    /// The gateway, the fleet's binary, the output directories.
    pub harness: Harness,
    /// Only these workloads (names; empty: all).
    pub only_workloads: Vec<String>,
    /// These policies instead of the config's (empty: the config's).
    pub policies: Vec<String>,
    /// Capacities (requests per second) by workload name; `*` for every workload.
    pub capacity_rps: BTreeMap<String, f64>,
    /// Open-loop levels instead of the config's (empty: the config's).
    pub levels: Vec<f64>,
    /// Closed-loop concurrencies instead of the config's (empty: the config's).
    pub closed_loop: Vec<usize>,
    /// Trace replay speed-ups instead of the config's (empty: the config's).
    pub speedups: Vec<f64>,
    /// The policy the targets are about, instead of the config's.
    pub default_policy: Option<String>,
}

/// The whole benchmark; writes `<out>/<date>[-name].{json,md}` and the charts, and returns the
/// path of the JSON file.
pub async fn bench(cfg: BenchConfig, opts: BenchOptions) -> Result<PathBuf, String> {
    let http = Http::new();
    let (date, time) = utc_now();
    let (gw, mut fleet) = opts.harness.connect(&cfg, &http).await?;
    let policies = if opts.policies.is_empty() {
        cfg.policies.clone()
    } else {
        opts.policies.clone()
    };
    let mut runs: Vec<RunReport> = Vec::new();
    let mut skipped: Vec<Skipped> = Vec::new();
    let mut capacities: BTreeMap<String, f64> = BTreeMap::new();
    let default_policy = opts
        .default_policy
        .clone()
        .unwrap_or_else(|| cfg.default_policy.clone());
    let started = Instant::now();
    for w in &cfg.workloads {
        if !opts.only_workloads.is_empty() && !opts.only_workloads.iter().any(|o| o == w.name()) {
            continue;
        }
        let mut w = w.clone();
        if !opts.closed_loop.is_empty() && !w.closed_loop.is_empty() {
            w.closed_loop = opts.closed_loop.clone();
        }
        if !opts.speedups.is_empty() && !w.replay_speedups.is_empty() {
            w.replay_speedups = opts.speedups.clone();
        }
        let mut modes = w.fixed_modes();
        let mut sweep_pending = w.open_loop.is_some();
        let mut i = 0;
        while i < modes.len() || sweep_pending {
            if i == modes.len() {
                // Every fixed mode ran: the sweep's rates can be set.
                sweep_pending = false;
                let sweep = w.open_loop.as_ref().expect("a pending sweep exists");
                let explicit = opts
                    .capacity_rps
                    .get(w.name())
                    .or_else(|| opts.capacity_rps.get("*"))
                    .copied()
                    .or(sweep.capacity_rps);
                let Some(cap) = capacity(explicit, w.name(), &runs) else {
                    return Err(format!(
                        "{}: no capacity for the open-loop levels: run a closed-loop mode or give --capacity-rps {}=REQ_PER_S",
                        w.name(),
                        w.name()
                    ));
                };
                eprintln!(
                    "{}: capacity {cap:.1} req/s for the open-loop levels",
                    w.name()
                );
                capacities.insert(w.name().to_string(), cap);
                let levels = if opts.levels.is_empty() {
                    sweep.levels.clone()
                } else {
                    opts.levels.clone()
                };
                modes.extend(w.open_modes(cap, &levels));
                continue;
            }
            let mode = modes[i].clone();
            i += 1;
            for policy in &policies {
                if skipped.iter().any(|s| &s.policy == policy) {
                    continue;
                }
                // Chat, then (under the default policy) the workload's other APIs.
                let mut apis = vec![Api::Chat];
                if *policy == default_policy {
                    apis.extend(w.apis.iter().copied());
                }
                for api in apis {
                    match run_one(
                        &cfg,
                        &mut fleet,
                        &gw,
                        &http,
                        &w,
                        &mode,
                        policy,
                        api,
                        &opts.harness.tmp_dir,
                    )
                    .await?
                    {
                        Ok(r) => {
                            print_run(&r, started);
                            runs.push(r);
                        }
                        Err(refused) => {
                            eprintln!(
                                "bench: the gateway refused policy {policy}, skipping it: {refused}"
                            );
                            skipped.push(Skipped {
                                policy: policy.clone(),
                                reason: refused,
                            });
                            break;
                        }
                    }
                }
            }
        }
    }
    let overhead = match &cfg.overhead {
        Some(oc)
            if opts.only_workloads.is_empty()
                || opts.only_workloads.iter().any(|w| w == "overhead") =>
        {
            overhead(&cfg, oc, &mut fleet, &gw, &http).await?
        }
        _ => Vec::new(),
    };
    fleet.stop().await;
    let result = BenchResult {
        name: cfg.name.clone(),
        started: format!("{date} {time} UTC"),
        machine: machine(),
        config: {
            let mut c = serde_json::to_value(&cfg).unwrap_or_default();
            // What the command line changed, so the document says what actually ran.
            c["command_line"] = json!({
                "only": opts.only_workloads,
                "policies": policies,
                "levels": opts.levels,
                "closed_loop": opts.closed_loop,
                "speedups": opts.speedups,
                "capacity_rps": opts.capacity_rps,
                "default_policy": opts.default_policy,
            });
            c
        },
        targets: report::verdicts(&runs),
        tail_targets: report::tail_targets(&runs, &default_policy, &cfg.baselines),
        default_policy,
        baselines: cfg.baselines.clone(),
        capacity_rps: capacities,
        skipped,
        runs,
        overhead,
    };
    std::fs::create_dir_all(&opts.harness.out_dir).map_err(|e| e.to_string())?;
    let stem = if cfg.name == "full" {
        date
    } else {
        format!("{date}-{}", cfg.name)
    };
    let json_path = opts.harness.out_dir.join(format!("{stem}.json"));
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&result).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    report::charts(&result, &opts.harness.out_dir, &format!("{stem}-"))?;
    std::fs::write(
        opts.harness.out_dir.join(format!("{stem}.md")),
        report::markdown(&result, &format!("{stem}-")),
    )
    .map_err(|e| e.to_string())?;
    eprintln!(
        "bench: {} runs in {:.0} s",
        result.runs.len(),
        started.elapsed().as_secs_f64()
    );
    for v in result.targets.iter().filter(|v| v.met.is_some()) {
        eprintln!(
            "  [{}] {} -- {}",
            if v.met == Some(true) { "met" } else { "MISSED" },
            v.target,
            v.measured
        );
    }
    for t in &result.tail_targets {
        eprintln!(
            "  [{}] {} {}: {} {} -- {}",
            match t.met {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "n/a",
            },
            t.workload,
            t.mode,
            t.target,
            t.bound,
            t.value
                .map_or(t.measured.clone(), |v| format!("{v:.2}x: {}", t.measured))
        );
    }
    Ok(json_path)
}

/// A run's line on stderr (and its error samples).
fn print_run(r: &RunReport, started: Instant) {
    eprintln!(
        "[{:>5.0}s] {:<14} {:<11} {:<17} TTFT p50 {:>7.1} p99 {:>7.1}  E2E p50 {:>6.0} p99 {:>6.0} ms  {:>5.1} req/s {:>5.0} tok/s  hit {:>5.1}% (oracle {:>5.1}%)  busiest/mean prefill {:.2}  {}/{} ok",
        started.elapsed().as_secs_f64(),
        r.workload,
        r.mode,
        r.policy,
        r.ttft_ms.p50,
        r.ttft_ms.p99,
        r.e2e_ms.p50,
        r.e2e_ms.p99,
        r.requests_per_s,
        r.output_tokens_per_s,
        r.hit_rate * 100.0,
        r.oracle.as_ref().map_or(0.0, |o| o.hit_rate * 100.0),
        r.prefill_imbalance,
        r.ok,
        r.sent
    );
    for e in &r.error_samples {
        eprintln!("    error: {e}");
    }
}
