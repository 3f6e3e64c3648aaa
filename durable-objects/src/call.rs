//! The HTTP side of an internal call, shared by the Durable Objects: the route it names, its JSON
//! body, the answer. The handlers themselves only see typed routes and messages, and answer a call
//! with its own answer type ([`reply`]).

use coordinator_protocol::route::path_and_query;
use coordinator_protocol::{Answer, ApiError, Call, Object, Route, RouteError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use worker::{Request, Response};

/// The route of an internal call, if it is one `object` serves.
pub fn parse_route(req: &Request, object: Object) -> Result<Route, ApiError> {
    // The raw URL: `Request::url` would parse it with the `url` crate (see `Route::parse_url`).
    let raw = req.inner().url();
    let path = || path_and_query(&raw).0;
    match Route::parse_url(req.method().as_ref(), &raw) {
        Ok(route) if route.object() == object => Ok(route),
        Ok(_) | Err(RouteError::NotFound) => {
            Err(ApiError::not_found(format!("no route {} here", path())))
        }
        Err(RouteError::MethodNotAllowed) => {
            Err(ApiError::method_not_allowed(req.method().as_ref(), path()))
        }
    }
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
pub fn reply<C: Call>(answer: &C::Answer) -> Result<Response, ApiError> {
    let reply = answer
        .reply()
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(reply.into_response()?)
}

/// A JSON answer with `status`.
pub fn answer<T: Serialize>(status: u16, value: &T) -> Result<Response, ApiError> {
    Ok(Response::from_json(value)?.with_status(status))
}
