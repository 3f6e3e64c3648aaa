//! Prefix affinity: which backend probably holds which prefix blocks in its KV cache.
//!
//! Every routed request records its chained block hashes (see [`crate::prompt`]) on the backend
//! it went to. Each backend has its own LRU (approximate: an entry already among the newest
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

    /// Calls `f` with every entry keyed by `block` (one per backend holding it).
    fn each_holder(&self, block: u64, mut f: impl FnMut(&Entry)) {
        self.probe(block, |e| {
            f(e);
            false
        });
    }

    /// Visits the entries keyed by `block` until `stop` says so; the slab position of that one.
    fn probe(&self, block: u64, mut stop: impl FnMut(&Entry) -> bool) -> Option<u32> {
        let mask = self.table.len() - 1;
        let tag = tag(block);
        let mut pos = tag as usize & mask;
        loop {
            let slot = self.table[pos];
            if slot.idx == NIL {
                return None;
            }
            if slot.tag == tag {
                let e = &self.entries[slot.idx as usize];
                if e.block == block && stop(e) {
                    return Some(slot.idx);
                }
            }
            pos = (pos + 1) & mask;
        }
    }

    /// Checks every internal invariant; used by tests and property tests.
    pub fn verify(&self) -> Result<(), String> {
        let occupied = self.table.iter().filter(|s| s.idx != NIL).count();
        if let Some(s) = self
            .table
            .iter()
            .find(|s| s.idx != NIL && s.tag != tag(self.entries[s.idx as usize].block))
        {
            return Err(format!("index slot of entry {} has a wrong tag", s.idx));
        }
        if occupied != self.len() {
            return Err(format!("index holds {occupied}, list holds {}", self.len()));
        }
        if self.len() > self.max_entries {
            return Err(format!(
                "{} entries above the bound {}",
                self.len(),
                self.max_entries
            ));
        }
        if self.table.len() < 2 * self.len() {
            return Err("index load factor above 1/2".into());
        }
        let mut total = 0;
        for (slot, b) in self.backends.iter().enumerate() {
            if b.blocks > b.capacity {
                return Err(format!(
                    "backend {slot} holds {} > {}",
                    b.blocks, b.capacity
                ));
            }
            let (mut n, mut blocks) = (0, 0);
            let mut cur = b.list.head;
            while cur != NIL {
                let e = &self.entries[cur as usize];
                if e.backend as usize != slot {
                    return Err("entry on the wrong backend list".into());
                }
                if self.find(e.block, e.backend) != Some(cur) {
                    return Err("entry missing from the index".into());
                }
                if usize::from(e.tail.len) > TAIL {
                    return Err("entry tail too long".into());
                }
                n += 1;
                blocks += e.blocks();
                cur = e.next;
            }
            if n != b.list.len {
                return Err(format!("backend {slot} list length {n} != {}", b.list.len));
            }
            if blocks != b.blocks {
                return Err(format!("backend {slot} blocks {blocks} != {}", b.blocks));
            }
            total += n;
        }
        if total != self.global.len {
            return Err("backend lists do not add up to the global list".into());
        }
        Ok(())
    }

    fn find(&self, block: u64, backend: u32) -> Option<u32> {
        self.probe(block, |e| e.backend == backend)
    }

    /// A chunk recorded again, further than the entry went: the entry takes the longer tail, and
    /// the backend's bound is kept.
    fn extend(&mut self, idx: u32, tail: Tail) {
        let e = &mut self.entries[idx as usize];
        let lru = &mut self.backends[e.backend as usize];
        lru.blocks = lru.blocks - u64::from(e.tail.len) + u64::from(tail.len);
        e.tail = tail;
        let (backend, capacity) = (e.backend, lru.capacity);
        self.shrink_to(backend, capacity);
    }

    /// Evicts `backend`'s least-recently-used blocks until it holds at most `blocks`: its oldest
    /// entry loses its last blocks first, then goes.
    fn shrink_to(&mut self, backend: u32, blocks: u64) {
        let slot = backend as usize;
        while self.backends[slot].blocks > blocks {
            let excess = self.backends[slot].blocks - blocks;
            let oldest = self.backends[slot].list.tail;
            let e = &mut self.entries[oldest as usize];
            if u64::from(e.tail.len) >= excess {
                e.tail.len -= excess as u8;
                self.backends[slot].blocks = blocks;
            } else {
                self.remove(oldest);
            }
        }
    }

    fn insert(&mut self, block: u64, backend: u32, mut tail: Tail) {
        let slot = backend as usize;
        let capacity = self.backends[slot].capacity;
        // A bound smaller than the chunk keeps the chunk's first blocks.
        tail.len = tail.len.min((capacity - 1).min(TAIL as u64) as u8);
        let blocks = 1 + u64::from(tail.len);
        self.shrink_to(backend, capacity - blocks);
        if self.len() >= self.max_entries {
            self.remove(self.global.tail);
        }
        let entry = Entry {
            block,
            backend,
            prev: NIL,
            next: NIL,
            gprev: NIL,
            gnext: NIL,
            stamp: 0,
            tail,
        };
        let idx = if self.free != NIL {
            let idx = self.free;
            self.free = self.entries[idx as usize].next;
            self.entries[idx as usize] = entry;
            idx
        } else {
            if self.entries.len() == self.entries.capacity() {
                // Grow geometrically but never past the global bound, so a full table has no slack.
                let room = self.max_entries.saturating_sub(self.entries.len()).max(1);
                let step = self.entries.capacity().max(1024).min(room);
                self.entries.reserve_exact(step);
            }
            self.entries.push(entry);
            (self.entries.len() - 1) as u32
        };
        self.link_front(idx);
        if (self.len() + 1) * 2 > self.table.len() {
            self.grow_index();
        }
        Self::place(
            &mut self.table,
            Slot {
                idx,
                tag: tag(block),
            },
        );
    }

    /// Puts `slot` at the first free position from its home.
    fn place(table: &mut [Slot], slot: Slot) {
        let mask = table.len() - 1;
        let mut pos = slot.tag as usize & mask;
        while table[pos].idx != NIL {
            pos = (pos + 1) & mask;
        }
        table[pos] = slot;
    }

    fn grow_index(&mut self) {
        let new_len = (self.table.len() * 2).max(MIN_TABLE);
        let mut table = vec![Slot::EMPTY; new_len];
        for &slot in self.table.iter().filter(|s| s.idx != NIL) {
            Self::place(&mut table, slot);
        }
        self.table = table;
    }

    fn remove(&mut self, idx: u32) {
        if idx == NIL {
            return;
        }
        self.unlink(idx);
        let mask = self.table.len() - 1;
        let mut pos = tag(self.entries[idx as usize].block) as usize & mask;
        while self.table[pos].idx != idx {
            if self.table[pos].idx == NIL {
                debug_assert!(false, "entry missing from the index");
                return;
            }
            pos = (pos + 1) & mask;
        }
        // Backward-shift deletion keeps every probe chain unbroken without tombstones.
        self.table[pos] = Slot::EMPTY;
        let mut hole = pos;
        let mut i = pos;
        loop {
            i = (i + 1) & mask;
            let cur = self.table[i];
            if cur.idx == NIL {
                break;
            }
            let home = cur.tag as usize & mask;
            if (i.wrapping_sub(home) & mask) >= (i.wrapping_sub(hole) & mask) {
                self.table[hole] = cur;
                self.table[i] = Slot::EMPTY;
                hole = i;
            }
        }
        self.entries[idx as usize].next = self.free;
        self.free = idx;
        self.evictions += 1;
    }

    /// Moves an entry to the front, unless it is already among the newest quarter of its
    /// backend's blocks (each move to the front pushes it down by at most one entry, of at most
    /// [`CHUNK_BLOCKS`] blocks), which saves the re-linking's cache misses for the hot prefixes
    /// touched by most requests.
    fn touch(&mut self, idx: u32) {
        let e = &self.entries[idx as usize];
        let lru = &self.backends[e.backend as usize];
        let quarter = lru.capacity / (4 * CHUNK_BLOCKS as u64);
        if u64::from(lru.clock.wrapping_sub(e.stamp)) < quarter {
            return;
        }
        self.unlink(idx);
        self.link_front(idx);
    }

    fn link_front(&mut self, idx: u32) {
        let backend = self.entries[idx as usize].backend as usize;
        let old_head = self.backends[backend].list.head;
        let old_ghead = self.global.head;
        self.backends[backend].clock = self.backends[backend].clock.wrapping_add(1);
        let stamp = self.backends[backend].clock;
        {
            let e = &mut self.entries[idx as usize];
            e.stamp = stamp;
            e.prev = NIL;
            e.next = old_head;
            e.gprev = NIL;
            e.gnext = old_ghead;
        }
        if old_head != NIL {
            self.entries[old_head as usize].prev = idx;
        } else {
            self.backends[backend].list.tail = idx;
        }
        self.backends[backend].list.head = idx;
        self.backends[backend].list.len += 1;
        self.backends[backend].blocks += self.entries[idx as usize].blocks();
        if old_ghead != NIL {
            self.entries[old_ghead as usize].gprev = idx;
        } else {
            self.global.tail = idx;
        }
        self.global.head = idx;
        self.global.len += 1;
    }

    fn unlink(&mut self, idx: u32) {
        let e = self.entries[idx as usize];
        let Entry {
            backend,
            prev,
            next,
            gprev,
            gnext,
            ..
        } = e;
        self.backends[backend as usize].blocks -= e.blocks();
        let list = &mut self.backends[backend as usize].list;
        if prev != NIL {
            self.entries[prev as usize].next = next;
        } else {
            list.head = next;
        }
        if next != NIL {
            self.entries[next as usize].prev = prev;
        } else {
            list.tail = prev;
        }
        list.len -= 1;
        if gprev != NIL {
            self.entries[gprev as usize].gnext = gnext;
        } else {
            self.global.head = gnext;
        }
        if gnext != NIL {
            self.entries[gnext as usize].gprev = gprev;
        } else {
            self.global.tail = gprev;
        }
        self.global.len -= 1;
    }
}

