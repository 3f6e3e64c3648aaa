//! The benchmark's result document: every run, the overhead measurement, the target verdicts,
//! and what was skipped, as written to `bench/results/*.json`.

use super::run::RunReport;
use super::targets::{TailTarget, Verdict};
use crate::driver::Load;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The gateway's added latency at one concurrency, measured against direct calls in the same run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OverheadPoint {
    /// How load was offered.
    pub load: Load,
    /// Concurrent streams (0 for an open-loop rate).
    pub concurrency: usize,
    /// Requests per phase.
    pub requests: usize,
    /// Direct TTFT p50 / p99, ms.
    pub direct_ttft_p50: f64,
    pub direct_ttft_p99: f64,
    /// Through the gateway, TTFT p50 / p99, ms.
    pub gateway_ttft_p50: f64,
    pub gateway_ttft_p99: f64,
    /// Direct and gateway end-to-end p50 / p99, ms.
    pub direct_e2e_p50: f64,
    pub direct_e2e_p99: f64,
    pub gateway_e2e_p50: f64,
    pub gateway_e2e_p99: f64,
    /// Throughput of each phase, requests per second.
    pub direct_rps: f64,
    pub gateway_rps: f64,
    /// Errors in each phase.
    pub direct_errors: usize,
    pub gateway_errors: usize,
}

impl OverheadPoint {
    /// Added TTFT at p50 and p99, ms.
    pub fn added_ttft(&self) -> (f64, f64) {
        (
            self.gateway_ttft_p50 - self.direct_ttft_p50,
            self.gateway_ttft_p99 - self.direct_ttft_p99,
        )
    }
}

/// The whole benchmark's result document.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// Config name (`full`, `quick`).
    pub name: String,
    /// UTC date and time of the start.
    pub started: String,
    /// Machine description (`nproc`, CPU model, memory).
    pub machine: BTreeMap<String, String>,
    /// The config as run.
    pub config: serde_json::Value,
    /// Every run.
    pub runs: Vec<RunReport>,
    /// The overhead benchmark.
    pub overhead: Vec<OverheadPoint>,
    /// Issue 7's target figures and verdicts (hit rate and balance of cache_aware).
    pub targets: Vec<Verdict>,
    /// The policy the tail-latency targets are about.
    pub default_policy: String,
    /// The policies it is compared with.
    pub baselines: Vec<String>,
    /// Issue 11's tail-latency targets, per workload and mode.
    pub tail_targets: Vec<TailTarget>,
    /// The capacity each open-loop sweep's levels are fractions of, requests per second.
    pub capacity_rps: BTreeMap<String, f64>,
    /// Policies the gateway refused (not run).
    pub skipped: Vec<Skipped>,
}

/// A policy the gateway refused, so not benchmarked.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    /// The policy.
    pub policy: String,
    /// The gateway's answer.
    pub reason: String,
}
