//! Small request-path helpers every handler shares: the request id, the clock, random and hex ids, the
//! environment's vars, and reading (or discarding) a request body within a size limit.
//!
//! Nothing here knows a route, a pool or a key: the modules above it (`lib.rs`'s handlers, the
//! admin API, the keys, the settings) call it, and it calls none of them.

use coordinator_protocol::ApiError;
use wasm_bindgen::JsCast;
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
        // The global `crypto`, looked up once per isolate.
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
