//! The routes beside the request path: the admin API (`admin.rs`), `/metrics` (`metrics.rs`), the
//! operators' page (`dashboard.rs`, its assets in `dashboard/`) and `/v1/models` (`models.rs`).

pub mod admin;
pub mod dashboard;
pub mod metrics;
pub mod models;
