//! Small request-path helpers every handler shares: the request id, the clock and a request's
//! deadlines on one timer ([`Deadlines`]), headers made in one call ([`HeaderList`]), random and
//! hex ids, the environment's vars, and reading (or discarding) a request body within a size
//! limit.
//!
//! Nothing here knows a route, a pool or a key: the modules above it (`lib.rs`'s handlers, the
//! admin API, the keys, the settings) call it, and it calls none of them.

use coordinator_protocol::ApiError;
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::Duration;
use wasm_bindgen::closure::Closure;
use wasm_bindgen::prelude::wasm_bindgen;
use wasm_bindgen::{JsCast, JsValue};
use worker::{Env, Request};

/// The client's `x-request-id` when it is safe to echo (printable ASCII, no separators that
/// could split a header or a log line), otherwise a fresh one.
pub fn request_id(req: &Request) -> String {
    let given = req.headers().get("x-request-id").ok().flatten();
    match given {
        Some(id)
            if !id.is_empty()
                && id.len() <= 128
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:@/+=".contains(&b)) =>
        {
            id
        }
        _ => "req-".to_string() + &random_hex(12),
    }
}

/// The platform's clock in milliseconds since the epoch: `Date.now()` itself, without the `Date`
/// object `worker::Date::now()` makes (a request reads the clock a few dozen times, once per
/// streamed chunk among them).
pub fn now_ms() -> u64 {
    js_sys::Date::now() as u64
}

/// `n` random bytes from the platform's CSPRNG, hex-encoded.
pub fn random_hex(n: usize) -> String {
    thread_local! {
        // The global `crypto`, looked up once per isolate: the one static of the isolate not in
        // `isolate.rs`, which imports the settings, which import this file.
        static CRYPTO: Option<web_sys::Crypto> = js_sys::Reflect::get(&js_sys::global(), &"crypto".into())
            .ok()
            .and_then(|c| c.dyn_into::<web_sys::Crypto>().ok());
    }
    let mut bytes = vec![0u8; n];
    let filled = CRYPTO.with(|c| {
        c.as_ref()
            .is_some_and(|c| c.get_random_values_with_u8_array(&mut bytes).is_ok())
    });
    if !filled {
        // workerd always has crypto; this only keeps ids unique if it somehow does not.
        let t = (now_ms() ^ (js_sys::Math::random() * 1e15) as u64).to_le_bytes();
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = t[i % 8].wrapping_add(i as u8);
        }
    }
    hex(&bytes)
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(2 * bytes.len());
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    out
}

/// Bytes of a lower-case hex string, or `None` if it is not one.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    b.chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

/// A `wrangler.toml` var parsed as `T`, or `default` when unset or unparsable.
pub fn var_or<T: std::str::FromStr>(env: &Env, name: &str, default: T) -> T {
    env.var(name)
        .ok()
        .and_then(|v| v.to_string().parse().ok())
        .unwrap_or(default)
}

/// A `wrangler.toml` var holding JSON, parsed as `T`, or `T::default()` when unset or unparsable.
pub fn json_var_or_default<T: serde::de::DeserializeOwned + Default>(env: &Env, name: &str) -> T {
    env.var(name)
        .ok()
        .and_then(|v| serde_json::from_str(&v.to_string()).ok())
        .unwrap_or_default()
}

