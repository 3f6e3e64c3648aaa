//! Step 1 of a decision: which backends may take the request. A backend is eligible if it serves
//! the model, has the wanted role, is ready, healthy, admitted by its breaker, not 429-saturated
//! and (under admission control) has room; each eligible backend becomes a [`Candidate`] priced by
//! the cost model and the time model. When none is, the step says why.

use super::super::{AcquireError, Pool, DEFAULT_RETRY_AFTER_S};
use crate::backend::Role;
use crate::cost::cache_benefit;
use crate::policy::Candidate;
use crate::pool::has_room;
use crate::prompt::RequestFeatures;
use crate::time_model::room_wait_ms;

impl Pool {
    /// Fills the scratch candidate lists: `primary` (and, for a disaggregated pair, `decode`).
    /// Returns whether the request is paired, or why no backend can take it.
    pub(super) fn eligible(
        &mut self,
        features: &RequestFeatures,
        now_ms: u64,
        headroom: Option<f64>,
    ) -> Result<bool, AcquireError> {
        let block_tokens = self.block_tokens_for(features);
        let echo = self.echo();
        // A pool holding a decode policy pairs, unless the request asked for one role.
        let pair_policy = self.policies.decode.is_some() && features.role_hint.is_none();
        let output_tokens = features.max_tokens;
        let queue_weight = self.config.queue_weight;
        let breaker_config = self.config.breaker;
        let time_model = self.config.time_model;
        let expected_output = self.output_ratio.expected(output_tokens);
        let mean_uncached = self.mean_uncached_tokens;

        let scratch = &mut self.scratch;
        self.affinity
            .match_lengths(&features.block_hashes, &mut scratch.lengths);
        scratch.primary.clear();
        scratch.decode.clear();
        scratch.mixed.clear();
        let mut model_known = false;
        let mut at_capacity = false;
        let mut retry_ms: Option<u64> = None;
        // The backend with the longest match most likely served this conversation's previous
        // turn, so it also holds that turn's answer, which the gateway never sees: credit it with
        // an answer's worth of cached tokens.
        let longest = scratch.lengths.iter().copied().max().unwrap_or(0);
        let answer_credit = expected_output as u64;
        for (slot, s) in self.slots.iter().enumerate() {
            let Some(entry) = &s.entry else { continue };
            if !entry.serves(&features.model) {
                continue;
            }
            model_known = true;
            let role = entry.spec.role;
            let wanted = match features.role_hint {
                Some(hint) => role == hint,
                None => pair_policy || role == Role::Mixed,
            };
            if !wanted {
                continue;
            }
            if !entry.available(now_ms, &breaker_config) {
                let wait = entry.retry_after_ms(now_ms, &breaker_config);
                retry_ms = Some(retry_ms.map_or(wait, |r| r.min(wait)));
                continue;
            }
            let backend_capacity = entry.capacity();
            let capacity = backend_capacity.capacity_tokens();
            let cached_blocks = scratch.lengths.get(slot).copied().unwrap_or(0);
            // Blocks a running request recorded but has not computed yet are no hit: a request
            // admitted meanwhile computes them again. Blocks past what running requests hold were
            // computed by earlier ones.
            let (held_blocks, computed_held) =
                entry
                    .held
                    .prefixes(&features.block_hashes, cached_blocks as usize, now_ms);
            let computed_blocks = if (held_blocks as u32) < cached_blocks {
                cached_blocks
            } else {
                computed_held as u32
            };
            let cached_tokens = (u64::from(cached_blocks) * block_tokens as u64)
                .min(u64::from(features.prompt_tokens));
            let computed_tokens = (u64::from(computed_blocks) * block_tokens as u64)
                .min(u64::from(features.prompt_tokens));
            let mut uncached = u64::from(features.prompt_tokens) - computed_tokens;
            if computed_blocks > 0 && computed_blocks == longest {
                uncached = uncached.saturating_sub(answer_credit).max(1);
            }
            if let Some(headroom) = headroom {
                let tokens = uncached + u64::from(output_tokens);
                if !has_room(
                    &entry.all_in_flight(echo),
                    &backend_capacity,
                    tokens,
                    headroom,
                ) {
                    at_capacity = true;
                    continue;
                }
            }
            let external_queue_ms = if entry.external_waiting > 0.0 {
                entry.external_waiting
                    * mean_uncached
                    * entry.timing.prefill_ms_per_token(&time_model)
            } else {
                0.0
            } + entry.remote_backlog_ms(now_ms);
            let mut predicted = entry.timing.predict(
                &time_model,
                if role == Role::Decode { 0 } else { uncached },
                expected_output,
                entry.running(echo),
                external_queue_ms,
                now_ms,
            );
            let in_flight = &entry.all_in_flight(echo);
            // The gateway's count misses prefixes that running requests share (only the first,
            // cold request counted them); vLLM's own usage at the last probe sees every pinned
            // block.
            let scraped_tokens = entry
                .scraped
                .kv_usage
                .map_or(0, |u| (u.clamp(0.0, 1.0) * capacity as f64) as u64);
            // Prompt memory: the distinct blocks this coordinator's leases hold, or their
            // uncached tokens (with the siblings'), whichever is more.
            let held_tokens = entry.held.in_use() as u64 * block_tokens as u64;
            let prompt_memory = held_tokens
                .saturating_add(entry.remote.prompt_tokens)
                .max(in_flight.prompt_tokens);
            let memory_tokens = (prompt_memory
                + (in_flight.output_tokens as f64 * self.output_ratio.get()) as u64)
                .max(scraped_tokens);
            let request_memory = (u64::from(features.prompt_tokens)
                .saturating_sub(computed_held as u64 * block_tokens as u64))
                + expected_output as u64;
            let engine_waiting = entry.scraped.waiting.unwrap_or(0.0);
            let short_of_room = memory_tokens + request_memory > capacity
                || in_flight.leases >= backend_capacity.max_num_seqs.max(1)
                || engine_waiting > 0.0;
            // How long the backend takes to free its whole capacity: the sequences that fill it
            // prefill one after another and then decode together. (The request's own decode, used
            // before, priced a 1-token answer's wait for memory at about one engine step.) Only
            // needed when the request must wait for room.
            let drain_ms = if in_flight.leases == 0 || !short_of_room {
                predicted.decode_ms
            } else {
                let leases = f64::from(in_flight.leases);
                let running = entry.running(echo);
                let mean_prefill = in_flight.prompt_tokens as f64 / leases
                    * entry.timing.prefill_ms_per_token(&time_model);
                let mean_decode = in_flight.output_tokens as f64 * self.output_ratio.get() / leases
                    * entry.timing.step_ms_with(&time_model, running);
                let per_capacity = capacity as f64 / (memory_tokens as f64 / leases).max(1.0);
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
                (engine_waiting, entry.scraped.running.unwrap_or(0.0)),
            );
            // The prefill queue already counts the prefills of the requests ahead; a wait for
            // room counts them too (they run as room frees), so the longer of the two counts.
            let room_wait = (room_wait - entry.timing.backlog_ms(now_ms)).max(0.0);
            predicted.ttft_ms += room_wait;
            let candidate = Candidate {
                slot: slot as u32,
                weight: entry.spec.weight,
                leases: in_flight.leases,
                load: entry.load(queue_weight, echo),
                request_load: (u64::from(features.prompt_tokens) + u64::from(output_tokens)) as f64
                    / capacity.max(1) as f64,
                benefit: cache_benefit(cached_tokens, capacity),
                cached_blocks,
                computed_blocks,
                ttft_ms: predicted.ttft_ms,
                decode_ms: predicted.decode_ms,
                harm_ms: predicted.harm_ms,
                wait_ms: room_wait + external_queue_ms,
                queue_ms: room_wait + external_queue_ms + entry.timing.backlog_ms(now_ms),
            };
            let list = match (pair_policy, role) {
                (true, Role::Prefill) => &mut scratch.primary,
                (true, Role::Decode) => &mut scratch.decode,
                (true, Role::Mixed) => &mut scratch.mixed,
                (false, _) => &mut scratch.primary,
            };
            list.push(candidate);
        }
        let paired = pair_policy && !scratch.primary.is_empty() && !scratch.decode.is_empty();
        if pair_policy && !paired {
            std::mem::swap(&mut scratch.primary, &mut scratch.mixed);
            scratch.decode.clear();
        }
        if scratch.primary.is_empty() && at_capacity {
            return Err(AcquireError::AtCapacity);
        }
        if scratch.primary.is_empty() {
            let err = if model_known {
                AcquireError::NoBackendAvailable {
                    retry_after_s: retry_ms
                        .map_or(DEFAULT_RETRY_AFTER_S, |ms| ms.div_ceil(1000))
                        .clamp(1, 3600),
                }
            } else {
                AcquireError::ModelNotFound {
                    model: features.model.clone(),
                }
            };
            self.stats.acquire_errors
                [matches!(err, AcquireError::NoBackendAvailable { .. }) as usize] += 1;
            return Err(err);
        }
        Ok(paired)
    }
}
