//! A straightforward model of [`PrefixAffinity`]'s rules, for tests: entries in a plain vector,
//! found by linear scans, their order kept as link times instead of intrusive lists, no index.
//! The property test below drives both with the same records, bound changes and removals and
//! checks that the table answers exactly as the model does.

use super::{fingerprint, PrefixAffinity, CHUNK_BLOCKS, TAIL};

struct ModelEntry {
    block: u64,
    backend: u32,
    tail: Vec<u16>,
    /// When it was last moved to the front (global order).
    linked: u64,
    /// Its backend's clock then.
    stamp: u32,
}

#[derive(Clone, Copy, Default)]
struct ModelBackend {
    capacity: u64,
    clock: u32,
}

/// The model table.
pub(super) struct Model {
    entries: Vec<ModelEntry>,
    backends: Vec<ModelBackend>,
    max_entries: usize,
    time: u64,
    evictions: u64,
}

impl Model {
    pub(super) fn new(max_entries: usize) -> Model {
        Model {
            entries: Vec::new(),
            backends: Vec::new(),
            max_entries,
            time: 0,
            evictions: 0,
        }
    }

    pub(super) fn set_max_entries(&mut self, max_entries: usize) {
        self.max_entries = max_entries;
        while self.entries.len() > max_entries {
            self.remove(self.oldest(None));
        }
    }

    pub(super) fn set_backend_capacity(&mut self, backend: u32, capacity: u64) {
        let slot = backend as usize;
        if self.backends.len() <= slot {
            self.backends.resize(slot + 1, ModelBackend::default());
        }
        self.backends[slot].capacity = capacity;
        self.shrink_to(backend, capacity);
    }

    pub(super) fn record(&mut self, backend: u32, blocks: &[u64]) {
        let Some(b) = self.backends.get(backend as usize).copied() else {
            return;
        };
        if b.capacity == 0 || self.max_entries == 0 {
            return;
        }
        for chunk in blocks.chunks(CHUNK_BLOCKS).rev() {
            let mut from = 0;
            loop {
                let mut tail: Vec<u16> =
                    chunk[from + 1..].iter().map(|&h| fingerprint(h)).collect();
                let Some(i) = self.find(chunk[from], backend) else {
                    tail.truncate((b.capacity as usize - 1).min(TAIL));
                    self.shrink_to(backend, b.capacity - 1 - tail.len() as u64);
                    if self.entries.len() >= self.max_entries {
                        self.remove(self.oldest(None));
                    }
                    self.entries.push(ModelEntry {
                        block: chunk[from],
                        backend,
                        tail,
                        linked: 0,
                        stamp: 0,
                    });
                    self.link_front(self.entries.len() - 1);
                    break;
                };
                let lru = self.backends[backend as usize];
                let quarter = lru.capacity / (4 * CHUNK_BLOCKS as u64);
                if u64::from(lru.clock.wrapping_sub(self.entries[i].stamp)) >= quarter {
                    self.link_front(i);
                }
                let held = &self.entries[i].tail;
                if held.starts_with(&tail) {
                    break;
                }
                if tail.starts_with(held) {
                    self.entries[i].tail = tail;
                    self.shrink_to(backend, b.capacity);
                    break;
                }
                from += 1 + held.iter().zip(&tail).take_while(|(a, b)| a == b).count();
            }
        }
    }

    /// Each backend's match: through every chunk whose first block it holds; within the last,
    /// from entry to entry (each keyed by the block where the one before parts from the request).
    pub(super) fn match_lengths(&self, blocks: &[u64]) -> Vec<u32> {
        (0..self.backends.len() as u32)
            .map(|backend| {
                let mut len = 0;
                for (c, chunk) in blocks.chunks(CHUNK_BLOCKS).enumerate() {
                    let mut k = 0;
                    while k < chunk.len() {
                        let Some(i) = self.find(chunk[k], backend) else {
                            break;
                        };
                        k += 1 + self.agreeing(i, &chunk[k + 1..]);
                    }
                    if k == 0 {
                        break;
                    }
                    len = (c * CHUNK_BLOCKS + k) as u32;
                }
                len
            })
            .collect()
    }

