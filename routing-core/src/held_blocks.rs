//! The KV blocks a backend's running requests hold, counted once however many requests share them.
//!
//! A backend's memory is not the sum of its requests' prompts: a system prompt behind every
//! conversation is held once, and a conversation's history, cached from its last turn, is held
//! again while its next turn runs. The pool therefore keeps, per backend, the prompt blocks of each
//! live lease, and the number of distinct blocks among them is the backend's memory in use by the
//! gateway's requests (their output tokens come on top).
//!
//! Prompts are chains of block hashes (a block's hash names its whole prefix, see
//! [`crate::prompt`]), so the blocks held form a tree of prefixes, and two prompts share exactly
//! their longest common prefix, which a binary search finds. A prompt starting adds its length
//! minus the longest prefix it shares with a prompt already held; one ending takes away its length
//! minus the longest prefix it shares with those still held. Either costs a binary search per
//! running request on the backend (one comparison for an unrelated prompt), not a hash-map update
//! per block.

use crate::lease::LeaseId;

/// The prompt blocks live leases hold on one backend.
#[derive(Debug, Clone, Default)]
pub struct HeldBlocks {
    prompts: Vec<(LeaseId, Vec<u64>)>,
    distinct: usize,
}

impl HeldBlocks {
    /// Lease `lease` started holding the chain `blocks`.
    pub fn hold(&mut self, lease: LeaseId, blocks: Vec<u64>) {
        self.distinct += blocks.len() - self.shared(&blocks, blocks.len());
        self.prompts.push((lease, blocks));
    }

    /// Lease `lease` ended: its blocks, or `None` if it held none here.
    pub fn release(&mut self, lease: LeaseId) -> Option<Vec<u64>> {
        let i = self.prompts.iter().position(|(id, _)| *id == lease)?;
        let (_, blocks) = self.prompts.swap_remove(i);
        // Saturating: only a list that is not a chain could make the counts disagree.
        self.distinct = self
            .distinct
            .saturating_sub(blocks.len() - self.shared(&blocks, blocks.len()));
        Some(blocks)
    }

    /// How many leading blocks of the chain `blocks` (at most `limit`) running requests hold.
    pub fn held_prefix(&self, blocks: &[u64], limit: usize) -> usize {
        self.shared(blocks, limit.min(blocks.len()))
    }

    /// Distinct blocks held.
    pub fn distinct(&self) -> usize {
        self.distinct
    }

    /// Each live lease's blocks.
    pub fn prompts(&self) -> impl Iterator<Item = (LeaseId, &[u64])> {
        self.prompts.iter().map(|(id, b)| (*id, b.as_slice()))
    }

    /// The longest prefix of `blocks`, up to `limit`, that a held prompt shares.
    fn shared(&self, blocks: &[u64], limit: usize) -> usize {
        let mut longest = 0;
        for (_, held) in &self.prompts {
            if longest == limit {
                break;
            }
            longest = longest.max(common_prefix(&blocks[..limit], held));
        }
        longest
    }
}

/// The length of the longest common prefix of two chains: chained hashes agree at a position
/// exactly when they agree on everything before it, so agreement is monotone and a binary search
/// finds where it ends.
fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    if hi == 0 || a[0] != b[0] {
        return 0;
    }
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if a[mid - 1] == b[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn shared_blocks_count_once_until_the_last_holder_ends() {
        let mut h = HeldBlocks::default();
        h.hold(1, vec![1, 2, 3]);
        h.hold(2, vec![1, 2, 4, 5]);
        assert_eq!(h.distinct(), 5);
        assert_eq!(h.release(1), Some(vec![1, 2, 3]));
        assert_eq!(h.distinct(), 4);
        assert_eq!(h.held_prefix(&[1, 2, 4, 7, 8], 5), 3);
        assert_eq!(h.held_prefix(&[1, 2, 4, 7, 8], 2), 2);
        assert_eq!(h.held_prefix(&[6, 7], 2), 0);
        assert_eq!(h.release(9), None);
        h.hold(3, vec![]);
        assert_eq!(h.release(2), Some(vec![1, 2, 4, 5]));
        assert_eq!(h.release(3), Some(vec![]));
        assert_eq!(h.distinct(), 0);
    }

    #[test]
    fn the_same_prompt_twice_counts_once() {
        let mut h = HeldBlocks::default();
        h.hold(1, vec![1, 2, 3]);
        h.hold(2, vec![1, 2, 3]);
        assert_eq!(h.distinct(), 3);
        h.release(1);
        assert_eq!((h.distinct(), h.held_prefix(&[1, 2, 3, 4], 4)), (3, 3));
        h.release(2);
        assert_eq!(h.distinct(), 0);
    }

    /// Per-block reference counts, the straightforward way to count the same thing.
    #[derive(Default)]
    struct Counts(HashMap<u64, u32>);

    impl Counts {
        fn distinct(&self) -> usize {
            self.0.len()
        }

        fn held_prefix(&self, blocks: &[u64], limit: usize) -> usize {
            blocks[..limit.min(blocks.len())]
                .iter()
                .take_while(|b| self.0.contains_key(b))
                .count()
        }
    }

    /// A chain: the first `shared` blocks of family `family`'s, then `own` blocks of its own.
    fn chain(family: u64, shared: usize, seed: u64, own: usize) -> Vec<u64> {
        let text = format!("{:064}", family * 7_919).repeat(30)[..shared * 64].to_string()
            + &format!("{seed:064}").repeat(own);
        crate::prompt::block_hashes(text.as_bytes(), 16)
    }

    proptest! {
        /// Counting by common prefixes agrees with per-block reference counts on chains.
        #[test]
        fn agrees_with_per_block_counts(
            ops in prop::collection::vec(
                (any::<bool>(), 0u64..8, 0u64..3, 0usize..30, 0usize..12),
                1..60,
            ),
        ) {
            let (mut h, mut counts) = (HeldBlocks::default(), Counts::default());
            let mut live: Vec<(LeaseId, Vec<u64>)> = Vec::new();
            for (start, lease, family, shared, own) in ops {
                let blocks = chain(family, shared, lease, own);
                if start && live.iter().all(|(id, _)| *id != lease) {
                    for b in &blocks {
                        *counts.0.entry(*b).or_default() += 1;
                    }
                    h.hold(lease, blocks.clone());
                    live.push((lease, blocks.clone()));
                } else if let Some(i) = live.iter().position(|(id, _)| *id == lease) {
                    let (_, held) = live.swap_remove(i);
                    for b in &held {
                        let n = counts.0.get_mut(b).unwrap();
                        *n -= 1;
                        if *n == 0 {
                            counts.0.remove(b);
                        }
                    }
                    prop_assert_eq!(h.release(lease), Some(held));
                } else {
                    prop_assert_eq!(h.release(lease), None);
                }
                prop_assert_eq!(h.distinct(), counts.distinct());
                for limit in [0, shared, blocks.len()] {
                    let expected = counts.held_prefix(&blocks, limit);
                    prop_assert_eq!(h.held_prefix(&blocks, limit), expected);
                }
            }
        }
    }
}
