//! Registry operations: adding, removing and patching backends, draining them, and applying
//! what a probe found (health, served models, scraped gauges).

use super::entry::{learn_seq_limit, BackendEntry, Slot};
use super::errors::unknown;
use super::evidence::LeaseEvidence;
use super::BackendStats;
use super::{BackendView, Pool, PoolError, ProbeResult, ScrapedGauges};
use crate::backend::breaker::CircuitBreaker;
use crate::backend::cost::InFlight;
use crate::backend::health::{Health, HealthState, HealthTransition, ProbeVerdict};
use crate::backend::held_blocks::HeldBlocks;
use crate::backend::time_model::BackendTiming;
use crate::backend::{BackendId, BackendKey, BackendPatch, BackendSpec, Lifecycle};
use crate::pool::shard::ShardLoad;

/// How long after its registration a backend that cannot be reached counts as still starting
/// (vLLM loading a large model listens only when it is done): 15 minutes.
pub const STARTUP_GRACE_MS: u64 = 15 * 60_000;

/// Fewest output tokens between two scrapes for their time per token to teach the time model.
const MIN_SCRAPED_TOKENS: f64 = 50.0;

impl Pool {
    /// Registers a backend, `pending` until its first successful probe.
    pub fn add_backend(&mut self, spec: BackendSpec, now_ms: u64) -> Result<BackendId, PoolError> {
        spec.validate()
            .map_err(|reason| PoolError::InvalidSpec { reason })?;
        if self.index.contains_key(&spec.id) {
            return Err(PoolError::DuplicateBackend { id: spec.id });
        }
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot::default());
                (self.slots.len() - 1) as u32
            }
        };
        let id = spec.id.clone();
        let s = &mut self.slots[slot as usize];
        s.entry = Some(BackendEntry {
            key: BackendKey {
                slot,
                generation: s.generation,
            },
            spec,
            lifecycle: Lifecycle::Pending,
            health: Health::default(),
            breaker: CircuitBreaker::new(),
            in_flight: InFlight::default(),
            probed_models: None,
            scraped: ScrapedGauges::default(),
            load_unknown: false,
            assumed_load: ScrapedGauges::default(),
            added_ms: now_ms,
            stats: BackendStats::default(),
            timing: BackendTiming::default(),
            external_running: 0.0,
            external_waiting: 0.0,
            tpot_scraped: None,
            remote: ShardLoad::default(),
            remote_at_ms: 0,
            reported: InFlight::default(),
            held: HeldBlocks::default(),
            learned_seqs: None,
            load_scraped_ms: None,
            evidence: LeaseEvidence::default(),
        });
        self.index.insert(id.clone(), slot);
        self.sync_affinity_capacity(slot);
        self.members_changed();
        Ok(id)
    }

    /// Removes a backend: it leaves the ring at once and its affinity entries are purged. Its
    /// live leases stay in the lease table until released or expired, and then touch nothing.
    pub fn remove_backend(
        &mut self,
        id: &BackendId,
        _now_ms: u64,
    ) -> Result<BackendSpec, PoolError> {
        let slot = self.slot_of(id)?;
        self.index.remove(id);
        let s = &mut self.slots[slot as usize];
        let entry = s.entry.take();
        s.generation = s.generation.wrapping_add(1);
        self.free_slots.push(slot);
        self.affinity.remove_backend(slot);
        self.members_changed();
        self.roster_changed();
        entry
            .map(|e| e.spec)
            .ok_or_else(|| PoolError::UnknownBackend { id: id.clone() })
    }

    /// Applies a partial update to a backend's spec.
    pub fn update_backend(
        &mut self,
        id: &BackendId,
        patch: &BackendPatch,
        _now_ms: u64,
    ) -> Result<BackendView, PoolError> {
        let slot = self.slot_of(id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(id))?;
        let next = patch
            .apply(&entry.spec)
            .map_err(|reason| PoolError::InvalidSpec { reason })?;
        let weight_changed = next.weight != entry.spec.weight;
        entry.spec = next;
        self.sync_affinity_capacity(slot);
        self.roster_changed();
        if weight_changed {
            self.members_changed();
        }
        self.view(slot).ok_or_else(|| unknown(id))
    }

    /// Drains or undrains a backend.
    ///
    /// `draining` is allowed from pending or ready (a backend without leases goes straight to
    /// `drained`); `ready` is allowed from draining or drained and gives `pending` if the backend
    /// is not healthy; setting the current state is a no-op. Everything else is refused:
    /// `pending -> ready` only happens on a successful probe, `drained` only when the last lease
    /// ends.
    pub fn set_lifecycle(
        &mut self,
        id: &BackendId,
        to: Lifecycle,
        _now_ms: u64,
    ) -> Result<Lifecycle, PoolError> {
        let slot = self.slot_of(id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(id))?;
        let from = entry.lifecycle;
        let next = match (from, to) {
            _ if from == to => from,
            (Lifecycle::Pending | Lifecycle::Ready, Lifecycle::Draining) => {
                if entry.in_flight.leases == 0 {
                    Lifecycle::Drained
                } else {
                    Lifecycle::Draining
                }
            }
            (Lifecycle::Drained, Lifecycle::Draining) => Lifecycle::Drained,
            (Lifecycle::Draining | Lifecycle::Drained, Lifecycle::Ready) => {
                if entry.health.is_serving() {
                    Lifecycle::Ready
                } else {
                    Lifecycle::Pending
                }
            }
            _ => return Err(PoolError::InvalidTransition { from, to }),
        };
        let changed = next != from;
        entry.lifecycle = next;
        if changed {
            self.roster_changed();
        }
        Ok(next)
    }

    /// Applies one probe result: health transitions, `pending -> ready` on the first success,
    /// served models and scraped gauges.
    pub fn record_probe(
        &mut self,
        id: &BackendId,
        probe: &ProbeResult,
        now_ms: u64,
    ) -> Result<Option<HealthTransition>, PoolError> {
        let slot = self.slot_of(id)?;
        let health_config = self.config.health;
        let time_model = self.config.time_model;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(id))?;
        // vLLM 0.34 refuses connections while it loads: a backend starting up (never yet
        // healthy, within STARTUP_GRACE_MS of its registration) or seen loading, that cannot be
        // reached, is still loading, not down.
        let starting = entry.health.state == HealthState::Loading
            || (entry.health.state == HealthState::Unknown
                && entry.lifecycle == Lifecycle::Pending
                && now_ms.saturating_sub(entry.added_ms) < STARTUP_GRACE_MS);
        let verdict = if probe.loading || (probe.unreachable && starting) {
            ProbeVerdict::Loading
        } else if probe.ok {
            ProbeVerdict::Up
        } else {
            ProbeVerdict::Down
        };
        let transition = entry.health.record(verdict, &health_config, now_ms);
        if entry.lifecycle == Lifecycle::Pending && entry.health.is_serving() {
            entry.lifecycle = Lifecycle::Ready;
        }
        if probe.ok {
            if let Some(models) = &probe.models {
                let models: Vec<String> =
                    models.iter().filter(|m| !m.is_empty()).cloned().collect();
                entry.probed_models = Some(models);
            }
        }
        let finite = |x: Option<f64>| x.filter(|v| v.is_finite() && *v >= 0.0);
        let page = &probe.metrics;
        if probe.ok && probe.load_unknown && !page.has_load() {
            // The scrape said nothing of its load (no page, or one without vLLM's series): not
            // zero, and not the last value either. Priced as the most loaded known backend.
            entry.load_unknown = true;
            entry.scraped.waiting = None;
            entry.scraped.running = None;
            entry.scraped.kv_usage = None;
            entry.external_running = 0.0;
            entry.external_waiting = 0.0;
        } else if page.has_load() {
            entry.load_unknown = false;
        }
        let scraped = &mut entry.scraped;
        scraped.waiting = finite(page.gauges.waiting).or(scraped.waiting);
        scraped.running = finite(page.gauges.running).or(scraped.running);
        scraped.kv_usage = finite(page.gauges.kv_usage).or(scraped.kv_usage);
        // What the server runs beyond the gateway's own leases is someone else's traffic.
        if page.gauges.running.is_some() || page.gauges.waiting.is_some() {
            let (running, waiting) = (
                scraped.running.unwrap_or(0.0),
                scraped.waiting.unwrap_or(0.0),
            );
            entry.learned_seqs = learn_seq_limit(entry.learned_seqs, running, waiting, now_ms);
            entry.load_scraped_ms = Some(now_ms);
            let ours = f64::from(entry.in_flight.leases) + f64::from(entry.remote.leases);
            let external = (running + waiting - ours).max(0.0);
            entry.external_waiting = external.min(waiting);
            entry.external_running = external - entry.external_waiting;
        }
        // vLLM's own measure of its decode speed since the last scrape, at its current batch.
        if let (Some(sum), Some(count)) = (page.tpot_seconds_sum, page.tpot_count) {
            if let Some((last_sum, last_count)) = entry.tpot_scraped {
                let tokens = count - last_count;
                if tokens >= MIN_SCRAPED_TOKENS && sum >= last_sum {
                    let tpot_ms = (sum - last_sum) / tokens * 1000.0;
                    let running = scraped.running.unwrap_or(1.0);
                    entry.timing.learn_tpot(&time_model, tpot_ms, running);
                }
            }
            entry.tpot_scraped = Some((sum, count));
        }
        let before = (
            scraped.kv_blocks,
            scraped.block_size,
            scraped.kv_cache_tokens,
        );
        scraped.kv_cache_tokens = page
            .gauges
            .kv_cache_tokens
            .filter(|&t| t > 0)
            .or(scraped.kv_cache_tokens);
        scraped.kv_blocks = page
            .gauges
            .kv_blocks
            .filter(|&b| b > 0)
            .or(scraped.kv_blocks);
        scraped.block_size = page
            .gauges
            .block_size
            .filter(|&b| b > 0)
            .or(scraped.block_size);
        if (
            scraped.kv_blocks,
            scraped.block_size,
            scraped.kv_cache_tokens,
        ) != before
        {
            self.sync_affinity_capacity(slot);
        }
        self.assume_unknown_loads();
        Ok(transition)
    }

    /// Gives every backend whose load is unknown the load of the most loaded known one (the
    /// largest waiting queue, running batch and KV usage scraped), so it is priced
    /// conservatively; with no known backend, only the gateway's own leases count.
    fn assume_unknown_loads(&mut self) {
        let mut most = ScrapedGauges::default();
        let max = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, None) => x,
            (None, y) => y,
        };
        for e in self.entries().filter(|e| !e.load_unknown) {
            most.waiting = max(most.waiting, e.scraped.waiting);
            most.running = max(most.running, e.scraped.running);
            most.kv_usage = max(most.kv_usage, e.scraped.kv_usage);
        }
        for slot in 0..self.slots.len() as u32 {
            if let Some(e) = self.entry_mut(slot).filter(|e| e.load_unknown) {
                e.assumed_load = most;
            }
        }
    }

    /// Records that backend `id` now holds a request's prompt prefix: after a retry, the backend
    /// that served the request, not the one first chosen, is where the next turn should go.
    pub fn record_prefix(&mut self, id: &BackendId, block_hashes: &[u64]) -> Result<(), PoolError> {
        let slot = self.slot_of(id)?;
        self.affinity.record(slot, block_hashes);
        Ok(())
    }

    /// The backend lease `lease_id` is on and how many leading blocks of its prompt were cached
    /// there when it was granted (`None`: not live, or counted again after the pool lost it).
    pub fn lease_cache_hit(&self, lease_id: u64) -> Option<(BackendId, usize)> {
        let key = self.leases.get(lease_id)?.primary.backend;
        let entry = self.entries_key(key)?;
        let hit = entry.held.cached_of(lease_id)?;
        Some((entry.spec.id.clone(), hit))
    }

    /// Records that backend `id` does not hold a request's prompt prefix past its first `keep`
    /// blocks after all: the request failed there before the first byte, and went elsewhere.
    pub fn forget_prefix(
        &mut self,
        id: &BackendId,
        block_hashes: &[u64],
        keep: usize,
    ) -> Result<(), PoolError> {
        let slot = self.slot_of(id)?;
        self.affinity.forget(slot, block_hashes, keep);
        Ok(())
    }

    /// Backend `id` answered that it does not serve `model` (vLLM's 404 "The model ... does not
    /// exist."): stop routing the model there until its next probe reports its models again. A
    /// backend whose only model it was is marked in its health instead (an empty list would mean
    /// "as registered"), so it stops being chosen for it all the same. Returns whether the model
    /// was forgotten now (not already), which is when the caller should probe it soon: so the
    /// probe-soon is asked at most once per backend and model between probes.
    pub fn forget_model(&mut self, id: &BackendId, model: &str) -> Result<bool, PoolError> {
        let slot = self.slot_of(id)?;
        let entry = self.entry_mut(slot).ok_or_else(|| unknown(id))?;
        if !entry.serving().lists(model) {
            return Ok(false);
        }
        let mut served = entry.serving().listed_models().to_vec();
        served.retain(|m| m != model);
        if served.is_empty() {
            entry.health.missing_model = Some(model.to_string());
            return Ok(true);
        }
        entry.probed_models = Some(served);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::scrape::VllmMetrics;
    use crate::policy::PolicyKind;
    use crate::pool::test_support::{features, pool_with, spec, up};
    use crate::pool::{AcquireError, PoolConfig, DEFAULT_RETRY_AFTER_S};
    use crate::random::SplitMix64;
    use crate::stream::outcome::Outcome;

    /// A probe whose `/metrics` page shows `running` sequences and `waiting` requests.
    fn scrape(running: f64, waiting: f64) -> ProbeResult {
        ProbeResult {
            ok: true,
            metrics: VllmMetrics {
                gauges: ScrapedGauges {
                    running: Some(running),
                    waiting: Some(waiting),
                    ..ScrapedGauges::default()
                },
                ..VllmMetrics::default()
            },
            ..ProbeResult::default()
        }
    }

    /// Issue 42, item 11: grants say when a backend left service, for the isolates' guesses.
    #[test]
    fn the_roster_number_moves_when_a_backend_leaves_service_and_grants_carry_it() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 3);
        let start = pool.roster();
        let mut rng = SplitMix64::new(1);
        assert_eq!(
            pool.acquire(&features("x"), 0, &mut rng).unwrap().roster,
            start
        );
        pool.record_probe(&"b0".into(), &up(), 1).unwrap();
        assert_eq!(pool.roster(), start, "probes leave it");
        pool.set_lifecycle(&"b1".into(), Lifecycle::Draining, 2)
            .unwrap();
        let drained = pool.roster();
        assert_ne!(drained, start);
        pool.set_lifecycle(&"b1".into(), Lifecycle::Draining, 3)
            .unwrap();
        assert_eq!(pool.roster(), drained, "no change, no new number");
        pool.remove_backend(&"b2".into(), 4).unwrap();
        assert_ne!(pool.roster(), drained);
        let g = pool.acquire(&features("y"), 5, &mut rng).unwrap();
        assert_eq!(g.roster, pool.roster());
    }

    #[test]
    fn a_scrape_without_vllm_series_is_load_unknown_and_priced_as_the_most_loaded() {
        let mut pool = pool_with(PolicyKind::PredictedLatency, 2);
        let (b0, b1) = (BackendId::from("b0"), BackendId::from("b1"));
        pool.record_probe(&b0, &scrape(4.0, 6.0), 1).unwrap();
        pool.record_probe(&b1, &scrape(1.0, 0.0), 1).unwrap();
        let idle_load = pool.backend(&b1).unwrap().load;
        // b1 restarts with --disable-log-stats: its page has no vllm:* series.
        let bare = ProbeResult {
            ok: true,
            load_unknown: true,
            ..ProbeResult::default()
        };
        pool.record_probe(&b1, &bare, 2).unwrap();
        let view = pool.backend(&b1).unwrap();
        assert!(view.load_unknown);
        assert_eq!(
            (view.scraped.waiting, view.scraped.running),
            (None, None),
            "never the last value kept"
        );
        assert!(
            view.load > idle_load,
            "priced as loaded as b0, not as empty: {} vs {idle_load}",
            view.load
        );
        let mut page = String::new();
        pool.render_metrics(&mut page);
        assert!(
            page.contains(r#"llm_gateway_backend_load_unknown{pool="p1",backend="b1"} 1"#),
            "{page}"
        );
        // Its series come back: known again.
        pool.record_probe(&b1, &scrape(0.0, 0.0), 3).unwrap();
        assert!(!pool.backend(&b1).unwrap().load_unknown);
    }

    #[test]
    fn a_starting_backend_that_refuses_connections_is_loading_not_down() {
        let mut pool = Pool::new("p1", crate::pool::PoolConfig::default());
        pool.add_backend(crate::pool::test_support::spec("b0"), 0)
            .unwrap();
        let id = BackendId::from("b0");
        let refused = ProbeResult {
            unreachable: true,
            ..ProbeResult::default()
        };
        for t in 1..=5 {
            pool.record_probe(&id, &refused, t * 1000).unwrap();
        }
        let v = pool.backend(&id).unwrap();
        assert_eq!(
            v.health,
            HealthState::Loading,
            "vLLM 0.34 refuses while loading"
        );
        assert_eq!(v.lifecycle, Lifecycle::Pending, "not ready");
        pool.record_probe(&id, &crate::pool::test_support::up(), 6000)
            .unwrap();
        assert_eq!(pool.backend(&id).unwrap().health, HealthState::Healthy);
        // Once it served, a refused connection is a backend down, as before.
        for t in 7..=12 {
            pool.record_probe(&id, &refused, t * 1000).unwrap();
        }
        assert_eq!(pool.backend(&id).unwrap().health, HealthState::Unhealthy);
        // A backend that never answers is not "starting" for ever.
        pool.add_backend(crate::pool::test_support::spec("b1"), 0)
            .unwrap();
        let b1 = BackendId::from("b1");
        for t in 0..5 {
            pool.record_probe(&b1, &refused, STARTUP_GRACE_MS + t)
                .unwrap();
        }
        assert_eq!(pool.backend(&b1).unwrap().health, HealthState::Unhealthy);
    }

    #[test]
    fn the_batch_limit_is_learned_from_a_queue_behind_a_full_batch() {
        let mut pool = pool_with(PolicyKind::PredictedLatency, 1);
        let id = BackendId::from("b0");
        let seqs = |pool: &Pool| pool.backend(&id).unwrap().capacity.max_num_seqs;
        let configured = seqs(&pool);
        assert_eq!(configured, 256);
        pool.record_probe(&id, &scrape(3.0, 0.0), 1).unwrap();
        assert_eq!(seqs(&pool), configured, "no queue: nothing learned");
        pool.record_probe(&id, &scrape(2.0, 8.0), 2).unwrap();
        assert_eq!(seqs(&pool), 2, "two running while eight wait");
        pool.record_probe(&id, &scrape(1.0, 8.0), 3).unwrap();
        assert_eq!(
            seqs(&pool),
            2,
            "caught between one ending and the next admitted"
        );
        pool.record_probe(&id, &scrape(5.0, 0.0), 4).unwrap();
        assert_eq!(seqs(&pool), 5, "a larger batch without a queue raises it");
        pool.record_probe(&id, &scrape(1.0, 0.0), 30_000).unwrap();
        assert_eq!(seqs(&pool), 5, "a small batch says nothing of the limit");
        pool.record_probe(&id, &scrape(1.0, 0.0), 70_000).unwrap();
        assert_eq!(seqs(&pool), configured, "unconfirmed for a minute: lapsed");
    }

    /// The issue's case: a backend registered with vLLM's default 256 sequences that really runs
    /// 2, with ten of the gateway's long streams on it (eight in vLLM's queue): a new short request
    /// is predicted to wait for a slot, where without the learned limit it looked free.
    #[test]
    fn a_request_behind_vllms_own_queue_is_predicted_to_wait() {
        let predicted = |waiting: f64| {
            let mut pool = pool_with(PolicyKind::PredictedLatency, 1);
            let id = BackendId::from("b0");
            let mut rng = SplitMix64::new(5);
            for i in 0..10 {
                let mut f = features(&format!("a long story {i}"));
                f.max_tokens = 1000;
                pool.acquire(&f, 10, &mut rng).unwrap();
            }
            pool.record_probe(&id, &scrape(2.0, waiting), 20).unwrap();
            let mut short = features("hi");
            short.max_tokens = 1;
            pool.acquire(&short, 30, &mut rng)
                .unwrap()
                .predicted_ttft_ms
                .unwrap()
        };
        let (blind, knowing) = (predicted(0.0), predicted(8.0));
        assert!(
            knowing > 20 * blind.max(1),
            "{knowing} ms against {blind} ms"
        );
    }

    #[test]
    fn pending_backend_serves_nothing_until_probed() {
        let mut pool = Pool::new("p", PoolConfig::default());
        let id = pool.add_backend(spec("a"), 0).unwrap();
        let mut rng = SplitMix64::new(1);
        assert_eq!(
            pool.acquire(&features("hi"), 1, &mut rng),
            Err(AcquireError::NoBackendAvailable {
                retry_after_s: DEFAULT_RETRY_AFTER_S
            })
        );
        pool.record_probe(&id, &up(), 2).unwrap();
        assert_eq!(pool.backend(&id).unwrap().lifecycle, Lifecycle::Ready);
        let grant = pool.acquire(&features("hi"), 3, &mut rng).unwrap();
        assert_eq!(grant.backend, id);
        assert_eq!(grant.candidates[0].api_key.as_deref(), Some("key-a"));
    }

    #[test]
    fn probed_models_replace_registered_ones() {
        let mut pool = pool_with(PolicyKind::LeastLoad, 1);
        let id = BackendId::from("b0");
        let probe = ProbeResult {
            ok: true,
            models: Some(vec!["mistral".into()]),
            ..ProbeResult::default()
        };
        pool.record_probe(&id, &probe, 1).unwrap();
        let mut rng = SplitMix64::new(0);
        assert!(matches!(
            pool.acquire(&features("x"), 2, &mut rng),
            Err(AcquireError::ModelNotFound { .. })
        ));
        let mut f = features("x");
        f.model = "mistral".into();
        assert!(pool.acquire(&f, 2, &mut rng).is_ok());
    }

    #[test]
    fn lifecycle_rules() {
        let mut pool = Pool::new("p", PoolConfig::default());
        let id = pool.add_backend(spec("a"), 0).unwrap();
        assert_eq!(
            pool.set_lifecycle(&id, Lifecycle::Ready, 0),
            Err(PoolError::InvalidTransition {
                from: Lifecycle::Pending,
                to: Lifecycle::Ready
            })
        );
        assert_eq!(
            pool.set_lifecycle(&id, Lifecycle::Draining, 0),
            Ok(Lifecycle::Drained)
        );
        assert_eq!(
            pool.set_lifecycle(&id, Lifecycle::Ready, 0),
            Ok(Lifecycle::Pending),
            "not healthy yet"
        );
        assert!(pool.set_lifecycle(&id, Lifecycle::Drained, 0).is_err());
        pool.record_probe(&id, &up(), 1).unwrap();
        assert_eq!(pool.backend(&id).unwrap().lifecycle, Lifecycle::Ready);
    }

    #[test]
    fn removing_a_backend_with_live_leases_never_goes_negative() {
        let mut pool = pool_with(PolicyKind::RoundRobin, 2);
        let mut rng = SplitMix64::new(0);
        let g = pool.acquire(&features("x"), 0, &mut rng).unwrap();
        pool.remove_backend(&g.backend, 1).unwrap();
        assert_eq!(pool.in_flight_total(), 0);
        assert_eq!(pool.live_leases(), 1);
        // The slot is reused by a new backend, which must not inherit the old lease's release.
        let id = pool.add_backend(spec("fresh"), 2).unwrap();
        pool.record_probe(&id, &up(), 2).unwrap();
        let g2 = pool.acquire(&features("y"), 3, &mut rng).unwrap();
        let before = pool.in_flight_total();
        assert!(pool.release(g.lease_id, &Outcome::from_status(500), 4));
        assert_eq!(pool.in_flight_total(), before);
        assert!(pool.release(g2.lease_id, &Outcome::from_status(200), 5));
        assert_eq!(pool.in_flight_total(), 0);
        assert_eq!(pool.live_leases(), 0);
        assert!(pool.remove_backend(&g.backend, 6).is_err());
    }

    #[test]
    fn update_backend_patches_and_validates() {
        let mut pool = pool_with(PolicyKind::Weighted, 2);
        let id = BackendId::from("b1");
        let patch = BackendPatch {
            weight: Some(4),
            ..BackendPatch::default()
        };
        assert_eq!(pool.update_backend(&id, &patch, 0).unwrap().weight, 4);
        let bad = BackendPatch {
            url: Some("nope".into()),
            ..BackendPatch::default()
        };
        assert!(matches!(
            pool.update_backend(&id, &bad, 0),
            Err(PoolError::InvalidSpec { .. })
        ));
        let mut rng = SplitMix64::new(0);
        let mut count = 0;
        for t in 0..50 {
            let g = pool.acquire(&features("x"), t, &mut rng).unwrap();
            count += usize::from(g.backend == id);
            pool.release(g.lease_id, &Outcome::default(), t);
        }
        assert_eq!(count, 40);
    }

    #[test]
    fn scraped_time_per_token_teaches_the_decode_rate() {
        let mut pool = pool_with(PolicyKind::PredictedLatency, 1);
        let id = BackendId::from("b0");
        let scrape = |sum: f64, count: f64| ProbeResult {
            ok: true,
            metrics: VllmMetrics {
                gauges: ScrapedGauges {
                    running: Some(4.0),
                    ..ScrapedGauges::default()
                },
                tpot_seconds_sum: Some(sum),
                tpot_count: Some(count),
                ..VllmMetrics::default()
            },
            ..ProbeResult::default()
        };
        pool.record_probe(&id, &scrape(0.0, 0.0), 1).unwrap();
        // 30 ms a token at a batch of 4, where the configured model says 10.6 ms.
        let mut sum = 0.0;
        for round in 1..=40u64 {
            sum += 200.0 * 0.030;
            pool.record_probe(&id, &scrape(sum, 200.0 * round as f64), round * 1000)
                .unwrap();
        }
        let t = pool.backend(&id).unwrap().timing;
        assert!(
            (t.decode_ms_per_step - 10.0 * 30.0 / 10.6).abs() < 1.0,
            "{t:?}"
        );
        // Too few tokens between scrapes teach nothing.
        let before = t.observations;
        pool.record_probe(&id, &scrape(sum + 0.3, 8_010.0), 50_000)
            .unwrap();
        assert_eq!(pool.backend(&id).unwrap().timing.observations, before);
    }
}
