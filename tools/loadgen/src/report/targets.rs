//! The target figures a benchmark is judged by: issue 7's hit-rate and balance verdicts, and issue
//! 11's tail-latency targets of the default policy against the best baseline in the same workload
//! and mode.

use super::format::pct;
use super::run::RunReport;
use serde::Serialize;

/// A target figure of issue 7 and how the run did.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// What the target says.
    pub target: String,
    /// What was measured.
    pub measured: String,
    /// Met or not (None: not measured in this run).
    pub met: Option<bool>,
}

fn find<'a>(runs: &'a [RunReport], workload: &str, policy: &str) -> Option<&'a RunReport> {
    runs.iter()
        .find(|r| r.workload == workload && r.policy == policy)
}

/// Checks the target figures against the runs.
pub fn verdicts(runs: &[RunReport]) -> Vec<Verdict> {
    let mut out = Vec::new();
    for w in ["shared-prefix", "multi-turn"] {
        let ca = find(runs, w, "cache_aware");
        out.push(
            match ca.and_then(|r| r.fraction_of_oracle.map(|f| (r, f))) {
                Some((r, f)) => Verdict {
                    target: format!("{w}: cache_aware hit rate >= 90% of the oracle's"),
                    measured: format!(
                        "{:.1}% of {:.1}% = {:.0}% of the bound ({:+.0} points vs the 90% target)",
                        r.hit_rate * 100.0,
                        r.oracle.as_ref().map_or(0.0, |o| o.hit_rate * 100.0),
                        f * 100.0,
                        (f - 0.9) * 100.0
                    ),
                    met: Some(f >= 0.9),
                },
                None => Verdict {
                    target: format!("{w}: cache_aware hit rate >= 90% of the oracle's"),
                    measured: "not run".into(),
                    met: None,
                },
            },
        );
        out.push(match ca {
            Some(r) => Verdict {
                target: format!("{w}: cache_aware busiest backend <= 1.3x mean load"),
                measured: format!(
                    "requests {:.2}x, computed tokens {:.2}x",
                    r.request_imbalance, r.work_imbalance
                ),
                met: Some(r.request_imbalance <= 1.3),
            },
            None => Verdict {
                target: format!("{w}: cache_aware busiest backend <= 1.3x mean load"),
                measured: "not run".into(),
                met: None,
            },
        });
    }
    let target = "shared-prefix: cache_aware p99 TTFT <= 0.5x round_robin's".to_string();
    out.push(
        match (
            find(runs, "shared-prefix", "cache_aware"),
            find(runs, "shared-prefix", "round_robin"),
        ) {
            (Some(ca), Some(rr)) => {
                let ratio = ca.ttft_ms.p99 / rr.ttft_ms.p99.max(1e-9);
                Verdict {
                    target,
                    measured: format!(
                        "{:.1} ms vs {:.1} ms = {:.2}x",
                        ca.ttft_ms.p99, rr.ttft_ms.p99, ratio
                    ),
                    met: Some(ratio <= 0.5),
                }
            }
            _ => Verdict {
                target,
                measured: "not run".into(),
                met: None,
            },
        },
    );
    for p in ["power_of_two", "least_load"] {
        let target = format!("long-short: {p} p99 TTFT of short requests < round_robin's");
        out.push(match (find(runs, "long-short", p), find(runs, "long-short", "round_robin")) {
            (Some(a), Some(rr)) => {
                let short = |r: &RunReport| r.ttft_short_ms.unwrap_or(r.ttft_ms).p99;
                let short_e2e = |r: &RunReport| r.e2e_short_ms.unwrap_or(r.e2e_ms).p99;
                Verdict {
                    target,
                    measured: format!(
                        "short TTFT p99 {:.1} vs {:.1} ms ({:.2}x); short E2E p99 {:.0} vs {:.0} ms; all-request TTFT p99 {:.1} vs {:.1} ms",
                        short(a),
                        short(rr),
                        short(a) / short(rr).max(1e-9),
                        short_e2e(a),
                        short_e2e(rr),
                        a.ttft_ms.p99,
                        rr.ttft_ms.p99
                    ),
                    met: Some(short(a) < short(rr)),
                }
            }
            _ => Verdict { target, measured: "not run".into(), met: None },
        });
    }
    out
}

