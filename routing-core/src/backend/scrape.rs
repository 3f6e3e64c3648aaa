//! Reading a vLLM server's `/metrics` page: the few gauges routing needs.
//!
//! vLLM exports Prometheus text. The names changed across releases (`vllm:gpu_cache_usage_perc`
//! became `vllm:kv_cache_usage_perc`; `vllm:gpu_prefix_cache_queries` became
//! `vllm:prefix_cache_queries`), so both spellings are read, the newer one winning. A server with
//! several engines or models exports one sample per label set: queue gauges and counters are
//! summed, usage is averaged. The parser never fails: lines it does not understand are skipped,
//! so a strange page yields `None`s, never an error.
//!
//! A page without any of the load series (vLLM with `--disable-log-stats` exports no `vllm:*`
//! series at all) says nothing about the backend's load: [`VllmMetrics::has_load`] is false, and
//! the pool marks the backend "load unknown" rather than reading the missing series as zero.

use serde::{Deserialize, Serialize};

/// The load gauges of a `/metrics` page: what the pool keeps of each scrape (the latest known
/// value of each) and shows in its listings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ScrapedGauges {
    /// Requests waiting in vLLM's queue (`vllm:num_requests_waiting`, summed).
    pub waiting: Option<f64>,
    /// Requests running (`vllm:num_requests_running`, summed).
    pub running: Option<f64>,
    /// KV-cache usage, 0 to 1 (`vllm:kv_cache_usage_perc`, or the older
    /// `vllm:gpu_cache_usage_perc`, averaged).
    pub kv_usage: Option<f64>,
    /// KV blocks: the `num_gpu_blocks` label of `vllm:cache_config_info`.
    pub kv_blocks: Option<u64>,
    /// Tokens per KV block: the `block_size` label of `vllm:cache_config_info`.
    pub block_size: Option<u32>,
    /// The true KV capacity in tokens: the `kv_cache_size_tokens` label of
    /// `vllm:cache_config_info` (vLLM 0.34; `block_size x num_gpu_blocks` is wrong for hybrid
    /// models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_tokens: Option<u64>,
}

impl VllmMetrics {
    /// Whether the page reports the backend's load (any of the waiting, running or KV-usage
    /// series): a page without them leaves the load unknown.
    pub fn has_load(&self) -> bool {
        let g = &self.gauges;
        g.waiting.is_some() || g.running.is_some() || g.kv_usage.is_some()
    }
}

/// The routing-relevant figures of one `/metrics` page: the load gauges and the counters read
/// between scrapes. The one source of these figures: a probe result carries it, and the pool keeps
/// its [`ScrapedGauges`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VllmMetrics {
    /// The load gauges (flattened: the JSON is one flat object).
    #[serde(flatten)]
    pub gauges: ScrapedGauges,
    /// Prefix-cache queries in tokens (`vllm:prefix_cache_queries_total`, or the older
    /// `vllm:gpu_prefix_cache_queries[_total]`).
    pub prefix_cache_queries: Option<f64>,
    /// Prefix-cache hits in tokens (new or old name).
    pub prefix_cache_hits: Option<f64>,
    /// Sum and count of `vllm:time_per_output_token_seconds` (or the newer
    /// `vllm:inter_token_latency_seconds`): the decode rate the time model learns from.
    pub tpot_seconds_sum: Option<f64>,
    /// See `tpot_seconds_sum`.
    pub tpot_count: Option<f64>,
}

#[derive(Default)]
struct Acc {
    sum: f64,
    count: u32,
}

impl Acc {
    fn add(&mut self, v: f64) {
        if v.is_finite() {
            self.sum += v;
            self.count += 1;
        }
    }
    fn sum(&self) -> Option<f64> {
        (self.count > 0).then_some(self.sum)
    }
    fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / f64::from(self.count))
    }
}

