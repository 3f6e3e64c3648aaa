//! Evidence from the lease table: what the pool's own leases say of a backend's engine queue
//! between two scrapes.
//!
//! Each streamed grant says when its stream becomes overdue
//! ([`crate::pool::Grant::first_token_due_ms`]): its predicted time to first token times
//! `time_model.overdue_factor`, stretched by the backend's learned lateness, plus its learned
//! overhead, and at least
//! `time_model.overdue_floor_ms`. The Worker times the first token; it reports one on the lease's
//! next renewal or its release ([`Pool::note_first_token`]), and a stream with none by its
//! overdue time it reports then, on an early renewal ([`Pool::note_overdue`]): vLLM answers a
//! running sequence's first token within its prefill and a step, so a stream that has waited
//! several predictions for it is waiting for a sequence slot or KV room. Streams on time cost no
//! call; only the late ones do, and they are the news. Such a stream counts as overdue until its
//! first token is reported, and as queued ([`LeaseEvidence::queued`]) when it was granted after
//! the backend's last load scrape (the scrape saw the earlier ones, running or waiting, so a
//! wrong guess here lasts until one scrape).
//!
//! What follows at once, with no scrape ([`Pool::refresh_evidence`], run before each decision and
//! each time card): the backend's engine queue is the scrape's plus the queued streams, its
//! sequence slots are at most its leases less the queued ones (its effective free slots are
//! none), and with first tokens reported, the batch limit is learned as a scrape's would be
//! (`entry::learn_seq_limit`: `started` running behind a queue; first tokens ride on renewals up
//! to 20 s apart, so `started` may count short, and the scrape that follows raises a limit learned
//! too low). The model being wrong is also a
//! reason to look: [`Pool::evidence_scrapes`] names the backends to scrape now (streams queued,
//! or a first token reported past its overdue time), at most once per
//! [`EVIDENCE_SCRAPE_INTERVAL_MS`] each. Non-streamed leases (whose first byte is their last) and
//! disaggregated pairs say nothing here.

use super::entry::{learn_seq_limit, BackendEntry, Slot};
use super::lease::{Lease, LeaseId};
use super::Pool;
use crate::backend::time_model::TimeModelConfig;
use crate::backend::BackendId;

/// Least time between two scrapes that lease evidence asks for on one backend, in ms.
pub const EVIDENCE_SCRAPE_INTERVAL_MS: u64 = 1_000;

/// What the lease table says of one backend's engine, as of [`LeaseEvidence::at_ms`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseEvidence {
    /// Live streams whose first token the Worker reported (running there).
    pub started: u32,
    /// Live streams the Worker reported overdue, without a first token since.
    pub overdue: u32,
    /// Of those, the ones granted after the backend's last load scrape: queued in the engine
    /// beyond what that scrape saw.
    pub queued: u32,
    /// When this was computed, in ms of pool time.
    pub at_ms: u64,
    /// When lease evidence last asked for a scrape of the backend, in ms of pool time.
    pub scrape_asked_ms: Option<u64>,
    /// First tokens reported past their overdue time since the last scrape lease evidence asked
    /// for (each one says the model was wrong).
    pub late_first_tokens: u32,
}

/// When `lease` (on `entry`) becomes overdue, if it can: a stream without a reported first
/// token, not a disaggregated pair.
fn overdue_at(lease: &Lease, entry: &BackendEntry, c: &TimeModelConfig) -> Option<u64> {
    if !lease.stream || lease.decode.is_some() || lease.first_token_ms.is_some() {
        return None;
    }
    let p = &lease.primary.predicted;
    let predicted_ms = lease.primary.predicted_ttft_ms.map_or_else(
        || (p.queued_prefill_us + p.extra_wait_us + p.first_step_us) as f64 / 1000.0,
        f64::from,
    );
    let late_ms = predicted_ms * c.overdue_factor * entry.timing.lateness()
        + entry.timing.learned_overhead_ms().unwrap_or(0.0);
    let wait_ms = late_ms.max(c.overdue_floor_ms as f64).min(1e12) as u64;
    Some(lease.acquired_ms.saturating_add(wait_ms))
}

