//! A lease's life after the grant: moved to another backend ([`Pool::reassign`]), its prefill
//! stage ended ([`Pool::finish_prefill`]), renewed, readmitted after the pool lost it, released
//! with its outcome (feeding the breaker, the statistics and the time model) or expired.
//!
//! Blame goes to what failed. A 5xx the lease moves away from is only a suspicion: its breaker
//! charge waits on the lease ([`Lease::deferred_failure`]) until the release says whether the
//! request failed on the next backend too (then it was the request's, and neither backend is
//! charged) or not (then the first backend is charged). A first-byte timeout the backend's queue
//! explains (the wait the time model predicted, or the queue vLLM reported) counts as load, like
//! a 429, not as a failure. And no breaker opens past the pool's `breaker.max_open_ratio` cap.

use super::entry::BackendEntry;
use super::errors::unknown;
use super::{has_room, CandidateView, Pool, PoolError};
use crate::backend::breaker::BreakerState;
use crate::backend::held_blocks::HeldChain;
use crate::backend::time_model::{Observation, SharePrediction};
use crate::backend::{BackendId, BackendKey, Lifecycle};
use crate::pool::lease::{Lease, LeaseId, LeaseShare, LeaseTerms, MAX_LEASE_ID};
use crate::stream::outcome::{Outcome, OutcomeKind};
use xxhash_rust::xxh3::xxh3_64;

impl Pool {
    /// Moves a lease to another backend after its backend failed before the first byte (the
    /// Worker's retry on the next candidate). The failure is recorded on the old backend's
    /// breaker (a 5xx's charge deferred to the release, see the module doc); the counters move
    /// with the lease; the new backend is admitted through its
    /// breaker. If the new backend cannot take it, nothing changes and
    /// [`PoolError::BackendUnavailable`] is returned (the Worker may try the next candidate).
    /// The one exception is a retry on the same backend whose recorded failure opens its
    /// breaker: the failure stands, the lease ends, and `BackendUnavailable` is returned.
    pub fn reassign(
        &mut self,
        lease_id: LeaseId,
        to: &BackendId,
        failure: &Outcome,
        now_ms: u64,
    ) -> Result<CandidateView, PoolError> {
        let lease = self
            .leases
            .get(lease_id)
            .ok_or(PoolError::UnknownLease { lease_id })?;
        let (acquired_ms, prompt_tokens, output) = (
            lease.acquired_ms,
            u64::from(lease.prompt_tokens),
            if lease.decode.is_some() {
                1
            } else {
                u64::from(lease.max_tokens)
            },
        );
        let old = lease.primary;
        // A trial's outcome decides its breaker at once; other 5xx wait for the release.
        let defer = failure.is_suspect_5xx() && !old.trial;
        let slot = self.slot_of(to)?;
        let breaker_config = self.config.breaker;
        let twins = self.sibling_twins();
        let admission = self.config.admission;
        let target = self.entry_mut(slot).ok_or_else(|| unknown(to))?;
        if !target.available(now_ms, &breaker_config) {
            return Err(PoolError::BackendUnavailable { id: to.clone() });
        }
        // A move is a new request for the target: it must have room, as an acquire would need
        // (the lease's own share counts only when it stays where it is).
        if admission.enabled
            && old.backend != target.key
            && !has_room(
                &target.all_in_flight(twins),
                &target.capacity(),
                prompt_tokens.saturating_add(output),
                admission.overcommit,
            )
        {
            return Err(PoolError::BackendUnavailable { id: to.clone() });
        }
        // The lease stops holding its blocks on the old backend here (its settle finds them gone).
        let blocks = self.drop_blocks(lease_id, old.backend);
        if defer {
            // The statistics see the failure now; the breaker waits.
            self.settle_charging(
                &old,
                failure,
                OutcomeKind::Cancelled,
                (lease_id, acquired_ms),
                now_ms,
            );
        } else {
            self.settle(&old, failure, lease_id, acquired_ms, now_ms);
        }
        let earlier = match self.leases.get_mut(lease_id) {
            Some(lease) if defer => lease.deferred_failure.replace(old.backend),
            _ => None,
        };
        if let Some(earlier) = earlier {
            // A second suspect before any release: the first one is charged after all.
            self.charge_deferred(earlier, lease_id, now_ms);
        }
        let share = self.admit(slot, prompt_tokens, output, now_ms);
        if let (Some(share), Some(blocks)) = (&share, blocks) {
            // Nothing of it is known to be cached on the new backend.
            self.hold_blocks(
                lease_id,
                slot,
                blocks,
                0,
                self.ready_ms(slot, &share.predicted, now_ms),
                now_ms,
            );
        }
        let Some(share) = share else {
            // Retrying on the backend that just failed can open its breaker: the lease has
            // nowhere to go, so it ends here (its decode share too) rather than leak.
            if let Some(lease) = self.leases.remove(lease_id) {
                if let Some(decode) = &lease.decode {
                    self.unshare(decode, OutcomeKind::Cancelled, lease_id, now_ms);
                }
                if let Some(first) = lease.deferred_failure {
                    self.charge_deferred(first, lease_id, now_ms);
                }
            }
            return Err(PoolError::BackendUnavailable { id: to.clone() });
        };
        let view = self
            .entry(slot)
            .map(BackendEntry::candidate_view)
            .unwrap_or_default();
        if let Some(lease) = self.leases.get_mut(lease_id) {
            lease.primary = share;
        }
        Ok(view)
    }