/// Parses a Prometheus text page from a vLLM server.
pub fn parse_vllm_metrics(text: &str) -> VllmMetrics {
    let (mut waiting, mut running) = (Acc::default(), Acc::default());
    let (mut usage_new, mut usage_old) = (Acc::default(), Acc::default());
    let (mut q_new, mut q_old, mut h_new, mut h_old) = (
        Acc::default(),
        Acc::default(),
        Acc::default(),
        Acc::default(),
    );
    let (mut tpot_sum_old, mut tpot_count_old) = (Acc::default(), Acc::default());
    let (mut tpot_sum_new, mut tpot_count_new) = (Acc::default(), Acc::default());
    let mut out = VllmMetrics::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = split_sample(line) else {
            continue;
        };
        match name {
            "vllm:num_requests_waiting" => waiting.add(value),
            "vllm:num_requests_running" => running.add(value),
            "vllm:kv_cache_usage_perc" => usage_new.add(value),
            "vllm:gpu_cache_usage_perc" => usage_old.add(value),
            "vllm:prefix_cache_queries_total" | "vllm:prefix_cache_queries" => q_new.add(value),
            "vllm:prefix_cache_hits_total" | "vllm:prefix_cache_hits" => h_new.add(value),
            "vllm:gpu_prefix_cache_queries_total" | "vllm:gpu_prefix_cache_queries" => {
                q_old.add(value)
            }
            "vllm:gpu_prefix_cache_hits_total" | "vllm:gpu_prefix_cache_hits" => h_old.add(value),
            "vllm:time_per_output_token_seconds_sum" => tpot_sum_old.add(value),
            "vllm:time_per_output_token_seconds_count" => tpot_count_old.add(value),
            "vllm:inter_token_latency_seconds_sum" => tpot_sum_new.add(value),
            "vllm:inter_token_latency_seconds_count" => tpot_count_new.add(value),
            "vllm:cache_config_info" => {
                if let Some(v) = label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok()) {
                    out.gauges.kv_blocks = Some(v);
                }
                if let Some(v) = label(labels, "block_size").and_then(|v| v.parse().ok()) {
                    out.gauges.block_size = Some(v);
                }
                if let Some(v) = label(labels, "kv_cache_size_tokens").and_then(parse_count) {
                    out.gauges.kv_cache_tokens = Some(v);
                }
            }
            _ => {}
        }
    }
    out.gauges.waiting = waiting.sum();
    out.gauges.running = running.sum();
    out.gauges.kv_usage = usage_new
        .mean()
        .or_else(|| usage_old.mean())
        .map(|u| u.clamp(0.0, 1.0));
    out.prefix_cache_queries = q_new.sum().or_else(|| q_old.sum());
    out.prefix_cache_hits = h_new.sum().or_else(|| h_old.sum());
    (out.tpot_seconds_sum, out.tpot_count) = match (tpot_sum_new.sum(), tpot_count_new.sum()) {
        (Some(s), Some(c)) => (Some(s), Some(c)),
        _ => (tpot_sum_old.sum(), tpot_count_old.sum()),
    };
    out
}

/// A label's count, written as an integer or as a float (`"1.2e+06"`).
fn parse_count(v: &str) -> Option<u64> {
    v.parse::<u64>().ok().or_else(|| {
        v.parse::<f64>()
            .ok()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .map(|f| f as u64)
    })
}

/// Splits `name{labels} value [timestamp]` into its parts.
fn split_sample(line: &str) -> Option<(&str, &str, f64)> {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) if line.as_bytes()[i] == b'{' => {
            let close = closing_brace(line, i)?;
            (&line[..i], (&line[i + 1..close], &line[close + 1..]))
        }
        Some(i) => (&line[..i], ("", &line[i..])),
        None => return None,
    };
    let (labels, tail) = rest;
    let value = tail.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name, labels, value))
}

/// The index of the `}` closing the label set opened at `open`, skipping quoted values.
fn closing_brace(line: &str, open: usize) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, c) in line[open + 1..].char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_quotes => escaped = true,
            '"' => in_quotes = !in_quotes,
            '}' if !in_quotes => return Some(open + 1 + i),
            _ => {}
        }
    }
    None
}

