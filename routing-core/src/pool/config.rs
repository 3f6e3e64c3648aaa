//! A pool's configuration: [`PoolConfig`], its ranges ([`PoolConfig::validate`]) and
//! [`ConfigError`], with the admission knobs ([`AdmissionConfig`]) it carries.

use crate::backend::breaker::BreakerConfig;
use crate::backend::health::HealthConfig;
use crate::backend::time_model::TimeModelConfig;
use crate::policy::{CacheAwareConfig, ConsistentHashConfig, PolicyKind, PredictedLatencyConfig};
use crate::pool::shard::{DEFAULT_EXCHANGE_MS, MAX_SHARDS};
use crate::request::prompt::DEFAULT_BLOCK_TOKENS;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A pool's configuration, persisted by the Durable Object and changed through the admin API.
/// Every field has a default, so partial JSON works.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolConfig {
    /// The routing policy (default `cache_aware`).
    pub policy: PolicyKind,
    /// The pool's region (free text, e.g. `us-east`; default empty).
    pub region: String,
    /// Candidates in a grant: the choice plus fallbacks (default 3, 1 to 16).
    pub max_candidates: usize,
    /// Tokens per prefix block; must match the Worker's `FeatureConfig::block_tokens`
    /// (default 16).
    pub block_tokens: usize,
    /// A lease expires this long after it was granted or last renewed, unless released (default
    /// 60,000 ms, at least [`MIN_LEASE_TTL_MS`]). The Worker renews a live request's lease several
    /// times per period, so this bounds how long the load of a request whose Worker died stays
    /// counted, not how long a request may run.
    pub lease_ttl_ms: u64,
    /// Weight of the scraped waiting queue in a backend's load (default 1.0).
    pub queue_weight: f64,
    /// Global bound on prefix-affinity entries (default 500,000, about 36 MB; an entry stands for
    /// up to [`crate::pool::affinity::CHUNK_BLOCKS`] blocks of a prompt, so the default covers up
    /// to 8,000,000 blocks).
    pub affinity_max_entries: usize,
    /// consistent_hash knobs.
    pub consistent_hash: ConsistentHashConfig,
    /// cache_aware (and disaggregated prefill) knobs.
    pub cache_aware: CacheAwareConfig,
    /// predicted_latency knobs.
    pub predicted_latency: PredictedLatencyConfig,
    /// The time model's starting rates and learning ([`crate::backend::time_model`]).
    pub time_model: TimeModelConfig,
    /// Circuit-breaker thresholds and timings.
    pub breaker: BreakerConfig,
    /// Health-probe thresholds.
    pub health: HealthConfig,
    /// Admission control: backend capacity and the queue ([`crate::admission`]).
    pub admission: AdmissionConfig,
    /// Coordinator shards: Durable Objects the pool's coordination is split over (default 1, the
    /// single exact coordinator; at most [`MAX_SHARDS`]). See [`crate::pool::shard`].
    pub shards: u32,
    /// Interval between a shard's load reports to its siblings, ms (default
    /// [`DEFAULT_EXCHANGE_MS`]; 50 to 1,000).
    pub shard_exchange_ms: u64,
}

/// Shortest accepted `lease_ttl_ms`. Every live stream renews its lease every third of the TTL,
/// all against the one object of its pool shard: the renew rate is streams / (ttl / 3), so at
/// 1 s, 2,000 streams renew about 6,000 times a second, more than one object serves; at 10 s
/// they renew 600 times a second. A short TTL buys little: it only bounds how long the load of a
/// request whose Worker died stays counted.
pub const MIN_LEASE_TTL_MS: u64 = 10_000;

/// Accepted range of `shard_exchange_ms`.
pub const SHARD_EXCHANGE_MS_RANGE: (u64, u64) = (50, 1_000);

/// Most candidates a grant can carry.
pub const MAX_CANDIDATES: usize = 16;

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            policy: PolicyKind::default(),
            region: String::new(),
            max_candidates: 3,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            lease_ttl_ms: 60_000,
            queue_weight: 1.0,
            affinity_max_entries: 500_000,
            consistent_hash: ConsistentHashConfig::default(),
            cache_aware: CacheAwareConfig::default(),
            predicted_latency: PredictedLatencyConfig::default(),
            time_model: TimeModelConfig::default(),
            breaker: BreakerConfig::default(),
            health: HealthConfig::default(),
            admission: AdmissionConfig::default(),
            shards: 1,
            shard_exchange_ms: DEFAULT_EXCHANGE_MS,
        }
    }
}

