//! Prefix affinity: which backend probably holds which prefix blocks in its KV cache.
//!
//! Every routed request records its chained block hashes (see [`crate::request::prompt`]) on the
//! backend it went to. Each backend has its own LRU (approximate: an entry already among the newest
//! quarter of its list is not moved again) bounded by its KV capacity in blocks, since that is
//! roughly what vLLM can keep; the whole table has a global bound on entries, evicting the least
//! recently used entry of any backend; removing a backend purges its entries.
//!
//! An entry stands for a chunk of up to [`CHUNK_BLOCKS`] consecutive blocks of a prompt, chunks
//! being aligned on the prompt's start: it is keyed by the chunk's first block hash and carries a
//! 16-bit fingerprint of each following block of the chunk. Chained hashes make that enough: the
//! first block's hash names the whole prefix before it, and the fingerprints tell how far into the
//! chunk a request agrees with the prompt recorded. Where a later prompt parts from an entry inside
//! its chunk (conversations behind one system prompt that ends mid-chunk), the rest of its chunk
//! gets an entry of its own, keyed by the block where it parts. A request therefore costs about
//! one lookup per chunk, to record or to match, instead of one per block, and an entry covers up
//! to sixteen blocks in 64 bytes. What it gives up: a fingerprint matches a different block one
//! time in 65,536 (a match one block too long), and the blocks of an entry are used together (a
//! request that touches an entry refreshes all of it). A backend's block bound is kept to the
//! block: the oldest entry loses its last blocks first, as vLLM's LRU would evict them.
//!
//! The layout is chosen for memory: a slab of 64-byte entries threaded on two intrusive
//! doubly-linked LRU lists (the backend's and the global one), and an open-addressing index of
//! slab positions keyed by the entry's first block hash, each with 32 bits of that hash (so that a
//! probe reads only the entries it may want), with linear probing, load factor at most 1/2 and
//! backward-shift deletion. The same chunk held by several backends is several entries under one
//! hash, so a lookup visits each holder once, and the longest cached prefix of a request on every
//! backend is found in time linear in its chunk count.

mod slab;

const NIL: u32 = u32::MAX;
const MIN_TABLE: usize = 1024;

/// An index slot: an entry's slab position and 32 bits of its key, which give its home position
/// and rule out most other keys, so probing and deleting rarely read an entry they do not want.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    idx: u32,
    tag: u32,
}

impl Slot {
    const EMPTY: Slot = Slot { idx: NIL, tag: 0 };
}

/// The index tag of a key (its home position is the tag's low bits).
fn tag(block: u64) -> u32 {
    (block ^ (block >> 32)) as u32
}

/// Blocks one entry stands for at most: the chunk's first block and this many minus one after it.
pub const CHUNK_BLOCKS: usize = 16;
const TAIL: usize = CHUNK_BLOCKS - 1;

/// A chunk's blocks after its first, as fingerprints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Tail {
    prints: [u16; TAIL],
    len: u8,
}

impl Tail {
    /// The fingerprints of `blocks` (at most [`TAIL`] of them).
    fn of(blocks: &[u64]) -> Tail {
        let mut tail = Tail::default();
        for (print, &block) in tail.prints.iter_mut().zip(blocks) {
            *print = fingerprint(block);
        }
        tail.len = blocks.len().min(TAIL) as u8;
        tail
    }

    /// How many leading blocks of `blocks` agree with this tail.
    fn agreeing(&self, blocks: &[u64]) -> usize {
        self.prints[..self.len as usize]
            .iter()
            .zip(blocks)
            .take_while(|(&print, &block)| print == fingerprint(block))
            .count()
    }

    /// Whether this tail says nothing `other` does not (it is a prefix of it).
    fn within(&self, other: &Tail) -> bool {
        self.len <= other.len
            && self.prints[..self.len as usize] == other.prints[..self.len as usize]
    }
}

/// 16 bits of a block hash (its top ones; the index's home position uses the low ones).
fn fingerprint(block: u64) -> u16 {
    (block >> 48) as u16
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The hash of its first block: the chunk's first, or the one where it parts from the entry
    /// keyed by that.
    block: u64,
    backend: u32,
    /// Per-backend LRU neighbours (prev is more recent); `next` doubles as the free-list link.
    prev: u32,
    next: u32,
    /// Global LRU neighbours.
    gprev: u32,
    gnext: u32,
    /// The backend's link clock when this entry was last moved to the front.
    stamp: u32,
    /// The blocks after the first, to the chunk's end at most.
    tail: Tail,
}

