//! `vllm-sim`: a simulated vLLM OpenAI-compatible server for the gateway's tests, benchmarks and
//! `make dev`. It has no GPU and no weights, but behaves like vLLM where routing can see it: a prefix
//! cache that makes shared prompts cheap ([`kv_cache`]), a continuous-batching scheduler whose steps take
//! time that grows with tokens and batch size ([`scheduler`], [`engine`]), vLLM's request and response
//! shapes ([`api`], [`sse`]), its Prometheus metrics ([`metrics`]), NixlConnector-style prefill/decode
//! hand-offs ([`disagg`]) and injectable faults ([`faults`]).
//!
//! This file parses the command line, binds the listener, starts the engine task and serves. The chosen
//! address is printed on stdout as `vllm-sim listening on http://HOST:PORT` so that callers using
//! `--port 0` can find it.

mod api;
mod body;
mod config;
mod disagg;
mod engine;
mod faults;
mod kv_cache;
mod metrics;
mod openai;
mod prompt;
mod sampler;
mod scheduler;
mod server;
mod sse;
mod stop;
mod tokenizer;

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use clap::Parser;
use tokio::net::{TcpListener, TcpSocket};
use xxhash_rust::xxh3::xxh3_128;

use crate::config::Config;
use crate::disagg::TransferAuthority;
use crate::metrics::MetricsState;
use crate::server::AppState;

/// Pending connections the listener queues (bursts of thousands of clients connect at once).
const LISTEN_BACKLOG: u32 = 4096;

fn main() -> ExitCode {
    let config = Config::parse();
    if let Err(e) = config.validate() {
        eprintln!("vllm-sim: {e}");
        return ExitCode::from(2);
    }
    raise_open_file_limit();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vllm-sim: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(run(config))
}

async fn run(config: Config) -> ExitCode {
    let listener = match bind(&config.host, config.port).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "vllm-sim: cannot listen on {}:{}: {e}",
                config.host, config.port
            );
            return ExitCode::from(1);
        }
    };
    let address = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vllm-sim: {e}");
            return ExitCode::from(1);
        }
    };
    let mut config = config;
    config.port = address.port();

    let metrics = Arc::new(Mutex::new(MetricsState::default()));
    let engine = engine::spawn(config.scheduler(), config.time_scale, metrics.clone());
    let transfer = TransferAuthority {
        secret: config.kv_transfer_secret.clone(),
        engine_id: config
            .engine_id
            .clone()
            .unwrap_or_else(|| default_engine_id(&config)),
        host: config.advertised_host(),
        port: config.port,
        ttl_ms: (config.kv_transfer_ttl_s * 1000.0) as u64,
        role: config.role,
    };
    eprintln!(
        "vllm-sim: models {:?}, role {}, {} KV blocks of {} tokens, max {} seqs, time scale {}",
        config.models,
        config.role.as_str(),
        config.kv_blocks,
        config.block_size,
        config.max_num_seqs,
        config.time_scale
    );
    let state = Arc::new(AppState::new(config, engine, metrics, transfer));
    println!("vllm-sim listening on http://{address}");
    let _ = std::io::stdout().flush();
    server::serve(listener, state).await;
    ExitCode::SUCCESS
}

/// Binds `host:port` with a large backlog and address reuse.
async fn bind(host: &str, port: u16) -> std::io::Result<TcpListener> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let address: SocketAddr = tokio::net::lookup_host((host, port))
        .await?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "host did not resolve"))?;
    let socket = if address.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(LISTEN_BACKLOG)
}

/// A UUID-shaped engine id derived from the address and seed, stable across restarts.
fn default_engine_id(config: &Config) -> String {
    let h = xxh3_128(
        format!(
            "{}:{}:{}",
            config.advertised_host(),
            config.port,
            config.seed
        )
        .as_bytes(),
    );
    let hex = format!("{h:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// Raises the soft limit on open files to the hard limit: every stream is a socket.
fn raise_open_file_limit() {
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
