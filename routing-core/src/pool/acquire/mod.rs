//! The decision: [`Pool::acquire`] chooses backends for a request and grants a lease, as four
//! named steps over reusable buffers ([`Scratch`]):
//!
//! 1. [`eligible`](Pool::eligible): the backends that may take the request (`filter.rs`), each
//!    priced by the cost and time models (`price.rs`), or why there are none;
//! 2. [`rank`](Pool::rank): the policy orders them (and a disaggregated pair's decode side);
//! 3. [`admit`](Pool::admit_choice): the first choice's lease shares, through its breaker;
//! 4. [`lease`](Pool::grant_lease): the lease itself and the [`Grant`] the Worker acts on.

mod admit;
mod eligible;
mod filter;
mod lease;
mod price;
mod rank;
#[cfg(test)]
mod tests;
mod time_card;

use super::{AcquireError, Grant, Pool};
use crate::policy::Candidate;
use crate::random::RandomSource;
use crate::request::prompt::RequestFeatures;

/// Reusable buffers for [`Pool::acquire`], so a decision allocates little.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    lengths: Vec<u32>,
    /// Slots the filters let through, in slot order.
    passed: Vec<u32>,
    primary: Vec<Candidate>,
    decode: Vec<Candidate>,
    mixed: Vec<Candidate>,
    slot_index: Vec<u32>,
    order: Vec<usize>,
    decode_order: Vec<usize>,
}

impl Pool {
    /// Chooses backends for a request and grants a lease on the first.
    ///
    /// Also expires overdue leases first, so their load does not distort the decision. Open
    /// breakers whose cooldown has passed admit their half-open trials here. With admission
    /// control on, backends at capacity are skipped (overcommitted as configured for an empty
    /// queue); see [`Pool::acquire_within`].
    pub fn acquire(
        &mut self,
        features: &RequestFeatures,
        now_ms: u64,
        rng: &mut dyn RandomSource,
    ) -> Result<Grant, AcquireError> {
        let admission = self.config.admission;
        let headroom = admission.enabled.then_some(admission.overcommit);
        self.acquire_within(features, now_ms, rng, headroom)
    }

    /// [`Pool::acquire`] with an explicit capacity rule: `headroom` `None` ignores capacity;
    /// `Some(h)` skips backends without room `h` over capacity ([`has_room`](crate::admission::has_room)), and when that
    /// leaves none, answers [`AcquireError::AtCapacity`].
    pub fn acquire_within(
        &mut self,
        features: &RequestFeatures,
        now_ms: u64,
        rng: &mut dyn RandomSource,
        headroom: Option<f64>,
    ) -> Result<Grant, AcquireError> {
        self.now_hint_ms = self.now_hint_ms.max(now_ms);
        self.expire_leases(now_ms);
        self.refresh_siblings(now_ms);
        self.refresh_evidence(now_ms);
        let paired = self.eligible(features, now_ms, headroom)?;
        let decision = self.rank(features, paired, rng);
        let admitted = self.admit_choice(features, paired, now_ms)?;
        Ok(self.grant_lease(features, decision, admitted, now_ms, rng))
    }

    /// Tokens per prefix block for this request: the Worker's, else the pool's.
    fn block_tokens_for(&self, features: &RequestFeatures) -> usize {
        if features.block_tokens > 0 {
            features.block_tokens as usize
        } else {
            self.config.block_tokens()
        }
    }
}