impl Entry {
    /// Blocks the entry stands for.
    fn blocks(&self) -> u64 {
        1 + u64::from(self.tail.len)
    }
}

#[derive(Debug, Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
    len: u64,
}

impl List {
    const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

#[derive(Debug, Clone, Copy)]
struct BackendLru {
    list: List,
    /// Blocks its entries stand for, and the bound on them.
    blocks: u64,
    capacity: u64,
    /// Counts moves to the front of this backend's list.
    clock: u32,
}

/// The prefix-affinity table.
#[derive(Debug, Clone)]
pub struct PrefixAffinity {
    entries: Vec<Entry>,
    free: u32,
    table: Vec<Slot>,
    global: List,
    backends: Vec<BackendLru>,
    max_entries: usize,
    evictions: u64,
}

impl PrefixAffinity {
    /// An empty table holding at most `max_entries` entries (chunks of a backend) in total.
    pub fn new(max_entries: usize) -> Self {
        PrefixAffinity {
            entries: Vec::new(),
            free: NIL,
            table: vec![Slot::EMPTY; MIN_TABLE],
            global: List::EMPTY,
            backends: Vec::new(),
            max_entries,
            evictions: 0,
        }
    }

    /// Entries held, over all backends.
    pub fn len(&self) -> usize {
        self.global.len as usize
    }

    /// Whether the table holds nothing.
    pub fn is_empty(&self) -> bool {
        self.global.len == 0
    }

    /// The global bound on entries.
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }

    /// Entries evicted so far (by either bound; a backend's bound may also shorten its oldest
    /// entry, which is not counted).
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Blocks held for `backend` (what its entries stand for).
    pub fn backend_len(&self, backend: u32) -> u64 {
        self.backends.get(backend as usize).map_or(0, |b| b.blocks)
    }

    /// Entries held for `backend`.
    pub fn backend_entries(&self, backend: u32) -> u64 {
        self.backends
            .get(backend as usize)
            .map_or(0, |b| b.list.len)
    }

    /// The block bound of `backend` (0 when it is not registered).
    pub fn backend_capacity(&self, backend: u32) -> u64 {
        self.backends
            .get(backend as usize)
            .map_or(0, |b| b.capacity)
    }

    /// The share of `backend`'s block bound its entries stand for, 0 to 1 (0 without a bound).
    pub fn backend_fill(&self, backend: u32) -> f64 {
        match self.backend_capacity(backend) {
            0 => 0.0,
            cap => (self.backend_len(backend) as f64 / cap as f64).min(1.0),
        }
    }

