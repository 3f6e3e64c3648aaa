//! The consistent-hash ring, with bounded loads.
//!
//! Each backend owns virtual nodes in proportion to its weight ([`VNODES_PER_WEIGHT`] per unit),
//! placed by xxh3 of its id, so a backend's points do not depend on who else is in the pool: adding
//! one backend to `n` moves about `1/(n+1)` of the keys, all of them onto the newcomer.
//!
//! A lookup walks clockwise from the key's hash and yields each backend once, in ring order. The
//! consistent_hash policy skips backends that are unavailable (so a dead backend's keys spread over
//! the backends that follow each of its many points, instead of piling onto one neighbour) and,
//! following Mirrokni, Thorup and Zadimoghaddam ("Consistent Hashing with Bounded Loads", 2018),
//! skips backends whose load would exceed `ceil((1 + eps) * average)`.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Virtual nodes per unit of weight.
pub const VNODES_PER_WEIGHT: u32 = 100;
/// Most virtual nodes one backend gets (weights above 100 stop adding points).
pub const MAX_VNODES_PER_BACKEND: u32 = 10_000;

/// One point on the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Point {
    hash: u64,
    node: u32,
}

/// A ring member: an opaque node number (the pool uses its slot), the id that places its points,
/// and its weight.
#[derive(Debug, Clone, Copy)]
pub struct RingMember<'a> {
    /// Node number reported by lookups.
    pub node: u32,
    /// Stable id the virtual nodes are hashed from.
    pub id: &'a str,
    /// Relative weight (0 places no points).
    pub weight: u32,
}

/// The hash of a routing key, as the ring and the policies use it.
pub fn key_hash(key: &str) -> u64 {
    xxh3_64(key.as_bytes())
}

/// The bounded-load cap for a key about to be placed: `ceil((1 + eps) * (total_load + 1) / n)`,
/// never below the `ceil((total_load + 1) / n)` that guarantees some member fits.
pub fn bounded_load_cap(total_load: u64, members: usize, eps: f64) -> u64 {
    if members == 0 {
        return 0;
    }
    let n = members as u64;
    let exact = (total_load + 1).div_ceil(n);
    let with_slack = ((1.0 + eps.max(0.0)) * (total_load + 1) as f64 / n as f64).ceil();
    if with_slack.is_finite() && with_slack >= exact as f64 {
        (with_slack as u64).max(exact)
    } else {
        exact
    }
}

/// A consistent-hash ring of virtual nodes.
#[derive(Debug, Clone, Default)]
pub struct HashRing {
    points: Vec<Point>,
    max_node: u32,
}

impl HashRing {
    /// Builds the ring for the given members.
    pub fn new<'a>(members: impl IntoIterator<Item = RingMember<'a>>) -> Self {
        let mut points = Vec::new();
        let mut max_node = 0;
        for m in members {
            let vnodes = m
                .weight
                .saturating_mul(VNODES_PER_WEIGHT)
                .min(MAX_VNODES_PER_BACKEND);
            max_node = max_node.max(m.node);
            for i in 0..vnodes {
                points.push(Point {
                    hash: xxh3_64_with_seed(m.id.as_bytes(), u64::from(i)),
                    node: m.node,
                });
            }
        }
        points.sort_unstable();
        HashRing { points, max_node }
    }

    /// Number of virtual nodes.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// Whether the ring has no points.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The node owning `hash`: the first point at or after it, wrapping around.
    pub fn owner(&self, hash: u64) -> Option<u32> {
        self.walk(hash).next()
    }

    /// The distinct nodes in clockwise order from `hash`, each once.
    pub fn walk(&self, hash: u64) -> RingWalk<'_> {
        let start = self.points.partition_point(|p| p.hash < hash);
        RingWalk {
            ring: self,
            start,
            steps: 0,
            seen: vec![0u64; (self.max_node as usize / 64) + 1],
        }
    }

    /// Ranks nodes for `hash` under bounded loads.
    ///
    /// `load(node)` returns `None` for a node that may not be chosen, else its current load;
    /// `available` is the number of nodes for which it returns `Some` and `total_load` the sum of
    /// their loads. Nodes whose load is below the cap come first, in ring order; the rest follow
    /// in ring order. At most `limit` nodes are written to `out`. Returns the first available node
    /// in ring order (the key's owner among available nodes), whether or not it was under the cap.
    #[allow(clippy::too_many_arguments)]
    pub fn rank_bounded(
        &self,
        hash: u64,
        eps: f64,
        available: usize,
        total_load: u64,
        limit: usize,
        load: impl Fn(u32) -> Option<u64>,
        out: &mut Vec<u32>,
    ) -> Option<u32> {
        out.clear();
        if available == 0 || limit == 0 {
            return None;
        }
        let cap = bounded_load_cap(total_load, available, eps);
        let mut over_cap: Vec<u32> = Vec::new();
        let mut seen_available = 0;
        let mut first = None;
        for node in self.walk(hash) {
            let Some(l) = load(node) else { continue };
            first.get_or_insert(node);
            seen_available += 1;
            if l < cap {
                out.push(node);
                if out.len() == limit {
                    return first;
                }
            } else if over_cap.len() < limit {
                over_cap.push(node);
            }
            if seen_available == available {
                break;
            }
        }
        for node in over_cap {
            if out.len() == limit {
                break;
            }
            out.push(node);
        }
        first
    }
}

