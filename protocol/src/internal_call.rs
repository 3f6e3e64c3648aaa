//! The one way an internal call is put on the wire: the `worker::Request` of a [`Route`], with
//! the pool and shard headers of a pool coordinator call and a JSON body. The Worker uses it for
//! every Durable Object call, and pool shards use it to call their siblings.

use crate::messages::{POOL_HEADER, SHARD_HEADER};
use crate::{HttpMethod, Route};
use worker::{Headers, Method, Request, RequestInit};

/// Which pool coordinator shard a call is for.
#[derive(Debug, Clone, Copy)]
pub struct ShardAddress<'a> {
    /// The pool's name.
    pub pool: &'a str,
    /// The shard's index (0: the pool's own object).
    pub shard: u32,
}

fn method(m: HttpMethod) -> Method {
    match m {
        HttpMethod::Get => Method::Get,
        HttpMethod::Post => Method::Post,
        HttpMethod::Put => Method::Put,
        HttpMethod::Patch => Method::Patch,
        HttpMethod::Delete => Method::Delete,
    }
}

/// The request of `route`, addressed to a pool shard when `to` names one, carrying `body` (JSON).
pub fn internal_request(
    route: &Route,
    to: Option<ShardAddress<'_>>,
    body: Option<String>,
) -> worker::Result<Request> {
    let headers = Headers::new();
    if let Some(to) = to {
        headers.set(POOL_HEADER, to.pool)?;
        if to.shard != 0 {
            headers.set(SHARD_HEADER, &to.shard.to_string())?;
        }
    }
    let mut init = RequestInit::new();
    init.with_method(method(route.method()));
    if let Some(body) = body {
        headers.set("content-type", "application/json")?;
        init.with_body(Some(body.into()));
    }
    init.with_headers(headers);
    Request::new_with_init(&route.url(), &init)
}
