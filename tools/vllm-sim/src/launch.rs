//! Starting a server: binding the listener and building the state every request handler shares
//! (the metrics, the engine task, the kv_transfer_params authority). The binary calls these after
//! parsing its command line; tests start an in-process server the same way.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpSocket};
use xxhash_rust::xxh3::xxh3_128;

use crate::config::Config;
use crate::disagg::TransferAuthority;
use crate::metrics::MetricsState;
use crate::state::AppState;

/// Pending connections the listener queues (bursts of thousands of clients connect at once).
const LISTEN_BACKLOG: u32 = 4096;

/// Binds `host:port` with a large backlog and address reuse.
pub async fn bind(host: &str, port: u16) -> std::io::Result<TcpListener> {
    bind_socket(host, port).await?.listen(LISTEN_BACKLOG)
}

/// Binds `host:port` (address reuse) without listening: connections to it are refused, as to a
/// vLLM server still loading its model (its socket is bound before the engine starts, and
/// listened on only when it is up: `vllm/entrypoints/launchers/launcher.py`,
/// `create_server_socket`). [`listen`] it afterwards.
pub async fn bind_socket(host: &str, port: u16) -> std::io::Result<TcpSocket> {
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
    Ok(socket)
}

/// Starts listening on a socket from [`bind_socket`].
pub fn listen(socket: TcpSocket) -> std::io::Result<TcpListener> {
    socket.listen(LISTEN_BACKLOG)
}

/// The shared state of a server configured by `config` (whose `port` is the bound one), with its
/// engine task spawned on the current Tokio runtime.
pub fn app_state(config: Config) -> AppState {
    let metrics = Arc::new(Mutex::new(MetricsState::default()));
    let engine = crate::engine::spawn(config.scheduler(), config.time_scale, metrics.clone());
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
    AppState::new(config, engine, metrics, transfer)
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
