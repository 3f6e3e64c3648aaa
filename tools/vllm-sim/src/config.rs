//! Command-line configuration of `vllm-sim`, with defaults that resemble a 7-8B model (Llama-3-8B
//! class, bf16) served by vLLM 0.34.0 on one data-centre GPU. `README.md` explains the numbers and
//! its conformance table names the vLLM file each default comes from.

use clap::{Parser, ValueEnum};

use crate::faults::{FaultError, FaultSettings};
use crate::scheduler::{SchedulerConfig, StepTiming};

/// What a server does in a prefill/decode-disaggregated deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    /// Serves whole requests and either half of a disaggregated one.
    Mixed,
    /// Serves whole requests and prefills for remote decodes; refuses `do_remote_prefill`.
    Prefill,
    /// Serves whole requests and decodes remotely prefilled ones; refuses `do_remote_decode`.
    Decode,
}

impl Role {
    /// The role's name as given on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Mixed => "mixed",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// The vLLM release the sim's behaviour was checked against (README: conformance table).
pub const VLLM_VERSION: &str = "0.34.0";

/// The GPU whose vLLM server defaults the sim takes (`vllm/engine/arg_utils.py`,
/// `_set_default_max_num_seqs_and_batched_tokens_args`, OPENAI_API_SERVER context).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GpuProfile {
    /// A100 and any GPU under 70 GiB: `max_num_seqs` 256, `max_num_batched_tokens` 2048.
    A100,
    /// H100/H200-class (70 GiB or more, not an A100): 1024 and 8192.
    H100,
    /// B200/B300-class (160 GiB or more): 1024 and 16384.
    B200,
}

impl GpuProfile {
    /// vLLM's `(max_num_seqs, max_num_batched_tokens)` defaults for an API server on this GPU.
    pub fn defaults(self) -> (usize, u32) {
        match self {
            GpuProfile::A100 => (256, 2048),
            GpuProfile::H100 => (1024, 8192),
            GpuProfile::B200 => (1024, 16384),
        }
    }
}

/// vLLM's `--runner` (`vllm/config/model.py`, `RunnerOption`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Runner {
    /// Resolved from `--convert` / `--task`: pooling when either asks for a pooling task.
    Auto,
    /// A text generation model: chat and completions routes.
    Generate,
    /// A pooling model: embeddings (or classify/score) routes.
    Pooling,
}

/// vLLM's `--convert` (`vllm/config/model.py`, `ConvertOption`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Convert {
    /// Embed for a pooling runner.
    Auto,
    /// No adapter.
    None,
    /// Embedding model.
    Embed,
    /// Classification / cross-encoder model.
    Classify,
}

/// What a server's model does, deciding which routes exist (`vllm/entrypoints/launchers/api_server/routers.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Task {
    /// Text generation: `/v1/chat/completions`, `/v1/completions`.
    Generate,
    /// Embeddings: `/v1/embeddings`, `/v2/embed`, `/pooling`, `/score`, `/rerank`.
    Embed,
    /// Classification: `/classify`, `/pooling`, and with `--num-labels 1` (a cross-encoder)
    /// `/score`, `/rerank`.
    Classify,
    /// Speech to text, transcription only (a Whisper-class model,
    /// `supports_transcription_only`): `/v1/audio/transcriptions`, `/v1/audio/translations`.
    Transcription,
}

/// A LoRA adapter from `--lora-modules name=path` (vLLM's old `name=path` form; the path is only
/// reported, as `root` in `/v1/models`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    /// The adapter's name, served as a model name.
    pub name: String,
    /// Its path (ignored but listed).
    pub path: String,
}

fn parse_lora(s: &str) -> Result<LoraModule, String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() => Ok(LoraModule {
            name: name.to_string(),
            path: path.to_string(),
        }),
        _ => Err(format!("expected name=path, got {s:?}")),
    }
}

