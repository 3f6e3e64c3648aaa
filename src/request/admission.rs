//! The Worker's half of admission control: who is asking and how urgently, and waiting in a
//! pool's queue.
//!
//! The tenant is the client key (a minted key's id, or a `CLIENT_API_KEYS` key's hash prefix),
//! else the `x-tenant-id` header, else the client's address: `ip-` and 16 hex digits of
//! SHA-256(salt, `cf-connecting-ip`), so keyless clients share fairly by address while the address
//! itself is never kept, logged or shown (the salt is the `TENANT_SALT` secret; without it, a
//! random salt per isolate, which tells addresses apart within an isolate but not across them);
//! `anonymous` only when no address is known. The priority is the key's configured
//! `priority`; `x-gateway-priority` may lower it, or set it when the client has no key.
//! `x-gateway-max-wait-ms` may shorten the pool's `max_wait_ms`.
//!
//! Waiting: the pool's Durable Object holds an acquire call open while the request waits, for at
//! most its `poll_ms`, then answers with a ticket (`AcquireAnswer::Queued`); this side asks again at once with the
//! ticket and the time already waited. If the Durable Object fails or restarts mid-call, the next
//! call re-enters the queue with that ticket and time (so the deadline holds); after a few failed
//! calls in a row the client gets a clean 503. If the client's request signal aborts (a hang-up,
//! as the platform reports it), the wait is abandoned and the pool told at once, under the wait's
//! own id (chosen here before the first call, and the ticket the pool files it under): so a
//! hang-up before any answer, or while a grant is on its way back, releases that grant's lease at
//! once instead of after `lease_ttl_ms`. A grant whose answer was lost (the call failed or hit its
//! limit) never holds a lease beside the request's next one: asking again with the ticket, the
//! pool releases it first (`routing_core::coordinator::waiting`), and giving up on the pool names
//! the wait in a dequeue.

use crate::clients::keys::ClientKey;
use crate::platform::do_client::{answer_of, call, send, To};
use coordinator_protocol::acquire::{Acquire, AcquireAnswer, AcquireBody, Granted};
use coordinator_protocol::messages::DequeueRequest;
use coordinator_protocol::ApiError;
use futures_util::future::{select, Either};
use routing_core::admission::{AdmissionRequest, MAX_TICKET, PRIORITY_RANGE};
use routing_core::pool::Refusal;
use std::time::Duration;
use wasm_bindgen::JsValue;
use wasm_bindgen_futures::JsFuture;
use worker::{Context, Env, Request};

/// Longest accepted `x-gateway-max-wait-ms`.
const MAX_WAIT_HEADER_MS: u64 = 3_600_000;
/// A call to the pool longer than this failed (the pool answers within its `poll_ms`, at most 60 s).
const CALL_LIMIT: Duration = Duration::from_secs(65);
/// Failed calls in a row after which a queued request gives up with 503.
const MAX_CALL_FAILURES: u32 = 3;

/// A priority outside [`PRIORITY_RANGE`] is a 400.
pub fn validate_priority(p: i32) -> Result<(), ApiError> {
    if (PRIORITY_RANGE.0..=PRIORITY_RANGE.1).contains(&p) {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "priority must be an integer from {} to {}",
            PRIORITY_RANGE.0, PRIORITY_RANGE.1
        ))
        .with_code("invalid_priority")
        .with_param("priority"))
    }
}

/// The salt of keyless tenants' address hashes: the `TENANT_SALT` secret, else a random one per
/// isolate.
/// Read once per isolate (an isolate's bindings do not change while it lives).
pub fn tenant_salt(env: &Env) -> std::rc::Rc<str> {
    crate::platform::isolate::with_tenant_salt(|s| {
        s.get_or_init(|| {
            let configured = env
                .secret("TENANT_SALT")
                .map(|s| s.to_string())
                .or_else(|_| env.var("TENANT_SALT").map(|s| s.to_string()))
                .ok()
                .filter(|s| !s.is_empty());
            configured
                .unwrap_or_else(|| {
                    format!("{:016x}", (js_sys::Math::random() * 2f64.powi(53)) as u64)
                })
                .into()
        })
        .clone()
    })
}

