//! What a benchmark runs, as read from `bench/config/*.json`: the fleet, the policies, the
//! workloads and the modes each runs under (closed loop, open loop at fractions of a capacity,
//! a fixed load), the overhead measurement; and the capacity an open-loop sweep is scaled to.

use crate::api::Api;
use crate::driver::Load;
use crate::oracle;
use crate::report::RunReport;
use crate::workload::Workload;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The fleet of simulated backends.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// Number of vllm-sim processes.
    pub backends: usize,
    /// Port of the first; the others follow.
    pub base_port: u16,
    /// `--kv-blocks` of each (of `--block-size` tokens, vllm-sim's default 64 as vLLM 0.34's).
    pub kv_blocks: usize,
    /// `--time-scale` of each.
    pub time_scale: f64,
    /// Any other vllm-sim flags.
    #[serde(default)]
    pub extra_args: Vec<String>,
}

/// One workload of the benchmark and the loads it runs under. Each load is a *mode*; every policy
/// runs every mode on a fresh fleet.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadRun {
    /// Name in reports and in `--only` (default: the workload's kind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The workload and its parameters.
    pub workload: Workload,
    /// One fixed load (open-loop rate or closed-loop concurrency).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<Load>,
    /// Closed-loop modes: the number of concurrent clients of each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub closed_loop: Vec<usize>,
    /// Open-loop modes: seeded Poisson arrivals at fractions of the workload's capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_loop: Option<OpenLoopSweep>,
    /// Trace replays (`trace` workloads): the speed-ups of the trace's arrival times, one mode
    /// each (`replay-x8`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replay_speedups: Vec<f64>,
    /// Closed loop: a client's think time between a conversation's turns, ms.
    #[serde(default)]
    pub think_ms: f64,
    /// Open loop: jittered spacing of a conversation's turns (see the driver) instead of a fixed
    /// one.
    #[serde(default)]
    pub random_turn_gaps: bool,
    /// Wall-clock limit of one run, seconds.
    pub max_duration_s: f64,
    /// Other APIs the same sessions are also sent through (`responses`, `messages`; chat is
    /// always run): in every mode, under the default policy only, right after its chat run, as a
    /// run named `<name>-<api>` (see [`WorkloadRun::through`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub apis: Vec<Api>,
}

/// Open-loop load levels of a workload.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenLoopSweep {
    /// Offered load as fractions of the capacity, e.g. `[0.5, 0.7, 0.9]`.
    pub levels: Vec<f64>,
    /// The capacity, requests per second. Absent: measured in the same bench, as the best
    /// completed requests per second of this workload's closed-loop runs at their highest
    /// concurrency (what the fleet, gateway included, serves to that many busy clients).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_rps: Option<f64>,
}

impl WorkloadRun {
    /// The workload's name in reports.
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(self.workload.kind())
    }

    /// This workload sent through `api`: named `<name>-<api>` (its runs, records and report
    /// sections are its own), with no further APIs of its own.
    pub fn through(&self, api: Api) -> WorkloadRun {
        WorkloadRun {
            name: Some(format!("{}-{}", self.name(), api.name())),
            apis: Vec::new(),
            ..self.clone()
        }
    }

    /// The modes that need no capacity: closed loops first, then the fixed load.
    pub fn fixed_modes(&self) -> Vec<Mode> {
        let mut out: Vec<Mode> = self
            .closed_loop
            .iter()
            .map(|&c| Mode::of(Load::Concurrency(c), None))
            .collect();
        out.extend(self.load.map(|l| Mode::of(l, None)));
        out.extend(
            self.replay_speedups
                .iter()
                .map(|&x| Mode::of(Load::Replay(x), None)),
        );
        out
    }

    /// The open-loop modes at `capacity` requests per second.
    pub fn open_modes(&self, capacity: f64, levels: &[f64]) -> Vec<Mode> {
        levels
            .iter()
            .map(|&f| Mode::of(Load::Rate(round2(f * capacity)), Some(f)))
            .collect()
    }
}

