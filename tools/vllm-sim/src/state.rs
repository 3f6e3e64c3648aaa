//! The state every request handler shares: the configuration, the engine handle, the metrics, the
//! injected faults and the kv_transfer_params authority, plus the request ids derived from them and
//! the load counters that load shedding (`--max-num-queued-reqs`, `--max-num-queued-tokens`) reads.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_128;

use crate::config::Config;
use crate::disagg::TransferAuthority;
use crate::engine::EngineHandle;
use crate::faults::{FaultDecision, FaultSettings};
use crate::metrics::{MetricsInfo, MetricsState};
use crate::sampler::SplitMix64;

/// Fault settings and the state they need at run time.
#[derive(Debug)]
pub struct FaultState {
    /// Current settings.
    pub settings: FaultSettings,
    /// Draws for rate-based faults, seeded by `--seed`.
    pub rng: SplitMix64,
    /// End of the current loading phase, if any.
    pub loading_until: Option<Instant>,
    /// Request ids taken, and until when (`request_id_linger_ms`).
    pub taken_ids: std::collections::HashMap<String, Instant>,
}

/// What vLLM 0.34's admission check counts (`AsyncLLM.check_admission`,
/// `vllm/v1/engine/async_llm.py`): unfinished requests, and the prompt tokens of those that have
/// not produced their first token yet (their whole prompt, however much is cached or computed).
#[derive(Debug, Default)]
pub struct LoadCounters {
    /// Requests admitted and not finished.
    pub unfinished: AtomicU64,
    /// Prompt tokens of admitted requests without a first token.
    pub prefill_tokens: AtomicU64,
}

/// Why a request was shed (the `reason` label of `vllm:admission_rejections`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// `--max-num-queued-reqs` reached: vLLM's `QueueOverflowError`.
    QueuedReqs,
    /// `--max-num-queued-tokens` reached: vLLM's `MaxQueuedTokensError`.
    QueuedTokens,
}

impl LoadCounters {
    /// vLLM's check: shed when `unfinished + 1 > max_reqs`, or when the prefill backlog is
    /// already `>= max_tokens` (the new prompt is not added in). `None` or 0: no limit.
    pub fn check(&self, max_reqs: Option<u64>, max_tokens: Option<u64>) -> Result<(), Shed> {
        if let Some(max) = max_reqs.filter(|&m| m > 0) {
            if self.unfinished.load(Ordering::Relaxed) + 1 > max {
                return Err(Shed::QueuedReqs);
            }
        }
        if let Some(max) = max_tokens.filter(|&m| m > 0) {
            if self.prefill_tokens.load(Ordering::Relaxed) >= max {
                return Err(Shed::QueuedTokens);
            }
        }
        Ok(())
    }
}

/// One admitted request's share of [`LoadCounters`], given back when it produces its first token
/// ([`InFlight::first_token`]) and when it ends (dropped).
#[derive(Debug)]
pub struct InFlight {
    counters: Arc<LoadCounters>,
    prompt_tokens: u64,
    prefilling: AtomicBool,
}

impl InFlight {
    /// Counts a request with `prompt_tokens` in.
    pub fn new(counters: Arc<LoadCounters>, prompt_tokens: u32) -> Self {
        counters.unfinished.fetch_add(1, Ordering::Relaxed);
        counters
            .prefill_tokens
            .fetch_add(u64::from(prompt_tokens), Ordering::Relaxed);
        InFlight {
            counters,
            prompt_tokens: u64::from(prompt_tokens),
            prefilling: AtomicBool::new(true),
        }
    }

