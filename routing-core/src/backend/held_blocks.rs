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
//!
//! **Bounded per lease.** A lease does not keep its prompt's whole chain (8 bytes a block: 80 KB
//! for a 160k-token prompt of 16-token blocks, per running request), only a sample of it
//! ([`HeldChain`]): every block of the first 63, then 32 blocks per doubling of the length (the
//! blocks ending at multiples of 2, 4, 8, ... from block 64, 128, 256, ... on): 128 hashes for
//! 256 blocks, 295 (2.4 KB, down from 80 KB) for 10,000 blocks, 512 (4 KB) for 2^20. Prefixes
//! are compared on the sample, so a shared prefix counts rounded down to the last sampled block
//! it covers (exact up to 63 blocks, within 1/32 of its length beyond), the rest of each prompt
//! as its own. Every count uses that same rounding, so what a prompt adds when it starts is what
//! it takes away when it ends: the counts return to zero exactly.

/// Sampled blocks below which every block is kept.
const DENSE: usize = 63;
/// Samples per doubling of the length past [`DENSE`].
const PER_OCTAVE: usize = 32;

/// The position in the chain of the `i`-th sampled block: every block up to [`DENSE`], then the
/// blocks ending at multiples of `2^(o+1)` between `64 * 2^o` and `128 * 2^o` blocks.
fn position(i: usize) -> usize {
    if i < DENSE {
        return i;
    }
    let (octave, within) = ((i - DENSE) / PER_OCTAVE, (i - DENSE) % PER_OCTAVE);
    ((PER_OCTAVE + within) << (octave + 1)) - 1
}

/// How many sampled blocks lie among the first `len` blocks of a chain.
fn samples_below(len: usize) -> usize {
    let mut n = len.min(DENSE);
    let mut octave = 0;
    loop {
        let step = 2usize << octave;
        let first = PER_OCTAVE * step; // the octave's first sampled length (block count)
        if first > len {
            return n;
        }
        n += (len.min(2 * first - 1) / step) - PER_OCTAVE + 1;
        octave += 1;
    }
}

/// The blocks a prefix of `samples` sampled blocks covers, as a length: up to and including the
/// last of them.
fn covered(samples: usize) -> usize {
    if samples == 0 {
        0
    } else {
        position(samples - 1) + 1
    }
}

/// A prompt's chain as a lease keeps it: its length and a bounded sample of its block hashes
/// (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeldChain {
    len: usize,
    samples: Vec<u64>,
}

impl HeldChain {
    /// The sample of the chain `blocks`.
    pub fn of(blocks: &[u64]) -> HeldChain {
        let samples = (0..samples_below(blocks.len()))
            .map(|i| blocks[position(i)])
            .collect();
        HeldChain {
            len: blocks.len(),
            samples,
        }
    }

    /// The chain's length in blocks.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the chain has no block.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sampled hashes kept.
    pub fn samples(&self) -> &[u64] {
        &self.samples
    }
}

impl From<Vec<u64>> for HeldChain {
    fn from(blocks: Vec<u64>) -> HeldChain {
        HeldChain::of(&blocks)
    }
}

