//! `GET /metrics`: every pool's Prometheus text, merged into one exposition.
//!
//! A pool of several coordinator shards is first made one page: counters and load gauges summed
//! over its shards, state gauges (health, breakers, scraped gauges, probes) from shard 0
//! (`routing_core::metrics::sum_shard_pages`). A shard that fails to answer leaves its pool's
//! counters out of that scrape and shows in `llm_gateway_metrics_shards_missing`
//! (`routing_core::metrics::pool_page`).
//!
//! Each pool renders the same metric families with its own `pool` label; a valid exposition lists
//! each family's `# HELP` / `# TYPE` once with all its samples together, so the pages are merged
//! family by family rather than concatenated.

use crate::platform::do_client::{self, To};
use coordinator_protocol::call::{Metrics, MetricsPage};
use coordinator_protocol::ApiError;
use futures_util::future::join_all;
use routing_core::metrics::pool_page;
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

/// Collects and merges the metrics of every pool, every shard of every pool asked at once.
///
/// A shard that does not answer is logged and counted in the pool's
/// `llm_gateway_metrics_shards_missing`; the pool's counters are then left out of this scrape
/// rather than summed over fewer shards (`routing_core::metrics::pool_page`: a counter never goes
/// backwards because a call failed).
pub async fn handle(env: &Env) -> Result<Response, ApiError> {
    let pools = do_client::list_pools(env).await?;
    let asked = pools.iter().map(|pool| async move {
        let calls = (0..pool.all_shards()).map(|k| async move {
            (
                k,
                do_client::call(env, To::Pool(&pool.name, k), &Metrics).await,
            )
        });
        let mut pages = Vec::new();
        let mut missing = 0;
        for (k, answer) in join_all(calls).await {
            match answer {
                Ok(MetricsPage(page)) => pages.push(page),
                Err(e) => {
                    missing += 1;
                    worker::console_error!("metrics: pool {} shard {k}: {e}", pool.name);
                }
            }
        }
        pool_page(&pool.name, &pages, missing)
    });
    let pages = join_all(asked).await;
    let mut resp = Response::ok(merge_expositions(&pages))?;
    resp.headers_mut()
        .set("content-type", "text/plain; version=0.0.4; charset=utf-8")?;
    Ok(resp)
}
