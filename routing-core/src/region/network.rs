//! The network part of a pool's cost: the round trip between the Worker's colo and a pool.
//!
//! The platform tells a Worker where it runs (`request.cf.colo`) but not how far any other place
//! is, so the model starts from a configured table of round trips between regions (the
//! `REGION_RTT_MS` var, symmetric: `{"us-east": {"eu-west": 80}}`) and refines it with what the
//! isolate measures itself: the wall time of its calls to each pool's coordinator, which runs near
//! the pool's GPUs. Measurements are kept per client region and pool (an isolate serves one colo,
//! so one region, unless a trusted front proxy names the region per request): the last
//! [`SAMPLES`] of at most [`MAX_POOLS`] such pairs (the least recently measured is forgotten
//! first), and once there are [`MIN_SAMPLES`] of a pair, their median, which a few slow calls (a
//! busy coordinator) do not move. Measurements live in isolate memory only: a new isolate starts
//! from the table.

use std::collections::HashMap;

/// Measurements kept per pool.
pub const SAMPLES: usize = 16;
/// Measurements of a pool before they replace the configured figure.
pub const MIN_SAMPLES: usize = 4;
/// Pools an isolate keeps measurements of.
pub const MAX_POOLS: usize = 64;
/// Largest round trip a measurement may report, in ms (longer ones are clamped).
pub const MAX_RTT_MS: u32 = 5_000;

/// A pool's recent round trips, a ring of [`SAMPLES`].
#[derive(Debug, Clone)]
struct Samples {
    ms: [u32; SAMPLES],
    len: usize,
    next: usize,
    /// When last measured (for eviction), a counter of the model's observations.
    touched: u64,
}

impl Samples {
    fn median(&self) -> u32 {
        let mut v = self.ms[..self.len].to_vec();
        v.sort_unstable();
        v[v.len() / 2]
    }
}

/// Round trips from this Worker to each pool, configured and measured.
#[derive(Debug, Clone, Default)]
pub struct NetworkModel {
    /// Configured round trips between regions, both orders.
    table: HashMap<(String, String), u32>,
    /// Round trip assumed between two different regions the table does not list, in ms.
    default_remote_ms: u32,
    measured: HashMap<String, Samples>,
    observations: u64,
}

impl NetworkModel {
    /// A model from the configured table (`{"from": {"to": ms}}`, read both ways) and the round
    /// trip to assume between different regions it does not list.
    pub fn new(table: &HashMap<String, HashMap<String, u32>>, default_remote_ms: u32) -> Self {
        let mut t = HashMap::new();
        for (from, row) in table {
            for (to, ms) in row {
                t.insert((from.clone(), to.clone()), *ms);
                t.entry((to.clone(), from.clone())).or_insert(*ms);
            }
        }
        NetworkModel {
            table: t,
            default_remote_ms,
            ..NetworkModel::default()
        }
    }

    /// Records one measured round trip to `pool` from a client in `client_region`.
    pub fn observe(&mut self, client_region: Option<&str>, pool: &str, rtt_ms: u32) {
        let pool = &pair(client_region, pool);
        self.observations += 1;
        let touched = self.observations;
        if !self.measured.contains_key(pool) && self.measured.len() >= MAX_POOLS {
            if let Some(oldest) = self
                .measured
                .iter()
                .min_by_key(|(_, s)| s.touched)
                .map(|(k, _)| k.clone())
            {
                self.measured.remove(&oldest);
            }
        }
        let s = self.measured.entry(pool.to_string()).or_insert(Samples {
            ms: [0; SAMPLES],
            len: 0,
            next: 0,
            touched,
        });
        s.ms[s.next] = rtt_ms.min(MAX_RTT_MS);
        s.next = (s.next + 1) % SAMPLES;
        s.len = (s.len + 1).min(SAMPLES);
        s.touched = touched;
    }

