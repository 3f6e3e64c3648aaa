//! The goodput benchmark's SLO and its figures per load: the bounds (a multiple of what the
//! window's requests would take on an idle fleet, from vllm-sim's cost model), one load's figures as
//! the median of several trace windows with their spread, and whether the SLO held there. Pure.

use crate::report::{IdleModel, RunReport};
use crate::stats::percentile;
use serde::{Deserialize, Serialize};

/// The SLO: TTFT p99 and e2e p99, each at most `factor` x the `reference_percentile` of the
/// requests' own idle figure (their uncached prefill and one step; plus one step per further
/// output token for e2e), over the windows replayed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloConfig {
    /// Which percentile of the idle figures the bounds are multiples of (99: the p99 request's
    /// own prefill, the floor of any router's TTFT p99; 50: the median prompt's).
    #[serde(default = "default_reference")]
    pub reference_percentile: f64,
    /// TTFT p99 bound over the reference idle TTFT.
    pub ttft_p99_factor: f64,
    /// E2E p99 bound over the reference idle e2e.
    pub e2e_p99_factor: f64,
}

fn default_reference() -> f64 {
    99.0
}

/// The SLO's bounds for one trace, and what they were derived from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SloBounds {
    /// The reference idle TTFT, ms.
    pub idle_ttft_ms: f64,
    /// The reference idle e2e, ms.
    pub idle_e2e_ms: f64,
    /// The idle TTFT of the windows' median prompt, ms (printed for comparison).
    pub median_prompt_idle_ttft_ms: f64,
    /// TTFT p99 bound, ms.
    pub ttft_p99_ms: f64,
    /// E2E p99 bound, ms.
    pub e2e_p99_ms: f64,
}

impl SloConfig {
    /// The bounds for requests of (prompt tokens, output tokens) `requests` on a fleet timed by
    /// `idle`.
    pub fn bounds(&self, idle: &IdleModel, requests: &[(u32, u32)]) -> SloBounds {
        let sorted = |f: &dyn Fn(&(u32, u32)) -> f64| {
            let mut v: Vec<f64> = requests.iter().map(f).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            v
        };
        let ttft = sorted(&|r| idle.ideal_ttft_ms(r.0));
        let e2e = sorted(&|r| idle.ideal_e2e_ms(r.0, r.1));
        let idle_ttft_ms = percentile(&ttft, self.reference_percentile);
        let idle_e2e_ms = percentile(&e2e, self.reference_percentile);
        SloBounds {
            idle_ttft_ms,
            idle_e2e_ms,
            median_prompt_idle_ttft_ms: percentile(&ttft, 50.0),
            ttft_p99_ms: self.ttft_p99_factor * idle_ttft_ms,
            e2e_p99_ms: self.e2e_p99_factor * idle_e2e_ms,
        }
    }
}

/// One window's figures at one load (a failed percentile is infinite).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct WindowFigures {
    /// TTFT p99, ms.
    pub ttft_p99_ms: f64,
    /// E2E p99, ms.
    pub e2e_p99_ms: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// The fleet's prefix-cache hit rate (0-1).
    pub hit_rate: f64,
    /// Failed requests.
    pub failed: usize,
}

impl WindowFigures {
    /// Of a trace run's report (failed requests count as infinitely slow, as in the trace bench).
    pub fn of(r: &RunReport) -> WindowFigures {
        let (ttft, e2e, failed) = match &r.trace {
            Some(t) => (t.ttft_ms.p99, t.e2e_ms.p99, t.failed),
            None => (Some(r.ttft_ms.p99), Some(r.e2e_ms.p99), r.errors),
        };
        WindowFigures {
            ttft_p99_ms: ttft.unwrap_or(f64::INFINITY),
            e2e_p99_ms: e2e.unwrap_or(f64::INFINITY),
            requests_per_s: r.requests_per_s,
            output_tokens_per_s: r.output_tokens_per_s,
            hit_rate: r.hit_rate,
            failed,
        }
    }
}

