//! Load generator for vllm-sim, to show it is never the bottleneck of a gateway benchmark.
//!
//! Three modes, each against a running server (`bench/run.sh` starts one per mode and runs them all):
//! - `rps`: `--connections` keep-alive connections send short non-streamed `/v1/completions`
//!   requests back to back for `--seconds`; reports requests/s and latency percentiles.
//! - `streams`: opens `--streams` concurrent streaming chat requests (one connection each), holds them
//!   for `--seconds` and reports how long it took until every stream had its first chunk, the chunks
//!   delivered per second, and the server's RSS while they are all open.
//! - `fill`: sends rounds of distinct long prompts, each round enough to fill the whole KV cache, and
//!   reports the server's RSS and cached blocks after every round (memory must stay flat).
//!
//! Run: `cargo run --release -p vllm-sim --example bench -- --mode rps --addr 127.0.0.1:8101`.
//! The request loops are bounded in count and time and only talk to the given loopback address.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Parser, ValueEnum};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mode {
    Rps,
    Streams,
    Fill,
}

#[derive(Debug, Parser)]
#[command(about = "Load generator for vllm-sim")]
struct Args {
    /// Server address (loopback only).
    #[arg(long, default_value = "127.0.0.1:8101")]
    addr: String,
    /// What to measure.
    #[arg(long, value_enum, default_value_t = Mode::Rps)]
    mode: Mode,
    /// Keep-alive connections (rps).
    #[arg(long, default_value_t = 128)]
    connections: usize,
    /// Concurrent streams (streams).
    #[arg(long, default_value_t = 2000)]
    streams: usize,
    /// Duration of the measurement.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Output tokens per request (rps).
    #[arg(long, default_value_t = 4)]
    max_tokens: u32,
    /// Prompt size in bytes (rps, fill).
    #[arg(long, default_value_t = 256)]
    prompt_bytes: usize,
    /// Rounds (fill).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Requests per round (fill).
    #[arg(long, default_value_t = 400)]
    per_round: usize,
    /// The server's pid, to report its resident memory.
    #[arg(long)]
    server_pid: Option<u32>,
}

type Sender = http1::SendRequest<Full<Bytes>>;

async fn connect(addr: &str) -> Result<Sender, Box<dyn std::error::Error + Send + Sync>> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

async fn post(
    sender: &mut Sender,
    path: &str,
    body: String,
) -> Result<Response<Incoming>, Box<dyn std::error::Error + Send + Sync>> {
    sender.ready().await?;
    let request = Request::post(path)
        .header("host", "vllm-sim")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    Ok(sender.send_request(request).await?)
}

async fn get_text(addr: &str, path: &str) -> String {
    let Ok(mut sender) = connect(addr).await else {
        return String::new();
    };
    if sender.ready().await.is_err() {
        return String::new();
    }
    let Ok(request) = Request::get(path)
        .header("host", "vllm-sim")
        .body(Full::new(Bytes::new()))
    else {
        return String::new();
    };
    match sender.send_request(request).await {
        Ok(r) => match r.into_body().collect().await {
            Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
            Err(_) => String::new(),
        },
        Err(_) => String::new(),
    }
}

/// A metric's value from the `/metrics` text (first sample with that name).
async fn metric(addr: &str, name: &str) -> f64 {
    let text = get_text(addr, "/metrics").await;
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn rss_mib(pid: Option<u32>) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid?)).ok()?;
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// CPU seconds (user + system) the process has used so far.
fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid?)).ok()?;
    // Fields after the command name (which is in parentheses and may contain spaces).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0) // USER_HZ is 100 on Linux
}

/// The server's CPU use between two readings, in percent of one core.
fn cpu_percent(before: Option<f64>, after: Option<f64>, seconds: f64) -> f64 {
    match (before, after) {
        (Some(b), Some(a)) if seconds > 0.0 => (a - b) / seconds * 100.0,
        _ => f64::NAN,
    }
}

