//! Step 2 of a decision: the pool's (prefill) policy orders the eligible candidates, best first,
//! and for a prefill/decode pair its decode policy orders the decode candidates.

use crate::policy::ring::key_hash;
use crate::policy::{DecisionInput, DecisionKind, NO_CANDIDATE};
use crate::pool::Pool;
use crate::random::RandomSource;
use crate::request::prompt::RequestFeatures;

impl Pool {
    /// Writes the ranking into the scratch `order` (and `decode_order` when `paired`); says why
    /// the first candidate was chosen. Both orders hold at least one index.
    pub(super) fn rank(
        &mut self,
        features: &RequestFeatures,
        paired: bool,
        rng: &mut dyn RandomSource,
    ) -> DecisionKind {
        let scratch = &mut self.scratch;
        let limit = self.config.limit();
        scratch.slot_index.clear();
        scratch.slot_index.resize(self.slots.len(), NO_CANDIDATE);
        for (i, c) in scratch.primary.iter().enumerate() {
            scratch.slot_index[c.slot as usize] = i as u32;
        }
        let key_hash = features.routing_key.as_deref().map(key_hash);
        let input = DecisionInput {
            candidates: &scratch.primary,
            slot_index: &scratch.slot_index,
            key_hash,
            limit,
        };
        let decision = self.policies.prefill.rank(&input, rng, &mut scratch.order);
        if scratch.order.is_empty() {
            scratch.order.push(0);
        }
        scratch.decode_order.clear();
        if let (true, Some(decode)) = (paired, self.policies.decode.as_mut()) {
            scratch.slot_index.fill(NO_CANDIDATE);
            for (i, c) in scratch.decode.iter().enumerate() {
                scratch.slot_index[c.slot as usize] = i as u32;
            }
            let decode_input = DecisionInput {
                candidates: &scratch.decode,
                slot_index: &scratch.slot_index,
                key_hash,
                limit,
            };
            decode.rank(&decode_input, rng, &mut scratch.decode_order);
            if scratch.decode_order.is_empty() {
                scratch.decode_order.push(0);
            }
        }
        decision
    }
}