/// A simulated vLLM OpenAI-compatible server: prefix cache, continuous-batching scheduler, vLLM's
/// metrics, prefill/decode kv_transfer_params and fault injection. No GPU, no weights.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "vllm-sim",
    version = concat!(env!("CARGO_PKG_VERSION"), " (behaves as vLLM 0.34.0)"),
    about,
    long_about = None
)]
pub struct Config {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on (0 picks a free one; the chosen address is printed on stdout).
    #[arg(long, default_value_t = 8101)]
    pub port: u16,

    /// Served model name; repeat for aliases of the same engine (like vLLM's --served-model-name).
    /// Metrics are labelled with the first.
    #[arg(long = "model", default_value = "sim-model")]
    pub models: Vec<String>,

    /// GPU whose vLLM defaults --max-num-seqs and --max-num-batched-tokens take (a100: 256 and
    /// 2048; h100: 1024 and 8192; b200: 1024 and 16384).
    #[arg(long, value_enum, default_value_t = GpuProfile::A100)]
    pub gpu_profile: GpuProfile,

    /// Most sequences running at once; the rest wait in FIFO order (default: the GPU profile's).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,

    /// Most tokens computed in one step; longer prompts are prefilled in chunks (chunked prefill)
    /// (default: the GPU profile's).
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,

    /// Load shedding: a new request is answered 503 (vLLM's QueueOverflowError) when this many
    /// requests are already unfinished (waiting or running). 0 or absent: unlimited.
    #[arg(long)]
    pub max_num_queued_reqs: Option<u64>,

    /// Load shedding: a new request is answered 503 (vLLM's MaxQueuedTokensError) when the prompts
    /// of requests still in prefill (no first token yet) add up to this many tokens. 0 or absent:
    /// unlimited.
    #[arg(long)]
    pub max_num_queued_tokens: Option<u64>,

    /// Export no `vllm:*` series on /metrics (vLLM's --disable-log-stats).
    #[arg(long, default_value_t = false)]
    pub disable_log_stats: bool,

    /// vLLM's --runner: generate (chat and completions routes) or pooling (embeddings etc.).
    #[arg(long, value_enum, default_value_t = Runner::Auto)]
    pub runner: Runner,

    /// vLLM's --convert: embed or classify with a pooling runner.
    #[arg(long, value_enum, default_value_t = Convert::Auto)]
    pub convert: Convert,

    /// Sim shorthand for --runner/--convert (vLLM removed --task): generate, embed or classify.
    #[arg(long, value_enum)]
    pub task: Option<Task>,

    /// Send an SSE comment `: keep-alive` on a stream silent for this many seconds (vLLM's
    /// --sse-keep-alive-interval, whole seconds there; the sim also takes fractions; 0 disables).
    #[arg(long, default_value_t = 0.0)]
    pub sse_keep_alive_interval: f64,

    /// LoRA adapters served beside the base model, `name=path` (vLLM's --lora-modules; the path is
    /// only listed). Requests naming an adapter get other prefix-cache blocks than the base model.
    #[arg(long, num_args = 1.., value_parser = parse_lora)]
    pub lora_modules: Vec<LoraModule>,

    /// KV cache size in blocks (vLLM's num_gpu_blocks).
    #[arg(long, default_value_t = 4096)]
    pub kv_blocks: u32,

    /// Tokens per KV block (and per prefix-cache block); vLLM 0.34's default is 64.
    #[arg(long, default_value_t = 64)]
    pub block_size: u32,

    /// Prefill cost per uncached prompt token, in microseconds.
    #[arg(long, default_value_t = 100.0)]
    pub prefill_us_per_token: f64,

    /// Fixed cost of one engine step (a forward pass at batch size 1), in milliseconds.
    #[arg(long, default_value_t = 10.0)]
    pub decode_ms_per_step: f64,

    /// Extra step cost per decoding sequence in the batch, in milliseconds.
    #[arg(long, default_value_t = 0.15)]
    pub decode_ms_per_seq: f64,

    /// Longest sequence (prompt + output) in tokens; longer prompts get 400.
    #[arg(long, default_value_t = 32768)]
    pub max_model_len: u32,

