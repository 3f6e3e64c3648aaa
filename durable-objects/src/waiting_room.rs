//! The open calls of the acquires waiting in a pool's admission queue: the one-shot channel each
//! waiting call listens on and its request signal. The queue and every rule of the wait are
//! `routing_core::coordinator::WaitingRoom`'s; this file only carries its verdicts to the calls
//! (`Effect::Answer`), closes the calls it is done with (`Effect::CloseCall`, which then answer
//! `202`) and tells it whether a call's client left ([`Callers`]): its request signal aborted
//! (workerd propagates the cancellation of a Durable Object call in production; locally it does
//! not), or its call was dropped.

use futures_channel::oneshot;
use routing_core::admission::Ticket;
use routing_core::coordinator::{Callers, WaitEnd};
use std::collections::HashMap;

/// One waiting call.
struct OpenCall {
    /// Which call of its wait it is.
    call_id: u64,
    /// Where its verdict goes.
    tx: oneshot::Sender<WaitEnd>,
    /// Its request signal.
    signal: Option<web_sys::AbortSignal>,
}

/// The waiting calls, by their wait's ticket (one open call per wait).
#[derive(Default)]
pub struct OpenCalls {
    calls: HashMap<Ticket, OpenCall>,
}

impl OpenCalls {
    /// Opens call `call_id` of `ticket`'s wait (a call still open for it is dropped: it answers
    /// `202`). Returns where its verdict arrives.
    pub fn open(
        &mut self,
        ticket: Ticket,
        call_id: u64,
        signal: Option<web_sys::AbortSignal>,
    ) -> oneshot::Receiver<WaitEnd> {
        let (tx, rx) = oneshot::channel();
        let call = OpenCall {
            call_id,
            tx,
            signal,
        };
        self.calls.insert(ticket, call);
        rx
    }

    /// Hands `verdict` to call `call_id` of `ticket`; gives it back when no such call takes it.
    pub fn answer(&mut self, ticket: Ticket, call_id: u64, verdict: WaitEnd) -> Option<WaitEnd> {
        match self.calls.remove(&ticket) {
            Some(call) if call.call_id == call_id => call.tx.send(verdict).err(),
            Some(other) => {
                self.calls.insert(ticket, other);
                Some(verdict)
            }
            None => Some(verdict),
        }
    }

    /// Closes call `call_id` of `ticket` (a newer call of the same wait stays open).
    pub fn close(&mut self, ticket: Ticket, call_id: u64) {
        if self
            .calls
            .get(&ticket)
            .is_some_and(|c| c.call_id == call_id)
        {
            self.calls.remove(&ticket);
        }
    }
}

impl Callers for OpenCalls {
    fn left(&self, ticket: Ticket) -> bool {
        self.calls
            .get(&ticket)
            .is_none_or(|c| c.tx.is_canceled() || c.signal.as_ref().is_some_and(|s| s.aborted()))
    }
}