    /// The configured round trip between two regions (0 within one; `None` when either is
    /// unknown).
    pub fn configured_ms(&self, from: Option<&str>, to: &str) -> Option<u32> {
        let from = from.filter(|f| !f.is_empty())?;
        if to.is_empty() {
            return None;
        }
        if from == to {
            return Some(0);
        }
        Some(
            self.table
                .get(&(from.to_string(), to.to_string()))
                .copied()
                .unwrap_or(self.default_remote_ms),
        )
    }

    /// The round trip to `pool` in `pool_region` from a client in `client_region`: measured when
    /// there are enough measurements, else configured, else 0 (nothing known: every pool alike).
    pub fn rtt_ms(&self, client_region: Option<&str>, pool: &str, pool_region: &str) -> u32 {
        match self.measured.get(&pair(client_region, pool)) {
            Some(s) if s.len >= MIN_SAMPLES => s.median(),
            _ => self.configured_ms(client_region, pool_region).unwrap_or(0),
        }
    }

    /// Whether the round trip to `pool` from `client_region` comes from measurements.
    pub fn is_measured(&self, client_region: Option<&str>, pool: &str) -> bool {
        self.measured
            .get(&pair(client_region, pool))
            .is_some_and(|s| s.len >= MIN_SAMPLES)
    }

    /// Client region and pool pairs with measurements kept.
    pub fn measured_pools(&self) -> usize {
        self.measured.len()
    }
}

/// The key of a client region and pool's measurements.
fn pair(client_region: Option<&str>, pool: &str) -> String {
    format!("{}>{pool}", client_region.unwrap_or(""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> HashMap<String, HashMap<String, u32>> {
        serde_json::from_str(r#"{"us-east": {"eu-west": 80, "ap-south": 190}}"#).unwrap()
    }

    #[test]
    fn the_table_is_read_both_ways_with_a_default_for_the_rest() {
        let m = NetworkModel::new(&table(), 150);
        assert_eq!(m.configured_ms(Some("us-east"), "eu-west"), Some(80));
        assert_eq!(m.configured_ms(Some("eu-west"), "us-east"), Some(80));
        assert_eq!(m.configured_ms(Some("eu-west"), "eu-west"), Some(0));
        assert_eq!(m.configured_ms(Some("eu-west"), "ap-south"), Some(150));
        assert_eq!(m.configured_ms(None, "eu-west"), None);
        assert_eq!(m.rtt_ms(None, "p", "eu-west"), 0);
    }

    #[test]
    fn measurements_replace_the_table_once_there_are_enough_and_slow_calls_do_not_move_them() {
        let mut m = NetworkModel::new(&table(), 150);
        let us = Some("us-east");
        for ms in [52, 49, 51] {
            m.observe(us, "eu", ms);
        }
        assert_eq!(m.rtt_ms(us, "eu", "eu-west"), 80, "3 samples: the table");
        m.observe(us, "eu", 50);
        assert!(m.is_measured(us, "eu"));
        let median = m.rtt_ms(us, "eu", "eu-west");
        assert!((50..=52).contains(&median), "{median}");
        // Clients of another region have their own measurements (here none yet).
        assert!(!m.is_measured(Some("eu-west"), "eu"));
        assert_eq!(m.rtt_ms(Some("eu-west"), "eu", "eu-west"), 0);
        // A few calls that queued behind a busy coordinator leave the median where it was.
        for _ in 0..3 {
            m.observe(us, "eu", 900);
        }
        assert!(m.rtt_ms(us, "eu", "eu-west") <= 52);
        m.observe(us, "eu", u32::MAX);
        let kept = m.measured.get(&pair(us, "eu")).unwrap();
        assert!(kept.ms.iter().all(|&v| v <= MAX_RTT_MS));
    }

    #[test]
    fn memory_is_bounded_and_the_least_recent_pool_goes_first() {
        let mut m = NetworkModel::new(&HashMap::new(), 100);
        for i in 0..(MAX_POOLS + 10) {
            m.observe(None, &format!("p{i}"), 10);
            m.observe(None, "hot", 20);
        }
        assert_eq!(m.measured_pools(), MAX_POOLS);
        assert!(m.measured.contains_key(&pair(None, "hot")));
        assert!(!m.measured.contains_key(&pair(None, "p0")));
    }
}
