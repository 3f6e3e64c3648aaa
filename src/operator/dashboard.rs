//! `/dashboard`: the operators' live view, a static page bundled into the Worker.
//!
//! The page (HTML, JS and CSS under `src/operator/dashboard/`, embedded at compile time) holds no
//! data and loads nothing from elsewhere: it asks for the admin token once, keeps it in the tab's
//! session storage, and reads the admin API (`/admin/pools`, `/admin/backends`,
//! `/admin/pools/{pool}/history`) with it as a bearer token, refreshing every few seconds. Its
//! actions (drain, undrain, probe now) are the same admin calls. So serving it needs no
//! authentication, and the admin API's checks are the only ones.
//!
//! Every answer carries a strict Content-Security-Policy (same-origin scripts, styles and fetches
//! only; no inline code; no framing), on top of the page inserting every string as text.

use coordinator_protocol::ApiError;
use worker::{Method, Response};

const INDEX_HTML: &str = include_str!("dashboard/index.html");
const APP_JS: &str = include_str!("dashboard/app.js");
const APP_CSS: &str = include_str!("dashboard/app.css");

/// The policy every dashboard answer carries.
const CONTENT_SECURITY_POLICY: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
     connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The asset at `rest` (the path after `/dashboard`), if there is one.
fn asset(rest: &[&str]) -> Option<(&'static str, &'static str)> {
    match rest {
        [] | [""] | ["index.html"] => Some((INDEX_HTML, "text/html; charset=utf-8")),
        ["app.js"] => Some((APP_JS, "text/javascript; charset=utf-8")),
        ["app.css"] => Some((APP_CSS, "text/css; charset=utf-8")),
        _ => None,
    }
}

/// Serves `GET /dashboard` and its assets.
pub fn serve(method: &Method, path: &str, rest: &[&str]) -> Result<Response, ApiError> {
    if !matches!(method, Method::Get | Method::Head) {
        return Err(ApiError::method_not_allowed(method.as_ref(), path));
    }
    let (body, content_type) =
        asset(rest).ok_or_else(|| ApiError::not_found(format!("Unknown route {path}.")))?;
    let mut resp = Response::ok(body)?;
    let headers = resp.headers_mut();
    for (name, value) in [
        ("content-type", content_type),
        ("content-security-policy", CONTENT_SECURITY_POLICY),
        ("x-content-type-options", "nosniff"),
        ("referrer-policy", "no-referrer"),
        ("x-frame-options", "DENY"),
        // The assets change only with a deploy; revalidating each load keeps them in step.
        ("cache-control", "no-cache"),
    ] {
        headers.set(name, value)?;
    }
    Ok(resp)
}
