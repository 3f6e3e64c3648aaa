//! The regional hop: the edge Worker hands a planned request to a second deployment of this same
//! Worker placed next to the chosen pool's GPUs, so the lease call and the backend fetch are local
//! to the pool and the client pays one edge-to-pool round trip instead of two.
//!
//! At the edge (the default role), everything that must be decided once stays there: the client
//! key, the body checks, the features, residency and the pool order (`regions::plan`). When the
//! first pool's region names a service binding in the `REGIONAL_WORKERS` var
//! (`{"eu-west": "REGIONAL_EU_WEST"}`), the request goes to that binding with the plan, the
//! client's admission identity and what to charge its rate limits in the `x-gateway-hop` header,
//! sharing the client's abort signal, and the regional Worker's response is returned as it
//! streams (the edge never reads its body). The regional Worker charges the limits beside its
//! lease call (`src/clients/reserving.rs`), so a hop costs no limiter round trip from the edge;
//! the limits are the edge's decision, carried in the context ([`Charge`]: its `RATE_LIMIT_RPM`,
//! `RATE_LIMIT_TPM` and `RATE_LIMIT_AHEAD`, signed with HMAC-SHA256 under `HOP_SECRET`), never
//! the regional Worker's own vars, so hopped traffic is limited exactly as the edge would limit
//! it (issue 42, item 6); a decision whose signature does not match is refused like an
//! unreadable context.
//!
//! A Worker with `GATEWAY_ROLE = "regional"` (no public route) trusts that header, and only it
//! does: at the edge the header is ignored and always overwritten. With the `HOP_SECRET` secret
//! set on both, the regional Worker also requires the secret with the hop (defence in depth, in
//! case it is ever given a route); without it, a hop is an ordinary request. The regional side walks the
//! plan's pools (lease, fetch, relay, lease guard), charges and settles the reservation, as the
//! edge would.
//!
//! The regional Worker's answer carries the grant's time card and lease ([`HOP_CARD_HEADER`],
//! taken out at the edge): the edge counts its own sends against the pool and plans on the
//! grant's card, as it would without the hop (issue 42, item 4).
//!
//! The context carries its version ([`HOP_VERSION`]): during a deploy the edge and the regional
//! Worker may run different builds, and a regional Worker that cannot read the context (newer
//! than it knows, or not parseable) answers 421 with `x-gateway-hop-refused` before charging or
//! leasing anything, and the edge then serves the request itself: the client never sees a 400
//! for the gateway's own deploy (issue 42, item 7).

use crate::clients::keys::Reservation;
use crate::platform::auth::constant_time_eq;
use crate::platform::http::{hex, unhex};
use crate::platform::isolate::settings;
use crate::request::regions::{self, Plan};
use coordinator_protocol::messages::PoolEntry;
use coordinator_protocol::ApiError;
use hmac::{Hmac, Mac};
use routing_core::admission::AdmissionRequest;
use routing_core::region::{ChoiceReason, TimeCard};
use routing_core::request::prompt::RequestFeatures;
use routing_core::request::rate_limit::RateLimits;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use worker::{Env, Fetcher, Headers, Request, Response};

/// The internal header carrying a [`HopContext`] (hex-encoded JSON) from the edge to a regional
/// Worker.
pub const HOP_HEADER: &str = "x-gateway-hop";
/// The shared `HOP_SECRET`, from the edge: a regional Worker that has the secret trusts a hop
/// only when this header carries it.
const HOP_AUTH_HEADER: &str = "x-gateway-hop-auth";
/// A regional Worker's answer to a hop whose context it cannot read (a context from a newer edge
/// during a deploy, or one it cannot parse): status 421 with this header, before anything was
/// charged or leased, so the edge serves the request itself.
const HOP_REFUSED_HEADER: &str = "x-gateway-hop-refused";
/// The version of [`HopContext`] this build writes and the newest it reads. A context of an older
/// version is read (fields added since have defaults); a newer one is refused with
/// [`HOP_REFUSED_HEADER`]. Move it on whenever a field changes meaning or becomes required.
pub const HOP_VERSION: u32 = 1;
/// The regional Worker's answer to a hop it served: the grant's time card and lease (hex-encoded
/// JSON), so the edge counts its own send against the pool and plans its next requests on the
/// card the grant carried, as without the hop (issue 42, item 4). The edge takes it out of the
/// response.
pub const HOP_CARD_HEADER: &str = "x-gateway-hop-card";
/// With `SIMULATE_NETWORK=true` only: how many modelled round trips the request waited out, edge
/// and regional side together (tests count them instead of timing them).
pub const SIMULATED_WAITS_HEADER: &str = "x-gateway-simulated-waits";

