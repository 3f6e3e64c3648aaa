//! `vllm-sim`: a simulated vLLM OpenAI-compatible server for the gateway's tests, benchmarks and
//! `make dev`. It has no GPU and no weights, but behaves like vLLM where routing can see it: a prefix
//! cache that makes shared prompts cheap ([`kv_cache`]), a continuous-batching scheduler whose steps take
//! time that grows with tokens and batch size ([`scheduler`], [`engine`]), vLLM's request and response
//! shapes ([`api`], [`sse`]; vLLM's own routes by task in [`passthrough`]: [`tokenize`], [`pooling`],
//! [`audio`]), its Prometheus metrics ([`metrics`]), NixlConnector-style prefill/decode
//! hand-offs ([`disagg`]) and injectable faults ([`faults`]).
//!
//! The library is what the `vllm-sim` binary serves, and what `loadgen`'s oracle calls to render chat
//! prompts ([`prompt::render_chat`]) and hash prompt blocks ([`kv_cache::block_hashes`]) exactly as
//! the server does.

pub mod api;
pub mod audio;
pub mod body;
pub mod config;
pub mod disagg;
pub mod engine;
pub mod error;
pub mod faults;
pub mod kv_cache;
pub mod launch;
pub mod messages;
pub mod metrics;
pub mod openai;
pub mod passthrough;
pub mod pooling;
pub mod prompt;
pub mod responses;
pub mod sampler;
pub mod scheduler;
pub mod server;
pub mod sse;
pub mod state;
pub mod stop;
pub mod tokenize;
pub mod tokenizer;
