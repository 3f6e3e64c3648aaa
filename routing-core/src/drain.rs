//! When a backend whose removal waits for its drain may go: once it is drained and nothing runs on
//! it any more (or it is already gone).

use crate::backend::Lifecycle;
use crate::pool::BackendView;

/// Whether a backend waiting to be removed (`None`: already gone) may be removed now.
pub fn drain_finished(backend: Option<&BackendView>) -> bool {
    backend.is_none_or(|v| v.leases_in_flight == 0 && v.lifecycle == Lifecycle::Drained)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(lifecycle: Lifecycle, leases_in_flight: u32) -> BackendView {
        BackendView {
            lifecycle,
            leases_in_flight,
            ..BackendView::default()
        }
    }

    #[test]
    fn only_a_drained_idle_or_gone_backend_is_finished() {
        assert!(drain_finished(None));
        assert!(drain_finished(Some(&view(Lifecycle::Drained, 0))));
        assert!(!drain_finished(Some(&view(Lifecycle::Drained, 1))));
        assert!(!drain_finished(Some(&view(Lifecycle::Draining, 0))));
        assert!(!drain_finished(Some(&view(Lifecycle::Ready, 0))));
    }
}