/// `x` rounded to two decimals (offered rates in reports and configs stay readable).
fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// One way of offering a workload: its label in reports, its load, and its fraction of the
/// capacity (open-loop sweeps).
#[derive(Debug, Clone, PartialEq)]
pub struct Mode {
    /// `closed-32`, `open-0.9`, `open-20rps`.
    pub label: String,
    /// The load.
    pub load: Load,
    /// Fraction of the capacity, for the sweep's modes.
    pub level: Option<f64>,
}

impl Mode {
    /// The mode of `load` (at `level` of the capacity, for a sweep).
    pub fn of(load: Load, level: Option<f64>) -> Mode {
        let label = match (load, level) {
            (Load::Concurrency(c), _) => format!("closed-{c}"),
            (Load::Rate(_), Some(f)) => format!("open-{f}"),
            (Load::Rate(r), None) => format!("open-{r}rps"),
            (Load::Replay(x), _) => format!("replay-x{x}"),
        };
        Mode { label, load, level }
    }
}

/// Parses `--capacity-rps` values: `NAME=RPS` for one workload, a bare `RPS` for all (`*`).
pub fn parse_capacities(args: &[String]) -> Result<BTreeMap<String, f64>, String> {
    let mut out = BTreeMap::new();
    for a in args {
        let (name, value) = a.split_once('=').unwrap_or(("*", a.as_str()));
        let rps: f64 = value
            .trim()
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite() && *v > 0.0)
            .ok_or_else(|| format!("--capacity-rps {a}: expected NAME=REQ_PER_S or REQ_PER_S"))?;
        out.insert(name.trim().to_string(), rps);
    }
    Ok(out)
}

/// The capacity open-loop levels are fractions of: an explicit figure, or the best throughput of
/// the workload's closed-loop runs at their highest concurrency among `runs`.
pub fn capacity(explicit: Option<f64>, workload: &str, runs: &[RunReport]) -> Option<f64> {
    if let Some(c) = explicit.filter(|c| *c > 0.0) {
        return Some(c);
    }
    let closed = |r: &RunReport| match r.load {
        Load::Concurrency(c) if r.workload == workload && r.ok > 0 => Some(c),
        _ => None,
    };
    let top = runs.iter().filter_map(closed).max()?;
    runs.iter()
        .filter(|r| closed(r) == Some(top))
        .map(|r| r.requests_per_s)
        .reduce(f64::max)
}

/// The overhead benchmark.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverheadConfig {
    /// Concurrent streams of each measurement.
    pub concurrency: Vec<usize>,
    /// Requests per phase (direct, gateway) of each measurement.
    pub requests: Vec<usize>,
    /// Prompt tokens (unique prompts).
    pub prompt_tokens: usize,
    /// Output tokens.
    pub output_tokens: u32,
    /// Wall-clock limit of one phase, seconds.
    pub max_duration_s: f64,
    /// Open-loop rates (requests per second) measured too, `requests` of the last concurrency each
    /// (a load the local gateway is not saturated by, unlike 50 or 200 closed-loop streams).
    #[serde(default)]
    pub rates: Vec<f64>,
}

/// A benchmark configuration (`bench/config/*.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BenchConfig {
    /// `full`, `quick`, ...
    pub name: String,
    /// Model name served by the fleet.
    pub model: String,
    /// Pool the fleet is registered in.
    pub pool: String,
    /// Seed of every workload and arrival process.
    pub seed: u64,
    /// The fleet.
    pub fleet: FleetConfig,
    /// Policies, in the order they run.
    pub policies: Vec<String>,
    /// The policy the target figures are about (the gateway's default).
    #[serde(default = "default_policy")]
    pub default_policy: String,
    /// The policies it is compared with: the best of them is the reference.
    #[serde(default = "default_baselines")]
    pub baselines: Vec<String>,
    /// Workloads, in the order they run.
    pub workloads: Vec<WorkloadRun>,
    /// The overhead benchmark, if any.
    pub overhead: Option<OverheadConfig>,
    /// Per-request timeout, seconds.
    pub request_timeout_s: f64,
}

fn default_policy() -> String {
    "predicted_latency".into()
}

