//! Step 4 of a decision: the lease (a fresh random id, a deadline) and the [`Grant`] the Worker
//! acts on, with the candidates' views in ranked order; the choice is recorded in the prefix
//! table and the statistics.

use super::admit::Admitted;
use super::price::whole_ms;
use crate::backend::held_blocks::HeldChain;
use crate::policy::{Candidate, DecisionKind};
use crate::pool::entry::{BackendEntry, Slot};
use crate::pool::lease::{Lease, MAX_LEASE_ID};
use crate::pool::{CandidateView, Grant, Pool, RouteReceipt};
use crate::random::RandomSource;
use crate::request::prompt::RequestFeatures;

impl Pool {
    /// Records the lease of the admitted shares and builds the grant.
    pub(super) fn grant_lease(
        &mut self,
        features: &RequestFeatures,
        decision: DecisionKind,
        admitted: Admitted,
        now_ms: u64,
        rng: &mut dyn RandomSource,
    ) -> Grant {
        let Admitted {
            chosen,
            primary,
            decode,
        } = admitted;
        let lease_id = loop {
            let id = rng.next_u64() & MAX_LEASE_ID;
            if id != 0 && !self.leases.contains(id) {
                break id;
            }
        };
        let deadline_ms = now_ms.saturating_add(self.config.lease_ttl_ms);
        let primary_ready_ms = self.ready_ms(chosen.slot, &primary.predicted, now_ms);
        let lease = Lease {
            id: lease_id,
            request_id: features.request_id.clone(),
            prompt_tokens: features.prompt_tokens,
            max_tokens: features.max_tokens,
            stream: features.stream,
            primary,
            decode,
            acquired_ms: now_ms,
            deadline_ms,
            deferred_failure: None,
            first_token_ms: None,
            overdue_reported: false,
        };
        let first_token_due_ms = self.first_token_due_ms(&lease);
        // The id was checked to be free just above.
        let _ = self.leases.insert(lease);

        let views = |list: &[Candidate], order: &[usize], slots: &[Slot]| -> Vec<CandidateView> {
            order
                .iter()
                .filter_map(|&i| list.get(i))
                .filter_map(|c| slots[c.slot as usize].entry.as_ref())
                .map(BackendEntry::candidate_view)
                .collect()
        };
        let scratch = &self.scratch;
        let candidates = views(&scratch.primary, &scratch.order, &self.slots);
        let receipt = self.receipt(&chosen);
        let decode_candidates = views(&scratch.decode, &scratch.decode_order, &self.slots);
        self.affinity.record(chosen.slot, &features.block_hashes);
        self.hold_blocks(
            lease_id,
            chosen.slot,
            HeldChain::of(&features.block_hashes),
            chosen.computed_blocks as usize,
            primary_ready_ms,
            now_ms,
        );
        self.stats.record_decision(self.config.policy, decision);
        self.stats.prompt_blocks += features.block_hashes.len() as u64;
        self.stats.cached_blocks += u64::from(chosen.cached_blocks);
        Grant {
            lease_id,
            backend: candidates.first().map(|c| c.id.clone()).unwrap_or_default(),
            candidates,
            decode_candidates,
            policy: self.config.policy,
            decision: Some(decision),
            cached_blocks: chosen.cached_blocks,
            deadline_ms,
            predicted_ttft_ms: whole_ms(chosen.ttft_ms),
            receipt,
            // The coordinator adds its card (it holds the queue the card counts).
            card: None,
            roster: self.roster(),
            first_token_due_ms,
        }
    }

    /// The decision's receipt: the chosen candidate's predicted time to first token and the
    /// lowest among the others (one pass over the candidates).
    fn receipt(&self, chosen: &Candidate) -> Option<RouteReceipt> {
        let predicted_ttft_ms = whole_ms(chosen.ttft_ms)?;
        let alt = self
            .scratch
            .primary
            .iter()
            .filter(|c| c.slot != chosen.slot && c.ttft_ms.is_finite())
            .min_by(|a, b| a.ttft_ms.total_cmp(&b.ttft_ms));
        let alt_entry = alt.and_then(|c| self.slots[c.slot as usize].entry.as_ref());
        let alt_id = alt_entry.map(|e| e.spec.id.clone());
        let queued = |e: Option<&BackendEntry>| e.map(|e| e.evidence.queued).filter(|&n| n > 0);
        Some(RouteReceipt {
            queued_by_leases: queued(self.slots[chosen.slot as usize].entry.as_ref()),
            alt_queued_by_leases: queued(alt_entry),
            predicted_ttft_ms,
            alt_predicted_ttft_ms: alt_id.as_ref().and(alt).and_then(|c| whole_ms(c.ttft_ms)),
            alt: alt_id,
        })
    }
}
