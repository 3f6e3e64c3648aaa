//! `loadgen bench`: the whole benchmark against a running gateway. It owns a fleet of vllm-sim
//! processes, and for every workload, mode (closed loop at N clients, open loop at a fraction of the
//! capacity the closed-loop runs measured, or a fixed load) and policy: restarts the fleet (cold
//! caches), re-registers it in the pool (which also purges the pool's prefix-affinity table), sets
//! the policy (skipping one the gateway refuses), waits until a probe has made every backend ready,
//! reads every backend's `/metrics`, runs the workload, reads `/metrics` again. Then it measures the
//! gateway's overhead against direct calls (if configured), and writes the JSON result, the
//! markdown tables and the charts.

use crate::client::Http;
use crate::driver::{drive, Limits, Load, Target};
use crate::metrics::{Counters, Histogram};
use crate::oracle;
use crate::report::{self, BenchResult, OverheadPoint, RunReport, Skipped};
use crate::stats::Summary;
use crate::workload::Workload;
use hyper::Method;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// vLLM's time-to-first-token histogram (seconds, measured by the backend).
const TTFT_HISTOGRAM: &str = "vllm:time_to_first_token_seconds";

/// The fleet of simulated backends.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// Number of vllm-sim processes.
    pub backends: usize,
    /// Port of the first; the others follow.
    pub base_port: u16,
    /// `--kv-blocks` of each (16 tokens per block).
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
    /// Closed loop: a client's think time between a conversation's turns, ms.
    #[serde(default)]
    pub think_ms: f64,
    /// Open loop: jittered spacing of a conversation's turns (see the driver) instead of a fixed
    /// one.
    #[serde(default)]
    pub random_turn_gaps: bool,
    /// Wall-clock limit of one run, seconds.
    pub max_duration_s: f64,
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

    /// The modes that need no capacity: closed loops first, then the fixed load.
    pub fn fixed_modes(&self) -> Vec<Mode> {
        let mut out: Vec<Mode> = self
            .closed_loop
            .iter()
            .map(|&c| Mode::of(Load::Concurrency(c), None))
            .collect();
        out.extend(self.load.map(|l| Mode::of(l, None)));
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
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The oracle's bound for one workload on this fleet.
    pub fn oracle(&self, w: &Workload) -> oracle::OracleBound {
        oracle::workload_bound(w, self.seed, 16, self.fleet.backends * self.fleet.kv_blocks)
    }
}

/// Running vllm-sim processes, restartable on the same ports.
pub struct Fleet {
    config: FleetConfig,
    model: String,
    bin: PathBuf,
    log_dir: PathBuf,
    children: Vec<Child>,
    http: Http,
}

impl Fleet {
    /// A fleet (not started yet).
    pub fn new(
        config: FleetConfig,
        model: String,
        bin: PathBuf,
        log_dir: PathBuf,
        http: Http,
    ) -> Self {
        Fleet {
            config,
            model,
            bin,
            log_dir,
            children: Vec::new(),
            http,
        }
    }

    /// Backend ids (`sim-1`, ...) and base URLs.
    pub fn members(&self) -> Vec<(String, String)> {
        (0..self.config.backends)
            .map(|i| {
                (
                    format!("sim-{}", i + 1),
                    format!("http://127.0.0.1:{}", self.config.base_port as usize + i),
                )
            })
            .collect()
    }

    /// Stops every process this fleet started.
    pub async fn stop(&mut self) {
        for c in &mut self.children {
            let _ = c.start_kill();
        }
        for c in &mut self.children {
            let _ = c.wait().await;
        }
        self.children.clear();
    }

