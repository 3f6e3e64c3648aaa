//! The pool's time card (`Pool::time_card`, a dry run of the acquire's pricing on three made-up
//! requests, plus the admission queue): computed for the directory after each probe round on
//! shard 0, and carried by every grant, computed at most every [`GRANT_CARD_MS`] and kept
//! meanwhile, so an isolate's copy of the pools it sends to is as fresh as its last grant.
//!
//! The card's queue wait is the admission queue's current delay (how long its oldest entry has
//! waited): in a first-come queue with steady arrivals, what a request arriving now can expect.

use super::Coordinator;
use crate::region::TimeCard;

/// Longest a grant's card is reused before it is computed again, in ms.
pub const GRANT_CARD_MS: u64 = 250;

/// A card whose request with nothing to prefill waits this long, or that shows a queue, is busy:
/// once the pool's last lease ends, shard 0 publishes a new card at once, so isolates do not keep
/// avoiding an idle pool until the next probe round.
pub const BUSY_CARD_MS: u32 = 200;

impl Coordinator {
    /// This pool's card now.
    pub fn card_now(&mut self, now_ms: u64) -> TimeCard {
        let q = &self.room.queue;
        let queued = q.len() as u32;
        let wait = q.oldest_arrival_ms().map_or(0, |a| {
            now_ms.saturating_sub(a).min(u64::from(u32::MAX)) as u32
        });
        self.pool.time_card(now_ms, queued, wait)
    }

    /// The card a grant carries: the kept one while it is fresh, else a new one.
    pub fn grant_card(&mut self, now_ms: u64) -> TimeCard {
        match &self.grant_card {
            Some(card) if now_ms.saturating_sub(card.at_ms) < GRANT_CARD_MS => card.clone(),
            _ => self.fresh_card(now_ms),
        }
    }

    /// A new card, kept for the grants that follow.
    fn fresh_card(&mut self, now_ms: u64) -> TimeCard {
        let card = self.card_now(now_ms);
        self.grant_card = Some(card.clone());
        card
    }

    /// The card for the directory (shard 0 only: the others publish none).
    pub(super) fn directory_card(&mut self, now_ms: u64) -> Option<TimeCard> {
        if self.shard != 0 {
            return None;
        }
        let card = self.fresh_card(now_ms);
        self.published_busy = card.queued > 0 || card.cached_ms.is_none_or(|ms| ms >= BUSY_CARD_MS);
        Some(card)
    }

    /// After leases ended: a new card for the directory when the last one published was busy and
    /// no lease is left.
    pub(super) fn card_if_idle_now(&mut self, now_ms: u64) -> Option<TimeCard> {
        if !self.published_busy || self.pool.live_leases() > 0 || !self.room.queue.is_empty() {
            return None;
        }
        self.directory_card(now_ms)
    }
}
