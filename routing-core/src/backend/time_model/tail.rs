//! The answers a prompt would hold up: which running requests on a backend are predicted to end in
//! the pool's tail of end-to-end times, and how much a new prompt's prefill would push them
//! further into it.
//!
//! vLLM computes a new prompt in the same engine steps as every running sequence's next token,
//! so a prefill of `p` ms delays each answer decoding there by about `p`. For the mean that is the
//! harm the time model already prices (`running × p`); for the tail it matters only for answers
//! that end late anyway. So each share the backend carries keeps its predicted end-to-end time
//! (grant to last token: queue, prefill, first step, expected output at its predicted time per
//! token) plus the prefill admitted there after it (which ran in its steps), and a prompt is
//! priced by how far it pushes them past the pool's tail `T` (a high quantile of the end-to-end
//! times it measured):
//!
//! ```text
//! tail_harm(b, p) = Σ over b's shares i: max(0, E_i + p − T) − max(0, E_i − T)
//! ```
//!
//! An answer predicted to end well inside the tail costs nothing; one already past it costs the
//! whole `p`. In the timed simulation the slowest 1% of answers on Mooncake's conversation trace
//! spent 300-800 ms of their decode in other prompts' prefill, nearly all of it from prompts that
//! were cold everywhere and could have gone elsewhere.

use super::BackendTiming;

/// Most shares a backend tracks for the tail (more are not priced: a backend running over a
/// thousand sequences holds up everyone with any prefill).
const MAX_TRACKED: usize = 1_024;

/// Observations before the pool's tail is trusted.
const MIN_OBSERVATIONS: u64 = 20;

/// How far one observation moves the tail estimate, as a share of it.
const STEP: f64 = 0.05;

/// A streaming estimate of a high quantile of the pool's end-to-end times (grant to release of
/// successful streamed requests), in ms: each observation above it raises it by `STEP × q`, each
/// one below lowers it by `STEP × (1 − q)` (relative to its value), so it settles where a share
/// `1 − q` of observations lie above it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TailEstimate {
    ms: f64,
    observations: u64,
}

impl TailEstimate {
    /// Learns one end-to-end time, for quantile `q` (0.5 to 0.999).
    pub fn observe(&mut self, duration_ms: u64, q: f64) {
        let x = duration_ms as f64;
        let q = q.clamp(0.5, 0.999);
        if self.observations == 0 {
            self.ms = x;
        } else {
            let step = STEP * self.ms.max(1.0);
            if x > self.ms {
                self.ms += step * q;
            } else {
                self.ms = (self.ms - step * (1.0 - q)).max(0.0);
            }
        }
        self.observations = self.observations.saturating_add(1);
    }

    /// The estimate, once enough requests have taught it.
    pub fn ms(&self) -> Option<f64> {
        (self.observations >= MIN_OBSERVATIONS).then_some(self.ms)
    }
}

impl BackendTiming {
    /// Tracks a share whose end-to-end time is predicted `e2e_us` from its grant; returns the
    /// base kept in its prediction (its end-to-end time less the prefill admitted through it, so
    /// that adding what is admitted later gives its end-to-end time now).
    pub(super) fn track_answer(&mut self, e2e_us: u64) -> i64 {
        let base = e2e_us as i64 - self.admitted_prefill_us as i64;
        if self.answers.len() < MAX_TRACKED {
            // Kept sorted, so a price reads only the answers near the tail.
            let at = self.answers.partition_point(|&a| a < base);
            self.answers.insert(at, base);
        }
        base
    }

    /// Stops tracking a share that left (equal bases are interchangeable).
    pub(super) fn forget_answer(&mut self, base: i64) {
        let at = self.answers.partition_point(|&a| a < base);
        if self.answers.get(at) == Some(&base) {
            self.answers.remove(at);
        }
    }

