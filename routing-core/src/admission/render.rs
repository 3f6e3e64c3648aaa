//! The queue's metric families in the Prometheus text format: one table, written by
//! [`crate::metrics::write`].

use super::request::DropReason;
use super::stats::WAIT_BUCKETS_MS;
use super::AdmissionQueue;
use crate::metrics::{write, Family, Kind};

impl AdmissionQueue {
    /// Renders the queue's metric families for `pool` (Prometheus text), appending to `out`.
    pub fn render_metrics(&self, pool: &str, out: &mut String) {
        write(out, pool, &QUEUE_FAMILIES, std::slice::from_ref(self));
    }
}

/// The queue's families, in page order.
const QUEUE_FAMILIES: [Family<AdmissionQueue>; 4] = [
    Kind::Gauge.family(
        "llm_gateway_queue_length",
        "Requests waiting in the gateway's admission queue, by priority band.",
        |q, s| {
            let lengths = q.lengths_by_priority();
            if lengths.is_empty() {
                s.value(&[("priority", "0")], 0.0);
            }
            for (priority, n) in lengths {
                s.value(&[("priority", &priority.to_string())], n as f64);
            }
        },
    ),
    Kind::Counter.family(
        "llm_gateway_queue_dropped_total",
        "Requests that left the admission queue without a lease, by reason.",
        |q, s| {
            let dropped = DropReason::ALL.map(|r| (r.as_str(), q.stats.dropped(r) as f64));
            s.each(&[], "reason", dropped)
        },
    ),
    Kind::Counter.family(
        "llm_gateway_queue_admitted_total",
        "Requests granted under admission control, by whether they waited in the queue.",
        |q, s| {
            let immediate = q.stats.admitted.saturating_sub(q.stats.queued);
            let admitted = [("false", immediate), ("true", q.stats.queued)];
            s.each(&[], "queued", admitted.map(|(k, n)| (k, n as f64)))
        },
    ),
    Kind::Histogram.family(
        "llm_gateway_queue_wait_seconds",
        "Time granted requests spent in the admission queue (0 for those granted at once).",
        |q, s| {
            let st = &q.stats;
            s.buckets(
                &[],
                &WAIT_BUCKETS_MS,
                &st.wait_buckets,
                st.wait_count,
                st.wait_sum_ms,
            )
        },
    ),
];

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
