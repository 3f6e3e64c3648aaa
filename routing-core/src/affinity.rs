//! Prefix affinity: which backend probably holds which prefix blocks in its KV cache.
//!
//! Every routed request records its chained block hashes (see [`crate::prompt`]) on the backend
//! it went to. Each backend has its own LRU (approximate: an entry already among the newest
//! quarter of its list is not moved again) bounded by its KV capacity in blocks, since that is
//! roughly what vLLM can keep; the whole table has a global bound on entries, evicting the least
//! recently used entry of any backend; removing a backend purges its entries.
//!
//! The layout is chosen for memory (at most 64 bytes an entry, measured by the benchmarks): a slab
//! of 32-byte entries threaded on two intrusive doubly-linked LRU lists (the backend's and the
//! global one), and an open-addressing index of `u32` slab positions keyed by block hash, with
//! linear probing, load factor at most 1/2 and backward-shift deletion. The same block held by
//! several backends is several entries under one hash, so a lookup visits each holder once, and
//! the longest cached prefix of a request on every backend is found in time linear in its block
//! count.

const NIL: u32 = u32::MAX;
const MIN_TABLE: usize = 1024;

#[derive(Debug, Clone, Copy)]
struct Entry {
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
    capacity: u64,
    /// Counts moves to the front of this backend's list.
    clock: u32,
}

/// The prefix-affinity table.
#[derive(Debug, Clone)]
pub struct PrefixAffinity {
    entries: Vec<Entry>,
    free: u32,
    table: Vec<u32>,
    global: List,
    backends: Vec<BackendLru>,
    max_entries: usize,
    evictions: u64,
}