    /// Heap bytes used by the table's structures.
    pub fn memory_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.table.capacity() * std::mem::size_of::<Slot>()
            + self.backends.capacity() * std::mem::size_of::<BackendLru>()
    }

    /// Changes the global bound, evicting least-recently-used entries down to it.
    pub fn set_max_entries(&mut self, max_entries: usize) {
        self.max_entries = max_entries;
        while self.len() > self.max_entries {
            self.remove(self.global.tail);
        }
    }

    /// Registers `backend` (or changes its bound) with room for `capacity_blocks` blocks,
    /// evicting its least-recently-used blocks down to the new bound.
    pub fn set_backend_capacity(&mut self, backend: u32, capacity_blocks: u64) {
        let slot = backend as usize;
        if self.backends.len() <= slot {
            self.backends.resize(
                slot + 1,
                BackendLru {
                    list: List::EMPTY,
                    blocks: 0,
                    capacity: 0,
                    clock: 0,
                },
            );
        }
        self.backends[slot].capacity = capacity_blocks;
        self.shrink_to(backend, capacity_blocks);
    }

    /// Forgets everything about `backend` and unregisters it.
    pub fn remove_backend(&mut self, backend: u32) {
        self.set_backend_capacity(backend, 0);
    }

    /// Records that `backend` now holds the prefix `blocks` (chained hashes, in prompt order).
    ///
    /// Chunks are touched last to first, so the prefix's first blocks, shared by the most
    /// requests, are the most recently used and the last to be evicted, as in vLLM.
    pub fn record(&mut self, backend: u32, blocks: &[u64]) {
        let Some(lru) = self.backends.get(backend as usize) else {
            return;
        };
        if lru.capacity == 0 || self.max_entries == 0 {
            return;
        }
        let chunks = blocks.len().div_ceil(CHUNK_BLOCKS);
        for c in (0..chunks).rev() {
            let start = c * CHUNK_BLOCKS;
            let end = (start + CHUNK_BLOCKS).min(blocks.len());
            self.record_chunk(backend, &blocks[start..end]);
        }
    }

    /// Records one chunk. Where the entry already there parts from it, the rest of the chunk gets
    /// an entry of its own, keyed by the first block where they part (that hash is chained too).
    fn record_chunk(&mut self, backend: u32, chunk: &[u64]) {
        let mut from = 0;
        loop {
            let tail = Tail::of(&chunk[from + 1..]);
            let Some(idx) = self.find(chunk[from], backend) else {
                self.insert(chunk[from], backend, tail);
                return;
            };
            self.touch(idx);
            let held = self.entries[idx as usize].tail;
            if tail.within(&held) {
                return;
            }
            let agreeing = held.agreeing(&chunk[from + 1..]);
            if agreeing == usize::from(held.len) {
                self.extend(idx, tail);
                return;
            }
            from += 1 + agreeing;
        }
    }

    /// Forgets that `backend` holds the prefix `blocks` past its first `keep` blocks (a request
    /// recorded there failed before the backend computed it; `keep` is what the backend held
    /// before). Entries keyed by a block of the chain from `keep` on name this prefix and go; the
    /// entry that covers block `keep` from an earlier key is cut short before it if it agrees with
    /// the chain that far (one that parts from it earlier is another prompt's). A lookup per
    /// block from `keep` on: only a retry pays it.
    pub fn forget(&mut self, backend: u32, blocks: &[u64], keep: usize) {
        if keep >= blocks.len() {
            return;
        }
        for &block in &blocks[keep..] {
            if let Some(idx) = self.find(block, backend) {
                self.discard(idx);
            }
        }
        // An entry reaches at most to its chunk's end: only keys in `keep`'s chunk can cover it.
        for k in keep - keep % CHUNK_BLOCKS..keep {
            let Some(idx) = self.find(blocks[k], backend) else {
                continue;
            };
            let room = (keep - 1 - k) as u8;
            let tail = self.entries[idx as usize].tail;
            if tail.len > room && tail.agreeing(&blocks[k + 1..]) > usize::from(room) {
                self.shorten(idx, room);
            }
        }
    }

    /// Writes into `lengths[b]` the number of leading blocks of `blocks` that backend `b` holds,
    /// for every registered backend (`lengths` is resized to cover them all).
    ///
    /// A backend holding a chunk's first block holds everything before it (the hash is chained),
    /// so the walk goes on to the next chunk for every backend that held this one's first block,
    /// even where the chunk's rest was evicted.
    pub fn match_lengths(&self, blocks: &[u64], lengths: &mut Vec<u32>) {
        lengths.clear();
        lengths.resize(self.backends.len(), 0);
        for (c, chunk) in blocks.chunks(CHUNK_BLOCKS).enumerate() {
            let start = (c * CHUNK_BLOCKS) as u32;
            // Bit k: some backend's match stops at the chunk's block k, where its entry parts from
            // the request; an entry keyed by that block may go on.
            let mut stops = 0u32;
            let mut found = false;
            self.each_holder(chunk[0], |e| {
                let Some(len) = lengths.get_mut(e.backend as usize) else {
                    return;
                };
                // Only a backend that held every earlier chunk's first block goes on.
                if c == 0 || *len + CHUNK_BLOCKS as u32 > start {
                    let k = 1 + e.tail.agreeing(&chunk[1..]);
                    *len = start + k as u32;
                    found = true;
                    stops |= 1 << k;
                }
            });
            if !found {
                break;
            }
            stops &= (1 << chunk.len()) - 1;
            while stops != 0 {
                let k = stops.trailing_zeros() as usize;
                stops &= stops - 1;
                self.each_holder(chunk[k], |e| {
                    let Some(len) = lengths.get_mut(e.backend as usize) else {
                        return;
                    };
                    if *len == start + k as u32 {
                        let next = k + 1 + e.tail.agreeing(&chunk[k + 1..]);
                        *len = start + next as u32;
                        stops |= (1 << next) & ((1 << chunk.len()) - 1);
                    }
                });
            }
        }
    }
}

#[cfg(test)]
mod model;
#[cfg(test)]
mod tests;
