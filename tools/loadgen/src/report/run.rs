//! One run's report: from the client's records and the backends' counter deltas, the latency
//! summaries, throughput, errors, balance across backends and prefix-cache hit rate (against the
//! oracle's bound) of one (workload, mode, policy) run.

use crate::api::Api;
use crate::driver::{Load, Record};
use crate::metrics::Counters;
use crate::oracle::OracleBound;
use crate::stats::{imbalance, Summary};
use serde::Serialize;
use std::collections::BTreeMap;

/// One backend's share of a run.
#[derive(Debug, Clone, Serialize)]
pub struct BackendShare {
    /// Requests the client saw it serve (response header).
    pub requests: u64,
    /// Its counters' change over the run (`/metrics`).
    pub counters: Counters,
}

/// Everything measured in one run.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// Workload name.
    pub workload: String,
    /// Workload kind (`prefix-groups`, `multi-turn`, ...).
    pub kind: String,
    /// Mode: `closed-64`, `open-0.9`, ...
    pub mode: String,
    /// Routing policy (`direct` when no gateway).
    pub policy: String,
    /// The API the requests went through (chat completions unless the workload's `apis` asked
    /// for another).
    pub api: Api,
    /// For a run through another API than chat: the workload whose sessions it sent (this run's
    /// workload is named `<api_of>-<api>`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_of: Option<String>,
    /// How load was offered.
    pub load: Load,
    /// Open-loop sweep: the offered rate as a fraction of the workload's capacity.
    pub level: Option<f64>,
    /// vllm-sim's `--time-scale` (model time = wall time x this).
    pub time_scale: f64,
    /// Wall-clock seconds.
    pub duration_s: f64,
    /// Requests sent.
    pub sent: usize,
    /// Requests that streamed to the end.
    pub ok: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Up to five distinct error texts.
    pub error_samples: Vec<String>,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Time to first token, wall ms.
    pub ttft_ms: Summary,
    /// Time per output token after the first, wall ms.
    pub tpot_ms: Summary,
    /// End-to-end latency, wall ms.
    pub e2e_ms: Summary,
    /// Time to first token in model ms (wall x time scale): what the modelled GPU would show.
    pub ttft_model_ms: Summary,
    /// `long-short` only: time to first token of the short requests, the ones a router can save
    /// from waiting behind a long prefill (a long prompt's own prefill no routing can shorten).
    pub ttft_short_ms: Option<Summary>,
    /// `long-short` only: end-to-end latency of the short requests.
    pub e2e_short_ms: Option<Summary>,
    /// Time to first token as the backends measured it, ms: from each request's own engine-side
    /// figure when the sims report it (vllm-sim `--report-engine-timing`, which `loadgen bench`
    /// turns on), else from vLLM's histogram, interpolated inside its coarse buckets (100 to
    /// 250 ms is one bucket). The client's figure minus this is the gateway's and the network's
    /// share.
    pub backend_ttft_ms: Option<Quantiles>,
    /// Per backend.
    pub backends: BTreeMap<String, BackendShare>,
    /// Busiest backend's requests over the mean.
    pub request_imbalance: f64,
    /// Busiest backend's computed tokens (uncached prompt + output) over the mean.
    pub work_imbalance: f64,
    /// Busiest backend's computed prompt tokens (prompt tokens not found in its prefix cache: its
    /// prefill work) over the mean.
    pub prefill_imbalance: f64,
    /// Fleet-wide counters' change.
    pub fleet: Counters,
    /// Fleet prefix-cache hit rate (`/metrics`, tokens).
    pub hit_rate: f64,
    /// Hit rate from the responses' `cached_tokens` / `prompt_tokens`.
    pub usage_hit_rate: f64,
    /// The oracle's bound for this workload on this fleet.
    pub oracle: Option<OracleBound>,
    /// `hit_rate / oracle.hit_rate`.
    pub fraction_of_oracle: Option<f64>,
    /// Trace replays only: failures counted in the percentiles, slowdown, the slowest requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<super::trace::TraceFigures>,
}

/// What a run was: workload, mode, policy, load and the backends' time scale.
#[derive(Debug, Clone, Copy)]
pub struct RunLabel<'a> {
    /// Workload name.
    pub workload: &'a str,
    /// Workload kind.
    pub kind: &'a str,
    /// Mode label.
    pub mode: &'a str,
    /// Routing policy.
    pub policy: &'a str,
    /// How load was offered.
    pub load: Load,
    /// Fraction of the capacity (open-loop sweeps).
    pub level: Option<f64>,
    /// vllm-sim's `--time-scale`.
    pub time_scale: f64,
}

