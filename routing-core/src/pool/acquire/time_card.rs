//! The pool's [`TimeCard`]: the eligibility step run on three made-up requests (nothing to
//! prefill, [`SHORT_TOKENS`] and [`LONG_TOKENS`] uncached tokens), without ranking, admitting or
//! granting anything, so the card predicts exactly what an acquire would price.
//!
//! Which backends count, and the models the card lists, follow the one "serves this model" rule
//! (`backend::serving`, also behind the acquire's filter and `/v1/models`): a backend still loading
//! or never probed is not ready and its models are not advertised.
//!
//! The card is computed for the model most of the pool's ready backends serve (a pool of one
//! model, the usual case, is exact; the card lists every model served, so the Worker does not send
//! a pool requests for models it lacks). Each class is the least predicted time to first token
//! among the backends that could take it now (under admission control, those with room); the
//! queue figures come from the caller, which holds the waiting room.

use super::super::Pool;
use super::price::whole_ms;
use crate::region::time_card::{TimeCard, CARD_OUTPUT_TOKENS, LONG_TOKENS, SHORT_TOKENS};
use crate::request::endpoint::Endpoint;
use crate::request::prompt::RequestFeatures;

impl Pool {
    /// The pool's time card at `now_ms`, with the admission queue's length and predicted wait.
    pub fn time_card(&mut self, now_ms: u64, queued: u32, queue_wait_ms: u32) -> TimeCard {
        let mut card = TimeCard {
            at_ms: now_ms,
            queued,
            queue_wait_ms,
            ..TimeCard::default()
        };
        let mut counts: Vec<(String, u32)> = Vec::new();
        self.refresh_evidence(now_ms);
        for b in self.entries() {
            let serving = b.serving();
            if !serving.is_up() {
                continue;
            }
            card.ready += 1;
            let scraped_running = b.scraped.running.unwrap_or(0.0).max(0.0) as u32;
            card.running += b.in_flight.leases.max(scraped_running);
            card.max_seqs += b.capacity().max_num_seqs;
            card.queued_by_leases += b.evidence.queued;
            for m in serving.served_models() {
                match counts.iter_mut().find(|(name, _)| name == m) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((m.clone(), 1)),
                }
            }
        }
        let Some(model) = counts
            .iter()
            .max_by_key(|(_, n)| *n)
            .map(|(m, _)| m.clone())
        else {
            return card;
        };
        card.models = counts.into_iter().map(|(m, _)| m).collect();
        card.models.sort();
        let admission = self.config.admission;
        let headroom = admission.enabled.then_some(admission.overcommit);
        let mut decode_ms = None;
        let mut predict = |tokens: u32| -> Option<u32> {
            let features = RequestFeatures {
                request_id: String::new(),
                kind: Endpoint::Completions,
                model: model.clone(),
                stream: true,
                prompt_tokens: tokens,
                max_tokens: CARD_OUTPUT_TOKENS,
                routing_key: None,
                block_tokens: 0,
                block_hashes: Vec::new(),
                role_hint: None,
                sent_ahead: None,
                previous_response_id: None,
                stores_response: false,
                owner: None,
            };
            self.eligible(&features, now_ms, headroom).ok()?;
            let best = self
                .scratch
                .primary
                .iter()
                .filter(|c| c.ttft_ms.is_finite())
                .min_by(|a, b| a.ttft_ms.total_cmp(&b.ttft_ms))?;
            if tokens == SHORT_TOKENS && best.decode_ms.is_finite() {
                decode_ms = whole_ms(best.decode_ms);
            }
            whole_ms(best.ttft_ms)
        };
        card.cached_ms = predict(0);
        card.short_ms = predict(SHORT_TOKENS);
        card.long_ms = predict(LONG_TOKENS);
        card.decode_ms = decode_ms;
        if card.cached_ms.is_none() || card.short_ms.is_none() || card.long_ms.is_none() {
            card.decode_ms = None;
            card.cached_ms = None;
            card.short_ms = None;
            card.long_ms = None;
        }
        card
    }
}

#[cfg(test)]
mod tests {
    use crate::policy::PolicyKind;
    use crate::pool::test_support::{add_ready, features, pool_with, spec};
    use crate::pool::{Pool, PoolConfig};
    use crate::random::SplitMix64;

