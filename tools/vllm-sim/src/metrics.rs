//! `/metrics`: the engine's state rendered in Prometheus text format under vLLM 0.34.0's metric names.
//!
//! Names, types, help strings and histogram buckets follow vLLM 0.34.0
//! (`vllm/v1/metrics/loggers.py`, `PrometheusStatLogger`) as `prometheus_client` exposes them:
//! counters end in `_total`, every engine series has the labels `model_name` (the first `--model`)
//! and `engine="0"`. Prefix-cache queries and hits count tokens. Series 0.34 no longer has are not
//! exported: `vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_queries`,
//! `vllm:gpu_prefix_cache_hits` and `vllm:time_per_output_token_seconds` (inter-token latency is
//! `vllm:inter_token_latency_seconds`). `vllm:num_requests_waiting` is queued plus deferred
//! requests, split by `vllm:num_requests_waiting_by_reason{reason="capacity"|"deferred"}` (the sim
//! defers none). `vllm:cache_config_info` carries the cache configuration as labels, among them
//! `block_size`, `num_gpu_blocks` and `kv_cache_size_tokens` (the true KV capacity), with `engine`
//! and no `model_name`, as `log_metrics_info` renders `CacheConfig.metrics_info()`
//! (`vllm/config/cache.py`). `vllm:admission_rejections{model_name, reason}` counts requests shed
//! by `--max-num-queued-reqs` / `--max-num-queued-tokens`. With `--disable-log-stats` no `vllm:*`
//! series is exported at all (only the sim's own).
//!
//! Latency histograms are in wall-clock seconds, as a scraper or the gateway would measure them (with
//! `--time-scale 100`, a simulated 1 s TTFT shows as 0.01 s). The per-request phase histograms
//! (queue, prefill, decode, inference) are observed when a request finishes after producing a
//! token; inter-token latency once per output token after the first. Sim-only series use the
//! `vllm_sim:` prefix: cached blocks, evictions and stalled requests. The engine task updates one
//! [`MetricsState`] after every step; [`render`] is pure.

use std::fmt::Write;

use crate::scheduler::SchedulerStats;

/// vLLM's buckets for `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's buckets for `vllm:inter_token_latency_seconds`.
pub const INTER_TOKEN_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// vLLM's buckets for `vllm:e2e_request_latency_seconds` and the other per-request phase
/// histograms (queue, prefill, decode, inference).
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A Prometheus histogram with fixed bucket bounds.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); the last entry is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, value: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += value;
        self.count += 1;
    }

    /// Observations so far.
    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.count
    }
}

/// Fixed facts about the server, rendered as labels.
#[derive(Debug, Clone)]
pub struct MetricsInfo {
    /// The `model_name` label: the first served model name, as vLLM does.
    pub model_name: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks in the KV cache.
    pub num_gpu_blocks: u32,
    /// Longest sequence (for `kv_cache_max_concurrency`).
    pub max_model_len: u32,
    /// `--disable-log-stats`: no `vllm:*` series.
    pub disable_log_stats: bool,
}

/// Everything `/metrics` shows, updated by the engine after each step.
#[derive(Debug, Clone)]
pub struct MetricsState {
    /// Sequences running.
    pub running: usize,
    /// Sequences waiting.
    pub waiting: usize,
    /// Running sequences held by the stall fault (counted in `running` too).
    pub stalled: usize,
    /// Fraction of KV blocks held by running sequences.
    pub kv_usage: f64,
    /// Blocks cached under a hash.
    pub cached_blocks: usize,
    /// Cached blocks evicted.
    pub evictions: u64,
    /// The scheduler's counters.
    pub stats: SchedulerStats,
    /// Prompt tokens of embedding requests (served outside the scheduler).
    pub embedding_prompt_tokens: u64,
    /// Requests shed by `--max-num-queued-reqs`.
    pub rejected_queued_reqs: u64,
    /// Requests shed by `--max-num-queued-tokens`.
    pub rejected_queued_tokens: u64,
    /// Time to first token, seconds.
    pub ttft: Histogram,
    /// Request latency from arrival to the last token, seconds.
    pub e2e: Histogram,
    /// Arrival to the first step that computes the request (the WAITING phase), seconds.
    pub queue: Histogram,
    /// First scheduled step to the first token (the PREFILL phase), seconds.
    pub prefill: Histogram,
    /// First token to last token (the DECODE phase), seconds.
    pub decode: Histogram,
    /// First scheduled step to the last token (the RUNNING phase), seconds.
    pub inference: Histogram,
    /// Time between consecutive output tokens of a request, one observation per token after the
    /// first, seconds.
    pub inter_token: Histogram,
}