    /// Ends a lease with its outcome. Returns `false` (and changes nothing) if the lease is not
    /// live: already released, expired, or unknown, so a double release is harmless.
    ///
    /// The outcome feeds the breaker of the lease's backend (both backends of a pair) and the
    /// statistics; 4xx, cancellations and 429s never count as failures, and neither does a
    /// failure the Worker found to be the request's ([`Outcome::request_fault`]), which also
    /// withdraws the deferred charge of the backend the lease moved away from.
    pub fn release(&mut self, lease_id: LeaseId, outcome: &Outcome, now_ms: u64) -> bool {
        if let (Some(ttfb_ms), true) = (outcome.ttfb_ms, outcome.kind.is_success()) {
            self.check_first_token(lease_id, ttfb_ms);
        }
        let Some(lease) = self.leases.remove(lease_id) else {
            self.stats.unknown_releases += 1;
            return false;
        };
        // A renewal still on its way must not bring it back.
        self.leases
            .mark_ended(lease_id, now_ms, self.config.lease_ttl_ms);
        // A resumed stream's times span two backends and its tokens only the continuation's:
        // nothing to learn a backend's rates from.
        if outcome.kind.is_success() && lease.decode.is_none() && outcome.resume.is_none() {
            self.learn(&lease, outcome, now_ms);
        }
        self.settle(&lease.primary, outcome, lease_id, lease.acquired_ms, now_ms);
        if let Some(decode) = &lease.decode {
            self.settle(decode, outcome, lease_id, lease.acquired_ms, now_ms);
        }
        if let (Some(first), false) = (lease.deferred_failure, outcome.request_fault) {
            self.charge_deferred(first, lease_id, now_ms);
        }
        true
    }

    /// Ends the prefill stage of a disaggregated lease: the prefill share is settled with the
    /// prefill's own `outcome` (so only its failures count against the prefill backend) and taken
    /// off the counters at once; the lease goes on with its decode share alone, which the final
    /// release settles. Returns `false` (and changes nothing) if the lease is not live or has no
    /// decode share.
    pub fn finish_prefill(&mut self, lease_id: LeaseId, outcome: &Outcome, now_ms: u64) -> bool {
        let Some(lease) = self.leases.get(lease_id) else {
            return false;
        };
        let Some(decode) = lease.decode else {
            return false;
        };
        let (prefill, acquired_ms) = (lease.primary, lease.acquired_ms);
        self.settle(&prefill, outcome, lease_id, acquired_ms, now_ms);
        if let Some(lease) = self.leases.get_mut(lease_id) {
            lease.primary = decode;
            lease.decode = None;
        }
        true
    }

    /// Extends a live lease's deadline to `lease_ttl_ms` from now (the Worker's heartbeat while
    /// its request runs). Returns the new deadline, or [`PoolError::UnknownLease`].
    pub fn renew(&mut self, lease_id: LeaseId, now_ms: u64) -> Result<u64, PoolError> {
        let deadline_ms = now_ms.saturating_add(self.config.lease_ttl_ms);
        if self.leases.set_deadline(lease_id, deadline_ms) {
            Ok(deadline_ms)
        } else {
            Err(PoolError::UnknownLease { lease_id })
        }
    }

