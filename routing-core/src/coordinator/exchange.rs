//! This coordinator as one of its pool's shards: when its load goes to its siblings, and taking
//! theirs.
//!
//! A call that moves load (a lease taken, moved or ended) schedules a push of `Pool::load_report`
//! to every sibling: at once when the last push is at least `shard_exchange_ms` old, else at the
//! end of that interval; changes arriving meanwhile ride on the scheduled push. So a shard pushes
//! at most once per interval, and while its load changes its siblings' copy is never older than
//! about one interval. A sibling (shard k > 0) also arms its alarm at its next lease deadline,
//! since only shard 0's alarm probes. A push also carries the backends this shard's lease
//! evidence asks shard 0 to scrape (`super::evidence`).

use super::{Coordinator, Effects};
use crate::backend::BackendId;
use crate::pool::shard::LoadReport;

/// When this shard last pushed its load, whether a push is scheduled, and the scrapes the next
/// push asks shard 0 for.
#[derive(Debug, Default)]
pub(super) struct Exchange {
    last_push_ms: u64,
    scheduled: bool,
    scrape: Vec<BackendId>,
}

impl Exchange {
    /// The next push asks shard 0 to scrape `ids` too.
    pub(super) fn ask_scrape(&mut self, ids: Vec<BackendId>) {
        for id in ids {
            if !self.scrape.contains(&id) {
                self.scrape.push(id);
            }
        }
    }
}

/// A load push that is due.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadPush {
    /// This shard's load.
    pub report: LoadReport,
    /// The shards to push it to.
    pub siblings: Vec<u32>,
    /// On a sibling shard (k > 0) with leases: when its next lease expires, for its alarm.
    pub expiry_alarm_at_ms: Option<u64>,
}

impl Coordinator {
    /// The load changed: in how many ms to push it (`None`: one shard, or a push is already
    /// scheduled). Call [`Self::take_load_push`] then.
    pub fn load_changed(&mut self, now_ms: u64) -> Option<u64> {
        let config = self.pool.config();
        if config.shards <= 1 || self.exchange.scheduled {
            return None;
        }
        self.exchange.scheduled = true;
        Some((self.exchange.last_push_ms + config.shard_exchange_ms).saturating_sub(now_ms))
    }

    /// The scheduled push is due: this shard's load for its siblings.
    pub fn take_load_push(&mut self, now_ms: u64) -> LoadPush {
        self.exchange.scheduled = false;
        self.exchange.last_push_ms = now_ms;
        let mut report = self.pool.load_report(now_ms);
        report.scrape = std::mem::take(&mut self.exchange.scrape);
        LoadPush {
            report,
            siblings: self.siblings(),
            expiry_alarm_at_ms: self.pool.next_deadline().filter(|_| self.shard != 0),
        }
    }

    /// A sibling's load report. Returns whether it was taken into account, and on shard 0 the
    /// scrapes it asks for (an older report's too: the ask is news even when its load is not).
    pub fn accept_load(&mut self, report: LoadReport, now_ms: u64) -> (bool, Effects) {
        let effects = self.sibling_asked(&report, now_ms);
        (self.pool.accept_load_report(report, now_ms), effects)
    }
}
