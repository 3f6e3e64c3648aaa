//! The probe's reading of a backend's answers: up, loading, redirected, a login page, a refused
//! key, and the metrics page.

use super::*;

fn answer(status: u16, content_type: &str, body: &str) -> Result<ProbeAnswer, String> {
    Ok(ProbeAnswer {
        status,
        content_type: content_type.into(),
        body: body.into(),
    })
}

#[test]
fn health_says_up_loading_redirected_or_down() {
    let mut up = ProbeReport::default();
    assert!(up.read_health(Ok(200)));
    assert_eq!((up.health_status, up.error.as_deref()), (Some(200), None));
    let mut loading = ProbeReport::default();
    assert!(!loading.read_health(Ok(503)));
    assert!(loading.result.loading && !loading.result.ok);
    let mut moved = ProbeReport::default();
    assert!(!moved.read_health(Ok(302)));
    assert!(moved.error.unwrap().contains("follows no redirects"));
    let mut down = ProbeReport::default();
    assert!(!down.read_health(Ok(500)));
    assert_eq!(down.error.as_deref(), Some("/health answered 500"));
    let mut gone = ProbeReport::default();
    assert!(!gone.read_health(Err("connection refused".into())));
    assert_eq!(gone.health_status, None);
    assert!(gone.error.unwrap().contains("connection refused"));
}

#[test]
fn only_a_model_list_is_a_backend() {
    let mut r = ProbeReport::default();
    r.read_health(Ok(200));
    r.read_models(answer(
        200,
        "application/json",
        r#"{"object":"list","data":[{"id":"m1"},{"id":"m2"}]}"#,
    ));
    assert!(r.result.ok);
    assert_eq!(
        r.result.models.as_deref(),
        Some(&["m1".to_string(), "m2".to_string()][..])
    );
    let mut login = ProbeReport::default();
    login.read_health(Ok(200));
    login.read_models(answer(
        200,
        "text/html; charset=utf-8",
        "<html>Sign in</html>",
    ));
    assert!(!login.result.ok);
    assert!(login.error.unwrap().contains("text/html"));
    for (status, says) in [(307, "redirect"), (401, "api_key"), (403, "api_key")] {
        let mut r = ProbeReport::default();
        r.read_health(Ok(200));
        r.read_models(answer(status, "", ""));
        assert!(!r.result.ok, "{status}");
        assert!(r.error.unwrap().contains(says), "{status}");
    }
    // No answer, or a 404 (an old server without the route): the health verdict stands.
    for other in [Err("timed out".to_string()), answer(404, "", "")] {
        let mut r = ProbeReport::default();
        r.read_health(Ok(200));
        r.read_models(other);
        assert!(r.result.ok && r.result.models.is_none());
    }
}

#[test]
fn a_metrics_page_feeds_the_gauges_and_anything_else_nothing() {
    let page = "vllm:num_requests_waiting 3\nvllm:num_requests_running 2\n";
    let mut r = ProbeReport::default();
    r.read_metrics(answer(200, "text/plain", page));
    assert_eq!(r.metrics.gauges.waiting, Some(3.0));
    assert_eq!(r.result.metrics.gauges.running, Some(2.0));
    let mut none = ProbeReport::default();
    none.read_metrics(answer(500, "text/plain", page));
    assert_eq!(none.metrics.gauges.waiting, None);
}

#[test]
fn lora_adapters_are_kept_with_their_parent_and_root() {
    let mut report = ProbeReport::default();
    let body = r#"{"object":"list","data":[
        {"id":"base","object":"model","root":"/models/base","parent":null},
        {"id":"sql","object":"model","root":"/loras/sql","parent":"base"}]}"#;
    report.read_models(Ok(ProbeAnswer {
        status: 200,
        content_type: "application/json".into(),
        body: body.into(),
    }));
    assert_eq!(
        report.models,
        Some(vec!["base".to_string(), "sql".to_string()])
    );
    assert_eq!(
        report.adapters,
        vec![crate::coordinator::AdapterCard {
            id: "sql".into(),
            parent: "base".into(),
            root: Some("/loras/sql".into()),
        }]
    );
}
