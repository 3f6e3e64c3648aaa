//! Which pool a request tries first: the one where it will see its first token soonest, the
//! network included, within the jurisdictions it may be served in.
//!
//! The client's region comes from, in order: the `x-gateway-region` header when
//! `ALLOW_REGION_HEADER` is `"true"` (tests, or a trusted front proxy), then the platform's view of
//! the client (`request.cf` continent or colo) mapped through the `REGION_MAP` var, a JSON object
//! such as `{"NA": "us-east", "EU": "eu-west", "LHR": "eu-west"}` (colo codes win over
//! continents). Pools are put in proximity order (the client's region, then by configured round
//! trip), restricted to the allowed jurisdictions (the nearest pool's `residency` setting), and
//! then ordered on predicted time by `routing_core::region::order_pools`: each pool's time card
//! (from the directory, with the cached pool list) plus the round trips to it, measured by this
//! isolate or configured in `REGION_RTT_MS`; a conversation whose history this isolate sent to a
//! pool counts that history as cached there. `TIME_ROUTING=false` keeps proximity order.
//!
//! The isolate's memory holds the network measurements and the conversations' home pools, both
//! bounded (`routing_core::region`).

use crate::platform::http::{json_var_or_default, var_or};
use crate::platform::isolate::{self, InFlightRequest};
use crate::platform::settings::{RegionSettings, Settings};
use coordinator_protocol::messages::PoolEntry;
use coordinator_protocol::ApiError;
use routing_core::policy::ring::key_hash;
use routing_core::region::choice::allowed_in;
use routing_core::region::{
    order_pools, ChoiceConfig, ChoiceReason, HomePools, NetworkModel, PoolOption, TimeCard,
};
use routing_core::request::prompt::RequestFeatures;
use std::cell::RefCell;
use std::collections::HashMap;
use worker::{Env, Request};

/// Conversations an isolate remembers the home pool of, unless `HOME_POOLS_MAX` says otherwise.
const DEFAULT_HOME_POOLS: usize = 8192;

/// Keeps the card a grant (or an overdue stream's renewal) from `pool` carried, when it is newer
/// than the one kept.
pub fn fresh_card(pool: &str, card: &TimeCard) {
    isolate::with_grant_cards(|c| {
        let mut c = c.borrow_mut();
        if c.get(pool).is_none_or(|kept| kept.at_ms < card.at_ms) {
            c.insert(pool.to_string(), card.clone());
        }
    });
}

/// Sends remembered per pool.
const SENT_KEPT: usize = 512;

/// Of the requests this isolate sent `pool` after its card was computed (`card_at_ms`), how many
/// have not ended (they hold a slot or wait for one), and their mean output tokens.
fn sent_since(pool: &str, card_at_ms: u64) -> (u32, u32) {
    isolate::with_in_flight(|s| {
        let s = s.borrow();
        let Some(list) = s.get(pool) else {
            return (0, 0);
        };
        let live = list.iter().filter(|x| x.at_ms >= card_at_ms);
        let (n, tokens) = live.fold((0u32, 0u64), |(n, t), x| (n + 1, t + u64::from(x.tokens)));
        (
            n,
            if n == 0 {
                0
            } else {
                (tokens / u64::from(n)) as u32
            },
        )
    })
}

fn read_settings(env: &Env) -> RegionSettings {
    let d = ChoiceConfig::default();
    RegionSettings {
        choice: ChoiceConfig {
            enabled: var_or(env, "TIME_ROUTING", "true".to_string()) != "false",
            margin_ms: var_or(env, "POOL_CHOICE_MARGIN_MS", d.margin_ms),
            margin_ratio: var_or(env, "POOL_CHOICE_MARGIN_RATIO", d.margin_ratio).clamp(0.0, 10.0),
            card_max_age_ms: var_or(env, "TIME_CARD_MAX_AGE_MS", d.card_max_age_ms),
            round_trips: var_or(env, "POOL_ROUND_TRIPS", d.round_trips).min(4),
        },
        home_capacity: var_or(env, "HOME_POOLS_MAX", DEFAULT_HOME_POOLS).clamp(1, 1 << 20),
        simulate_network: var_or(env, "SIMULATE_NETWORK", String::new()) == "true",
        limiter_rtt_ms: var_or(env, "SIMULATE_LIMITER_RTT_MS", 0u64).min(10_000),
    }
}

