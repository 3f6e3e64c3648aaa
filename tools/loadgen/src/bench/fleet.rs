//! The benchmark's fleet of vllm-sim processes on consecutive loopback ports: started with empty
//! caches before every run, health-checked, scraped for their counters and TTFT histograms, stopped.

use super::config::FleetConfig;
use crate::client::Http;
use crate::metrics::{Counters, Histogram};
use hyper::Method;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// vLLM's time-to-first-token histogram (seconds, measured by the backend).
const TTFT_HISTOGRAM: &str = "vllm:time_to_first_token_seconds";

/// Running vllm-sim processes, restartable on the same ports.
pub struct Fleet {
    config: FleetConfig,
    model: String,
    bin: PathBuf,
    log_dir: PathBuf,
    children: Vec<Child>,
    http: Http,
}

impl Fleet {
    /// A fleet (not started yet).
    pub fn new(
        config: FleetConfig,
        model: String,
        bin: PathBuf,
        log_dir: PathBuf,
        http: Http,
    ) -> Self {
        Fleet {
            config,
            model,
            bin,
            log_dir,
            children: Vec::new(),
            http,
        }
    }

    /// Backend ids (`sim-1`, ...) and base URLs.
    pub fn members(&self) -> Vec<(String, String)> {
        (0..self.config.backends)
            .map(|i| {
                (
                    format!("sim-{}", i + 1),
                    format!("http://127.0.0.1:{}", self.config.base_port as usize + i),
                )
            })
            .collect()
    }

    /// Stops every process this fleet started.
    pub async fn stop(&mut self) {
        for c in &mut self.children {
            let _ = c.start_kill();
        }
        for c in &mut self.children {
            let _ = c.wait().await;
        }
        self.children.clear();
    }

    /// (Re)starts every backend with empty caches and waits until each answers `/health`.
    pub async fn restart(&mut self) -> Result<(), String> {
        self.stop().await;
        std::fs::create_dir_all(&self.log_dir).map_err(|e| e.to_string())?;
        for (i, (_, url)) in self.members().iter().enumerate() {
            let port = self.config.base_port as usize + i;
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.log_dir.join(format!("sim-{port}.log")))
                .map_err(|e| e.to_string())?;
            let child = Command::new(&self.bin)
                .args(["--port", &port.to_string(), "--model", &self.model])
                .args([
                    "--kv-blocks",
                    &self.config.kv_blocks.to_string(),
                    "--time-scale",
                    &self.config.time_scale.to_string(),
                ])
                .args(["--seed", &port.to_string(), "--report-engine-timing"])
                .args(&self.config.extra_args)
                .stdout(Stdio::null())
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| format!("starting {}: {e}", self.bin.display()))?;
            self.children.push(child);
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Ok((200, _)) = self
                    .http
                    .call(Method::GET, &format!("{url}/health"), None, None)
                    .await
                {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!("vllm-sim on port {port} did not come up"));
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
        Ok(())
    }

    /// Every backend's counters and time-to-first-token histogram, in `members()` order.
    pub async fn scrape(&self) -> Vec<(Counters, Histogram)> {
        let mut out = Vec::new();
        for (_, url) in self.members() {
            let text = match self
                .http
                .call(Method::GET, &format!("{url}/metrics"), None, None)
                .await
            {
                Ok((200, t)) => t,
                _ => String::new(),
            };
            out.push((
                Counters::from_text(&text),
                Histogram::from_text(&text, TTFT_HISTOGRAM),
            ));
        }
        out
    }
}
