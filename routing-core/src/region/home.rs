//! Where a conversation's history is cached: a bounded map, kept in the Worker's isolate, from
//! the prompts it routed to the pool that served them.
//!
//! A conversation's next turn extends its previous prompt, so its chained block hashes start with
//! the previous prompt's. The isolate records the last block hash of every prompt it sends to a
//! pool; a new request looks its own hashes up from the longest prefix down, and the first hit is
//! its home pool and how many of its blocks that pool probably holds. A request with a routing key
//! (a session id) is also found by the key. At most `capacity` prompts are kept (the oldest
//! recorded is forgotten first), so memory stays at about `capacity x 24` bytes plus the pool
//! names. Another isolate does not know the map: its requests start from the nearest pool, and the
//! pool's own prefix table still finds the backend.

use std::collections::{HashMap, VecDeque};

/// A prompt's home: the pool index in [`HomePools::pools`] and the blocks it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Home {
    pool: u16,
    blocks: u32,
}

/// Conversations' home pools, bounded.
#[derive(Debug, Clone)]
pub struct HomePools {
    capacity: usize,
    by_block: HashMap<u64, Home>,
    by_key: HashMap<u64, Home>,
    /// Insertion order of `by_block` and `by_key` entries, for eviction (`true`: a routing key).
    order: VecDeque<(bool, u64)>,
    pools: Vec<String>,
}

impl HomePools {
    /// An empty map of at most `capacity` prompts.
    pub fn new(capacity: usize) -> Self {
        HomePools {
            capacity: capacity.max(1),
            by_block: HashMap::new(),
            by_key: HashMap::new(),
            order: VecDeque::new(),
            pools: Vec::new(),
        }
    }

    fn pool_index(&mut self, pool: &str) -> u16 {
        if let Some(i) = self.pools.iter().position(|p| p == pool) {
            return i as u16;
        }
        // Pool names are few; past u16 the last slot is reused rather than growing.
        if self.pools.len() < usize::from(u16::MAX) {
            self.pools.push(pool.to_string());
        }
        (self.pools.len() - 1) as u16
    }

    /// Records that `pool` served a prompt with these block hashes (and routing key).
    pub fn record(&mut self, block_hashes: &[u64], routing_key: Option<u64>, pool: &str) {
        let Some(&last) = block_hashes.last() else {
            return;
        };
        let home = Home {
            pool: self.pool_index(pool),
            blocks: block_hashes.len() as u32,
        };
        if self.by_block.insert(last, home).is_none() {
            self.order.push_back((false, last));
        }
        if let Some(key) = routing_key {
            if self.by_key.insert(key, home).is_none() {
                self.order.push_back((true, key));
            }
        }
        while self.by_block.len() + self.by_key.len() > self.capacity {
            match self.order.pop_front() {
                Some((false, h)) => {
                    self.by_block.remove(&h);
                }
                Some((true, k)) => {
                    self.by_key.remove(&k);
                }
                None => break,
            }
        }
    }

    /// The home pool of a prompt and the blocks it probably holds there: the longest recorded
    /// prefix, else the routing key's last pool (holding as many blocks as it recorded, at most
    /// the prompt's).
    pub fn lookup(&self, block_hashes: &[u64], routing_key: Option<u64>) -> Option<(&str, u32)> {
        for (i, h) in block_hashes.iter().enumerate().rev() {
            if let Some(home) = self.by_block.get(h) {
                return Some((&self.pools[usize::from(home.pool)], (i + 1) as u32));
            }
        }
        let home = self.by_key.get(&routing_key?)?;
        let blocks = home.blocks.min(block_hashes.len() as u32);
        Some((&self.pools[usize::from(home.pool)], blocks))
    }

    /// Prompts (and keys) recorded.
    pub fn len(&self) -> usize {
        self.by_block.len() + self.by_key.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_next_turn_finds_the_pool_of_its_previous_turn_by_prefix() {
        let mut h = HomePools::new(100);
        h.record(&[1, 2, 3], None, "eu");
        h.record(&[1, 9], None, "us");
        // The next turn of [1, 2, 3]: its first three blocks are the previous prompt.
        assert_eq!(h.lookup(&[1, 2, 3, 4, 5], None), Some(("eu", 3)));
        assert_eq!(h.lookup(&[1, 9, 7], None), Some(("us", 2)));
        // Sharing only a first block (a system prompt) recorded by nobody's last block: no home.
        assert_eq!(h.lookup(&[1, 5], None), None);
        assert_eq!(h.lookup(&[], None), None);
    }

    #[test]
    fn a_routing_key_finds_its_pool_when_the_prompt_does_not() {
        let mut h = HomePools::new(100);
        h.record(&[1, 2], Some(77), "eu");
        assert_eq!(h.lookup(&[5, 6, 7], Some(77)), Some(("eu", 2)));
        assert_eq!(h.lookup(&[5], Some(77)), Some(("eu", 1)));
        assert_eq!(h.lookup(&[5], Some(78)), None);
    }

    #[test]
    fn the_map_is_bounded_and_forgets_the_oldest_first() {
        let mut h = HomePools::new(10);
        for i in 0..100u64 {
            h.record(&[i], None, if i % 2 == 0 { "a" } else { "b" });
        }
        assert_eq!(h.len(), 10);
        assert_eq!(h.lookup(&[0], None), None);
        assert_eq!(h.lookup(&[99], None), Some(("b", 1)));
        // The latest record of a prompt wins.
        h.record(&[99], None, "a");
        assert_eq!(h.lookup(&[99], None), Some(("a", 1)));
    }
}
