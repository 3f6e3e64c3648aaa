//! The figures of a trace replay that the generic run report does not have: latency percentiles
//! that count failed requests (as infinitely slow, so a policy cannot look better by dropping
//! requests), the slowdown (TTFT over the request's own uncached prefill on an idle backend),
//! the engine-side TTFT, the TTFT distribution for the CDF chart, and the slowest requests with
//! where the engine's time went and what the router predicted; and the end-to-end tail the same
//! way ([`super::e2e_tail`]: the slowest by end-to-end latency with the engine's end-to-end time
//! and decode stall).

use super::e2e_tail::{e2e_tail, E2eTailMean, SlowE2eRequest};
use crate::client::{EngineSplit, RouteReceipt};
use crate::driver::Record;
use crate::stats::percentile;
use serde::Serialize;

/// How long a request takes on an idle backend: its prompt at the prefill rate plus one step's
/// fixed cost (the step that computes its last prompt chunk samples the first token).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct IdleModel {
    /// vllm-sim `--prefill-us-per-token`.
    pub prefill_us_per_token: f64,
    /// vllm-sim `--decode-ms-per-step`.
    pub step_ms: f64,
    /// vllm-sim `--time-scale` (model time = wall time x this).
    pub time_scale: f64,
}

impl IdleModel {
    /// The fleet's timing, from vllm-sim's defaults and the fleet's extra flags.
    pub fn of_fleet(extra_args: &[String], time_scale: f64) -> IdleModel {
        let c = crate::bench::FleetConfig::engine(extra_args);
        IdleModel {
            prefill_us_per_token: c.prefill_us_per_token,
            step_ms: c.decode_ms_per_step,
            time_scale: time_scale.max(1e-9),
        }
    }

    /// Wall ms to the first token of `prompt_tokens` uncached tokens on an idle backend.
    pub fn ideal_ttft_ms(&self, prompt_tokens: u32) -> f64 {
        (self.prefill_us_per_token * f64::from(prompt_tokens) / 1e3 + self.step_ms)
            / self.time_scale
    }

    /// Wall ms to the last of `output_tokens` tokens of `prompt_tokens` uncached tokens on an idle
    /// backend: the first token's time and one decode step for each further token.
    pub fn ideal_e2e_ms(&self, prompt_tokens: u32, output_tokens: u32) -> f64 {
        self.ideal_ttft_ms(prompt_tokens)
            + f64::from(output_tokens.saturating_sub(1)) * self.step_ms / self.time_scale
    }
}

/// Percentiles where failed requests count as infinitely slow: `None` (JSON `null`, "failed" in
/// the tables) when the percentile falls among them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TailQuantiles {
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
}

impl TailQuantiles {
    /// Of `values`, `None` standing for a failed request.
    pub fn of(values: impl IntoIterator<Item = Option<f64>>) -> TailQuantiles {
        let mut v: Vec<f64> = values
            .into_iter()
            .map(|x| x.unwrap_or(f64::INFINITY))
            .filter(|x| !x.is_nan())
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let at = |p: f64| {
            if v.is_empty() {
                return None;
            }
            let rank = (p / 100.0) * (v.len() - 1) as f64;
            // An interpolation towards a failure is a failure.
            if v[rank.ceil() as usize].is_infinite() {
                return None;
            }
            Some(percentile(&v, p))
        };
        TailQuantiles {
            p50: at(50.0),
            p90: at(90.0),
            p99: at(99.0),
        }
    }
}

/// One of the slowest requests of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlowRequest {
    /// Index of the request in the replayed window.
    pub request: usize,
    /// Seconds from the run's start to the send.
    pub sent_s: f64,
    /// Client TTFT, ms (`None`: it failed).
    pub ttft_ms: Option<f64>,
    /// The error, if it failed.
    pub error: Option<String>,
    /// Prompt and cached prompt tokens (usage).
    pub prompt_tokens: Option<u32>,
    /// Cached prompt tokens (usage).
    pub cached_tokens: Option<u32>,
    /// TTFT over the idle-backend TTFT of its prompt.
    pub slowdown: Option<f64>,
    /// The backend that served it.
    pub backend: Option<String>,
    /// Engine-side TTFT, ms.
    pub engine_ttft_ms: Option<f64>,
    /// Where the engine's time went.
    pub engine_split: Option<EngineSplit>,
    /// `x-gateway-predicted-ttft-ms`.
    pub predicted_ttft_ms: Option<f64>,
    /// `x-gateway-route-receipt`.
    pub route_receipt: Option<RouteReceipt>,
}

