//! The KV blocks a backend's running requests hold, counted once however many requests share them.
//!
//! A backend's memory is not the sum of its requests' prompts: a system prompt behind every
//! conversation is held once, and a conversation's history, cached from its last turn, is held
//! again while its next turn runs. The pool therefore keeps, per backend, the prompt blocks of each
//! live lease, and the number of distinct blocks among them is the backend's memory in use by the
//! gateway's requests (their output tokens come on top).
//!
//! Prompts are chains of block hashes (a block's hash names its whole prefix, see
//! [`crate::request::prompt`]), so the blocks held form a tree of prefixes, and two prompts share
//! exactly their longest common prefix, which a binary search finds. A prompt starting adds its
//! length minus the longest prefix it shares with a prompt already held; one ending takes away its
//! length minus the longest prefix it shares with those still held. Either costs a binary search
//! per running request on the backend (one comparison for an unrelated prompt), not a hash-map
//! update per block.
//!
//! A prefix is shared only once it is computed: vLLM enters a block into its prefix cache when the
//! block's tokens have been computed, so requests admitted while the first request behind a new
//! prefix is still waiting for or running its prefill each compute, and hold, their own copy. Each
//! held prompt therefore also carries how much of it was computed when it started (its cache hit)
//! and from when later requests find the rest computed (its prefill under way, as the time model
//! predicts it: [`crate::backend::time_model::SharePrediction::start_ms`]); before then,
//! only that computed part is shared with later requests ([`HeldBlocks::prefixes`]), and a
//! request starting meanwhile counts the rest of what it shares as copies of its own
//! ([`HeldBlocks::in_use`]).

/// One live lease's prompt on a backend.
#[derive(Debug, Clone)]
struct Held {
    lease: u64,
    blocks: Vec<u64>,
    /// Leading blocks already computed when it started (its cache hit there).
    computed: usize,
    /// From when a request admitted after it finds all of its blocks computed (pool time, ms).
    ready_ms: u64,
    /// Blocks it shares with prompts held before it but holds as its own copy, since they were
    /// not computed yet when it started.
    copies: usize,
}

/// The prompt blocks live leases hold on one backend, each prompt under its lease's id (the pool's
/// `LeaseId`, a `u64`).
#[derive(Debug, Clone, Default)]
pub struct HeldBlocks {
    prompts: Vec<Held>,
    distinct: usize,
    copies: usize,
}

impl HeldBlocks {
    /// Lease `lease` started holding the chain `blocks`, of which the first `computed` were
    /// computed already; requests admitted from `ready_ms` on find the rest computed too.
    pub fn hold(
        &mut self,
        lease: u64,
        blocks: Vec<u64>,
        computed: usize,
        ready_ms: u64,
        now_ms: u64,
    ) {
        let (shared, computed_shared) = self.prefixes(&blocks, blocks.len(), now_ms);
        let really = computed_shared.max(computed.min(blocks.len()));
        let copies = shared.saturating_sub(really);
        self.distinct += blocks.len() - shared;
        self.copies += copies;
        self.prompts.push(Held {
            lease,
            blocks,
            computed,
            ready_ms,
            copies,
        });
    }

    /// Lease `lease` ended: its blocks, or `None` if it held none here.
    pub fn release(&mut self, lease: u64) -> Option<Vec<u64>> {
        let i = self.prompts.iter().position(|h| h.lease == lease)?;
        let held = self.prompts.swap_remove(i);
        // Saturating: only a list that is not a chain could make the counts disagree.
        self.distinct = self
            .distinct
            .saturating_sub(held.blocks.len() - self.held_prefix(&held.blocks));
        self.copies = self.copies.saturating_sub(held.copies);
        Some(held.blocks)
    }

    /// How many leading blocks of lease `lease`'s prompt were cached here when it started.
    pub fn cached_of(&self, lease: u64) -> Option<usize> {
        self.prompts
            .iter()
            .find(|h| h.lease == lease)
            .map(|h| h.computed)
    }

    /// How many leading blocks of the chain `blocks` (at most `limit`) running requests hold, and
    /// how many of those they have computed by `now_ms` as far as the gateway can tell (a
    /// prompt's whole chain once its prefill should be under way, before that only what was
    /// cached when it started), in one pass over the held prompts.
    pub fn prefixes(&self, blocks: &[u64], limit: usize, now_ms: u64) -> (usize, usize) {
        let limit = limit.min(blocks.len());
        let (mut held, mut computed) = (0, 0);
        for h in &self.prompts {
            if computed == limit {
                break;
            }
            let common = common_prefix(&blocks[..limit], &h.blocks);
            held = held.max(common);
            computed = computed.max(if h.ready_ms > now_ms {
                common.min(h.computed)
            } else {
                common
            });
        }
        (held.max(computed), computed)
    }

    /// Distinct blocks held, counting a shared prefix once.
    pub fn distinct(&self) -> usize {
        self.distinct
    }

