//! An isolate's guess of the backend a pool shard will choose, so the Worker can send the
//! request's backend fetch beside its lease call instead of after it (`ROUTE_AHEAD`).
//!
//! The pool still decides: a fetch sent ahead is kept only when the grant names the backend it
//! went to, and is aborted otherwise, before anything of it reaches the client, so every request
//! is served by the backend its pool chose. What the guess changes is only when the fetch starts.
//! A guess is made from this isolate's own grants, per pool shard:
//!
//! - the backend granted to an earlier request sharing the longest sampled prompt prefix with
//!   this one (block indices `2^k - 1` and each request's last block: a conversation's next turn
//!   finds its history's backend), else the best alternative the shard weighed for the last
//!   request (its receipt's: with that request placed, where a request with nothing cached most
//!   likely goes next), else the backend granted to the last request whose prefix was new to the
//!   book;
//! - only from a grant at most [`FRESH_MS`] old (the backend's URL and key come from it), and not
//!   once a guess of it was wrong, until a grant names it again;
//! - never a backend removed, drained or patched since: every grant carries its shard's roster
//!   number, which moves on when a backend leaves service or changes how it is called, and a
//!   number other than the one last heard makes the book forget every backend it knew of the pool
//!   ([`GuessBook::roster`]); the isolate that deleted or drained a backend forgets it at once
//!   ([`GuessBook::forget_backend`]). So a removed backend gets a prompt sent ahead only from an
//!   isolate that has had no answer from the pool since the removal, and only by the requests
//!   that isolate starts before that answer comes back (one lease round trip), not for
//!   [`FRESH_MS`];
//! - not for [`BUSY_HOLD_MS`] after the shard queued, refused, or paired a request
//!   (disaggregated), when a fetch sent ahead would land on a full backend or the wrong role;
//! - only while the shard's wrong guesses among its last [`WINDOW`], plus the fetches sent ahead
//!   to it that have not been settled yet, are at most [`MAX_MISSES`]. Guesses are scored whether
//!   or not a fetch was sent, so a shard whose choices this isolate cannot predict stops being
//!   sent ahead, and starts again once its guesses come right. A fetch that went out counts as
//!   right only when it was kept (the grant named its backend at once, unpaired); refused,
//!   queued, paired or granted elsewhere, it counts as wrong. A guess no fetch went out on counts
//!   as right when the shard chose it or, under `predicted_latency` (the one policy that prices a
//!   re-send), weighed it as its best alternative within a re-send's round trip of its choice by
//!   the receipt's predicted times to first token (the policy's own score also weighs queue,
//!   decode and harm: an approximation, for the window only).
//!
//! Every fetch sent ahead is either settled (kept or scored wrong) or counted pending, so with
//! requests in flight at once the window still holds: no fetch is sent while the wrong ones and
//! the pending ones together reach [`MAX_MISSES`] + 1, and of any [`WINDOW`] consecutive settled
//! guesses of a shard at most [`MAX_MISSES`] + 1 sent a fetch in vain (a request that hangs up
//! while its fetch is pending is not scored). An aborted fetch costs its backend at most what it
//! computed before the abort: until the lease call's answer, or the pool's first word that it
//! queued the request (it says so at once to a call with a fetch sent ahead).

use crate::backend::BackendId;
use crate::pool::CandidateView;
use std::collections::{HashMap, VecDeque};

/// How old (ms) a grant may be for its backend to be guessed.
pub const FRESH_MS: u64 = 5_000;
/// How long (ms) after a queued, refused or paired request no fetch is sent ahead.
pub const BUSY_HOLD_MS: u64 = 2_000;
/// The guesses scored per shard.
pub const WINDOW: u32 = 16;
/// Most wrong guesses among the last [`WINDOW`] for fetches to be sent ahead.
pub const MAX_MISSES: u32 = 4;
/// Most prefix entries kept per place (oldest forgotten first).
pub const MAX_PREFIXES: usize = 1_024;
/// Most places (pool shard and model) kept (a few MB in all); a new place past it takes the
/// place of the one granted least recently among those with no fetch pending, so the bound on
/// fetches out per place holds however many places an isolate sees.
pub const MAX_SHARDS: usize = 64;

