//! The table's storage, under [`PrefixAffinity`]'s operations: probing the open-addressing index,
//! inserting an entry (keeping both bounds), extending and shortening one, removing one with
//! backward-shift deletion, the two intrusive LRU lists, and the check of every invariant.

use super::{tag, Entry, PrefixAffinity, Slot, Tail, CHUNK_BLOCKS, MIN_TABLE, NIL, TAIL};

impl PrefixAffinity {
    /// Calls `f` with every entry keyed by `block` (one per backend holding it).
    pub(super) fn each_holder(&self, block: u64, mut f: impl FnMut(&Entry)) {
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

    pub(super) fn find(&self, block: u64, backend: u32) -> Option<u32> {
        self.probe(block, |e| e.backend == backend)
    }

    /// A chunk recorded again, further than the entry went: the entry takes the longer tail, and
    /// the backend's bound is kept.
    pub(super) fn extend(&mut self, idx: u32, tail: Tail) {
        let e = &mut self.entries[idx as usize];
        let lru = &mut self.backends[e.backend as usize];
        lru.blocks = lru.blocks - u64::from(e.tail.len) + u64::from(tail.len);
        e.tail = tail;
        let (backend, capacity) = (e.backend, lru.capacity);
        self.shrink_to(backend, capacity);
    }

    /// Evicts `backend`'s least-recently-used blocks until it holds at most `blocks`: its oldest
    /// entry loses its last blocks first, then goes.
    pub(super) fn shrink_to(&mut self, backend: u32, blocks: u64) {
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

    pub(super) fn insert(&mut self, block: u64, backend: u32, mut tail: Tail) {
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

    /// Evicts an entry (counted in [`PrefixAffinity::evictions`]).
    pub(super) fn remove(&mut self, idx: u32) {
        if idx == NIL {
            return;
        }
        self.discard(idx);
        self.evictions += 1;
    }

    /// Cuts an entry's tail to `len` blocks (no longer than it is).
    pub(super) fn shorten(&mut self, idx: u32, len: u8) {
        let e = &mut self.entries[idx as usize];
        let cut = e.tail.len.saturating_sub(len);
        e.tail.len -= cut;
        self.backends[e.backend as usize].blocks -= u64::from(cut);
    }

    /// Takes an entry out of the index and both lists, and frees its slab position.
    pub(super) fn discard(&mut self, idx: u32) {
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
    }

    /// Moves an entry to the front, unless it is already among the newest quarter of its
    /// backend's blocks (each move to the front pushes it down by at most one entry, of at most
    /// [`CHUNK_BLOCKS`] blocks), which saves the re-linking's cache misses for the hot prefixes
    /// touched by most requests.
    pub(super) fn touch(&mut self, idx: u32) {
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
