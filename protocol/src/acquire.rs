//! `POST /acquire`, the hottest call: a request's routing features, who is asking, and the
//! pool's answer.
//!
//! The Worker may ask several pools, and a queued request asks the same pool again and again, so
//! the features are serialised once per request ([`AcquireBody::new`]) and each call ([`Acquire`])
//! only appends its admission part ([`AcquireBody::call`]). Block hashes travel as base64 of
//! little-endian `u64`s (`routing_core::request::block_hash_encoding`). The pool decodes the body straight
//! into [`AcquireRequest`] (no untyped JSON). It answers an [`AcquireAnswer`]: a lease
//! ([`Granted`], 200: the grant's own JSON, plus `queued_ms` when the request waited), a ticket
//! ([`crate::messages::Queued`], 202), or a refusal (`routing_core::pool::Refusal`, an error
//! answer; see [`crate::call`]).

use crate::messages::Queued;
use routing_core::admission::AdmissionRequest;
use routing_core::pool::{Grant, Refusal};
use routing_core::region::ChoiceNote;
use routing_core::request::prompt::{RequestFeatures, SentAhead};
use serde::de::{DeserializeSeed, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::borrow::Cow;
use std::fmt;

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
    /// The backend the Worker sent the request to beside this call (`ROUTE_AHEAD`), and what a
    /// re-send elsewhere would cost; the pool puts it in the features it decides on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ahead: Option<SentAhead>,
}

/// A request's acquire body, serialised once; each call adds only its admission part.
#[derive(Debug, Clone)]
pub struct AcquireBody {
    /// `{"features":{...}` without the closing brace.
    head: String,
    /// `,"choice":{...}` for the pool being asked, when set.
    note: String,
    /// `,"ahead":{...}` while a fetch sent ahead waits on the pool being asked.
    ahead: String,
}

impl AcquireBody {
    /// Serialises `features` (block hashes included) once.
    pub fn new(features: &RequestFeatures) -> Self {
        let features = serde_json::to_string(features).unwrap_or_else(|_| "{}".to_string());
        AcquireBody {
            head: format!("{{\"features\":{features}"),
            note: String::new(),
            ahead: String::new(),
        }
    }

    /// Says why the next calls ask the pool they go to (the Worker sets it per pool).
    pub fn set_choice(&mut self, note: &ChoiceNote) {
        self.note = serde_json::to_string(note)
            .map(|n| format!(",\"choice\":{n}"))
            .unwrap_or_default();
    }

    /// Says which backend the request was sent to ahead of the next calls, or (`None`) that none
    /// was.
    pub fn set_ahead(&mut self, ahead: Option<&SentAhead>) {
        self.ahead = ahead
            .and_then(|a| serde_json::to_string(a).ok())
            .map(|a| format!(",\"ahead\":{a}"))
            .unwrap_or_default();
    }

    /// The body of one call: the features, plus `admission` when given.
    pub fn call(&self, admission: Option<&AdmissionRequest>) -> String {
        let admission = admission.and_then(|a| serde_json::to_string(a).ok());
        let extra = admission.as_ref().map_or(0, |a| a.len() + 14);
        let len = self.head.len() + self.note.len() + self.ahead.len() + extra + 1;
        let mut body = String::with_capacity(len);
        body.push_str(&self.head);
        body.push_str(&self.note);
        body.push_str(&self.ahead);
        if let Some(a) = admission {
            body.push_str(",\"admission\":");
            body.push_str(&a);
        }
        body.push('}');
        body
    }
}

/// One acquire call: the request's body, this call's admission part, and whether the pool may
/// refuse so that a further pool takes the request.
#[derive(Debug, Clone, Copy)]
pub struct Acquire<'a> {
    /// The request's features, serialised once.
    pub body: &'a AcquireBody,
    /// Tenant, priority, wait limit and the ticket of a wait in progress.
    pub admission: Option<&'a AdmissionRequest>,
    /// A saturated or full pool may refuse (the Worker has somewhere else to go).
    pub spill_ok: bool,
}

