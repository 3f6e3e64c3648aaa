//! The queue's metric families in the Prometheus text format.

use super::request::DropReason;
use super::stats::WAIT_BUCKETS_MS;
use super::AdmissionQueue;
use crate::metrics::{header, sample};

impl AdmissionQueue {
    /// Renders the queue's metric families for `pool` (Prometheus text), appending to `out`.
    pub fn render_metrics(&self, pool: &str, out: &mut String) {
        header(
            out,
            "llm_gateway_queue_length",
            "gauge",
            "Requests waiting in the gateway's admission queue, by priority band.",
        );
        let lengths = self.lengths_by_priority();
        if lengths.is_empty() {
            sample(
                out,
                "llm_gateway_queue_length",
                pool,
                &[("priority", "0")],
                0.0,
            );
        }
        for (priority, n) in lengths {
            let p = priority.to_string();
            sample(
                out,
                "llm_gateway_queue_length",
                pool,
                &[("priority", &p)],
                n as f64,
            );
        }
        header(
            out,
            "llm_gateway_queue_dropped_total",
            "counter",
            "Requests that left the admission queue without a lease, by reason.",
        );
        for reason in DropReason::ALL {
            let n = self.stats.dropped(reason) as f64;
            sample(
                out,
                "llm_gateway_queue_dropped_total",
                pool,
                &[("reason", reason.as_str())],
                n,
            );
        }
        header(
            out,
            "llm_gateway_queue_admitted_total",
            "counter",
            "Requests granted under admission control, by whether they waited in the queue.",
        );
        let s = &self.stats;
        let immediate = s.admitted.saturating_sub(s.queued) as f64;
        sample(
            out,
            "llm_gateway_queue_admitted_total",
            pool,
            &[("queued", "false")],
            immediate,
        );
        sample(
            out,
            "llm_gateway_queue_admitted_total",
            pool,
            &[("queued", "true")],
            s.queued as f64,
        );
        header(
            out,
            "llm_gateway_queue_wait_seconds",
            "histogram",
            "Time granted requests spent in the admission queue (0 for those granted at once).",
        );
        let mut cumulative = 0;
        for (i, bound) in WAIT_BUCKETS_MS.iter().enumerate() {
            cumulative += s.wait_buckets[i];
            let le = format!("{}", *bound as f64 / 1000.0);
            sample(
                out,
                "llm_gateway_queue_wait_seconds_bucket",
                pool,
                &[("le", &le)],
                cumulative as f64,
            );
        }
        let count = s.wait_count as f64;
        sample(
            out,
            "llm_gateway_queue_wait_seconds_bucket",
            pool,
            &[("le", "+Inf")],
            count,
        );
        let sum = s.wait_sum_ms as f64 / 1000.0;
        sample(out, "llm_gateway_queue_wait_seconds_sum", pool, &[], sum);
        sample(
            out,
            "llm_gateway_queue_wait_seconds_count",
            pool,
            &[],
            count,
        );
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::test_support::{config, waiting};

    #[test]
    fn metrics_render_every_family() {
        let mut q = AdmissionQueue::new();
        q.offer(waiting(1, "a", 3, 10, 0), &config()).unwrap();
        q.record_immediate();
        q.record_drop(DropReason::Timeout);
        let mut out = String::new();
        q.render_metrics("p\"1", &mut out);
        assert!(
            out.contains("llm_gateway_queue_length{pool=\"p\\\"1\",priority=\"3\"} 1"),
            "{out}"
        );
        assert!(out.contains(
            "llm_gateway_queue_dropped_total{pool=\"p\\\"1\",reason=\"queue_timeout\"} 1"
        ));
        assert!(
            out.contains("llm_gateway_queue_wait_seconds_bucket{pool=\"p\\\"1\",le=\"0.005\"} 1")
        );
        assert!(out.contains("llm_gateway_queue_wait_seconds_count{pool=\"p\\\"1\"} 1"));
    }
}