    /// Speculative decoding (vLLM's `--spec-tokens`, or `num_speculative_tokens` in
    /// `--speculative-config`): each decode step verifies K draft tokens and keeps the accepted
    /// ones plus one sampled token, so a streamed event carries 1 to K+1 tokens. Accepted drafts
    /// follow a fixed cycle (K, K-1, ..., 0 per step); usage counts every token. 0: off.
    #[arg(
        long = "spec-tokens",
        alias = "num-speculative-tokens",
        default_value_t = 0
    )]
    pub spec_tokens: u32,

    /// Mean output length, in tokens, of requests that do not set ignore_eos (EOS is drawn uniformly
    /// from 1..2*mean, deterministically per seed and prompt).
    #[arg(long, default_value_t = 128)]
    pub mean_output_tokens: u32,

    /// Require `Authorization: Bearer KEY` on /v1/* (like vLLM's --api-key).
    #[arg(long)]
    pub api_key: Option<String>,

    /// Role in a prefill/decode-disaggregated deployment.
    #[arg(long, value_enum, default_value_t = Role::Mixed)]
    pub role: Role,

    /// Divides every simulated delay (prefill, decode steps, embeddings): 100 runs 100x faster than
    /// the modelled GPU. Fault delays, loading time and kv_transfer_params expiry are wall-clock.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,

    /// Seed of generated text and of fault draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Secret shared by prefill and decode servers to sign and verify kv_transfer_params.
    #[arg(long, default_value = "vllm-sim-dev-kv-transfer-secret")]
    pub kv_transfer_secret: String,

    /// Seconds (wall-clock) that issued kv_transfer_params stay valid (vLLM 0.34's NIXL
    /// kv_lease_duration default: 30).
    #[arg(long, default_value_t = 30.0)]
    pub kv_transfer_ttl_s: f64,

    /// Engine id reported in kv_transfer_params (default: derived from host, port and seed).
    #[arg(long)]
    pub engine_id: Option<String>,

    /// Labels of a classify model (its `num_labels`); 1 is a cross-encoder, which vLLM 0.34 also
    /// serves `/score` and `/rerank` for (`enable_scoring_api`).
    #[arg(long, default_value_t = 1)]
    pub num_labels: u32,

    /// Dimension of /v1/embeddings vectors when the request does not set `dimensions`.
    #[arg(long, default_value_t = 32)]
    pub embedding_dim: usize,

    /// Report `usage.prompt_tokens_details.cached_tokens` (prefix-cache hits), as vLLM does with
    /// --enable-prompt-tokens-details. On by default in the sim; `=false` turns it off.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub enable_prompt_tokens_details: bool,

    /// Put each streamed request's engine-side time to first token (arrival to first token, ms)
    /// in its usage chunk as `usage.sim_engine_ttft_ms`, with its split into
    /// `sim_engine_queue_ms`, `sim_engine_prefill_ms`, `sim_engine_shared_prefill_ms` and
    /// `sim_engine_decode_interference_ms`
    /// (they add up to it; see `scheduler::EngineSplit`), and the rest of its answer as
    /// `sim_engine_e2e_ms` (arrival to last token, ms) and `sim_engine_decode_stall_ms` (after the
    /// first token: other sequences' prompt tokens' share of the steps it decoded in, ms; see
    /// `scheduler::Finish`): a sim-only extension for benchmarks.
    #[arg(long)]
    pub report_engine_timing: bool,

    /// Start in a loading phase of this many seconds (wall-clock): connections are refused, as
    /// vLLM's socket is bound but not listening while the model loads (or /health and /v1/*
    /// answer 503 with --fault-loading-answers-503).
    #[arg(long, default_value_t = 0.0)]
    pub startup_delay_s: f64,

    /// Fault: while loading, answer /health and /v1/* with 503 instead of refusing connections
    /// (what the sim did before; no vLLM 0.34 server does this itself).
    #[arg(long, default_value_t = false)]
    pub fault_loading_answers_503: bool,

    /// Fault: a stream sends vLLM's error event then `data: [DONE]` after this many output tokens
    /// (0: as its first event); a non-streamed request gets vLLM's 500.
    #[arg(long)]
    pub stream_error_after_tokens: Option<u32>,

    /// Fault: fraction of generation requests answered with --fault-error-status.
    #[arg(long, default_value_t = 0.0)]
    pub fault_error_rate: f64,

    /// Fault: status of injected errors (5xx).
    #[arg(long, default_value_t = 500)]
    pub fault_error_status: u16,

    /// Fault: fraction of generation requests answered 429.
    #[arg(long, default_value_t = 0.0)]
    pub fault_429_rate: f64,

    /// Fault: fraction of generation requests that hang before the first byte.
    #[arg(long, default_value_t = 0.0)]
    pub fault_hang_rate: f64,

    /// Fault: delay before the first byte of every generation request, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub fault_first_byte_delay_ms: u64,

    /// Fault: drop the connection after this many output tokens.
    #[arg(long)]
    pub fault_disconnect_after_tokens: Option<u32>,

    /// Fault: stop generating after this many output tokens and keep the connection open, silent
    /// (an engine hang); the sequence keeps its slot until the client disconnects.
    #[arg(long)]
    pub fault_stall_after_tokens: Option<u32>,

    /// Fault: non-streamed answers send their headers and half of the body, then close.
    #[arg(long, default_value_t = false)]
    pub fault_truncate_body: bool,

    /// Fault: streams send half of the event after this many output tokens, then close.
    #[arg(long)]
    pub fault_disconnect_mid_event_after_tokens: Option<u32>,

    /// Fault: /health answers 503.
    #[arg(long, default_value_t = false)]
    pub fault_health_fail: bool,

    /// Fault: generation requests whose body contains this text get vLLM's 500.
    #[arg(long)]
    pub fault_poison_marker: Option<String>,
}