    /// (Re)starts every backend with empty caches and waits until each answers `/health`.
    pub async fn restart(&mut self) -> Result<(), String> {
        self.stop().await;
        std::fs::create_dir_all(&self.log_dir).map_err(|e| e.to_string())?;
        for (i, (_, url)) in self.members().iter().enumerate() {
            let port = self.config.base_port as usize + i;
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.log_dir.join(format!("sim-{port}.log")))
                .map_err(|e| e.to_string())?;
            let child = Command::new(&self.bin)
                .args(["--port", &port.to_string(), "--model", &self.model])
                .args([
                    "--kv-blocks",
                    &self.config.kv_blocks.to_string(),
                    "--time-scale",
                    &self.config.time_scale.to_string(),
                ])
                .args(["--seed", &port.to_string()])
                .args(&self.config.extra_args)
                .stdout(Stdio::null())
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| format!("starting {}: {e}", self.bin.display()))?;
            self.children.push(child);
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Ok((200, _)) = self
                    .http
                    .call(Method::GET, &format!("{url}/health"), None, None)
                    .await
                {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!("vllm-sim on port {port} did not come up"));
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
        Ok(())
    }

    /// Every backend's counters and time-to-first-token histogram, in `members()` order.
    pub async fn scrape(&self) -> Vec<(Counters, Histogram)> {
        let mut out = Vec::new();
        for (_, url) in self.members() {
            let text = match self
                .http
                .call(Method::GET, &format!("{url}/metrics"), None, None)
                .await
            {
                Ok((200, t)) => t,
                _ => String::new(),
            };
            out.push((
                Counters::from_text(&text),
                Histogram::from_text(&text, TTFT_HISTOGRAM),
            ));
        }
        out
    }
}

/// The gateway's admin API, as far as the benchmark needs it.
pub struct Gateway {
    /// Base URL.
    pub url: String,
    /// Admin bearer token.
    pub token: String,
    /// Pool name.
    pub pool: String,
    http: Http,
}

impl Gateway {
    /// A handle on the gateway at `url`.
    pub fn new(url: String, token: String, pool: String, http: Http) -> Self {
        Gateway {
            url,
            token,
            pool,
            http,
        }
    }

    async fn admin(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(u16, String), String> {
        self.http
            .call(
                method,
                &format!("{}/admin{path}", self.url),
                Some(&self.token),
                body.map(|b| b.to_string()),
            )
            .await
    }

    /// Checks the token works.
    pub async fn check(&self) -> Result<(), String> {
        match self.admin(Method::GET, "/backends", None).await? {
            (200, _) => Ok(()),
            (s, body) => Err(format!("admin API answered {s}: {body}")),
        }
    }

    /// Removes every backend of the pool (purging their affinity) and registers the fleet again.
    pub async fn register(&self, members: &[(String, String)], model: &str) -> Result<(), String> {
        let (_, listing) = self.admin(Method::GET, "/backends", None).await?;
        let listing: serde_json::Value = serde_json::from_str(&listing).unwrap_or_default();
        let urls: Vec<&str> = members.iter().map(|(_, u)| u.as_str()).collect();
        for b in listing
            .get("data")
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
        {
            let field = |k: &str| b.get(k).and_then(serde_json::Value::as_str).unwrap_or("");
            if field("pool") == self.pool || urls.contains(&field("url")) {
                let path = format!(
                    "/backends/{}?force=true&pool={}",
                    field("id"),
                    field("pool")
                );
                self.admin(Method::DELETE, &path, None).await?;
            }
        }
        for (id, url) in members {
            let body = json!({"id": id, "url": url, "pool": self.pool, "models": [model]});
            match self.admin(Method::POST, "/backends", Some(body)).await? {
                (200 | 201, _) => {}
                (s, b) => return Err(format!("registering {id}: HTTP {s}: {b}")),
            }
        }
        Ok(())
    }

    /// Sets the pool's policy (probing every second so scraped load stays fresh). `Ok(Err(..))`:
    /// the gateway refused the policy (400, e.g. a name this build does not know).
    pub async fn set_policy(&self, policy: &str) -> Result<Result<(), String>, String> {
        let body = json!({"policy": policy, "probe_interval_ms": 1000});
        match self
            .admin(Method::PUT, &format!("/pools/{}", self.pool), Some(body))
            .await?
        {
            (200, _) => Ok(Ok(())),
            (400 | 422, b) => Ok(Err(format!("HTTP 400: {b}"))),
            (s, b) => Err(format!("setting policy {policy}: HTTP {s}: {b}")),
        }
    }

    /// Writes the pool's state and backends (for diagnosis) to `path`; failures are ignored.
    pub async fn dump_state(&self, path: &Path) {
        let pool = self
            .admin(Method::GET, &format!("/pools/{}", self.pool), None)
            .await
            .map(|r| r.1)
            .unwrap_or_default();
        let backends = self
            .admin(Method::GET, "/backends", None)
            .await
            .map(|r| r.1)
            .unwrap_or_default();
        let parse = |t: &str| {
            serde_json::from_str::<serde_json::Value>(t).unwrap_or(serde_json::Value::Null)
        };
        let doc = json!({"pool": parse(&pool), "backends": parse(&backends)});
        let _ = std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap_or_default());
    }