/// Whether this deployment is a regional Worker (`GATEWAY_ROLE = "regional"`, read once per
/// isolate with the other settings).
fn is_regional(env: &Env) -> bool {
    settings(env).regional
}

/// The `HOP_SECRET` secret (or var) both roles share, if set.
fn hop_secret(env: &Env) -> Option<String> {
    settings(env).hop_secret.clone()
}

/// What the edge decided, for the regional Worker that carries it out.
#[derive(Debug, Serialize, Deserialize)]
pub struct HopContext {
    /// [`HOP_VERSION`] of the edge that wrote it (0: an edge from before versions).
    #[serde(default)]
    pub version: u32,
    /// The pools to try, in the edge's order, as the edge listed them (so a regional Worker whose
    /// cached list is older still finds a pool created since).
    pools: Vec<PoolEntry>,
    /// Why the first is first (`ChoiceReason::as_str`).
    reason: String,
    predicted_ms: Option<u64>,
    anchor_ms: Option<u64>,
    allowed: Vec<String>,
    excluded: usize,
    client_region: Option<String>,
    /// The region the regional Worker serves (its first pool's region).
    pub region: String,
    /// The client's tenant, priority and wait limit, for admission.
    pub who: AdmissionRequest,
    /// The tokens an edge from before `charge` charged, for the regional side to settle (or
    /// refund); an edge of this build leaves the charging to the regional side and sends none.
    #[serde(default)]
    pub reservation: Option<Reservation>,
    /// What the regional side charges the client's rate limits, when they apply.
    #[serde(default)]
    pub charge: Option<Charge>,
    /// The edge asked the stream for its usage event on the client's behalf: take it out again.
    pub strip_usage_event: bool,
}

/// A charge to a client's rate limits, with the edge's decision on them (issue 42, item 6): the
/// regional Worker charges it against the edge's limits, not its own `RATE_LIMIT_*` vars.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Charge {
    /// The client's key hash ([`crate::clients::keys::require_client`]).
    pub client: String,
    /// The tokens estimated at admission (prompt plus `max_tokens`).
    pub estimate: u64,
    /// The edge's `RATE_LIMIT_RPM` and `RATE_LIMIT_TPM` (zeros: unlimited); `None` from an edge
    /// from before the decision travelled, whose regional Worker applies its own vars.
    #[serde(default)]
    pub limits: Option<RateLimits>,
    /// The edge's `RATE_LIMIT_AHEAD`.
    #[serde(default)]
    pub ahead: bool,
    /// With `HOP_SECRET`: HMAC-SHA256 of the decision under the secret (hex), checked by the
    /// regional Worker, which refuses a hop whose decision does not match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
}

impl Charge {
    /// The charge of a request the edge (or a Worker serving alone) admits, with its own limits.
    pub fn at_edge(env: &Env, client: &str, estimate: u64) -> Charge {
        Charge {
            client: client.to_string(),
            estimate,
            limits: Some(crate::clients::keys::configured_limits(env).unwrap_or_default()),
            ahead: settings(env).rate_limit_ahead,
            sig: None,
        }
    }

    /// The limits to charge against: the edge's decision (`None`: unlimited), or this Worker's
    /// own for an edge that sent none.
    pub fn limits(&self, env: &Env) -> Option<RateLimits> {
        match self.limits {
            Some(l) => (l != RateLimits::default()).then_some(l),
            None => crate::clients::keys::configured_limits(env),
        }
    }