/// The backend carrying `lease`'s primary share, if it is still the one registered in its slot.
fn share_entry<'a>(slots: &'a mut [Slot], lease: &Lease) -> Option<&'a mut BackendEntry> {
    let key = lease.primary.backend;
    slots
        .get_mut(key.slot as usize)
        .and_then(|s| s.entry.as_mut())
        .filter(|e| e.key == key)
}

impl Pool {
    /// Records the first token of lease `lease_id`'s stream, `ttfb_ms` after the grant (the
    /// first report wins). Returns whether the lease is live.
    pub fn note_first_token(&mut self, lease_id: LeaseId, ttfb_ms: u64) -> bool {
        self.check_first_token(lease_id, ttfb_ms);
        match self.leases.get_mut(lease_id) {
            Some(lease) => {
                lease.first_token_ms.get_or_insert(ttfb_ms);
                true
            }
            None => false,
        }
    }

    /// The Worker says lease `lease_id`'s stream had no first token by its overdue time: it
    /// counts as queued until one is reported. Returns whether the lease is live.
    pub fn note_overdue(&mut self, lease_id: LeaseId) -> bool {
        match self.leases.get_mut(lease_id) {
            Some(lease) => {
                lease.overdue_reported |= lease.first_token_ms.is_none();
                true
            }
            None => false,
        }
    }

    /// When `lease`'s stream becomes overdue, in ms after its grant, for the grant to carry.
    pub(super) fn first_token_due_ms(&self, lease: &Lease) -> Option<u32> {
        if self.config.time_model.overdue_factor <= 0.0 {
            return None;
        }
        let key = lease.primary.backend;
        let entry = self.entry(key.slot).filter(|e| e.key == key)?;
        let at = overdue_at(lease, entry, &self.config.time_model)?;
        Some(
            at.saturating_sub(lease.acquired_ms)
                .min(u64::from(u32::MAX)) as u32,
        )
    }

    /// Counts a first token `ttfb_ms` after the grant of lease `lease_id` that came past the
    /// stream's overdue time (reported on a renewal, or only at the release) on its backend: the
    /// model was wrong there, which asks for a scrape.
    pub(super) fn check_first_token(&mut self, lease_id: LeaseId, ttfb_ms: u64) {
        let c = self.config.time_model;
        if c.overdue_factor <= 0.0 {
            return;
        }
        let Some(lease) = self.leases.get(lease_id) else {
            return;
        };
        let Some(entry) = share_entry(&mut self.slots, lease) else {
            return;
        };
        let late = overdue_at(lease, entry, &c)
            .is_some_and(|at| lease.acquired_ms.saturating_add(ttfb_ms) > at);
        if late {
            entry.evidence.late_first_tokens += 1;
        }
    }

    /// Recounts every backend's [`LeaseEvidence`] from the lease table at `now_ms` (one pass over
    /// the live leases), and learns the batch limit it implies.
    pub fn refresh_evidence(&mut self, now_ms: u64) {
        let c = self.config.time_model;
        for s in &mut self.slots {
            if let Some(e) = s.entry.as_mut() {
                e.evidence = LeaseEvidence {
                    at_ms: now_ms,
                    scrape_asked_ms: e.evidence.scrape_asked_ms,
                    late_first_tokens: e.evidence.late_first_tokens,
                    ..LeaseEvidence::default()
                };
            }
        }
        if c.overdue_factor <= 0.0 {
            return;
        }
        for lease in self.leases.iter() {
            let Some(entry) = share_entry(&mut self.slots, lease) else {
                continue;
            };
            if lease.first_token_ms.is_some() && lease.stream {
                entry.evidence.started += 1;
            }
            if !lease.overdue_reported || lease.first_token_ms.is_some() {
                continue;
            }
            let ev = &mut entry.evidence;
            ev.overdue += 1;
            if entry
                .load_scraped_ms
                .is_none_or(|scraped| lease.acquired_ms > scraped)
            {
                ev.queued += 1;
            }
        }
        for s in &mut self.slots {
            if let Some(e) = s.entry.as_mut() {
                let ev = e.evidence;
                if ev.queued > 0 && ev.started > 0 {
                    e.learned_seqs = learn_seq_limit(
                        e.learned_seqs,
                        f64::from(ev.started),
                        f64::from(ev.queued),
                        now_ms,
                    );
                }
            }
        }
    }