/// Reads the body, refusing it (413) past `limit` bytes (declared or actual). At most `limit`
/// bytes ever enter wasm; an oversize body is drained on the JS side (for a few seconds at most)
/// before the 413, so the client, still sending, reads the answer instead of a reset connection.
pub async fn read_body_limited(req: &mut Request, limit: usize) -> Result<Vec<u8>, ApiError> {
    use futures_util::StreamExt;
    let declared: Option<usize> = req
        .headers()
        .get("content-length")
        .ok()
        .flatten()
        .and_then(|v| v.parse().ok());
    if declared.is_some_and(|n| n > limit) {
        discard_body(req).await;
        return Err(ApiError::payload_too_large(limit));
    }
    // A body of declared length (framed by it, so it cannot grow) is read in one call.
    let chunked = req.headers().has("transfer-encoding").unwrap_or(true);
    if declared.is_some() && !chunked {
        let unreadable = |_| ApiError::bad_request("unreadable request body");
        let read = req.inner().array_buffer().map_err(unreadable)?;
        let buffer = wasm_bindgen_futures::JsFuture::from(read)
            .await
            .map_err(unreadable)?;
        let bytes = js_sys::Uint8Array::new(&buffer);
        if bytes.length() as usize > limit {
            return Err(ApiError::payload_too_large(limit));
        }
        return Ok(bytes.to_vec());
    }
    let mut body = Vec::with_capacity(declared.unwrap_or(0).min(limit));
    let Ok(mut stream) = req.stream() else {
        return Ok(body);
    };
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|_| ApiError::bad_request("unreadable request body"))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::payload_too_large(limit));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Reads and drops the request body in JS (no wasm copies), for at most 5 seconds.
async fn discard_body(req: &Request) {
    let (Some(body), Ok(sink)) = (req.inner().body(), web_sys::WritableStream::new()) else {
        return;
    };
    let drained = wasm_bindgen_futures::JsFuture::from(body.pipe_to(&sink));
    let _ =
        coordinator_protocol::timed_fetch::with_timeout(drained, std::time::Duration::from_secs(5))
            .await;
}

/// The deadlines of one request (its lease call's limit, the lease's renewals, the first byte's
/// deadline, the stream's watchdog), all on one platform timer at a time instead of a timer (and
/// a callback) each: the timer is set for the earliest deadline waited on, but never more than
/// [`MAX_TIMER_MS`] ahead, so a deadline made later for a later time (they are made in the
/// opposite order of their lengths: the lease call's 65 s, the first byte's, the renewal's, the
/// watchdog's) finds it set early enough and sets nothing. One that is no longer waited on (the
/// call answered, the first byte came) leaves it set; when it fires for nobody it is set again
/// for the next. So a short request sets one timer, and a long one one a second at most. Clones
/// share the timer; it is cleared when the last clone and the last [`Sleep`] are gone. A timer
/// belongs to its request, so each request has its own.
#[derive(Clone)]
pub struct Deadlines(Rc<RefCell<Timer>>);

/// The furthest ahead the timer of [`Deadlines`] is set (shorter deadlines are kept exactly).
pub const MAX_TIMER_MS: u64 = 1_000;

struct Timer {
    /// The sleeps waited on: id, when due (ms), and the task to wake.
    waiting: Vec<(u64, u64, Option<Waker>)>,
    /// The platform timer set: its handle and when it fires.
    set: Option<(i32, u64)>,
    /// Every deadline up to this time has passed (the last time the timer fired).
    passed_ms: u64,
    next_id: u64,
    /// The timer's callback, made at the first use.
    callback: Option<Closure<dyn FnMut()>>,
}

impl Deadlines {
    /// Deadlines with no timer set yet.
    pub fn new() -> Deadlines {
        Deadlines(Rc::new(RefCell::new(Timer {
            waiting: Vec::new(),
            set: None,
            passed_ms: 0,
            next_id: 0,
            callback: None,
        })))
    }

    /// A future that resolves `after` from now (as `worker::Delay` does).
    pub fn sleep(&self, after: Duration) -> Sleep {
        Sleep {
            timer: self.0.clone(),
            due_ms: now_ms().saturating_add(after.as_millis() as u64),
            id: None,
        }
    }
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines::new()
    }
}

impl Timer {
    /// Sets the platform timer to fire by `due_ms` (at most [`MAX_TIMER_MS`] from now) unless it
    /// fires by then already.
    fn set_for(&mut self, due_ms: u64, timer: &Rc<RefCell<Timer>>) {
        if self.set.is_some_and(|(_, at)| at <= due_ms) {
            return;
        }
        let now = now_ms();
        let at = due_ms.min(now.saturating_add(MAX_TIMER_MS));
        let global: web_sys::WorkerGlobalScope = js_sys::global().unchecked_into();
        if let Some((handle, _)) = self.set.take() {
            global.clear_timeout_with_handle(handle);
        }
        let callback = self.callback.get_or_insert_with(|| {
            let timer = Rc::downgrade(timer);
            Closure::new(move || fired(&timer))
        });
        let ms = at.saturating_sub(now) as i32;
        if let Ok(handle) = global.set_timeout_with_callback_and_timeout_and_arguments_0(
            callback.as_ref().unchecked_ref(),
            ms,
        ) {
            self.set = Some((handle, at));
        }
    }
}

