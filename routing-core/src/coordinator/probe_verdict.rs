//! What a probe's `/health` 503 means: "loading its model" only for a backend that has never
//! served; once it has, a 503 is a failed probe, subject to the health thresholds like any other.

use crate::backend::Lifecycle;
use crate::pool::ProbeResult;

/// The failure a 503 becomes once a backend has served.
pub const UNAVAILABLE_AFTER_START: &str = "/health answered 503";

/// Settles a probe `result` for a backend in `lifecycle` (`None`: the backend is gone). Returns
/// the failure to report when a 503 no longer counts as loading.
pub fn settle_loading(
    result: &mut ProbeResult,
    lifecycle: Option<Lifecycle>,
) -> Option<&'static str> {
    let started = lifecycle.is_some_and(|l| l != Lifecycle::Pending);
    if result.loading && started {
        result.loading = false;
        return Some(UNAVAILABLE_AFTER_START);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loading() -> ProbeResult {
        ProbeResult {
            loading: true,
            ..ProbeResult::default()
        }
    }

    #[test]
    fn a_503_is_loading_only_before_the_first_success() {
        let mut r = loading();
        assert_eq!(settle_loading(&mut r, Some(Lifecycle::Pending)), None);
        assert!(r.loading);
        for started in [Lifecycle::Ready, Lifecycle::Draining, Lifecycle::Drained] {
            let mut r = loading();
            assert_eq!(
                settle_loading(&mut r, Some(started)),
                Some(UNAVAILABLE_AFTER_START)
            );
            assert!(!r.loading && !r.ok, "{started:?}");
        }
    }

    #[test]
    fn other_answers_and_gone_backends_are_left_alone() {
        let mut ok = ProbeResult {
            ok: true,
            ..ProbeResult::default()
        };
        assert_eq!(settle_loading(&mut ok, Some(Lifecycle::Ready)), None);
        assert!(ok.ok);
        let mut r = loading();
        assert_eq!(settle_loading(&mut r, None), None);
    }
}
