//! The routing key that sticky policies hash: who or what a request belongs to.
//!
//! Looked up in a fixed order of precedence: the `x-session-id`, `x-user-id` and `x-tenant-id`
//! headers, then one operator-configured header, then the body's OpenAI `user` field. The first
//! non-blank value wins. No key at all means sticky policies fall back to load.

use serde_json::Value;

/// Headers consulted first, in order of precedence.
pub const ROUTING_KEY_HEADERS: [&str; 3] = ["x-session-id", "x-user-id", "x-tenant-id"];

/// Longest key kept, in bytes; longer values are truncated at a character boundary.
pub const MAX_ROUTING_KEY_BYTES: usize = 256;

/// The request's routing key, if it has one.
///
/// `header` looks a header up by lower-case name; `custom_header` is the pool's configured extra
/// header (any case).
pub fn routing_key(
    header: &dyn Fn(&str) -> Option<String>,
    body: &Value,
    custom_header: Option<&str>,
) -> Option<String> {
    for name in ROUTING_KEY_HEADERS {
        if let Some(key) = header(name).as_deref().and_then(clean) {
            return Some(key);
        }
    }
    if let Some(name) = custom_header.map(str::trim).filter(|n| !n.is_empty()) {
        let lower = name.to_ascii_lowercase();
        if let Some(key) = header(&lower).as_deref().and_then(clean) {
            return Some(key);
        }
    }
    body.get("user").and_then(Value::as_str).and_then(clean)
}

fn clean(value: &str) -> Option<String> {
    let v = value.trim();
    if v.is_empty() {
        return None;
    }
    let mut end = v.len().min(MAX_ROUTING_KEY_BYTES);
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    Some(v[..end].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn headers(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name: &str| {
            owned
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn precedence_is_session_user_tenant_custom_body() {
        let body = json!({"user": "body-user"});
        let all = headers(&[
            ("x-session-id", "s"),
            ("x-user-id", "u"),
            ("x-tenant-id", "t"),
            ("x-doc", "d"),
        ]);
        assert_eq!(
            routing_key(&all, &body, Some("X-Doc")).as_deref(),
            Some("s")
        );
        let no_session = headers(&[("x-user-id", "u"), ("x-tenant-id", "t"), ("x-doc", "d")]);
        assert_eq!(
            routing_key(&no_session, &body, Some("x-doc")).as_deref(),
            Some("u")
        );
        let tenant = headers(&[("x-tenant-id", "t"), ("x-doc", "d")]);
        assert_eq!(
            routing_key(&tenant, &body, Some("x-doc")).as_deref(),
            Some("t")
        );
        let custom = headers(&[("x-doc", "d")]);
        assert_eq!(
            routing_key(&custom, &body, Some("X-Doc")).as_deref(),
            Some("d")
        );
        assert_eq!(
            routing_key(&custom, &body, None).as_deref(),
            Some("body-user")
        );
        assert_eq!(routing_key(&headers(&[]), &json!({}), None), None);
    }

    #[test]
    fn blank_values_are_skipped_and_long_ones_truncated() {
        let h = headers(&[("x-session-id", "   "), ("x-user-id", " u1 ")]);
        assert_eq!(routing_key(&h, &json!({}), None).as_deref(), Some("u1"));
        let long = "é".repeat(300);
        let h = headers(&[("x-session-id", long.as_str())]);
        let key = routing_key(&h, &json!({}), None).unwrap();
        assert!(key.len() <= MAX_ROUTING_KEY_BYTES);
        assert!(key.chars().all(|c| c == 'é'));
        assert_eq!(routing_key(&headers(&[]), &json!({"user": 5}), None), None);
    }
}