    #[test]
    fn an_idle_pool_predicts_a_curve_that_grows_with_the_prefill() {
        let mut pool = pool_with(PolicyKind::PredictedLatency, 2);
        let card = pool.time_card(1_000, 0, 0);
        assert_eq!(card.at_ms, 1_000);
        assert_eq!((card.ready, card.running), (2, 0));
        assert_eq!(card.models, vec!["llama".to_string()]);
        let (c, s, l) = (
            card.cached_ms.unwrap(),
            card.short_ms.unwrap(),
            card.long_ms.unwrap(),
        );
        assert!(c < s && s < l, "{card:?}");
        // At the default 100 us per token, 8,192 tokens take about 819 ms to prefill.
        assert!((700..1_000).contains(&l), "{card:?}");
        // Nothing was granted: the card is a dry run.
        assert_eq!(pool.in_flight_total(), 0);
    }

    #[test]
    fn load_on_the_pool_shows_on_its_card_and_a_pool_without_backends_predicts_nothing() {
        let mut pool = pool_with(PolicyKind::PredictedLatency, 1);
        let idle = pool.time_card(0, 0, 0);
        let mut rng = SplitMix64::new(1);
        let long = "word ".repeat(6_000);
        for i in 0..4 {
            pool.acquire(&features(&format!("{i} {long}")), 0, &mut rng)
                .unwrap();
        }
        let busy = pool.time_card(0, 3, 250);
        assert_eq!(busy.running, 4);
        assert!(
            busy.short_ms.unwrap() > idle.short_ms.unwrap() + 500,
            "{idle:?} {busy:?}"
        );
        assert_eq!(
            busy.predict_ms(0).unwrap(),
            u64::from(busy.cached_ms.unwrap()) + 250
        );
        let mut empty = pool_with(PolicyKind::PredictedLatency, 0);
        let card = empty.time_card(0, 0, 0);
        assert_eq!((card.cached_ms, card.ready), (None, 0));
        assert_eq!(card.predict_ms(10), None);
    }

    #[test]
    fn the_card_and_the_model_list_agree_a_loading_or_unprobed_backend_serves_nothing() {
        use crate::backend::BackendId;
        use crate::pool::test_support::up;
        use crate::pool::ProbeResult;
        let mut pool = Pool::new("p", PoolConfig::default());
        let with = |id: &str, model: &str| {
            let mut s = spec(id);
            s.models = vec![model.to_string()];
            s
        };
        add_ready(&mut pool, with("healthy", "llama"));
        // Was ready, restarted and is loading its weights again: lifecycle Ready, health Loading.
        let loading = add_ready(&mut pool, with("loading", "qwen"));
        let probe = ProbeResult {
            loading: true,
            ..ProbeResult::default()
        };
        pool.record_probe(&loading, &probe, 1).unwrap();
        // Registered, never probed: Pending and Unknown.
        pool.add_backend(with("unprobed", "mistral"), 0).unwrap();
        // Healthy, but answered that its only model does not exist.
        let lost = add_ready(&mut pool, with("lost", "phi"));
        assert!(pool.forget_model(&lost, "phi").unwrap());

        let card = pool.time_card(10, 0, 0);
        assert_eq!(card.models, vec!["llama".to_string()]);
        assert_eq!(card.models, pool.served_models());
        // `ready` counts the backends that are up, the one whose model is missing included.
        assert_eq!(card.ready, 2);
        // The acquire agrees: a listed model nobody can take now is a 503, not served.
        let mut rng = SplitMix64::new(1);
        for model in ["qwen", "mistral", "phi"] {
            let mut f = features("hi");
            f.model = model.into();
            assert!(pool.acquire(&f, 10, &mut rng).is_err(), "{model}");
        }
        let mut f = features("hi");
        f.model = "llama".into();
        let grant = pool.acquire(&f, 10, &mut rng).unwrap();
        assert_eq!(grant.backend, BackendId::new("healthy"));
        // Once it has loaded, its model is on the card and the list again.
        pool.record_probe(&loading, &up(), 20).unwrap();
        assert_eq!(pool.time_card(20, 0, 0).models, vec!["llama", "qwen"]);
        assert_eq!(pool.served_models(), vec!["llama", "qwen"]);
    }

    #[test]
    fn a_backend_whose_sequences_are_all_taken_predicts_the_wait_behind_them() {
        // The case: a backend running 2 sequences at a time with 10 long streams on it.
        let mut pool = Pool::new("p", PoolConfig::default());
        let mut s = spec("b0");
        s.capacity.max_num_seqs = 2;
        add_ready(&mut pool, s);
        let mut rng = SplitMix64::new(1);
        for i in 0..10 {
            let mut f = features(&format!("long {i}"));
            f.max_tokens = 4000;
            pool.acquire(&f, 0, &mut rng).unwrap();
        }
        let card = pool.time_card(100, 0, 0);
        assert_eq!((card.running, card.max_seqs), (10, 2));
        // Eight streams wait for one of two slots, each 4,000 tokens of decode away.
        assert!(card.cached_ms.unwrap() > 5_000, "{card:?}");
    }
}
