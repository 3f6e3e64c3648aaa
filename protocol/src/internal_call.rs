//! The one way an internal call is put on the wire: the request of a [`Route`], with the pool and
//! shard headers of a pool coordinator call and a JSON body. The Worker uses it for every Durable
//! Object call, and pool shards use it to call their siblings.
//!
//! The request is built as a plain `web_sys::Request` ([`internal_web_request`]), which
//! [`internal_request`] wraps for `worker::Stub::fetch_with_request`; the Worker's hot path hands
//! the URL and the rest ([`internal_init`]) to the stub's `fetch` as they are.

use crate::messages::{POOL_HEADER, SHARD_HEADER};
use crate::Route;
use wasm_bindgen::JsValue;
use worker::Request;

/// Which pool coordinator shard a call is for.
#[derive(Debug, Clone, Copy)]
pub struct ShardAddress<'a> {
    /// The pool's name.
    pub pool: &'a str,
    /// The shard's index (0: the pool's own object).
    pub shard: u32,
}

/// The request of `route`, addressed to a pool shard when `to` names one, carrying `body` (JSON).
pub fn internal_request(
    route: &Route,
    to: Option<ShardAddress<'_>>,
    body: Option<String>,
) -> worker::Result<Request> {
    Ok(internal_web_request(route, to, body)?.into())
}

/// [`internal_request`] as the platform's own request object, without `worker`'s wrapper (which
/// reads the request's method, URL, headers and `cf` back when it is made).
pub fn internal_web_request(
    route: &Route,
    to: Option<ShardAddress<'_>>,
    body: Option<String>,
) -> worker::Result<web_sys::Request> {
    let (url, init) = internal_init(route, to, body)?;
    Ok(web_sys::Request::new_with_str_and_init(&url, &init)?)
}

/// The URL and the rest of [`internal_web_request`], for a caller that hands both to the stub's
/// `fetch` (which makes the request object itself: given one, it would make a copy of it).
pub fn internal_init(
    route: &Route,
    to: Option<ShardAddress<'_>>,
    body: Option<String>,
) -> worker::Result<(String, web_sys::RequestInit)> {
    let headers = web_sys::Headers::new()?;
    if let Some(to) = to {
        headers.set(POOL_HEADER, to.pool)?;
        if to.shard != 0 {
            headers.set(SHARD_HEADER, &to.shard.to_string())?;
        }
    }
    let init = web_sys::RequestInit::new();
    init.set_method(route.method().as_str());
    if let Some(body) = body {
        headers.set("content-type", "application/json")?;
        init.set_body(&JsValue::from_str(&body));
    }
    init.set_headers(&headers);
    Ok((route.url(), init))
}