impl PoolConfig {
    /// Checks every knob's range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |m: &str| Err(ConfigError(m.to_string()));
        if self.max_candidates == 0 || self.max_candidates > MAX_CANDIDATES {
            return fail("max_candidates must be between 1 and 16");
        }
        if self.block_tokens == 0 || self.block_tokens > 4096 {
            return fail("block_tokens must be between 1 and 4096");
        }
        if self.lease_ttl_ms < MIN_LEASE_TTL_MS {
            return fail(
                "lease_ttl_ms must be at least 10000 (every stream renews each third of it against one object)",
            );
        }
        if !(self.queue_weight.is_finite() && self.queue_weight >= 0.0) {
            return fail("queue_weight must be a finite number at least 0");
        }
        if self.affinity_max_entries > 100_000_000 {
            return fail("affinity_max_entries must be at most 100,000,000");
        }
        self.consistent_hash.validate().map_err(ConfigError)?;
        self.cache_aware.validate().map_err(ConfigError)?;
        self.predicted_latency.validate().map_err(ConfigError)?;
        self.time_model.validate().map_err(ConfigError)?;
        self.breaker.validate().map_err(ConfigError)?;
        if self.health.failure_threshold == 0 || self.health.success_threshold == 0 {
            return fail("health thresholds must be at least 1");
        }
        self.admission.validate().map_err(ConfigError)?;
        if self.shards == 0 || self.shards > MAX_SHARDS {
            return fail("shards must be between 1 and 64");
        }
        let (lo, hi) = SHARD_EXCHANGE_MS_RANGE;
        if !(lo..=hi).contains(&self.shard_exchange_ms) {
            return fail("shard_exchange_ms must be between 50 and 1000");
        }
        Ok(())
    }

    pub(super) fn limit(&self) -> usize {
        self.max_candidates.clamp(1, MAX_CANDIDATES)
    }

    pub(super) fn block_tokens(&self) -> usize {
        self.block_tokens.max(1)
    }
}

/// An invalid [`PoolConfig`], with the reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid pool configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

/// A pool's admission knobs (`admission` in the pool's settings).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdmissionConfig {
    /// Whether backends have a capacity and requests queue for it (default false).
    pub enabled: bool,
    /// Most requests waiting in the pool's queue (default 1,024; 1 to 10,000).
    pub max_queue: usize,
    /// Most requests one tenant may have waiting (default 256; 0 = no limit besides its share of
    /// a full queue).
    pub max_queue_per_tenant: usize,
    /// Longest wait before 503 `queue_timeout`, ms (default 30,000; 0 = never wait). A client's
    /// `x-gateway-max-wait-ms` may shorten it.
    pub max_wait_ms: u64,
    /// How far over capacity a backend may be pushed when the queue is empty, as a fraction of
    /// its capacity (default 0: strict; 0.25 lets a backend of 8 sequences run 10).
    pub overcommit: f64,
    /// Requests considered when a freed backend looks for one whose prefix it holds (default 8;
    /// 1 turns the preference off).
    pub lookahead: usize,
    /// Credit a tenant gets per round of deficit round robin, in estimated tokens (default 16, one
    /// KV block: small, so tenants alternate request by request rather than in bursts).
    pub quantum_tokens: u64,
    /// Longest one acquire call waits in the Durable Object before it answers "still queued" and
    /// the Worker asks again, ms (default 5,000). A waiter whose Worker stops asking leaves the
    /// queue within about this long.
    pub poll_ms: u64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            enabled: false,
            max_queue: 1024,
            max_queue_per_tenant: 256,
            max_wait_ms: 30_000,
            overcommit: 0.0,
            lookahead: 8,
            quantum_tokens: 16,
            poll_ms: 5_000,
        }
    }
}

/// Largest accepted `max_queue`.
pub const MAX_QUEUE: usize = 10_000;