    /// Forces probe rounds until `n` backends are ready.
    pub async fn wait_ready(&self, n: usize) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.admin(Method::POST, &format!("/pools/{}/probe", self.pool), None)
                .await?;
            let (_, body) = self
                .admin(Method::GET, &format!("/pools/{}", self.pool), None)
                .await?;
            let ready = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("ready_backends").and_then(serde_json::Value::as_u64))
                .unwrap_or(0);
            if ready as usize >= n {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("only {ready} of {n} backends became ready: {body}"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Machine facts for the report.
pub fn machine() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert(
        "nproc".into(),
        std::thread::available_parallelism().map_or("?".into(), |n| n.to_string()),
    );
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    if let Some(model) = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
    {
        m.insert("cpu".into(), model.trim().to_string());
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    if let Some(kb) = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
    {
        m.insert("memory".into(), format!("{:.0} GiB", kb / 1024.0 / 1024.0));
    }
    m
}

/// `(YYYY-MM-DD, HH:MM:SS)` in UTC, from the system clock.
pub fn utc_now() -> (String, String) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (date, tod) = ((secs / 86_400) as i64, secs % 86_400);
    (
        civil_date(date),
        format!("{:02}:{:02}:{:02}", tod / 3600, tod / 60 % 60, tod % 60),
    )
}

/// The proleptic Gregorian date of a day number since 1970-01-01 (Howard Hinnant's algorithm).
pub fn civil_date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Options of `loadgen bench` besides the config.
pub struct BenchOptions {
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
    /// The policy the targets are about, instead of the config's.
    pub default_policy: Option<String>,
}

/// Runs one workload in one mode under one policy on a freshly restarted fleet; `Ok(Err(..))` if
/// the gateway refused the policy.
#[allow(clippy::too_many_arguments)]
async fn run_one(
    cfg: &BenchConfig,
    fleet: &mut Fleet,
    gw: &Gateway,
    http: &Http,
    w: &WorkloadRun,
    mode: &Mode,
    policy: &str,
    tmp_dir: &Path,
) -> Result<Result<RunReport, String>, String> {
    fleet.restart().await?;
    let members = fleet.members();
    gw.register(&members, &cfg.model).await?;
    if let Err(refused) = gw.set_policy(policy).await? {
        return Ok(Err(refused));
    }
    gw.wait_ready(members.len()).await?;
    let target = Target {
        urls: vec![format!("{}/v1/chat/completions", gw.url)],
        model: cfg.model.clone(),
        headers: vec![],
    };
    let limits = Limits {
        max_duration: Duration::from_secs_f64(w.max_duration_s),
        request_timeout: Duration::from_secs_f64(cfg.request_timeout_s),
        think: Duration::from_secs_f64(w.think_ms.max(0.0) / 1e3),
        random_turn_gaps: w.random_turn_gaps,
    };
    if let Some(warmup) = w.workload.warmup(cfg.seed) {
        // As many at once as there are backends, so that a load-aware policy spreads new prefixes.
        let (records, _) = drive(
            http.clone(),
            target.clone(),
            warmup,
            Load::Concurrency(members.len()),
            cfg.seed,
            Limits {
                think: Duration::ZERO,
                random_turn_gaps: false,
                ..limits
            },
        )
        .await;
        let failed = records.iter().filter(|r| r.error.is_some()).count();
        if failed > 0 {
            eprintln!("    warm-up: {failed} of {} requests failed", records.len());
        }
    }
    let before = fleet.scrape().await;
    let plan = w.workload.generate(cfg.seed);
    let (records, elapsed) = drive(
        http.clone(),
        target,
        plan.clone(),
        mode.load,
        cfg.seed,
        limits,
    )
    .await;
    // Let the last streams' metrics settle (the sim counts a request when it finishes).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = fleet.scrape().await;
    let deltas: Vec<(String, Counters)> = members
        .iter()
        .zip(after.iter().zip(before.iter()))
        .map(|((id, _), (a, b))| (id.clone(), a.0.since(&b.0)))
        .collect();
    let backend_ttft = after
        .iter()
        .zip(before.iter())
        .fold(Histogram::default(), |acc, (a, b)| {
            acc.add(&a.1.since(&b.1))
        });
    gw.dump_state(&tmp_dir.join(format!("state-{}-{}-{policy}.json", w.name(), mode.label)))
        .await;
    let mut report = report::summarize(
        report::RunLabel {
            workload: w.name(),
            kind: w.workload.kind(),
            mode: &mode.label,
            policy,
            load: mode.load,
            level: mode.level,
            time_scale: cfg.fleet.time_scale,
        },
        &records,
        elapsed,
        &deltas,
        Some(cfg.oracle(&w.workload)),
    );
    report.backend_ttft_ms = Some(report::Quantiles {
        p50: backend_ttft.quantile(0.5) * 1e3,
        p90: backend_ttft.quantile(0.9) * 1e3,
        p99: backend_ttft.quantile(0.99) * 1e3,
    });
    if let Workload::LongShort { long_tokens, .. } = w.workload {
        let short: Vec<&crate::driver::Record> = records
            .iter()
            .filter(|r| {
                r.error.is_none() && plan.sessions[r.session].turns[0].user.len() < long_tokens * 4
            })
            .collect();
        report.ttft_short_ms = Some(Summary::of(short.iter().filter_map(|r| r.ttft_ms)));
        report.e2e_short_ms = Some(Summary::of(short.iter().map(|r| r.e2e_ms)));
    }
    Ok(Ok(report))
}

/// Measures the gateway's added latency: for each concurrency, the same closed-loop workload sent
/// straight to the backends (client-side round robin) and then through the gateway (round_robin
/// policy), on the same fleet, one after the other.
pub async fn overhead(
    cfg: &BenchConfig,
    oc: &OverheadConfig,
    fleet: &mut Fleet,
    gw: &Gateway,
    http: &Http,
) -> Result<Vec<OverheadPoint>, String> {
    fleet.restart().await?;
    let members = fleet.members();
    gw.register(&members, &cfg.model).await?;
    gw.set_policy("round_robin").await??;
    gw.wait_ready(members.len()).await?;
    let mut out = Vec::new();
    let loads: Vec<Load> = oc
        .concurrency
        .iter()
        .map(|&c| Load::Concurrency(c))
        .chain(oc.rates.iter().map(|&r| Load::Rate(r)))
        .collect();
    for (i, &load) in loads.iter().enumerate() {
        let c = match load {
            Load::Concurrency(c) => c,
            Load::Rate(_) => 0,
        };
        let n = oc
            .requests
            .get(i)
            .copied()
            .unwrap_or(oc.requests[oc.requests.len() - 1]);
        let workload = Workload::NoSharing {
            requests: n,
            prompt_tokens: oc.prompt_tokens,
            output_tokens: oc.output_tokens,
        };
        let limits = Limits {
            max_duration: Duration::from_secs_f64(oc.max_duration_s),
            request_timeout: Duration::from_secs_f64(cfg.request_timeout_s),
            think: Duration::ZERO,
            random_turn_gaps: false,
        };
        let direct = Target {
            urls: members
                .iter()
                .map(|(_, u)| format!("{u}/v1/chat/completions"))
                .collect(),
            model: cfg.model.clone(),
            headers: vec![],
        };
        let via = Target {
            urls: vec![format!("{}/v1/chat/completions", gw.url)],
            model: cfg.model.clone(),
            headers: vec![],
        };
        let phase = |t: Target, seed: u64| {
            let plan = workload.generate(seed);
            let http = http.clone();
            async move { drive(http, t, plan, load, seed, limits).await }
        };
        // A short warm-up through both paths opens the connections.
        let warm = Workload::NoSharing {
            requests: c.clamp(8, 50),
            prompt_tokens: 8,
            output_tokens: 2,
        };
        let _ = drive(
            http.clone(),
            via.clone(),
            warm.generate(1),
            Load::Concurrency(c.max(8)),
            1,
            limits,
        )
        .await;
        let _ = drive(
            http.clone(),
            direct.clone(),
            warm.generate(2),
            Load::Concurrency(c.max(8)),
            2,
            limits,
        )
        .await;
        let (d, d_s) = phase(direct, cfg.seed + 10 + i as u64).await;
        let (g, g_s) = phase(via, cfg.seed + 20 + i as u64).await;
        let ok = |r: &&crate::driver::Record| r.error.is_none() && r.ttft_ms.is_some();
        let ttft = |v: &[crate::driver::Record]| {
            Summary::of(v.iter().filter(ok).filter_map(|r| r.ttft_ms))
        };
        let e2e = |v: &[crate::driver::Record]| Summary::of(v.iter().filter(ok).map(|r| r.e2e_ms));
        let (dt, gt, de, ge) = (ttft(&d), ttft(&g), e2e(&d), e2e(&g));
        let point = OverheadPoint {
            load,
            concurrency: c,
            requests: n,
            direct_ttft_p50: dt.p50,
            direct_ttft_p99: dt.p99,
            gateway_ttft_p50: gt.p50,
            gateway_ttft_p99: gt.p99,
            direct_e2e_p50: de.p50,
            direct_e2e_p99: de.p99,
            gateway_e2e_p50: ge.p50,
            gateway_e2e_p99: ge.p99,
            direct_rps: dt.count as f64 / d_s.max(1e-9),
            gateway_rps: gt.count as f64 / g_s.max(1e-9),
            direct_errors: d.len() - dt.count,
            gateway_errors: g.len() - gt.count,
        };
        eprintln!(
            "overhead: {load:?}: direct TTFT p50 {:.1} p99 {:.1} ms; gateway p50 {:.1} p99 {:.1} ms ({} / {} errors)",
            dt.p50, dt.p99, gt.p50, gt.p99, point.direct_errors, point.gateway_errors
        );
        out.push(point);
    }
    Ok(out)
}

/// The whole benchmark; writes `<out>/<date>[-name].{json,md}` and the charts, and returns the
/// path of the JSON file.
pub async fn bench(cfg: BenchConfig, opts: BenchOptions) -> Result<PathBuf, String> {
    let http = Http::new();
    let (date, time) = utc_now();
    let gw = Gateway::new(
        opts.gateway.clone(),
        opts.admin_token.clone(),
        cfg.pool.clone(),
        http.clone(),
    );
    gw.check().await?;
    let mut fleet = Fleet::new(
        cfg.fleet.clone(),
        cfg.model.clone(),
        opts.sim_bin.clone(),
        opts.tmp_dir.clone(),
        http.clone(),
    );
    let policies = if opts.policies.is_empty() {
        cfg.policies.clone()
    } else {
        opts.policies.clone()
    };
    let mut runs: Vec<RunReport> = Vec::new();
    let mut skipped: Vec<Skipped> = Vec::new();
    let mut capacities: BTreeMap<String, f64> = BTreeMap::new();
    let started = Instant::now();
    for w in &cfg.workloads {
        if !opts.only_workloads.is_empty() && !opts.only_workloads.iter().any(|o| o == w.name()) {
            continue;
        }
        let mut w = w.clone();
        if !opts.closed_loop.is_empty() && !w.closed_loop.is_empty() {
            w.closed_loop = opts.closed_loop.clone();
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
                let r = match run_one(
                    &cfg,
                    &mut fleet,
                    &gw,
                    &http,
                    &w,
                    &mode,
                    policy,
                    &opts.tmp_dir,
                )
                .await?
                {
                    Ok(r) => r,
                    Err(refused) => {
                        eprintln!(
                            "bench: the gateway refused policy {policy}, skipping it: {refused}"
                        );
                        skipped.push(Skipped {
                            policy: policy.clone(),
                            reason: refused,
                        });
                        continue;
                    }
                };
                eprintln!(
                    "[{:>5.0}s] {:<13} {:<11} {:<17} TTFT p50 {:>7.1} p99 {:>7.1}  E2E p50 {:>6.0} p99 {:>6.0} ms  {:>5.1} req/s {:>5.0} tok/s  hit {:>5.1}% (oracle {:>5.1}%)  busiest/mean prefill {:.2}  {}/{} ok",
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
                runs.push(r);
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
    let default_policy = opts
        .default_policy
        .clone()
        .unwrap_or_else(|| cfg.default_policy.clone());
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
    std::fs::create_dir_all(&opts.out_dir).map_err(|e| e.to_string())?;
    let stem = if cfg.name == "full" {
        date
    } else {
        format!("{date}-{}", cfg.name)
    };
    let json_path = opts.out_dir.join(format!("{stem}.json"));
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&result).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    report::charts(&result, &opts.out_dir, &format!("{stem}-"))?;
    std::fs::write(
        opts.out_dir.join(format!("{stem}.md")),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(19_723), "2024-01-01");
        assert_eq!(civil_date(11_016), "2000-02-29");
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