fn filler(tag: &str, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    let mut i = 0;
    while s.len() < bytes {
        s.push_str(&format!("{tag}-{i} "));
        i += 1;
    }
    s.truncate(bytes);
    s
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn rps(args: &Args) {
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let shared = filler("system", args.prompt_bytes / 2);
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    let start = Instant::now();
    let cpu_before = cpu_seconds(args.server_pid);
    for c in 0..args.connections {
        let addr = args.addr.clone();
        let shared = shared.clone();
        let errors = errors.clone();
        let (max_tokens, prompt_bytes) = (args.max_tokens, args.prompt_bytes);
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let Ok(mut sender) = connect(&addr).await else {
                errors.fetch_add(1, Ordering::Relaxed);
                return latencies;
            };
            let mut i = 0u64;
            while Instant::now() < deadline {
                let prompt = format!("{shared}{}", filler(&format!("c{c}r{i}"), prompt_bytes - shared.len()));
                let body = format!(
                    r#"{{"model":"sim-model","prompt":"{prompt}","max_tokens":{max_tokens},"ignore_eos":true}}"#
                );
                let sent = Instant::now();
                let ok = match post(&mut sender, "/v1/completions", body).await {
                    Ok(r) => r.status().is_success() && r.into_body().collect().await.is_ok(),
                    Err(_) => false,
                };
                if ok {
                    latencies.push(sent.elapsed().as_secs_f64());
                } else {
                    errors.fetch_add(1, Ordering::Relaxed);
                    match connect(&addr).await {
                        Ok(s) => sender = s,
                        Err(_) => break,
                    }
                }
                i += 1;
            }
            latencies
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        if let Ok(l) = t.await {
            all.extend(l);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let server_cpu = cpu_percent(cpu_before, cpu_seconds(args.server_pid), elapsed);
    all.sort_by(|a, b| a.total_cmp(b));
    println!(
        "rps: {} connections, {} B prompts, {} output tokens: {} ok, {} errors in {:.1} s = {:.0} req/s; latency p50 {:.2} ms, p99 {:.2} ms; server CPU {:.0}% of one core, RSS {:.1} MiB",
        args.connections,
        args.prompt_bytes,
        args.max_tokens,
        all.len(),
        errors.load(Ordering::Relaxed),
        elapsed,
        all.len() as f64 / elapsed,
        percentile(&all, 0.5) * 1e3,
        percentile(&all, 0.99) * 1e3,
        server_cpu,
        rss_mib(args.server_pid).unwrap_or(f64::NAN),
    );
}

async fn streams(args: &Args) {
    let headers = Arc::new(AtomicU64::new(0));
    let started = Arc::new(AtomicU64::new(0));
    let chunks = Arc::new(AtomicU64::new(0));
    let failed_connect = Arc::new(AtomicU64::new(0));
    let failed_request = Arc::new(AtomicU64::new(0));
    let ended_early = Arc::new(AtomicU64::new(0));
    let open_until = Instant::now() + Duration::from_secs_f64(args.seconds);
    let begin = Instant::now();
    let mut tasks = Vec::new();
    for s in 0..args.streams {
        let addr = args.addr.clone();
        let (headers, started, chunks) = (headers.clone(), started.clone(), chunks.clone());
        let (failed_connect, failed_request, ended_early) = (
            failed_connect.clone(),
            failed_request.clone(),
            ended_early.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let Ok(mut sender) = connect(&addr).await else {
                failed_connect.fetch_add(1, Ordering::Relaxed);
                return;
            };
            let body = format!(
                r#"{{"model":"sim-model","messages":[{{"role":"user","content":"stream {s}"}}],"max_tokens":30000,"ignore_eos":true,"stream":true}}"#
            );
            let response = match post(&mut sender, "/v1/chat/completions", body).await {
                Ok(r) if r.status().is_success() => r,
                _ => {
                    failed_request.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            };
            headers.fetch_add(1, Ordering::Relaxed);
            let mut body = response.into_body();
            let mut first = true;
            loop {
                match tokio::time::timeout_at(open_until.into(), body.frame()).await {
                    Ok(Some(Ok(f))) => {
                        if let Some(data) = f.data_ref() {
                            let n = data.windows(6).filter(|w| w == b"data: ").count() as u64;
                            chunks.fetch_add(n, Ordering::Relaxed);
                            if first {
                                first = false;
                                started.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Ok(_) => {
                        ended_early.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    Err(_) => return, // time is up: drop the stream
                }
            }
        }));
    }
    let mut all_open_after = None;
    let mut peak_rss: f64 = 0.0;
    let mut running_seen: f64 = 0.0;
    let mut waiting_seen: f64 = 0.0;
    let mut chunks_at_all_open = 0;
    let mut last_sample = begin;
    let mut cpu_at_all_open = None;
    while Instant::now() < open_until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let settled = headers.load(Ordering::Relaxed)
            + failed_connect.load(Ordering::Relaxed)
            + failed_request.load(Ordering::Relaxed);
        if all_open_after.is_none() && settled as usize >= args.streams {
            all_open_after = Some(begin.elapsed().as_secs_f64());
            chunks_at_all_open = chunks.load(Ordering::Relaxed);
            cpu_at_all_open = cpu_seconds(args.server_pid);
        }
        if last_sample.elapsed() >= Duration::from_millis(500) {
            last_sample = Instant::now();
            peak_rss = peak_rss.max(rss_mib(args.server_pid).unwrap_or(0.0));
            running_seen = running_seen.max(metric(&args.addr, "vllm:num_requests_running").await);
            waiting_seen = waiting_seen.max(metric(&args.addr, "vllm:num_requests_waiting").await);
        }
    }
    let open_at = all_open_after.unwrap_or(f64::NAN);
    let held_for = open_until.saturating_duration_since(begin).as_secs_f64() - open_at;
    let steady_chunks = chunks.load(Ordering::Relaxed) - chunks_at_all_open;
    let server_cpu = cpu_percent(cpu_at_all_open, cpu_seconds(args.server_pid), held_for);
    for t in tasks {
        let _ = t.await;
    }
    println!(
        "streams: {} requested; {} open (200 + headers) within {:.2} s, {} got tokens; failures: {} connect, {} request, {} finished (max_tokens); then held {:.1} s delivering {:.0} chunks/s; server running up to {:.0}, waiting up to {:.0}; server CPU {:.0}% of one core, RSS peak {:.1} MiB",
        args.streams,
        headers.load(Ordering::Relaxed),
        open_at,
        started.load(Ordering::Relaxed),
        failed_connect.load(Ordering::Relaxed),
        failed_request.load(Ordering::Relaxed),
        ended_early.load(Ordering::Relaxed),
        held_for,
        steady_chunks as f64 / held_for,
        running_seen,
        waiting_seen,
        server_cpu,
        peak_rss,
    );
}

async fn fill(args: &Args) {
    let deadline = Instant::now() + Duration::from_secs(600);
    for round in 0..args.rounds {
        let started = Instant::now();
        let mut tasks = Vec::new();
        let per_task = args.per_round.div_ceil(16);
        for t in 0..16 {
            let addr = args.addr.clone();
            let prompt_bytes = args.prompt_bytes;
            tasks.push(tokio::spawn(async move {
                let Ok(mut sender) = connect(&addr).await else {
                    return 0u64;
                };
                let mut ok = 0;
                for i in 0..per_task {
                    if Instant::now() > deadline {
                        break;
                    }
                    let prompt = filler(&format!("round{round}-task{t}-req{i}"), prompt_bytes);
                    let body =
                        format!(r#"{{"model":"sim-model","prompt":"{prompt}","max_tokens":1}}"#);
                    if let Ok(r) = post(&mut sender, "/v1/completions", body).await {
                        if r.status().is_success() && r.into_body().collect().await.is_ok() {
                            ok += 1;
                        }
                    }
                }
                ok
            }));
        }
        let mut ok = 0;
        for t in tasks {
            ok += t.await.unwrap_or(0);
        }
        println!(
            "fill round {}: {} requests of {} B in {:.1} s; cached blocks {:.0}, evictions {:.0}, server RSS {:.1} MiB",
            round + 1,
            ok,
            args.prompt_bytes,
            started.elapsed().as_secs_f64(),
            metric(&args.addr, "vllm_sim:cached_blocks").await,
            metric(&args.addr, "vllm_sim:prefix_cache_evictions_total").await,
            rss_mib(args.server_pid).unwrap_or(f64::NAN),
        );
    }
}

fn main() {
    let args = Args::parse();
    if !args.addr.starts_with("127.") && !args.addr.starts_with("localhost") {
        eprintln!("bench: only loopback addresses are allowed");
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        match args.mode {
            Mode::Rps => rps(&args).await,
            Mode::Streams => streams(&args).await,
            Mode::Fill => fill(&args).await,
        }
    });
}
