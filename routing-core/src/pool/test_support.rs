//! Helpers the pool's unit tests share: a backend spec, a passing probe, a probed pool and
//! a chat request's features.

use super::{Pool, PoolConfig, ProbeResult};
use crate::backend::{BackendId, BackendSpec};
use crate::policy::PolicyKind;
use crate::request::prompt::{request_features, FeatureConfig, RequestFeatures};
use serde_json::json;

pub(crate) fn spec(id: &str) -> BackendSpec {
    BackendSpec {
        id: id.into(),
        url: format!("http://{id}:8000"),
        models: vec!["llama".into()],
        api_key: Some(format!("key-{id}")),
        ..BackendSpec::default()
    }
}

pub(crate) fn up() -> ProbeResult {
    ProbeResult {
        ok: true,
        ..ProbeResult::default()
    }
}

/// Adds `spec` to `pool` at time 0 and has it probed healthy, so it takes requests.
pub(crate) fn add_ready(pool: &mut Pool, spec: BackendSpec) -> BackendId {
    let id = pool.add_backend(spec, 0).unwrap();
    pool.record_probe(&id, &up(), 0).unwrap();
    id
}

pub(crate) fn pool_with(policy: PolicyKind, n: usize) -> Pool {
    let mut pool = Pool::new(
        "p1",
        PoolConfig {
            policy,
            ..PoolConfig::default()
        },
    );
    for i in 0..n {
        add_ready(&mut pool, spec(&format!("b{i}")));
    }
    pool
}

pub(crate) fn features(text: &str) -> RequestFeatures {
    let body = json!({"model": "llama", "messages": [{"role": "user", "content": text}]});
    request_features(&body, &|_| None, &FeatureConfig::default()).unwrap()
}