/// One live lease's prompt on a backend.
#[derive(Debug, Clone)]
struct Held {
    lease: u64,
    chain: HeldChain,
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
        blocks: impl Into<HeldChain>,
        computed: usize,
        ready_ms: u64,
        now_ms: u64,
    ) {
        let chain = blocks.into();
        let samples = &chain.samples;
        let (shared, computed_shared) =
            self.scan(|i| samples[i], samples.len(), usize::MAX, now_ms);
        let really = computed_shared.max(computed.min(chain.len));
        let copies = shared.saturating_sub(really);
        self.distinct += chain.len - shared;
        self.copies += copies;
        self.prompts.push(Held {
            lease,
            chain,
            computed,
            ready_ms,
            copies,
        });
    }

    /// Lease `lease` ended: its chain, or `None` if it held none here.
    pub fn release(&mut self, lease: u64) -> Option<HeldChain> {
        let i = self.prompts.iter().position(|h| h.lease == lease)?;
        let held = self.prompts.swap_remove(i);
        let samples = &held.chain.samples;
        let (shared, _) = self.scan(|i| samples[i], samples.len(), usize::MAX, u64::MAX);
        // Saturating: only a list that is not a chain could make the counts disagree.
        self.distinct = self.distinct.saturating_sub(held.chain.len - shared);
        self.copies = self.copies.saturating_sub(held.copies);
        Some(held.chain)
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
    /// cached when it started), in one pass over the held prompts. Rounded down to the sample
    /// grid (see the module documentation).
    pub fn prefixes(&self, blocks: &[u64], limit: usize, now_ms: u64) -> (usize, usize) {
        let n = samples_below(limit.min(blocks.len()));
        self.scan(|i| blocks[position(i)], n, limit, now_ms)
    }

    /// [`Self::prefixes`] of the chain whose `i`-th sampled block is `sample(i)`, `n` samples
    /// long, counted to at most `limit` blocks.
    fn scan(
        &self,
        sample: impl Fn(usize) -> u64,
        n: usize,
        limit: usize,
        now_ms: u64,
    ) -> (usize, usize) {
        let whole = covered(n).min(limit);
        let (mut held, mut computed) = (0, 0);
        for h in &self.prompts {
            if computed == whole {
                break;
            }
            let common = covered(common_prefix(&sample, n, &h.chain.samples)).min(limit);
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

    /// Each live lease's sampled blocks.
    pub fn prompts(&self) -> impl Iterator<Item = (u64, &[u64])> {
        self.prompts
            .iter()
            .map(|h| (h.lease, h.chain.samples.as_slice()))
    }

    /// [`Self::distinct`] counted again from the held chains (for checks): each stretch of the
    /// sample grid a prompt covers counts once however many prompts share it, the rest of each
    /// prompt as its own.
    pub fn recount(&self) -> usize {
        let mut stretches = std::collections::HashSet::new();
        let mut own = 0;
        for h in &self.prompts {
            for (i, &block) in h.chain.samples.iter().enumerate() {
                stretches.insert((i, block));
            }
            own += h.chain.len - covered(h.chain.samples.len());
        }
        let shared: usize = stretches
            .iter()
            .map(|&(i, _)| covered(i + 1) - covered(i))
            .sum();
        shared + own
    }
}

/// The length of the longest common prefix of a chain's first `n` samples (`sample(i)`) and the
/// samples `b`, in samples: chained hashes agree at a position exactly when they agree on
/// everything before it, so agreement is monotone and a binary search finds where it ends.
fn common_prefix(sample: &impl Fn(usize) -> u64, n: usize, b: &[u64]) -> usize {
    let (mut lo, mut hi) = (0, n.min(b.len()));
    if hi == 0 || sample(0) != b[0] {
        return 0;
    }
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if sample(mid - 1) == b[mid - 1] {
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
        assert_eq!(h.release(1), Some(HeldChain::of(&[1, 2, 3])));
        assert_eq!(h.distinct(), 4);
        assert_eq!(h.prefixes(&[1, 2, 4, 7, 8], 5, 0).0, 3);
        assert_eq!(h.prefixes(&[1, 2, 4, 7, 8], 2, 0).0, 2);
        assert_eq!(h.prefixes(&[6, 7], 2, 0).0, 0);
        assert_eq!(h.release(9), None);
        h.hold(3, vec![], 0, 0, 0);
        assert_eq!(h.release(2), Some(HeldChain::of(&[1, 2, 4, 5])));
        assert_eq!(h.release(3), Some(HeldChain::of(&[])));
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
        assert_eq!(h.release(3), Some(HeldChain::of(&[1, 2, 3, 8])));
        assert_eq!(h.release(1), Some(HeldChain::of(&[1, 2, 3])));
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

    /// Issue 42, "still open" (d): a lease used to keep its prompt's whole chain of block hashes
    /// (8 bytes a block: 80 KB for a 160k-token prompt of 16-token blocks, per running request).
    /// It keeps a bounded sample of it now: the first 63 blocks, then 32 per doubling of the
    /// length (295 hashes, 2.4 KB, for 10,000 blocks; 4 KB for 2^20 blocks), and the counts
    /// stay exact to the sample grid and consistent from hold to release.
    #[test]
    fn a_long_prompt_keeps_a_bounded_sample_of_its_chain() {
        // Two chains that agree on their first 6,000 blocks and never again.
        let long: Vec<u64> = (0..10_000).map(|i| 1_000_000 + i).collect();
        let mut other = long[..6_000].to_vec();
        other.extend((0..100).map(|i| 9_000_000 + i));
        let mut h = HeldBlocks::default();
        h.hold(1, long.clone(), 0, 0, 0);
        h.hold(2, other.clone(), 0, 0, 0);
        assert_eq!(HeldChain::of(&long).samples().len(), 295);
        let kept: usize = h.prompts().map(|(_, b)| b.len()).max().unwrap();
        assert!(kept <= 300, "a lease keeps {kept} hashes");
        let bytes = kept * std::mem::size_of::<u64>();
        assert!(bytes < 2_400, "{bytes} bytes per lease, was 80,000");
        // The 6,000 shared blocks count once, to within the grid (1/32 of the length).
        let exact = 10_000 + 100;
        assert!(
            h.distinct() >= exact && h.distinct() <= exact + 6_000 / 32,
            "{}",
            h.distinct()
        );
        // What another request finds held of the shared prefix, rounded down to the grid.
        let (held, _) = h.prefixes(&long, long.len(), 0);
        assert!((10_000 - 10_000 / 32..=10_000).contains(&held), "{held}");
        let (held, _) = h.prefixes(&other, other.len(), 0);
        assert!((6_100 - 6_100 / 32..=6_100).contains(&held), "{held}");
        assert!(h.release(1).is_some());
        assert_eq!(h.distinct(), 6_100);
        assert!(h.release(2).is_some());
        assert_eq!((h.distinct(), h.in_use()), (0, 0));
    }

    /// Per-block reference counts, the straightforward way to count the same thing.
    #[derive(Default)]
    struct Counts(HashMap<u64, u32>);

    impl Counts {
        /// A lease holds `blocks`: one more reference to each.
        fn add(&mut self, blocks: &[u64]) {
            for b in blocks {
                *self.0.entry(*b).or_default() += 1;
            }
        }

        /// A lease releases `blocks`: one reference fewer to each, forgotten at zero.
        fn remove(&mut self, blocks: &[u64]) {
            for b in blocks {
                let n = self.0.get_mut(b).unwrap();
                *n -= 1;
                if *n == 0 {
                    self.0.remove(b);
                }
            }
        }

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
                    counts.add(&blocks);
                    h.hold(lease, blocks.clone(), 0, 0, 0);
                    live.push((lease, blocks.clone()));
                } else if let Some(i) = live.iter().position(|(id, _)| *id == lease) {
                    let (_, held) = live.swap_remove(i);
                    counts.remove(&held);
                    prop_assert_eq!(h.release(lease), Some(HeldChain::of(&held)));
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

        /// Long chains, sampled: the count never falls below the exact one, exceeds it by at
        /// most 1/32 of the blocks held, matches a recount, and returns to zero.
        #[test]
        fn long_chains_count_within_the_grid_and_return_to_zero(
            ops in prop::collection::vec(
                (any::<bool>(), 0u64..6, 0u64..3, 0usize..3_000, 0usize..400),
                1..40,
            ),
        ) {
            // A family's shared prefix, then blocks of the chain's own.
            let long_chain = |family: u64, shared: usize, seed: u64, own: usize| -> Vec<u64> {
                let own_base = (1 << 60) + (family << 50) + ((shared as u64) << 30) + (seed << 20);
                (0..shared as u64)
                    .map(|i| (family << 40) + i)
                    .chain((0..own as u64).map(|i| own_base + i))
                    .collect()
            };
            let (mut h, mut counts) = (HeldBlocks::default(), Counts::default());
            let mut live: Vec<(u64, Vec<u64>)> = Vec::new();
            for (start, lease, family, shared, own) in ops {
                let blocks = long_chain(family, shared, lease, own);
                if start && live.iter().all(|(id, _)| *id != lease) {
                    counts.add(&blocks);
                    h.hold(lease, blocks.clone(), 0, 0, 0);
                    live.push((lease, blocks));
                } else if let Some(i) = live.iter().position(|(id, _)| *id == lease) {
                    let (_, held) = live.swap_remove(i);
                    counts.remove(&held);
                    prop_assert_eq!(h.release(lease).map(|c| c.len()), Some(held.len()));
                }
                let total: usize = live.iter().map(|(_, b)| b.len()).sum();
                prop_assert_eq!(h.distinct(), h.recount());
                prop_assert!(h.distinct() >= counts.distinct());
                prop_assert!(h.distinct() <= counts.distinct() + total / 32);
                prop_assert!(h.prompts().all(|(_, b)| b.len() <= 63 + 32 * 6));
            }
            for (lease, _) in live {
                prop_assert!(h.release(lease).is_some());
            }
            prop_assert_eq!((h.distinct(), h.in_use()), (0, 0));
        }
    }
}
