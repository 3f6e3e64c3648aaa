//! Forwarding a granted request to its backend: `proxy.rs` (the streaming proxy), `attempts.rs`
//! (the calls to the candidates and the retries before the first byte), `upstream_body.rs` (the
//! request body sent upstream and the attempts' failures), `relay.rs` (the stream to the client,
//! usage read on the way) and `resume.rs` (a broken stream continued from the next candidate).

pub mod attempts;
pub mod proxy;
pub mod relay;
pub mod resume;
pub mod upstream_body;
