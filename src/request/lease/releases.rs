//! Lease releases, sent together when an isolate has several for the same pool shard.
//!
//! Every proxied request ends with a release, one Durable Object call each. Under load an isolate
//! ends requests faster than a call takes, so releases are collected per pool shard while a call
//! to that shard is in flight: the request whose release found no call in flight sends it at once
//! (an idle gateway never waits), and when its call returns it sends whatever other requests
//! queued meanwhile as one `ReleaseBatch`, and so on until nothing is queued, at most
//! [`MAX_ROUNDS`] calls, after which it hands over. So no release waits for more than the call in
//! flight before it, and a busy isolate makes a fraction of the calls.
//!
//! Every queued release is sent: the queue is only ever non-empty while a sender is between two
//! of its calls and will look at it again. A sender that never comes back (its invocation was cut
//! off) is dropped as a Rust future, which hands over; one that has not come back after
//! [`SENDER_LOST_MS`] is presumed lost and the next release takes its place. Failures are logged
//! per lease, and a lease's deadline stays the backstop, as for a single release.

use crate::platform::do_client::{call, To};
use crate::platform::isolate;
use coordinator_protocol::messages::{ReleaseBatch, ReleaseRequest};
use coordinator_protocol::ApiError;
use worker::Env;

/// Most calls one sender makes before it hands over (it keeps its invocation alive meanwhile).
const MAX_ROUNDS: u32 = 8;
/// A sender that has not come back for this long is presumed lost.
const SENDER_LOST_MS: u64 = 10_000;

/// Releases a lease in shard `shard` of `pool`: sent now, or with the next batch of the call in
/// flight to that shard.
pub async fn release(env: &Env, pool: &str, shard: u32, req: ReleaseRequest) {
    let key = (pool.to_string(), shard);
    let Some((id, mut batch)) = lead_or_queue(&key, req) else {
        return;
    };
    let sending = Sending { key: &key, id };
    for round in 1..=MAX_ROUNDS {
        if round == MAX_ROUNDS {
            // Hand over before the last call, so nothing queued meanwhile waits for it.
            sending.stop();
        }
        send(env, pool, shard, batch).await;
        if round == MAX_ROUNDS {
            break;
        }
        match sending.next_batch() {
            Some(next) => batch = next,
            None => break,
        }
    }
}

/// Queues `req` behind the sender in flight, or makes the caller the sender: its id and first
/// batch (anything a lost sender left, then `req`).
fn lead_or_queue(key: &(String, u32), req: ReleaseRequest) -> Option<(u64, Vec<ReleaseRequest>)> {
    let now = crate::platform::http::now_ms();
    isolate::with_release_queues(|q| {
        let mut q = q.borrow_mut();
        let queue = q.entry(key.clone()).or_default();
        match queue.sender {
            Some((_, since)) if now.saturating_sub(since) < SENDER_LOST_MS => {
                queue.queued.push(req);
                None
            }
            _ => {
                let id = isolate::next_sender_id();
                queue.sender = Some((id, now));
                let mut batch = std::mem::take(&mut queue.queued);
                batch.push(req);
                Some((id, batch))
            }
        }
    })
}

/// A sender's hold on its shard's queue; dropped (or stopped), it hands over.
struct Sending<'a> {
    key: &'a (String, u32),
    id: u64,
}

impl Sending<'_> {
    /// What was queued meanwhile; `None` (and handed over) when nothing was.
    fn next_batch(&self) -> Option<Vec<ReleaseRequest>> {
        isolate::with_release_queues(|q| {
            let mut q = q.borrow_mut();
            let queue = q.get_mut(self.key)?;
            if queue.queued.is_empty() {
                if queue.sender.is_some_and(|(id, _)| id == self.id) {
                    queue.sender = None;
                }
                return None;
            }
            Some(std::mem::take(&mut queue.queued))
        })
    }

    /// Hands over: the next release leads its own call.
    fn stop(&self) {
        isolate::with_release_queues(|q| {
            if let Some(queue) = q.borrow_mut().get_mut(self.key) {
                if queue.sender.is_some_and(|(id, _)| id == self.id) {
                    queue.sender = None;
                }
            }
        });
    }
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One call: `/release` for a single lease, `/release_batch` for several. The answers (which
/// leases were still live) are not used.
async fn send(env: &Env, pool: &str, shard: u32, batch: Vec<ReleaseRequest>) {
    let sent = if let [one] = batch.as_slice() {
        call(env, To::Pool(pool, shard), one).await.map(drop)
    } else {
        let body = ReleaseBatch { releases: batch };
        let sent = call(env, To::Pool(pool, shard), &body).await.map(drop);
        return log_failure(sent, &body.releases, pool);
    };
    log_failure(sent, &batch, pool);
}

fn log_failure(sent: Result<(), ApiError>, batch: &[ReleaseRequest], pool: &str) {
    if let Err(e) = sent {
        for r in batch {
            let lease_id = r.lease_id;
            worker::console_error!("release of lease {lease_id} in pool {pool} failed: {e}");
        }
    }
}
