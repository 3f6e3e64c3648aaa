//! The KV blocks a backend's running requests hold, counted once however many requests share them.
//!
//! A backend's memory is not the sum of its requests' prompts: a system prompt behind every
//! conversation is held once, and a conversation's history, cached from its last turn, is held
//! again while its next turn runs. The pool therefore counts, per backend, how many live leases
//! hold each prompt block; the number of distinct blocks is the backend's memory in use by the
//! gateway's requests (their output tokens come on top).

use std::collections::HashMap;

/// Reference counts of the prompt blocks live leases hold on one backend.
#[derive(Debug, Clone, Default)]
pub struct HeldBlocks {
    counts: HashMap<u64, u32>,
}

impl HeldBlocks {
    /// A request holding `blocks` started.
    pub fn hold(&mut self, blocks: &[u64]) {
        for &b in blocks {
            *self.counts.entry(b).or_default() += 1;
        }
    }

    /// A request holding `blocks` ended (blocks it never held are ignored).
    pub fn release(&mut self, blocks: &[u64]) {
        for b in blocks {
            if let Some(n) = self.counts.get_mut(b) {
                *n -= 1;
                if *n == 0 {
                    self.counts.remove(b);
                }
            }
        }
    }

    /// How many leading blocks of `blocks` (a chain, the first `limit` of which the backend
    /// caches) running requests hold. Chained hashes make held blocks prefix-closed, so a binary
    /// search finds it in `log2(limit)` lookups.
    pub fn held_prefix(&self, blocks: &[u64], limit: usize) -> usize {
        let (mut lo, mut hi) = (0, limit.min(blocks.len()));
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if self.counts.contains_key(&blocks[mid - 1]) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// Distinct blocks held.
    pub fn distinct(&self) -> usize {
        self.counts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_blocks_count_once_until_the_last_holder_ends() {
        let mut h = HeldBlocks::default();
        h.hold(&[1, 2, 3]);
        h.hold(&[1, 2, 4, 5]);
        assert_eq!(h.distinct(), 5);
        h.release(&[1, 2, 3]);
        assert_eq!(h.distinct(), 4);
        assert_eq!(h.held_prefix(&[1, 2, 4, 7, 8], 5), 3);
        assert_eq!(h.held_prefix(&[1, 2, 4, 7, 8], 2), 2);
        assert_eq!(h.held_prefix(&[6, 7], 2), 0);
        h.release(&[9]);
        h.release(&[1, 2, 4, 5]);
        assert_eq!(h.distinct(), 0);
    }
}