/// Reads this isolate's region settings (from `env`, the first time).
fn with_settings<R>(env: &Env, f: impl FnOnce(&RegionSettings) -> R) -> R {
    isolate::with_region_settings(|s| f(s.get_or_init(|| read_settings(env))))
}

fn with_network<R>(env: &Env, f: impl FnOnce(&mut NetworkModel) -> R) -> R {
    isolate::with_network(|n| {
        let cell = n.get_or_init(|| {
            let table: HashMap<String, HashMap<String, u32>> =
                json_var_or_default(env, "REGION_RTT_MS");
            RefCell::new(NetworkModel::new(
                &table,
                var_or(env, "REGION_RTT_DEFAULT_MS", 100),
            ))
        });
        f(&mut cell.borrow_mut())
    })
}

fn with_homes<R>(env: &Env, f: impl FnOnce(&mut HomePools) -> R) -> R {
    let capacity = with_settings(env, |s| s.home_capacity);
    isolate::with_homes(|h| {
        f(&mut h
            .get_or_init(|| RefCell::new(HomePools::new(capacity)))
            .borrow_mut())
    })
}

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

/// The pools to try, in order, and why the first one is first.
pub struct Plan {
    /// Pools to try, first first.
    pub pools: Vec<PoolEntry>,
    /// Why the first is first.
    pub reason: ChoiceReason,
    /// The predicted cost of the first pool (round trips plus time to first token), if known.
    pub predicted_ms: Option<u64>,
    /// When the first pool is not the request's anchor (its home pool, else the nearest), the
    /// anchor's predicted cost: what moving saved, by the prediction.
    pub anchor_ms: Option<u64>,
    /// The jurisdictions the request may be served in (empty: anywhere).
    pub allowed: Vec<String>,
    /// Pools left out because they are outside those jurisdictions.
    pub excluded: usize,
    /// The client's region, when known.
    pub client_region: Option<String>,
}

impl Plan {
    /// Whether `pool` is in another region than the client's.
    pub fn cross_region(&self, pool: &PoolEntry) -> bool {
        self.client_region
            .as_deref()
            .is_some_and(|r| !pool.region.is_empty() && pool.region != r)
    }
}

