//! A backend registration's rules: what a URL, a model list and a registration must be before a
//! pool takes them (`POST /admin/backends`, `PATCH`), and the backend spec a valid registration
//! becomes. Checked by the pool's coordinator object; the Worker's admin API asks [`host_is_ip`]
//! before it forwards a registration.

use crate::messages::BackendRegistration;
use crate::settings::validate_name;
use crate::ApiError;
use routing_core::backend::{BackendId, BackendSpec, Capacity};
use routing_core::request::role::Role;
use url::Url;

/// Checks a backend URL: http or https, a host, no credentials, no query or fragment.
pub fn validate_url(raw: &str) -> Result<String, ApiError> {
    let bad = |why: &str| {
        Err(ApiError::bad_request(format!("invalid backend url: {why}")).with_param("url"))
    };
    let url = match Url::parse(raw) {
        Ok(u) => u,
        Err(_) => return bad("not an absolute URL"),
    };
    if url.scheme() != "http" && url.scheme() != "https" {
        return bad("scheme must be http or https");
    }
    if url.host_str().is_none_or(str::is_empty) {
        return bad("missing host");
    }
    if !url.username().is_empty() || url.password().is_some() {
        return bad("credentials in the URL are not allowed; use api_key");
    }
    if url.query().is_some() || url.fragment().is_some() {
        return bad("query strings and fragments are not allowed");
    }
    Ok(url.as_str().trim_end_matches('/').to_string())
}

/// Whether a backend URL names its host by IP address rather than by a DNS name. A deployed
/// Worker cannot fetch such a URL (only hostnames), so registration refuses it unless the operator
/// allows it for local use. The URL parser normalises every IPv4 spelling (`0x7f.1`, `2130706433`)
/// to dotted form, so those count too.
pub fn host_is_ip(raw: &str) -> bool {
    let Ok(url) = Url::parse(raw) else {
        return false;
    };
    let host = url.host_str().unwrap_or_default();
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok()
}

/// Checks model names: 1-256 characters, no control characters, at most 64 of them.
pub fn validate_models(models: &[String]) -> Result<(), ApiError> {
    let bad = models.len() > 64
        || models
            .iter()
            .any(|m| m.is_empty() || m.len() > 256 || m.chars().any(char::is_control));
    if bad {
        return Err(ApiError::bad_request(
            "`models` must hold at most 64 names of 1-256 printable characters",
        )
        .with_param("models"));
    }
    Ok(())
}

/// Validates a registration and turns it into a backend spec.
pub fn validate_registration(reg: BackendRegistration) -> Result<BackendSpec, ApiError> {
    let url = validate_url(&reg.url)?;
    let role = match reg.role.as_deref().unwrap_or("mixed") {
        "mixed" => Role::Mixed,
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        other => {
            return Err(ApiError::bad_request(format!(
                "unknown role `{other}`; expected mixed, prefill or decode"
            ))
            .with_param("role"))
        }
    };
    let id = match reg.id {
        Some(id) => {
            validate_name("id", &id)?;
            id
        }
        None => format!(
            "b-{:012x}",
            xxhash_rust::xxh3::xxh3_64(url.as_bytes()) & 0xffff_ffff_ffff
        ),
    };
    validate_models(&reg.models)?;
    let region = reg.region.unwrap_or_default();
    if !region.is_empty() {
        validate_name("region", &region)?;
    }
    let defaults = Capacity::default();
    let spec = BackendSpec {
        id: BackendId(id),
        url,
        region,
        models: reg.models,
        weight: reg.weight.unwrap_or(1),
        role,
        api_key: reg.api_key.filter(|k| !k.is_empty()),
        capacity: Capacity {
            max_num_seqs: reg.max_num_seqs.unwrap_or(defaults.max_num_seqs),
            kv_blocks: reg.kv_blocks.unwrap_or(defaults.kv_blocks),
            block_size: reg.block_size.unwrap_or(defaults.block_size),
            kv_tokens: 0,
        },
    };
    spec.validate()
        .map_err(|e| ApiError::bad_request(format!("invalid backend: {e}")))?;
    Ok(spec)
}

#[cfg(test)]
#[path = "registration_tests.rs"]
mod tests;
