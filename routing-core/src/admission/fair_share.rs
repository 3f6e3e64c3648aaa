//! Fair shares within one priority band: each tenant's requests form a [`Flow`], and the
//! [`Band`] serves its flows by deficit round robin weighted by the requests' estimated tokens.

use super::request::Ticket;
use std::collections::{HashMap, VecDeque};
use xxhash_rust::xxh3::xxh3_64;

/// One tenant's requests in one band and its deficit-round-robin credit.
#[derive(Debug, Clone, Default)]
pub(super) struct Flow {
    pub(super) queue: VecDeque<Ticket>,
    pub(super) deficit: i64,
    /// Whether the flow got its quantum on its current turn at the front.
    credited: bool,
}

/// One priority band: its tenants' flows and the round-robin order of those with requests.
#[derive(Debug, Clone, Default)]
pub(super) struct Band {
    pub(super) active: VecDeque<u64>,
    pub(super) flows: HashMap<u64, Flow>,
}

impl Band {
    pub(super) fn len(&self) -> usize {
        self.flows.values().map(|f| f.queue.len()).sum()
    }

    /// Deficit round robin, one request at a time: the next request this band serves. Both the
    /// real dispatch and the look-ahead (on a copy) call this, so they agree.
    pub(super) fn pop(
        &mut self,
        quantum: i64,
        cost_of: &dyn Fn(Ticket) -> i64,
    ) -> Option<(u64, Ticket)> {
        let mut rotations = 0;
        loop {
            let &tenant = self.active.front()?;
            let Some(flow) = self.flows.get_mut(&tenant) else {
                self.active.pop_front();
                continue;
            };
            let Some(&ticket) = flow.queue.front() else {
                self.active.pop_front();
                self.flows.remove(&tenant);
                continue;
            };
            let cost = cost_of(ticket);
            if flow.deficit >= cost {
                flow.deficit -= cost;
                flow.queue.pop_front();
                if flow.queue.is_empty() {
                    // An idle flow keeps no credit (or debt), as in deficit round robin.
                    self.active.pop_front();
                    self.flows.remove(&tenant);
                }
                return Some((tenant, ticket));
            }
            if !flow.credited {
                flow.deficit = flow.deficit.saturating_add(quantum);
                flow.credited = true;
                continue;
            }
            flow.credited = false;
            self.active.rotate_left(1);
            rotations += 1;
            if rotations >= self.active.len() {
                // A whole round and nobody could pay: skip the rounds in which nobody would.
                let rounds = self
                    .active
                    .iter()
                    .filter_map(|t| {
                        let f = self.flows.get(t)?;
                        let need = cost_of(*f.queue.front()?) - f.deficit;
                        Some((need.max(0) + quantum - 1) / quantum)
                    })
                    .min()
                    .unwrap_or(0);
                if rounds > 1 {
                    for f in self.flows.values_mut() {
                        f.deficit = f.deficit.saturating_add((rounds - 1) * quantum);
                    }
                }
                rotations = 0;
            }
        }
    }
}

/// The key a tenant's flow is filed under.
pub(super) fn tenant_key(tenant: &str) -> u64 {
    xxh3_64(tenant.as_bytes())
}
