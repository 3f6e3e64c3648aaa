//! This pool as one of several coordinator shards: its load report for its siblings, their
//! reports summed into each backend's entry, and the estimate of what they placed since
//! (see [`crate::pool::shard`]). With one shard (the default) none of this counts.

use super::Pool;
use crate::pool::shard::{LoadReport, ShardLoad, SiblingLoads, SIBLING_ECHO};

impl Pool {
    /// Makes this pool one of `shards` coordinator shards (index `me`), whose siblings report their
    /// load every `exchange_ms`; one shard (the default) is the exact single coordinator.
    pub fn set_shard(&mut self, me: u32, shards: u32, exchange_ms: u64) {
        self.shard = me;
        self.shards = shards.max(1);
        self.siblings = (shards > 1).then(|| SiblingLoads::new(me, exchange_ms));
        for s in self.slots.iter_mut() {
            if let Some(e) = s.entry.as_mut() {
                e.remote = ShardLoad::default();
            }
        }
    }

    /// This shard's load on every busy backend, for its siblings.
    pub fn load_report(&mut self, now_ms: u64) -> LoadReport {
        for s in self.slots.iter_mut() {
            if let Some(e) = s.entry.as_mut() {
                e.reported = e.in_flight;
            }
        }
        LoadReport::new(
            self.shard,
            now_ms,
            self.entries().map(|e| {
                let f = e.in_flight;
                let load = ShardLoad {
                    leases: f.leases,
                    prompt_tokens: f.prompt_tokens,
                    output_tokens: f.output_tokens,
                    backlog_ms: e.timing.backlog_ms(now_ms),
                };
                (e.spec.id.clone(), load)
            }),
        )
    }

    /// Takes a sibling shard's load report into account from now on. Returns false if it was
    /// ignored (one shard, this shard's own report, or older than the one held).
    pub fn accept_load_report(&mut self, report: LoadReport, now_ms: u64) -> bool {
        let Some(siblings) = self.siblings.as_mut() else {
            return false;
        };
        let accepted = siblings.accept(report);
        if accepted {
            self.sum_siblings(now_ms);
        }
        accepted
    }

    /// How many placements the sibling shards are guessed to have made for each of this shard's
    /// own since its last report: (shards − 1) × [`SIBLING_ECHO`] (0 with one shard).
    pub(super) fn sibling_twins(&self) -> f64 {
        f64::from(self.shards - 1) * SIBLING_ECHO
    }

    /// Re-sums the siblings' load once per exchange interval, so stale reports stop counting.
    pub(super) fn refresh_siblings(&mut self, now_ms: u64) {
        let interval = self.siblings.as_ref().map(SiblingLoads::exchange_ms);
        if interval.is_some_and(|ms| now_ms >= self.siblings_summed_ms + ms) {
            self.sum_siblings(now_ms);
        }
    }

    fn sum_siblings(&mut self, now_ms: u64) {
        let Some(siblings) = self.siblings.as_ref() else {
            return;
        };
        for s in self.slots.iter_mut() {
            if let Some(e) = s.entry.as_mut() {
                e.remote = ShardLoad::default();
                e.remote_at_ms = now_ms;
            }
        }
        let (slots, index) = (&mut self.slots, &self.index);
        siblings.for_each_total(now_ms, |id, load| {
            if let Some(e) = index
                .get(id)
                .and_then(|&i| slots[i as usize].entry.as_mut())
            {
                e.remote = load;
            }
        });
        self.siblings_summed_ms = now_ms;
    }
}
