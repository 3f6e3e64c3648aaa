//! Reading vLLM's Prometheus metrics: enough of the text format to sum a counter across label sets,
//! and the before/after difference of the counters a benchmark reports (prefix-cache queries and
//! hits in tokens, requests, preemptions). vLLM renamed `gpu_prefix_cache_*` to `prefix_cache_*`;
//! both spellings are read, the newer one winning.

use serde::Serialize;
use std::collections::BTreeMap;

/// Sums of every sample by metric name (labels dropped; `_total` kept as on the wire).
pub fn parse(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find('{') {
            Some(i) => match line[i..].find('}') {
                Some(j) => (&line[..i], &line[i + j + 1..]),
                None => continue,
            },
            None => match line.find(char::is_whitespace) {
                Some(i) => (&line[..i], &line[i..]),
                None => continue,
            },
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        *out.entry(name.to_string()).or_insert(0.0) += value;
    }
    out
}

/// The counters a benchmark reads from one backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Counters {
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: f64,
    /// Of those, tokens found cached.
    pub prefix_hits: f64,
    /// Requests finished (any reason).
    pub requests: f64,
    /// Prompt tokens processed.
    pub prompt_tokens: f64,
    /// Tokens generated.
    pub generation_tokens: f64,
    /// Preemptions.
    pub preemptions: f64,
}

fn first_of(m: &BTreeMap<String, f64>, names: &[&str]) -> f64 {
    names.iter().find_map(|n| m.get(*n).copied()).unwrap_or(0.0)
}

impl Counters {
    /// The counters in a `/metrics` body.
    pub fn from_text(text: &str) -> Counters {
        let m = parse(text);
        Counters {
            prefix_queries: first_of(
                &m,
                &[
                    "vllm:prefix_cache_queries_total",
                    "vllm:prefix_cache_queries",
                    "vllm:gpu_prefix_cache_queries_total",
                    "vllm:gpu_prefix_cache_queries",
                ],
            ),
            prefix_hits: first_of(
                &m,
                &[
                    "vllm:prefix_cache_hits_total",
                    "vllm:prefix_cache_hits",
                    "vllm:gpu_prefix_cache_hits_total",
                    "vllm:gpu_prefix_cache_hits",
                ],
            ),
            requests: first_of(&m, &["vllm:request_success_total"]),
            prompt_tokens: first_of(&m, &["vllm:prompt_tokens_total"]),
            generation_tokens: first_of(&m, &["vllm:generation_tokens_total"]),
            preemptions: first_of(&m, &["vllm:num_preemptions_total"]),
        }
    }

    /// `self - before`; a counter that went down (the server restarted) counts from zero.
    pub fn since(&self, before: &Counters) -> Counters {
        let d = |a: f64, b: f64| if a >= b { a - b } else { a };
        Counters {
            prefix_queries: d(self.prefix_queries, before.prefix_queries),
            prefix_hits: d(self.prefix_hits, before.prefix_hits),
            requests: d(self.requests, before.requests),
            prompt_tokens: d(self.prompt_tokens, before.prompt_tokens),
            generation_tokens: d(self.generation_tokens, before.generation_tokens),
            preemptions: d(self.preemptions, before.preemptions),
        }
    }

    /// Component-wise sum.
    pub fn add(&self, o: &Counters) -> Counters {
        Counters {
            prefix_queries: self.prefix_queries + o.prefix_queries,
            prefix_hits: self.prefix_hits + o.prefix_hits,
            requests: self.requests + o.requests,
            prompt_tokens: self.prompt_tokens + o.prompt_tokens,
            generation_tokens: self.generation_tokens + o.generation_tokens,
            preemptions: self.preemptions + o.preemptions,
        }
    }

    /// `prefix_hits / prefix_queries`.
    pub fn hit_rate(&self) -> f64 {
        if self.prefix_queries > 0.0 {
            self.prefix_hits / self.prefix_queries
        } else {
            0.0
        }
    }

    /// Tokens this backend computed: uncached prompt tokens plus generated tokens (its work).
    pub fn work_tokens(&self) -> f64 {
        (self.prefix_queries - self.prefix_hits).max(0.0) + self.generation_tokens
    }
}