    /// Whether a client well within its limits may be served ahead of its charge's answer.
    pub fn may_go_ahead(&self, env: &Env) -> bool {
        match self.limits {
            Some(_) => self.ahead,
            None => settings(env).rate_limit_ahead,
        }
    }

    /// The decision's signature under `secret`: HMAC-SHA256 of its fields, one per line.
    fn signature(&self, secret: &str) -> String {
        let l = self.limits.unwrap_or_default();
        let text = format!(
            "hop-charge-v1\n{}\n{}\n{}\n{}\n{}\n{}",
            self.client,
            self.estimate,
            self.limits.is_some(),
            l.requests_per_minute,
            l.tokens_per_minute,
            self.ahead
        );
        // (HMAC takes a key of any length: this never fails.)
        let Ok(mut mac) = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes()) else {
            return String::new();
        };
        mac.update(text.as_bytes());
        hex(&mac.finalize().into_bytes())
    }

    /// Whether the decision carries `secret`'s signature.
    fn signed_by(&self, secret: &str) -> bool {
        let expected = self.signature(secret);
        self.sig.as_deref().is_some_and(|sig| {
            !expected.is_empty() && constant_time_eq(sig.as_bytes(), expected.as_bytes())
        })
    }
}

impl HopContext {
    /// The edge's plan.
    pub fn plan(&self) -> Plan {
        Plan {
            pools: self.pools.clone(),
            reason: reason_named(&self.reason),
            predicted_ms: self.predicted_ms,
            anchor_ms: self.anchor_ms,
            allowed: self.allowed.clone(),
            excluded: self.excluded,
            client_region: self.client_region.clone(),
        }
    }
}

fn reason_named(name: &str) -> ChoiceReason {
    match name {
        "home" => ChoiceReason::Home,
        "faster" => ChoiceReason::Faster,
        "anchor_full" => ChoiceReason::AnchorFull,
        _ => ChoiceReason::Nearest,
    }
}

/// The hop a regional Worker was handed, when this deployment is one and the request carries it
/// (with `HOP_SECRET` set: and the secret); `None` at the edge whatever the request says, and for
/// a hop without the secret, which is then an ordinary request (its key is checked).
pub fn incoming(req: &Request, env: &Env) -> Result<Option<HopContext>, ApiError> {
    if !is_regional(env) {
        return Ok(None);
    }
    let header = |name: &str| req.headers().get(name).ok().flatten();
    let Some(value) = header(HOP_HEADER) else {
        return Ok(None);
    };
    if let Some(secret) = hop_secret(env).as_deref() {
        let given = header(HOP_AUTH_HEADER).unwrap_or_default();
        if !constant_time_eq(given.as_bytes(), secret.as_bytes()) {
            return Ok(None);
        }
    }
    // The version first: a newer edge's context may not parse here at all.
    let json = unhex(&value);
    let version = json
        .as_deref()
        .and_then(|j| serde_json::from_slice::<Versioned>(j).ok())
        .map(|v| v.version);
    let context = json
        .filter(|_| version.is_some_and(|v| v <= HOP_VERSION))
        .and_then(|j| serde_json::from_slice::<HopContext>(&j).ok());
    // With the secret, the rate-limit decision must be the edge's own (signed): one that does not
    // match is refused like an unreadable context, and the edge serves the request itself.
    let secret = hop_secret(env);
    let forged = |c: &HopContext| match (&secret, &c.charge) {
        (Some(secret), Some(charge)) => !charge.signed_by(secret),
        _ => false,
    };
    match context {
        Some(context) if forged(&context) => {
            worker::console_error!("a hop's rate-limit decision does not carry HOP_SECRET's signature: refused");
            Err(ApiError::hop_context_unreadable(
                "the hop's rate-limit decision is not signed with HOP_SECRET; the edge serves the request",
            )
            .with_header(HOP_REFUSED_HEADER, "signature"))
        }
        Some(context) => Ok(Some(context)),
        None => Err(ApiError::hop_context_unreadable(format!(
            "this regional Worker reads hop contexts up to version {HOP_VERSION}; the edge serves the request"
        ))
        .with_header(HOP_REFUSED_HEADER, "context")),
    }
}

