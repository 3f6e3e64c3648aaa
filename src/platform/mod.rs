//! What every part of the Worker stands on: one typed call for every Durable Object
//! (`do_client.rs`), small HTTP helpers with the clock and a request's deadlines (`http.rs`), the
//! settings read once per isolate (`settings.rs`) and the bearer-token checks and key hashes
//! (`auth.rs`).

pub mod auth;
pub mod do_client;
pub mod http;
pub mod settings;
