//! `GET /metrics`: every pool's Prometheus text, merged into one exposition.
//!
//! A pool of several coordinator shards is first made one page: counters and load gauges summed
//! over its shards, state gauges (health, breakers, scraped gauges, probes) from shard 0
//! (`routing_core::metrics::sum_shard_pages`).
//!
//! Each pool renders the same metric families with its own `pool` label; a valid exposition lists
//! each family's `# HELP` / `# TYPE` once with all its samples together, so the pages are merged
//! family by family rather than concatenated.

use crate::platform::do_client::{self, To};
use coordinator_protocol::call::{Metrics, MetricsPage};
use coordinator_protocol::ApiError;
use routing_core::metrics::sum_shard_pages;
use worker::{Env, Response};

/// Merges Prometheus text pages, keeping each family's header once and its samples together.
pub fn merge_expositions(pages: &[String]) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut families: std::collections::HashMap<String, (Vec<String>, Vec<String>)> =
        Default::default();
    for page in pages {
        let mut current = String::new();
        for line in page.lines() {
            if line.trim().is_empty() {
                continue;
            }
            if let Some(rest) = line
                .strip_prefix("# HELP ")
                .or_else(|| line.strip_prefix("# TYPE "))
            {
                let name = rest
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                let entry = families.entry(name.clone()).or_insert_with(|| {
                    order.push(name.clone());
                    (Vec::new(), Vec::new())
                });
                if !entry.0.iter().any(|h| h == line) {
                    entry.0.push(line.to_string());
                }
                current = name;
            } else if !line.starts_with('#') {
                let name: String = line
                    .chars()
                    .take_while(|c| *c != '{' && *c != ' ')
                    .collect();
                let key = if !current.is_empty() && name.starts_with(&current) {
                    current.clone()
                } else {
                    name
                };
                families
                    .entry(key.clone())
                    .or_insert_with(|| {
                        order.push(key.clone());
                        (Vec::new(), Vec::new())
                    })
                    .1
                    .push(line.to_string());
            }
        }
    }
    let mut out = String::new();
    for name in order {
        if let Some((headers, samples)) = families.get(&name) {
            for l in headers.iter().chain(samples) {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    out
}

/// Collects and merges the metrics of every pool.
pub async fn handle(env: &Env) -> Result<Response, ApiError> {
    let mut pages = Vec::new();
    for pool in do_client::list_pools(env).await? {
        let mut shard_pages = Vec::new();
        for k in 0..pool.all_shards() {
            match do_client::call(env, To::Pool(&pool.name, k), &Metrics).await {
                Ok(MetricsPage(page)) => shard_pages.push(page),
                Err(e) => worker::console_error!("metrics: pool {} shard {k}: {e}", pool.name),
            }
        }
        match shard_pages.len() {
            0 => {}
            1 => pages.append(&mut shard_pages),
            _ => pages.push(sum_shard_pages(&shard_pages)),
        }
    }
    let mut resp = Response::ok(merge_expositions(&pages))?;
    resp.headers_mut()
        .set("content-type", "text/plain; version=0.0.4; charset=utf-8")?;
    Ok(resp)
}
