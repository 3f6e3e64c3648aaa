//! The `vllm-sim` binary: parses the command line, binds the listener, starts the engine task and
//! serves (the simulation itself is the `vllm_sim` library). The chosen address is printed on stdout
//! as `vllm-sim listening on http://HOST:PORT` so that callers using `--port 0` can find it (with
//! `--startup-delay-s`, connections to it are refused until the simulated load ends, as vLLM's).

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;

use vllm_sim::config::Config;
use vllm_sim::launch;

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
    let socket = match launch::bind_socket(&config.host, config.port).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "vllm-sim: cannot listen on {}:{}: {e}",
                config.host, config.port
            );
            return ExitCode::from(1);
        }
    };
    let address = match socket.local_addr() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vllm-sim: {e}");
            return ExitCode::from(1);
        }
    };
    let mut config = config;
    config.port = address.port();

    eprintln!(
        "vllm-sim: models {:?}, role {}, {} KV blocks of {} tokens, max {} seqs, time scale {}",
        config.models,
        config.role.as_str(),
        config.kv_blocks,
        config.block_size,
        config.max_num_seqs(),
        config.time_scale
    );
    let state = Arc::new(launch::app_state(config));
    // While the simulated model loads, the port is bound but refuses connections (vLLM 0.34);
    // otherwise it listens before its address is printed, so callers can connect at once.
    let loading_until = state
        .loading_until()
        .filter(|_| !state.loading_answers_503());
    let socket = match loading_until {
        Some(until) => {
            println!("vllm-sim listening on http://{address}");
            let _ = std::io::stdout().flush();
            tokio::time::sleep_until(until.into()).await;
            launch::listen(socket)
        }
        None => {
            let listener = launch::listen(socket);
            println!("vllm-sim listening on http://{address}");
            let _ = std::io::stdout().flush();
            listener
        }
    };
    let listener = match socket {
        Ok(l) => l,
        Err(e) => {
            eprintln!("vllm-sim: cannot listen on {address}: {e}");
            return ExitCode::from(1);
        }
    };
    vllm_sim::server::serve(listener, state).await;
    ExitCode::SUCCESS
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
