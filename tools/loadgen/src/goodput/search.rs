//! The goodput benchmark's search over replay speed-ups: start at a load, multiply it by a growth
//! factor while the SLO holds, divide it while it does not, then bisect (geometrically) between
//! the highest load that held and the lowest that broke, within a bounded number of probes. Pure:
//! the caller runs each probe and records whether the SLO held. A screen (`--at`) probes a fixed
//! list of speed-ups instead, in order, so variants are compared at the loads that decide them.

use serde::{Deserialize, Serialize};

/// How the search moves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchConfig {
    /// Each step up (or down, before anything held) multiplies (divides) the speed-up by this.
    #[serde(default = "default_growth")]
    pub growth: f64,
    /// At most this many probes per router and trace.
    #[serde(default = "default_steps")]
    pub steps: usize,
    /// Bisection stops when the lowest failing speed-up is within this fraction of the highest
    /// sustained one.
    #[serde(default = "default_tolerance")]
    pub tolerance: f64,
    /// Never below this speed-up.
    #[serde(default = "default_min")]
    pub min: f64,
    /// Never above this speed-up.
    #[serde(default = "default_max")]
    pub max: f64,
}

fn default_growth() -> f64 {
    2.0
}
fn default_steps() -> usize {
    6
}
fn default_tolerance() -> f64 {
    0.1
}
fn default_min() -> f64 {
    1.0
}
fn default_max() -> f64 {
    256.0
}

impl Default for SearchConfig {
    fn default() -> Self {
        SearchConfig {
            growth: default_growth(),
            steps: default_steps(),
            tolerance: default_tolerance(),
            min: default_min(),
            max: default_max(),
        }
    }
}

/// One search: the probes so far and what they showed.
#[derive(Debug, Clone)]
pub struct Search {
    config: SearchConfig,
    start: f64,
    /// A screen's speed-ups, probed in order instead of the search (empty: search).
    fixed: Vec<f64>,
    probes: Vec<(f64, bool)>,
}

/// `x` rounded to one decimal (speed-ups stay readable and a bisection cannot loop on a hair).
fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

impl Search {
    /// A search that first probes `start` (clamped to the config's bounds).
    pub fn new(config: SearchConfig, start: f64) -> Search {
        Search {
            start: round1(start.clamp(config.min, config.max)),
            config,
            fixed: Vec::new(),
            probes: Vec::new(),
        }
    }

    /// A screen: probes exactly `speedups`, in order (each rounded to one decimal), whatever
    /// they show.
    pub fn fixed(config: SearchConfig, speedups: &[f64]) -> Search {
        Search {
            start: speedups.first().copied().map_or(config.min, round1),
            config,
            fixed: speedups.iter().copied().map(round1).collect(),
            probes: Vec::new(),
        }
    }

    /// Records that the SLO held (`true`) or broke at `speedup`.
    pub fn record(&mut self, speedup: f64, held: bool) {
        self.probes.push((speedup, held));
    }

    /// The probes so far, in order.
    #[cfg(test)]
    pub fn probes(&self) -> &[(f64, bool)] {
        &self.probes
    }

    /// The lowest speed-up at which the SLO broke.
    pub fn lowest_broken(&self) -> Option<f64> {
        self.probes
            .iter()
            .filter(|p| !p.1)
            .map(|p| p.0)
            .reduce(f64::min)
    }

    /// The highest sustained speed-up: the highest at which the SLO held below every one at which
    /// it broke (a pass above a failure, noise near the edge, does not count).
    pub fn sustained(&self) -> Option<f64> {
        let broken = self.lowest_broken().unwrap_or(f64::INFINITY);
        self.probes
            .iter()
            .filter(|p| p.1 && p.0 < broken)
            .map(|p| p.0)
            .reduce(f64::max)
    }