/// Iterator over distinct ring nodes in clockwise order; see [`HashRing::walk`].
pub struct RingWalk<'a> {
    ring: &'a HashRing,
    start: usize,
    steps: usize,
    seen: Vec<u64>,
}

impl Iterator for RingWalk<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        let len = self.ring.points.len();
        while self.steps < len {
            let idx = (self.start + self.steps) % len;
            self.steps += 1;
            let node = self.ring.points[idx].node;
            let (word, bit) = (node as usize / 64, 1u64 << (node % 64));
            if self.seen[word] & bit == 0 {
                self.seen[word] |= bit;
                return Some(node);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(n: u32) -> (Vec<String>, HashRing) {
        let ids: Vec<String> = (0..n).map(|i| format!("backend-{i}")).collect();
        let r = HashRing::new(ids.iter().enumerate().map(|(i, id)| RingMember {
            node: i as u32,
            id,
            weight: 1,
        }));
        (ids, r)
    }

    #[test]
    fn points_follow_weight() {
        let r = HashRing::new([
            RingMember {
                node: 0,
                id: "a",
                weight: 1,
            },
            RingMember {
                node: 1,
                id: "b",
                weight: 3,
            },
            RingMember {
                node: 2,
                id: "c",
                weight: 0,
            },
        ]);
        assert_eq!(r.len(), 400);
        let mut counts = [0u32; 3];
        for k in 0..20_000u32 {
            counts[r.owner(key_hash(&k.to_string())).unwrap() as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        let share_b = f64::from(counts[1]) / 20_000.0;
        assert!((0.65..0.85).contains(&share_b), "b's share {share_b}");
    }

    #[test]
    fn walk_yields_each_node_once() {
        let (_, r) = ring(10);
        let mut nodes: Vec<u32> = r.walk(12345).collect();
        assert_eq!(nodes.len(), 10);
        nodes.sort();
        nodes.dedup();
        assert_eq!(nodes.len(), 10);
        assert_eq!(HashRing::default().owner(1), None);
    }

    #[test]
    fn placement_does_not_depend_on_node_numbers() {
        let a = HashRing::new([
            RingMember {
                node: 0,
                id: "x",
                weight: 1,
            },
            RingMember {
                node: 1,
                id: "y",
                weight: 1,
            },
        ]);
        let b = HashRing::new([
            RingMember {
                node: 7,
                id: "y",
                weight: 1,
            },
            RingMember {
                node: 3,
                id: "x",
                weight: 1,
            },
        ]);
        for k in 0..1000u64 {
            let h = key_hash(&k.to_string());
            let oa = a.owner(h).unwrap();
            let ob = b.owner(h).unwrap();
            assert_eq!(oa == 0, ob == 3);
        }
    }

    #[test]
    fn unavailable_owner_keys_spread_over_many_nodes() {
        let (_, r) = ring(10);
        let mut moved_to = [0u32; 10];
        for k in 0..20_000u32 {
            let h = key_hash(&k.to_string());
            if r.owner(h) == Some(0) {
                let mut out = Vec::new();
                r.rank_bounded(h, 100.0, 9, 0, 1, |n| (n != 0).then_some(0), &mut out);
                moved_to[out[0] as usize] += 1;
            }
        }
        assert_eq!(moved_to[0], 0);
        let receivers = moved_to.iter().filter(|&&c| c > 0).count();
        assert_eq!(
            receivers, 9,
            "orphaned keys reach every other backend: {moved_to:?}"
        );
        let max = *moved_to.iter().max().unwrap();
        let total: u32 = moved_to.iter().sum();
        assert!(f64::from(max) < 0.25 * f64::from(total), "{moved_to:?}");
    }

    #[test]
    fn cap_formula() {
        assert_eq!(bounded_load_cap(0, 10, 0.25), 1);
        assert_eq!(bounded_load_cap(99, 10, 0.25), 13);
        assert_eq!(bounded_load_cap(100, 4, 0.0), 26);
        assert_eq!(bounded_load_cap(5, 0, 0.25), 0);
        assert_eq!(bounded_load_cap(5, 2, f64::NAN), 3);
    }

    #[test]
    fn bounded_rank_skips_full_nodes_then_lists_them() {
        let (_, r) = ring(4);
        let h = key_hash("session-1");
        let owner = r.owner(h).unwrap();
        let loads = [5u64, 5, 5, 5];
        let mut with_owner_full = loads;
        with_owner_full[owner as usize] = 20;
        let total: u64 = with_owner_full.iter().sum();
        let mut out = Vec::new();
        r.rank_bounded(
            h,
            0.25,
            4,
            total,
            4,
            |n| Some(with_owner_full[n as usize]),
            &mut out,
        );
        assert_eq!(out.len(), 4);
        assert_ne!(out[0], owner);
        assert_eq!(*out.last().unwrap(), owner, "over-cap nodes come last");
        r.rank_bounded(h, 0.25, 4, 20, 4, |n| Some(loads[n as usize]), &mut out);
        assert_eq!(out[0], owner);
    }
}
