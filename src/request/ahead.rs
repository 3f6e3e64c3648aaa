//! A request's backend fetch sent beside its lease call (`ROUTE_AHEAD`), to the backend this
//! isolate expects the pool shard to choose, so the lease call's round trip and the backend's
//! overlap instead of following each other.
//!
//! The pool still decides every request: the fetch sent ahead becomes the request's first attempt
//! only when the grant names its backend (and the grant is not a disaggregated pair); otherwise,
//! and on every other way out (a refusal, a queue, a hang-up, the limiter's refusal), it is
//! aborted before anything of it is read, so nothing of it reaches the client, it is never charged
//! to the client, and the request's attempts go on exactly as without the setting. The guess and
//! its limits (fresh grants only, not while the shard queues or refuses, not while its guesses
//! keep coming out wrong) are `routing_core::pool::guess`'s; this file sends and settles.
//!
//! A request sends at most one fetch ahead, to the first pool it asks that the isolate has a
//! guess for, and only when its rate-limit charge is already settled (no limits, or served ahead of its limiter): the backend is never
//! fetched before the limiter has admitted the request.
//!
//! A backend deleted, drained or changed gets nothing sent ahead from the moment of the change:
//! the isolate that made it forgets the backend at once ([`forget_backend`]), and every other
//! isolate when the shard's next grant carries a new roster number (issue 42, item 11).

use crate::platform::isolate;
use crate::request::forward::attempts::{send, PendingFetch, UpstreamCall};
use routing_core::pool::guess::{Granted, Place, Scored};
use routing_core::pool::{CandidateView, Grant};
use routing_core::request::prompt::SentAhead;
use routing_core::PolicyKind;
use std::cell::{Cell, RefCell};
use worker::AbortSignal;

/// The response header saying what became of a fetch sent ahead: `kept` (it is the answer's
/// first attempt), `missed` (the pool chose another backend, and it was aborted) or `queued` (the
/// pool queued the request, and it was aborted: the request waits its turn like any other).
pub const AHEAD_HEADER: &str = "x-gateway-ahead";

/// One lease call's guess, and the fetch sent on it, if one was.
pub(crate) struct Ahead {
    place: Place,
    /// The backend guessed, as the grant that taught it named it (URL and key included).
    guessed: Option<CandidateView>,
    /// The fetch, until it is kept or aborted.
    sent: RefCell<Option<PendingFetch>>,
    told: Option<SentAhead>,
    resend_ms: u32,
    /// Whether the book has heard how the fetch sent ahead ended.
    settled: Cell<bool>,
}

/// What a request gives [`Ahead::start`].
pub(crate) struct AheadTarget<'a> {
    pub(crate) pool: &'a str,
    pub(crate) shard: u32,
    pub(crate) model: &'a str,
    pub(crate) block_hashes: &'a [u64],
    /// Whether a fetch may be sent at all: `ROUTE_AHEAD` on, none sent for the request yet, the
    /// rate-limit charge settled.
    pub(crate) may_send: bool,
    /// A modelled round trip to the backend (`SIMULATE_NETWORK` only).
    pub(crate) delay_ms: u64,
    /// What a re-send to another backend would add, ms: the pool prices it against the others.
    pub(crate) resend_ms: u32,
}

impl Ahead {
    /// Guesses the shard's choice and, when allowed, sends `body` to it now.
    pub(crate) fn start(
        ask: AheadTarget<'_>,
        call: &UpstreamCall<'_>,
        body: &[u8],
        client_signal: &AbortSignal,
    ) -> Ahead {
        let now = crate::platform::http::now_ms();
        let place = Place::new(ask.pool, ask.shard, ask.model);
        let guess = isolate::with_guess_book(|b| b.borrow().guess(&place, ask.block_hashes, now));
        let sent = match &guess {
            Some(g) if g.send && ask.may_send => {
                // The fetch carries an id of its own (the request's, `-ahead`): when it is aborted
                // and the request is sent again to the same backend (the pool queued it, paired
                // it, or its choice failed and the next candidate is that backend), vLLM may still
                // hold the first id until the abort reaches its engine, and before
                // vllm-project/vllm PR #27987 it answers a second request with the same
                // `X-Request-Id` 400 "already running".
                let ahead_id = format!("{}-ahead", call.request_id);
                let call = UpstreamCall {
                    request_id: &ahead_id,
                    ..*call
                };
                send(&call, &g.backend, body, client_signal, ask.delay_ms).ok()
            }
            _ => None,
        };
        if sent.is_some() {
            isolate::with_guess_book(|b| b.borrow_mut().sending(&place));
        }
        let told = sent.as_ref().map(|s| SentAhead {
            backend: s.backend().0.clone(),
            resend_ms: ask.resend_ms,
        });
        Ahead {
            place,
            guessed: guess.map(|g| g.backend),
            sent: RefCell::new(sent),
            told,
            resend_ms: ask.resend_ms,
            settled: Cell::new(false),
        }
    }

