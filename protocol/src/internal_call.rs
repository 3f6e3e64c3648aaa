//! The one way an internal call is put on the wire: the request of a [`Route`], with the pool and
//! shard headers of a pool coordinator call and a JSON body. The Worker uses it for every Durable
//! Object call, and pool shards use it to call their siblings.
//!
//! The request is built as a plain `web_sys::Request` ([`internal_web_request`]): the Worker's
//! hot path sends it as is; [`internal_request`] wraps it for `worker::Stub::fetch_with_request`.

use crate::messages::{POOL_HEADER, SHARD_HEADER};
use crate::{HttpMethod, Route};
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

fn method(m: HttpMethod) -> &'static str {
    match m {
        HttpMethod::Get => "GET",
        HttpMethod::Post => "POST",
        HttpMethod::Put => "PUT",
        HttpMethod::Patch => "PATCH",
        HttpMethod::Delete => "DELETE",
    }
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
    let headers = web_sys::Headers::new()?;
    if let Some(to) = to {
        headers.set(POOL_HEADER, to.pool)?;
        if to.shard != 0 {
            headers.set(SHARD_HEADER, &to.shard.to_string())?;
        }
    }
    let init = web_sys::RequestInit::new();
    init.set_method(method(route.method()));
    if let Some(body) = body {
        headers.set("content-type", "application/json")?;
        init.set_body(&JsValue::from_str(&body));
    }
    init.set_headers(&headers);
    Ok(web_sys::Request::new_with_str_and_init(
        &route.url(),
        &init,
    )?)
}
