//! What a client request is, as the routing core sees it.
//!
//! `endpoint` names the OpenAI endpoint a request came in on; `prompt/` reads its body into
//! [`RequestFeatures`](prompt::RequestFeatures) (model, token estimates, chained prefix-block
//! hashes) using `routing_key` for the key sticky policies hash, and `block_hash_encoding` for the
//! compact wire form of the hashes; `role` is the part of inference (prefill, decode or both) a
//! request may ask for and a backend performs; `rate_limit` holds the per-client buckets a request
//! is charged against; `passthrough` reads the features of vLLM's own routes passed through by model.
//! Nothing here imports the rest of the crate: every other folder builds on it.

pub mod block_hash_encoding;
pub mod endpoint;
pub mod passthrough;
pub mod prompt;
pub mod rate_limit;
pub mod role;
pub mod routing_key;