/// The platform timer fired: wakes every sleep now due, and sets the timer for the next one.
fn fired(timer: &Weak<RefCell<Timer>>) {
    let Some(timer) = timer.upgrade() else {
        return;
    };
    let wake: Vec<Waker> = {
        let mut t = timer.borrow_mut();
        let due = t.set.take().map_or(0, |(_, at)| at);
        t.passed_ms = t.passed_ms.max(due).max(now_ms());
        let passed = t.passed_ms;
        let wake = t
            .waiting
            .iter_mut()
            .filter(|(_, at, _)| *at <= passed)
            .filter_map(|(_, _, w)| w.take())
            .collect();
        if let Some(next) = t
            .waiting
            .iter()
            .map(|(_, at, _)| *at)
            .filter(|at| *at > passed)
            .min()
        {
            t.set_for(next, &timer);
        }
        wake
    };
    for w in wake {
        w.wake();
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some((handle, _)) = self.set.take() {
            let global: web_sys::WorkerGlobalScope = js_sys::global().unchecked_into();
            global.clear_timeout_with_handle(handle);
        }
    }
}

/// A wait until a deadline of [`Deadlines`].
pub struct Sleep {
    timer: Rc<RefCell<Timer>>,
    due_ms: u64,
    /// Its place among the waiting, once polled.
    id: Option<u64>,
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<()> {
        let this = &mut *self;
        let mut t = this.timer.borrow_mut();
        if t.passed_ms >= this.due_ms || now_ms() >= this.due_ms {
            if let Some(id) = this.id.take() {
                t.waiting.retain(|(i, _, _)| *i != id);
            }
            return Poll::Ready(());
        }
        match this.id {
            Some(id) => {
                if let Some(entry) = t.waiting.iter_mut().find(|(i, _, _)| *i == id) {
                    entry.2 = Some(cx.waker().clone());
                }
            }
            None => {
                let id = t.next_id;
                t.next_id += 1;
                t.waiting.push((id, this.due_ms, Some(cx.waker().clone())));
                this.id = Some(id);
            }
        }
        t.set_for(this.due_ms, &this.timer);
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            if let Ok(mut t) = self.timer.try_borrow_mut() {
                t.waiting.retain(|(i, _, _)| *i != id);
            }
        }
    }
}

#[wasm_bindgen(inline_js = r#"
export function headers_of(text) {
  const headers = new Headers();
  const parts = text.split("\0");
  for (let i = 0; i + 1 < parts.length; i += 2) headers.set(parts[i], parts[i + 1]);
  return headers;
}
"#)]
extern "C" {
    #[wasm_bindgen(catch)]
    fn headers_of(text: &str) -> Result<web_sys::Headers, JsValue>;
}

/// Header names and values collected in Rust and made into the platform's `Headers` in one call
/// ([`HeaderList::build`]), instead of a call (and two strings passed) per header: the upstream
/// request's and the client response's, a dozen each on the request path. Each is set in order
/// (a name set twice keeps its last value), as `Headers::set` would.
#[derive(Default)]
pub struct HeaderList {
    text: String,
    /// A name or value no header can hold (a NUL), refused at [`HeaderList::build`] as the
    /// platform refuses it.
    invalid: bool,
}

impl HeaderList {
    /// No headers yet.
    pub fn new() -> HeaderList {
        HeaderList::default()
    }

    /// Sets header `name` to `value`.
    pub fn set(&mut self, name: &str, value: &str) {
        if name.contains('\0') || value.contains('\0') {
            self.invalid = true;
            return;
        }
        self.text.push_str(name);
        self.text.push('\0');
        self.text.push_str(value);
        self.text.push('\0');
    }

    /// The platform's `Headers` (its error when a name or value is not a header's).
    pub fn build(&self) -> Result<web_sys::Headers, JsValue> {
        if self.invalid {
            return Err(js_sys::TypeError::new("Invalid header name or value").into());
        }
        headers_of(&self.text)
    }
}
