//! The wire side of an internal call, shared by the Durable Objects: the route it names, its JSON
//! body, the answer. A call arrives as a request (`fetch`) or, for a pool coordinator, by RPC
//! with the route and body as strings ([`Incoming`]); either way the handlers only see typed
//! routes and messages, and answer with the call's own answer type ([`reply`]) as a `Reply`,
//! which goes back as a response ([`respond`]) or as an RPC answer ([`respond_rpc`]). An object
//! calling another (a shard its siblings, shard 0 the directory) sends the call's own message and
//! reads back its own answer type ([`send`], [`send_body`]).

use coordinator_protocol::call::{read_answer, CallError, Reply};
use coordinator_protocol::internal_call::{internal_request, ShardAddress};
use coordinator_protocol::route::path_and_query;
use coordinator_protocol::{Answer, ApiError, Call, Object, Route, RouteError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use worker::{Request, Response, Stub};

/// A handler's answer: the reply, or the error it answers with.
pub type Answered = Result<Reply, ApiError>;

/// What a call brought besides its route.
pub enum Incoming<'a> {
    /// The platform's request (a `fetch`): its body is read when a handler asks for it.
    Request(&'a mut Request),
    /// An RPC call's body, as the caller serialised it.
    Rpc(Option<String>),
}

impl Incoming<'_> {
    /// Reads the call's JSON body as `T` (400 naming `what` when it is not one).
    pub async fn body<T: DeserializeOwned>(&mut self, what: &str) -> Result<T, ApiError> {
        match self {
            Incoming::Request(req) => read_body(req, what).await,
            Incoming::Rpc(body) => serde_json::from_str(body.as_deref().unwrap_or(""))
                .map_err(|e| ApiError::invalid_body(what, e)),
        }
    }

    /// The request's signal (aborted when the caller goes away; an RPC call has none: its caller
    /// tells the pool itself, with a dequeue).
    pub fn signal(&self) -> Option<web_sys::AbortSignal> {
        match self {
            Incoming::Request(req) => Some(req.inner().signal()),
            Incoming::Rpc(_) => None,
        }
    }
}

/// The route an RPC call names (`method`, `url` as the request would carry them), if `object`
/// serves it.
pub fn parse_rpc_route(method: &str, url: &str, object: Object) -> Result<Route, ApiError> {
    let path = || path_and_query(url).0;
    match Route::parse_url(method, url) {
        Ok(route) if route.object() == object => Ok(route),
        Ok(_) | Err(RouteError::NotFound) => {
            Err(ApiError::not_found(format!("no route {} here", path())))
        }
        Err(RouteError::MethodNotAllowed) => Err(ApiError::method_not_allowed(method, path())),
    }
}

/// A handler's answer as the platform's response.
pub fn respond(answered: Answered) -> worker::Result<Response> {
    answered
        .unwrap_or_else(|e| Reply::error(&e, None))
        .into_response()
}

/// A handler's answer as it goes back over RPC.
pub fn respond_rpc(answered: Answered) -> wasm_bindgen::JsValue {
    answered
        .unwrap_or_else(|e| Reply::error(&e, None))
        .into_rpc()
}

/// The route of an internal call, if it is one `object` serves.
pub fn parse_route(req: &Request, object: Object) -> Result<Route, ApiError> {
    // The raw URL: `Request::url` would parse it with the `url` crate (see `Route::parse_url`).
    parse_rpc_route(req.method().as_ref(), &req.inner().url(), object)
}

/// Reads a call's JSON body as `T` (400 naming `what` when it is not one).
pub async fn read_body<T: DeserializeOwned>(req: &mut Request, what: &str) -> Result<T, ApiError> {
    let text = req
        .text()
        .await
        .map_err(|_| ApiError::bad_request("request body is not valid UTF-8"))?;
    serde_json::from_str(&text).map_err(|e| ApiError::invalid_body(what, e))
}

/// The answer to a call `C`: only `C`'s answer type, sent as it travels (status, headers, body).
pub fn reply<C: Call>(answer: &C::Answer) -> Answered {
    answer
        .reply()
        .map_err(|e| ApiError::internal(e.to_string()))
}

/// A JSON answer with `status`.
pub fn answer<T: Serialize>(status: u16, value: &T) -> Answered {
    Reply::json(status, value).map_err(|e| ApiError::internal(e.to_string()))
}

/// Sends `msg` to another Durable Object (`stub`; `to` names the pool shard when it is one) and
/// reads back `msg`'s own answer, or the error the object answered with.
pub async fn send<M: Call>(
    stub: &Stub,
    to: Option<ShardAddress<'_>>,
    msg: &M,
) -> Result<M::Answer, ApiError> {
    let body = msg.body().map_err(|e| ApiError::internal(e.to_string()))?;
    send_body::<M>(stub, to, &msg.route(), body).await
}

/// [`send`] with `M`'s route and body already made (`M::route` and `M::body`), for a message sent
/// to several objects: it is serialised once.
pub async fn send_body<M: Call>(
    stub: &Stub,
    to: Option<ShardAddress<'_>>,
    route: &Route,
    body: Option<String>,
) -> Result<M::Answer, ApiError> {
    let mut resp = stub
        .fetch_with_request(internal_request(route, to, body)?)
        .await?;
    let status = resp.status_code();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .ok()
        .flatten()
        .and_then(|v| v.parse().ok());
    let text = resp.text().await?;
    read_answer::<M::Answer>(status, retry_after, &text).map_err(|e| match e {
        CallError::Answered(e) => e,
        CallError::Unreadable(detail) => {
            ApiError::internal(format!("{} answered {status}: {detail}", route.path()))
        }
    })
}