    /// Counts a request again whose lease the pool lost (it expired while the request still
    /// ran, or the Durable Object restarted): a lease with the same id on the backend the Worker
    /// says serves it, counted in full (its cache hits are unknown) and not gated by the breaker
    /// (the request is already running there). A live lease is just renewed. A lease released
    /// within the last `lease_ttl_ms` (by its Worker, or by the pool refusing its retry) is not
    /// counted again: [`PoolError::UnknownLease`]. Returns the deadline.
    pub fn readmit(
        &mut self,
        lease_id: LeaseId,
        terms: &LeaseTerms,
        now_ms: u64,
    ) -> Result<u64, PoolError> {
        if let Ok(deadline_ms) = self.renew(lease_id, now_ms) {
            return Ok(deadline_ms);
        }
        // A lease released (or ended by the pool) lately is over: only an expired or forgotten
        // one comes back.
        if lease_id == 0 || lease_id > MAX_LEASE_ID || self.leases.ended_lately(lease_id, now_ms) {
            return Err(PoolError::UnknownLease { lease_id });
        }
        let slot = self.slot_of(&terms.backend)?;
        let entry = self
            .entry_mut(slot)
            .ok_or_else(|| unknown(&terms.backend))?;
        let (prompt_tokens, output_tokens) =
            (u64::from(terms.prompt_tokens), u64::from(terms.max_tokens));
        entry.in_flight.add(prompt_tokens, output_tokens);
        let primary = LeaseShare {
            backend: entry.key,
            prompt_tokens,
            output_tokens,
            trial: false,
            // Nothing was predicted for it: it teaches the time model nothing.
            predicted: SharePrediction::default(),
            predicted_ttft_ms: None,
        };
        let deadline_ms = now_ms.saturating_add(self.config.lease_ttl_ms);
        let lease = Lease {
            id: lease_id,
            request_id: terms.request_id.clone(),
            prompt_tokens: terms.prompt_tokens,
            max_tokens: terms.max_tokens,
            stream: terms.stream,
            primary,
            decode: None,
            acquired_ms: now_ms,
            deadline_ms,
            deferred_failure: None,
            first_token_ms: None,
            overdue_reported: false,
        };
        // `renew` failed just above, so the id is free.
        let _ = self.leases.insert(lease);
        Ok(deadline_ms)
    }

    /// Teaches the time model what a successful request measured: its backend's rates, and the
    /// pool's ratio of real to requested output.
    fn learn(&mut self, lease: &Lease, outcome: &Outcome, now_ms: u64) {
        self.common_overhead_ms = self.median_overhead_ms();
        let seen = Observation {
            ttfb_ms: outcome.ttfb_ms,
            duration_ms: now_ms.saturating_sub(lease.acquired_ms),
            completion_tokens: outcome.completion_tokens,
            streamed: lease.stream,
            held_by_client: outcome.held_by_client,
            at_ms: now_ms,
            pool_overhead_ms: self.common_overhead_ms,
        };
        if let Some(tokens) = outcome.completion_tokens {
            self.output_ratio.observe(tokens, lease.max_tokens);
        }
        if lease.stream && !outcome.held_by_client {
            self.e2e_tail.observe(
                seen.duration_ms,
                self.config.predicted_latency.tail_quantile,
            );
        }
        let time_model = self.config.time_model;
        if let Some(entry) = self.entry_for_key_mut(lease.primary.backend) {
            entry
                .timing
                .learn(&time_model, &lease.primary.predicted, &seen);
            if let (Some(predicted), Some(seen)) =
                (lease.primary.predicted_ttft_ms, outcome.ttfb_ms)
            {
                entry.stats.record_prediction(u64::from(predicted), seen);
            }
        }
    }