/// A keyless client's tenant, from its address: never the address itself.
fn address_tenant(salt: &str, address: &str) -> String {
    let digest = crate::platform::auth::hash_key(&format!("{salt}\n{address}"));
    format!("ip-{}", &digest[..16])
}

/// The admission part of an acquire: tenant, priority and wait limit of this request
/// (`salt`: [`tenant_salt`]).
pub fn admission_request(
    req: &Request,
    key: Option<&ClientKey>,
    salt: &str,
) -> Result<AdmissionRequest, ApiError> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .ok()
            .flatten()
            .map(|v| v.trim().to_string())
    };
    let asked = match header("x-gateway-priority") {
        None => None,
        Some(v) => {
            let p: i32 = v.parse().map_err(|_| {
                ApiError::bad_request("x-gateway-priority must be an integer")
                    .with_code("invalid_priority")
            })?;
            validate_priority(p)?;
            Some(p)
        }
    };
    let (tenant, priority) = match key {
        // A header may lower a key's priority, never raise it.
        Some(k) => (
            k.tenant.clone(),
            asked.map_or(k.priority, |p| p.min(k.priority)),
        ),
        None => (
            header("x-tenant-id")
                .map(|t| tenant_name(&t))
                .or_else(|| {
                    header("cf-connecting-ip")
                        .filter(|a| !a.is_empty())
                        .map(|a| address_tenant(salt, &a))
                })
                .unwrap_or_else(|| "anonymous".to_string()),
            asked.unwrap_or(0),
        ),
    };
    let max_wait_ms = match header("x-gateway-max-wait-ms") {
        None => None,
        Some(v) => Some(
            v.parse::<u64>()
                .ok()
                .filter(|&ms| ms <= MAX_WAIT_HEADER_MS)
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "x-gateway-max-wait-ms must be an integer from 0 to 3600000",
                    )
                    .with_code("invalid_max_wait")
                })?,
        ),
    };
    Ok(AdmissionRequest {
        tenant,
        priority,
        max_wait_ms,
        ticket: None,
        waited_ms: 0,
        wait_id: None,
    })
}

/// `x-tenant-id` as a tenant name: itself when it is 1-128 visible ASCII characters, else a hash
/// of it (so odd values still name one tenant, and nothing unprintable reaches a log).
fn tenant_name(value: &str) -> String {
    if !value.is_empty() && value.len() <= 128 && value.bytes().all(|b| b.is_ascii_graphic()) {
        value.to_string()
    } else {
        format!("h-{}", &crate::platform::auth::hash_key(value)[..16])
    }
}

/// How asking a pool for a lease ended.
pub enum Asked {
    /// A lease, and how long the request waited in the pool's queue for it.
    Granted(Granted),
    /// The pool refused (a refusal of its own, or its queue stopped answering).
    Refused(Refusal),
    /// The client hung up (the pool has been told).
    HungUp,
    /// The pool's object failed, or did not answer in time.
    Failed(ApiError),
}