    /// The backends whose streams are queued beyond what their last scrape saw, or that reported
    /// a first token past its overdue time, and that lease evidence has not had scraped within
    /// [`EVIDENCE_SCRAPE_INTERVAL_MS`]: scrape them now (they are marked asked at `now_ms`).
    /// Reads the evidence as last refreshed.
    pub fn evidence_scrapes(&mut self, now_ms: u64) -> Vec<BackendId> {
        let mut due = Vec::new();
        for s in &mut self.slots {
            let Some(e) = s.entry.as_mut() else { continue };
            let ev = &mut e.evidence;
            if (ev.queued > 0 || ev.late_first_tokens > 0) && ev.ask_scrape(now_ms) {
                ev.late_first_tokens = 0;
                due.push(e.spec.id.clone());
            }
        }
        due
    }

    /// Of `ids`, the backends a sibling shard's lease evidence showed wrong, the ones not
    /// scraped on lease evidence within [`EVIDENCE_SCRAPE_INTERVAL_MS`] (this shard's or a
    /// sibling's): scrape them now (they are marked asked at `now_ms`). Unknown ids are skipped.
    pub fn sibling_scrapes(&mut self, ids: &[BackendId], now_ms: u64) -> Vec<BackendId> {
        let mut due = Vec::new();
        for id in ids {
            let Some(e) = self
                .index
                .get(id)
                .and_then(|&slot| self.slots[slot as usize].entry.as_mut())
            else {
                continue;
            };
            if !due.contains(id) && e.evidence.ask_scrape(now_ms) {
                due.push(id.clone());
            }
        }
        due
    }

    /// Whether a backend reported a first token past its due time since lease evidence last had
    /// it scraped (a release's check: no pass over the leases when none did).
    pub fn late_first_tokens(&self) -> bool {
        self.entries().any(|e| e.evidence.late_first_tokens > 0)
    }

    /// Backend `id`'s lease evidence as last refreshed.
    pub fn lease_evidence(&self, id: &BackendId) -> Option<LeaseEvidence> {
        let slot = self.slot_of(id).ok()?;
        self.entry(slot).map(|e| e.evidence)
    }
}

impl LeaseEvidence {
    /// Whether a scrape may be asked for at `now_ms` (none was within
    /// [`EVIDENCE_SCRAPE_INTERVAL_MS`]); if so, it is marked asked.
    fn ask_scrape(&mut self, now_ms: u64) -> bool {
        let asked_lately = self
            .scrape_asked_ms
            .is_some_and(|t| now_ms < t.saturating_add(EVIDENCE_SCRAPE_INTERVAL_MS));
        if !asked_lately {
            self.scrape_asked_ms = Some(now_ms);
        }
        !asked_lately
    }
}

impl BackendEntry {
    /// The most sequences the lease evidence leaves the backend: its leases less those queued
    /// (at least one), when some are; else no bound.
    pub(super) fn evidence_seq_bound(&self) -> Option<u32> {
        (self.evidence.queued > 0)
            .then(|| (self.in_flight.leases.saturating_sub(self.evidence.queued)).max(1))
    }
}

#[cfg(test)]
mod tests;
