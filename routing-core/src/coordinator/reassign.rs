//! A failed attempt before the first byte: whether the request may retry on its next candidate
//! (the pool-wide retry budget's gate), and the move itself.
//!
//! Refused by the budget, the failure still counts against the failed backend and the lease ends
//! with it. Allowed, the lease moves to the next candidate; a pool that lost the lease (it expired
//! while the attempt hung, or the Durable Object restarted) counts it again from the Worker's
//! terms first. A backend that answered vLLM's "model does not exist" 404 stops being offered the
//! model (a backend serving only that model leaves rotation for it) until its next probe; the
//! new backend records the request's prefix once it takes the request, and the failed one keeps
//! only what it held of it before (it never computed the rest).

use super::retry_budget::{RetryBudget, RetryBudgetConfig};
use crate::backend::BackendId;
use crate::pool::lease::{LeaseId, LeaseTerms};
use crate::pool::{CandidateView, Pool, PoolError};
use crate::stream::outcome::Outcome;
use serde::{Deserialize, Serialize};

/// One failed attempt, as the Worker reports it (the body of its `POST /reassign`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailedAttempt {
    /// The lease.
    pub lease_id: LeaseId,
    /// The next candidate.
    pub to: BackendId,
    /// How the attempt failed (fed to the failed backend's breaker).
    pub failure: Outcome,
    /// The lease as the Worker knows it (`backend`: the one that failed), so a pool that lost the
    /// lease counts it again and moves it rather than refusing the retry.
    #[serde(default)]
    pub terms: Option<LeaseTerms>,
    /// The request's prompt-prefix block hashes, recorded on `to` once it takes the request
    /// (base64 on the wire, see [`crate::request::block_hash_encoding`]).
    #[serde(default, with = "crate::request::block_hash_encoding")]
    pub block_hashes: Vec<u64>,
    /// The failed backend answered 404 for this model: it does not serve it (any more).
    #[serde(default)]
    pub missing_model: Option<String>,
}

/// Why a retry did not happen.
#[derive(Debug, Clone, PartialEq)]
pub enum RetryRefused {
    /// The pool's retry budget is spent: the lease ended with the failure.
    BudgetExhausted,
    /// The pool could not move the lease.
    Pool(PoolError),
}

/// What a reassignment did.
#[derive(Debug, Clone, PartialEq)]
pub struct Reassignment {
    /// The new candidate, or why there is none.
    pub result: Result<CandidateView, RetryRefused>,
    /// The failed backend no longer lists the model.
    pub forgot_model: bool,
    /// The caller should probe the pool now: the failed backend's models changed, and it did
    /// not ask for a probe in the last [`crate::backend::health::PROBE_SOON_MIN_INTERVAL_MS`].
    pub probe_soon: bool,
}

