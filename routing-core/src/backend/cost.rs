//! The LLM cost model: how loaded a backend is, and what a request would cost there.
//!
//! A request's work is its prefill (prompt tokens not already in the backend's prefix cache) plus
//! its decode (expected output tokens); both occupy KV-cache space for the request's lifetime. So:
//!
//! ```text
//! load(b)        = (in-flight uncached prompt tokens(b) + in-flight expected output tokens(b))
//!                  / capacity_tokens(b)
//!                + queue_weight * scraped_waiting(b) / max_num_seqs(b)
//! marginal(r, b) = (prompt_tokens(r) - cached_tokens(r, b) + output_tokens(r)) / capacity_tokens(b)
//! benefit(r, b)  = cached_tokens(r, b) / capacity_tokens(b)
//! ```
//!
//! Everything is a fraction of the backend's capacity, so GPUs of different sizes compare fairly:
//! a load of 1.0 means the in-flight work fills its KV cache. The scraped waiting queue (vLLM's
//! `num_requests_waiting`) adds what the gateway cannot see: traffic from other gateways and
//! requests vLLM has preempted.

use serde::{Deserialize, Serialize};

/// Live load the pool tracks for one backend from its leases.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlight {
    /// Live leases.
    pub leases: u32,
    /// Prompt tokens of live leases not expected to hit the cache.
    pub prompt_tokens: u64,
    /// Expected output tokens of live leases.
    pub output_tokens: u64,
}

impl InFlight {
    /// Adds one lease's share.
    pub fn add(&mut self, prompt_tokens: u64, output_tokens: u64) {
        self.leases = self.leases.saturating_add(1);
        self.prompt_tokens = self.prompt_tokens.saturating_add(prompt_tokens);
        self.output_tokens = self.output_tokens.saturating_add(output_tokens);
    }

    /// Removes one lease's share, never going below zero.
    pub fn remove(&mut self, prompt_tokens: u64, output_tokens: u64) {
        self.leases = self.leases.saturating_sub(1);
        self.prompt_tokens = self.prompt_tokens.saturating_sub(prompt_tokens);
        self.output_tokens = self.output_tokens.saturating_sub(output_tokens);
    }
}

/// A backend's load as a fraction of its capacity (see the module documentation).
pub fn backend_load(
    in_flight: &InFlight,
    capacity_tokens: u64,
    waiting: f64,
    max_num_seqs: u32,
    queue_weight: f64,
) -> f64 {
    let tokens = in_flight
        .prompt_tokens
        .saturating_add(in_flight.output_tokens) as f64;
    let queue = if waiting.is_finite() && waiting > 0.0 {
        queue_weight * waiting / f64::from(max_num_seqs.max(1))
    } else {
        0.0
    };
    tokens / capacity_tokens.max(1) as f64 + queue
}

/// The load a request would add to a backend where `cached_tokens` of its prompt are cached.
pub fn marginal_load(
    prompt_tokens: u32,
    cached_tokens: u64,
    output_tokens: u32,
    capacity_tokens: u64,
) -> f64 {
    let uncached = u64::from(prompt_tokens).saturating_sub(cached_tokens);
    (uncached + u64::from(output_tokens)) as f64 / capacity_tokens.max(1) as f64
}

/// The prefill a request would skip on a backend, as a fraction of its capacity.
pub fn cache_benefit(cached_tokens: u64, capacity_tokens: u64) -> f64 {
    cached_tokens as f64 / capacity_tokens.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_never_goes_negative() {
        let mut f = InFlight::default();
        f.add(10, 5);
        f.remove(10, 5);
        f.remove(10, 5);
        assert_eq!(f, InFlight::default());
    }

    #[test]
    fn load_is_relative_to_capacity_plus_queue() {
        let f = InFlight {
            leases: 2,
            prompt_tokens: 600,
            output_tokens: 400,
        };
        assert!((backend_load(&f, 10_000, 0.0, 256, 1.0) - 0.1).abs() < 1e-12);
        assert!((backend_load(&f, 10_000, 128.0, 256, 1.0) - 0.6).abs() < 1e-12);
        assert!((backend_load(&f, 20_000, 0.0, 256, 1.0) - 0.05).abs() < 1e-12);
        assert!((backend_load(&f, 0, f64::NAN, 0, 1.0) - 1000.0).abs() < 1e-9);
    }

    #[test]
    fn cached_tokens_reduce_marginal_load() {
        assert!((marginal_load(1000, 0, 200, 12_000) - 0.1).abs() < 1e-12);
        assert!((marginal_load(1000, 800, 200, 12_000) - 400.0 / 12_000.0).abs() < 1e-12);
        assert!(
            (marginal_load(100, 800, 0, 1000)).abs() < 1e-12,
            "over-counted cache saturates"
        );
        assert!((cache_benefit(800, 8000) - 0.1).abs() < 1e-12);
    }
}