/// Latencies observed in one engine step, in seconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observations {
    /// Arrival to first token, per request that got its first token.
    pub ttft: Vec<f64>,
    /// Since the previous token, per token after a request's first.
    pub inter_token: Vec<f64>,
    /// Arrival to finish, per finished request.
    pub e2e: Vec<f64>,
    /// Per finished request that produced a token: time waiting before its first step.
    pub queue: Vec<f64>,
    /// See `queue`: first step to first token.
    pub prefill: Vec<f64>,
    /// See `queue`: first token to last token.
    pub decode: Vec<f64>,
    /// See `queue`: first step to last token.
    pub inference: Vec<f64>,
}

impl MetricsState {
    /// Adds a step's observations to the histograms.
    pub fn record(&mut self, observed: &Observations) {
        for (histogram, values) in [
            (&mut self.ttft, &observed.ttft),
            (&mut self.inter_token, &observed.inter_token),
            (&mut self.e2e, &observed.e2e),
            (&mut self.queue, &observed.queue),
            (&mut self.prefill, &observed.prefill),
            (&mut self.decode, &observed.decode),
            (&mut self.inference, &observed.inference),
        ] {
            for &v in values {
                histogram.observe(v);
            }
        }
    }
}

impl Default for MetricsState {
    fn default() -> Self {
        MetricsState {
            running: 0,
            waiting: 0,
            stalled: 0,
            kv_usage: 0.0,
            cached_blocks: 0,
            evictions: 0,
            stats: SchedulerStats::default(),
            embedding_prompt_tokens: 0,
            rejected_queued_reqs: 0,
            rejected_queued_tokens: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            queue: Histogram::new(E2E_BUCKETS),
            prefill: Histogram::new(E2E_BUCKETS),
            decode: Histogram::new(E2E_BUCKETS),
            inference: Histogram::new(E2E_BUCKETS),
            inter_token: Histogram::new(INTER_TOKEN_BUCKETS),
        }
    }
}

/// Escapes a label value for the text format.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A float the way Prometheus parsers read it (`1.0`, `0.25`, `+Inf`).
fn number(value: f64) -> String {
    if value.is_infinite() {
        if value > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{value:?}")
    }
}

struct Writer {
    out: String,
    labels: String,
}

impl Writer {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, extra_labels: &str, value: f64) {
        let sep = if extra_labels.is_empty() { "" } else { "," };
        let _ = writeln!(
            self.out,
            "{name}{{{}{sep}{extra_labels}}} {}",
            self.labels,
            number(value)
        );
    }

    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.header(name, "gauge", help);
        self.sample(name, "", value);
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.header(name, "counter", help);
        self.sample(name, "", value as f64);
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (i, count) in h.counts.iter().enumerate() {
            cumulative += count;
            let le = h.bounds.get(i).copied().unwrap_or(f64::INFINITY);
            self.sample(
                &bucket,
                &format!("le=\"{}\"", number(le)),
                cumulative as f64,
            );
        }
        self.sample(&format!("{name}_count"), "", h.count as f64);
        self.sample(&format!("{name}_sum"), "", h.sum);
    }
}