/// A median with the spread it was taken over.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// The median (the mean of the two middle values for an even count).
    pub median: f64,
    /// The lowest value.
    pub min: f64,
    /// The highest value.
    pub max: f64,
}

impl Spread {
    /// Of `values` (infinite values allowed; empty gives NaN).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let mut v: Vec<f64> = values.into_iter().collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        if n == 0 {
            return Spread {
                median: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
            };
        }
        // An odd count's middle value; an even count's two middle ones averaged, unless the upper
        // is infinite (then the average is too; said plainly).
        let median = if n % 2 == 1 || v[n / 2].is_infinite() {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Spread {
            median,
            min: v[0],
            max: v[n - 1],
        }
    }
}

/// One load's figures: the median over its windows, and whether the SLO held on the medians.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// The replay speed-up.
    pub speedup: f64,
    /// TTFT p99 over the windows, ms.
    pub ttft_p99_ms: Spread,
    /// E2E p99 over the windows, ms.
    pub e2e_p99_ms: Spread,
    /// Median completed requests per second.
    pub requests_per_s: f64,
    /// Median output tokens per second.
    pub output_tokens_per_s: f64,
    /// Median prefix-cache hit rate (0-1).
    pub hit_rate: f64,
    /// Failed requests over every window.
    pub failed: usize,
    /// Every window's own figures, in window order.
    pub windows: Vec<WindowFigures>,
    /// Whether the TTFT p99 median is within its bound.
    pub ttft_ok: bool,
    /// Whether the e2e p99 median is within its bound.
    pub e2e_ok: bool,
}

impl Point {
    /// The point at `speedup` from its windows' figures, checked against `bounds`.
    pub fn of(speedup: f64, windows: Vec<WindowFigures>, bounds: &SloBounds) -> Point {
        let median = |f: fn(&WindowFigures) -> f64| Spread::of(windows.iter().map(f)).median;
        let ttft = Spread::of(windows.iter().map(|w| w.ttft_p99_ms));
        let e2e = Spread::of(windows.iter().map(|w| w.e2e_p99_ms));
        Point {
            speedup,
            ttft_ok: ttft.median <= bounds.ttft_p99_ms,
            e2e_ok: e2e.median <= bounds.e2e_p99_ms,
            ttft_p99_ms: ttft,
            e2e_p99_ms: e2e,
            requests_per_s: median(|w| w.requests_per_s),
            output_tokens_per_s: median(|w| w.output_tokens_per_s),
            hit_rate: median(|w| w.hit_rate),
            failed: windows.iter().map(|w| w.failed).sum(),
            windows,
        }
    }

    /// Whether the SLO held: both medians within their bounds.
    pub fn held(&self) -> bool {
        self.ttft_ok && self.e2e_ok
    }

    /// What broke, for the tables: `TTFT`, `e2e`, `TTFT+e2e` or empty.
    pub fn broken(&self) -> &'static str {
        match (self.ttft_ok, self.e2e_ok) {
            (true, true) => "",
            (false, true) => "TTFT",
            (true, false) => "e2e",
            (false, false) => "TTFT+e2e",
        }
    }
}

/// Test fixtures shared with the report's tests: bounds of 1,000 ms TTFT p99 and 1,800 ms e2e
/// p99, and a window's figures (20 output tokens per request, 15% hit rate, nothing failed).
#[cfg(test)]
pub mod fixtures {
    use super::{SloBounds, WindowFigures};

    /// TTFT p99 <= 1,000 ms, e2e p99 <= 1,800 ms.
    pub fn bounds() -> SloBounds {
        SloBounds {
            idle_ttft_ms: 500.0,
            idle_e2e_ms: 900.0,
            median_prompt_idle_ttft_ms: 60.0,
            ttft_p99_ms: 1000.0,
            e2e_p99_ms: 1800.0,
        }
    }

