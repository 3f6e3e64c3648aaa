//! Step 3 of a decision: the chosen backend (and a pair's decode backend) takes the request's
//! load on its counters, through its breaker ([`Pool::admit`] also serves a reassigned retry).

use super::price::whole_ms;
use crate::backend::breaker::Admission;
use crate::policy::Candidate;
use crate::pool::lease::LeaseShare;
use crate::pool::{AcquireError, Pool, DEFAULT_RETRY_AFTER_S};
use crate::request::prompt::RequestFeatures;
use crate::request::role::Role;
use crate::stream::outcome::OutcomeKind;

/// The shares a decision admitted, and the candidate chosen.
pub(super) struct Admitted {
    /// The ranked first choice.
    pub(super) chosen: Candidate,
    /// Its share (a pair's prefill share).
    pub(super) primary: LeaseShare,
    /// A pair's decode share.
    pub(super) decode: Option<LeaseShare>,
}

impl Pool {
    /// Admits the ranked first choice: its share, a pair's decode share, and the chosen
    /// candidate. If a breaker refuses (a half-open trial already taken), nothing stays counted.
    pub(super) fn admit_choice(
        &mut self,
        features: &RequestFeatures,
        paired: bool,
        now_ms: u64,
    ) -> Result<Admitted, AcquireError> {
        let block_tokens = self.block_tokens_for(features);
        let output_tokens = features.max_tokens;
        let scratch = &self.scratch;
        let chosen = scratch.primary[scratch.order[0]];
        let cached_tokens = (u64::from(chosen.computed_blocks) * block_tokens as u64)
            .min(u64::from(features.prompt_tokens));
        let uncached = u64::from(features.prompt_tokens) - cached_tokens;
        self.mean_uncached_tokens += (uncached as f64 - self.mean_uncached_tokens) * 0.05;
        let primary_output = if paired { 1 } else { u64::from(output_tokens) };
        let decode_slot = paired.then(|| scratch.decode[scratch.decode_order[0]].slot);
        let no_backend = AcquireError::NoBackendAvailable {
            retry_after_s: DEFAULT_RETRY_AFTER_S,
        };
        let Some(mut primary) = self.admit(chosen.slot, uncached, primary_output, now_ms) else {
            return Err(no_backend);
        };
        primary.predicted.add_wait(chosen.wait_ms);
        if let Some(entry) = self.entry_mut(chosen.slot) {
            entry.timing.wait_for_room(now_ms, chosen.room_ms);
        }
        primary.predicted_ttft_ms = whole_ms(chosen.ttft_ms);
        let decode = match decode_slot {
            Some(slot) => {
                let prompt = u64::from(features.prompt_tokens);
                match self.admit(slot, prompt, u64::from(output_tokens), now_ms) {
                    Some(share) => Some(share),
                    None => {
                        self.unshare(&primary, OutcomeKind::Cancelled, 0, now_ms);
                        return Err(no_backend);
                    }
                }
            }
            None => None,
        };
        Ok(Admitted {
            chosen,
            primary,
            decode,
        })
    }

    /// Counts a new lease share on `slot`, through its breaker.
    /// Returns `None` if the slot is empty or its breaker refuses (callers checked both before).
    pub(in crate::pool) fn admit(
        &mut self,
        slot: u32,
        prompt_tokens: u64,
        output_tokens: u64,
        now_ms: u64,
    ) -> Option<LeaseShare> {
        let breaker_config = self.config.breaker;
        let time_model = self.config.time_model;
        let twins = self.sibling_twins();
        let out = output_tokens as f64 * self.output_ratio.get();
        let entry = self.entry_mut(slot)?;
        let trial = entry.breaker.admit(now_ms, &breaker_config)? == Admission::Trial;
        // A decode server pulls the prompt's KV cache instead of computing it.
        let prefill = if entry.spec.role == Role::Decode {
            0
        } else {
            prompt_tokens
        };
        let predicted = entry
            .timing
            .admit(&time_model, prefill, entry.running(twins), out, now_ms);
        entry.in_flight.add(prompt_tokens, output_tokens);
        entry.stats.requests += 1;
        Some(LeaseShare {
            backend: entry.key,
            prompt_tokens,
            output_tokens,
            trial,
            predicted,
            predicted_ttft_ms: None,
        })
    }
}
