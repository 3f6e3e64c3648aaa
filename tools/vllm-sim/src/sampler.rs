//! Deterministic "sampling": which pieces a sequence generates and when it would emit EOS.
//!
//! Output depends only on the server's `--seed`, the request's `seed` (ignored at `temperature: 0`,
//! where vLLM is greedy and the seed cannot matter) and the prompt bytes, so the same request to the
//! same server always produces the same text. Without `ignore_eos`, a sequence "emits EOS" after a
//! length drawn uniformly from `1..=2*mean-1` (mean `--mean-output-tokens`), never before `min_tokens`.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// SplitMix64: a tiny, fast, seedable generator (also used for fault draws).
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw from `[0, 1)`.
    pub fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The seed of a sequence's text: a hash of the prompt keyed by the server and request seeds.
pub fn text_seed(
    server_seed: u64,
    request_seed: Option<i64>,
    temperature: f64,
    prompt: &[u8],
) -> u64 {
    let request_part = match request_seed {
        Some(seed) if temperature > 0.0 => (seed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 1,
        _ => 0,
    };
    xxh3_64_with_seed(prompt, server_seed ^ request_part)
}

/// After how many output tokens a sequence emits EOS, or `None` when `ignore_eos` is set.
pub fn eos_after(
    text_seed: u64,
    mean_output_tokens: u32,
    min_tokens: u32,
    ignore_eos: bool,
) -> Option<u32> {
    if ignore_eos {
        return None;
    }
    let span = u64::from(mean_output_tokens.max(1)) * 2 - 1;
    let mut rng = SplitMix64::new(text_seed ^ 0xE05_E05);
    let natural = 1 + (rng.next_u64() % span) as u32;
    Some(natural.max(min_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_inputs_same_seed() {
        let a = text_seed(1, Some(5), 0.7, b"prompt");
        assert_eq!(a, text_seed(1, Some(5), 0.7, b"prompt"));
        assert_ne!(a, text_seed(2, Some(5), 0.7, b"prompt"));
        assert_ne!(a, text_seed(1, Some(6), 0.7, b"prompt"));
        assert_ne!(a, text_seed(1, Some(5), 0.7, b"prompt!"));
    }

    #[test]
    fn greedy_ignores_the_request_seed() {
        assert_eq!(
            text_seed(1, Some(5), 0.0, b"p"),
            text_seed(1, Some(6), 0.0, b"p")
        );
        assert_eq!(
            text_seed(1, Some(5), 0.0, b"p"),
            text_seed(1, None, 0.7, b"p")
        );
    }

    #[test]
    fn eos_lengths_average_the_mean_and_respect_min_tokens() {
        let n = 2000u64;
        let total: u64 = (0..n)
            .map(|s| u64::from(eos_after(s, 100, 0, false).unwrap()))
            .sum();
        let mean = total as f64 / n as f64;
        assert!((90.0..110.0).contains(&mean), "mean {mean}");
        assert!((0..n).all(|s| eos_after(s, 100, 150, false).unwrap() >= 150));
        assert_eq!(eos_after(3, 100, 0, true), None);
        assert_eq!(eos_after(3, 1, 0, false), Some(1));
    }

    #[test]
    fn unit_draws_stay_in_range() {
        let mut rng = SplitMix64::new(42);
        assert!((0..10_000)
            .map(|_| rng.next_unit())
            .all(|u| (0.0..1.0).contains(&u)));
    }
}
