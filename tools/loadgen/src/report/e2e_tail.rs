//! The end-to-end tail of a trace replay, explained from the engine's side as the TTFT tail is
//! by its split: the slowest 1% of answered requests by client end-to-end latency as means (client
//! and engine end-to-end time, the engine's decode stall, completion tokens, client and engine
//! TTFT), and the slowest answered requests by client end-to-end latency one by one. The engine's
//! figures are vllm-sim's `--report-engine-timing` ones: `sim_engine_e2e_ms` (arrival at the
//! engine to the last token) and `sim_engine_decode_stall_ms` (after the first token, the share of
//! the steps it decoded in that went to other prompts' prefill). Failed requests are left out:
//! their end-to-end time is when they failed, and the TTFT list (`slowest`) already shows them.

use crate::driver::Record;
use serde::Serialize;

/// Means over the slowest 1% of answered requests by client end-to-end latency (at least one
/// request). The engine's figures are averaged over the requests that carried them (`None` when
/// none did).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct E2eTailMean {
    /// Requests averaged.
    pub requests: usize,
    /// Client end-to-end latency, ms.
    pub e2e_ms: f64,
    /// Engine arrival to last token, ms.
    pub engine_e2e_ms: Option<f64>,
    /// Engine decode stall (other prompts' prefill in its decode steps), ms.
    pub engine_decode_stall_ms: Option<f64>,
    /// Completion tokens.
    pub completion_tokens: f64,
    /// Client TTFT, ms.
    pub ttft_ms: f64,
    /// Engine TTFT, ms.
    pub engine_ttft_ms: Option<f64>,
}

/// One of the slowest answered requests by client end-to-end latency.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlowE2eRequest {
    /// Index of the request in the replayed window.
    pub request: usize,
    /// Seconds from the run's start to the send.
    pub sent_s: f64,
    /// Client end-to-end latency, ms.
    pub e2e_ms: f64,
    /// Engine arrival to last token, ms.
    pub engine_e2e_ms: Option<f64>,
    /// Engine decode stall, ms.
    pub engine_decode_stall_ms: Option<f64>,
    /// Completion tokens.
    pub completion_tokens: u32,
    /// Client TTFT, ms.
    pub ttft_ms: Option<f64>,
    /// The backend that served it.
    pub backend: Option<String>,
}

/// The tail means and the `limit` slowest of `answered` (requests that got an answer), by client
/// end-to-end latency.
pub fn e2e_tail(answered: &[&Record], limit: usize) -> (Option<E2eTailMean>, Vec<SlowE2eRequest>) {
    let mut order: Vec<&Record> = answered.to_vec();
    order.sort_by(|a, b| b.e2e_ms.total_cmp(&a.e2e_ms));
    let tail = &order[..order.len().div_ceil(100)];
    let mean = |v: &mut dyn Iterator<Item = f64>| {
        let (sum, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
        (n > 0).then(|| sum / n as f64)
    };
    let means = (!tail.is_empty()).then(|| E2eTailMean {
        requests: tail.len(),
        e2e_ms: mean(&mut tail.iter().map(|r| r.e2e_ms)).unwrap_or(0.0),
        engine_e2e_ms: mean(&mut tail.iter().filter_map(|r| r.engine_e2e_ms)),
        engine_decode_stall_ms: mean(&mut tail.iter().filter_map(|r| r.engine_decode_stall_ms)),
        completion_tokens: mean(&mut tail.iter().map(|r| f64::from(r.output_tokens)))
            .unwrap_or(0.0),
        ttft_ms: mean(&mut tail.iter().filter_map(|r| r.ttft_ms)).unwrap_or(0.0),
        engine_ttft_ms: mean(&mut tail.iter().filter_map(|r| r.engine_ttft_ms)),
    });
    let slowest = order
        .iter()
        .take(limit)
        .map(|r| SlowE2eRequest {
            request: r.session,
            sent_s: r.sent_s,
            e2e_ms: r.e2e_ms,
            engine_e2e_ms: r.engine_e2e_ms,
            engine_decode_stall_ms: r.engine_decode_stall_ms,
            completion_tokens: r.output_tokens,
            ttft_ms: r.ttft_ms,
            backend: r.backend.clone(),
        })
        .collect();
    (means, slowest)
}

fn ms(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.0}"))
}

