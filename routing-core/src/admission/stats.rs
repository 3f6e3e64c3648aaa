//! The queue's counters: admissions, drops by reason, re-entries and the wait histogram.

use super::request::DropReason;

/// Upper bounds of the queue-wait histogram's buckets, in milliseconds.
pub const WAIT_BUCKETS_MS: [u64; 14] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 120_000,
];

/// Counters of a pool's admission control.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdmissionStats {
    /// Requests granted through admission control (at once or after waiting).
    pub admitted: u64,
    /// Of those, requests that waited in the queue first.
    pub queued: u64,
    /// Requests dropped, by [`DropReason`] (indexed as [`DropReason::ALL`]).
    pub dropped: [u64; 6],
    /// Requests that came back with a ticket the queue did not know (a restart) and re-entered.
    pub reentered: u64,
    pub(super) wait_buckets: [u64; WAIT_BUCKETS_MS.len()],
    pub(super) wait_count: u64,
    pub(super) wait_sum_ms: u64,
}

impl AdmissionStats {
    pub(super) fn observe_wait(&mut self, ms: u64) {
        if let Some(i) = WAIT_BUCKETS_MS.iter().position(|&b| ms <= b) {
            self.wait_buckets[i] += 1;
        }
        self.wait_count += 1;
        self.wait_sum_ms = self.wait_sum_ms.saturating_add(ms);
    }

    /// Requests dropped for `reason`.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped[reason.index()]
    }
}
