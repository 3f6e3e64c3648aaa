//! Lease evidence in the coordinator (`crate::pool::evidence` holds the rule): the first tokens
//! and the overdue streams the Worker reports on renewals, the check that runs after them, and
//! the scrape it asks for when the leases show the model wrong: the backends are scraped now
//! ([`Effect::ScrapeNow`], shard 0 only, since only shard 0 probes), and the scrape's findings go
//! where a probe round's do, the card for the directory included, so the pool choice across
//! regions sees the queue on its next pool list.

use super::probes::ProbeReport;
use super::{Callers, Coordinator, Effect, Effects};
use crate::backend::BackendId;
use crate::pool::lease::LeaseId;

impl Coordinator {
    /// The Worker saw lease `lease_id`'s first token `ttfb_ms` after it began (reported on a
    /// renewal). Returns whether the lease is live.
    pub fn first_token(&mut self, lease_id: LeaseId, ttfb_ms: u64) -> bool {
        self.pool.note_first_token(lease_id, ttfb_ms)
    }

    /// The Worker saw no first token on lease `lease_id`'s stream by its overdue time (an early
    /// renewal). Returns whether the lease is live.
    pub fn overdue(&mut self, lease_id: LeaseId) -> bool {
        self.pool.note_overdue(lease_id)
    }

    /// Recounts the lease evidence at `now_ms`. When it shows backends' models wrong (streams
    /// queued beyond the last scrape, or first tokens past their overdue time), asks for those
    /// backends to be scraped now (at most once per
    /// [`crate::pool::evidence::EVIDENCE_SCRAPE_INTERVAL_MS`] each) and publishes the card that
    /// already counts the queue.
    pub fn check_evidence(&mut self, now_ms: u64) -> Effects {
        self.pool.refresh_evidence(now_ms);
        let due = self.pool.evidence_scrapes(now_ms);
        // Only shard 0 probes (the others hear of the scrape with its findings).
        if due.is_empty() || self.shard != 0 {
            return Effects::new();
        }
        self.evidence_scrapes += due.len() as u64;
        let mut effects = vec![Effect::ScrapeNow(due)];
        if let Some(card) = self.directory_card(now_ms) {
            effects.push(Effect::PublishCard(card));
        }
        effects
    }

    /// The scrapes [`Effect::ScrapeNow`] asked for came back: their findings apply as a probe
    /// round's do (the changed backends written, the queue dispatched, the reports handed to the
    /// siblings), and the card that follows goes to the directory.
    pub fn finish_evidence_scrape(
        &mut self,
        reports: Vec<(BackendId, ProbeReport)>,
        now_ms: u64,
        callers: &dyn Callers,
    ) -> Effects {
        self.record_probes(reports, now_ms);
        self.probes_applied(now_ms, callers)
    }
}
