//! The protocol between the gateway's Worker and its Durable Objects, and the code both sides
//! share.
//!
//! Rust Durable Objects are reached over `stub.fetch`, so every call is an HTTP request to an
//! internal URL. [`Route`] names every call (the Worker builds the URL from it, the object parses
//! it back); [`messages`] and [`acquire`] hold one struct per body and answer; [`call`] pairs
//! each request with its route and its answer ([`call::Call`]) and says how answers travel;
//! [`error`] is the OpenAI-style error both sides answer with, and [`refusal`] words each refusal
//! of a pool in it; [`registration`] holds what a backend registration must be. With the `worker` feature the crate also carries
//! what both sides need of the platform: `ApiError` as a response and from a `worker::Error`, the request of an internal
//! call (`internal_call`), and [`timed_fetch`] (fetches with a deadline, used by probes and by the proxy).

pub mod acquire;
pub mod call;
pub mod error;
#[cfg(feature = "worker")]
pub mod internal_call;
pub mod messages;
pub mod names;
pub mod refusal;
pub mod registration;
pub mod route;
pub mod settings;
#[cfg(feature = "worker")]
pub mod timed_fetch;

pub use call::{Answer, Call};
pub use error::ApiError;
pub use route::{HttpMethod, Object, Route, RouteError, INTERNAL_ORIGIN};
