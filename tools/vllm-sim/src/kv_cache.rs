//! The simulated GPU KV cache: chained block hashes and a block pool with reference counts and an
//! LRU of cached blocks, modelled on vLLM V1's `BlockPool` / `KVCacheManager`.
//!
//! **Block hashes.** A sequence's bytes are cut into full blocks of `block_size` tokens, i.e.
//! `block_size * 4` bytes (see [`crate::tokenizer`]); a trailing partial block has no hash. Block `i`'s
//! hash is `xxh3_64(prev_hash as 8 little-endian bytes || block bytes)`, with `prev_hash = 0` for the
//! first block, so a hash names the whole prefix up to the end of its block. The gateway computes the
//! same hashes from the same bytes. A request with a `cache_salt` or for a LoRA adapter starts its
//! chain from [`root_hash`] of those instead of 0, so the same prompt under another salt or adapter
//! shares no block (vLLM 0.34 puts both in the first block's extra keys:
//! `vllm/v1/core/kv_cache_utils.py`, `_gen_lora_extra_hash_keys` and `cache_salt_keys`).
//!
//! **Pool.** `num_blocks` blocks, each referenced by the running sequences that hold it. A block whose
//! tokens have been computed is registered under its hash and stays cached after its sequences
//! release it. Unreferenced blocks wait in a free queue, least recently used first: allocation takes
//! the head and, if that block was cached, evicts its hash. A cache hit on an unreferenced block takes
//! it out of the queue. Released blocks join the tail in reverse order (a sequence's last blocks are
//! the least likely to be shared, so they go first), and blocks that were never cached join the head.
//! Blocks in use are never evicted.

use std::collections::HashMap;

use xxhash_rust::xxh3::Xxh3;

use crate::tokenizer::BYTES_PER_TOKEN;

/// Hash of a full block and everything before it.
pub type BlockHash = u64;

/// Index of a block in the pool (vLLM's block id).
pub type BlockId = u32;

/// `prev_hash` of a sequence's first block.
pub const ROOT_HASH: BlockHash = 0;

/// The hash of one full block following the block hashed `prev`.
pub fn chain_hash(prev: BlockHash, block: &[u8]) -> BlockHash {
    let mut hasher = Xxh3::new();
    hasher.update(&prev.to_le_bytes());
    hasher.update(block);
    hasher.digest()
}