/// Asks shard `shard` of `pool` for a lease (`spill_ok`: a further pool could take the request),
/// waiting in its queue while it answers with a ticket. `body` holds the request's features,
/// serialised once; `on_queued` runs when the pool first queues the request.
#[allow(clippy::too_many_arguments)]
pub async fn acquire(
    env: &Env,
    ctx: &Context,
    hung_up: &js_sys::Promise,
    pool: &str,
    shard: u32,
    spill_ok: bool,
    body: &AcquireBody,
    who: &AdmissionRequest,
    deadlines: &crate::platform::http::Deadlines,
    on_queued: &dyn Fn(),
) -> Asked {
    let started = crate::platform::http::now_ms();
    let mut who = who.clone();
    // This wait's own id, so a dequeue can name it before the pool answered anything.
    let wait_id = ((js_sys::Math::random() * 2f64.powi(53)) as u64 & MAX_TICKET).max(1);
    who.wait_id = Some(wait_id);
    let mut failures = 0;
    let mut gone = JsFuture::from(hung_up.clone());
    // Made at the first ticket, once the request holds one between calls.
    let mut keep_alive: Option<KeepAlive> = None;
    loop {
        let msg = Acquire {
            body,
            admission: Some(&who),
            spill_ok,
        };
        let sent = Box::pin(send(env, To::Pool(pool, shard), &msg));
        let limit = deadlines.sleep(CALL_LIMIT);
        let answer = match select(sent, select(&mut gone, limit)).await {
            Either::Left((answer, _)) => Some(answer),
            Either::Right((Either::Left(_), _)) => {
                // Tell the pool at once, even before any answer (a grant may be on its way back).
                give_up(ctx, env, (pool, shard), who.ticket.unwrap_or(wait_id));
                return Asked::HungUp;
            }
            Either::Right((Either::Right(_), _)) => None,
        };
        match answer {
            Some(Ok(resp)) => match answer_of::<AcquireAnswer>(resp).await {
                Ok(AcquireAnswer::Granted(granted)) => return Asked::Granted(granted),
                Ok(AcquireAnswer::Queued(queued)) => {
                    if who.ticket.is_none() {
                        on_queued();
                    }
                    who.ticket = Some(queued.ticket);
                    failures = 0;
                    keep_alive.get_or_insert_with(|| KeepAlive::new(ctx));
                }
                Ok(AcquireAnswer::Refused(refusal)) => return Asked::Refused(refusal),
                Err(e) => {
                    // An answer this side cannot read may have been a grant: its lease goes back.
                    give_up(ctx, env, (pool, shard), who.ticket.unwrap_or(wait_id));
                    return Asked::Failed(e);
                }
            },
            // The pool failed or restarted mid-call, or the call hit its limit: a grant may have
            // been answered and lost on the way (issue 42, item 8). A queued request asks again
            // with its ticket, and the pool releases a lease answered under it before trying the
            // request again; a request that gives up on the pool names its wait in a dequeue, so
            // such a lease goes back at once instead of after `lease_ttl_ms`.
            failed => {
                let Some(ticket) = who.ticket else {
                    give_up(ctx, env, (pool, shard), wait_id);
                    return Asked::Failed(failed.and_then(|r| r.err()).unwrap_or_else(|| {
                        ApiError::gateway_timeout("The pool did not answer in time.")
                    }));
                };
                failures += 1;
                if failures >= MAX_CALL_FAILURES {
                    give_up(ctx, env, (pool, shard), ticket);
                    return Asked::Refused(Refusal::QueueUnavailable);
                }
            }
        }
        who.waited_ms = crate::platform::http::now_ms().saturating_sub(started);
    }
}

/// Tells the pool shard the request gave up on it (its client left, or its calls failed) under
/// `ticket`, the wait's id or ticket: a queued request leaves the queue, and a lease answered under
/// it goes back. In `wait_until`, so the call finishes after the response.
fn give_up(ctx: &Context, env: &Env, (pool, shard): (&str, u32), ticket: u64) {
    let (env, pool) = (env.clone(), pool.to_string());
    ctx.wait_until(async move {
        if let Err(e) = call(&env, To::Pool(&pool, shard), &DequeueRequest { ticket }).await {
            worker::console_error!("pool {pool}: dequeue: {e}");
        }
    });
}

/// Keeps the invocation alive while a request waits in a queue (`wait_until` on a promise settled
/// when this is dropped), so a hang-up is still seen and reported to the pool instead of the
/// invocation being torn down with the ticket still queued.
struct KeepAlive {
    resolve: js_sys::Function,
}

impl KeepAlive {
    fn new(ctx: &Context) -> KeepAlive {
        let mut resolve = None;
        let promise = js_sys::Promise::new(&mut |r, _| resolve = Some(r));
        ctx.wait_until(async move {
            let _ = JsFuture::from(promise).await;
        });
        KeepAlive {
            resolve: resolve.unwrap_or_else(|| js_sys::Function::new_no_args("")),
        }
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        let _ = self.resolve.call0(&JsValue::NULL);
    }
}