/// A trace replay's own figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TraceFigures {
    /// Requests sent.
    pub sent: usize,
    /// Requests that failed (counted as infinitely slow in every percentile below).
    pub failed: usize,
    /// Client TTFT, ms.
    pub ttft_ms: TailQuantiles,
    /// Client end-to-end latency, ms.
    pub e2e_ms: TailQuantiles,
    /// TTFT over the request's idle-backend TTFT.
    pub slowdown: TailQuantiles,
    /// Engine-side TTFT, ms (answered requests that carried it).
    pub engine_ttft_ms: TailQuantiles,
    /// Median queue / prefill / shared prefill / decode-interference split over the answered
    /// requests, ms
    /// (each part's own median).
    pub split_p50: Option<EngineSplit>,
    /// Mean split of the slowest 1% of requests by client TTFT.
    pub split_tail_mean: Option<EngineSplit>,
    /// The TTFT distribution: (ms, fraction of *sent* requests answered by then), up to 200
    /// points; it ends below 1 when requests failed.
    pub ttft_cdf: Vec<(f64, f64)>,
    /// The slowest requests by client TTFT (failed ones first), with their split and the router's
    /// predictions.
    pub slowest: Vec<SlowRequest>,
    /// Means over the slowest 1% of answered requests by client end-to-end latency: client and
    /// engine E2E, engine decode stall, completion tokens, client and engine TTFT.
    pub e2e_tail_mean: Option<E2eTailMean>,
    /// The slowest answered requests by client end-to-end latency, with the engine's E2E and
    /// decode stall.
    pub slowest_e2e: Vec<SlowE2eRequest>,
}

/// How many of the slowest requests a run lists.
pub const SLOWEST: usize = 20;

fn split_of(splits: &[EngineSplit], pick: impl Fn(&[f64]) -> f64) -> Option<EngineSplit> {
    if splits.is_empty() {
        return None;
    }
    let col = |f: fn(&EngineSplit) -> f64| {
        let mut v: Vec<f64> = splits.iter().map(f).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        pick(&v)
    };
    Some(EngineSplit {
        queue_ms: col(|s| s.queue_ms),
        prefill_ms: col(|s| s.prefill_ms),
        shared_prefill_ms: col(|s| s.shared_prefill_ms),
        decode_interference_ms: col(|s| s.decode_interference_ms),
    })
}

