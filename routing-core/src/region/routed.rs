//! What a pool counts of the Worker's choices: the requests that asked it first, by why the Worker
//! chose it and whether they came from another region (`llm_gateway_pool_routed_total`).

use crate::metrics::{header, sample};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Why the Worker asked this pool, as the acquire carries it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ChoiceNote {
    /// `nearest`, `home`, `faster`, `anchor_full` (the plan's first pool) or `spill` (a later one).
    pub reason: String,
    /// The client is in another region than the pool.
    pub cross_region: bool,
}

/// Reasons a note may carry (anything else counts as `other`).
const REASONS: [&str; 5] = ["nearest", "home", "faster", "anchor_full", "spill"];

/// Acquires that named why they came, by reason and region.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutedCounts {
    counts: BTreeMap<(&'static str, bool), u64>,
}

impl RoutedCounts {
    /// Counts one acquire's note.
    pub fn count(&mut self, note: &ChoiceNote) {
        let reason = REASONS
            .iter()
            .copied()
            .find(|r| *r == note.reason)
            .unwrap_or("other");
        *self.counts.entry((reason, note.cross_region)).or_default() += 1;
    }

    /// How many came for `reason` from another region (`cross_region`) or this one.
    pub fn get(&self, reason: &str, cross_region: bool) -> u64 {
        self.counts
            .iter()
            .find(|((r, c), _)| *r == reason && *c == cross_region)
            .map_or(0, |(_, n)| *n)
    }

    /// Writes `llm_gateway_pool_routed_total` for `pool`.
    pub fn render(&self, pool: &str, out: &mut String) {
        const NAME: &str = "llm_gateway_pool_routed_total";
        header(
            out,
            NAME,
            "counter",
            "Requests that asked this pool, by why the Worker chose it and whether the client is in another region.",
        );
        for ((reason, cross), n) in &self.counts {
            let cross = if *cross { "true" } else { "false" };
            let labels = [("reason", *reason), ("cross_region", cross)];
            sample(out, NAME, pool, &labels, *n as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_reason_and_region_and_renders_them() {
        let mut c = RoutedCounts::default();
        let note = |reason: &str, cross_region| ChoiceNote {
            reason: reason.into(),
            cross_region,
        };
        c.count(&note("faster", true));
        c.count(&note("faster", true));
        c.count(&note("nearest", false));
        c.count(&note("made-up", false));
        assert_eq!(c.get("faster", true), 2);
        assert_eq!(c.get("other", false), 1);
        let mut out = String::new();
        c.render("eu", &mut out);
        assert!(out.contains(
            "llm_gateway_pool_routed_total{pool=\"eu\",reason=\"faster\",cross_region=\"true\"} 2"
        ));
    }
}