/// Orders `pools` for the request with `features`; a 503 when residency leaves no pool. A client
/// key's `residency` restricts the request as the nearest pool's does; with both, it may go only
/// where both allow.
pub fn plan(
    req: &Request,
    env: &Env,
    settings: &Settings,
    pools: Vec<PoolEntry>,
    features: &RequestFeatures,
    key_residency: &[String],
    now_ms: u64,
) -> Result<Plan, ApiError> {
    let region = client_region(req, settings);
    let mut pools = pools;
    // Each pool's newest card: the pool list's, or a later grant's.
    isolate::with_grant_cards(|c| {
        let c = c.borrow();
        for p in &mut pools {
            if let Some(fresh) = c.get(&p.name) {
                if p.card
                    .as_ref()
                    .is_none_or(|listed| listed.at_ms < fresh.at_ms)
                {
                    p.card = Some(fresh.clone());
                }
            }
        }
    });
    // Proximity: the client's region first, then by configured round trip (directory order for
    // ties and unknowns).
    with_network(env, |net| {
        pools.sort_by_key(|p| {
            let own = region.as_deref() == Some(p.region.as_str());
            (
                !own,
                net.configured_ms(region.as_deref(), &p.region)
                    .unwrap_or(u32::MAX),
            )
        })
    });
    // Residency: the nearest pool's rule, when the client is in its region, and the key's.
    let pool_rule: Vec<String> = pools
        .iter()
        .find(|p| region.as_deref() == Some(p.region.as_str()) && !p.residency.is_empty())
        .map(|p| p.residency.clone())
        .unwrap_or_default();
    let allowed =
        both_allow(&pool_rule, key_residency).ok_or_else(|| residency_error(key_residency))?;
    let listed = pools.len();
    if !allowed.is_empty() {
        pools.retain(|p| allowed_in(&p.jurisdiction, &allowed));
        if pools.is_empty() {
            return Err(residency_error(&allowed));
        }
    }
    let excluded = listed - pools.len();
    // Pools whose card says they lack the model go last.
    pools.sort_by_key(|p| p.card.as_ref().is_some_and(|c| !c.serves(&features.model)));
    let config = with_settings(env, |s| s.choice);
    let key = features.routing_key.as_deref().map(key_hash);
    let home = with_homes(env, |h| {
        h.lookup(&features.block_hashes, key)
            .map(|(pool, blocks)| (pool.to_string(), blocks))
    });
    let block_tokens = features.block_tokens.max(1);
    let options: Vec<PoolOption<'_>> = with_network(env, |net| {
        pools
            .iter()
            .map(|p| {
                let at_home = home.as_ref().filter(|(h, _)| *h == p.name);
                let sent = p
                    .card
                    .as_ref()
                    .map_or((0, 0), |c| sent_since(&p.name, c.at_ms));
                PoolOption {
                    card: p.card.as_ref(),
                    rtt_ms: net.rtt_ms(region.as_deref(), &p.name, &p.region),
                    cached_tokens: at_home.map_or(0, |(_, b)| b.saturating_mul(block_tokens)),
                    home: at_home.is_some(),
                    sent_since_card: sent.0,
                    sent_tokens: sent.1,
                }
            })
            .collect()
    });
    let u = js_sys::Math::random();
    let choice = order_pools(&options, features.prompt_tokens, now_ms, u, &config);
    let predicted_ms = choice.order.first().and_then(|&i| choice.predicted_ms[i]);
    let moved = choice.order.first().is_some_and(|&i| i != choice.anchor);
    let anchor_ms = moved
        .then(|| choice.predicted_ms.get(choice.anchor).copied().flatten())
        .flatten();
    let mut slots: Vec<Option<PoolEntry>> = pools.into_iter().map(Some).collect();
    let ordered = choice
        .order
        .iter()
        .filter_map(|&i| slots.get_mut(i).and_then(Option::take))
        .collect();
    Ok(Plan {
        pools: ordered,
        reason: choice.reason,
        predicted_ms,
        anchor_ms,
        allowed,
        excluded,
        client_region: region,
    })
}

/// The jurisdictions both rules allow (an empty rule allows anywhere; empty: anywhere); `None`
/// when two restrictions share no jurisdiction.
fn both_allow(a: &[String], b: &[String]) -> Option<Vec<String>> {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => Some(b.to_vec()),
        (_, true) => Some(a.to_vec()),
        _ => {
            let both: Vec<String> = a.iter().filter(|j| b.contains(j)).cloned().collect();
            (!both.is_empty()).then_some(both)
        }
    }
}

/// The answer when no pool in the allowed jurisdictions can take a request.
pub fn residency_error(allowed: &[String]) -> ApiError {
    ApiError::unavailable(
        format!(
            "No pool in the allowed jurisdictions ({}) can take the request now; it is not sent \
             elsewhere.",
            allowed.join(", ")
        ),
        1,
    )
    .with_code("residency_unavailable")
}