/// The pool's answer to an acquire.
#[derive(Debug, Clone, PartialEq)]
pub enum AcquireAnswer {
    /// A lease.
    Granted(Granted),
    /// The request waits in the pool's queue: ask again with the ticket.
    Queued(Queued),
    /// No lease, and why.
    Refused(Refusal),
}

/// A granted lease, and how long the request waited in the pool's queue for it.
///
/// On the wire: the grant's JSON object, with `"queued_ms"` added when the request waited. Read
/// back without `serde(flatten)`, which would buffer the whole grant first: the grant reads its
/// fields straight from the body, and `queued_ms` is picked out on the way.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Granted {
    /// The lease and candidates.
    pub grant: Grant,
    /// Time spent in the queue, ms (0 when there was room at once).
    pub queued_ms: u64,
}

/// The key of the queue wait in a [`Granted`] answer.
const QUEUED_MS: &str = "queued_ms";

impl Serialize for Granted {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Wire<'a> {
            #[serde(flatten)]
            grant: &'a Grant,
            #[serde(skip_serializing_if = "is_zero")]
            queued_ms: u64,
        }
        fn is_zero(ms: &u64) -> bool {
            *ms == 0
        }
        Wire {
            grant: &self.grant,
            queued_ms: self.queued_ms,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Granted {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(GrantedVisitor)
    }
}

struct GrantedVisitor;

impl<'de> Visitor<'de> for GrantedVisitor {
    type Value = Granted;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a grant")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Granted, A::Error> {
        let mut queued_ms = 0;
        let fields = WithoutWait {
            map,
            queued_ms: &mut queued_ms,
        };
        let grant = Grant::deserialize(serde::de::value::MapAccessDeserializer::new(fields))?;
        Ok(Granted { grant, queued_ms })
    }
}

/// The grant's fields, with `queued_ms` taken out into `queued_ms`.
struct WithoutWait<'a, A> {
    map: A,
    queued_ms: &'a mut u64,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for WithoutWait<'_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        while let Some(Key(key)) = self.map.next_key()? {
            if key == QUEUED_MS {
                *self.queued_ms = self.map.next_value()?;
                continue;
            }
            return seed
                .deserialize(serde::de::value::CowStrDeserializer::new(key))
                .map(Some);
        }
        Ok(None)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        self.map.next_value_seed(seed)
    }
}

/// A map key, borrowed from the body when it can be.
struct Key<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use routing_core::request::prompt::{request_features, FeatureConfig, BYTES_PER_TOKEN};
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
            assert_eq!(back.ahead, None);
        }
    }

    #[test]
    fn a_fetch_sent_ahead_travels_beside_the_features_until_cleared() {
        let f = features(100);
        let mut body = AcquireBody::new(&f);
        let ahead = SentAhead {
            backend: "gpu-3".into(),
            resend_ms: 42,
        };
        body.set_ahead(Some(&ahead));
        let back: AcquireRequest = serde_json::from_str(&body.call(None)).unwrap();
        assert_eq!(back.ahead.as_ref(), Some(&ahead));
        // Not inside the features: the pool sets those from the call.
        assert_eq!(back.features.sent_ahead, None);
        body.set_ahead(None);
        let back: AcquireRequest = serde_json::from_str(&body.call(None)).unwrap();
        assert_eq!(back.ahead, None);
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
            role: routing_core::request::role::Role::Mixed,
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
                ..Default::default()
            }),
            first_token_due_ms: Some(4_000_000),
            // (a streamed grant's due time adds about 25 bytes)
            ..Grant::default()
        };
        let grant_bytes = serde_json::to_string(&grant).unwrap().len();
        let release = serde_json::to_string(&crate::messages::ReleaseAnswer { released: true })
            .unwrap()
            .len();
        println!("acquire answer with 3 candidates: {grant_bytes} bytes; release answer: {release} bytes");
        // Neither grows with the prompt or the fleet: three candidates at most, no hashes.
        assert!(grant_bytes < 640, "{grant_bytes}");
        assert_eq!(release, 17);
    }
}