/// Why the configuration is unusable.
#[derive(Debug, Clone, PartialEq)]
pub enum ConfigError {
    /// A value outside its range.
    Invalid(String),
    /// Fault flags outside their range.
    Fault(FaultError),
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigError::Invalid(msg) => f.write_str(msg),
            ConfigError::Fault(e) => write!(f, "{e}"),
        }
    }
}

impl Config {
    /// Checks ranges that clap cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |msg: &str| Err(ConfigError::Invalid(msg.to_string()));
        if self.models.iter().any(|m| m.is_empty()) {
            return invalid("--model must not be empty");
        }
        if self.max_num_seqs() == 0 {
            return invalid("--max-num-seqs must be at least 1");
        }
        if self.max_num_batched_tokens() == 0 {
            return invalid("--max-num-batched-tokens must be at least 1");
        }
        if self.kv_blocks == 0 || self.kv_blocks == u32::MAX {
            return invalid("--kv-blocks must be between 1 and 2^32-2");
        }
        if self.block_size == 0 {
            return invalid("--block-size must be at least 1");
        }
        if self.spec_tokens > 32 {
            return invalid("--spec-tokens must be between 0 and 32");
        }
        if self.max_model_len < 2 {
            return invalid("--max-model-len must be at least 2");
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return invalid("--time-scale must be a positive number");
        }
        for (flag, v) in [
            ("--prefill-us-per-token", self.prefill_us_per_token),
            ("--decode-ms-per-step", self.decode_ms_per_step),
            ("--decode-ms-per-seq", self.decode_ms_per_seq),
            ("--kv-transfer-ttl-s", self.kv_transfer_ttl_s),
            ("--startup-delay-s", self.startup_delay_s),
            ("--sse-keep-alive-interval", self.sse_keep_alive_interval),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ConfigError::Invalid(format!(
                    "{flag} must be a non-negative number"
                )));
            }
        }
        if self.runner == Runner::Generate
            && (matches!(self.convert, Convert::Embed | Convert::Classify)
                || matches!(self.task, Some(Task::Embed | Task::Classify)))
        {
            return invalid("--runner generate cannot serve a pooling --convert/--task");
        }
        if self
            .lora_modules
            .iter()
            .any(|l| self.models.contains(&l.name))
        {
            return invalid("a --lora-modules name must differ from the served model names");
        }
        if self.num_labels == 0 || self.num_labels > 1024 {
            return invalid("--num-labels must be between 1 and 1024");
        }
        if self.runner == Runner::Pooling && self.task == Some(Task::Transcription) {
            return invalid("--runner pooling cannot serve --task transcription");
        }
        if self.embedding_dim == 0 || self.embedding_dim > 65536 {
            return invalid("--embedding-dim must be between 1 and 65536");
        }
        self.initial_faults().validate().map_err(ConfigError::Fault)
    }

    /// `--max-num-seqs`, or the GPU profile's default.
    pub fn max_num_seqs(&self) -> usize {
        self.max_num_seqs.unwrap_or(self.gpu_profile.defaults().0)
    }

    /// `--max-num-batched-tokens`, or the GPU profile's default.
    pub fn max_num_batched_tokens(&self) -> u32 {
        self.max_num_batched_tokens
            .unwrap_or(self.gpu_profile.defaults().1)
    }

    /// What the model does, from `--task`, else `--runner` and `--convert` (a pooling runner
    /// converts to embed unless told classify), else generate.
    pub fn task(&self) -> Task {
        if let Some(t) = self.task {
            return t;
        }
        match (self.runner, self.convert) {
            (Runner::Generate, _) => Task::Generate,
            (_, Convert::Classify) => Task::Classify,
            (_, Convert::Embed) | (Runner::Pooling, _) => Task::Embed,
            _ => Task::Generate,
        }
    }

    /// The scheduler's limits and timing.
    pub fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            max_num_seqs: self.max_num_seqs(),
            max_num_batched_tokens: self.max_num_batched_tokens(),
            num_blocks: self.kv_blocks,
            block_size: self.block_size,
            max_model_len: self.max_model_len,
            spec_tokens: self.spec_tokens,
            timing: self.step_timing(),
        }
    }

    /// The step duration model, in simulated microseconds.
    pub fn step_timing(&self) -> StepTiming {
        StepTiming {
            base_us: self.decode_ms_per_step * 1000.0,
            per_decode_seq_us: self.decode_ms_per_seq * 1000.0,
            per_prefill_token_us: self.prefill_us_per_token,
        }
    }

    /// Fault settings from the `--fault-*` flags.
    pub fn initial_faults(&self) -> FaultSettings {
        FaultSettings {
            error_rate: self.fault_error_rate,
            error_status: self.fault_error_status,
            rate_limit_rate: self.fault_429_rate,
            hang_rate: self.fault_hang_rate,
            first_byte_delay_ms: self.fault_first_byte_delay_ms,
            disconnect_after_tokens: self.fault_disconnect_after_tokens,
            stall_after_tokens: self.fault_stall_after_tokens,
            truncate_body: self.fault_truncate_body,
            disconnect_mid_event_after_tokens: self.fault_disconnect_mid_event_after_tokens,
            health_fail: self.fault_health_fail,
            poison_marker: self.fault_poison_marker.clone().filter(|m| !m.is_empty()),
            stream_error_after_tokens: self.stream_error_after_tokens,
            loading_answers_503: self.fault_loading_answers_503,
            // Faults without a flag (`reset_after_done`, and those set at run time only with
            // POST /sim/faults) start off.
            ..FaultSettings::default()
        }
    }

    /// The host advertised in kv_transfer_params (a wildcard listen address becomes loopback).
    pub fn advertised_host(&self) -> String {
        match self.host.as_str() {
            "0.0.0.0" | "::" | "[::]" => "127.0.0.1".to_string(),
            h => h.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Config {
        Config::try_parse_from(std::iter::once("vllm-sim").chain(args.iter().copied()))
            .expect("parses")
    }

    #[test]
    fn defaults_are_valid_and_documented_values() {
        let c = parse(&[]);
        assert!(c.validate().is_ok());
        assert_eq!(c.port, 8101);
        assert_eq!(c.models, vec!["sim-model".to_string()]);
        assert_eq!(
            (c.max_num_seqs(), c.kv_blocks, c.block_size, c.max_model_len),
            (256, 4096, 64, 32768)
        );
        assert_eq!(c.max_num_batched_tokens(), 2048);
        assert_eq!(c.kv_transfer_ttl_s, 30.0);
        assert_eq!(c.task(), Task::Generate);
        assert_eq!(c.sse_keep_alive_interval, 0.0);
        assert_eq!(c.role, Role::Mixed);
        assert_eq!(c.step_timing().step_us(0, 1000), 10_000.0 + 100_000.0);
    }

    #[test]
    fn gpu_profiles_set_vllm_batch_defaults_and_flags_override_them() {
        let h = parse(&["--gpu-profile", "h100"]);
        assert_eq!((h.max_num_seqs(), h.max_num_batched_tokens()), (1024, 8192));
        let a = parse(&["--gpu-profile", "a100", "--max-num-seqs", "8"]);
        assert_eq!((a.max_num_seqs(), a.max_num_batched_tokens()), (8, 2048));
        let b = parse(&["--gpu-profile", "h100", "--max-num-batched-tokens", "512"]);
        assert_eq!((b.max_num_seqs(), b.max_num_batched_tokens()), (1024, 512));
    }

    #[test]
    fn runner_convert_and_task_decide_the_task() {
        assert_eq!(parse(&["--task", "embed"]).task(), Task::Embed);
        assert_eq!(parse(&["--runner", "pooling"]).task(), Task::Embed);
        assert_eq!(
            parse(&["--runner", "pooling", "--convert", "classify"]).task(),
            Task::Classify
        );
        assert_eq!(parse(&["--convert", "embed"]).task(), Task::Embed);
        assert_eq!(parse(&["--runner", "generate"]).task(), Task::Generate);
        assert!(parse(&["--runner", "generate", "--task", "embed"])
            .validate()
            .is_err());
    }

    #[test]
    fn reads_lora_modules_and_0_34_flags() {
        let c = parse(&[
            "--lora-modules",
            "sql=/loras/sql",
            "chat=/loras/chat",
            "--sse-keep-alive-interval",
            "2",
            "--max-num-queued-reqs",
            "10",
            "--disable-log-stats",
            "--stream-error-after-tokens",
            "0",
        ]);
        assert_eq!(c.lora_modules.len(), 2);
        assert_eq!(c.lora_modules[0].name, "sql");
        assert_eq!(c.lora_modules[1].path, "/loras/chat");
        assert_eq!(c.sse_keep_alive_interval, 2.0);
        assert_eq!(c.max_num_queued_reqs, Some(10));
        assert!(c.disable_log_stats);
        assert_eq!(c.initial_faults().stream_error_after_tokens, Some(0));
        assert!(Config::try_parse_from(["vllm-sim", "--lora-modules", "nopath"]).is_err());
    }

    #[test]
    fn repeated_models_replace_the_default() {
        let c = parse(&["--model", "a", "--model", "b", "--role", "decode"]);
        assert_eq!(c.models, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(c.role, Role::Decode);
    }

    #[test]
    fn reads_the_new_fault_flags_and_prompt_tokens_details() {
        let c = parse(&[
            "--fault-stall-after-tokens",
            "3",
            "--fault-truncate-body",
            "--fault-disconnect-mid-event-after-tokens",
            "2",
        ]);
        let f = c.initial_faults();
        assert_eq!(
            (
                f.stall_after_tokens,
                f.truncate_body,
                f.disconnect_mid_event_after_tokens
            ),
            (Some(3), true, Some(2))
        );
        assert!(parse(&[]).enable_prompt_tokens_details);
        assert!(parse(&["--enable-prompt-tokens-details"]).enable_prompt_tokens_details);
        assert!(!parse(&["--enable-prompt-tokens-details=false"]).enable_prompt_tokens_details);
    }

    #[test]
    fn rejects_nonsense() {
        assert!(parse(&["--time-scale", "0"]).validate().is_err());
        assert!(parse(&["--kv-blocks", "0"]).validate().is_err());
        assert!(parse(&["--fault-error-rate", "2"]).validate().is_err());
        assert!(parse(&["--fault-error-status", "200"]).validate().is_err());
        assert!(Config::try_parse_from(["vllm-sim", "--role", "both"]).is_err());
    }
}