/// The trace figures of a run's records.
pub fn trace_figures(records: &[Record], idle: &IdleModel) -> TraceFigures {
    let ok = |r: &Record| r.error.is_none() && r.ttft_ms.is_some();
    let slowdown = |r: &Record| {
        let ttft = r.ttft_ms.filter(|_| ok(r))?;
        Some(ttft / idle.ideal_ttft_ms(r.prompt_tokens?).max(1e-9))
    };
    let mut order: Vec<&Record> = records.iter().collect();
    // Failed first, then by TTFT, slowest first.
    order.sort_by(|a, b| {
        let key = |r: &Record| r.ttft_ms.filter(|_| ok(r)).unwrap_or(f64::INFINITY);
        key(b).total_cmp(&key(a))
    });
    let answered: Vec<&Record> = order.iter().copied().filter(|r| ok(r)).collect();
    let tail_n = answered.len().div_ceil(100);
    let tail: Vec<EngineSplit> = answered
        .iter()
        .take(tail_n)
        .filter_map(|r| r.engine_split)
        .collect();
    let all: Vec<EngineSplit> = answered.iter().filter_map(|r| r.engine_split).collect();
    let mut ttfts: Vec<f64> = answered.iter().filter_map(|r| r.ttft_ms).collect();
    ttfts.sort_by(|a, b| a.total_cmp(b));
    let n = records.len().max(1) as f64;
    let step = (ttfts.len() / 200).max(1);
    let mut cdf: Vec<(f64, f64)> = ttfts
        .iter()
        .enumerate()
        .filter(|(i, _)| i % step == 0 || *i + 1 == ttfts.len())
        .map(|(i, &t)| (t, (i + 1) as f64 / n))
        .collect();
    cdf.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
    let (e2e_tail_mean, slowest_e2e) = e2e_tail(&answered, SLOWEST);
    TraceFigures {
        sent: records.len(),
        failed: records.len() - answered.len(),
        ttft_ms: TailQuantiles::of(records.iter().map(|r| r.ttft_ms.filter(|_| ok(r)))),
        e2e_ms: TailQuantiles::of(records.iter().map(|r| ok(r).then_some(r.e2e_ms))),
        slowdown: TailQuantiles::of(records.iter().map(slowdown)),
        engine_ttft_ms: TailQuantiles::of(
            answered.iter().filter_map(|r| r.engine_ttft_ms).map(Some),
        ),
        split_p50: split_of(&all, |v| percentile(v, 50.0)),
        split_tail_mean: split_of(&tail, |v| v.iter().sum::<f64>() / v.len() as f64),
        ttft_cdf: cdf,
        slowest: order
            .iter()
            .take(SLOWEST)
            .map(|r| SlowRequest {
                request: r.session,
                sent_s: r.sent_s,
                ttft_ms: r.ttft_ms.filter(|_| ok(r)),
                error: r.error.clone(),
                prompt_tokens: r.prompt_tokens,
                cached_tokens: r.cached_tokens,
                slowdown: slowdown(r),
                backend: r.backend.clone(),
                engine_ttft_ms: r.engine_ttft_ms,
                engine_split: r.engine_split,
                predicted_ttft_ms: r.predicted_ttft_ms,
                route_receipt: r.route_receipt.clone(),
            })
            .collect(),
        e2e_tail_mean,
        slowest_e2e,
    }
}

fn ms(x: Option<f64>) -> String {
    x.map_or("failed".into(), |v| format!("{v:.0}"))
}

fn ratio(x: Option<f64>) -> String {
    x.map_or("failed".into(), |v| format!("{v:.1}"))
}

fn split(s: Option<EngineSplit>) -> String {
    s.map_or("-".into(), |s| {
        format!(
            "{:.0} / {:.0} / {:.0} / {:.0}",
            s.queue_ms, s.prefill_ms, s.shared_prefill_ms, s.decode_interference_ms
        )
    })
}