/// What [`HOP_CARD_HEADER`] carries.
#[derive(Serialize, Deserialize)]
struct CardBack {
    lease_id: u64,
    card: TimeCard,
}

/// [`HOP_CARD_HEADER`]'s value for a grant of `lease_id` that carried `card`.
pub fn card_header(card: &TimeCard, lease_id: u64) -> String {
    let back = CardBack {
        lease_id,
        card: card.clone(),
    };
    serde_json::to_vec(&back)
        .map(|json| hex(&json))
        .unwrap_or_default()
}

/// A hop context's version alone.
#[derive(Deserialize)]
struct Versioned {
    #[serde(default)]
    version: u32,
}

/// The regional Worker of a plan's first pool, when this is the edge and one is bound.
pub fn regional_for(env: &Env, plan: &Plan) -> Option<Regional> {
    if is_regional(env) {
        return None;
    }
    let first = plan.pools.first()?;
    let binding = settings(env).regional_workers.get(&first.region)?.clone();
    match env.service(&binding) {
        Ok(fetcher) => Some(Regional {
            fetcher,
            region: first.region.clone(),
        }),
        Err(_) => {
            worker::console_error!("REGIONAL_WORKERS names {binding}, which is not bound");
            None
        }
    }
}

/// A regional Worker bound to this edge Worker.
pub struct Regional {
    fetcher: Fetcher,
    region: String,
}

/// What the edge hands over.
pub struct Handoff<'a> {
    /// The client's request (headers, URL and abort signal; its body was read already).
    pub client: &'a Request,
    /// The edge's environment.
    pub env: &'a Env,
    /// The pool order the edge chose.
    pub plan: &'a Plan,
    /// The client's admission identity.
    pub who: &'a AdmissionRequest,
    /// What the regional Worker charges the client's rate limits.
    pub charge: Option<Charge>,
    /// The request's id (the regional Worker uses it too).
    pub request_id: &'a str,
    /// Whether the usage event must be taken out of the stream.
    pub strip_usage_event: bool,
    /// The body to send upstream.
    pub body: &'a [u8],
}

/// Client headers the regional Worker does not get: the key (checked here), framing, the hop.
fn withheld(name: &str) -> bool {
    matches!(
        name,
        "authorization"
            | "content-length"
            | "transfer-encoding"
            | "host"
            | HOP_HEADER
            | HOP_AUTH_HEADER
    )
}

impl Regional {
    /// Hands the request over (see [`Regional::forward`]) and takes what the edge still owes it:
    /// the conversation's home pool, recorded here so its next turn is sent home as without the
    /// hop. `None` when the regional Worker never answered (it threw): the edge serves the request
    /// itself, and charges it.
    pub async fn hand_over(
        &self,
        h: Handoff<'_>,
        features: &RequestFeatures,
    ) -> Option<Result<Response, ApiError>> {
        let (env, client) = (h.env, h.client);
        match self.forward(h).await {
            // A regional Worker that cannot read this edge's context (a deploy in progress)
            // refused it before charging or leasing anything: served here instead (issue 42, 7).
            Ok(resp)
                if resp.status_code() == 421
                    && resp.headers().has(HOP_REFUSED_HEADER).unwrap_or(false) =>
            {
                worker::console_error!(
                    "regional Worker for {} cannot read this edge's hop context (version {HOP_VERSION}): serving from the edge",
                    self.region
                );
                None
            }
            Ok(resp) => {
                let header = |name: &str| resp.headers().get(name).ok().flatten();
                let back = header(HOP_CARD_HEADER)
                    .and_then(|v| unhex(&v))
                    .and_then(|json| serde_json::from_slice::<CardBack>(&json).ok());
                if let (true, Some(pool)) = (resp.status_code() < 300, header("x-gateway-pool")) {
                    match &back {
                        // The send counts against the pool until a newer card covers it, and the
                        // card is the freshest this edge has of the pool.
                        Some(b) => {
                            regions::fresh_card(&pool, &b.card);
                            let now = crate::platform::http::now_ms();
                            regions::served(env, &pool, Some(&b.card), features, b.lease_id, now);
                        }
                        None => regions::record_home(env, &pool, features),
                    }
                }
                Some(without_card(resp))
            }
            // The client left: the regional side saw the same abort and settles what it took.
            Err(_) if client.inner().signal().aborted() => Some(Err(ApiError::client_closed())),
            Err(e) => {
                worker::console_error!("regional hop failed, serving from the edge: {e}");
                None
            }
        }
    }