    /// Ends every lease past its deadline, as if cancelled (nobody is blamed), and moves open
    /// breakers whose cooldown has passed to half-open. Returns how many leases expired.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        self.now_hint_ms = self.now_hint_ms.max(now_ms);
        for s in &mut self.slots {
            if let Some(e) = &mut s.entry {
                e.breaker.refresh(now_ms);
            }
        }
        self.expire_leases(now_ms)
    }

    /// Ends every lease past its deadline; see [`Pool::expire`].
    pub(super) fn expire_leases(&mut self, now_ms: u64) -> usize {
        if self.leases.next_deadline().is_none_or(|d| d > now_ms) {
            return 0;
        }
        let expired = self.leases.take_expired(now_ms);
        for lease in &expired {
            for share in std::iter::once(&lease.primary).chain(lease.decode.as_ref()) {
                if let Some(entry) = self.entry_for_key_mut(share.backend) {
                    entry.stats.expired += 1;
                }
                self.unshare(share, OutcomeKind::Cancelled, lease.id, now_ms);
            }
        }
        self.stats.leases_expired += expired.len() as u64;
        expired.len()
    }

    pub(super) fn settle(
        &mut self,
        share: &LeaseShare,
        outcome: &Outcome,
        lease_id: LeaseId,
        acquired_ms: u64,
        now_ms: u64,
    ) {
        let charge = self.breaker_charge(share, outcome);
        self.settle_charging(share, outcome, charge, (lease_id, acquired_ms), now_ms);
    }

    /// Settles `share` with `outcome` in the statistics and `charge` on the breaker.
    fn settle_charging(
        &mut self,
        share: &LeaseShare,
        outcome: &Outcome,
        charge: OutcomeKind,
        (lease_id, acquired_ms): (LeaseId, u64),
        now_ms: u64,
    ) {
        if let Some(entry) = self.entry_for_key_mut(share.backend) {
            entry
                .stats
                .record_outcome(outcome, now_ms.saturating_sub(acquired_ms));
        }
        self.unshare(share, charge, lease_id, now_ms);
    }

    /// What `outcome` charges the breaker of the backend `share` is on: nothing for the request's
    /// own fault, load (a short saturation mark, as for a 429) for a first-byte timeout its queue
    /// explains, and otherwise the outcome's kind.
    fn breaker_charge(&self, share: &LeaseShare, outcome: &Outcome) -> OutcomeKind {
        if outcome.request_fault {
            return OutcomeKind::Cancelled;
        }
        if outcome.kind == OutcomeKind::Timeout && self.queue_explains(share, outcome) {
            return OutcomeKind::RateLimited;
        }
        outcome.kind
    }

    /// Whether the backend's queue explains a timeout after `outcome.ttfb_ms`: the wait the time
    /// model predicted for the share was at least half of it, or vLLM's last scrape found
    /// requests waiting behind a full batch.
    fn queue_explains(&self, share: &LeaseShare, outcome: &Outcome) -> bool {
        let Some(waited_ms) = outcome.ttfb_ms.filter(|&w| w > 0) else {
            return false;
        };
        let predicted_ms =
            (share.predicted.queued_prefill_us + share.predicted.extra_wait_us) / 1000;
        if predicted_ms.saturating_mul(2) >= waited_ms {
            return true;
        }
        let Some(entry) = self.entries_key(share.backend) else {
            return false;
        };
        let waiting = entry.load_gauges().waiting.unwrap_or(0.0);
        let running = entry.load_gauges().running.unwrap_or(0.0);
        waiting >= 1.0 && running >= f64::from(entry.capacity().max_num_seqs.max(1))
    }

    /// Charges a deferred 5xx to `backend`'s breaker (the request went on without failing again).
    fn charge_deferred(&mut self, backend: BackendKey, lease_id: LeaseId, now_ms: u64) {
        let breaker_config = self.config.breaker;
        let may_open = self.breaker_may_open(now_ms);
        let jitter = breaker_jitter(lease_id, now_ms);
        if let Some(entry) = self.entry_for_key_mut(backend) {
            entry.breaker.record_gated(
                OutcomeKind::ServerError,
                false,
                now_ms,
                &breaker_config,
                jitter,
                may_open,
            );
        }
    }

    /// Whether one more breaker may open now: fewer of the ready, healthy backends' breakers are
    /// out of rotation than `breaker.max_open_ratio` allows.
    pub(super) fn breaker_may_open(&self, now_ms: u64) -> bool {
        let (mut ready, mut out) = (0usize, 0usize);
        for e in self.entries() {
            if e.lifecycle == Lifecycle::Ready && e.health.is_serving() {
                ready += 1;
                if e.breaker.state_at(now_ms) != BreakerState::Closed {
                    out += 1;
                }
            }
        }
        out < self.config.breaker.max_open(ready)
    }

    /// Counts the chain `blocks` as held on `slot` by lease `lease_id`, the first `computed` of them
    /// cached there already, the rest found computed by requests admitted from `ready_ms` on.
    pub(super) fn hold_blocks(
        &mut self,
        lease_id: LeaseId,
        slot: u32,
        blocks: HeldChain,
        computed: usize,
        ready_ms: u64,
        now_ms: u64,
    ) {
        if let Some(entry) = self.entry_mut(slot) {
            entry
                .held
                .hold(lease_id, blocks, computed, ready_ms, now_ms);
        }
    }

    /// Stops counting the blocks lease `lease_id` holds on `backend`; returns them.
    fn drop_blocks(&mut self, lease_id: LeaseId, backend: BackendKey) -> Option<HeldChain> {
        self.entry_for_key_mut(backend)?.held.release(lease_id)
    }

    /// Takes a share off its backend's counters and tells the breaker how it ended.
    pub(super) fn unshare(
        &mut self,
        share: &LeaseShare,
        kind: OutcomeKind,
        lease_id: LeaseId,
        now_ms: u64,
    ) {
        self.drop_blocks(lease_id, share.backend);
        // Admission control's hook: a backend freed room (bounded; the queue drains it).
        if self.config.admission.enabled && self.freed.len() < 1024 {
            self.freed.push(share.backend.slot);
        }
        let breaker_config = self.config.breaker;
        // Only an opening needs the pool-wide count.
        let opens = self
            .entries_key(share.backend)
            .is_some_and(|e| e.breaker.would_open(kind, &breaker_config));
        let may_open = !opens || self.breaker_may_open(now_ms);
        let Some(entry) = self.entry_for_key_mut(share.backend) else {
            return;
        };
        entry
            .in_flight
            .remove(share.prompt_tokens, share.output_tokens);
        entry.timing.leave(&share.predicted, now_ms);
        let jitter = breaker_jitter(lease_id, now_ms);
        entry
            .breaker
            .record_gated(kind, share.trial, now_ms, &breaker_config, jitter, may_open);
        if entry.lifecycle == Lifecycle::Draining && entry.in_flight.leases == 0 {
            entry.lifecycle = Lifecycle::Drained;
        }
    }
}

