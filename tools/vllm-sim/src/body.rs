//! Response bodies: a whole body sent at once, a server-sent event stream fed by the engine, or a
//! whole body cut short. One body type serves every route so hyper's service has a single response
//! type; a body that returns an error makes hyper drop the connection (used for simulated
//! disconnects). A cut body announces its full length, so the client sees an incomplete body.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use serde::Serialize;
use tokio::time::Sleep;

use crate::sse::{SseStream, StreamCut};

/// The body of every response the sim sends.
pub enum SimBody {
    /// A complete body (taken when sent).
    Full(Option<Bytes>),
    /// A stream of server-sent events.
    Events(Box<SseStream>),
    /// The first part of a body whose full length was announced, then a dropped connection.
    Truncated(Box<Truncated>),
    /// Server-sent events written by a task (the Responses and Messages streams): each item is
    /// sent as it comes, the end of the channel ends the body.
    Channel(tokio::sync::mpsc::UnboundedReceiver<Bytes>),
}

/// How long a cut body waits after its first part so that part reaches the client before the cut.
const TRUNCATE_GRACE: Duration = Duration::from_millis(30);

/// See [`SimBody::Truncated`].
pub struct Truncated {
    head: Option<Bytes>,
    announced: u64,
    grace: Pin<Box<Sleep>>,
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = StreamCut;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamCut>>> {
        match self.get_mut() {
            SimBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Events(stream) => stream
                .poll_next(cx)
                .map(|next| next.map(|r| r.map(Frame::data))),
            SimBody::Truncated(cut) => {
                if let Some(head) = cut.head.take() {
                    return Poll::Ready(Some(Ok(Frame::data(head))));
                }
                cut.grace.as_mut().poll(cx).map(|()| Some(Err(StreamCut)))
            }
            SimBody::Channel(events) => events
                .poll_recv(cx)
                .map(|next| next.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, SimBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            SimBody::Full(None) => SizeHint::with_exact(0),
            SimBody::Events(_) | SimBody::Channel(_) => SizeHint::default(),
            SimBody::Truncated(cut) => SizeHint::with_exact(cut.announced),
        }
    }
}

/// A response with a complete body.
pub fn full(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<SimBody> {
    let mut response = Response::new(SimBody::Full(Some(body.into())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// A JSON response.
pub fn json(status: StatusCode, value: &impl Serialize) -> Response<SimBody> {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    full(status, "application/json", body)
}

/// An empty response.
pub fn empty(status: StatusCode) -> Response<SimBody> {
    let mut response = Response::new(SimBody::Full(None));
    *response.status_mut() = status;
    response
}

/// `response` with its complete body cut to the first half (at least one byte is left out), its
/// `content-length` still announcing the whole. Streams are returned unchanged.
pub fn truncate(response: Response<SimBody>) -> Response<SimBody> {
    let (parts, body) = response.into_parts();
    let body = match body {
        SimBody::Full(Some(bytes)) if !bytes.is_empty() => {
            let announced = bytes.len() as u64;
            let head = bytes.slice(..bytes.len() / 2);
            SimBody::Truncated(Box::new(Truncated {
                head: (!head.is_empty()).then_some(head),
                announced,
                grace: Box::pin(tokio::time::sleep(TRUNCATE_GRACE)),
            }))
        }
        other => other,
    };
    Response::from_parts(parts, body)
}

/// A streaming `text/event-stream` response.
pub fn event_stream(stream: SseStream) -> Response<SimBody> {
    let mut response = Response::new(SimBody::Events(Box::new(stream)));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    response
}

/// An event-stream response fed by a task through `events` (see [`SimBody::Channel`]).
pub fn channel_stream(events: tokio::sync::mpsc::UnboundedReceiver<Bytes>) -> Response<SimBody> {
    let mut response = Response::new(SimBody::Channel(events));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    response
}