    /// How far a prefill of `prefill_ms` here would push the answers running here past the tail of
    /// `tail_ms`, summed, in ms (see the module's formula). Each answer's end is as predicted at
    /// its grant plus the prefill admitted here since; the answers are sorted by it, so those
    /// already past the tail cost the whole prefill each, counted at once, and only the ones
    /// ending within `prefill_ms` before the tail are read one by one.
    pub fn tail_harm_ms(&self, prefill_ms: f64, tail_ms: f64) -> f64 {
        if prefill_ms <= 0.0 {
            return 0.0;
        }
        let admitted = self.admitted_prefill_us as f64;
        let pushed =
            |end_ms: f64| (end_ms + prefill_ms - tail_ms).max(0.0) - (end_ms - tail_ms).max(0.0);
        // An answer's end in ms is (base + admitted) / 1000: the bases of the ends at `ms`.
        let base_at = |ms: f64| ms * 1000.0 - admitted;
        let past = self
            .answers
            .partition_point(|&a| (a as f64) < base_at(tail_ms));
        let near = self
            .answers
            .partition_point(|&a| (a as f64) <= base_at(tail_ms - prefill_ms))
            .min(past);
        let near_tail: f64 = self.answers[near..past]
            .iter()
            .map(|&a| pushed((a as f64 + admitted) / 1000.0))
            .sum();
        near_tail + (self.answers.len() - past) as f64 * prefill_ms
    }

    /// Shares tracked for the tail.
    #[cfg(test)]
    fn tracked_answers(&self) -> usize {
        self.answers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BackendTiming, TimeModelConfig};
    use super::TailEstimate;

    #[test]
    fn the_estimate_settles_at_its_quantile() {
        let mut t = TailEstimate::default();
        assert_eq!(t.ms(), None);
        // 1..=100 ms over and over: the 90th percentile is about 90.
        for round in 0..200u64 {
            for i in 0..100u64 {
                t.observe((i * 37 + round) % 100 + 1, 0.9);
            }
        }
        let ms = t.ms().unwrap();
        assert!((80.0..=97.0).contains(&ms), "{ms}");
    }

    #[test]
    fn the_sorted_walk_prices_as_the_formula_does() {
        let c = TimeModelConfig::default();
        let mut b = BackendTiming::default();
        // Answers of 1 to 200 output tokens granted over time, prompts admitted among them, a
        // third leaving: the price read from the sorted ends equals the module's formula.
        let mut seed = 11u64;
        let mut next = move |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let mut kept = Vec::new();
        for i in 0..300u64 {
            let share = b.admit(&c, i * 7, next(400) as f64, 1.0 + next(200) as f64, 0);
            if next(3) == 0 {
                b.leave(&share, i * 7);
            } else {
                kept.push(share);
            }
        }
        assert!(b.tracked_answers() > 150);
        let admitted = b.admitted_prefill_us as i64;
        for (prefill, tail) in [(0.5, 900.0), (40.0, 1_500.0), (300.0, 2_500.0), (5e3, 10.0)] {
            let formula: f64 = b
                .answers
                .iter()
                .map(|&a| {
                    let e = (a + admitted) as f64 / 1000.0;
                    (e + prefill - tail).max(0.0) - (e - tail).max(0.0)
                })
                .sum();
            let priced = b.tail_harm_ms(prefill, tail);
            assert!(
                (priced - formula).abs() < 1e-6,
                "{prefill} {tail}: {priced} vs {formula}"
            );
        }
        assert!(b.answers.windows(2).all(|w| w[0] <= w[1]));
        for share in &kept {
            b.leave(share, 3_000);
        }
        assert_eq!(b.tracked_answers(), 0);
    }

    #[test]
    fn only_answers_near_the_tail_are_harmed() {
        let c = TimeModelConfig::default();
        let mut b = BackendTiming::default();
        // A long answer (1,000 tokens) and a short one, both granted at 0 with nothing to
        // prefill.
        let long = b.admit(&c, 0, 0.0, 1_000.0, 0);
        let short = b.admit(&c, 0, 1.0, 2.0, 0);
        assert_eq!(b.tracked_answers(), 2);
        // The long one ends past 5 s, the short one at about 30 ms: a 100 ms prefill pushes only
        // the long one past a 5 s tail, by all of it; with a 10 s tail, nothing.
        assert!((b.tail_harm_ms(100.0, 5_000.0) - 100.0).abs() < 1e-6);
        assert_eq!(b.tail_harm_ms(100.0, 20_000.0), 0.0);
        // A prompt admitted after them runs in their steps: it counts in their end-to-end time.
        let before = b.tail_harm_ms(100.0, 10_400.0);
        b.admit(&c, 5_000, 2.0, 1.0, 0);
        assert!(b.tail_harm_ms(100.0, 10_400.0) > before);
        b.leave(&long, 0);
        b.leave(&short, 0);
        assert_eq!(b.tracked_answers(), 1);
        assert_eq!(b.tail_harm_ms(0.0, 0.0), 0.0);
    }
}
