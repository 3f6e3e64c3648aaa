//! Turning records into results: one [`RunReport`] per (workload, mode, policy) run, the
//! benchmark's JSON document, its markdown tables, the target figures (issue 7's hit-rate and
//! balance verdicts, issue 11's tail-latency targets of the default policy against the best
//! baseline), and SVG charts (plotters), among them TTFT p99 against offered load.
//!
//! The parts: [`run`] (one run's figures), [`targets`] (the verdicts), [`result`] (the document),
//! [`markdown`] and [`charts`] (its renderings).

mod charts;
mod e2e_tail;
mod format;
mod markdown;
mod result;
mod run;
mod targets;
#[cfg(test)]
mod test_support;
mod trace;

pub use charts::{charts, draw_lines, Axes};
pub use markdown::markdown;
pub use result::{BenchResult, OverheadPoint, Skipped};
pub use run::{summarize, Quantiles, RunLabel, RunReport};
pub use targets::{tail_targets, verdicts};
pub use trace::{trace_figures, IdleModel};

#[cfg(test)]
mod tests {
    use super::charts::chart_files;
    use super::test_support::run;
    use super::*;
    use crate::driver::Load;
    use std::collections::BTreeMap;

    /// A result of `runs`, `predicted_latency` against `round_robin`.
    fn result_of(runs: Vec<RunReport>) -> BenchResult {
        BenchResult {
            name: "test".into(),
            started: "now".into(),
            machine: BTreeMap::new(),
            config: serde_json::Value::Null,
            targets: verdicts(&runs),
            default_policy: "predicted_latency".into(),
            baselines: vec!["round_robin".into()],
            tail_targets: tail_targets(&runs, "predicted_latency", &["round_robin".into()]),
            capacity_rps: BTreeMap::new(),
            skipped: vec![],
            runs,
            overhead: vec![],
        }
    }

    #[test]
    fn markdown_and_charts_cover_every_mode_and_the_sweep() {
        let mut runs = Vec::new();
        for (mode, rate, level) in [("open-0.5", 20.0, 0.5), ("open-0.9", 36.0, 0.9)] {
            for (p, ttft) in [("round_robin", 300.0), ("predicted_latency", 100.0)] {
                let mut r = run(
                    "groups",
                    "prefix-groups",
                    mode,
                    p,
                    ttft * level,
                    400.0,
                    rate,
                    [10.0, 10.0],
                );
                r.load = Load::Rate(rate);
                r.level = Some(level);
                runs.push(r);
            }
        }
        let mut result = result_of(runs);
        result.capacity_rps = BTreeMap::from([("groups".to_string(), 40.0)]);
        result.skipped = vec![Skipped {
            policy: "power_of_two".into(),
            reason: "HTTP 400".into(),
        }];
        let md = markdown(&result, "x-");
        assert!(md.contains("## Targets: predicted_latency against the best of round_robin"));
        assert!(
            md.contains("| open-0.5 | 0.33x met: 50.0 vs 150.0 ms (round_robin) |"),
            "{md}"
        );
        assert!(md.contains(
            "### groups, open-0.9 (open loop, Poisson 36 req/s = 0.9 x 40.0 req/s capacity"
        ));
        assert!(md.contains("Not run: `power_of_two`"));
        assert!(
            !md.contains("issue 7"),
            "no classic verdicts without their runs"
        );
        assert!(md.contains("x-groups-ttft-p99-vs-load.svg"));
        let dir = std::env::temp_dir().join(format!("loadgen-charts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        charts(&result, &dir, "x-").unwrap();
        for (file, _) in chart_files(&result) {
            let svg = std::fs::read_to_string(dir.join(format!("x-{file}"))).unwrap();
            assert!(svg.starts_with("<svg"), "{file}");
        }
        let sweep = std::fs::read_to_string(dir.join("x-groups-ttft-p99-vs-load.svg")).unwrap();
        assert!(sweep.contains("predicted_latency") && sweep.contains("<circle"));
        assert!(!dir.join("x-overhead.svg").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn other_apis_sit_beside_chat_and_stay_out_of_the_targets() {
        use crate::api::Api;
        let mut runs = Vec::new();
        for p in ["predicted_latency", "round_robin"] {
            runs.push(run(
                "chat",
                "multi-turn",
                "closed-64",
                p,
                90.0,
                400.0,
                50.0,
                [10.0, 10.0],
            ));
        }
        for (api, ttft) in [(Api::Responses, 95.0), (Api::Messages, 97.0)] {
            let name = format!("chat-{}", api.name());
            let mut r = run(
                &name,
                "multi-turn",
                "closed-64",
                "predicted_latency",
                ttft,
                400.0,
                50.0,
                [10.0, 10.0],
            );
            r.api = api;
            r.api_of = Some("chat".into());
            runs.push(r);
        }
        let mut result = result_of(runs);
        result.capacity_rps = BTreeMap::from([("chat".to_string(), 55.0)]);
        assert!(!result.tail_targets.is_empty());
        assert!(
            result.tail_targets.iter().all(|t| t.workload == "chat"),
            "{:?}",
            result.tail_targets
        );
        let md = markdown(&result, "x-");
        assert!(md.contains("## The same conversations through chat, Responses and Messages"));
        assert!(md.contains("as Responses requests (the whole history as `input` items"));
        // A run through another API is described at its chat workload's capacity.
        assert!(
            md.contains("### chat-messages, closed-64 (open loop, Poisson 50 req/s = 0.9 x 55.0"),
            "{md}"
        );
        let rows: Vec<&str> = md
            .lines()
            .filter(|l| l.starts_with("| chat | closed-64 |"))
            .collect();
        assert_eq!(rows.len(), 3, "{md}");
        assert!(
            rows[0].starts_with("| chat | closed-64 | predicted_latency | chat | 99.0% | 50.0% |"),
            "{}",
            rows[0]
        );
        assert!(rows[1].contains("| responses |") && rows[1].contains("| 95.0 |"));
        assert!(rows[2].contains("| messages |") && rows[2].contains("| 97.0 |"));
        // Without other APIs there is no such section.
        let chat_only = BenchResult {
            runs: result.runs[..2].to_vec(),
            ..result
        };
        assert!(!markdown(&chat_only, "x-").contains("through chat, Responses"));
    }
}