/// Retries `attempt` on its next candidate if the budget allows.
pub fn reassign(
    pool: &mut Pool,
    budget: &mut RetryBudget,
    budget_config: &RetryBudgetConfig,
    attempt: &FailedAttempt,
    now_ms: u64,
) -> Reassignment {
    // The backend said it lacks the model: true whether or not the request may go on.
    let forgot_model = match (attempt.missing_model.as_deref(), &attempt.terms) {
        (Some(model), Some(terms)) => pool.forget_model(&terms.backend, model).unwrap_or(false),
        _ => false,
    };
    let probe_soon = match &attempt.terms {
        Some(terms) if forgot_model => pool.ask_probe_soon(&terms.backend, now_ms),
        _ => false,
    };
    // Charged only once the move happened (below): a candidate the pool refuses costs nothing.
    if !budget.allows_retry(now_ms, budget_config) {
        pool.release(attempt.lease_id, &attempt.failure, now_ms);
        return Reassignment {
            result: Err(RetryRefused::BudgetExhausted),
            forgot_model,
            probe_soon,
        };
    }
    // Where the request failed and what that backend held of its prompt before it was chosen.
    let failed_at = pool.lease_cache_hit(attempt.lease_id);
    let (lease, to, failure) = (attempt.lease_id, &attempt.to, &attempt.failure);
    let mut result = pool.reassign(lease, to, failure, now_ms);
    if let (Err(PoolError::UnknownLease { .. }), Some(terms)) = (&result, &attempt.terms) {
        if pool.readmit(lease, terms, now_ms).is_ok() {
            result = pool.reassign(lease, to, failure, now_ms);
        }
    }
    if result.is_ok() {
        budget.record_retry(now_ms, budget_config);
    }
    if result.is_ok() && !attempt.block_hashes.is_empty() {
        // The failed backend never computed the prompt: the next turn must not go there for it.
        if let Some((from, keep)) = &failed_at {
            let _ = pool.forget_prefix(from, &attempt.block_hashes, *keep);
        }
        let _ = pool.record_prefix(to, &attempt.block_hashes);
    }
    Reassignment {
        result: result.map_err(RetryRefused::Pool),
        forgot_model,
        probe_soon,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendSpec;
    use crate::pool::test_support::add_ready;
    use crate::pool::PoolConfig;
    use crate::random::SplitMix64;
    use crate::request::prompt::RequestFeatures;
    use crate::stream::outcome::OutcomeKind;

    fn pool(n: usize) -> Pool {
        pool_serving(n, &["m", "other"])
    }

    /// A pool of `n` ready backends, each serving `models`.
    fn pool_serving(n: usize, models: &[&str]) -> Pool {
        let mut pool = Pool::new("p", PoolConfig::default());
        for i in 0..n {
            let spec = BackendSpec {
                id: format!("b{i}").as_str().into(),
                url: format!("http://b{i}:8000"),
                models: models.iter().map(|m| m.to_string()).collect(),
                ..BackendSpec::default()
            };
            add_ready(&mut pool, spec);
        }
        pool
    }

    fn features() -> RequestFeatures {
        RequestFeatures {
            model: "m".into(),
            prompt_tokens: 10,
            max_tokens: 10,
            ..RequestFeatures::default()
        }
    }

    fn timeout() -> Outcome {
        Outcome {
            kind: OutcomeKind::Timeout,
            ..Outcome::default()
        }
    }

    #[test]
    fn a_retry_within_the_budget_moves_the_lease_and_records_the_prefix() {
        let mut pool = pool(2);
        let grant = pool
            .acquire(&features(), 1, &mut SplitMix64::new(1))
            .unwrap();
        let to = grant.candidates[1].id.clone();
        let attempt = FailedAttempt {
            lease_id: grant.lease_id,
            to: to.clone(),
            failure: timeout(),
            terms: None,
            block_hashes: vec![7, 8],
            missing_model: None,
        };
        let config = RetryBudgetConfig::default();
        let done = reassign(&mut pool, &mut RetryBudget::new(), &config, &attempt, 2);
        assert_eq!(done.result.unwrap().id, to);
        assert_eq!(pool.backend(&to).unwrap().leases_in_flight, 1);
        assert_eq!(pool.backend(&grant.backend).unwrap().leases_in_flight, 0);
        assert_eq!(pool.backend(&to).unwrap().affinity_blocks, 2);
    }

    /// Issue 42, "still open" (c): the backend that failed before the first byte never
    /// computed the prompt, so the prefix table stops sending the conversation there: it keeps
    /// only what it held before the request (a shared system prompt), and the backend that served
    /// the retry holds the prompt.
    #[test]
    fn a_retry_takes_the_prompt_off_the_failed_backend_in_the_prefix_table() {
        let mut pool = pool(2);
        let chain: Vec<u64> = (1..=40).collect();
        let system = RequestFeatures {
            block_hashes: chain[..16].to_vec(),
            ..features()
        };
        let first = pool.acquire(&system, 1, &mut SplitMix64::new(1)).unwrap();
        let failed = first.backend.clone();
        pool.release(first.lease_id, &Outcome::from_status(200), 2);
        let whole = RequestFeatures {
            block_hashes: chain.clone(),
            ..features()
        };
        // The request that fails lands where the system prompt is held.
        let grant = (3..20)
            .find_map(|t| {
                let g = pool.acquire(&whole, t, &mut SplitMix64::new(t)).unwrap();
                if g.backend == failed {
                    return Some(g);
                }
                pool.release(g.lease_id, &Outcome::of_kind(OutcomeKind::Cancelled), t);
                None
            })
            .expect("a grant on the backend holding the system prompt");
        let to = grant
            .candidates
            .iter()
            .find(|c| c.id != failed)
            .unwrap()
            .id
            .clone();
        // Forget whatever the other grants recorded on `to`, so the test sees only the retry's.
        pool.remove_backend(&to, 30).unwrap();
        let spec = BackendSpec {
            id: to.clone(),
            url: "http://again:8000".into(),
            models: vec!["m".into()],
            ..BackendSpec::default()
        };
        add_ready(&mut pool, spec);
        assert_eq!(pool.backend(&failed).unwrap().affinity_blocks, 40);
        let attempt = FailedAttempt {
            lease_id: grant.lease_id,
            to: to.clone(),
            failure: timeout(),
            terms: None,
            block_hashes: chain.clone(),
            missing_model: None,
        };
        let config = RetryBudgetConfig::default();
        let done = reassign(&mut pool, &mut RetryBudget::new(), &config, &attempt, 31);
        assert_eq!(done.result.unwrap().id, to);
        assert_eq!(pool.backend(&to).unwrap().affinity_blocks, 40);
        assert_eq!(
            pool.backend(&failed).unwrap().affinity_blocks,
            16,
            "the failed backend keeps only the system prompt it held before"
        );
    }

    #[test]
    fn a_spent_budget_ends_the_lease_with_the_failure() {
        let mut pool = pool(2);
        let grant = pool
            .acquire(&features(), 1, &mut SplitMix64::new(1))
            .unwrap();
        let to = grant.candidates[1].id.clone();
        let none = RetryBudgetConfig {
            ratio: 0.0,
            min_per_window: 0,
            ..RetryBudgetConfig::default()
        };
        let mut budget = RetryBudget::new();
        let attempt = FailedAttempt {
            lease_id: grant.lease_id,
            to: to.clone(),
            failure: timeout(),
            terms: None,
            block_hashes: vec![],
            missing_model: None,
        };
        let done = reassign(&mut pool, &mut budget, &none, &attempt, 2);
        assert_eq!(done.result, Err(RetryRefused::BudgetExhausted));
        assert_eq!(pool.live_leases(), 0, "the lease ended");
        assert_eq!(budget.exhausted_total(), 1);
    }

    #[test]
    fn a_lost_lease_is_counted_again_then_moved_and_a_404_forgets_the_model() {
        let mut pool = pool(2);
        let (from, to): (BackendId, BackendId) = ("b0".into(), "b1".into());
        let terms = LeaseTerms {
            backend: from.clone(),
            prompt_tokens: 10,
            max_tokens: 10,
            stream: false,
            request_id: "r".into(),
        };
        let attempt = FailedAttempt {
            lease_id: 4242,
            to: to.clone(),
            failure: Outcome::from_status(404),
            terms: Some(terms.clone()),
            block_hashes: vec![],
            missing_model: Some("m".into()),
        };
        let config = RetryBudgetConfig::default();
        let done = reassign(&mut pool, &mut RetryBudget::new(), &config, &attempt, 2);
        assert_eq!(done.result.unwrap().id, to);
        assert!(done.forgot_model);
        assert_eq!(pool.backend(&to).unwrap().leases_in_flight, 1);
        assert!(!pool
            .backend(&from)
            .unwrap()
            .served_models
            .contains(&"m".to_string()));
    }

    #[test]
    fn a_one_model_backend_that_lost_its_model_stops_being_chosen_until_probed() {
        let mut pool = pool_serving(2, &["m"]);
        let grant = pool
            .acquire(&features(), 1, &mut SplitMix64::new(1))
            .unwrap();
        let (from, to) = (grant.backend.clone(), grant.candidates[1].id.clone());
        let terms = LeaseTerms {
            backend: from.clone(),
            prompt_tokens: 10,
            max_tokens: 10,
            stream: false,
            request_id: "r".into(),
        };
        let attempt = FailedAttempt {
            lease_id: grant.lease_id,
            to: to.clone(),
            failure: Outcome::from_status(404),
            terms: Some(terms.clone()),
            block_hashes: vec![],
            missing_model: Some("m".into()),
        };
        let config = RetryBudgetConfig::default();
        let mut budget = RetryBudget::new();
        let done = reassign(&mut pool, &mut budget, &config, &attempt, 2);
        assert!(done.forgot_model && done.probe_soon, "probe it soon");
        assert_eq!(done.result.unwrap().id, to);
        pool.release(grant.lease_id, &Outcome::from_status(200), 3);
        for t in 0..20 {
            let g = pool
                .acquire(&features(), 10 + t, &mut SplitMix64::new(t))
                .unwrap();
            assert_eq!(g.backend, to, "the backend without the model is not chosen");
            assert!(g.candidates.iter().all(|c| c.id != from));
            pool.release(g.lease_id, &Outcome::from_status(200), 10 + t);
        }
        // A second report of the same 404 asks for no second probe.
        assert_eq!(pool.forget_model(&from, "m"), Ok(false));
        // The next probe that lists the model brings it back.
        let probe = crate::pool::ProbeResult {
            ok: true,
            models: Some(vec!["m".into()]),
            ..Default::default()
        };
        pool.record_probe(&from, &probe, 100).unwrap();
        let mut chosen = std::collections::HashSet::new();
        for t in 0..20 {
            let g = pool
                .acquire(&features(), 200 + t, &mut SplitMix64::new(t))
                .unwrap();
            chosen.insert(g.backend.clone());
            pool.release(g.lease_id, &Outcome::from_status(200), 200 + t);
        }
        assert!(chosen.contains(&from), "{chosen:?}");
        // It says "no such model" again right away: forgotten again, but no second probe yet.
        let g = (0..50)
            .find_map(|seed| {
                let g = pool
                    .acquire(&features(), 300, &mut SplitMix64::new(seed))
                    .unwrap();
                if g.backend == from {
                    return Some(g);
                }
                pool.release(g.lease_id, &Outcome::from_status(200), 300);
                None
            })
            .expect("the restored backend is chosen again");
        let other = g
            .candidates
            .iter()
            .find(|c| c.id != g.backend)
            .unwrap()
            .id
            .clone();
        let terms_now = LeaseTerms {
            backend: g.backend.clone(),
            ..terms.clone()
        };
        let again = FailedAttempt {
            lease_id: g.lease_id,
            to: other.clone(),
            terms: Some(terms_now),
            ..attempt.clone()
        };
        let done = reassign(&mut pool, &mut budget, &config, &again, 300);
        assert!(done.forgot_model);
        assert!(!done.probe_soon, "a second probe within the interval");
        pool.release(g.lease_id, &Outcome::from_status(200), 301);
        assert!(pool.ask_probe_soon(
            &g.backend,
            300 + crate::backend::health::PROBE_SOON_MIN_INTERVAL_MS
        ));
    }
}