/// Records that `pool` (with its newest `card`) took the request (its lease `lease`) at `now_ms`:
/// its home for the conversation's next turn, and one more request the card does not know of,
/// until it ends ([`finished`]).
pub fn served(
    env: &Env,
    pool: &str,
    card: Option<&TimeCard>,
    features: &RequestFeatures,
    lease: u64,
    now_ms: u64,
) {
    record_home(env, pool, features);
    let Some(card) = card else {
        return;
    };
    isolate::with_in_flight(|s| {
        let mut s = s.borrow_mut();
        let list = s.entry(pool.to_string()).or_default();
        // Those sent before this card are counted in it.
        while list.front().is_some_and(|x| x.at_ms < card.at_ms) || list.len() >= SENT_KEPT {
            list.pop_front();
        }
        list.push_back(InFlightRequest {
            at_ms: now_ms,
            lease,
            tokens: features.max_tokens,
        });
    });
}

/// Records `pool` as the home of the request's conversation (its next turn extends this prompt).
pub fn record_home(env: &Env, pool: &str, features: &RequestFeatures) {
    let key = features.routing_key.as_deref().map(key_hash);
    with_homes(env, |h| h.record(&features.block_hashes, key, pool));
}

/// The request of `lease` on `pool` ended: it no longer counts against the pool.
pub fn finished(pool: &str, lease: u64) {
    isolate::with_in_flight(|s| {
        if let Some(list) = s.borrow_mut().get_mut(pool) {
            list.retain(|x| x.lease != lease);
        }
    });
}

/// With `SIMULATE_NETWORK=true` (local benchmarks and tests only: every pool of a local run is on
/// this machine), the round trip the platform would add between the client's colo and `pool`,
/// from `REGION_RTT_MS`: the Worker waits it out before the lease call and again before the
/// backend fetch, so what the client measures, and what this isolate learns of the network,
/// include the modelled network. With the regional hop (`hop.rs`) the edge waits it out once,
/// before the hand-over, and the regional Worker measures from the pool's region (0 for its own
/// pools). 0 otherwise.
pub fn simulated_rtt_ms(env: &Env, client_region: Option<&str>, pool: &PoolEntry) -> u64 {
    if !simulating(env) {
        return 0;
    }
    with_network(env, |n| {
        u64::from(n.configured_ms(client_region, &pool.region).unwrap_or(0))
    })
}

/// With `SIMULATE_NETWORK=true`, the round trip to a client's rate limiter object that the Worker
/// waits out before charging it (`SIMULATE_LIMITER_RTT_MS`, 0 by default: on the platform the
/// object lives where the client was first seen). 0 otherwise.
pub fn simulated_limiter_rtt_ms(env: &Env) -> u64 {
    with_settings(env, |s| {
        if s.simulate_network {
            s.limiter_rtt_ms
        } else {
            0
        }
    })
}

/// Whether `SIMULATE_NETWORK` is on (local benchmarks and tests).
pub fn simulating(env: &Env) -> bool {
    with_settings(env, |s| s.simulate_network)
}

/// The isolate's estimate of the round trip from a Worker in `from` to `pool` (measured on its
/// lease calls, else configured, else 0): what sending the request to another of the pool's
/// backends after the lease call would add (`ahead.rs`).
///
/// Measurements are kept under the client's region (`observe_rtt`), also at a regional Worker,
/// where they are its own lease calls' round trips; without enough of them, the configured round
/// trip from where this Worker runs (`from`: the pool's region at a regional Worker).
pub fn rtt_estimate_ms(
    env: &Env,
    client_region: Option<&str>,
    from: Option<&str>,
    pool: &PoolEntry,
) -> u32 {
    with_network(env, |n| match n.is_measured(client_region, &pool.name) {
        true => n.rtt_ms(client_region, &pool.name, &pool.region),
        false => n.configured_ms(from, &pool.region).unwrap_or(0),
    })
}

/// Records one measured round trip to `pool` from a client in `client_region` (an acquire that
/// did not wait in a queue).
pub fn observe_rtt(env: &Env, client_region: Option<&str>, pool: &str, ms: u64) {
    let ms = ms.min(u64::from(u32::MAX)) as u32;
    with_network(env, |n| n.observe(client_region, pool, ms));
}