    /// The pool queued the request: what was sent ahead is aborted now, not when the grant
    /// comes (the request waits its turn like any other, and its backend is not computing it
    /// meanwhile).
    pub(crate) fn queued(&self) {
        if let Some(sent) = self.sent.borrow_mut().take() {
            sent.abort();
            self.settled.set(true);
            isolate::with_guess_book(|b| {
                b.borrow_mut()
                    .busy(&self.place, true, crate::platform::http::now_ms())
            });
        }
    }

    /// What the lease call tells the pool: the backend the fetch went to, if one went.
    pub(crate) fn told(&self) -> Option<&SentAhead> {
        self.told.as_ref()
    }

    /// The shard granted `grant` (after `queued`): the book learns it, and the fetch sent ahead
    /// comes back when it went where the grant says, with the header's value.
    pub(crate) fn granted(
        self,
        block_hashes: &[u64],
        grant: &Grant,
        queued: bool,
    ) -> (Option<PendingFetch>, Option<&'static str>) {
        let paired = !grant.decode_candidates.is_empty();
        let Some(first) = grant.candidates.first() else {
            return (None, None);
        };
        isolate::with_guess_book(|b| {
            let mut book = b.borrow_mut();
            // A backend left service or changed since the shard's last grant: forget the pool's
            // backends before learning this grant (issue 42, item 11).
            book.roster(&self.place, grant.roster);
            book.granted(
                &self.place,
                block_hashes,
                Granted {
                    backend: first,
                    paired,
                    queued,
                    alt: grant
                        .receipt
                        .as_ref()
                        .and_then(|r| r.alt.as_ref())
                        .and_then(|alt| grant.candidates.iter().find(|c| &c.id == alt)),
                    alt_margin_ms: grant.receipt.as_ref().and_then(|r| {
                        let alt = r.alt_predicted_ttft_ms?;
                        Some(alt.saturating_sub(r.predicted_ttft_ms))
                    }),
                    prices_resend: grant.policy == PolicyKind::PredictedLatency,
                },
                // Scored once: a fetch aborted when the pool queued the request was already.
                self.guessed
                    .as_ref()
                    .filter(|_| !self.settled.get())
                    .map(|g| Scored {
                        backend: &g.id,
                        sent: self.told.is_some(),
                        resend_ms: self.resend_ms,
                    }),
                crate::platform::http::now_ms(),
            )
        });
        self.settled.set(true);
        // Kept only if it went where the grant says, as the grant says to call it: a backend
        // whose URL or key changed since the guess was learned is sent to again.
        let same_call =
            |view: &CandidateView| view.url == first.url && view.api_key == first.api_key;
        let sent = self.sent.borrow_mut().take();
        match sent {
            // A request the shard queued waited its turn: the fetch sent before it was aborted
            // when the pool first said so (`queued`), and the request is sent again now.
            None if self.told.is_some() => (None, Some("queued")),
            // (A fetch still running when a queued request's grant came, because the grant came
            // before the pool's first answer could say it was queued, is kept like any other if
            // it went where the grant says.)
            Some(sent)
                if !paired
                    && sent.backend() == &first.id
                    && self.guessed.as_ref().is_some_and(same_call) =>
            {
                (Some(sent), Some("kept"))
            }
            Some(sent) => {
                sent.abort();
                (None, Some("missed"))
            }
            None => (None, None),
        }
    }

    /// The shard refused the request or could not be asked: nothing goes ahead to it for a
    /// while (the fetch sent, if any, is aborted as this is dropped).
    pub(crate) fn refused(self) {
        let sent = self.told.is_some() && !self.settled.get();
        self.settled.set(true);
        isolate::with_guess_book(|b| {
            b.borrow_mut()
                .busy(&self.place, sent, crate::platform::http::now_ms())
        });
    }
}

/// `backend` of `pool` was deleted, drained or changed by this isolate's admin call: nothing is
/// sent ahead to it until a grant names it again.
pub(crate) fn forget_backend(pool: &str, backend: &str) {
    isolate::with_guess_book(|b| b.borrow_mut().forget_backend(pool, &backend.into()));
}

impl Drop for Ahead {
    fn drop(&mut self) {
        if let Some(sent) = self.sent.get_mut().take() {
            sent.abort();
        }
        // The client left (or the limiter refused) before the pool answered: not scored.
        if self.told.is_some() && !self.settled.get() {
            isolate::with_guess_book(|b| b.borrow_mut().abandoned(&self.place));
        }
    }
}
