//! Lease evidence in the coordinator (`crate::pool::evidence` holds the rule): the first tokens
//! and the overdue streams the Worker reports on renewals, the check that runs after them, and
//! the scrape it asks for when the leases show the model wrong: the backends are scraped now
//! ([`Effect::ScrapeNow`]), and the scrape's findings go where a probe round's do, the card for
//! the directory included, so the pool choice across regions sees the queue on its next pool
//! list. Only shard 0 probes: a sibling shard whose leases show a backend wrong asks shard 0 on
//! its next load push ([`Effect::PushLoad`], the report's `scrape`), and shard 0 scrapes it under
//! the same limit (once per [`crate::pool::evidence::EVIDENCE_SCRAPE_INTERVAL_MS`] per backend,
//! whichever shard asked) and hands the findings to every sibling with its probe reports.

use super::probes::ProbeReport;
use super::{Callers, Coordinator, Effect, Effects};
use crate::backend::BackendId;
use crate::pool::lease::LeaseId;
use crate::pool::shard::LoadReport;

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

    /// Counts a lease renewal received, and whether it said its stream was overdue (lease
    /// evidence's early renewal): `llm_gateway_lease_renewals_total`, which shows that streams on
    /// time renew no sooner than their schedule.
    pub fn count_renewal(&mut self, overdue: bool) {
        self.renewals[usize::from(overdue)] += 1;
    }

    /// Recounts the lease evidence at `now_ms`. When it shows backends' models wrong (streams
    /// queued beyond the last scrape, or first tokens past their overdue time), asks for those
    /// backends to be scraped now (at most once per
    /// [`crate::pool::evidence::EVIDENCE_SCRAPE_INTERVAL_MS`] each) and publishes the card that
    /// already counts the queue. On a sibling shard the ask goes to shard 0 with the next load
    /// push, pushed now (or when the exchange interval allows).
    pub fn check_evidence(&mut self, now_ms: u64) -> Effects {
        self.pool.refresh_evidence(now_ms);
        let due = self.pool.evidence_scrapes(now_ms);
        if due.is_empty() {
            return Effects::new();
        }
        if self.shard != 0 {
            // Only shard 0 probes (the siblings hear of the scrape with its findings).
            self.exchange.ask_scrape(due);
            return vec![Effect::PushLoad];
        }
        self.scrape_now(due, now_ms)
    }

    /// Scrapes `due` now (counted), and publishes the card as of now.
    fn scrape_now(&mut self, due: Vec<BackendId>, now_ms: u64) -> Effects {
        self.evidence_scrapes += due.len() as u64;
        let mut effects = vec![Effect::ScrapeNow(due)];
        if let Some(card) = self.directory_card(now_ms) {
            effects.push(Effect::PublishCard(card));
        }
        effects
    }

    /// On shard 0, the scrapes a sibling's load `report` asks for, under the same limit as its
    /// own ([`crate::pool::Pool::sibling_scrapes`]); nothing on the other shards.
    pub(super) fn sibling_asked(&mut self, report: &LoadReport, now_ms: u64) -> Effects {
        if self.shard != 0 || report.scrape.is_empty() {
            return Effects::new();
        }
        let due = self.pool.sibling_scrapes(&report.scrape, now_ms);
        if due.is_empty() {
            return Effects::new();
        }
        self.scrape_now(due, now_ms)
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