impl AdmissionConfig {
    /// Checks every knob's range.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_queue == 0 || self.max_queue > MAX_QUEUE {
            return Err("admission.max_queue must be between 1 and 10,000".into());
        }
        if self.max_queue_per_tenant > self.max_queue {
            return Err(
                "admission.max_queue_per_tenant must be at most max_queue (0: no limit)".into(),
            );
        }
        if self.max_wait_ms > 3_600_000 {
            return Err("admission.max_wait_ms must be at most 3,600,000".into());
        }
        if !(self.overcommit.is_finite() && (0.0..=10.0).contains(&self.overcommit)) {
            return Err("admission.overcommit must be within [0, 10]".into());
        }
        if self.lookahead == 0 || self.lookahead > 64 {
            return Err("admission.lookahead must be between 1 and 64".into());
        }
        if self.quantum_tokens == 0 || self.quantum_tokens > 1_000_000_000 {
            return Err("admission.quantum_tokens must be between 1 and 1,000,000,000".into());
        }
        if !(200..=60_000).contains(&self.poll_ms) {
            return Err("admission.poll_ms must be between 200 and 60,000".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::test_support::{features, pool_with, spec, up};
    use crate::pool::Pool;
    use crate::random::SplitMix64;

    #[test]
    fn config_is_validated_and_partial_json_works() {
        let cfg: PoolConfig =
            serde_json::from_str(r#"{"policy":"power_of_two","consistent_hash":{"eps":0.5}}"#)
                .unwrap();
        assert_eq!(cfg.policy, PolicyKind::PowerOfTwo);
        assert_eq!(cfg.consistent_hash.eps, 0.5);
        assert_eq!(cfg.max_candidates, 3);
        assert!(serde_json::from_str::<PoolConfig>(r#"{"policy":"fastest"}"#).is_err());
        let mut pool = pool_with(PolicyKind::RoundRobin, 2);
        assert!(pool
            .set_config(PoolConfig {
                max_candidates: 0,
                ..PoolConfig::default()
            })
            .is_err());
        pool.set_config(PoolConfig {
            policy: PolicyKind::ConsistentHash,
            ..PoolConfig::default()
        })
        .unwrap();
        assert_eq!(pool.config().policy, PolicyKind::ConsistentHash);
        let g = pool
            .acquire(&features("x"), 0, &mut SplitMix64::new(0))
            .unwrap();
        assert_eq!(g.policy, PolicyKind::ConsistentHash);
    }

    /// Issue 42, item 10: a 1 s TTL made every stream renew three times a second.
    #[test]
    fn lease_ttl_is_bounded_from_below() {
        let with_ttl = |lease_ttl_ms| PoolConfig {
            lease_ttl_ms,
            ..PoolConfig::default()
        };
        for short in [1_000, 4_000, MIN_LEASE_TTL_MS - 1] {
            let e = with_ttl(short).validate().unwrap_err();
            assert!(e.0.contains("lease_ttl_ms"), "{e}");
        }
        assert!(with_ttl(MIN_LEASE_TTL_MS).validate().is_ok());
    }

    #[test]
    fn degenerate_config_does_not_panic() {
        let cfg = PoolConfig {
            max_candidates: 0,
            block_tokens: 0,
            lease_ttl_ms: 0,
            affinity_max_entries: 0,
            queue_weight: f64::NAN,
            cache_aware: CacheAwareConfig {
                cache_weight: f64::NAN,
                ..CacheAwareConfig::default()
            },
            ..PoolConfig::default()
        };
        for policy in PolicyKind::ALL {
            let mut pool = Pool::new(
                "p",
                PoolConfig {
                    policy,
                    ..cfg.clone()
                },
            );
            let id = pool.add_backend(spec("a"), 0).unwrap();
            pool.record_probe(&id, &up(), 0).unwrap();
            let g = pool
                .acquire(
                    &features("some prompt text here"),
                    0,
                    &mut SplitMix64::new(1),
                )
                .unwrap();
            assert_eq!(g.candidates.len(), 1);
            assert_eq!(pool.expire(0), 1);
        }
    }

    #[test]
    fn shard_settings_default_to_one_exact_coordinator_and_are_bounded() {
        let cfg: PoolConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(
            (cfg.shards, cfg.shard_exchange_ms),
            (1, DEFAULT_EXCHANGE_MS)
        );
        let cfg: PoolConfig =
            serde_json::from_str(r#"{"shards": 4, "shard_exchange_ms": 100}"#).unwrap();
        assert!(cfg.validate().is_ok());
        for (shards, ms) in [(0, 200), (MAX_SHARDS + 1, 200), (4, 49), (4, 1_001)] {
            let bad = PoolConfig {
                shards,
                shard_exchange_ms: ms,
                ..PoolConfig::default()
            };
            let e = bad.validate().unwrap_err().0;
            assert!(e.starts_with("shard"), "{shards} {ms}: {e}");
        }
        assert!(PoolConfig {
            shards: MAX_SHARDS,
            ..PoolConfig::default()
        }
        .validate()
        .is_ok());
    }

    #[test]
    fn config_ranges_are_checked() {
        assert!(AdmissionConfig::default().validate().is_ok());
        for bad in [
            AdmissionConfig {
                max_queue: 0,
                ..AdmissionConfig::default()
            },
            AdmissionConfig {
                max_queue: 10_001,
                ..AdmissionConfig::default()
            },
            AdmissionConfig {
                max_queue: 10,
                max_queue_per_tenant: 11,
                ..AdmissionConfig::default()
            },
            AdmissionConfig {
                overcommit: -0.1,
                ..AdmissionConfig::default()
            },
            AdmissionConfig {
                overcommit: f64::NAN,
                ..AdmissionConfig::default()
            },
            AdmissionConfig {
                lookahead: 0,
                ..AdmissionConfig::default()
            },
            AdmissionConfig {
                quantum_tokens: 0,
                ..AdmissionConfig::default()
            },
            AdmissionConfig {
                poll_ms: 100,
                ..AdmissionConfig::default()
            },
            AdmissionConfig {
                max_wait_ms: 3_600_001,
                ..AdmissionConfig::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let json: AdmissionConfig = serde_json::from_str(r#"{"enabled": true}"#).unwrap();
        assert_eq!(
            json,
            AdmissionConfig {
                enabled: true,
                ..AdmissionConfig::default()
            }
        );
    }
}