    /// The next speed-up to probe, or `None` when the search is over (out of steps, at a bound,
    /// or the bracket is within the tolerance).
    pub fn next(&self) -> Option<f64> {
        let c = &self.config;
        if !self.fixed.is_empty() {
            return self.fixed.get(self.probes.len()).copied();
        }
        if self.probes.len() >= c.steps {
            return None;
        }
        let fresh = |x: f64| {
            let x = round1(x.clamp(c.min, c.max));
            (!self.probes.iter().any(|p| p.0 == x)).then_some(x)
        };
        match (self.sustained(), self.lowest_broken()) {
            (None, None) => Some(self.start),
            (Some(held), None) => fresh(held * c.growth),
            (None, Some(broke)) => fresh(broke / c.growth),
            (Some(held), Some(broke)) => {
                if broke <= held * (1.0 + c.tolerance) {
                    None
                } else {
                    fresh((held * broke).sqrt())
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a search against a router whose SLO holds up to `limit`.
    fn run(config: SearchConfig, start: f64, limit: f64) -> Search {
        let mut s = Search::new(config, start);
        while let Some(x) = s.next() {
            s.record(x, x <= limit);
        }
        s
    }

    #[test]
    fn grows_then_bisects_to_the_tolerance() {
        let s = run(SearchConfig::default(), 8.0, 21.0);
        let xs: Vec<f64> = s.probes().iter().map(|p| p.0).collect();
        // 8 and 16 hold, 32 breaks; then sqrt(16 x 32) = 22.6 breaks, sqrt(16 x 22.6) = 19 holds,
        // sqrt(19 x 22.6) = 20.7 holds: six steps.
        assert_eq!(xs, [8.0, 16.0, 32.0, 22.6, 19.0, 20.7]);
        assert_eq!(s.sustained(), Some(20.7));
        assert_eq!(s.lowest_broken(), Some(22.6));
        assert_eq!(s.next(), None);
    }

    #[test]
    fn stops_within_the_tolerance_before_the_step_budget() {
        let config = SearchConfig {
            steps: 20,
            tolerance: 0.25,
            ..SearchConfig::default()
        };
        let s = run(config, 8.0, 21.0);
        let (held, broke) = (s.sustained().unwrap(), s.lowest_broken().unwrap());
        assert!(held <= 21.0 && broke > 21.0);
        assert!(broke <= held * 1.25, "{held} {broke}");
        assert!(s.probes().len() < 20);
    }

    #[test]
    fn goes_down_when_the_start_breaks_and_stops_at_the_floor() {
        let s = run(SearchConfig::default(), 8.0, 3.0);
        let xs: Vec<f64> = s.probes().iter().map(|p| p.0).collect();
        assert_eq!(&xs[..3], [8.0, 4.0, 2.0]);
        assert!(s.sustained().unwrap() <= 3.0 && s.sustained().unwrap() >= 2.0);
        // Nothing holds even at the floor: no sustained load, and the search ends at the floor.
        let s = run(SearchConfig::default(), 4.0, 0.5);
        assert_eq!(s.sustained(), None);
        assert_eq!(s.probes().last().unwrap().0, 1.0);
        assert_eq!(s.next(), None);
    }

    #[test]
    fn two_steps_and_the_ceiling_bound_the_search() {
        let quick = SearchConfig {
            steps: 2,
            ..SearchConfig::default()
        };
        let s = run(quick, 8.0, 100.0);
        assert_eq!(s.probes(), [(8.0, true), (16.0, true)]);
        assert_eq!(s.sustained(), Some(16.0));
        let capped = SearchConfig {
            max: 20.0,
            ..SearchConfig::default()
        };
        let s = run(capped, 8.0, 100.0);
        assert_eq!(s.probes(), [(8.0, true), (16.0, true), (20.0, true)]);
        assert_eq!(s.next(), None, "at the ceiling");
    }

    #[test]
    fn a_screen_probes_its_list_whatever_it_shows() {
        let mut s = Search::fixed(SearchConfig::default(), &[19.0, 20.71, 22.6]);
        let mut seen = Vec::new();
        while let Some(x) = s.next() {
            seen.push(x);
            s.record(x, x < 20.0);
        }
        assert_eq!(seen, vec![19.0, 20.7, 22.6]);
        assert_eq!(s.sustained(), Some(19.0));
        assert_eq!(s.lowest_broken(), Some(20.7));
    }

    #[test]
    fn a_pass_above_a_failure_is_not_sustained() {
        let mut s = Search::new(SearchConfig::default(), 8.0);
        s.record(8.0, true);
        s.record(16.0, false);
        s.record(11.3, true);
        s.record(32.0, true);
        assert_eq!(s.sustained(), Some(11.3));
        assert_eq!(s.lowest_broken(), Some(16.0));
    }
}
