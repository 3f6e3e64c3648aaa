//! Step 1 of a decision: which backends may take the request, each priced. The filters
//! (`filter.rs`: model, role, lifecycle, health, breaker, saturation) run over every backend
//! first; each backend they let through is then matched against the request's prefix, dropped if
//! admission control finds no room for what it would compute (a filter that needs the match), and
//! priced (`price.rs`: cost model and time model) into a [`Candidate`](crate::policy::Candidate)
//! of the list for its role, in slot order. When none is left, the step says why.

use super::super::{AcquireError, Pool, DEFAULT_RETRY_AFTER_S};
use super::filter::{has_room_for, verdict, Verdict};
use super::price::Pricing;
use crate::request::prompt::RequestFeatures;
use crate::request::role::Role;

impl Pool {
    /// Fills the scratch candidate lists: `primary` (and, for a disaggregated pair, `decode`).
    /// Returns whether the request is paired, or why no backend can take it.
    pub(super) fn eligible(
        &mut self,
        features: &RequestFeatures,
        now_ms: u64,
        headroom: Option<f64>,
    ) -> Result<bool, AcquireError> {
        // A pool holding a decode policy pairs, unless the request asked for one role.
        let pair_policy = self.policies.decode.is_some() && features.role_hint.is_none();
        let breaker = self.config.breaker;
        let mut model_known = false;
        let mut retry_ms: Option<u64> = None;
        // A follow-up of a stored response goes to the backend holding it, or nowhere.
        let pinned = match &features.previous_response_id {
            Some(id) => Some(self.holder_slot(id, features.owner.as_deref(), now_ms)?),
            None => None,
        };
        let scratch = &mut self.scratch;
        scratch.passed.clear();
        for (slot, s) in self.slots.iter().enumerate() {
            let Some(entry) = &s.entry else { continue };
            if pinned.is_some_and(|p| p as usize != slot) {
                continue;
            }
            match verdict(entry, features, pair_policy, now_ms, &breaker) {
                Verdict::OtherModel => continue,
                Verdict::OtherRole => {}
                Verdict::Unavailable { retry_after_ms } => {
                    retry_ms = Some(retry_ms.map_or(retry_after_ms, |r| r.min(retry_after_ms)));
                }
                Verdict::Eligible => scratch.passed.push(slot as u32),
            }
            model_known = true;
        }

        self.affinity
            .match_lengths(&features.block_hashes, &mut scratch.lengths);
        let longest = scratch.lengths.iter().copied().max().unwrap_or(0);
        let pricing = Pricing::new(self, features, now_ms, longest);
        // After a restart, admission is held until the running streams renewed.
        let held = headroom.is_some() && self.admission_held(now_ms);
        let scratch = &mut self.scratch;
        scratch.primary.clear();
        scratch.decode.clear();
        scratch.mixed.clear();
        let mut at_capacity = false;
        for &slot in &scratch.passed {
            let Some(entry) = &self.slots[slot as usize].entry else {
                continue;
            };
            let cached_blocks = scratch.lengths.get(slot as usize).copied().unwrap_or(0);
            let prefix = pricing.prefix(entry, cached_blocks);
            if let Some(headroom) = headroom {
                let tokens = prefix.uncached + u64::from(features.max_tokens);
                if held || !has_room_for(entry, pricing.twins, tokens, headroom) {
                    at_capacity = true;
                    continue;
                }
            }
            let candidate = pricing.price(slot, entry, &prefix, self.affinity.backend_fill(slot));
            let list = match (pair_policy, entry.spec.role) {
                (true, Role::Prefill) => &mut scratch.primary,
                (true, Role::Decode) => &mut scratch.decode,
                (true, Role::Mixed) => &mut scratch.mixed,
                (false, _) => &mut scratch.primary,
            };
            list.push(candidate);
        }
        let paired = pair_policy && !scratch.primary.is_empty() && !scratch.decode.is_empty();
        if pair_policy && !paired {
            std::mem::swap(&mut scratch.primary, &mut scratch.mixed);
            scratch.decode.clear();
        }
        if scratch.primary.is_empty() && at_capacity {
            return Err(AcquireError::AtCapacity);
        }
        if scratch.primary.is_empty() {
            let err = if model_known {
                AcquireError::NoBackendAvailable {
                    retry_after_s: retry_ms
                        .map_or(DEFAULT_RETRY_AFTER_S, |ms| ms.div_ceil(1000))
                        .clamp(1, 3600),
                }
            } else {
                AcquireError::ModelNotFound {
                    model: features.model.clone(),
                }
            };
            self.stats.acquire_errors
                [matches!(err, AcquireError::NoBackendAvailable { .. }) as usize] += 1;
            return Err(err);
        }
        Ok(paired)
    }
}
