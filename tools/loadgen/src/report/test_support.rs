//! Records and run reports for the report module's tests.

use super::run::{summarize, RunLabel, RunReport};
use crate::driver::{Load, Record};
use crate::metrics::Counters;
use crate::oracle::OracleBound;

pub fn rec(backend: &str, ttft: f64) -> Record {
    Record {
        session: 0,
        turn: 0,
        sent_s: 0.0,
        status: 200,
        error: None,
        ttft_ms: Some(ttft),
        e2e_ms: ttft + 10.0,
        output_tokens: 11,
        prompt_tokens: Some(100),
        cached_tokens: Some(50),
        backend: Some(backend.into()),
        decision: None,
        server_timing: None,
        engine_ttft_ms: None,
        predicted_ttft_ms: None,
        engine_split: None,
        engine_e2e_ms: None,
        engine_decode_stall_ms: None,
        route_receipt: None,
        ahead: None,
    }
}

/// A run of `policy` in `mode` with the given figures.
#[allow(clippy::too_many_arguments)]
pub fn run(
    workload: &str,
    kind: &str,
    mode: &str,
    policy: &str,
    ttft_p99: f64,
    e2e_p50: f64,
    rps: f64,
    prefill: [f64; 2],
) -> RunReport {
    let backends = [
        (
            "a".to_string(),
            Counters {
                prefix_queries: 1000.0,
                prefix_hits: 1000.0 - prefill[0],
                ..Counters::default()
            },
        ),
        (
            "b".to_string(),
            Counters {
                prefix_queries: 1000.0,
                prefix_hits: 1000.0 - prefill[1],
                ..Counters::default()
            },
        ),
    ];
    let oracle = OracleBound {
        fleet_blocks: 10,
        working_set_blocks: 5,
        unbounded: crate::oracle::HitCount::default(),
        fleet: crate::oracle::HitCount::default(),
        hit_rate: 0.9,
    };
    let mut r = summarize(
        RunLabel {
            workload,
            kind,
            mode,
            policy,
            load: Load::Rate(rps),
            level: Some(0.9),
            time_scale: 1.0,
        },
        &[rec("a", 1.0)],
        1.0,
        &backends,
        Some(oracle),
    );
    r.ttft_ms.p99 = ttft_p99;
    r.e2e_ms.p50 = e2e_p50;
    r.requests_per_s = rps;
    r
}
