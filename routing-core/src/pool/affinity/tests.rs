//! Tests of [`super`]: matching, bounds, eviction and the index's consistency.

use super::*;

fn blocks(seed: u64, n: usize) -> Vec<u64> {
    crate::request::prompt::block_hashes(format!("{seed:064}").repeat(n).as_bytes(), 16)
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
        crate::request::prompt::block_hashes(text.as_bytes(), 16)
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

#[test]
fn forgetting_a_prompt_keeps_what_was_held_before_and_other_prompts() {
    let mut a = table(1000, &[100, 100]);
    let p = blocks(1, 40);
    // Another conversation behind the same first 20 blocks, parting mid-chunk.
    let mut q = p[..20].to_vec();
    q.extend(blocks(2, 10).iter().map(|b| b ^ p[19]));
    a.record(0, &q);
    a.record(0, &p);
    a.record(1, &p);
    assert_eq!(lengths_of(&a, &p), vec![40, 40]);
    let evictions = a.evictions();
    // Backend 0 failed the request for `p`; it held the 20 blocks `q` shares before.
    a.forget(0, &p, 20);
    a.verify().unwrap();
    assert_eq!(lengths_of(&a, &p), vec![20, 40]);
    assert_eq!(
        lengths_of(&a, &q)[0],
        30,
        "the other conversation is untouched"
    );
    assert_eq!(
        a.evictions(),
        evictions,
        "a forgotten prompt is not an eviction"
    );
    // Nothing held before: all of it goes; keeping all of it changes nothing.
    a.forget(1, &p, 40);
    a.forget(1, &p, 0);
    a.verify().unwrap();
    assert_eq!(lengths_of(&a, &p), vec![20, 0]);
    // Held up to the middle of a chunk: the entry covering it is cut there.
    let mut b = table(1000, &[100]);
    b.record(0, &p);
    b.forget(0, &p, 18);
    b.verify().unwrap();
    assert_eq!(lengths_of(&b, &p), vec![18]);
    assert_eq!(b.backend_len(0), 18);
}
