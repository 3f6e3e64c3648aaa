//! What every part of the Worker stands on: one typed call for every Durable Object
//! (`do_client.rs`), small HTTP helpers with the clock and a request's deadlines (`http.rs`), the
//! settings read once per isolate (`settings.rs`), the bearer-token checks and key hashes
//! (`auth.rs`), and the isolate's memory: every cache kept between requests (`isolate.rs`).

pub mod auth;
pub mod do_client;
pub mod http;
pub mod isolate;
pub mod settings;