/// Three percentiles, ms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Quantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// Builds a run's report. `backends` lists every backend of the fleet (id and counter deltas),
/// so idle backends count in the balance.
pub fn summarize(
    label: RunLabel<'_>,
    records: &[Record],
    duration_s: f64,
    backends: &[(String, Counters)],
    oracle: Option<OracleBound>,
) -> RunReport {
    let RunLabel {
        workload,
        kind,
        mode,
        policy,
        load,
        level,
        time_scale,
    } = label;
    let ok: Vec<&Record> = records
        .iter()
        .filter(|r| r.error.is_none() && r.ttft_ms.is_some())
        .collect();
    let mut samples: Vec<String> = Vec::new();
    for r in records.iter().filter_map(|r| r.error.as_ref()) {
        let short: String = r.chars().take(200).collect();
        if samples.len() < 5 && !samples.contains(&short) {
            samples.push(short);
        }
    }
    let ttft = Summary::of(ok.iter().filter_map(|r| r.ttft_ms));
    let mut shares: BTreeMap<String, BackendShare> = backends
        .iter()
        .map(|(id, c)| {
            (
                id.clone(),
                BackendShare {
                    requests: 0,
                    counters: *c,
                },
            )
        })
        .collect();
    for r in records {
        if let Some(b) = &r.backend {
            shares
                .entry(b.clone())
                .or_insert(BackendShare {
                    requests: 0,
                    counters: Counters::default(),
                })
                .requests += 1;
        }
    }
    let fleet = backends
        .iter()
        .fold(Counters::default(), |acc, (_, c)| acc.add(c));
    let reqs: Vec<f64> = shares.values().map(|s| s.requests as f64).collect();
    let work: Vec<f64> = shares.values().map(|s| s.counters.work_tokens()).collect();
    let prefill: Vec<f64> = shares
        .values()
        .map(|s| (s.counters.prefix_queries - s.counters.prefix_hits).max(0.0))
        .collect();
    let (prompt, cached) = ok.iter().fold((0u64, 0u64), |(p, c), r| {
        (
            p + u64::from(r.prompt_tokens.unwrap_or(0)),
            c + u64::from(r.cached_tokens.unwrap_or(0)),
        )
    });
    let hit_rate = fleet.hit_rate();
    let fraction_of_oracle = oracle
        .as_ref()
        .filter(|o| o.hit_rate > 0.01)
        .map(|o| hit_rate / o.hit_rate);
    RunReport {
        workload: workload.to_string(),
        kind: kind.to_string(),
        mode: mode.to_string(),
        policy: policy.to_string(),
        api: Api::Chat,
        api_of: None,
        load,
        level,
        time_scale,
        duration_s,
        sent: records.len(),
        ok: ok.len(),
        errors: records.len() - ok.len(),
        error_samples: samples,
        requests_per_s: ok.len() as f64 / duration_s.max(1e-9),
        output_tokens_per_s: ok.iter().map(|r| f64::from(r.output_tokens)).sum::<f64>()
            / duration_s.max(1e-9),
        ttft_ms: ttft,
        tpot_ms: Summary::of(ok.iter().filter_map(|r| r.tpot_ms())),
        e2e_ms: Summary::of(ok.iter().map(|r| r.e2e_ms)),
        ttft_model_ms: ttft.scaled(time_scale),
        ttft_short_ms: None,
        e2e_short_ms: None,
        backend_ttft_ms: None,
        backends: shares,
        request_imbalance: imbalance(&reqs, backends.len()),
        work_imbalance: imbalance(&work, backends.len()),
        prefill_imbalance: imbalance(&prefill, backends.len()),
        fleet,
        hit_rate,
        usage_hit_rate: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        oracle,
        fraction_of_oracle,
        trace: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::test_support::rec;

    #[test]
    fn summarize_counts_balance_hits_and_errors() {
        let mut records = vec![rec("a", 1.0), rec("a", 2.0), rec("b", 3.0)];
        records.push(Record {
            error: Some("HTTP 503".into()),
            ttft_ms: None,
            ..rec("b", 0.0)
        });
        let c = Counters {
            prefix_queries: 100.0,
            prefix_hits: 25.0,
            ..Counters::default()
        };
        let backends = vec![
            ("a".to_string(), c),
            ("b".to_string(), c),
            ("c".to_string(), Counters::default()),
        ];
        let r = summarize(
            RunLabel {
                workload: "w",
                kind: "no-sharing",
                mode: "open-1rps",
                policy: "p",
                load: Load::Rate(1.0),
                level: None,
                time_scale: 4.0,
            },
            &records,
            2.0,
            &backends,
            None,
        );
        assert_eq!((r.sent, r.ok, r.errors), (4, 3, 1));
        assert_eq!(r.backends["a"].requests, 2);
        assert_eq!(r.request_imbalance, 2.0 / (4.0 / 3.0));
        assert_eq!(r.hit_rate, 0.25);
        assert_eq!(r.usage_hit_rate, 0.5);
        assert_eq!(r.ttft_model_ms.p50, 8.0);
        assert!((r.tpot_ms.p50 - 1.0).abs() < 1e-9);
        assert_eq!(r.requests_per_s, 1.5);
    }
}
