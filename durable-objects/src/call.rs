//! The HTTP side of an internal call, shared by the Durable Objects: the route it names, its JSON
//! body, the JSON answer. The handlers themselves only see typed routes and messages.

use coordinator_protocol::{ApiError, Object, Route, RouteError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use worker::{Request, Response};

/// The route of an internal call, if it is one `object` serves.
pub fn parse_route(req: &Request, object: Object) -> Result<Route, ApiError> {
    // The raw URL, split by hand: parsing it with the `url` crate (as `Request::url` does) cost
    // about 30 us of wasm per call, a tenth of a cheap call's whole cost. Internal calls' URLs are
    // built by `coordinator_protocol::internal_call`, already in normal form.
    let raw = req.inner().url();
    let (path, query) = path_and_query(&raw);
    match Route::parse(req.method().as_ref(), path, query) {
        Ok(route) if route.object() == object => Ok(route),
        Ok(_) | Err(RouteError::NotFound) => {
            Err(ApiError::not_found(format!("no route {path} here")))
        }
        Err(RouteError::MethodNotAllowed) => {
            Err(ApiError::method_not_allowed(req.method().as_ref(), path))
        }
    }
}

/// The path (at least `/`) and the query of an absolute URL, without its fragment.
fn path_and_query(raw: &str) -> (&str, Option<&str>) {
    let raw = raw.split_once('#').map_or(raw, |(before, _)| before);
    let after_scheme = raw.split_once("://").map_or(raw, |(_, rest)| rest);
    let rest = match after_scheme.find(['/', '?']) {
        Some(i) => &after_scheme[i..],
        None => "",
    };
    let (path, query) = match rest.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (rest, None),
    };
    (if path.is_empty() { "/" } else { path }, query)
}

/// Reads a call's JSON body as `T` (400 naming `what` when it is not one).
pub async fn read_body<T: DeserializeOwned>(req: &mut Request, what: &str) -> Result<T, ApiError> {
    let text = req
        .text()
        .await
        .map_err(|_| ApiError::bad_request("request body is not valid UTF-8"))?;
    serde_json::from_str(&text).map_err(|e| ApiError::invalid_body(what, e))
}

/// A JSON answer with `status`.
pub fn answer<T: Serialize>(status: u16, value: &T) -> Result<Response, ApiError> {
    Ok(Response::from_json(value)?.with_status(status))
}

#[cfg(test)]
mod tests {
    use super::path_and_query;

    #[test]
    fn splits_like_a_url_parser() {
        for (raw, want) in [
            (
                "https://pool/acquire?spill_ok=true",
                ("/acquire", Some("spill_ok=true")),
            ),
            ("https://pool/backends/gpu-1", ("/backends/gpu-1", None)),
            ("https://pool", ("/", None)),
            ("https://pool?x=1", ("/", Some("x=1"))),
            (
                "https://pool:8443/a/b?c=d&e=f#frag",
                ("/a/b", Some("c=d&e=f")),
            ),
            ("http://127.0.0.1/release", ("/release", None)),
        ] {
            assert_eq!(path_and_query(raw), want, "{raw}");
            let parsed = worker::Url::parse(raw).unwrap();
            assert_eq!((parsed.path(), parsed.query()), want, "{raw} (url crate)");
        }
    }
}
