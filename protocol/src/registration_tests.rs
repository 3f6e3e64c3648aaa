//! The registration rules: URLs, IP hosts, model lists, and what a registration becomes.

use super::*;

fn registration(url: &str) -> BackendRegistration {
    serde_json::from_value(serde_json::json!({ "url": url })).unwrap()
}

#[test]
fn urls_are_http_with_a_host_and_nothing_secret_or_extra() {
    assert_eq!(
        validate_url("https://gpu-1.example.com:8000/").unwrap(),
        "https://gpu-1.example.com:8000"
    );
    for (bad, why) in [
        ("gpu-1:8000", "scheme"),
        ("ftp://gpu-1.example.com", "scheme"),
        ("https://user:pw@gpu-1.example.com", "credentials"),
        ("https://gpu-1.example.com/?a=1", "query"),
        ("https://gpu-1.example.com/#x", "query"),
        ("not a url", "absolute"),
    ] {
        let e = validate_url(bad).unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (400, Some("url")), "{bad}");
        assert!(e.message.contains(why), "{bad}: {}", e.message);
    }
}

#[test]
fn every_spelling_of_an_ip_address_is_one() {
    for ip in [
        "http://127.0.0.1:8000",
        "http://0x7f.1",
        "http://2130706433",
        "http://[::1]:9000",
    ] {
        assert!(host_is_ip(ip), "{ip}");
    }
    assert!(!host_is_ip("https://gpu-1.example.com"));
    assert!(!host_is_ip("not a url"));
}

#[test]
fn model_lists_are_bounded_and_printable() {
    assert!(validate_models(&["meta-llama/Llama-3.1-8B".into()]).is_ok());
    let many: Vec<String> = (0..65).map(|i| format!("m{i}")).collect();
    for bad in [
        vec![String::new()],
        vec!["a\nb".to_string()],
        vec!["x".repeat(257)],
        many,
    ] {
        let e = validate_models(&bad).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("models"));
    }
}

#[test]
fn a_registration_becomes_a_spec_with_defaults_and_a_stable_id() {
    let spec = validate_registration(registration("https://gpu-1.example.com/")).unwrap();
    assert_eq!(spec.url, "https://gpu-1.example.com");
    assert_eq!((spec.role, spec.weight), (Role::Mixed, 1));
    assert_eq!(spec.capacity, Capacity::default());
    assert!(
        spec.id.0.starts_with("b-") && spec.id.0.len() == 14,
        "{}",
        spec.id.0
    );
    let again = validate_registration(registration("https://gpu-1.example.com")).unwrap();
    assert_eq!(again.id, spec.id, "the id is the URL's");
    let mut reg = registration("https://gpu-2.example.com");
    reg.role = Some("verifier".into());
    assert_eq!(
        validate_registration(reg).unwrap_err().param.as_deref(),
        Some("role")
    );
    let mut reg = registration("https://gpu-2.example.com");
    reg.api_key = Some(String::new());
    assert_eq!(
        validate_registration(reg).unwrap().api_key,
        None,
        "an empty key is none"
    );
    let mut reg = registration("https://gpu-2.example.com");
    reg.max_num_seqs = Some(0);
    assert_eq!(validate_registration(reg).unwrap_err().status, 400);
}
