//! The prices of step 1: for a backend the filters let through, how much of the request's prompt
//! it probably holds (the prefix-affinity match, less what running requests have not computed
//! yet) and what the request would cost there: the cost model's load and cache benefit, and the
//! time model's time to first token (with the wait for room and the stretch of its prefill by
//! prompts arriving after it), decode time and harm to the sequences running there. Prices
//! decide nothing (see `filter.rs`); the policy ranks on them.

use super::super::entry::BackendEntry;
use super::super::Pool;
use crate::backend::cost::cache_benefit;
use crate::backend::time_model::{room_wait_ms, TimeModelConfig};
use crate::policy::Candidate;
use crate::request::prompt::RequestFeatures;
use crate::request::role::Role;

/// What pricing needs that is the same for every backend, read from the pool once per decision.
pub(super) struct Pricing<'a> {
    features: &'a RequestFeatures,
    now_ms: u64,
    block_tokens: u64,
    /// See `Pool::sibling_twins`.
    pub(super) twins: f64,
    queue_weight: f64,
    time_model: TimeModelConfig,
    /// The pool's learned ratio of real to requested output.
    output_ratio: f64,
    /// Expected output tokens of this request.
    expected_output: f64,
    /// Mean uncached prompt tokens of the pool's requests (prices other clients' queued ones).
    mean_uncached: f64,
    /// The longest prefix match of any backend, in blocks.
    longest: u32,
    /// The overhead the pool's backends have in common, in ms (see
    /// [`crate::backend::time_model::BackendTiming::excess_overhead_ms`]).
    overhead_floor_ms: f64,
    /// The pool's tail of end-to-end times, in ms, when learned and priced.
    e2e_tail_ms: Option<f64>,
}

/// How much of the request's prompt one backend holds.
#[derive(Debug, Clone, Copy)]
pub(super) struct PrefixMatch {
    /// Leading prompt blocks the affinity table says it holds.
    cached_blocks: u32,
    /// Of those, the ones computed by now.
    computed_blocks: u32,
    /// Leading blocks its running requests hold and have computed.
    computed_held: u64,
    /// `cached_blocks` in tokens, at most the prompt.
    cached_tokens: u64,
    /// Prompt tokens it would compute.
    pub(super) uncached: u64,
}

impl<'a> Pricing<'a> {
    /// Pricing for `features` at `now_ms` on `pool`, whose backends' longest match is `longest`
    /// blocks.
    pub(super) fn new(
        pool: &Pool,
        features: &'a RequestFeatures,
        now_ms: u64,
        longest: u32,
    ) -> Self {
        Pricing {
            features,
            now_ms,
            block_tokens: pool.block_tokens_for(features) as u64,
            twins: pool.sibling_twins(),
            queue_weight: pool.config.queue_weight,
            time_model: pool.config.time_model,
            output_ratio: pool.output_ratio.get(),
            expected_output: pool.output_ratio.expected(features.max_tokens),
            mean_uncached: pool.mean_uncached_tokens,
            longest,
            overhead_floor_ms: pool.common_overhead_ms.unwrap_or(f64::INFINITY),
            e2e_tail_ms: pool
                .e2e_tail
                .ms()
                .filter(|_| pool.config.predicted_latency.tail_harm_weight > 0.0),
        }
    }

    /// The prefix match on a backend whose affinity match is `cached_blocks` long.
    pub(super) fn prefix(&self, entry: &BackendEntry, cached_blocks: u32) -> PrefixMatch {
        let f = self.features;
        let prompt = u64::from(f.prompt_tokens);
        // Blocks a running request recorded but has not computed yet are no hit: a request
        // admitted meanwhile computes them again. Blocks past what running requests hold were
        // computed by earlier ones.
        let (held_blocks, computed_held) =
            entry
                .held
                .prefixes(&f.block_hashes, cached_blocks as usize, self.now_ms);
        let computed_blocks = if (held_blocks as u32) < cached_blocks {
            cached_blocks
        } else {
            computed_held as u32
        };
        // vLLM reuses whole KV blocks of its own size only (64 tokens by default in 0.34, from
        // the backend's `cache_config_info`): a match of the gateway's finer blocks counts down
        // to the engine's last whole block.
        let engine_block = u64::from(entry.capacity().block_size).max(1);
        let whole = |blocks: u32| {
            let tokens = u64::from(blocks) * self.block_tokens;
            (tokens - tokens % engine_block).min(prompt)
        };
        let cached_tokens = whole(cached_blocks);
        let computed_tokens = whole(computed_blocks);
        let mut uncached = prompt - computed_tokens;
        // The backend with the longest match most likely served this conversation's previous
        // turn, so it also holds that turn's answer, which the gateway never sees: credit it with
        // an answer's worth of cached tokens.
        if computed_tokens > 0 && computed_blocks == self.longest {
            uncached = uncached.saturating_sub(self.expected_output as u64).max(1);
        }
        PrefixMatch {
            cached_blocks,
            computed_blocks,
            computed_held: computed_held as u64,
            cached_tokens,
            uncached,
        }
    }

