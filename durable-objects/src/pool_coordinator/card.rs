//! The pool's time card on its way to the directory: after each probe round, shard 0 computes the
//! card (`routing_core::pool::Pool::time_card`, a dry run of the acquire's pricing) and pushes it to
//! the directory, which lists it with the pool, so every Worker isolate receives it with the pool
//! list it already refreshes in the background. No call on any request's path carries it.
//!
//! Every grant carries the card too, computed at most every [`GRANT_CARD_MS`] and kept meanwhile,
//! so an isolate's copy of the pools it sends to is as fresh as its last grant.
//!
//! The card's queue wait is the admission queue's current delay (how long its oldest entry has
//! waited): in a first-come queue with steady arrivals, what a request arriving now can expect.

use super::*;
use coordinator_protocol::internal_call::internal_request;
use coordinator_protocol::messages::CardAnswer;
use coordinator_protocol::names::{DIRECTORY_BINDING, DIRECTORY_NAME};
use routing_core::region::TimeCard;

/// Longest a grant's card is reused before it is computed again, in ms.
pub(super) const GRANT_CARD_MS: u64 = 250;

/// This pool's card now (the acquire's pricing on three made-up requests, and the queue).
pub(super) fn card_now(l: &mut Live, now: u64) -> TimeCard {
    let q = &l.room.queue;
    let queued = q.len() as u32;
    let wait = q
        .oldest_arrival_ms()
        .map_or(0, |a| now.saturating_sub(a).min(u64::from(u32::MAX)) as u32);
    l.pool.time_card(now, queued, wait)
}

/// The card a grant carries: the kept one while it is fresh, else a new one.
pub(super) fn grant_card(l: &mut Live, now: u64) -> TimeCard {
    match &l.grant_card {
        Some(card) if now.saturating_sub(card.at_ms) < GRANT_CARD_MS => card.clone(),
        _ => {
            let card = card_now(l, now);
            l.grant_card = Some(card.clone());
            card
        }
    }
}

impl PoolCoordinator {
    /// Computes this pool's card and hands it to the directory (shard 0 only; a failure is logged).
    pub(super) async fn publish_card(&self) {
        let Some((name, card)) = self.with(|l| {
            if l.shard != 0 {
                return None;
            }
            let now = now_ms();
            let card = card_now(l, now);
            l.grant_card = Some(card.clone());
            Some((l.name.clone(), card))
        }) else {
            return;
        };
        let result = async {
            let body =
                serde_json::to_string(&card).map_err(|e| ApiError::internal(e.to_string()))?;
            let stub = self
                .env
                .durable_object(DIRECTORY_BINDING)?
                .id_from_name(DIRECTORY_NAME)?
                .get_stub()?;
            let route = Route::PutCard(name.clone());
            let mut resp = stub
                .fetch_with_request(internal_request(&route, None, Some(body))?)
                .await?;
            let answer: CardAnswer = resp.json().await?;
            Ok::<bool, ApiError>(answer.known)
        }
        .await;
        if let Err(e) = result {
            console_error!("pool {name}: cannot publish its time card: {e}");
        }
    }
}
