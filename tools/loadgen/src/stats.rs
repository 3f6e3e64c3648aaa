//! Latency summaries: percentiles with linear interpolation between closest ranks (numpy's default,
//! so figures can be checked with any notebook) and the mean.

use serde::Serialize;

/// Summary of a set of samples (milliseconds unless stated).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Number of samples.
    pub count: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest sample.
    pub max: f64,
}

/// The `p`-th percentile (0-100) of sorted `values`; 0 for no values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = (p / 100.0).clamp(0.0, 1.0) * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

impl Summary {
    /// Summarises `values` (any order; NaNs are dropped).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Summary {
        let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        if v.is_empty() {
            return Summary::default();
        }
        Summary {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            p999: percentile(&v, 99.9),
            max: v[v.len() - 1],
        }
    }

    /// Every figure multiplied by `k` (e.g. wall-clock to model time).
    pub fn scaled(&self, k: f64) -> Summary {
        Summary {
            count: self.count,
            mean: self.mean * k,
            p50: self.p50 * k,
            p90: self.p90 * k,
            p99: self.p99 * k,
            p999: self.p999 * k,
            max: self.max * k,
        }
    }
}

/// Busiest over mean of per-backend counts (1.0 is perfect balance); `backends` is the fleet size,
/// so a backend that got nothing still counts in the mean.
pub fn imbalance(counts: &[f64], backends: usize) -> f64 {
    let n = backends.max(counts.len());
    let total: f64 = counts.iter().sum();
    if n == 0 || total == 0.0 {
        return 0.0;
    }
    counts.iter().copied().fold(0.0, f64::max) / (total / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 5.5);
        assert!((percentile(&v, 90.0) - 9.1).abs() < 1e-9);
        assert!((percentile(&v, 99.0) - 9.91).abs() < 1e-9);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 10.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(percentile(&[3.0], 99.9), 3.0);
    }

    #[test]
    fn summary_sorts_and_ignores_nan() {
        let s = Summary::of([5.0, 1.0, f64::NAN, 3.0]);
        assert_eq!(s.count, 3);
        assert_eq!(s.p50, 3.0);
        assert_eq!(s.max, 5.0);
        assert_eq!(s.mean, 3.0);
        assert_eq!(Summary::of([]).count, 0);
        assert_eq!(s.scaled(2.0).p50, 6.0);
    }

    #[test]
    fn imbalance_counts_idle_backends() {
        assert_eq!(imbalance(&[10.0, 10.0], 2), 1.0);
        assert_eq!(imbalance(&[20.0], 2), 2.0);
        assert_eq!(imbalance(&[], 2), 0.0);
    }
}
