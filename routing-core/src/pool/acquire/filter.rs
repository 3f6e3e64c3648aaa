//! The filters of step 1: whether a backend may take the request at all (it serves the model, has
//! the wanted role, is ready, healthy, admitted by its breaker and not 429-saturated), and, under
//! admission control, whether it has room for the request's uncached tokens. Filters decide; they
//! price nothing (see `price.rs`).

use super::super::entry::BackendEntry;
use crate::backend::breaker::BreakerConfig;
use crate::pool::has_room;
use crate::request::prompt::RequestFeatures;
use crate::request::role::Role;

/// What the filters say of one backend, in the order they ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// It does not serve the request's model.
    OtherModel,
    /// It serves the model, in a role the request does not want.
    OtherRole,
    /// It serves the model in a wanted role but cannot take a request now (not ready, unhealthy,
    /// its breaker open or refusing trials, or saturated): it may again in this many ms.
    Unavailable {
        /// When to try again.
        retry_after_ms: u64,
    },
    /// It may take the request.
    Eligible,
}

/// Filters one backend for `features`. `pair_policy`: the pool pairs disaggregated servers for
/// this request, so prefill and decode servers are wanted beside mixed ones.
pub(super) fn verdict(
    entry: &BackendEntry,
    features: &RequestFeatures,
    pair_policy: bool,
    now_ms: u64,
    breaker: &BreakerConfig,
) -> Verdict {
    // The "serves this model" rule (`backend::serving`), split so a model some backend lists but
    // none can take now is a 503 to retry, not a 404.
    let serving = entry.serving();
    if !serving.lists(&features.model) {
        return Verdict::OtherModel;
    }
    let role = entry.spec.role;
    let wanted = match features.role_hint {
        Some(hint) => role == hint,
        None => pair_policy || role == Role::Mixed,
    };
    if !wanted {
        return Verdict::OtherRole;
    }
    if !entry.available(now_ms, breaker) {
        return Verdict::Unavailable {
            retry_after_ms: entry.retry_after_ms(now_ms, breaker),
        };
    }
    debug_assert!(serving.serves(&features.model));
    Verdict::Eligible
}

/// Admission control's filter: whether `tokens` more (the request's uncached prompt and its
/// output) fit on the backend `headroom` over its capacity, its siblings' load and the guess of
/// what they placed since (`twins`) included.
pub(super) fn has_room_for(entry: &BackendEntry, twins: f64, tokens: u64, headroom: f64) -> bool {
    has_room(
        &entry.all_in_flight(twins),
        &entry.capacity(),
        tokens,
        headroom,
    )
}
