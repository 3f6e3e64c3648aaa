//! The state every request handler shares: the configuration, the engine handle, the metrics, the
//! injected faults and the kv_transfer_params authority, plus the request ids derived from them.

use std::sync::atomic::{AtomicU64, Ordering};
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
