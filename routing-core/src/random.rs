//! Randomness as an input.
//!
//! The core never reads a random number generator of its own: policies that choose at random
//! (random, power_of_two) and the breaker's cooldown jitter draw from a [`RandomSource`] passed in
//! by the caller. The Durable Object seeds a [`SplitMix64`] once (from `crypto.getRandomValues` or
//! the clock); tests seed it with a constant so every decision is reproducible.

/// A source of uniformly distributed 64-bit values.
pub trait RandomSource {
    /// The next uniformly distributed 64-bit value.
    fn next_u64(&mut self) -> u64;

    /// A uniform value in `0..n`; returns 0 when `n` is 0.
    ///
    /// Uses the multiply-shift reduction (Lemire), whose bias is at most `n / 2^64`.
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A uniform value in `[0, 1)` with 53 bits of precision.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// SplitMix64 (Steele, Lea and Flood): a tiny, fast, seedable generator with good statistical
/// quality for load-balancing choices. Not cryptographic, and not meant to be.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose sequence is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }
}

impl RandomSource for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = SplitMix64::new(1);
        let mut seen = [0u32; 5];
        for _ in 0..10_000 {
            let v = rng.below(5);
            assert!(v < 5);
            seen[v as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 1_700 && c < 2_300), "{seen:?}");
        assert_eq!(rng.below(0), 0);
    }

    #[test]
    fn unit_is_in_half_open_interval() {
        let mut rng = SplitMix64::new(3);
        for _ in 0..10_000 {
            let u = rng.unit();
            assert!((0.0..1.0).contains(&u));
        }
    }
}