#[cfg(test)]
mod model;
#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(seed: u64, n: usize) -> Vec<u64> {
        crate::prompt::block_hashes(format!("{seed:064}").repeat(n).as_bytes(), 16)
    }

    /// A table of `max_entries` with backends 0, 1, ... of these block bounds.
    fn table(max_entries: usize, capacities: &[u64]) -> PrefixAffinity {
        let mut a = PrefixAffinity::new(max_entries);
        for (b, &capacity) in capacities.iter().enumerate() {
            a.set_backend_capacity(b as u32, capacity);
        }
        a
    }

    fn lengths_of(a: &PrefixAffinity, blocks: &[u64]) -> Vec<u32> {
        let mut lengths = Vec::new();
        a.match_lengths(blocks, &mut lengths);
        lengths
    }

    #[test]
    fn entry_is_64_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 64);
    }

    #[test]
    fn longest_prefix_per_backend() {
        let mut a = PrefixAffinity::new(1000);
        a.set_backend_capacity(0, 100);
        a.set_backend_capacity(2, 100);
        let p = blocks(1, 30);
        a.record(0, &p[..21]);
        a.record(2, &p[..3]);
        assert_eq!(lengths_of(&a, &p), vec![21, 0, 3]);
        assert_eq!(lengths_of(&a, &p[..16]), vec![16, 0, 3]);
        assert_eq!(lengths_of(&a, &p[..12]), vec![12, 0, 3]);
        assert_eq!(lengths_of(&a, &blocks(2, 10)), vec![0, 0, 0]);
        assert_eq!(lengths_of(&a, &[]), vec![0, 0, 0]);
        let entries = 21usize.div_ceil(CHUNK_BLOCKS) as u64;
        assert_eq!((a.backend_len(0), a.backend_entries(0)), (21, entries));
        assert_eq!(a.len() as u64, entries + 1);
        a.verify().unwrap();
    }

    #[test]
    fn a_prompt_that_parts_inside_a_chunk_matches_up_to_where_it_parts() {
        let g = CHUNK_BLOCKS;
        let mut a = table(1000, &[100]);
        // A system prompt that ends 3 blocks into the second chunk, and two questions.
        let system = "s".repeat(64 * (g + 3));
        let prompt = |question: &str| {
            let text = format!("{system}{}", question.repeat(64 * (g - 2)));
            crate::prompt::block_hashes(text.as_bytes(), 16)
        };
        let (first, second) = (prompt("a"), prompt("b"));
        assert_eq!(first.len(), 2 * g + 1);
        assert_eq!(first[..g + 3], second[..g + 3]);
        assert_ne!(first[g + 3], second[g + 3]);
        a.record(0, &first);
        assert_eq!(lengths_of(&a, &second), vec![g as u32 + 3]);
        assert_eq!(lengths_of(&a, &first), vec![2 * g as u32 + 1]);
        // A shorter prompt over the same blocks takes nothing away.
        a.record(0, &first[..g + 1]);
        assert_eq!(lengths_of(&a, &first), vec![2 * g as u32 + 1]);
        // Where two prompts part inside a chunk, the second one's rest gets its own entry.
        a.record(0, &second);
        assert_eq!((a.len(), a.backend_len(0)), (5, 3 * g as u64 - 1));
        for p in [&first, &second] {
            assert_eq!(lengths_of(&a, p), vec![2 * g as u32 + 1]);
            assert_eq!(lengths_of(&a, &p[..g + 6]), vec![g as u32 + 6]);
        }
        a.verify().unwrap();
    }

    #[test]
    fn a_hole_in_the_prefix_ends_the_match() {
        let mut a = table(1000, &[100]);
        let p = blocks(1, 12);
        a.record(0, &[p[0], p[1], p[3], p[4]]);
        assert_eq!(lengths_of(&a, &p), vec![2]);
        let mut q = p.clone();
        q.remove(9);
        a.record(0, &q);
        assert_eq!(lengths_of(&a, &p), vec![9]);
    }

    #[test]
    fn backend_bound_evicts_its_oldest_and_keeps_the_prefix_head() {
        let mut a = table(1000, &[4]);
        let p = blocks(1, 6);
        a.record(0, &p);
        assert_eq!(a.backend_len(0), 4);
        assert_eq!(lengths_of(&a, &p), vec![4], "the first blocks survive");
        let q = blocks(2, 2);
        a.record(0, &q);
        assert_eq!(lengths_of(&a, &p), vec![2]);
        a.set_backend_capacity(0, 1);
        assert_eq!(a.backend_len(0), 1);
        a.verify().unwrap();
    }

    #[test]
    fn a_long_prompt_over_a_small_bound_keeps_its_first_blocks() {
        let mut a = table(1000, &[20]);
        let p = blocks(1, 40);
        a.record(0, &p);
        assert_eq!((a.backend_len(0), lengths_of(&a, &p)), (20, vec![20]));
        a.verify().unwrap();
    }

    #[test]
    fn a_prefix_in_use_survives_a_stream_of_new_blocks() {
        let mut a = table(1000, &[8]);
        let hot = blocks(1, 2);
        for i in 0..100 {
            a.record(0, &hot);
            a.record(0, &blocks(1000 + i, 3));
            assert_eq!(lengths_of(&a, &hot), vec![2], "round {i}");
        }
        a.verify().unwrap();
    }

    #[test]
    fn global_bound_evicts_least_recent_of_any_backend() {
        let g = CHUNK_BLOCKS;
        let mut a = table(5, &[100, 100]);
        a.record(0, &blocks(1, 3 * g));
        a.record(1, &blocks(2, 3 * g));
        assert_eq!(a.len(), 5);
        assert_eq!((a.backend_entries(0), a.backend_len(0)), (2, 2 * g as u64));
        assert_eq!(a.backend_entries(1), 3);
        assert_eq!(lengths_of(&a, &blocks(1, 3 * g)), vec![2 * g as u32, 0]);
        a.set_max_entries(2);
        assert_eq!(a.len(), 2);
        assert_eq!(a.backend_len(0), 0);
        a.verify().unwrap();
    }

    #[test]
    fn removing_a_backend_purges_its_entries_only() {
        let mut a = table(1000, &[100, 100]);
        let p = blocks(1, 8);
        a.record(0, &p);
        a.record(1, &p);
        a.remove_backend(0);
        assert_eq!((a.len(), a.backend_len(1)), (1, 8));
        assert_eq!(lengths_of(&a, &p), vec![0, 8]);
        a.record(0, &p);
        assert_eq!(
            a.backend_len(0),
            0,
            "an unregistered backend records nothing"
        );
        a.verify().unwrap();
    }

    #[test]
    fn index_grows_and_shrinks_consistently() {
        let mut a = PrefixAffinity::new(10_000);
        for b in 0..4 {
            a.set_backend_capacity(b, 2_000);
        }
        for i in 0..400u64 {
            a.record((i % 4) as u32, &blocks(i, 20));
        }
        a.verify().unwrap();
        let per_prompt = 20usize.div_ceil(CHUNK_BLOCKS);
        assert_eq!(a.len(), 400 * per_prompt);
        assert_eq!((0..4).map(|b| a.backend_len(b)).sum::<u64>(), 8_000);
        a.remove_backend(1);
        a.remove_backend(3);
        a.verify().unwrap();
        assert_eq!(a.len(), 200 * per_prompt);
        assert_eq!(lengths_of(&a, &blocks(398, 20))[2], 20);
    }

    #[test]
    fn zero_bound_records_nothing() {
        let mut a = table(0, &[10]);
        a.record(0, &blocks(1, 3));
        assert!(a.is_empty());
    }
}
