//! `loadgen bench`: the whole benchmark against a running gateway. It owns a fleet of vllm-sim
//! processes, and for every workload and policy: restarts the fleet (cold caches), re-registers it
//! in the pool (which also purges the pool's prefix-affinity table), sets the policy, waits until a
//! probe has made every backend ready, reads every backend's `/metrics`, runs the workload, reads
//! `/metrics` again. Then it measures the gateway's overhead against direct calls, and writes the
//! JSON result, the markdown tables and the charts.

use crate::client::Http;
use crate::driver::{drive, Limits, Load, Target};
use crate::metrics::{Counters, Histogram};
use crate::oracle;
use crate::report::{self, BenchResult, OverheadPoint, RunReport};
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

/// One workload of the benchmark.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadRun {
    /// The workload and its parameters.
    pub workload: Workload,
    /// How load is offered.
    pub load: Load,
    /// Wall-clock limit of one run, seconds.
    pub max_duration_s: f64,
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
    /// Workloads, in the order they run.
    pub workloads: Vec<WorkloadRun>,
    /// The overhead benchmark, if any.
    pub overhead: Option<OverheadConfig>,
    /// Per-request timeout, seconds.
    pub request_timeout_s: f64,
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

    /// Sets the pool's policy (probing every second so scraped load stays fresh).
    pub async fn set_policy(&self, policy: &str) -> Result<(), String> {
        let body = json!({"policy": policy, "probe_interval_ms": 1000});
        match self
            .admin(Method::PUT, &format!("/pools/{}", self.pool), Some(body))
            .await?
        {
            (200, _) => Ok(()),
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
    /// Only these workloads / policies (empty: all).
    pub only_workloads: Vec<String>,
    pub only_policies: Vec<String>,
}

/// Runs one workload under one policy on a freshly restarted fleet.
async fn run_one(
    cfg: &BenchConfig,
    fleet: &mut Fleet,
    gw: &Gateway,
    http: &Http,
    w: &WorkloadRun,
    policy: &str,
    tmp_dir: &Path,
) -> Result<RunReport, String> {
    fleet.restart().await?;
    let members = fleet.members();
    gw.register(&members, &cfg.model).await?;
    gw.set_policy(policy).await?;
    gw.wait_ready(members.len()).await?;
    let target = Target {
        urls: vec![format!("{}/v1/chat/completions", gw.url)],
        model: cfg.model.clone(),
        headers: vec![],
    };
    let limits = Limits {
        max_duration: Duration::from_secs_f64(w.max_duration_s),
        request_timeout: Duration::from_secs_f64(cfg.request_timeout_s),
    };
    if let Some(warmup) = w.workload.warmup(cfg.seed) {
        // As many at once as there are backends, so that a load-aware policy spreads new prefixes.
        let (records, _) = drive(
            http.clone(),
            target.clone(),
            warmup,
            Load::Concurrency(members.len()),
            cfg.seed,
            limits,
        )
        .await;
        let failed = records.iter().filter(|r| r.error.is_some()).count();
        if failed > 0 {
            eprintln!("    warm-up: {failed} of {} requests failed", records.len());
        }
    }
    let before = fleet.scrape().await;
    let plan = w.workload.generate(cfg.seed);
    let (records, elapsed) =
        drive(http.clone(), target, plan.clone(), w.load, cfg.seed, limits).await;
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
    gw.dump_state(&tmp_dir.join(format!("state-{}-{policy}.json", w.workload.kind())))
        .await;
    let mut report = report::summarize(
        report::RunLabel {
            workload: w.workload.kind(),
            policy,
            load: w.load,
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
    Ok(report)
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
    gw.set_policy("round_robin").await?;
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
    let mut runs = Vec::new();
    let started = Instant::now();
    for w in &cfg.workloads {
        if !opts.only_workloads.is_empty()
            && !opts.only_workloads.iter().any(|o| o == w.workload.kind())
        {
            continue;
        }
        for policy in &cfg.policies {
            if !opts.only_policies.is_empty() && !opts.only_policies.contains(policy) {
                continue;
            }
            let r = run_one(&cfg, &mut fleet, &gw, &http, w, policy, &opts.tmp_dir).await?;
            eprintln!(
                "[{:>5.0}s] {:<13} {:<15} hit {:>5.1}% (oracle {:>5.1}%)  TTFT p50 {:>7.1} p99 {:>7.1} ms  E2E p99 {:>7.0} ms  busiest/mean {:.2}  {:.1} req/s  {}/{} ok",
                started.elapsed().as_secs_f64(),
                r.workload,
                r.policy,
                r.hit_rate * 100.0,
                r.oracle.as_ref().map_or(0.0, |o| o.hit_rate * 100.0),
                r.ttft_ms.p50,
                r.ttft_ms.p99,
                r.e2e_ms.p99,
                r.request_imbalance,
                r.requests_per_s,
                r.ok,
                r.sent
            );
            for e in &r.error_samples {
                eprintln!("    error: {e}");
            }
            runs.push(r);
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
        config: serde_json::to_value(&cfg).unwrap_or_default(),
        targets: report::verdicts(&runs),
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
    for v in &result.targets {
        eprintln!(
            "  [{}] {} -- {}",
            match v.met {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "n/a",
            },
            v.target,
            v.measured
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
        for name in ["full.json", "quick.json"] {
            let cfg = BenchConfig::load(&dir.join(name)).unwrap();
            assert_eq!(cfg.fleet.backends, 8, "{name}");
            assert!(!cfg.policies.is_empty() && !cfg.workloads.is_empty());
        }
    }
}