/// What an isolate knows of its pool shards' choices.
#[derive(Debug, Default)]
pub struct GuessBook {
    shards: HashMap<Place, ShardBook>,
}

/// Where a request asks: a pool shard, for a model (a pool's backends may serve different
/// models, and a request for one never goes to a backend without it).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Place {
    /// The pool.
    pub pool: String,
    /// Its coordinator shard.
    pub shard: u32,
    /// The model asked for.
    pub model: String,
}

impl Place {
    /// `pool`'s `shard`, for `model`.
    pub fn new(pool: &str, shard: u32, model: &str) -> Place {
        Place {
            pool: pool.to_string(),
            shard,
            model: model.to_string(),
        }
    }
}

/// One shard's book.
#[derive(Debug, Default)]
struct ShardBook {
    /// Backends seen in grants: how to call them, and when.
    backends: HashMap<BackendId, (CandidateView, u64)>,
    /// Sampled prefix hashes to the backend last granted for them.
    prefixes: HashMap<u64, BackendId>,
    /// Insertion order of `prefixes`, for forgetting.
    order: VecDeque<u64>,
    /// The backend granted to the last request whose prefix was new to the book.
    cold: Option<BackendId>,
    /// Until when (ms) nothing is sent ahead.
    hold_until_ms: u64,
    /// The last [`WINDOW`] guesses, newest in bit 0: 1 for a wrong one.
    misses: u32,
    /// Fetches sent ahead to this shard and not settled yet.
    pending: u32,
    /// When (ms) it last learned from a grant.
    last_grant_ms: u64,
    /// The shard's roster number as its last answer gave it ([`GuessBook::roster`]).
    roster: Option<u32>,
}

/// A guess: the backend, and whether a fetch may be sent to it ahead of the grant.
#[derive(Clone, Debug, PartialEq)]
pub struct Guess {
    /// The backend the shard is expected to choose.
    pub backend: CandidateView,
    /// Whether the shard's record allows sending ahead now (else the guess is only scored).
    pub send: bool,
}

/// What a grant said, for [`GuessBook::granted`].
pub struct Granted<'a> {
    /// The chosen backend.
    pub backend: &'a CandidateView,
    /// Whether it is a disaggregated pair (never guessed).
    pub paired: bool,
    /// Whether the request waited in the shard's queue.
    pub queued: bool,
    /// The best alternative the shard weighed (its receipt's), if it is among the grant's
    /// candidates: where the next request with nothing cached most likely goes, now that the
    /// chosen backend has this one.
    pub alt: Option<&'a CandidateView>,
    /// How much later (ms) the shard predicted the first token on `alt` than on the chosen
    /// backend (its receipt's), for scoring a guess no fetch went out on.
    pub alt_margin_ms: Option<u32>,
    /// Whether the shard's policy prices a re-send (`predicted_latency`).
    pub prices_resend: bool,
}

/// A guess made before a grant, to score against it.
#[derive(Clone, Copy, Debug)]
pub struct Scored<'a> {
    /// The backend guessed.
    pub backend: &'a BackendId,
    /// Whether a fetch went to it (the shard then priced it: the grant is the truth).
    pub sent: bool,
    /// The round trip a re-send would have cost, which the shard would have priced had a fetch
    /// gone: a guess no fetch went out on counts as right when it was the shard's best
    /// alternative within that much of the chosen backend.
    pub resend_ms: u32,
}

impl GuessBook {
    /// An empty book.
    pub fn new() -> Self {
        Self::default()
    }

    /// The backend expected to be chosen at `place` for a request with `block_hashes`.
    pub fn guess(&self, place: &Place, block_hashes: &[u64], now_ms: u64) -> Option<Guess> {
        let book = self.shards.get(place)?;
        let fresh = |id: &BackendId| {
            book.backends
                .get(id)
                .filter(|(_, seen)| now_ms.saturating_sub(*seen) <= FRESH_MS)
        };
        let (view, _) = sampled(block_hashes)
            .filter_map(|h| book.prefixes.get(&h))
            .chain(book.cold.as_ref())
            .find_map(fresh)?;
        let send = now_ms >= book.hold_until_ms && book.wrong() + book.pending <= MAX_MISSES;

        Some(Guess {
            backend: view.clone(),
            send,
        })
    }

