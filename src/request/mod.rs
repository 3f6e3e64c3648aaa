//! The request path of the completion endpoints, in the order a request takes it: `completion/`
//! (intake: the key, the body, the features, the walk over pools), `context.rs` (the
//! `RequestContext` its stages share), `regions.rs` (the plan: pools ordered on predicted time),
//! `hop.rs` (the hand-over to a regional Worker), `admission.rs` (the lease asked of each pool, the
//! queue waits) and `ahead.rs` (the backend fetch sent beside the lease call); then `forward/`
//! (the proxied answer) and `lease/` (the lease's guard and its releases). `passthrough.rs` holds
//! what differs for vLLM's own routes passed through by model (multipart intake, a route the
//! backend's task lacks). `stored_responses.rs` sends the calls about a stored Responses API
//! response (retrieve, cancel) to the backend holding it.

pub mod admission;
pub mod ahead;
pub mod api_errors;
pub mod completion;
pub mod context;
pub mod forward;
pub mod hop;
pub mod lease;
pub mod passthrough;
pub mod regions;
pub mod stored_responses;