/// A Prometheus histogram summed over label sets: `(upper bound, cumulative count)` by bucket,
/// in increasing order (`+Inf` last).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Cumulative counts by upper bound.
    pub buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// The histogram `name` (without `_bucket`) in a `/metrics` body.
    pub fn from_text(text: &str, name: &str) -> Histogram {
        let prefix = format!("{name}_bucket{{");
        let mut by_le: Vec<(f64, f64)> = Vec::new();
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with(&prefix))
        {
            let Some(le) = line.split("le=\"").nth(1).and_then(|r| r.split('"').next()) else {
                continue;
            };
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::NAN)
            };
            let Some(v) = line
                .rsplit('}')
                .next()
                .and_then(|r| r.split_whitespace().next())
                .and_then(|v| v.parse::<f64>().ok())
            else {
                continue;
            };
            match by_le.iter_mut().find(|(b, _)| *b == le) {
                Some(entry) => entry.1 += v,
                None => by_le.push((le, v)),
            }
        }
        by_le.retain(|(le, _)| !le.is_nan());
        by_le.sort_by(|a, b| a.0.total_cmp(&b.0));
        Histogram { buckets: by_le }
    }

    /// `self - before`, bucket by bucket (a restarted server counts from zero).
    pub fn since(&self, before: &Histogram) -> Histogram {
        let buckets = self
            .buckets
            .iter()
            .map(|&(le, v)| {
                let b = before
                    .buckets
                    .iter()
                    .find(|(l, _)| *l == le)
                    .map_or(0.0, |x| x.1);
                (le, if v >= b { v - b } else { v })
            })
            .collect();
        Histogram { buckets }
    }

    /// Bucket-wise sum (buckets missing from one side count as zero).
    pub fn add(&self, o: &Histogram) -> Histogram {
        let mut out = self.clone();
        for &(le, v) in &o.buckets {
            match out.buckets.iter_mut().find(|(l, _)| *l == le) {
                Some(e) => e.1 += v,
                None => out.buckets.push((le, v)),
            }
        }
        out.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        out
    }

    /// The `q`-quantile (0-1), interpolated linearly inside its bucket as Prometheus'
    /// `histogram_quantile` does; 0 for an empty histogram.
    pub fn quantile(&self, q: f64) -> f64 {
        let total = self.buckets.last().map_or(0.0, |b| b.1);
        if total <= 0.0 {
            return 0.0;
        }
        let rank = q * total;
        let (mut prev_le, mut prev_count) = (0.0, 0.0);
        for &(le, count) in &self.buckets {
            if count >= rank {
                if le.is_infinite() {
                    return prev_le;
                }
                let width = count - prev_count;
                let frac = if width > 0.0 {
                    (rank - prev_count) / width
                } else {
                    1.0
                };
                return prev_le + (le - prev_le) * frac;
            }
            (prev_le, prev_count) = (le, count);
        }
        prev_le
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"# HELP vllm:prefix_cache_queries_total Prefix cache queries.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 640.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2
vllm:generation_tokens_total{engine="0",model_name="m"} 1.5e2
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 4.0
plain_metric 5
"#;

    #[test]
    fn parses_and_sums_across_labels() {
        let m = parse(SAMPLE);
        assert_eq!(m["vllm:request_success_total"], 10.0);
        assert_eq!(m["plain_metric"], 5.0);
        assert_eq!(m["vllm:generation_tokens_total"], 150.0);
        let c = Counters::from_text(SAMPLE);
        assert_eq!(c.prefix_queries, 1000.0);
        assert_eq!(c.prefix_hits, 640.0);
        assert_eq!(c.requests, 10.0);
        assert_eq!(c.preemptions, 2.0);
        assert_eq!(c.hit_rate(), 0.64);
        assert_eq!(c.work_tokens(), 360.0 + 150.0);
    }

    #[test]
    fn histograms_sum_subtract_and_interpolate() {
        let text = "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.1\",model_name=\"m\"} 50\n\
                    vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.5\",model_name=\"m\"} 90\n\
                    vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 100\n\
                    vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 100\n";
        let h = Histogram::from_text(text, "vllm:time_to_first_token_seconds");
        assert_eq!(
            h.buckets,
            vec![(0.1, 50.0), (0.5, 90.0), (f64::INFINITY, 100.0)]
        );
        assert!((h.quantile(0.25) - 0.05).abs() < 1e-12);
        assert!((h.quantile(0.7) - 0.3).abs() < 1e-12);
        assert_eq!(
            h.quantile(0.99),
            0.5,
            "past the last finite bucket: its bound"
        );
        let twice = h.add(&h);
        assert_eq!(twice.since(&h), h);
        assert_eq!(Histogram::default().quantile(0.5), 0.0);
    }

    #[test]
    fn older_names_are_read_and_deltas_survive_restarts() {
        let old = "vllm:gpu_prefix_cache_queries_total{a=\"b\"} 50\nvllm:gpu_prefix_cache_hits_total 20\n";
        let c = Counters::from_text(old);
        assert_eq!((c.prefix_queries, c.prefix_hits), (50.0, 20.0));
        let later = Counters {
            prefix_queries: 80.0,
            ..c
        };
        assert_eq!(later.since(&c).prefix_queries, 30.0);
        let restarted = Counters {
            prefix_queries: 10.0,
            ..Counters::default()
        };
        assert_eq!(restarted.since(&c).prefix_queries, 10.0);
    }
}