impl Pool {
    /// From when requests sent to `slot` after a share predicted `predicted` at `now_ms` count on
    /// its prompt as computed ([`SharePrediction::ready_ms`], with the backend's lateness).
    pub(super) fn ready_ms(&self, slot: u32, predicted: &SharePrediction, now_ms: u64) -> u64 {
        let lateness = self
            .slots
            .get(slot as usize)
            .and_then(|s| s.entry.as_ref())
            .map_or(1.0, |e| e.timing.lateness());
        predicted.ready_ms(now_ms, lateness)
    }

    /// The overhead (time to first byte beyond the engine's) the backends have in common: the
    /// median of those learned so far, if any (see [`Observation::pool_overhead_ms`]).
    fn median_overhead_ms(&self) -> Option<f64> {
        let mut learned: Vec<f64> = self
            .slots
            .iter()
            .filter_map(|s| s.entry.as_ref()?.timing.learned_overhead_ms())
            .collect();
        if learned.is_empty() {
            return None;
        }
        let mid = learned.len() / 2;
        let (_, median, _) = learned.select_nth_unstable_by(mid, f64::total_cmp);
        Some(*median)
    }

    /// Whether backend `id` may be probed out of turn now (see
    /// [`crate::backend::health::Health::ask_probe_soon`]).
    pub fn ask_probe_soon(&mut self, id: &BackendId, now_ms: u64) -> bool {
        let Ok(slot) = self.slot_of(id) else {
            return false;
        };
        self.entry_mut(slot)
            .is_some_and(|e| e.health.ask_probe_soon(now_ms))
    }

    /// The backend whose 5xx lease `lease_id` moved away from, its breaker charge still deferred
    /// (the release settles it, so the caller persists that backend's state too).
    pub fn deferred_failure(&self, lease_id: LeaseId) -> Option<BackendId> {
        let key = self.leases.get(lease_id)?.deferred_failure?;
        self.entries_key(key).map(|e| e.spec.id.clone())
    }

    /// The entry `key` names, if it is still that backend's.
    pub(super) fn entries_key(&self, key: BackendKey) -> Option<&super::entry::BackendEntry> {
        let s = self.slots.get(key.slot as usize)?;
        (s.generation == key.generation)
            .then_some(s.entry.as_ref())
            .flatten()
    }
}

/// A uniform value in `[0, 1)` for a breaker's cooldown jitter, from the lease and the time.
fn breaker_jitter(lease_id: LeaseId, now_ms: u64) -> f64 {
    (xxh3_64(&(lease_id ^ now_ms.rotate_left(32)).to_le_bytes()) >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests;
