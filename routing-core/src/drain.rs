//! When a backend whose removal waits for its drain may go: once it is drained and nothing runs on
//! it any more (or it is already gone), and never while a restart's hold lasts.
//!
//! **Restarts.** Leases live in memory only, so a pool that restarts knows a draining backend's
//! lifecycle (persisted) but none of its streams: they come back one by one as their Workers renew
//! (each renewal of a lease the pool lost counts it again). A draining backend restored with no
//! leases is therefore not drained yet: it stays draining, and nothing counts as finished, until
//! one lease lifetime after the restart ([`restart_hold_until`]), by which time every stream still
//! running has renewed.

use crate::backend::Lifecycle;
use crate::pool::BackendView;

/// Until when, after a restart at `restarted_ms`, a draining backend with no known leases is held
/// as draining: one lease lifetime, the longest a running stream goes without renewing.
pub fn restart_hold_until(restarted_ms: u64, lease_ttl_ms: u64) -> u64 {
    restarted_ms.saturating_add(lease_ttl_ms)
}

/// Whether a backend waiting to be removed (`None`: already gone) may be removed now, at `now_ms`,
/// with drains held until `hold_until_ms` (0 when no restart holds them).
pub fn drain_finished(backend: Option<&BackendView>, now_ms: u64, hold_until_ms: u64) -> bool {
    backend.is_none_or(|v| {
        v.leases_in_flight == 0
            && matches!(v.lifecycle, Lifecycle::Drained | Lifecycle::Draining)
            && now_ms >= hold_until_ms
    })
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
        assert!(drain_finished(None, 0, 0));
        assert!(drain_finished(Some(&view(Lifecycle::Drained, 0)), 0, 0));
        assert!(!drain_finished(Some(&view(Lifecycle::Drained, 1)), 0, 0));
        assert!(!drain_finished(Some(&view(Lifecycle::Draining, 1)), 0, 0));
        assert!(!drain_finished(Some(&view(Lifecycle::Ready, 0)), 0, 0));
    }

    #[test]
    fn a_restart_holds_every_drain_for_one_lease_lifetime() {
        let hold = restart_hold_until(1_000, 60_000);
        assert_eq!(hold, 61_000);
        // Restored draining with no known leases: its streams may not have renewed yet.
        let restored = view(Lifecycle::Draining, 0);
        assert!(!drain_finished(Some(&restored), 1_000, hold));
        assert!(!drain_finished(Some(&restored), 60_999, hold));
        // A renewed stream ended and left it drained: still held, another may renew.
        assert!(!drain_finished(
            Some(&view(Lifecycle::Drained, 0)),
            30_000,
            hold
        ));
        // A lifetime on, every running stream has renewed: idle means done.
        assert!(drain_finished(Some(&restored), 61_000, hold));
        assert!(!drain_finished(
            Some(&view(Lifecycle::Draining, 1)),
            61_000,
            hold
        ));
    }
}
