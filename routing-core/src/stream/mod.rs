//! An answer as it streams from a backend and how it ends.
//!
//! `usage` reads the token counts a backend reports, from a whole body or from a passing SSE
//! stream; `resume/` decides whether a stream that broke after its first byte can be continued on
//! another backend and splices the continuation in; `outcome` is how the request ended, as the
//! Worker reports it when it releases the lease (and what the backend's breaker and time model
//! learn from); `settle` is what a request's end charges its client's token reservation. These
//! files build on [`crate::request`] only.

pub mod api_events;
pub mod outcome;
pub mod resume;
pub mod settle;
pub mod usage;