/// Issue 11's targets for the default policy, each against the best of the baselines.
pub mod bounds {
    /// TTFT p99 over the best baseline's.
    pub const TTFT_P99_VS_BEST: f64 = 0.8;
    /// TTFT p99 over round_robin's, on shared-prefix workloads.
    pub const TTFT_P99_VS_ROUND_ROBIN: f64 = 0.5;
    /// E2E p50 over the best baseline's: no worse, within 5% of run-to-run noise.
    pub const E2E_P50_VS_BEST: f64 = 1.05;
    /// Completed requests per second over the best baseline's: no worse, within 5%.
    pub const THROUGHPUT_VS_BEST: f64 = 0.95;
    /// Hit rate as a fraction of the oracle's: within 5%.
    pub const HIT_RATE_OF_ORACLE: f64 = 0.95;
    /// Busiest backend's computed prompt tokens over the mean.
    pub const PREFILL_IMBALANCE: f64 = 1.3;
}

/// One of issue 11's targets for one workload and mode.
#[derive(Debug, Clone, Serialize)]
pub struct TailTarget {
    /// Workload name.
    pub workload: String,
    /// Mode label.
    pub mode: String,
    /// Short key: `ttft_p99_vs_best`, `engine_ttft_p99_vs_best`, `ttft_p99_vs_round_robin`,
    /// `e2e_p50_vs_best`,
    /// `throughput_vs_best`, `hit_rate_of_oracle`, `prefill_imbalance`.
    pub target: &'static str,
    /// The bound, as text (`<= 0.8x`).
    pub bound: String,
    /// The measured figure (a ratio), if both sides ran.
    pub value: Option<f64>,
    /// How it was computed.
    pub measured: String,
    /// Met or not (None: not measured).
    pub met: Option<bool>,
}

/// Workload kinds where requests share long prefixes by group (the round_robin target applies).
fn shared_prefix_kind(kind: &str) -> bool {
    kind == "shared-prefix" || kind == "prefix-groups"
}

