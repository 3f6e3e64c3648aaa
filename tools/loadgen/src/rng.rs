//! Seeded randomness for workloads and arrivals: one small generator (SplitMix64) and the few
//! distributions the workloads need (uniform, exponential gaps of a Poisson process, Zipf).
//!
//! Its own code rather than a crate so that a seed names the same workload on every platform and
//! every version of the dependencies: benchmark results must be reproducible from the seed alone.

/// A SplitMix64 generator: tiny, fast, and good enough for load generation.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator for `seed`; `stream` separates independent sequences drawn from one seed.
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut rng = Rng {
            state: seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F),
        };
        rng.next_u64();
        rng
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// An exponential draw with the given mean: the gap between arrivals of a Poisson process.
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.next_f64()).ln()
    }

    /// Shuffles `items` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// A Zipf distribution over `0..n`: item `k` has weight `1 / (k + 1)^s` (`s = 0` is uniform).
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// The distribution over `n` items with exponent `s`.
    pub fn new(n: usize, s: f64) -> Self {
        let mut cdf = Vec::with_capacity(n);
        let mut total = 0.0;
        for k in 0..n {
            total += 1.0 / ((k + 1) as f64).powf(s);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        Zipf { cdf }
    }

    /// Draws an item.
    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.next_f64();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len().saturating_sub(1))
    }

    /// The probability of item `k`.
    #[cfg(test)]
    pub fn probability(&self, k: usize) -> f64 {
        let prev = if k == 0 { 0.0 } else { self.cdf[k - 1] };
        self.cdf[k] - prev
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_streams_differ() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7, 1);
            (0..5).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::new(7, 1);
            (0..5).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = Rng::new(7, 2);
            (0..5).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn exponential_has_the_requested_mean() {
        let mut r = Rng::new(1, 0);
        let n = 200_000;
        let mean = (0..n).map(|_| r.exponential(0.05)).sum::<f64>() / n as f64;
        assert!((mean - 0.05).abs() < 0.001, "{mean}");
    }

    #[test]
    fn zipf_favours_the_first_items_and_uniform_does_not() {
        let z = Zipf::new(10, 1.0);
        assert!(z.probability(0) > 2.9 * z.probability(2));
        let u = Zipf::new(4, 0.0);
        assert!((u.probability(3) - 0.25).abs() < 1e-12);
        let mut r = Rng::new(3, 0);
        let mut counts = [0usize; 10];
        for _ in 0..50_000 {
            counts[z.sample(&mut r)] += 1;
        }
        assert!(counts[0] > counts[1] && counts[1] > counts[5]);
    }

    #[test]
    fn below_stays_in_range() {
        let mut r = Rng::new(9, 0);
        assert!((0..10_000).all(|_| r.below(3) < 3));
    }
}
