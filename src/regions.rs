//! Which pool a client should try first: the nearest region, then the others.
//!
//! The client's region comes from, in order: the `x-gateway-region` header when
//! `ALLOW_REGION_HEADER` is `"true"` (tests, or a trusted front proxy), then the platform's view of
//! the client (`request.cf` continent or colo) mapped through the `REGION_MAP` var, a JSON object
//! such as `{"NA": "us-east", "EU": "eu-west", "LHR": "eu-west"}` (colo codes win over
//! continents). Pools in that region come first; the rest keep their directory order.

use crate::settings::Settings;
use coordinator_protocol::messages::PoolEntry;
use worker::Request;

/// The client's region, if it can be told.
pub fn client_region(req: &Request, settings: &Settings) -> Option<String> {
    if settings.region_header {
        if let Some(r) = req
            .headers()
            .get("x-gateway-region")
            .ok()
            .flatten()
            .filter(|r| !r.is_empty())
        {
            return Some(r);
        }
    }
    let map = &settings.region_map;
    let cf = req.cf()?;
    let colo = cf.colo();
    map.get(&colo)
        .or_else(|| cf.continent().and_then(|c| map.get(&c)))
        .cloned()
}

/// Orders pools nearest first.
pub fn order_pools(
    req: &Request,
    settings: &Settings,
    mut pools: Vec<PoolEntry>,
) -> Vec<PoolEntry> {
    if pools.len() < 2 {
        return pools;
    }
    if let Some(region) = client_region(req, settings) {
        pools.sort_by_key(|p| p.region != region);
    }
    pools
}