/// Issue 11's targets, computed from the runs: for every workload and mode in which `default`
/// ran, its figures against the best of `baselines` in the same workload and mode.
pub fn tail_targets(runs: &[RunReport], default: &str, baselines: &[String]) -> Vec<TailTarget> {
    let mut out = Vec::new();
    let mut seen: Vec<(&str, &str)> = Vec::new();
    // Runs through another API than chat compare APIs, not policies: they have no baselines.
    for d in runs
        .iter()
        .filter(|r| r.policy == default && r.api_of.is_none())
    {
        if seen.contains(&(d.workload.as_str(), d.mode.as_str())) {
            continue;
        }
        seen.push((&d.workload, &d.mode));
        let same = |p: &str| {
            runs.iter()
                .find(|r| r.workload == d.workload && r.mode == d.mode && r.policy == p)
        };
        let base: Vec<&RunReport> = baselines.iter().filter_map(|p| same(p)).collect();
        let mut push = |target: &'static str,
                        bound: String,
                        value: Option<f64>,
                        measured: String,
                        ok: &dyn Fn(f64) -> bool| {
            out.push(TailTarget {
                workload: d.workload.clone(),
                mode: d.mode.clone(),
                target,
                bound,
                met: value.map(ok),
                value,
                measured,
            });
        };
        // The best baseline by a figure (lowest for latencies, highest for throughput).
        let best = |f: &dyn Fn(&RunReport) -> f64, lowest: bool| {
            base.iter().copied().filter(|r| r.ok > 0).reduce(|a, b| {
                if (f(b) < f(a)) == lowest {
                    b
                } else {
                    a
                }
            })
        };
        let ratio = |f: &dyn Fn(&RunReport) -> f64, lowest: bool, unit: &str| match best(f, lowest)
        {
            Some(b) if f(b) > 0.0 && d.ok > 0 => (
                Some(f(d) / f(b)),
                format!("{:.1} vs {:.1} {unit} ({})", f(d), f(b), b.policy),
            ),
            _ => (None, "no baseline ran".to_string()),
        };
        let (v, m) = ratio(&|r| r.ttft_ms.p99, true, "ms");
        push(
            "ttft_p99_vs_best",
            format!("<= {}x", bounds::TTFT_P99_VS_BEST),
            v,
            m,
            &|x| x <= bounds::TTFT_P99_VS_BEST,
        );
        // The same at the backends (each request's engine-side figure): what routing decides,
        // without the gateway's and the client's own time on a shared machine.
        if d.backend_ttft_ms.is_some() {
            let (v, m) = ratio(
                &|r| r.backend_ttft_ms.map_or(f64::NAN, |q| q.p99),
                true,
                "ms",
            );
            push(
                "engine_ttft_p99_vs_best",
                format!("<= {}x", bounds::TTFT_P99_VS_BEST),
                v,
                m,
                &|x| x <= bounds::TTFT_P99_VS_BEST,
            );
        }
        if shared_prefix_kind(&d.kind) {
            let (v, m) = match same("round_robin") {
                Some(rr) if rr.ok > 0 && d.ok > 0 => (
                    Some(d.ttft_ms.p99 / rr.ttft_ms.p99.max(1e-9)),
                    format!("{:.1} vs {:.1} ms", d.ttft_ms.p99, rr.ttft_ms.p99),
                ),
                _ => (None, "round_robin did not run".to_string()),
            };
            push(
                "ttft_p99_vs_round_robin",
                format!("<= {}x", bounds::TTFT_P99_VS_ROUND_ROBIN),
                v,
                m,
                &|x| x <= bounds::TTFT_P99_VS_ROUND_ROBIN,
            );
        }
        let (v, m) = ratio(&|r| r.e2e_ms.p50, true, "ms");
        push(
            "e2e_p50_vs_best",
            format!("<= {}x", bounds::E2E_P50_VS_BEST),
            v,
            m,
            &|x| x <= bounds::E2E_P50_VS_BEST,
        );
        let (v, m) = ratio(&|r| r.requests_per_s, false, "req/s");
        let m = match best(&|r| r.requests_per_s, false) {
            Some(b) if v.is_some() => format!(
                "{m}; {:.0} vs {:.0} output tok/s",
                d.output_tokens_per_s, b.output_tokens_per_s
            ),
            _ => m,
        };
        push(
            "throughput_vs_best",
            format!(">= {}x", bounds::THROUGHPUT_VS_BEST),
            v,
            m,
            &|x| x >= bounds::THROUGHPUT_VS_BEST,
        );
        let m = match &d.oracle {
            Some(o) => format!("{} of {}", pct(d.hit_rate), pct(o.hit_rate)),
            None => "no oracle".into(),
        };
        push(
            "hit_rate_of_oracle",
            format!(">= {}x", bounds::HIT_RATE_OF_ORACLE),
            d.fraction_of_oracle,
            m,
            &|x| x >= bounds::HIT_RATE_OF_ORACLE,
        );
        push(
            "prefill_imbalance",
            format!("<= {}x", bounds::PREFILL_IMBALANCE),
            (d.ok > 0).then_some(d.prefill_imbalance),
            format!("requests {:.2}x", d.request_imbalance),
            &|x| x <= bounds::PREFILL_IMBALANCE,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Load;
    use crate::metrics::Counters;
    use crate::report::run::{summarize, RunLabel};
    use crate::report::test_support::{rec, run};

    #[test]
    fn verdicts_compare_against_round_robin() {
        let mk = |w: &str, p: &str, p99: f64| {
            let mut r = summarize(
                RunLabel {
                    workload: w,
                    kind: w,
                    mode: "open-1rps",
                    policy: p,
                    load: Load::Rate(1.0),
                    level: None,
                    time_scale: 1.0,
                },
                &[rec("a", p99)],
                1.0,
                &[("a".into(), Counters::default())],
                None,
            );
            r.ttft_ms.p99 = p99;
            r
        };
        let runs = vec![
            mk("shared-prefix", "round_robin", 100.0),
            mk("shared-prefix", "cache_aware", 40.0),
            mk("long-short", "round_robin", 50.0),
            mk("long-short", "least_load", 60.0),
        ];
        let v = verdicts(&runs);
        let get = |t: &str| v.iter().find(|x| x.target.contains(t)).unwrap().met;
        assert_eq!(get("0.5x"), Some(true));
        assert_eq!(get("least_load"), Some(false));
        assert_eq!(get("power_of_two"), None);
    }

    #[test]
    fn tail_targets_compare_the_default_with_the_best_baseline() {
        let baselines: Vec<String> = ["round_robin", "least_load", "consistent_hash"]
            .map(String::from)
            .to_vec();
        let g = |p: &str, ttft: f64, e2e: f64, rps: f64, prefill: [f64; 2]| {
            run(
                "groups",
                "prefix-groups",
                "open-0.9",
                p,
                ttft,
                e2e,
                rps,
                prefill,
            )
        };
        let runs = vec![
            g("round_robin", 500.0, 900.0, 40.0, [500.0, 500.0]),
            g("least_load", 200.0, 600.0, 41.0, [100.0, 100.0]),
            g("consistent_hash", 300.0, 500.0, 39.0, [100.0, 100.0]),
            // predicted: 150 ms p99 (0.75x least_load's, 0.30x round robin's), e2e p50 520 vs
            // the best 500 (1.04x), 40 vs the best 41 req/s (0.976x), prefill 120 vs 80 tokens
            // on its two backends (1.2x the mean), hit rate 100 - 10% = 90% = the oracle's.
            g("predicted_latency", 150.0, 520.0, 40.0, [120.0, 80.0]),
            run(
                "chat",
                "multi-turn",
                "closed-64",
                "predicted_latency",
                100.0,
                500.0,
                30.0,
                [200.0, 100.0],
            ),
            run(
                "chat",
                "multi-turn",
                "closed-64",
                "least_load",
                110.0,
                400.0,
                30.0,
                [100.0, 100.0],
            ),
        ];
        let t = tail_targets(&runs, "predicted_latency", &baselines);
        let get = |w: &str, k: &str| {
            t.iter()
                .find(|x| x.workload == w && x.target == k)
                .unwrap_or_else(|| panic!("{w} {k}: {t:?}"))
        };
        let close = |a: Option<f64>, b: f64| (a.unwrap() - b).abs() < 1e-9;
        let x = get("groups", "ttft_p99_vs_best");
        assert!(close(x.value, 0.75) && x.met == Some(true), "{x:?}");
        assert!(x.measured.contains("least_load"), "{}", x.measured);
        let x = get("groups", "ttft_p99_vs_round_robin");
        assert!(close(x.value, 0.3) && x.met == Some(true), "{x:?}");
        let x = get("groups", "e2e_p50_vs_best");
        assert!(
            close(x.value, 520.0 / 500.0) && x.met == Some(true),
            "{x:?}"
        );
        assert!(x.measured.contains("consistent_hash"));
        let x = get("groups", "throughput_vs_best");
        assert!(close(x.value, 40.0 / 41.0) && x.met == Some(true), "{x:?}");
        let x = get("groups", "hit_rate_of_oracle");
        assert!(close(x.value, 0.9 / 0.9) && x.met == Some(true), "{x:?}");
        let x = get("groups", "prefill_imbalance");
        assert!(close(x.value, 1.2) && x.met == Some(true), "{x:?}");
        // Chat: only least_load ran as a baseline; no round_robin target on a chat workload.
        let x = get("chat", "ttft_p99_vs_best");
        assert!(
            close(x.value, 100.0 / 110.0) && x.met == Some(false),
            "{x:?}"
        );
        assert!(get("chat", "e2e_p50_vs_best").met == Some(false));
        assert!(get("chat", "prefill_imbalance").met == Some(false));
        assert!(!t
            .iter()
            .any(|x| x.workload == "chat" && x.target == "ttft_p99_vs_round_robin"));
        // Without the default policy there is nothing to compute.
        assert!(tail_targets(&runs[..3], "predicted_latency", &baselines).is_empty());
    }
}
