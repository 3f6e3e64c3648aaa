//! One measured run: a workload in one mode under one policy, on a freshly restarted fleet
//! registered in the pool, with its warm-up, the backends' counters before and after, and the
//! resulting [`RunReport`]. [`measure`] is the run itself against any router in front of the
//! fleet (the goodput benchmark also sends it through another gateway).

use super::config::{BenchConfig, Mode, WorkloadRun};
use super::fleet::Fleet;
use super::gateway::Gateway;
use crate::api::Api;
use crate::client::Http;
use crate::driver::{drive, Limits, Load, Target};
use crate::metrics::{Counters, Histogram};
use crate::report::{self, RunReport};
use crate::stats::Summary;
use crate::workload::Workload;
use std::path::Path;
use std::time::Duration;

/// Runs one workload in one mode under one policy on a freshly restarted fleet, its requests sent
/// through `api` (another API than chat: the run is [`WorkloadRun::through`] it, named
/// `<name>-<api>`); `Ok(Err(..))` if the gateway refused the policy.
#[allow(clippy::too_many_arguments)]
pub async fn run_one(
    cfg: &BenchConfig,
    fleet: &mut Fleet,
    gw: &Gateway,
    http: &Http,
    w: &WorkloadRun,
    mode: &Mode,
    policy: &str,
    api: Api,
    tmp_dir: &Path,
) -> Result<Result<RunReport, String>, String> {
    let of = w.name().to_string();
    let through;
    let w = if api == Api::Chat {
        w
    } else {
        through = w.through(api);
        &through
    };
    fleet.restart().await?;
    let members = fleet.members();
    gw.register(&members, &cfg.model).await?;
    if let Err(refused) = gw.set_policy(policy).await? {
        return Ok(Err(refused));
    }
    gw.wait_ready(members.len()).await?;
    let target = Target {
        urls: vec![format!("{}{}", gw.url, api.path())],
        api,
        model: cfg.model.clone(),
        headers: vec![],
    };
    let mut report = measure(cfg, fleet, http, w, mode, policy, target, tmp_dir).await;
    if api != Api::Chat {
        report.api = api;
        report.api_of = Some(of);
    }
    gw.dump_state(&tmp_dir.join(format!("state-{}-{}-{policy}.json", w.name(), mode.label)))
        .await;
    Ok(Ok(report))
}

/// Runs one workload in one mode against `target` (the gateway, or another router in front of
/// the fleet) on the running `fleet`: its warm-up, the backends' counters before and after, the
/// records written to `tmp_dir`, and the resulting [`RunReport`] labelled `policy`.
#[allow(clippy::too_many_arguments)]
pub async fn measure(
    cfg: &BenchConfig,
    fleet: &Fleet,
    http: &Http,
    w: &WorkloadRun,
    mode: &Mode,
    policy: &str,
    target: Target,
    tmp_dir: &Path,
) -> RunReport {
    let members = fleet.members();
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
    let records_file = tmp_dir.join(format!(
        "records-{}-{}-{policy}.jsonl",
        w.name(),
        mode.label
    ));
    if let Err(e) = crate::driver::write_records(&records_file, &records) {
        eprintln!("    {e}");
    }
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
    // Each request's engine-side figure when (nearly) every answer carried one; else the
    // backends' histograms.
    let ok: Vec<&crate::driver::Record> = records.iter().filter(|r| r.error.is_none()).collect();
    let engine = Summary::of(ok.iter().filter_map(|r| r.engine_ttft_ms));
    report.backend_ttft_ms = Some(if !ok.is_empty() && engine.count * 100 >= ok.len() * 99 {
        report::Quantiles {
            p50: engine.p50,
            p90: engine.p90,
            p99: engine.p99,
        }
    } else {
        report::Quantiles {
            p50: backend_ttft.quantile(0.5) * 1e3,
            p90: backend_ttft.quantile(0.9) * 1e3,
            p99: backend_ttft.quantile(0.99) * 1e3,
        }
    });
    if w.workload.trace_window().is_some() {
        let idle = report::IdleModel::of_fleet(&cfg.fleet.extra_args, cfg.fleet.time_scale);
        report.trace = Some(report::trace_figures(&records, &idle));
    }
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
    report
}