/// The value of label `key` in `a="1",b="2"` (escapes are not needed for the labels we read).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let name = rest[..eq].trim().trim_start_matches(',').trim();
        let after = rest[eq + 1..].trim_start();
        let after = after.strip_prefix('"')?;
        let end = after.find('"')?;
        if name == key {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEW: &str = r#"
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 400.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="4096"} 1.0
"#;

    #[test]
    fn reads_current_names() {
        let m = parse_vllm_metrics(NEW);
        assert_eq!(m.gauges.running, Some(5.0));
        assert_eq!(m.gauges.waiting, Some(7.0));
        assert_eq!(m.gauges.kv_usage, Some(0.375));
        assert_eq!(m.prefix_cache_queries, Some(1000.0));
        assert_eq!(m.prefix_cache_hits, Some(400.0));
        assert_eq!(m.gauges.kv_blocks, Some(4096));
        assert_eq!(m.gauges.block_size, Some(16));
    }

    #[test]
    fn a_page_without_vllm_series_has_no_load_and_kv_capacity_comes_from_its_label() {
        // vLLM with --disable-log-stats: no vllm:* series at all.
        let bare =
            "# HELP python_gc_objects_collected_total x\npython_gc_objects_collected_total 12\n";
        let m = parse_vllm_metrics(bare);
        assert!(!m.has_load());
        assert_eq!(m.gauges.waiting, None);
        assert!(parse_vllm_metrics(NEW).has_load());
        let info = "vllm:cache_config_info{block_size=\"64\",num_gpu_blocks=\"1000\",kv_cache_size_tokens=\"48000\"} 1.0\n";
        let m = parse_vllm_metrics(info);
        assert_eq!(m.gauges.block_size, Some(64));
        assert_eq!(m.gauges.kv_cache_tokens, Some(48_000));
        assert!(!m.has_load(), "configuration is no load");
    }

    #[test]
    fn reads_older_names() {
        let old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9\n\
                   vllm:gpu_prefix_cache_queries_total{model_name=\"m\"} 10\n\
                   vllm:gpu_prefix_cache_hits_total{model_name=\"m\"} 4\n";
        let m = parse_vllm_metrics(old);
        assert_eq!(m.gauges.kv_usage, Some(0.9));
        assert_eq!(m.prefix_cache_queries, Some(10.0));
        assert_eq!(m.prefix_cache_hits, Some(4.0));
        assert_eq!(m.gauges.waiting, None);
    }

    #[test]
    fn reads_time_per_output_token_under_either_name() {
        let old = "vllm:time_per_output_token_seconds_sum{model_name=\"m\"} 1.5\n\
                   vllm:time_per_output_token_seconds_count{model_name=\"m\"} 100\n";
        let m = parse_vllm_metrics(old);
        assert_eq!((m.tpot_seconds_sum, m.tpot_count), (Some(1.5), Some(100.0)));
        let both = format!(
            "{old}vllm:inter_token_latency_seconds_sum 3\nvllm:inter_token_latency_seconds_count 300\n"
        );
        let m = parse_vllm_metrics(&both);
        assert_eq!((m.tpot_seconds_sum, m.tpot_count), (Some(3.0), Some(300.0)));
    }

    #[test]
    fn newer_name_wins_when_both_are_present() {
        let both = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n";
        assert_eq!(parse_vllm_metrics(both).gauges.kv_usage, Some(0.1));
    }

    #[test]
    fn garbage_is_skipped_not_fatal() {
        let junk = "vllm:num_requests_waiting{model_name=\"a}b\"} 2\n\
                    vllm:num_requests_waiting{unterminated 5\n\
                    vllm:num_requests_waiting notanumber\n\
                    \u{0}\u{ffff} {}}}\n\
                    vllm:num_requests_running NaN\n";
        let m = parse_vllm_metrics(junk);
        assert_eq!(m.gauges.waiting, Some(2.0));
        assert_eq!(m.gauges.running, None);
    }
}