/// The markdown of one trace mode: a table of every policy's trace figures, then each policy's
/// slowest requests.
pub fn markdown_section(runs: &[&super::RunReport], s: &mut String) {
    use std::fmt::Write as _;
    let runs: Vec<(&super::RunReport, &TraceFigures)> = runs
        .iter()
        .filter_map(|r| Some((*r, r.trace.as_ref()?)))
        .collect();
    if runs.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "\nTrace figures: failed requests count as infinitely slow (*failed*: the percentile falls among them). \
         Slowdown: TTFT over the request's uncached prefill on an idle backend (prefill rate x prompt tokens + one step). \
         Split: the engine's time to first token as queue / own prefill / shared prefill (other prompts in its steps) / decode interference, ms (vllm-sim `--report-engine-timing`).\n"
    );
    let _ = writeln!(
        s,
        "| policy | TTFT p50 | TTFT p90 | TTFT p99 | E2E p50 | E2E p99 | slowdown p50 | slowdown p99 | engine TTFT p50 / p99 | split p50 | split, slowest 1% (mean) | req/s | hit rate | of oracle | busiest/mean prefill | failed / sent |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (r, t) in &runs {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {:.1} | {:.1}% | {} | {:.2} | {} / {} |",
            r.policy,
            ms(t.ttft_ms.p50),
            ms(t.ttft_ms.p90),
            ms(t.ttft_ms.p99),
            ms(t.e2e_ms.p50),
            ms(t.e2e_ms.p99),
            ratio(t.slowdown.p50),
            ratio(t.slowdown.p99),
            ms(t.engine_ttft_ms.p50),
            ms(t.engine_ttft_ms.p99),
            split(t.split_p50),
            split(t.split_tail_mean),
            r.requests_per_s,
            r.hit_rate * 100.0,
            r.fraction_of_oracle
                .map_or("-".into(), |f| format!("{:.1}%", f * 100.0)),
            r.prefill_imbalance,
            t.failed,
            t.sent
        );
    }
    for (r, t) in &runs {
        let _ = writeln!(
            s,
            "\n<details><summary>{}: the {} slowest requests by TTFT</summary>\n\n\
             | request | sent, s | TTFT | engine TTFT | queue / prefill / shared / decode | prompt / cached tokens | slowdown | backend | predicted there | runner-up (predicted) | error |\n|---|---|---|---|---|---|---|---|---|---|---|",
            r.policy,
            t.slowest.len()
        );
        for q in &t.slowest {
            let rr = q.route_receipt.clone().unwrap_or_default();
            let predicted = rr.predicted_ttft_ms.or(q.predicted_ttft_ms);
            let _ = writeln!(
                s,
                "| {} | {:.1} | {} | {} | {} | {} / {} | {} | {} | {} | {} | {} |",
                q.request,
                q.sent_s,
                ms(q.ttft_ms),
                q.engine_ttft_ms.map_or("-".into(), |v| format!("{v:.0}")),
                split(q.engine_split),
                q.prompt_tokens.map_or("-".into(), |v| v.to_string()),
                q.cached_tokens.map_or("-".into(), |v| v.to_string()),
                q.slowdown.map_or("-".into(), |v| format!("{v:.1}")),
                q.backend.as_deref().unwrap_or("-"),
                predicted.map_or("-".into(), |v| format!("{v:.0}")),
                match (&rr.alt, rr.alt_predicted_ttft_ms) {
                    (Some(a), Some(p)) => format!("{a} ({p:.0})"),
                    (Some(a), None) => a.clone(),
                    _ => "-".into(),
                },
                q.error.as_deref().map_or(String::new(), |e| e
                    .chars()
                    .take(80)
                    .collect::<String>()
                    .replace('|', "/"))
            );
        }
        let _ = writeln!(s, "\n</details>");
    }
    let e2e: Vec<(&str, &TraceFigures)> =
        runs.iter().map(|(r, t)| (r.policy.as_str(), *t)).collect();
    super::e2e_tail::markdown_section(&e2e, s);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::test_support::rec;

    #[test]
    fn failures_count_as_infinitely_slow() {
        let q = TailQuantiles::of((1..=98).map(|i| Some(f64::from(i))).chain([None, None]));
        assert_eq!(q.p50, Some(50.5));
        assert_eq!(q.p99, None, "the 99th percentile is among the two failures");
        let q = TailQuantiles::of((1..=100).map(|i| Some(f64::from(i))));
        assert!((q.p99.unwrap() - 99.01).abs() < 1e-9);
    }

    #[test]
    fn slowdown_slowest_and_cdf_count_every_request() {
        let idle = IdleModel {
            prefill_us_per_token: 100.0,
            step_ms: 10.0,
            time_scale: 1.0,
        };
        // 100 prompt tokens: 10 ms of prefill + a 10 ms step = 20 ms on an idle backend.
        assert_eq!(idle.ideal_ttft_ms(100), 20.0);
        let mut records: Vec<Record> = (1..=9).map(|i| rec("a", f64::from(i) * 20.0)).collect();
        records[8].engine_split = Some(EngineSplit {
            queue_ms: 150.0,
            prefill_ms: 20.0,
            shared_prefill_ms: 0.0,
            decode_interference_ms: 5.0,
        });
        records.push(Record {
            error: Some("stream broken".into()),
            ttft_ms: None,
            ..rec("b", 0.0)
        });
        let f = trace_figures(&records, &idle);
        assert_eq!((f.sent, f.failed), (10, 1));
        assert_eq!(f.slowest[0].error.as_deref(), Some("stream broken"));
        assert_eq!(f.slowest[1].ttft_ms, Some(180.0));
        assert_eq!(f.slowest[1].slowdown, Some(9.0));
        assert_eq!(f.slowest[1].engine_split.unwrap().queue_ms, 150.0);
        assert_eq!(f.slowdown.p50, Some(5.5));
        assert_eq!(f.ttft_ms.p99, None, "one failure in ten sets the p99");
        assert_eq!(f.ttft_cdf.last(), Some(&(180.0, 0.9)), "ends below 1");
        assert_eq!(f.split_tail_mean.unwrap().queue_ms, 150.0);
    }
}
