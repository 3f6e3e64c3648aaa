//! Which backend holds each stored Responses API response: the pool's record that lets a
//! follow-up (`previous_response_id`) and `GET /v1/responses/{id}` or its cancel reach the one
//! vLLM server that keeps the response in its memory.
//!
//! A Responses request with `store` (the API's default) is answered with a response id (the
//! stream's terminal event's `response.id`: `response.completed`, `response.incomplete` or
//! `response.failed`; the body's `id` otherwise); the Worker reports it with the lease's release,
//! and the pool records it here against the backend that served it. The book is bounded
//! ([`MAX_RECORDS`] per pool shard, the oldest evicted first) and each record lives
//! [`RECORD_TTL_MS`]; a record whose backend left the pool stays until then and answers "lost"
//! rather than pointing anywhere else, as an id the book does not know does (never another
//! backend's answer). The Durable Object keeps a copy in its SQLite storage
//! (`Effect::PersistResponse`, read back by `Coordinator::restore`), so a restarted coordinator
//! (a deploy, an eviction) still knows where each response is.
//!
//! Every stateful Responses call goes to the pool's shard 0 (`shard::shard_of_request`), so one
//! book per pool holds every record; see that function for why.

use super::{AcquireError, CandidateView, Pool};
use crate::backend::health::HealthState;
use crate::backend::BackendId;
use crate::stream::outcome::StoredResponse;
use std::collections::{HashMap, VecDeque};

/// Most records a pool shard keeps; the oldest goes first.
pub const MAX_RECORDS: usize = 10_000;

/// How long a record lives, ms (a day: a conversation idle longer starts afresh).
pub const RECORD_TTL_MS: u64 = 24 * 60 * 60 * 1000;

/// Longest response id recorded (vLLM's are `resp_` and 32 hex digits); a longer one is not a
/// backend's and is ignored.
pub const MAX_ID_BYTES: usize = 256;

/// The response ids a pool shard recorded, each with the backend holding it.
#[derive(Debug, Default)]
pub struct ResponseBook {
    holders: HashMap<String, Record>,
    /// Ids in the order they were recorded, with the time each was: eviction and expiry go from
    /// the front. An id recorded again leaves a stale entry behind, skipped when it comes up.
    order: VecDeque<(String, u64)>,
}

/// What [`ResponseBook::record`] did, for whoever keeps a durable copy of the book.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// Records older than this (ms) were evicted or expired: a copy should drop them too.
    pub forget_before_ms: Option<u64>,
}

#[derive(Debug, Clone)]
struct Record {
    backend: BackendId,
    owner: Option<String>,
    recorded_ms: u64,
}

impl ResponseBook {
    /// Records that `backend` holds `response` as of `now_ms`. Returns what was recorded
    /// (`None` for an id that cannot be a backend's), with the time before which every record is
    /// now gone when this evicted or expired some.
    pub fn record(
        &mut self,
        response: &StoredResponse,
        backend: &BackendId,
        now_ms: u64,
    ) -> Option<Recorded> {
        let id = response.id.as_str();
        if id.is_empty() || id.len() > MAX_ID_BYTES {
            return None;
        }
        let before = self.holders.len();
        self.expire(now_ms);
        let record = Record {
            backend: backend.clone(),
            owner: response.owner.clone(),
            recorded_ms: now_ms,
        };
        self.holders.insert(id.to_string(), record);
        self.order.push_back((id.to_string(), now_ms));
        while self.holders.len() > MAX_RECORDS {
            self.pop_oldest();
        }
        let dropped = self.holders.len() <= before;
        // Stale order entries (ids recorded again) never outnumber the live ones.
        if self.order.len() > 2 * MAX_RECORDS {
            let holders = &self.holders;
            self.order
                .retain(|(id, at)| holders.get(id).is_some_and(|r| r.recorded_ms == *at));
        }
        let forget_before_ms = match dropped {
            true => self.order.front().map(|(_, at)| *at),
            false => None,
        };
        Some(Recorded { forget_before_ms })
    }

    /// The backend holding `id`, if the book has a live record of it made by `owner` (another
    /// client's response is as unknown as one never made).
    pub fn holder(&self, id: &str, owner: Option<&str>, now_ms: u64) -> Option<&BackendId> {
        self.holders
            .get(id)
            .filter(|r| now_ms.saturating_sub(r.recorded_ms) < RECORD_TTL_MS)
            .filter(|r| r.owner.as_deref() == owner)
            .map(|r| &r.backend)
    }

    /// Live records.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    /// Whether the book holds no record.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    fn expire(&mut self, now_ms: u64) {
        while let Some((_, at)) = self.order.front() {
            if now_ms.saturating_sub(*at) < RECORD_TTL_MS {
                break;
            }
            self.pop_oldest();
        }
    }

    /// Drops the oldest entry, and its record if the entry is the record's latest.
    fn pop_oldest(&mut self) {
        if let Some((id, at)) = self.order.pop_front() {
            if self.holders.get(&id).is_some_and(|r| r.recorded_ms == at) {
                self.holders.remove(&id);
            }
        }
    }
}

impl Pool {
    /// Records that `backend` holds the stored `response` (reported with a lease's release).
    pub fn record_response(
        &mut self,
        response: &StoredResponse,
        backend: &BackendId,
        now_ms: u64,
    ) -> Option<Recorded> {
        self.responses.record(response, backend, now_ms)
    }