    fn agreeing(&self, i: usize, blocks: &[u64]) -> usize {
        self.entries[i]
            .tail
            .iter()
            .zip(blocks)
            .take_while(|(&print, &block)| print == fingerprint(block))
            .count()
    }

    pub(super) fn backend_len(&self, backend: u32) -> u64 {
        self.entries
            .iter()
            .filter(|e| e.backend == backend)
            .map(|e| 1 + e.tail.len() as u64)
            .sum()
    }

    fn find(&self, block: u64, backend: u32) -> Option<usize> {
        self.entries
            .iter()
            .position(|e| e.block == block && e.backend == backend)
    }

    fn link_front(&mut self, i: usize) {
        self.time += 1;
        let lru = &mut self.backends[self.entries[i].backend as usize];
        lru.clock = lru.clock.wrapping_add(1);
        self.entries[i].linked = self.time;
        self.entries[i].stamp = lru.clock;
    }

    /// The least recently linked entry, of `backend` or of any.
    fn oldest(&self, backend: Option<u32>) -> usize {
        (0..self.entries.len())
            .filter(|&i| backend.is_none_or(|b| self.entries[i].backend == b))
            .min_by_key(|&i| self.entries[i].linked)
            .expect("an entry to evict")
    }

    fn shrink_to(&mut self, backend: u32, blocks: u64) {
        loop {
            let held = self.backend_len(backend);
            if held <= blocks {
                return;
            }
            let i = self.oldest(Some(backend));
            let excess = (held - blocks) as usize;
            let tail = &mut self.entries[i].tail;
            if tail.len() >= excess {
                tail.truncate(tail.len() - excess);
            } else {
                self.remove(i);
            }
        }
    }

    fn remove(&mut self, i: usize) {
        self.entries.swap_remove(i);
        self.evictions += 1;
    }
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    /// A chain of block hashes: the first `shared` blocks of family `family`'s text, then
    /// `fresh` blocks of its own (prompts of one family share prefixes of any length).
    fn prompt(family: u64, shared: usize, seed: u64, fresh: usize) -> Vec<u64> {
        let text = format!("{:064}", family * 1_000_003).repeat(40)[..shared * 64].to_string()
            + &format!("{seed:064}").repeat(fresh);
        crate::request::prompt::block_hashes(text.as_bytes(), 16)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// The table answers every match, length and eviction count exactly as the model.
        #[test]
        fn the_table_answers_as_the_model(
            max_entries in 0usize..60,
            ops in prop::collection::vec(
                (0u8..8, 0u32..4, (0u64..3, 0usize..40), (0u64..1_000, 0usize..30), 0u64..120),
                1..80,
            ),
        ) {
            let mut table = PrefixAffinity::new(max_entries);
            let mut model = Model::new(max_entries);
            for (kind, backend, (family, shared), (seed, fresh), cap) in ops {
                let p = prompt(family, shared, seed, fresh);
                match kind {
                    0..=4 => {
                        table.record(backend, &p);
                        model.record(backend, &p);
                    }
                    5 | 6 => {
                        table.set_backend_capacity(backend, cap);
                        model.set_backend_capacity(backend, cap);
                    }
                    _ => {
                        table.set_max_entries(cap as usize / 2);
                        model.set_max_entries(cap as usize / 2);
                    }
                }
                table.verify().map_err(TestCaseError::fail)?;
                prop_assert_eq!(table.len(), model.entries.len());
                prop_assert_eq!(table.evictions(), model.evictions);
                for b in 0..4 {
                    prop_assert_eq!(table.backend_len(b), model.backend_len(b));
                }
                let mut lengths = Vec::new();
                let other = prompt((family + 1) % 3, shared, seed + 1, 3);
                for query in [p.clone(), prompt(family, 40, seed, 0), other] {
                    table.match_lengths(&query, &mut lengths);
                    prop_assert_eq!(&lengths, &model.match_lengths(&query));
                }
            }
        }
    }
}