/// The markdown of one trace mode's end-to-end tail: a table of every policy's tail means, then
/// each policy's slowest requests by end-to-end latency.
pub fn markdown_section(runs: &[(&str, &super::trace::TraceFigures)], s: &mut String) {
    use std::fmt::Write as _;
    if runs.iter().all(|(_, t)| t.e2e_tail_mean.is_none()) {
        return;
    }
    let _ = writeln!(
        s,
        "\nEnd-to-end tail: the slowest 1% of answered requests by client E2E, means. \
         Engine E2E: arrival at the engine to its last token; decode stall: after its first token, \
         the share of the steps it decoded in that went to other prompts' prefill, ms (vllm-sim `--report-engine-timing`).\n"
    );
    let _ = writeln!(
        s,
        "| policy | requests | E2E | engine E2E | decode stall | completion tokens | TTFT | engine TTFT |\n|---|---|---|---|---|---|---|---|"
    );
    for (policy, t) in runs {
        let Some(m) = t.e2e_tail_mean else {
            continue;
        };
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} | {} | {} | {:.0} | {:.0} | {} |",
            policy,
            m.requests,
            m.e2e_ms,
            ms(m.engine_e2e_ms),
            ms(m.engine_decode_stall_ms),
            m.completion_tokens,
            m.ttft_ms,
            ms(m.engine_ttft_ms)
        );
    }
    for (policy, t) in runs {
        if t.slowest_e2e.is_empty() {
            continue;
        }
        let _ = writeln!(
            s,
            "\n<details><summary>{}: the {} slowest requests by E2E</summary>\n\n\
             | request | sent, s | E2E | engine E2E | decode stall | completion tokens | TTFT | backend |\n|---|---|---|---|---|---|---|---|",
            policy,
            t.slowest_e2e.len()
        );
        for q in &t.slowest_e2e {
            let _ = writeln!(
                s,
                "| {} | {:.1} | {:.0} | {} | {} | {} | {} | {} |",
                q.request,
                q.sent_s,
                q.e2e_ms,
                ms(q.engine_e2e_ms),
                ms(q.engine_decode_stall_ms),
                q.completion_tokens,
                ms(q.ttft_ms),
                q.backend.as_deref().unwrap_or("-")
            );
        }
        let _ = writeln!(s, "\n</details>");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::test_support::rec;

    /// 200 answered requests, E2E 11..=210 ms, the two slowest with the engine's figures.
    fn records() -> Vec<Record> {
        let mut records: Vec<Record> = (1..=200).map(|i| rec("a", f64::from(i))).collect();
        records[199].engine_e2e_ms = Some(190.0);
        records[199].engine_decode_stall_ms = Some(60.0);
        records[199].engine_ttft_ms = Some(180.0);
        records[199].output_tokens = 30;
        records[198].engine_e2e_ms = Some(170.0);
        records[198].engine_decode_stall_ms = Some(20.0);
        records[198].output_tokens = 10;
        records[198].backend = Some("b".into());
        records
    }

    #[test]
    fn the_slowest_percent_by_e2e_are_averaged_and_listed() {
        let records = records();
        let answered: Vec<&Record> = records.iter().collect();
        let (m, slowest) = e2e_tail(&answered, 20);
        let m = m.expect("means");
        assert_eq!(m.requests, 2, "1% of 200");
        assert_eq!(m.e2e_ms, (210.0 + 209.0) / 2.0);
        assert_eq!(m.engine_e2e_ms, Some(180.0));
        assert_eq!(m.engine_decode_stall_ms, Some(40.0));
        assert_eq!(m.completion_tokens, 20.0);
        assert_eq!(m.ttft_ms, (200.0 + 199.0) / 2.0);
        assert_eq!(
            m.engine_ttft_ms,
            Some(180.0),
            "only the one that carried it"
        );
        assert_eq!(slowest.len(), 20);
        assert_eq!(slowest[0].e2e_ms, 210.0);
        assert_eq!(slowest[0].engine_decode_stall_ms, Some(60.0));
        assert_eq!(slowest[1].backend.as_deref(), Some("b"));
        assert_eq!(slowest[1].completion_tokens, 10);
        assert_eq!(slowest[2].engine_e2e_ms, None);
        assert!(slowest.windows(2).all(|w| w[0].e2e_ms >= w[1].e2e_ms));
        assert_eq!(e2e_tail(&[], 20), (None, Vec::new()));
    }

    #[test]
    fn trace_figures_leave_failures_out_of_the_e2e_tail_and_render_it() {
        let idle = super::super::IdleModel {
            prefill_us_per_token: 100.0,
            step_ms: 10.0,
            time_scale: 1.0,
        };
        let mut records = records();
        records.push(Record {
            error: Some("timed out".into()),
            ttft_ms: None,
            e2e_ms: 60_000.0,
            ..rec("c", 0.0)
        });
        let f = super::super::trace_figures(&records, &idle);
        let m = f.e2e_tail_mean.expect("means");
        assert_eq!(
            (m.requests, m.e2e_ms),
            (2, 209.5),
            "the failure is not in it"
        );
        assert_eq!(f.slowest_e2e[0].e2e_ms, 210.0);
        assert_eq!(f.slowest[0].error.as_deref(), Some("timed out"));
        let mut md = String::new();
        markdown_section(&[("p", &f)], &mut md);
        assert!(
            md.contains("| p | 2 | 210 | 180 | 40 | 20 | 200 | 180 |"),
            "{md}"
        );
        assert!(md.contains("p: the 20 slowest requests by E2E"), "{md}");
        assert!(
            md.contains("| 0 | 0.0 | 210 | 190 | 60 | 30 | 200 | a |"),
            "{md}"
        );
        assert!(
            md.contains("| 0 | 0.0 | 191 | - | - | 11 | 181 | a |"),
            "{md}"
        );
    }
}