    /// The slot of the backend holding the stored response `id`: the only backend a request
    /// naming it as `previous_response_id` may go to. The response is lost
    /// ([`AcquireError::ResponseNotFound`]) when the pool has no live record of it, when the
    /// backend that holds it left the pool, or when that backend is down (a vLLM server keeps
    /// stored responses in its memory: one that fails its probes has probably restarted).
    pub(super) fn holder_slot(
        &self,
        id: &str,
        owner: Option<&str>,
        now_ms: u64,
    ) -> Result<u32, AcquireError> {
        let lost = || AcquireError::ResponseNotFound { id: id.to_string() };
        let backend = self.responses.holder(id, owner, now_ms).ok_or_else(lost)?;
        let slot = *self.index.get(backend).ok_or_else(lost)?;
        let entry = self.slots[slot as usize].entry.as_ref().ok_or_else(lost)?;
        if entry.health.state == HealthState::Unhealthy {
            return Err(lost());
        }
        Ok(slot)
    }

    /// Where to send `GET /v1/responses/{id}` and its cancel for `owner`: the backend holding
    /// `id`, by the rule of [`Pool::holder_slot`].
    pub fn response_holder(
        &self,
        id: &str,
        owner: Option<&str>,
        now_ms: u64,
    ) -> Result<CandidateView, AcquireError> {
        let slot = self.holder_slot(id, owner, now_ms)?;
        match &self.slots[slot as usize].entry {
            Some(entry) => Ok(entry.candidate_view()),
            None => Err(AcquireError::ResponseNotFound { id: id.to_string() }),
        }
    }

    /// Stored responses the pool knows the holder of.
    pub fn recorded_responses(&self) -> usize {
        self.responses.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(id: &str) -> BackendId {
        BackendId(id.to_string())
    }

    fn r(id: impl Into<String>) -> StoredResponse {
        StoredResponse {
            id: id.into(),
            owner: None,
        }
    }

    #[test]
    fn a_recorded_id_names_its_backend_until_it_expires() {
        let mut book = ResponseBook::default();
        let first = book.record(&r("resp_1"), &b("a"), 1_000);
        assert_eq!(
            first,
            Some(Recorded {
                forget_before_ms: None
            })
        );
        assert_eq!(book.holder("resp_1", None, 2_000), Some(&b("a")));
        assert_eq!(book.holder("resp_2", None, 2_000), None);
        assert_eq!(book.holder("resp_1", None, 1_000 + RECORD_TTL_MS), None);
        // Recording later expires it for good.
        let later = book
            .record(&r("resp_3"), &b("b"), 1_000 + RECORD_TTL_MS)
            .unwrap();
        assert_eq!(later.forget_before_ms, Some(1_000 + RECORD_TTL_MS));
        assert_eq!(book.len(), 1);
    }

    #[test]
    fn the_book_is_bounded_and_evicts_the_oldest() {
        let mut book = ResponseBook::default();
        for i in 0..MAX_RECORDS + 5 {
            book.record(&r(format!("resp_{i}")), &b("a"), i as u64);
        }
        assert_eq!(book.len(), MAX_RECORDS);
        assert_eq!(book.holder("resp_0", None, 10), None);
        assert_eq!(book.holder("resp_4", None, 10), None);
        assert_eq!(book.holder("resp_5", None, 10), Some(&b("a")));
        let newest = format!("resp_{}", MAX_RECORDS + 4);
        assert_eq!(book.holder(&newest, None, 10), Some(&b("a")));
        // One more evicts the record of time 5: a durable copy drops what is older than 6.
        let extra = book.record(&r("resp_extra"), &b("a"), 99_999).unwrap();
        assert_eq!(extra.forget_before_ms, Some(6));
        assert_eq!(book.holder("resp_5", None, 10), None);
    }

    #[test]
    fn an_id_recorded_again_keeps_its_newest_holder_and_the_order_stays_bounded() {
        let mut book = ResponseBook::default();
        for t in 0..(3 * MAX_RECORDS) as u64 {
            let backend = if t % 2 == 0 { "a" } else { "b" };
            book.record(&r("resp_same"), &b(backend), t);
        }
        assert_eq!(book.len(), 1);
        assert!(book.order.len() <= 2 * MAX_RECORDS);
        let last = (3 * MAX_RECORDS - 1) as u64;
        assert_eq!(book.holder("resp_same", None, last), Some(&b("b")));
    }

    #[test]
    fn a_record_answers_only_the_client_that_made_it() {
        let mut book = ResponseBook::default();
        let mine = StoredResponse {
            id: "resp_mine".into(),
            owner: Some("key-a".into()),
        };
        book.record(&mine, &b("a"), 0);
        assert_eq!(book.holder("resp_mine", Some("key-a"), 1), Some(&b("a")));
        assert_eq!(book.holder("resp_mine", Some("key-b"), 1), None);
        assert_eq!(book.holder("resp_mine", None, 1), None);
    }

    #[test]
    fn empty_and_oversized_ids_are_not_recorded() {
        let mut book = ResponseBook::default();
        assert_eq!(book.record(&r(""), &b("a"), 0), None);
        assert_eq!(
            book.record(&r("x".repeat(MAX_ID_BYTES + 1)), &b("a"), 0),
            None
        );
        assert!(book.is_empty());
    }
}