fn default_baselines() -> Vec<String> {
    ["round_robin", "least_load", "consistent_hash"]
        .map(String::from)
        .to_vec()
}

impl BenchConfig {
    /// Reads a config file.
    pub fn load(path: &Path) -> Result<BenchConfig, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let cfg: BenchConfig =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        for w in &cfg.workloads {
            w.workload
                .check()
                .map_err(|e| format!("{}: workload {}: {e}", path.display(), w.name()))?;
            if w.replay_speedups
                .iter()
                .any(|x| !(x.is_finite() && *x > 0.0))
            {
                return Err(format!(
                    "{}: workload {}: replay_speedups must be positive",
                    path.display(),
                    w.name()
                ));
            }
            if w.apis.contains(&Api::Chat) {
                return Err(format!(
                    "{}: workload {}: apis lists the other APIs (chat always runs)",
                    path.display(),
                    w.name()
                ));
            }
            if !w.replay_speedups.is_empty() && w.workload.trace_window().is_none() {
                return Err(format!(
                    "{}: workload {}: replay_speedups need a trace workload",
                    path.display(),
                    w.name()
                ));
            }
        }
        Ok(cfg)
    }

    /// The oracle's bound for one workload on this fleet.
    pub fn oracle(&self, w: &Workload) -> oracle::OracleBound {
        let fleet_blocks = self.fleet.backends * self.fleet.kv_blocks;
        oracle::workload_bound(w, self.seed, self.fleet.block_tokens(), fleet_blocks)
    }
}

impl FleetConfig {
    /// The engine each vllm-sim of the fleet runs: vllm-sim's own reading of the fleet's flags
    /// (its defaults where the flags are not valid alone).
    pub fn engine(extra_args: &[String]) -> vllm_sim::config::Config {
        use clap::Parser;
        let args = std::iter::once("vllm-sim".to_string()).chain(extra_args.iter().cloned());
        vllm_sim::config::Config::try_parse_from(args)
            .unwrap_or_else(|_| vllm_sim::config::Config::parse_from(["vllm-sim"]))
    }

    /// Tokens per KV block of the fleet's engines: the unit the oracle's cache bound counts in.
    pub fn block_tokens(&self) -> usize {
        Self::engine(&self.extra_args).block_size as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report;
    use serde_json::json;

    /// The oracle counts the cache in the fleet's own blocks: vllm-sim's 64 tokens unless the
    /// fleet's flags say otherwise.
    #[test]
    fn the_oracle_counts_in_the_engines_blocks() {
        let fleet = |extra: &[&str]| FleetConfig {
            backends: 2,
            base_port: 9000,
            kv_blocks: 100,
            time_scale: 1.0,
            extra_args: extra.iter().map(|s| s.to_string()).collect(),
        };
        assert_eq!(fleet(&[]).block_tokens(), 64);
        assert_eq!(fleet(&["--block-size", "16"]).block_tokens(), 16);
    }

    #[test]
    fn the_shipped_configs_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/config");
        for name in ["full.json", "quick.json", "classic.json"] {
            let cfg = BenchConfig::load(&dir.join(name)).unwrap();
            assert_eq!(cfg.fleet.backends, 8, "{name}");
            assert_eq!(cfg.fleet.time_scale, 1.0, "{name}");
            assert!(!cfg.policies.is_empty() && !cfg.workloads.is_empty());
            assert!(cfg
                .workloads
                .iter()
                .all(|w| !w.fixed_modes().is_empty() || w.open_loop.is_some()));
        }
    }