    /// Learns from a grant at `place` for a request with `block_hashes`, and scores `guessed`
    /// (what [`GuessBook::guess`] said before it, if anything) against it.
    pub fn granted(
        &mut self,
        place: &Place,
        block_hashes: &[u64],
        grant: Granted<'_>,
        guessed: Option<Scored<'_>>,
        now_ms: u64,
    ) {
        if self.shards.len() >= MAX_SHARDS && !self.shards.contains_key(place) {
            // Forgotten: the place granted least recently with no fetch pending. When every
            // place has one pending, this grant is not learned (its place has no fetch out).
            let idle = self
                .shards
                .iter()
                .filter(|(_, b)| b.pending == 0)
                .min_by_key(|(_, b)| b.last_grant_ms)
                .map(|(p, _)| p.clone());
            match idle {
                Some(old) => {
                    self.shards.remove(&old);
                }
                None => return,
            }
        }
        let book = self.shards.entry(place.clone()).or_default();
        book.last_grant_ms = now_ms;
        if let Some(g) = guessed {
            let chosen = g.backend == &grant.backend.id;
            let right = match g.sent {
                true => {
                    book.pending = book.pending.saturating_sub(1);
                    chosen && !grant.queued && !grant.paired
                }
                false => {
                    chosen
                        || (grant.prices_resend
                            && grant.alt.is_some_and(|a| &a.id == g.backend)
                            && grant.alt_margin_ms.is_some_and(|m| m <= g.resend_ms))
                }
            };
            book.score(!right);
            // Not guessed again until a grant names it: a drained, removed or full backend
            // costs one fetch in vain per isolate and lease round trip, not one per request.
            if !right && !chosen {
                book.backends.remove(g.backend);
            }
        }
        if grant.paired || grant.queued {
            book.hold_until_ms = now_ms.saturating_add(BUSY_HOLD_MS);
        }
        if grant.paired {
            return;
        }
        let id = grant.backend.id.clone();
        let known = sampled(block_hashes).any(|h| book.prefixes.contains_key(&h));
        match grant.alt {
            Some(alt) => {
                book.cold = Some(alt.id.clone());
                book.backends.insert(alt.id.clone(), (alt.clone(), now_ms));
            }
            None if !known => book.cold = Some(id.clone()),
            None => {}
        }
        for h in sampled(block_hashes) {
            if book.prefixes.insert(h, id.clone()).is_none() {
                book.order.push_back(h);
            }
        }
        while book.order.len() > MAX_PREFIXES {
            if let Some(old) = book.order.pop_front() {
                book.prefixes.remove(&old);
            }
        }
        book.backends.insert(id, (grant.backend.clone(), now_ms));
        book.backends
            .retain(|_, (_, seen)| now_ms.saturating_sub(*seen) <= FRESH_MS);
    }

    /// The shard at `place` answered with roster number `roster` (a grant's [`Grant::roster`]):
    /// when the book heard another number from it before, a backend left service or changed how
    /// it is called meanwhile, and every backend known of the pool, on any shard and for any
    /// model, is forgotten (guesses start again from the next grants).
    ///
    /// [`Grant::roster`]: crate::pool::Grant::roster
    pub fn roster(&mut self, place: &Place, roster: u32) {
        let heard = self.shards.get(place).and_then(|b| b.roster);
        if heard.is_some_and(|r| r != roster) {
            for (p, book) in &mut self.shards {
                if p.pool == place.pool {
                    book.forget_backends();
                }
            }
        }
        if let Some(book) = self.shards.get_mut(place) {
            book.roster = Some(roster);
        }
    }

    /// `backend` of `pool` was removed or drained by this isolate's admin call: never guessed
    /// again until a grant names it.
    pub fn forget_backend(&mut self, pool: &str, backend: &BackendId) {
        for (p, book) in &mut self.shards {
            if p.pool == pool {
                book.backends.remove(backend);
            }
        }
    }