    /// The candidate the backend in `slot` makes for the request, with its prefix match `m` and
    /// the share of its KV cache the prefix-affinity table fills (`cache_fill`).
    pub(super) fn price(
        &self,
        slot: u32,
        entry: &BackendEntry,
        m: &PrefixMatch,
        cache_fill: f64,
    ) -> Candidate {
        let (f, now_ms, tm) = (self.features, self.now_ms, &self.time_model);
        let backend_capacity = entry.capacity();
        let capacity = backend_capacity.capacity_tokens();
        let external_queue_ms = if entry.external_waiting > 0.0 {
            entry.external_waiting * self.mean_uncached * entry.timing.prefill_ms_per_token(tm)
        } else {
            0.0
        } + entry.remote_backlog_ms(now_ms);
        let role = entry.spec.role;
        let mut predicted = entry.timing.predict(
            tm,
            if role == Role::Decode { 0 } else { m.uncached },
            self.expected_output,
            entry.running(self.twins),
            external_queue_ms,
            now_ms,
        );
        let in_flight = &entry.all_in_flight(self.twins);
        // The gateway's count misses prefixes that running requests share (only the first,
        // cold request counted them); vLLM's own usage at the last probe sees every pinned
        // block.
        let gauges = entry.load_gauges();
        let scraped_tokens = gauges
            .kv_usage
            .map_or(0, |u| (u.clamp(0.0, 1.0) * capacity as f64) as u64);
        // Prompt memory: the distinct blocks this coordinator's leases hold, or their
        // uncached tokens (with the siblings'), whichever is more.
        let held_tokens = entry.held.in_use() as u64 * self.block_tokens;
        let prompt_memory = held_tokens
            .saturating_add(entry.remote.prompt_tokens)
            .max(in_flight.prompt_tokens);
        let memory_tokens = (prompt_memory
            + (in_flight.output_tokens as f64 * self.output_ratio) as u64)
            .max(scraped_tokens);
        let request_memory = (u64::from(f.prompt_tokens)
            .saturating_sub(m.computed_held * self.block_tokens))
            + self.expected_output as u64;
        // The engine's queue: the scrape's, plus the streams lease evidence finds queued since
        // (`pool::evidence`), which run behind the leases that are not.
        let queued_by_leases = f64::from(entry.evidence.queued);
        let engine_waiting = gauges.waiting.unwrap_or(0.0) + queued_by_leases;
        let engine_running = gauges
            .running
            .unwrap_or(0.0)
            .max(f64::from(in_flight.leases) - queued_by_leases);
        let short_of_room = memory_tokens + request_memory > capacity
            || in_flight.leases >= backend_capacity.max_num_seqs.max(1)
            || engine_waiting > 0.0;
        // How long the backend takes to free its whole capacity: the sequences that fill it
        // (as many as its memory holds, at most its sequence slots) prefill one after another
        // and then decode together. Only needed when the request must wait for room.
        let drain_ms = if in_flight.leases == 0 || !short_of_room {
            predicted.decode_ms
        } else {
            let leases = f64::from(in_flight.leases);
            let running = entry.running(self.twins);
            let mean_prefill =
                in_flight.prompt_tokens as f64 / leases * entry.timing.prefill_ms_per_token(tm);
            let mean_decode = in_flight.output_tokens as f64 * self.output_ratio / leases
                * entry.timing.step_ms_with(tm, running);
            let fit_in_memory = capacity as f64 / (memory_tokens as f64 / leases).max(1.0);
            let per_capacity = fit_in_memory.min(f64::from(backend_capacity.max_num_seqs.max(1)));
            per_capacity.max(1.0) * mean_prefill + mean_decode
        };
        let room_wait = room_wait_ms(
            memory_tokens,
            // Memory for the prompt is needed wherever it is cached, except for the blocks
            // running requests hold already.
            request_memory,
            capacity,
            in_flight.leases,
            backend_capacity.max_num_seqs,
            drain_ms,
            (engine_waiting, engine_running),
        );
        // The prefill queue already counts the prefills of the requests ahead; a wait for
        // room counts them too (they run as room frees), so the longer of the two counts.
        // While the backend is short of room, requests granted earlier and still waiting for it
        // go first (vLLM admits in order); once it has room again, they have started.
        let blocked = if short_of_room {
            entry.timing.room_blocked_ms(now_ms)
        } else {
            0.0
        };
        let room_wait = (room_wait.max(blocked) - entry.timing.backlog_ms(now_ms)).max(0.0);
        predicted.ttft_ms += room_wait
            + entry
                .timing
                .excess_overhead_ms(self.overhead_floor_ms, now_ms);
        let share = entry.timing.prefill_share(now_ms);
        // Prefill time per ms of anything else there, at the recent share: what stalls a decode
        // and delays later arrivals.
        let prefill_per_ms = share / (1.0 - share);
        let own_uncached = if role == Role::Decode { 0 } else { m.uncached };
        let prefill_ms_per_token = entry.timing.prefill_ms_per_token(tm);
        let own_prefill_ms = own_uncached as f64 * prefill_ms_per_token;
        // Prompts arriving after this one share its prefill's steps (see
        // `BackendTiming::interference_ms`).
        predicted.ttft_ms += entry.timing.interference_ms(tm, own_prefill_ms, now_ms);
        let tail_harm_ms = self
            .e2e_tail_ms
            .map_or(0.0, |tail| entry.timing.tail_harm_ms(own_prefill_ms, tail));
        let own_chunk = own_uncached.min(u64::from(tm.step_token_budget));
        let first_token_harm_ms =
            entry.timing.prefilling(now_ms) as f64 * own_chunk as f64 * prefill_ms_per_token;
        Candidate {
            affinity_ms: u64::from(f.prompt_tokens).saturating_sub(m.uncached) as f64
                * prefill_ms_per_token,
            slot,
            weight: entry.spec.weight,
            leases: in_flight.leases,
            load: entry.load(self.queue_weight, self.twins),
            request_load: (u64::from(f.prompt_tokens) + u64::from(f.max_tokens)) as f64
                / capacity.max(1) as f64,
            benefit: cache_benefit(m.cached_tokens, capacity),
            cached_blocks: m.cached_blocks,
            computed_blocks: m.computed_blocks,
            ttft_ms: predicted.ttft_ms,
            decode_ms: predicted.decode_ms,
            harm_ms: predicted.harm_ms,
            wait_ms: room_wait + external_queue_ms,
            room_ms: room_wait,
            queue_ms: room_wait + external_queue_ms + entry.timing.backlog_ms(now_ms),
            first_token_harm_ms,
            stall_ms: predicted.decode_ms * prefill_per_ms,
            arrival_harm_ms: own_prefill_ms * prefill_per_ms,
            tail_harm_ms,
            cache_fill,
            resend_ms: match &f.sent_ahead {
                Some(ahead) if ahead.backend != entry.spec.id.0 => f64::from(ahead.resend_ms),
                _ => 0.0,
            },
        }
    }
}

/// A predicted time in whole milliseconds, if finite: how a price travels on a lease share, a
/// grant's receipt and the time card (used by `admit.rs`, `lease.rs` and `time_card.rs`, so the
/// later steps import it from the first and never each other back).
pub(super) fn whole_ms(ms: f64) -> Option<u32> {
    ms.is_finite()
        .then(|| ms.round().clamp(0.0, f64::from(u32::MAX)) as u32)
}
