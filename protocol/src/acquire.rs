//! `POST /acquire`, the hottest call: a request's routing features, and who is asking.
//!
//! The Worker may ask several pools, and a queued request asks the same pool again and again, so
//! the features are serialised once per request ([`AcquireBody::new`]) and each call only appends
//! its admission part ([`AcquireBody::call`]). Block hashes travel as base64 of little-endian
//! `u64`s (`routing_core::block_hash_encoding`). The pool decodes the body straight into
//! [`AcquireRequest`] (no untyped JSON) and the answer is a `routing_core::pool::Grant` (200) or a
//! [`crate::messages::Queued`] (202).

use routing_core::admission::AdmissionRequest;
use routing_core::prompt::RequestFeatures;
use routing_core::region::ChoiceNote;
use serde::{Deserialize, Serialize};

/// The body of `POST /acquire`: `{"features": {...}, "admission": {...}}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AcquireRequest {
    /// What routing needs to know about the request.
    pub features: RequestFeatures,
    /// Tenant, priority, wait limit, and the ticket of a wait in progress; without it the pool
    /// never queues the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<AdmissionRequest>,
    /// Why the Worker asked this pool (counted by the pool; absent from older Workers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choice: Option<ChoiceNote>,
}

/// A request's acquire body, serialised once; each call adds only its admission part.
#[derive(Debug, Clone)]
pub struct AcquireBody {
    /// `{"features":{...}` without the closing brace.
    head: String,
    /// `,"choice":{...}` for the pool being asked, when set.
    note: String,
}

impl AcquireBody {
    /// Serialises `features` (block hashes included) once.
    pub fn new(features: &RequestFeatures) -> Self {
        let features = serde_json::to_string(features).unwrap_or_else(|_| "{}".to_string());
        AcquireBody {
            head: format!("{{\"features\":{features}"),
            note: String::new(),
        }
    }

    /// Says why the next calls ask the pool they go to (the Worker sets it per pool).
    pub fn set_choice(&mut self, note: &ChoiceNote) {
        self.note = serde_json::to_string(note)
            .map(|n| format!(",\"choice\":{n}"))
            .unwrap_or_default();
    }

    /// The body of one call: the features, plus `admission` when given.
    pub fn call(&self, admission: Option<&AdmissionRequest>) -> String {
        let admission = admission.and_then(|a| serde_json::to_string(a).ok());
        let extra = admission.as_ref().map_or(0, |a| a.len() + 14);
        let mut body = String::with_capacity(self.head.len() + self.note.len() + extra + 1);
        body.push_str(&self.head);
        body.push_str(&self.note);
        if let Some(a) = admission {
            body.push_str(",\"admission\":");
            body.push_str(&a);
        }
        body.push('}');
        body
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use routing_core::prompt::{request_features, FeatureConfig, BYTES_PER_TOKEN};
    use serde_json::json;

    /// The features of a chat whose prompt is estimated at about `tokens` tokens.
    fn features(tokens: usize) -> RequestFeatures {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut text = String::new();
        while text.len() < tokens * BYTES_PER_TOKEN {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            text.push_str(&format!("w{:x} ", x % 100_000));
        }
        let body = json!({
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "messages": [{"role": "user", "content": text}],
        });
        let mut f = request_features(&body, &|_| None, &FeatureConfig::default()).unwrap();
        f.request_id = "req-0123456789abcdef01234567".into();
        f
    }

    #[test]
    fn a_body_decodes_to_the_features_and_admission_it_was_built_from() {
        let f = features(2_000);
        assert!(!f.block_hashes.is_empty());
        let who = AdmissionRequest {
            tenant: "t".into(),
            priority: 2,
            ticket: Some(9),
            ..AdmissionRequest::default()
        };
        let body = AcquireBody::new(&f);
        for admission in [None, Some(&who)] {
            let back: AcquireRequest = serde_json::from_str(&body.call(admission)).unwrap();
            assert_eq!(back.features, f);
            assert_eq!(back.admission.as_ref(), admission);
        }
    }

    #[test]
    fn a_hand_written_body_without_hashes_still_parses() {
        let req: AcquireRequest = serde_json::from_str(
            r#"{"features":{"model":"m","request_id":"r","prompt_tokens":10,"max_tokens":5},"admission":{"tenant":"x"}}"#,
        )
        .unwrap();
        assert_eq!(
            (req.features.model.as_str(), req.features.block_hashes.len()),
            ("m", 0)
        );
        assert_eq!(req.admission.unwrap().tenant, "x");
    }

    /// The old body: the features with their hashes as decimal JSON numbers.
    fn decimal_body(f: &RequestFeatures) -> String {
        let mut value = serde_json::to_value(f).unwrap();
        value["block_hashes"] = serde_json::json!(f.block_hashes);
        value.to_string()
    }

    #[test]
    fn a_16k_token_prompt_costs_about_half_the_bytes() {
        let f = features(16_000);
        let (old, new) = (
            decimal_body(&f).len(),
            AcquireBody::new(&f).call(None).len(),
        );
        println!(
            "acquire body for a prompt of {} estimated tokens ({} block hashes): decimal {old} bytes, base64 {new} bytes",
            f.prompt_tokens,
            f.block_hashes.len()
        );
        assert!(new * 100 < old * 60, "{new} vs {old}");
    }

    #[test]
    fn the_answers_are_small_and_fixed_in_shape() {
        use routing_core::backend::BackendId;
        use routing_core::pool::{CandidateView, Grant};
        let candidate = |i: u32| CandidateView {
            id: BackendId(format!("b-{i:012x}")),
            url: format!("https://gpu-{i}.pool.example.com:8000"),
            api_key: None,
            role: routing_core::backend::Role::Mixed,
        };
        let grant = Grant {
            lease_id: 123_456_789,
            backend: candidate(0).id,
            candidates: (0..3).map(candidate).collect(),
            deadline_ms: 1_764_547_200_000,
            cached_blocks: 900,
            predicted_ttft_ms: Some(4_000_000),
            receipt: Some(routing_core::pool::RouteReceipt {
                predicted_ttft_ms: 4_000_000,
                alt: Some(candidate(1).id),
                alt_predicted_ttft_ms: Some(4_000_001),
            }),
            ..Grant::default()
        };
        let grant_bytes = serde_json::to_string(&grant).unwrap().len();
        let release = serde_json::to_string(&crate::messages::ReleaseAnswer { released: true })
            .unwrap()
            .len();
        println!("acquire answer with 3 candidates: {grant_bytes} bytes; release answer: {release} bytes");
        // Neither grows with the prompt or the fleet: three candidates at most, no hashes.
        assert!(grant_bytes < 600, "{grant_bytes}");
        assert_eq!(release, 17);
    }
}