    #[test]
    fn the_full_and_quick_benches_are_the_tail_latency_ones() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/config");
        let full = BenchConfig::load(&dir.join("full.json")).unwrap();
        let quick = BenchConfig::load(&dir.join("quick.json")).unwrap();
        let has =
            |c: &BenchConfig, ps: &[&str]| ps.iter().all(|p| c.policies.iter().any(|q| q == p));
        let five = [
            "predicted_latency",
            "cache_aware",
            "round_robin",
            "least_load",
            "consistent_hash",
        ];
        assert!(has(&full, &five) && has(&full, &["power_of_two"]));
        assert!(has(&quick, &five));
        assert_eq!(full.default_policy, "predicted_latency");
        for cfg in [&full, &quick] {
            let find = |n: &str| cfg.workloads.iter().find(|w| w.name() == n).unwrap();
            let chat = find("chat");
            match chat.workload {
                Workload::MultiTurn {
                    users,
                    rounds,
                    system_tokens,
                    ..
                } => {
                    assert!(users >= 32 && rounds >= 3 && system_tokens >= 1000);
                    // Closed loop at the highest concurrency keeps every client busy.
                    assert!(users >= *chat.closed_loop.iter().max().unwrap());
                }
                ref w => panic!("chat is {w:?}"),
            }
            let groups = find("prefix-groups");
            match groups.workload {
                Workload::PrefixGroups {
                    groups: g,
                    initial_groups,
                    system_tokens,
                    ..
                } => {
                    assert!(g >= 32 && initial_groups < g / 2 && system_tokens >= 1200);
                }
                ref w => panic!("prefix-groups is {w:?}"),
            }
            for w in [chat, groups] {
                assert!(w.closed_loop.contains(&64));
                let levels = &w.open_loop.as_ref().unwrap().levels;
                assert!(levels.iter().any(|l| (0.8..=0.9).contains(l)), "{levels:?}");
            }
        }
        assert!(full.workloads.iter().all(|w| w.closed_loop == [32, 64]));
        // The quick bench sends chat's conversations through the Responses and Messages APIs too.
        let chat = quick.workloads.iter().find(|w| w.name() == "chat").unwrap();
        assert_eq!(chat.apis, [Api::Responses, Api::Messages]);
        let responses = chat.through(Api::Responses);
        assert_eq!(responses.name(), "chat-responses");
        assert!(responses.apis.is_empty());
        assert_eq!(responses.workload, chat.workload);
        assert_eq!(responses.closed_loop, chat.closed_loop);
    }

    #[test]
    fn modes_and_the_measured_capacity() {
        let w: WorkloadRun = serde_json::from_value(json!({
            "name": "g",
            "workload": {"kind": "no-sharing", "requests": 1, "prompt_tokens": 1, "output_tokens": 1},
            "closed_loop": [32, 64],
            "open_loop": {"levels": [0.5, 0.9]},
            "max_duration_s": 1
        }))
        .unwrap();
        let labels = |m: Vec<Mode>| m.into_iter().map(|m| m.label).collect::<Vec<_>>();
        assert_eq!(labels(w.fixed_modes()), ["closed-32", "closed-64"]);
        let open = w.open_modes(41.0, &[0.5, 0.9]);
        assert_eq!(labels(open.clone()), ["open-0.5", "open-0.9"]);
        assert_eq!(open[1].load, Load::Rate(36.9));
        assert_eq!(Mode::of(Load::Rate(20.0), None).label, "open-20rps");
        let report = |workload: &str, load: Load, rps: f64| {
            let mut r = report::summarize(
                report::RunLabel {
                    workload,
                    kind: "no-sharing",
                    mode: "m",
                    policy: "p",
                    load,
                    level: None,
                    time_scale: 1.0,
                },
                &[],
                1.0,
                &[],
                None,
            );
            r.ok = 1;
            r.requests_per_s = rps;
            r
        };
        let runs = vec![
            report("g", Load::Concurrency(64), 30.0),
            report("g", Load::Concurrency(64), 35.0),
            report("g", Load::Concurrency(32), 50.0),
            report("other", Load::Concurrency(128), 90.0),
        ];
        // The best run at the highest concurrency of this workload, not a faster lower one.
        assert_eq!(capacity(None, "g", &runs), Some(35.0));
        assert_eq!(capacity(Some(12.0), "g", &runs), Some(12.0));
        assert_eq!(capacity(None, "none", &runs), None);
        let caps = parse_capacities(&["chat=20.5".into(), "30".into()]).unwrap();
        assert_eq!(caps["chat"], 20.5);
        assert_eq!(caps["*"], 30.0);
        assert!(parse_capacities(&["chat=fast".into()]).is_err());
        assert!(parse_capacities(&["-3".into()]).is_err());
    }
}