/// `prev_hash` of the first block of a request for LoRA adapter `lora` with `cache_salt` (either may
/// be absent): [`ROOT_HASH`] when both are, else `xxh3_64` of `"vllm-sim-root"`, then for each of
/// the adapter name and the salt (absent as empty) its length as 8 little-endian bytes and its UTF-8.
pub fn root_hash(lora: Option<&str>, cache_salt: Option<&str>) -> BlockHash {
    if lora.is_none() && cache_salt.is_none() {
        return ROOT_HASH;
    }
    let mut hasher = Xxh3::new();
    hasher.update(b"vllm-sim-root");
    for part in [lora.unwrap_or(""), cache_salt.unwrap_or("")] {
        hasher.update(&(part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.digest()
}

/// Extends `hashes` with the hashes of every full block of `bytes` not yet hashed.
pub fn extend_block_hashes(hashes: &mut Vec<BlockHash>, bytes: &[u8], block_size: u32) {
    extend_block_hashes_from(ROOT_HASH, hashes, bytes, block_size);
}

/// [`extend_block_hashes`] for a chain that starts from `root` (see [`root_hash`]).
pub fn extend_block_hashes_from(
    root: BlockHash,
    hashes: &mut Vec<BlockHash>,
    bytes: &[u8],
    block_size: u32,
) {
    let block_bytes = block_size as usize * BYTES_PER_TOKEN;
    if block_bytes == 0 {
        return;
    }
    let full_blocks = bytes.len() / block_bytes;
    while hashes.len() < full_blocks {
        let i = hashes.len();
        let prev = hashes.last().copied().unwrap_or(root);
        hashes.push(chain_hash(
            prev,
            &bytes[i * block_bytes..(i + 1) * block_bytes],
        ));
    }
}

/// The chained hashes of every full block of `bytes`.
pub fn block_hashes(bytes: &[u8], block_size: u32) -> Vec<BlockHash> {
    block_hashes_from(ROOT_HASH, bytes, block_size)
}

/// The chained hashes of every full block of `bytes`, starting from `root` (see [`root_hash`]).
pub fn block_hashes_from(root: BlockHash, bytes: &[u8], block_size: u32) -> Vec<BlockHash> {
    let mut hashes = Vec::new();
    extend_block_hashes_from(root, &mut hashes, bytes, block_size);
    hashes
}

const NIL: BlockId = BlockId::MAX;

/// Bookkeeping of one block.
#[derive(Debug, Clone)]
struct Block {
    /// The hash it is cached under, if its tokens were computed and registered.
    hash: Option<BlockHash>,
    /// Running sequences holding it.
    ref_count: u32,
    /// Neighbours in the free queue (NIL at the ends or when not queued).
    prev: BlockId,
    next: BlockId,
    queued: bool,
}

/// The KV cache's blocks: who holds them, which are cached, and which are free (LRU order).
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    cached: HashMap<BlockHash, BlockId>,
    head: BlockId,
    tail: BlockId,
    free_len: usize,
    evictions: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` free, empty blocks.
    pub fn new(num_blocks: u32) -> Self {
        let mut pool = BlockPool {
            blocks: vec![
                Block {
                    hash: None,
                    ref_count: 0,
                    prev: NIL,
                    next: NIL,
                    queued: false
                };
                num_blocks as usize
            ],
            cached: HashMap::new(),
            head: NIL,
            tail: NIL,
            free_len: 0,
            evictions: 0,
        };
        for id in 0..num_blocks {
            pool.push_tail(id);
        }
        pool
    }

    /// Blocks no running sequence holds (cached or empty): what allocation can use.
    pub fn num_free(&self) -> usize {
        self.free_len
    }

    /// Blocks currently registered under a hash.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Cached blocks evicted so far to make room.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Fraction of blocks held by running sequences, as vLLM's `kv_cache_usage_perc` (0.0 to 1.0).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free_len as f64 / self.blocks.len() as f64
    }

    /// The blocks caching the longest run of leading `hashes` (stops at the first miss).
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// Whether `new_blocks` fresh blocks can be allocated after taking the `hits` out of the free queue.
    pub fn can_allocate(&self, hits: &[BlockId], new_blocks: usize) -> bool {
        let hits_in_queue = hits.iter().filter(|&&id| self.is_queued(id)).count();
        new_blocks <= self.free_len.saturating_sub(hits_in_queue)
    }

    /// Adds a reference to each block (cache hits), taking unreferenced ones out of the free queue.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if self.is_queued(id) {
                self.unlink(id);
            }
            if let Some(block) = self.blocks.get_mut(id as usize) {
                block.ref_count += 1;
            }
        }
    }

    /// Takes `n` blocks from the head of the free queue, evicting their cached hashes; `None` (and no
    /// change) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free_len {
            return None;
        }
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let block = &mut self.blocks[id as usize];
            if let Some(hash) = block.hash.take() {
                if self.cached.get(&hash) == Some(&id) {
                    self.cached.remove(&hash);
                }
                self.evictions += 1;
            }
            block.ref_count = 1;
            ids.push(id);
        }
        Some(ids)
    }

    /// Registers a held block whose tokens are now computed under `hash`, so later prompts can hit it.
    /// Returns false (and leaves the block uncached) when another block already caches that hash.
    pub fn register(&mut self, id: BlockId, hash: BlockHash) -> bool {
        if self.cached.contains_key(&hash) {
            return false;
        }
        let Some(block) = self.blocks.get_mut(id as usize) else {
            return false;
        };
        if block.hash.is_some() {
            return false;
        }
        block.hash = Some(hash);
        self.cached.insert(hash, id);
        true
    }

    /// Drops one reference to each of a sequence's blocks (given in sequence order); blocks left
    /// unreferenced join the free queue: cached ones at the tail, last block first; others at the head.
    pub fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let Some(block) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            if block.ref_count == 0 {
                continue;
            }
            block.ref_count -= 1;
            if block.ref_count == 0 {
                if block.hash.is_some() {
                    self.push_tail(id);
                } else {
                    self.push_head(id);
                }
            }
        }
    }

    fn is_queued(&self, id: BlockId) -> bool {
        self.blocks.get(id as usize).is_some_and(|b| b.queued)
    }

    fn push_tail(&mut self, id: BlockId) {
        let tail = self.tail;
        {
            let block = &mut self.blocks[id as usize];
            block.prev = tail;
            block.next = NIL;
            block.queued = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.free_len += 1;
    }

    fn push_head(&mut self, id: BlockId) {
        let head = self.head;
        {
            let block = &mut self.blocks[id as usize];
            block.prev = NIL;
            block.next = head;
            block.queued = true;
        }
        if head == NIL {
            self.tail = id;
        } else {
            self.blocks[head as usize].prev = id;
        }
        self.head = id;
        self.free_len += 1;
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let block = &mut self.blocks[id as usize];
            let links = (block.prev, block.next);
            block.prev = NIL;
            block.next = NIL;
            block.queued = false;
            links
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.free_len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allocates blocks for `hashes`, registers them and releases them, like a finished sequence.
    fn cache_sequence(pool: &mut BlockPool, hashes: &[BlockHash]) -> Vec<BlockId> {
        let ids = pool.allocate(hashes.len()).expect("room");
        for (&id, &h) in ids.iter().zip(hashes) {
            pool.register(id, h);
        }
        pool.release(&ids);
        ids
    }

    #[test]
    fn hashes_are_chained_over_full_blocks_only() {
        let bytes = vec![b'a'; 16 * 4 * 2 + 5];
        let hashes = block_hashes(&bytes, 16);
        assert_eq!(hashes.len(), 2);
        assert_eq!(hashes[0], chain_hash(ROOT_HASH, &bytes[..64]));
        assert_eq!(hashes[1], chain_hash(hashes[0], &bytes[64..128]));
        // Same block bytes, different prefix: different hash.
        assert_ne!(hashes[0], hashes[1]);
        // The documented byte layout: prev hash as 8 LE bytes, then the block.
        let mut manual = ROOT_HASH.to_le_bytes().to_vec();
        manual.extend_from_slice(&bytes[..64]);
        assert_eq!(hashes[0], xxhash_rust::xxh3::xxh3_64(&manual));
    }

    #[test]
    fn extending_hashes_matches_hashing_at_once() {
        let bytes: Vec<u8> = (0..500u32).map(|i| (i % 251) as u8).collect();
        let mut hashes = block_hashes(&bytes[..100], 4);
        extend_block_hashes(&mut hashes, &bytes, 4);
        assert_eq!(hashes, block_hashes(&bytes, 4));
    }

    #[test]
    fn cached_blocks_survive_release_and_are_hit() {
        let mut pool = BlockPool::new(8);
        let ids = cache_sequence(&mut pool, &[11, 12, 13]);
        assert_eq!(pool.num_free(), 8);
        assert_eq!(pool.num_cached(), 3);
        assert_eq!(pool.cached_prefix(&[11, 12, 99, 13]), ids[..2].to_vec());
        assert_eq!(pool.cached_prefix(&[99, 11]), Vec::<BlockId>::new());
        pool.touch(&ids[..2]);
        assert_eq!(pool.num_free(), 6);
        assert!((pool.usage() - 0.25).abs() < 1e-9);
    }

    #[test]
    fn evicts_least_recently_used_cached_blocks_first() {
        let mut pool = BlockPool::new(4);
        cache_sequence(&mut pool, &[1, 2]);
        cache_sequence(&mut pool, &[3, 4]);
        assert_eq!(pool.num_cached(), 4);
        // Touch-and-release [1] makes it most recent.
        let hit = pool.cached_prefix(&[1]);
        pool.touch(&hit);
        pool.release(&hit);
        // Two new blocks evict the two least recent: 2 (released before 1 originally) then 4.
        let fresh = pool.allocate(2).unwrap();
        assert_eq!(pool.evictions(), 2);
        assert_eq!(pool.num_cached(), 2);
        assert_eq!(pool.cached_prefix(&[1]).len(), 1);
        assert_eq!(pool.cached_prefix(&[3]).len(), 1);
        assert!(pool.cached_prefix(&[2]).is_empty());
        pool.release(&fresh);
    }

    #[test]
    fn blocks_in_use_are_never_evicted() {
        let mut pool = BlockPool::new(3);
        let held = pool.allocate(2).unwrap();
        pool.register(held[0], 7);
        assert!(pool.allocate(2).is_none());
        let last = pool.allocate(1).unwrap();
        assert!(pool.allocate(1).is_none());
        assert_eq!(pool.cached_prefix(&[7]), vec![held[0]]);
        assert!((pool.usage() - 1.0).abs() < 1e-9);
        pool.release(&last);
        pool.release(&held);
        assert_eq!(pool.num_free(), 3);
    }

    #[test]
    fn hits_in_the_free_queue_do_not_count_as_free_room() {
        let mut pool = BlockPool::new(2);
        let ids = cache_sequence(&mut pool, &[5, 6]);
        assert!(pool.can_allocate(&[], 2));
        assert!(!pool.can_allocate(&ids, 1));
        assert!(pool.can_allocate(&ids[..1], 1));
    }

    #[test]
    fn uncached_blocks_are_reused_before_cached_ones() {
        let mut pool = BlockPool::new(3);
        cache_sequence(&mut pool, &[1]);
        let scratch = pool.allocate(1).unwrap();
        pool.release(&scratch);
        let next = pool.allocate(1).unwrap();
        assert_eq!(next, scratch);
        assert_eq!(pool.evictions(), 0);
    }

    #[test]
    fn a_duplicate_hash_stays_uncached() {
        let mut pool = BlockPool::new(2);
        let ids = pool.allocate(2).unwrap();
        assert!(pool.register(ids[0], 9));
        assert!(!pool.register(ids[1], 9));
        pool.release(&ids);
        assert_eq!(pool.num_cached(), 1);
    }
}