    /// A fetch is being sent ahead to `place`: pending until it is settled.
    pub fn sending(&mut self, place: &Place) {
        if let Some(book) = self.shards.get_mut(place) {
            book.pending += 1;
        }
    }

    /// The shard refused a request, queued it, or could not be asked: nothing is sent ahead to it
    /// for a while, and a fetch that went out on it (`sent`) counts as a wrong guess.
    pub fn busy(&mut self, place: &Place, sent: bool, now_ms: u64) {
        if let Some(book) = self.shards.get_mut(place) {
            book.hold_until_ms = now_ms.saturating_add(BUSY_HOLD_MS);
            if sent {
                book.pending = book.pending.saturating_sub(1);
                book.score(true);
            }
        }
    }

    /// A fetch sent ahead to `place` will not be settled (the client left first): no longer
    /// pending, and not scored.
    pub fn abandoned(&mut self, place: &Place) {
        if let Some(book) = self.shards.get_mut(place) {
            book.pending = book.pending.saturating_sub(1);
        }
    }
}

impl ShardBook {
    /// Forgets every backend and what pointed at one (the scores stay).
    fn forget_backends(&mut self) {
        self.backends.clear();
        self.prefixes.clear();
        self.order.clear();
        self.cold = None;
    }

    fn score(&mut self, wrong: bool) {
        let mask = (1u32 << WINDOW) - 1;
        self.misses = ((self.misses << 1) | u32::from(wrong)) & mask;
    }

    fn wrong(&self) -> u32 {
        self.misses.count_ones()
    }
}