    /// Blocks in use: the distinct blocks plus the copies requests hold of prefixes that were
    /// not computed when they started.
    pub fn in_use(&self) -> usize {
        self.distinct + self.copies
    }

    /// Each live lease's blocks.
    pub fn prompts(&self) -> impl Iterator<Item = (u64, &[u64])> {
        self.prompts.iter().map(|h| (h.lease, h.blocks.as_slice()))
    }

    /// The longest prefix of the chain `blocks` that a held prompt shares, computed or not.
    fn held_prefix(&self, blocks: &[u64]) -> usize {
        self.prefixes(blocks, blocks.len(), u64::MAX).0
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
        h.hold(1, vec![1, 2, 3], 0, 0, 0);
        h.hold(2, vec![1, 2, 4, 5], 0, 0, 0);
        assert_eq!(h.distinct(), 5);
        assert_eq!(h.release(1), Some(vec![1, 2, 3]));
        assert_eq!(h.distinct(), 4);
        assert_eq!(h.prefixes(&[1, 2, 4, 7, 8], 5, 0).0, 3);
        assert_eq!(h.prefixes(&[1, 2, 4, 7, 8], 2, 0).0, 2);
        assert_eq!(h.prefixes(&[6, 7], 2, 0).0, 0);
        assert_eq!(h.release(9), None);
        h.hold(3, vec![], 0, 0, 0);
        assert_eq!(h.release(2), Some(vec![1, 2, 4, 5]));
        assert_eq!(h.release(3), Some(vec![]));
        assert_eq!(h.distinct(), 0);
    }

    #[test]
    fn the_same_prompt_twice_counts_once() {
        let mut h = HeldBlocks::default();
        h.hold(1, vec![1, 2, 3], 0, 0, 0);
        h.hold(2, vec![1, 2, 3], 0, 0, 0);
        assert_eq!(h.distinct(), 3);
        h.release(1);
        assert_eq!((h.distinct(), h.prefixes(&[1, 2, 3, 4], 4, 0).0), (3, 3));
        h.release(2);
        assert_eq!(h.distinct(), 0);
    }

    #[test]
    fn a_prefix_is_shared_once_computed() {
        let mut h = HeldBlocks::default();
        // A new prefix [1, 2, 3], nothing cached, prefill done at 100 ms.
        h.hold(1, vec![1, 2, 3], 0, 100, 0);
        assert_eq!(
            (
                h.prefixes(&[1, 2, 3, 9], 4, 0).0,
                h.prefixes(&[1, 2, 3, 9], 4, 50).1
            ),
            (3, 0)
        );
        // A request starting at 50 ms behind the same prefix computes and holds its own copy.
        h.hold(2, vec![1, 2, 3, 9], 0, 150, 50);
        assert_eq!((h.distinct(), h.in_use()), (4, 7));
        // One starting at 120 ms shares it.
        assert_eq!(h.prefixes(&[1, 2, 3, 8], 4, 120).1, 3);
        h.hold(3, vec![1, 2, 3, 8], 3, 130, 120);
        assert_eq!((h.distinct(), h.in_use()), (5, 8));
        // What was cached when a prompt started is shared at once: [1, 2] was a hit for lease 4,
        // its block 7 is shared only once its prefill is done.
        h.hold(4, vec![1, 2, 7], 2, 500, 130);
        assert_eq!(h.prefixes(&[1, 2, 7, 6], 4, 140).1, 2);
        assert_eq!(h.prefixes(&[1, 2, 7, 6], 4, 600).1, 3);
        assert_eq!(h.release(3), Some(vec![1, 2, 3, 8]));
        assert_eq!(h.release(1), Some(vec![1, 2, 3]));
        assert_eq!(
            h.prefixes(&[1, 2, 3, 6], 4, 140).1,
            2,
            "lease 2's copy is not done"
        );
        assert_eq!(h.prefixes(&[1, 2, 3, 6], 4, 160).1, 3);
        assert_eq!(h.prefixes(&[1, 2, 3, 6], 4, 140), (3, 2));
        assert_eq!(h.prefixes(&[1, 2, 3, 6], 1, 140), (1, 1));
        h.release(2);
        h.release(4);
        assert_eq!((h.distinct(), h.in_use()), (0, 0));
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
        crate::request::prompt::block_hashes(text.as_bytes(), 16)
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
            let mut live: Vec<(u64, Vec<u64>)> = Vec::new();
            for (start, lease, family, shared, own) in ops {
                let blocks = chain(family, shared, lease, own);
                if start && live.iter().all(|(id, _)| *id != lease) {
                    for b in &blocks {
                        *counts.0.entry(*b).or_default() += 1;
                    }
                    h.hold(lease, blocks.clone(), 0, 0, 0);
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
                    prop_assert_eq!(h.prefixes(&blocks, limit, 0), (expected, expected));
                }
            }
        }
    }
}