    /// The request left prefill: its prompt no longer counts in the backlog.
    pub fn first_token(&self) {
        if self.prefilling.swap(false, Ordering::Relaxed) {
            self.counters
                .prefill_tokens
                .fetch_sub(self.prompt_tokens, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.first_token();
        self.counters.unfinished.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What every request handler shares.
pub struct AppState {
    /// The command line.
    pub config: Config,
    /// Submits sequences to the engine.
    pub engine: EngineHandle,
    /// What `/metrics` shows.
    pub metrics: Arc<Mutex<MetricsState>>,
    /// Labels of `/metrics`.
    pub metrics_info: MetricsInfo,
    /// Injected faults.
    pub faults: Mutex<FaultState>,
    /// Issues and verifies kv_transfer_params.
    pub transfer: Arc<TransferAuthority>,
    /// Unix seconds at start (the `created` of `/v1/models`).
    pub started_unix: u64,
    /// What load shedding counts.
    pub load: Arc<LoadCounters>,
    /// Woken when a loading phase starts at run time (the listener closes meanwhile).
    pub loading_started: tokio::sync::Notify,
    /// Stored Responses API responses (`store: true`), for `previous_response_id` and retrieval.
    pub responses: crate::responses::ResponseStore,
    ids: AtomicU64,
}

impl AppState {
    /// Takes `id` for `request_id_linger_ms` (see [`FaultSettings::request_id_linger_ms`]):
    /// false when the fault is on and a request with the same id arrived within that time.
    pub fn take_request_id(&self, id: &str) -> bool {
        let Ok(mut f) = self.faults.lock() else {
            return true;
        };
        let linger = Duration::from_millis(f.settings.request_id_linger_ms);
        if linger.is_zero() {
            return true;
        }
        let now = Instant::now();
        f.taken_ids.retain(|_, until| *until > now);
        if f.taken_ids.contains_key(id) {
            return false;
        }
        // Bounded: past 100,000 distinct ids within the linger time the record starts again.
        if f.taken_ids.len() >= 100_000 {
            f.taken_ids.clear();
        }
        f.taken_ids.insert(id.to_string(), now + linger);
        true
    }

    /// Shared state for a server configured by `config`.
    pub fn new(
        config: Config,
        engine: EngineHandle,
        metrics: Arc<Mutex<MetricsState>>,
        transfer: TransferAuthority,
    ) -> Self {
        let loading_until = (config.startup_delay_s > 0.0)
            .then(|| Instant::now() + Duration::from_secs_f64(config.startup_delay_s));
        let metrics_info = MetricsInfo {
            model_name: config.models[0].clone(),
            block_size: config.block_size,
            num_gpu_blocks: config.kv_blocks,
            max_model_len: config.max_model_len,
            disable_log_stats: config.disable_log_stats,
        };
        let faults = FaultState {
            settings: config.initial_faults(),
            rng: SplitMix64::new(config.seed ^ 0xFA_u64),
            loading_until,
            taken_ids: Default::default(),
        };
        AppState {
            metrics_info,
            faults: Mutex::new(faults),
            transfer: Arc::new(transfer),
            started_unix: crate::sse::unix_ms() / 1000,
            load: Arc::new(LoadCounters::default()),
            loading_started: tokio::sync::Notify::new(),
            ids: AtomicU64::new(0),
            responses: Default::default(),
            config,
            engine,
            metrics,
        }
    }

    /// 32 hex digits unique to this process and distinct across servers and runs.
    pub fn fresh_id(&self) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        let mut key = Vec::with_capacity(32);
        key.extend_from_slice(&n.to_le_bytes());
        key.extend_from_slice(&self.config.seed.to_le_bytes());
        key.extend_from_slice(&self.config.port.to_le_bytes());
        key.extend_from_slice(&crate::sse::unix_ms().to_le_bytes());
        format!("{:032x}", xxh3_128(&key))
    }

    /// Admits a request with `prompt_tokens` under the load-shedding limits, counting it in until
    /// the returned guard is dropped; a shed request is counted in `vllm:admission_rejections`.
    pub fn admit(&self, prompt_tokens: u32) -> Result<InFlight, Shed> {
        let checked = self.load.check(
            self.config.max_num_queued_reqs,
            self.config.max_num_queued_tokens,
        );
        if let Err(shed) = checked {
            if let Ok(mut m) = self.metrics.lock() {
                match shed {
                    Shed::QueuedReqs => m.rejected_queued_reqs += 1,
                    Shed::QueuedTokens => m.rejected_queued_tokens += 1,
                }
            }
            return Err(shed);
        }
        Ok(InFlight::new(self.load.clone(), prompt_tokens))
    }

    /// The end of the current loading phase, if the sim is loading.
    pub fn loading_until(&self) -> Option<Instant> {
        if self.is_loading() {
            self.faults.lock().ok()?.loading_until
        } else {
            None
        }
    }

    /// Whether a loading phase is answered with 503 rather than refused connections.
    pub fn loading_answers_503(&self) -> bool {
        self.faults
            .lock()
            .map(|f| f.settings.loading_answers_503)
            .unwrap_or(false)
    }

    /// Whether the model is still loading (and forgets a loading phase that has ended).
    pub fn is_loading(&self) -> bool {
        let Ok(mut faults) = self.faults.lock() else {
            return false;
        };
        match faults.loading_until {
            Some(until) if Instant::now() < until => true,
            Some(_) => {
                faults.loading_until = None;
                false
            }
            None => false,
        }
    }

    /// The faults to apply to the next generation request.
    pub fn fault_decision(&self) -> FaultDecision {
        match self.faults.lock() {
            Ok(mut f) => {
                let FaultState { settings, rng, .. } = &mut *f;
                settings.decide(rng)
            }
            Err(_) => FaultSettings::default().decide(&mut SplitMix64::new(0)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_shedding_counts_unfinished_requests_and_the_prefill_backlog_as_vllm() {
        let counters = Arc::new(LoadCounters::default());
        assert_eq!(counters.check(None, None), Ok(()));
        let a = InFlight::new(counters.clone(), 100);
        let b = InFlight::new(counters.clone(), 50);
        // Two unfinished: a third exceeds a limit of 2, not of 3; 0 is no limit.
        assert_eq!(counters.check(Some(2), None), Err(Shed::QueuedReqs));
        assert_eq!(counters.check(Some(3), None), Ok(()));
        assert_eq!(counters.check(Some(0), Some(0)), Ok(()));
        // 150 prompt tokens in prefill: shed at a backlog limit of 150, not 151.
        assert_eq!(counters.check(None, Some(150)), Err(Shed::QueuedTokens));
        assert_eq!(counters.check(None, Some(151)), Ok(()));
        a.first_token();
        a.first_token();
        assert_eq!(counters.prefill_tokens.load(Ordering::Relaxed), 50);
        assert_eq!(counters.check(None, Some(51)), Ok(()));
        drop(a);
        drop(b);
        assert_eq!(counters.unfinished.load(Ordering::Relaxed), 0);
        assert_eq!(counters.prefill_tokens.load(Ordering::Relaxed), 0);
    }
}