impl PrefixAffinity {
    /// An empty table holding at most `max_entries` (block, backend) entries in total.
    pub fn new(max_entries: usize) -> Self {
        PrefixAffinity {
            entries: Vec::new(),
            free: NIL,
            table: vec![NIL; MIN_TABLE],
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

    /// Entries evicted so far (by either bound).
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Entries held for `backend`.
    pub fn backend_len(&self, backend: u32) -> u64 {
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
            + self.table.capacity() * std::mem::size_of::<u32>()
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
    /// evicting its least-recently-used entries down to the new bound.
    pub fn set_backend_capacity(&mut self, backend: u32, capacity_blocks: u64) {
        let slot = backend as usize;
        if self.backends.len() <= slot {
            self.backends.resize(
                slot + 1,
                BackendLru {
                    list: List::EMPTY,
                    capacity: 0,
                    clock: 0,
                },
            );
        }
        self.backends[slot].capacity = capacity_blocks;
        while self.backends[slot].list.len > capacity_blocks {
            let tail = self.backends[slot].list.tail;
            self.remove(tail);
        }
    }

    /// Forgets everything about `backend` and unregisters it.
    pub fn remove_backend(&mut self, backend: u32) {
        self.set_backend_capacity(backend, 0);
    }

    /// Records that `backend` now holds the prefix `blocks` (chained hashes, in prompt order).
    ///
    /// Blocks are touched last to first, so the prefix's first blocks, shared by the most
    /// requests, are the most recently used and the last to be evicted, as in vLLM.
    pub fn record(&mut self, backend: u32, blocks: &[u64]) {
        let Some(lru) = self.backends.get(backend as usize) else {
            return;
        };
        if lru.capacity == 0 || self.max_entries == 0 {
            return;
        }
        for &block in blocks.iter().rev() {
            match self.find(block, backend) {
                Some(idx) => self.touch(idx),
                None => self.insert(block, backend),
            }
        }
    }

    /// Writes into `lengths[b]` the number of leading blocks of `blocks` that backend `b` holds,
    /// for every registered backend (`lengths` is resized to cover them all).
    pub fn match_lengths(&self, blocks: &[u64], lengths: &mut Vec<u32>) {
        lengths.clear();
        lengths.resize(self.backends.len(), 0);
        for (i, &block) in blocks.iter().enumerate() {
            let i = i as u32;
            let mut advanced = false;
            let mask = self.table.len() - 1;
            let mut pos = Self::home(block, mask);
            loop {
                let idx = self.table[pos];
                if idx == NIL {
                    break;
                }
                let e = &self.entries[idx as usize];
                if e.block == block {
                    if let Some(len) = lengths.get_mut(e.backend as usize) {
                        if *len == i {
                            *len = i + 1;
                            advanced = true;
                        }
                    }
                }
                pos = (pos + 1) & mask;
            }
            if !advanced {
                break;
            }
        }
    }

    /// Checks every internal invariant; used by tests and property tests.
    pub fn verify(&self) -> Result<(), String> {
        let occupied = self.table.iter().filter(|&&i| i != NIL).count();
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
            if b.list.len > b.capacity {
                return Err(format!(
                    "backend {slot} holds {} > {}",
                    b.list.len, b.capacity
                ));
            }
            let mut n = 0;
            let mut cur = b.list.head;
            while cur != NIL {
                let e = &self.entries[cur as usize];
                if e.backend as usize != slot {
                    return Err("entry on the wrong backend list".into());
                }
                if self.find(e.block, e.backend) != Some(cur) {
                    return Err("entry missing from the index".into());
                }
                n += 1;
                cur = e.next;
            }
            if n != b.list.len {
                return Err(format!("backend {slot} list length {n} != {}", b.list.len));
            }
            total += n;
        }
        if total != self.global.len {
            return Err("backend lists do not add up to the global list".into());
        }
        Ok(())
    }

    fn home(block: u64, mask: usize) -> usize {
        ((block ^ (block >> 32)) as usize) & mask
    }

    fn find(&self, block: u64, backend: u32) -> Option<u32> {
        let mask = self.table.len() - 1;
        let mut pos = Self::home(block, mask);
        loop {
            let idx = self.table[pos];
            if idx == NIL {
                return None;
            }
            let e = &self.entries[idx as usize];
            if e.block == block && e.backend == backend {
                return Some(idx);
            }
            pos = (pos + 1) & mask;
        }
    }

    fn insert(&mut self, block: u64, backend: u32) {
        let slot = backend as usize;
        if self.backends[slot].list.len >= self.backends[slot].capacity {
            let tail = self.backends[slot].list.tail;
            self.remove(tail);
        }
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
        let mask = self.table.len() - 1;
        let mut pos = Self::home(block, mask);
        while self.table[pos] != NIL {
            pos = (pos + 1) & mask;
        }
        self.table[pos] = idx;
    }

    fn grow_index(&mut self) {
        let new_len = (self.table.len() * 2).max(MIN_TABLE);
        let mut table = vec![NIL; new_len];
        let mask = new_len - 1;
        for &idx in self.table.iter().filter(|&&i| i != NIL) {
            let mut pos = Self::home(self.entries[idx as usize].block, mask);
            while table[pos] != NIL {
                pos = (pos + 1) & mask;
            }
            table[pos] = idx;
        }
        self.table = table;
    }

    fn remove(&mut self, idx: u32) {
        if idx == NIL {
            return;
        }
        self.unlink(idx);
        let block = self.entries[idx as usize].block;
        let mask = self.table.len() - 1;
        let mut pos = Self::home(block, mask);
        while self.table[pos] != idx {
            if self.table[pos] == NIL {
                debug_assert!(false, "entry missing from the index");
                return;
            }
            pos = (pos + 1) & mask;
        }
        // Backward-shift deletion keeps every probe chain unbroken without tombstones.
        self.table[pos] = NIL;
        let mut hole = pos;
        let mut i = pos;
        loop {
            i = (i + 1) & mask;
            let cur = self.table[i];
            if cur == NIL {
                break;
            }
            let home = Self::home(self.entries[cur as usize].block, mask);
            if (i.wrapping_sub(home) & mask) >= (i.wrapping_sub(hole) & mask) {
                self.table[hole] = cur;
                self.table[i] = NIL;
                hole = i;
            }
        }
        self.entries[idx as usize].next = self.free;
        self.free = idx;
        self.evictions += 1;
    }

    /// Moves an entry to the front, unless it is already among the newest quarter of its
    /// backend's list (each move to the front pushes it down by at most one place), which saves
    /// the re-linking's cache misses for the hot prefixes touched by most requests.
    fn touch(&mut self, idx: u32) {
        let e = &self.entries[idx as usize];
        let lru = &self.backends[e.backend as usize];
        if u64::from(lru.clock.wrapping_sub(e.stamp)) < lru.capacity / 4 {
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
        if old_ghead != NIL {
            self.entries[old_ghead as usize].gprev = idx;
        } else {
            self.global.tail = idx;
        }
        self.global.head = idx;
        self.global.len += 1;
    }

    fn unlink(&mut self, idx: u32) {
        let Entry {
            backend,
            prev,
            next,
            gprev,
            gnext,
            ..
        } = self.entries[idx as usize];
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
mod tests {
    use super::*;

    fn blocks(seed: u64, n: usize) -> Vec<u64> {
        crate::prompt::block_hashes(format!("{seed:064}").repeat(n).as_bytes(), 16)
    }

    #[test]
    fn entry_is_32_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 32);
    }

    #[test]
    fn longest_prefix_per_backend() {
        let mut a = PrefixAffinity::new(1000);
        a.set_backend_capacity(0, 100);
        a.set_backend_capacity(2, 100);
        let p = blocks(1, 10);
        a.record(0, &p[..6]);
        a.record(2, &p[..3]);
        let mut lengths = Vec::new();
        a.match_lengths(&p, &mut lengths);
        assert_eq!(lengths, vec![6, 0, 3]);
        a.match_lengths(&blocks(2, 10), &mut lengths);
        assert_eq!(lengths, vec![0, 0, 0]);
        a.match_lengths(&[], &mut lengths);
        assert_eq!(lengths, vec![0, 0, 0]);
        a.verify().unwrap();
    }

    #[test]
    fn a_hole_in_the_prefix_ends_the_match() {
        let mut a = PrefixAffinity::new(1000);
        a.set_backend_capacity(0, 100);
        let p = blocks(1, 5);
        a.record(0, &[p[0], p[1], p[3], p[4]]);
        let mut lengths = Vec::new();
        a.match_lengths(&p, &mut lengths);
        assert_eq!(lengths, vec![2]);
    }

    #[test]
    fn backend_bound_evicts_its_oldest_and_keeps_the_prefix_head() {
        let mut a = PrefixAffinity::new(1000);
        a.set_backend_capacity(0, 4);
        let p = blocks(1, 6);
        a.record(0, &p);
        assert_eq!(a.backend_len(0), 4);
        let mut lengths = Vec::new();
        a.match_lengths(&p, &mut lengths);
        assert_eq!(lengths, vec![4], "the first blocks survive");
        let q = blocks(2, 2);
        a.record(0, &q);
        a.match_lengths(&p, &mut lengths);
        assert_eq!(lengths, vec![2]);
        a.set_backend_capacity(0, 1);
        assert_eq!(a.backend_len(0), 1);
        a.verify().unwrap();
    }

    #[test]
    fn a_prefix_in_use_survives_a_stream_of_new_blocks() {
        let mut a = PrefixAffinity::new(1000);
        a.set_backend_capacity(0, 8);
        let hot = blocks(1, 2);
        let mut lengths = Vec::new();
        for i in 0..100 {
            a.record(0, &hot);
            a.record(0, &blocks(1000 + i, 3));
            a.match_lengths(&hot, &mut lengths);
            assert_eq!(lengths, vec![2], "round {i}");
        }
        a.verify().unwrap();
    }

    #[test]
    fn global_bound_evicts_least_recent_of_any_backend() {
        let mut a = PrefixAffinity::new(5);
        a.set_backend_capacity(0, 100);
        a.set_backend_capacity(1, 100);
        a.record(0, &blocks(1, 3));
        a.record(1, &blocks(2, 3));
        assert_eq!(a.len(), 5);
        assert_eq!(a.backend_len(0), 2);
        assert_eq!(a.backend_len(1), 3);
        a.set_max_entries(2);
        assert_eq!(a.len(), 2);
        assert_eq!(a.backend_len(0), 0);
        a.verify().unwrap();
    }

    #[test]
    fn removing_a_backend_purges_its_entries_only() {
        let mut a = PrefixAffinity::new(1000);
        a.set_backend_capacity(0, 100);
        a.set_backend_capacity(1, 100);
        let p = blocks(1, 8);
        a.record(0, &p);
        a.record(1, &p);
        a.remove_backend(0);
        assert_eq!(a.len(), 8);
        let mut lengths = Vec::new();
        a.match_lengths(&p, &mut lengths);
        assert_eq!(lengths, vec![0, 8]);
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
        for i in 0..200u64 {
            a.record((i % 4) as u32, &blocks(i, 20));
        }
        a.verify().unwrap();
        assert_eq!(a.len(), 4_000);
        a.remove_backend(1);
        a.remove_backend(3);
        a.verify().unwrap();
        assert_eq!(a.len(), 2_000);
        let mut lengths = Vec::new();
        a.match_lengths(&blocks(198, 20), &mut lengths);
        assert_eq!(lengths[2], 20);
    }

    #[test]
    fn zero_bound_records_nothing() {
        let mut a = PrefixAffinity::new(0);
        a.set_backend_capacity(0, 10);
        a.record(0, &blocks(1, 3));
        assert!(a.is_empty());
    }
}
