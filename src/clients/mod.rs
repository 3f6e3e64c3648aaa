//! The gateway's clients: `keys.rs` (client keys, their tenant, priority and limits, the
//! reservation of tokens) and `reserving.rs` (the token reservation started beside the first lease
//! call and resolved before the backend is fetched).

pub mod keys;
pub mod reserving;