/// The prefix hashes a request is filed and looked up under, longest first: its last block, then
/// blocks `2^k - 1` from the largest below it down to the first.
fn sampled(block_hashes: &[u64]) -> impl Iterator<Item = u64> + '_ {
    let n = block_hashes.len();
    let last = n.checked_sub(1);
    let top = match n {
        0 => 0,
        _ => usize::BITS - n.leading_zeros(),
    };
    let powers = (0..top)
        .rev()
        .map(|k| (1usize << k) - 1)
        .filter(move |&i| Some(i) != last && i < n);
    last.into_iter().chain(powers).map(|i| block_hashes[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(id: &str) -> CandidateView {
        CandidateView {
            id: BackendId(id.into()),
            url: format!("http://{id}"),
            ..CandidateView::default()
        }
    }

    fn sent_ok(id: &BackendId) -> Scored<'_> {
        sent(id)
    }

    fn sent(id: &BackendId) -> Scored<'_> {
        Scored {
            backend: id,
            sent: true,
            resend_ms: 50,
        }
    }

    fn at(shard: u32) -> Place {
        Place::new("p", shard, "m")
    }

    fn grant(v: &CandidateView) -> Granted<'_> {
        Granted {
            backend: v,
            paired: false,
            queued: false,
            alt: None,
            alt_margin_ms: None,
            prices_resend: true,
        }
    }

    /// Issue 42, item 11: a force-deleted backend was still guessed, and sent whole prompts, for
    /// up to [`FRESH_MS`] by every place (shard, model) of the pool that had learned it.
    #[test]
    fn a_roster_change_forgets_every_backend_of_the_pool_at_once() {
        let mut book = GuessBook::new();
        let (a, b) = (view("a"), view("b"));
        let other_model = Place::new("p", 1, "m2");
        let other_pool = Place::new("q", 0, "m");
        for place in [at(0), other_model.clone(), other_pool.clone()] {
            book.roster(&place, 7);
            book.granted(&place, &[1, 2], grant(&a), None, 0);
            book.roster(&place, 7);
        }
        book.granted(&at(0), &[5, 6], grant(&b), None, 10);
        assert_eq!(
            book.guess(&other_model, &[1, 2], 20).unwrap().backend.id.0,
            "a"
        );
        // Shard 0 answers after `a` was removed: nothing known of pool `p` is guessed any more,
        // on any shard or model; another pool keeps its book.
        book.roster(&at(0), 8);
        assert_eq!(book.guess(&at(0), &[1, 2], 30), None);
        assert_eq!(book.guess(&at(0), &[5, 6], 30), None);
        assert_eq!(book.guess(&other_model, &[1, 2], 30), None);
        assert_eq!(
            book.guess(&other_pool, &[1, 2], 30).unwrap().backend.id.0,
            "a"
        );
        // The same number again changes nothing; the book learns again from the next grants.
        book.granted(&at(0), &[5, 6], grant(&b), None, 40);
        book.roster(&at(0), 8);
        assert_eq!(book.guess(&at(0), &[5, 6], 50).unwrap().backend.id.0, "b");
        // The isolate that deletes a backend forgets it at once.
        book.forget_backend("p", &BackendId("b".into()));
        assert_eq!(book.guess(&at(0), &[5, 6], 60), None);
    }

    #[test]
    fn samples_the_last_block_and_powers_of_two() {
        let hashes: Vec<u64> = (0..10).collect();
        assert_eq!(sampled(&hashes).collect::<Vec<_>>(), vec![9, 7, 3, 1, 0]);
        assert_eq!(sampled(&[5]).collect::<Vec<_>>(), vec![5]);
        assert_eq!(sampled(&[]).count(), 0);
        let eight: Vec<u64> = (0..8).collect();
        assert_eq!(sampled(&eight).collect::<Vec<_>>(), vec![7, 3, 1, 0]);
    }

    #[test]
    fn guesses_the_backend_of_the_longest_shared_prefix_then_the_last_cold_one() {
        let mut book = GuessBook::new();
        let (a, b) = (view("a"), view("b"));
        assert_eq!(book.guess(&at(0), &[1, 2, 3], 0), None);
        book.granted(&at(0), &[1, 2, 3, 4], grant(&a), None, 0);
        book.granted(&at(0), &[9, 8], grant(&b), None, 10);
        // Shares blocks 0..4 with the first request: its backend.
        let g = book.guess(&at(0), &[1, 2, 3, 4, 5, 6], 20).unwrap();
        assert_eq!(g.backend.id.0, "a");
        assert!(g.send);
        // Nothing shared: the last cold grant's backend.
        assert_eq!(book.guess(&at(0), &[7], 20).unwrap().backend.id.0, "b");
        // Another shard knows nothing, nor does another model's book.
        assert_eq!(book.guess(&at(1), &[1, 2], 20), None);
        assert_eq!(
            book.guess(&Place::new("p", 0, "other"), &[1, 2, 3, 4], 20),
            None
        );
    }

    #[test]
    fn a_new_prompt_is_guessed_to_the_last_grants_best_alternative() {
        let mut book = GuessBook::new();
        let (a, b) = (view("a"), view("b"));
        let with_alt = Granted {
            alt: Some(&b),
            ..grant(&a)
        };
        book.granted(&at(0), &[1, 2], with_alt, None, 0);
        assert_eq!(book.guess(&at(0), &[9], 1).unwrap().backend.id.0, "b");
        assert_eq!(book.guess(&at(0), &[1, 2, 3], 1).unwrap().backend.id.0, "a");
    }

    #[test]
    fn old_grants_are_not_guessed() {
        let mut book = GuessBook::new();
        book.granted(&at(0), &[1], grant(&view("a")), None, 0);
        assert!(book.guess(&at(0), &[1], FRESH_MS).is_some());
        assert_eq!(book.guess(&at(0), &[1], FRESH_MS + 1), None);
    }

    #[test]
    fn a_busy_shard_is_scored_but_not_sent_ahead() {
        let mut book = GuessBook::new();
        let a = view("a");
        book.granted(&at(0), &[1], grant(&a), None, 0);
        let queued = Granted {
            queued: true,
            ..grant(&a)
        };
        book.granted(&at(0), &[1], queued, None, 100);
        assert!(
            !book
                .guess(&at(0), &[1], 100 + BUSY_HOLD_MS - 1)
                .unwrap()
                .send
        );
        assert!(book.guess(&at(0), &[1], 100 + BUSY_HOLD_MS).unwrap().send);
        book.busy(&at(0), false, 3_000);
        assert!(!book.guess(&at(0), &[1], 3_001).unwrap().send);
    }

    #[test]
    fn paired_grants_are_never_guessed() {
        let mut book = GuessBook::new();
        let a = view("a");
        let paired = Granted {
            paired: true,
            ..grant(&a)
        };
        book.granted(&at(0), &[1], paired, None, 0);
        assert_eq!(book.guess(&at(0), &[1], 1), None);
    }

    #[test]
    fn stops_sending_ahead_after_too_many_wrong_guesses_and_starts_again() {
        let mut book = GuessBook::new();
        let (a, b) = (view("a"), view("b"));
        book.granted(&at(0), &[1], grant(&a), None, 0);
        let a_id = a.id.clone();
        // The shard keeps choosing b where a was guessed, then a again (alternating cold
        // requests): every other guess wrong.
        let mut sent_wrong = 0;
        for i in 0..200u64 {
            let g = book.guess(&at(0), &[1000 + i], i).unwrap();
            let chosen = if i % 2 == 0 { &b } else { &a };
            if g.send && g.backend.id != chosen.id {
                sent_wrong += 1;
            }
            book.granted(
                &at(0),
                &[1000 + i],
                grant(chosen),
                Some(sent(&g.backend.id)),
                i,
            );
        }
        // Half the guesses are wrong: past the bound, so almost nothing is sent ahead.
        assert!(sent_wrong <= MAX_MISSES + 1, "{sent_wrong} sent in vain");
        // Right guesses bring it back once the window holds few enough wrong ones.
        for i in 200..200 + u64::from(WINDOW) {
            book.granted(&at(0), &[1], grant(&a), Some(sent(&a_id)), i);
        }
        assert!(book.guess(&at(0), &[1], 300).unwrap().send);
    }

    #[test]
    fn a_backend_guessed_wrong_is_not_guessed_until_granted_again() {
        let mut book = GuessBook::new();
        let (a, b) = (view("a"), view("b"));
        book.granted(&at(0), &[1, 2, 3, 4], grant(&a), None, 0);
        book.granted(&at(0), &[7, 8], grant(&b), None, 1);
        let g = book.guess(&at(0), &[1, 2, 3, 4, 5], 2).unwrap();
        assert_eq!(g.backend.id.0, "a");
        // The pool chose b for a prompt a held (a was drained, say).
        book.granted(
            &at(0),
            &[1, 2, 3, 4, 5],
            grant(&b),
            Some(sent(&g.backend.id)),
            3,
        );
        // a's other prefixes now fall through to what is known: b.
        assert_eq!(
            book.guess(&at(0), &[1, 2, 3, 4, 6, 9], 4)
                .unwrap()
                .backend
                .id
                .0,
            "b"
        );
        assert_eq!(
            book.guess(&at(0), &[1, 2, 3, 4], 4).unwrap().backend.id.0,
            "b"
        );
        book.granted(&at(0), &[1, 2, 3, 4], grant(&a), None, 5);
        assert_eq!(
            book.guess(&at(0), &[1, 2, 3, 4], 6).unwrap().backend.id.0,
            "a"
        );
    }

    #[test]
    fn a_guess_no_fetch_went_on_is_right_when_the_shard_weighed_it_within_a_resend() {
        let mut book = GuessBook::new();
        let (a, b) = (view("a"), view("b"));
        book.granted(&at(0), &[1], grant(&a), None, 0);
        let shadow = |id| Scored {
            backend: id,
            sent: false,
            resend_ms: 50,
        };
        let near = |margin| Granted {
            alt: Some(&a),
            alt_margin_ms: Some(margin),
            ..grant(&b)
        };
        // Guessed a, the shard chose b with a 30 ms behind: a fetch sent to a would have stayed.
        for i in 0..(u64::from(WINDOW)) {
            book.granted(&at(0), &[1], near(30), Some(shadow(&a.id)), i);
        }
        assert!(book.guess(&at(0), &[1], 20).unwrap().send);
        // 80 ms behind: wrong, and after enough of those nothing is sent.
        for i in 0..(u64::from(MAX_MISSES) + 1) {
            book.granted(&at(0), &[1], grant(&a), None, 30 + i);
            book.granted(&at(0), &[1], near(80), Some(shadow(&a.id)), 30 + i);
        }
        assert!(!book.guess(&at(0), &[2], 40).unwrap().send);
    }

    #[test]
    fn fetches_in_flight_count_against_the_window_until_settled() {
        let mut book = GuessBook::new();
        let a = view("a");
        book.granted(&at(0), &[1], grant(&a), None, 0);
        // Requests arriving together: each fetch sent is pending, so only MAX_MISSES + 1 go.
        let mut sent = 0;
        for _ in 0..50 {
            if book.guess(&at(0), &[1], 1).unwrap().send {
                book.sending(&at(0));
                sent += 1;
            }
        }
        assert_eq!(sent, MAX_MISSES + 1);
        // Settled as kept, they free the window again.
        for _ in 0..sent {
            book.granted(&at(0), &[1], grant(&a), Some(sent_ok(&a.id)), 2);
        }
        assert!(book.guess(&at(0), &[1], 3).unwrap().send);
        // A hang-up frees its place without a score.
        book.sending(&at(0));
        book.abandoned(&at(0));
        assert_eq!(book.shards[&at(0)].pending, 0);
    }

    #[test]
    fn a_fetch_sent_to_a_shard_that_queues_or_refuses_is_a_wrong_guess() {
        let mut book = GuessBook::new();
        let a = view("a");
        book.granted(&at(0), &[1], grant(&a), None, 0);
        for i in 0..u64::from(MAX_MISSES + 1) {
            book.sending(&at(0));
            let queued = Granted {
                queued: true,
                ..grant(&a)
            };
            book.granted(&at(0), &[1], queued, Some(sent_ok(&a.id)), i * 10_000);
        }
        assert_eq!(book.shards[&at(0)].misses.count_ones(), MAX_MISSES + 1);
        book.sending(&at(0));
        book.busy(&at(0), true, 100_000);
        assert_eq!(book.shards[&at(0)].misses.count_ones(), MAX_MISSES + 2);
        assert_eq!(book.shards[&at(0)].pending, 0);
    }

    #[test]
    fn the_prefix_table_is_bounded() {
        let mut book = GuessBook::new();
        let a = view("a");
        for i in 0..(MAX_PREFIXES as u64 + 100) {
            book.granted(&at(0), &[i], grant(&a), None, 0);
        }
        let shard = &book.shards[&at(0)];
        assert_eq!(shard.prefixes.len(), MAX_PREFIXES);
        assert_eq!(shard.order.len(), MAX_PREFIXES);
    }

    #[test]
    fn past_its_places_the_book_forgets_the_idlest_and_never_one_with_a_fetch_out() {
        let mut book = GuessBook::new();
        let b = view("b");
        let h = [1u64, 2, 3];
        for shard in 0..MAX_SHARDS as u32 {
            book.granted(&at(shard), &h, grant(&b), None, 1_000 + u64::from(shard));
        }
        // Place 0 (granted first) has a fetch out; place 1 is then the least recently granted.
        book.sending(&at(0));
        book.granted(&at(MAX_SHARDS as u32), &h, grant(&b), None, 2_000);
        assert_eq!(book.shards.len(), MAX_SHARDS);
        assert!(
            book.shards.contains_key(&at(0)),
            "a place with a fetch out is kept"
        );
        assert!(
            !book.shards.contains_key(&at(1)),
            "the idlest place is forgotten"
        );
        assert!(
            book.guess(&at(2), &h, 2_000).is_some(),
            "the others still guess"
        );
        assert_eq!(book.shards[&at(0)].pending, 1);
        // With a fetch out at every place, a new place's grant is not learned.
        for shard in 0..=MAX_SHARDS as u32 {
            book.sending(&at(shard));
        }
        book.granted(&at(1_000), &h, grant(&b), None, 3_000);
        assert_eq!(book.shards.len(), MAX_SHARDS);
        assert!(!book.shards.contains_key(&at(1_000)));
    }
}
