//! Outbound fetches with a deadline, for probes and for the proxy's attempts.
//!
//! Workers have no socket timeouts: a fetch to a server that accepted the connection and then
//! went silent waits forever. Each call here races the fetch against a timer and, when the timer
//! wins, aborts the fetch so the connection is closed, not leaked. A caller's own signal (the
//! client's, when it hangs up) aborts it too.

use futures_util::future::{select, Either};
use std::time::Duration;
use wasm_bindgen::{JsCast, JsValue};
use worker::wasm_bindgen_futures::JsFuture;
use worker::{AbortSignal, Delay, Request, Response};

/// How a timed fetch failed.
#[derive(Debug)]
pub enum FetchFailure {
    /// No response within the deadline (the fetch was aborted).
    Timeout,
    /// Connection refused or reset, DNS or TLS failure, or aborted by the caller's signal.
    Transport(String),
}

impl std::fmt::Display for FetchFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FetchFailure::Timeout => write!(f, "timed out"),
            FetchFailure::Transport(e) => write!(f, "{e}"),
        }
    }
}

/// An abort controller whose signal also fires when `parent` does.
pub struct LinkedAbort {
    controller: web_sys::AbortController,
    signal: AbortSignal,
}

impl LinkedAbort {
    /// A controller linked to `parent`, if given.
    pub fn new(parent: Option<&AbortSignal>) -> Self {
        // As `worker::AbortController::default()` does: the platform always has the class.
        let controller = web_sys::AbortController::new().expect("AbortController is available");
        if let Some(parent) = parent {
            follow(parent, &controller);
        }
        let signal = AbortSignal::from(controller.signal());
        LinkedAbort { controller, signal }
    }

    /// The signal to pass to a fetch.
    pub fn signal(&self) -> &AbortSignal {
        &self.signal
    }

    /// Aborts the fetch (and anything else using this signal).
    pub fn abort(self) {
        self.controller.abort();
    }
}

/// Aborts `controller` when `parent` aborts: its own `abort`, bound to it, listens on `parent`
/// (cheaper than `AbortSignal.any`, which makes a third signal that follows both).
fn follow(parent: &web_sys::AbortSignal, controller: &web_sys::AbortController) {
    if parent.aborted() {
        controller.abort();
        return;
    }
    let Ok(abort) = js_sys::Reflect::get(controller, &"abort".into())
        .and_then(|f| f.dyn_into::<js_sys::Function>())
    else {
        return;
    };
    // Bound with an undefined reason, so the event is not taken for one.
    let bound = abort.bind1(controller, &JsValue::UNDEFINED);
    let _ = parent.add_event_listener_with_callback("abort", bound.unchecked_ref());
}

/// Fetches `req`, giving up (and aborting it) after `timeout`.
pub async fn fetch_with_timeout(
    req: Request,
    timeout: Duration,
    parent: Option<&AbortSignal>,
) -> Result<(Response, LinkedAbort), FetchFailure> {
    let abort = LinkedAbort::new(parent);
    let init = web_sys::RequestInit::new();
    init.set_signal(Some(abort.signal()));
    let global: web_sys::WorkerGlobalScope = js_sys::global().unchecked_into();
    let send = global.fetch_with_request_and_init(req.inner(), &init);
    let (resp, abort) = send_until(send, abort, &mut Delay::from(timeout)).await?;
    Ok((resp.into(), abort))
}

/// [`fetch_with_timeout`] of `url` with `init` (method, headers, body), with the platform's own
/// objects and without `worker`'s wrappers (each reads the object's fields back when it is made):
/// the proxy's path. The platform makes the one request object from the URL and `init` (given a
/// request object and an `init` with the signal, `fetch` would make a second one, a copy).
pub async fn fetch_web_with_timeout(
    url: &str,
    init: &web_sys::RequestInit,
    timeout: Duration,
    parent: Option<&AbortSignal>,
) -> Result<(web_sys::Response, LinkedAbort), FetchFailure> {
    fetch_web_until(url, init, &mut Delay::from(timeout), parent).await
}

/// [`fetch_web_with_timeout`] racing a timer the caller owns, which it can go on racing against
/// the body (the proxy's first chunk has the same deadline as the response): one timer, not two.
/// `init` gets the abort signal.
pub async fn fetch_web_until(
    url: &str,
    init: &web_sys::RequestInit,
    deadline: &mut (impl std::future::Future<Output = ()> + Unpin),
    parent: Option<&AbortSignal>,
) -> Result<(web_sys::Response, LinkedAbort), FetchFailure> {
    let (send, abort) = start_web_fetch(url, init, parent);
    send_until(send, abort, deadline).await
}

/// Sends `url` with `init` now (the platform starts the request when `fetch` is called, not when
/// its promise is awaited), with an abort signal linked to `parent`: the fetch and its abort, to
/// wait for with [`send_until`]. `init` gets the signal.
pub fn start_web_fetch(
    url: &str,
    init: &web_sys::RequestInit,
    parent: Option<&AbortSignal>,
) -> (js_sys::Promise, LinkedAbort) {
    let abort = LinkedAbort::new(parent);
    let signal: &web_sys::AbortSignal = abort.signal();
    init.set_signal(Some(signal));
    let global: web_sys::WorkerGlobalScope = js_sys::global().unchecked_into();
    (global.fetch_with_str_and_init(url, init), abort)
}

/// Waits for a fetch sent with `abort`'s signal until `deadline`, aborting it when the deadline
/// wins.
pub async fn send_until(
    send: js_sys::Promise,
    abort: LinkedAbort,
    deadline: &mut (impl std::future::Future<Output = ()> + Unpin),
) -> Result<(web_sys::Response, LinkedAbort), FetchFailure> {
    match select(JsFuture::from(send), deadline).await {
        Either::Left((Ok(resp), _)) => Ok((resp.unchecked_into(), abort)),
        Either::Left((Err(e), _)) => {
            Err(FetchFailure::Transport(worker::Error::from(e).to_string()))
        }
        Either::Right(_) => {
            abort.abort();
            Err(FetchFailure::Timeout)
        }
    }
}

/// Races any future against a timer; `None` when the timer wins.
pub async fn with_timeout<F: std::future::Future>(fut: F, timeout: Duration) -> Option<F::Output> {
    futures_util::pin_mut!(fut);
    match select(fut, Delay::from(timeout)).await {
        Either::Left((v, _)) => Some(v),
        Either::Right(_) => None,
    }
}