/// The `/metrics` body.
pub fn render(info: &MetricsInfo, state: &MetricsState) -> String {
    let mut w = Writer {
        out: String::with_capacity(8192),
        labels: format!("model_name=\"{}\",engine=\"0\"", escape(&info.model_name)),
    };
    if !info.disable_log_stats {
        render_vllm(&mut w, info, state);
    }
    w.gauge(
        "vllm_sim:cached_blocks",
        "KV blocks currently cached under a prefix hash (vllm-sim only).",
        state.cached_blocks as f64,
    );
    w.gauge(
        "vllm_sim:num_requests_stalled",
        "Running requests held by the stall_after_tokens fault (vllm-sim only).",
        state.stalled as f64,
    );
    w.counter(
        "vllm_sim:prefix_cache_evictions_total",
        "Cached KV blocks evicted to make room (vllm-sim only).",
        state.evictions,
    );
    w.out
}

/// The `vllm:*` series, in the order vLLM 0.34 registers them.
fn render_vllm(w: &mut Writer, info: &MetricsInfo, state: &MetricsState) {
    let s = &state.stats;
    w.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        state.running as f64,
    );
    w.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        state.waiting as f64,
    );
    w.header(
        "vllm:num_requests_waiting_by_reason",
        "gauge",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
    );
    w.sample(
        "vllm:num_requests_waiting_by_reason",
        "reason=\"capacity\"",
        state.waiting as f64,
    );
    w.sample(
        "vllm:num_requests_waiting_by_reason",
        "reason=\"deferred\"",
        0.0,
    );
    w.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        state.kv_usage,
    );
    w.counter(
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        s.prefix_queries,
    );
    w.counter(
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        s.prefix_hits,
    );
    w.counter(
        "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.",
        s.preemptions,
    );
    w.counter(
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        s.prompt_tokens + state.embedding_prompt_tokens,
    );
    w.counter(
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        s.generation_tokens,
    );
    w.header(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
    );
    for (reason, count) in [
        ("stop", s.finished_stop),
        ("length", s.finished_length),
        ("abort", s.finished_abort),
    ] {
        w.sample(
            "vllm:request_success_total",
            &format!("finished_reason=\"{reason}\""),
            count as f64,
        );
    }
    // Labelled by model and reason only (no engine), as vLLM registers it.
    w.header(
        "vllm:admission_rejections_total",
        "counter",
        "Number of admission attempts rejected by a queue limit, by reason.",
    );
    for (reason, count) in [
        ("max_num_queued_reqs", state.rejected_queued_reqs),
        ("max_num_queued_tokens", state.rejected_queued_tokens),
    ] {
        let _ = writeln!(
            w.out,
            "vllm:admission_rejections_total{{model_name=\"{}\",reason=\"{reason}\"}} {}",
            escape(&info.model_name),
            number(count as f64)
        );
    }
    w.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &state.ttft,
    );
    w.histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &state.inter_token,
    );
    w.histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &state.e2e,
    );
    w.histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &state.queue,
    );
    w.histogram(
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        &state.inference,
    );
    w.histogram(
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        &state.prefill,
    );
    w.histogram(
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        &state.decode,
    );
    w.header(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    // CacheConfig.metrics_info(): its fields as strings (a subset, in declaration order), then
    // `engine`; no model_name.
    let tokens = u64::from(info.num_gpu_blocks) * u64::from(info.block_size);
    let concurrency = tokens as f64 / f64::from(info.max_model_len.max(1));
    let _ = writeln!(
        w.out,
        "vllm:cache_config_info{{block_size=\"{bs}\",gpu_memory_utilization=\"0.9\",cache_dtype=\"auto\",is_attention_free=\"False\",num_gpu_blocks_override=\"None\",sliding_window=\"None\",enable_prefix_caching=\"True\",prefix_caching_hash_algo=\"sha256\",num_gpu_blocks=\"{blocks}\",num_cpu_blocks=\"None\",effective_attention_block_size=\"{bs}\",kv_cache_size_tokens=\"{tokens}\",kv_cache_max_concurrency=\"{concurrency:?}\",hash_block_size=\"{bs}\",engine=\"0\"}} 1.0",
        bs = info.block_size,
        blocks = info.num_gpu_blocks,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> MetricsInfo {
        MetricsInfo {
            model_name: "m\"x".into(),
            block_size: 16,
            num_gpu_blocks: 4096,
            max_model_len: 32768,
            disable_log_stats: false,
        }
    }

    #[test]
    fn renders_vllm_names_with_model_label() {
        let mut state = MetricsState {
            running: 3,
            kv_usage: 0.25,
            ..Default::default()
        };
        state.stats.prefix_hits = 32;
        let text = render(&info(), &state);
        assert!(text.contains("# TYPE vllm:num_requests_running gauge\n"));
        assert!(
            text.contains("vllm:num_requests_running{model_name=\"m\\\"x\",engine=\"0\"} 3.0\n")
        );
        assert!(
            text.contains("vllm:kv_cache_usage_perc{model_name=\"m\\\"x\",engine=\"0\"} 0.25\n")
        );
        assert!(!text.contains("vllm:gpu_cache_usage_perc"));
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter\n"));
        assert!(text
            .contains("vllm:prefix_cache_hits_total{model_name=\"m\\\"x\",engine=\"0\"} 32.0\n"));
        assert!(!text.contains("vllm:gpu_prefix_cache"));
        assert!(text.contains("num_gpu_blocks=\"4096\""));
        assert!(text.contains("block_size=\"16\""));
        for name in [
            "vllm:num_requests_waiting",
            "vllm:prefix_cache_queries_total",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:e2e_request_latency_seconds_sum",
            "vllm:inter_token_latency_seconds_count",
            "vllm:request_queue_time_seconds_bucket",
            "vllm:request_inference_time_seconds_sum",
            "vllm:request_prefill_time_seconds_count",
            "vllm:request_decode_time_seconds_sum",
        ] {
            assert!(text.contains(name), "{name} missing");
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_end_at_inf() {
        let mut state = MetricsState::default();
        state.ttft.observe(0.003);
        state.ttft.observe(0.05);
        state.ttft.observe(9999.0);
        let text = render(&info(), &state);
        let line = |le: &str| {
            let prefix = format!(
                "vllm:time_to_first_token_seconds_bucket{{model_name=\"m\\\"x\",engine=\"0\",le=\"{le}\"}} "
            );
            text.lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()).map(str::to_string))
                .unwrap_or_else(|| panic!("no bucket {le}"))
        };
        assert_eq!(line("0.001"), "0.0");
        assert_eq!(line("0.005"), "1.0");
        assert_eq!(line("0.06"), "2.0");
        assert_eq!(line("2560.0"), "2.0");
        assert_eq!(line("+Inf"), "3.0");
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_count{model_name=\"m\\\"x\",engine=\"0\"} 3.0"
        ));
        assert_eq!(state.ttft.count(), 3);
    }

    #[test]
    fn observations_land_in_their_histograms_with_vllm_buckets() {
        let mut state = MetricsState::default();
        state.record(&Observations {
            ttft: vec![0.02],
            inter_token: vec![0.01, 0.02, 0.3],
            e2e: vec![1.2],
            queue: vec![0.4],
            prefill: vec![0.2],
            decode: vec![0.6],
            inference: vec![0.9],
        });
        let text = render(&info(), &state);
        let value = |series: &str| {
            let prefix = format!("{series}{{model_name=\"m\\\"x\",engine=\"0\"");
            text.lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .and_then(|rest| rest.rsplit(' ').next())
                .unwrap_or_else(|| panic!("no {series}"))
                .to_string()
        };
        assert_eq!(value("vllm:inter_token_latency_seconds_count"), "3.0");
        assert!(text.contains("vllm:inter_token_latency_seconds_bucket{model_name=\"m\\\"x\",engine=\"0\",le=\"0.025\"} 2.0"));
        assert!(text.contains("vllm:inter_token_latency_seconds_bucket{model_name=\"m\\\"x\",engine=\"0\",le=\"80.0\"} 3.0"));
        assert_eq!(value("vllm:request_queue_time_seconds_sum"), "0.4");
        assert!(text.contains("vllm:request_queue_time_seconds_bucket{model_name=\"m\\\"x\",engine=\"0\",le=\"0.3\"} 0.0"));
        assert!(text.contains("vllm:request_queue_time_seconds_bucket{model_name=\"m\\\"x\",engine=\"0\",le=\"0.5\"} 1.0"));
        assert!(text.contains("vllm:request_queue_time_seconds_bucket{model_name=\"m\\\"x\",engine=\"0\",le=\"7680.0\"} 1.0"));
        assert_eq!(value("vllm:request_prefill_time_seconds_sum"), "0.2");
        assert_eq!(value("vllm:request_decode_time_seconds_sum"), "0.6");
        assert_eq!(value("vllm:request_inference_time_seconds_sum"), "0.9");
        assert_eq!(value("vllm:e2e_request_latency_seconds_count"), "1.0");
        assert_eq!(value("vllm:time_to_first_token_seconds_count"), "1.0");
    }

    #[test]
    fn series_removed_in_0_34_are_gone_and_new_ones_are_there() {
        let mut state = MetricsState {
            waiting: 4,
            rejected_queued_reqs: 2,
            ..Default::default()
        };
        state.inter_token.observe(0.02);
        let text = render(&info(), &state);
        for gone in [
            "vllm:gpu_cache_usage_perc",
            "vllm:gpu_prefix_cache_queries",
            "vllm:gpu_prefix_cache_hits",
            "vllm:time_per_output_token_seconds",
        ] {
            assert!(!text.contains(gone), "{gone} is not in vLLM 0.34");
        }
        assert!(text.contains("vllm:cache_config_info{block_size=\"16\","));
        assert!(text.contains("num_gpu_blocks=\"4096\""));
        assert!(text.contains("kv_cache_size_tokens=\"65536\""));
        assert!(text.contains("kv_cache_max_concurrency=\"2.0\""));
        assert!(text.contains("engine=\"0\"} 1.0\n"));
        assert!(!text.contains("vllm:cache_config_info{model_name"));
        assert!(text.contains(
            "vllm:admission_rejections_total{model_name=\"m\\\"x\",reason=\"max_num_queued_reqs\"} 2.0\n"
        ));
        assert!(text.contains(
            "vllm:admission_rejections_total{model_name=\"m\\\"x\",reason=\"max_num_queued_tokens\"} 0.0\n"
        ));
        assert!(
            text.contains("vllm:num_requests_waiting{model_name=\"m\\\"x\",engine=\"0\"} 4.0\n")
        );
        assert!(text.contains(
            "vllm:num_requests_waiting_by_reason{model_name=\"m\\\"x\",engine=\"0\",reason=\"capacity\"} 4.0\n"
        ));
    }

    #[test]
    fn disable_log_stats_exports_no_vllm_series() {
        let quiet = MetricsInfo {
            disable_log_stats: true,
            ..info()
        };
        let text = render(&quiet, &MetricsState::default());
        assert!(!text.contains("vllm:"), "{text}");
        assert!(text.contains("vllm_sim:cached_blocks"));
    }

    #[test]
    fn every_sample_line_has_a_type_header() {
        let text = render(&info(), &MetricsState::default());
        let typed: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split('{').next().unwrap_or_default();
            assert!(
                typed.iter().any(|t| name == *t
                    || name
                        .strip_prefix(*t)
                        .is_some_and(|s| ["_bucket", "_count", "_sum"].contains(&s))),
                "{line}"
            );
        }
    }
}