    /// Sends the request to the regional Worker and returns its response, streaming. An `Err`
    /// means the regional Worker never answered (the caller may serve the request itself).
    pub async fn forward(&self, h: Handoff<'_>) -> worker::Result<Response> {
        let context = HopContext {
            version: HOP_VERSION,
            pools: h.plan.pools.clone(),
            reason: h.plan.reason.as_str().to_string(),
            predicted_ms: h.plan.predicted_ms,
            anchor_ms: h.plan.anchor_ms,
            allowed: h.plan.allowed.clone(),
            excluded: h.plan.excluded,
            client_region: h.plan.client_region.clone(),
            region: self.region.clone(),
            who: h.who.clone(),
            reservation: None,
            // The edge's rate-limit decision, signed when the Workers share a secret.
            charge: h.charge.map(|mut c| {
                c.sig = hop_secret(h.env).map(|s| c.signature(&s));
                c
            }),
            strip_usage_event: h.strip_usage_event,
        };
        let json = serde_json::to_vec(&context).map_err(|e| worker::Error::from(e.to_string()))?;
        let headers = Headers::new();
        for (k, v) in h.client.headers().entries() {
            if !withheld(&k) {
                headers.append(&k, &v)?;
            }
        }
        headers.set(HOP_HEADER, &hex(&json))?;
        if let Some(secret) = hop_secret(h.env) {
            headers.set(HOP_AUTH_HEADER, &secret)?;
        }
        headers.set("x-request-id", h.request_id)?;
        let init = web_sys::RequestInit::new();
        init.set_method("POST");
        init.set_headers(&headers.0);
        init.set_body(&js_sys::Uint8Array::from(h.body));
        // A hang-up at the edge aborts the hop, and so reaches the regional Worker's request.
        init.set_signal(Some(&h.client.inner().signal()));
        let url = h.client.url()?;
        let request = web_sys::Request::new_with_str_and_init(url.as_str(), &init)?;
        // The modelled network: one round trip from the client's region to the pool's.
        let simulating = regions::simulating(h.env);
        let mut edge_waits = 0u32;
        if let Some(first) = h.plan.pools.first() {
            let rtt = regions::simulated_rtt_ms(h.env, h.plan.client_region.as_deref(), first);
            if rtt > 0 {
                edge_waits += 1;
                worker::Delay::from(std::time::Duration::from_millis(rtt)).await;
            }
        }
        let resp = self.fetcher.fetch_request(Request::from(request)).await?;
        if !simulating {
            return Ok(resp);
        }
        // Responses from a binding have immutable headers: copy them to count the edge's wait.
        let copied = copy_headers(&resp, |_| true)?;
        let regional: u32 = copied
            .get(SIMULATED_WAITS_HEADER)?
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        copied.set(SIMULATED_WAITS_HEADER, &(regional + edge_waits).to_string())?;
        Ok(resp.with_headers(copied))
    }
}

/// `resp`'s headers that `keep` keeps, in a new (mutable) list.
fn copy_headers(resp: &Response, keep: impl Fn(&str) -> bool) -> worker::Result<Headers> {
    let copied = Headers::new();
    for (k, v) in resp.headers().entries() {
        if keep(&k) {
            copied.append(&k, &v)?;
        }
    }
    Ok(copied)
}

/// The regional Worker's response without [`HOP_CARD_HEADER`] (the client never sees it).
fn without_card(resp: Response) -> Result<Response, ApiError> {
    if !resp.headers().has(HOP_CARD_HEADER).unwrap_or(false) {
        return Ok(resp);
    }
    let kept = copy_headers(&resp, |name| name != HOP_CARD_HEADER)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(resp.with_headers(kept))
}
