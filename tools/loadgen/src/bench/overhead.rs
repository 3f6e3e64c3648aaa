//! The gateway's added latency: the same closed- or open-loop workload sent straight to the
//! backends and then through the gateway, on the same fleet, one after the other.

use super::config::{BenchConfig, OverheadConfig};
use super::fleet::Fleet;
use super::gateway::Gateway;
use crate::client::Http;
use crate::driver::{drive, Limits, Load, Target};
use crate::report::OverheadPoint;
use crate::stats::Summary;
use crate::workload::Workload;
use std::time::Duration;

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
            Load::Rate(_) | Load::Replay(_) => 0,
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
            api: crate::api::Api::Chat,
            model: cfg.model.clone(),
            headers: vec![],
        };
        let via = Target {
            urls: vec![format!("{}/v1/chat/completions", gw.url)],
            api: crate::api::Api::Chat,
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