    /// A window with these p99s at `rps` requests per second.
    pub fn window(ttft: f64, e2e: f64, rps: f64) -> WindowFigures {
        WindowFigures {
            ttft_p99_ms: ttft,
            e2e_p99_ms: e2e,
            requests_per_s: rps,
            output_tokens_per_s: rps * 20.0,
            hit_rate: 0.15,
            failed: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{bounds, window};
    use super::*;

    fn idle() -> IdleModel {
        IdleModel {
            prefill_us_per_token: 100.0,
            step_ms: 10.0,
            time_scale: 1.0,
        }
    }

    #[test]
    fn bounds_are_multiples_of_the_reference_request_on_an_idle_fleet() {
        // 100 requests: prompts of 100..10,000 tokens, each with 11 output tokens.
        let reqs: Vec<(u32, u32)> = (1..=100).map(|i| (i * 100, 11)).collect();
        let slo = SloConfig {
            reference_percentile: 99.0,
            ttft_p99_factor: 2.0,
            e2e_p99_factor: 3.0,
        };
        let b = slo.bounds(&idle(), &reqs);
        // The p99 prompt (interpolated: 9,901 tokens) takes 990.1 ms of prefill + a 10 ms step.
        assert!((b.idle_ttft_ms - 1000.1).abs() < 1e-6, "{b:?}");
        // Its e2e adds ten more steps.
        assert!((b.idle_e2e_ms - 1100.1).abs() < 1e-6, "{b:?}");
        assert!((b.ttft_p99_ms - 2000.2).abs() < 1e-6);
        assert!((b.e2e_p99_ms - 3300.3).abs() < 1e-6);
        // The median prompt (5,050 tokens): 505 + 10 ms.
        assert!((b.median_prompt_idle_ttft_ms - 515.0).abs() < 1e-6);
        let median = SloConfig {
            reference_percentile: 50.0,
            ..slo
        }
        .bounds(&idle(), &reqs);
        assert!((median.ttft_p99_ms - 1030.0).abs() < 1e-6);
    }

    #[test]
    fn the_median_of_windows_and_its_spread() {
        assert_eq!(
            Spread::of([3.0, 1.0, 2.0]),
            Spread {
                median: 2.0,
                min: 1.0,
                max: 3.0
            }
        );
        assert_eq!(Spread::of([4.0, 1.0]).median, 2.5);
        // A failed window (infinite p99) is one vote, not a veto...
        let s = Spread::of([100.0, f64::INFINITY, 120.0]);
        assert_eq!((s.median, s.max), (120.0, f64::INFINITY));
        // ...unless it is a middle one.
        assert_eq!(Spread::of([100.0, f64::INFINITY]).median, f64::INFINITY);
        assert!(Spread::of([]).median.is_nan());
    }

    #[test]
    fn the_slo_holds_on_the_medians_and_says_what_broke() {
        let bounds = bounds();
        // One window over the TTFT bound, the median under it: held.
        let p = Point::of(
            16.0,
            vec![
                window(900.0, 1500.0, 40.0),
                window(1200.0, 1600.0, 42.0),
                window(950.0, 1700.0, 44.0),
            ],
            &bounds,
        );
        assert!(p.held(), "{p:?}");
        assert_eq!(p.ttft_p99_ms.median, 950.0);
        assert_eq!(p.ttft_p99_ms.max, 1200.0);
        assert_eq!(p.requests_per_s, 42.0);
        assert_eq!(p.output_tokens_per_s, 840.0);
        assert_eq!(p.broken(), "");
        let p = Point::of(32.0, vec![window(900.0, 2000.0, 80.0)], &bounds);
        assert!(!p.held());
        assert_eq!(p.broken(), "e2e");
        let p = Point::of(
            64.0,
            vec![window(f64::INFINITY, f64::INFINITY, 10.0)],
            &bounds,
        );
        assert_eq!(p.broken(), "TTFT+e2e");
    }
}
