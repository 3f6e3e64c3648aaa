//! Answers through the wire and back: what the object sends ([`Answer::reply`]) reads back
//! ([`read_answer`]) as the same answer, refusals typed.

use super::*;
use crate::acquire::{AcquireBody, Granted};
use crate::messages::Queued;
use crate::names::QUEUE_DROP_HEADER;
use routing_core::backend::BackendId;
use routing_core::pool::{CandidateView, Grant, PoolError};
use routing_core::request::role::Role;

/// What the caller reads of `answer` as the object sends it (`Retry-After` as the platform gives it).
fn through_the_wire<A: Answer>(answer: &A) -> (Reply, Result<A, CallError>) {
    let reply = answer.reply().unwrap();
    let retry_after = reply
        .headers
        .iter()
        .find(|(k, _)| k == "retry-after")
        .and_then(|(_, v)| v.parse().ok());
    let back = read_answer(reply.status, retry_after, &reply.body);
    (reply, back)
}

fn grant() -> Grant {
    let candidate = CandidateView {
        id: BackendId("b-0".into()),
        url: "https://gpu-0.example.com:8000".into(),
        api_key: None,
        role: Role::Mixed,
    };
    Grant {
        lease_id: 42,
        backend: candidate.id.clone(),
        candidates: vec![candidate],
        deadline_ms: 1_764_547_200_000,
        ..Grant::default()
    }
}

#[test]
fn a_grant_travels_as_its_own_json_with_the_wait_added_only_when_there_was_one() {
    let now = AcquireAnswer::Granted(Granted {
        grant: grant(),
        queued_ms: 0,
    });
    let (reply, back) = through_the_wire(&now);
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.body,
        serde_json::to_string(&grant()).unwrap(),
        "not a byte more"
    );
    assert_eq!(back, Ok(now));

    let waited = AcquireAnswer::Granted(Granted {
        grant: grant(),
        queued_ms: 1_500,
    });
    let (reply, back) = through_the_wire(&waited);
    assert!(
        reply.body.ends_with(r#","queued_ms":1500}"#),
        "{}",
        reply.body
    );
    let direct: Grant = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(direct, grant(), "a grant reader ignores the wait");
    assert_eq!(back, Ok(waited));

    // The wait may come anywhere among the grant's fields.
    let plain = serde_json::to_string(&grant()).unwrap();
    let first = format!(r#"{{"queued_ms":7,{}"#, &plain[1..]);
    let back: Granted = serde_json::from_str(&first).unwrap();
    assert_eq!((back.grant, back.queued_ms), (grant(), 7));
}

#[test]
fn a_ticket_travels_as_a_202() {
    let queued = AcquireAnswer::Queued(Queued {
        ticket: 9,
        queue_length: 3,
    });
    let (reply, back) = through_the_wire(&queued);
    assert_eq!(reply.status, 202);
    assert_eq!(reply.body, r#"{"ticket":9,"queue_length":3}"#);
    assert_eq!(back, Ok(queued));
}

#[test]
fn a_refusal_travels_worded_for_the_client_and_reads_back_typed() {
    let refusal = Refusal::QueueTimeout { retry_after_s: 61 };
    let (reply, back) = through_the_wire(&AcquireAnswer::Refused(refusal.clone()));
    let worded = ApiError::from(refusal.clone());
    assert_eq!(reply.status, 503);
    assert!(reply
        .headers
        .contains(&(QUEUE_DROP_HEADER.to_string(), "queue_timeout".to_string())));
    assert!(reply
        .headers
        .contains(&("retry-after".to_string(), "61".to_string())));
    // Still an OpenAI error body, with the refusal beside it.
    let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(body["error"]["code"], "queue_timeout");
    assert_eq!(body["error"]["message"], worded.message);
    assert_eq!(body["refusal"]["reason"], "queue_timeout");
    assert_eq!(back, Ok(AcquireAnswer::Refused(refusal)));

    let moved = ReassignAnswer::Refused(Refusal::CannotMove {
        error: PoolError::BackendUnavailable { id: "b-1".into() },
    });
    let (reply, back) = through_the_wire(&moved);
    assert_eq!(reply.status, 503);
    assert_eq!(back, Ok(moved));
}

#[test]
fn a_moved_lease_travels_as_the_candidate() {
    let candidate = grant().candidates[0].clone();
    let (reply, back) = through_the_wire(&ReassignAnswer::Moved(candidate.clone()));
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body, serde_json::to_string(&candidate).unwrap());
    assert_eq!(back, Ok(ReassignAnswer::Moved(candidate)));
}

#[test]
fn a_refusal_to_a_call_without_a_place_for_it_is_its_error() {
    let reply = Reply::refusal(&Refusal::RetryBudgetExhausted);
    let back = read_answer::<RenewAnswer>(reply.status, Some(1), &reply.body);
    assert_eq!(
        back,
        Err(CallError::Answered(ApiError::from(
            Refusal::RetryBudgetExhausted
        )))
    );
}

#[test]
fn other_errors_come_back_as_the_object_answered_them() {
    let e = ApiError::rate_limited("slow down", 7);
    let reply = Reply::error(&e, None);
    assert!(!reply.body.contains("refusal"));
    let back = read_answer::<Ack>(reply.status, Some(7), &reply.body);
    assert_eq!(back, Err(CallError::Answered(e)));
    // An error answer that is not an error body.
    match read_answer::<Ack>(502, None, "<html>bad gateway</html>") {
        Err(CallError::Answered(e)) => {
            assert_eq!((e.status, e.message.as_str()), (500, "pool answered 502"))
        }
        other => panic!("{other:?}"),
    }
    // A 2xx answer that is not the call's answer.
    assert!(matches!(
        read_answer::<RenewAnswer>(200, None, "{}"),
        Err(CallError::Unreadable(_))
    ));
}

#[test]
fn answers_keep_their_statuses_and_bodies() {
    let (reply, back) = through_the_wire(&Ack);
    assert_eq!((reply.status, reply.body.as_str()), (200, "ok"));
    assert_eq!(back, Ok(Ack));
    let draining = DeleteAnswer {
        id: "b".into(),
        deleted: false,
        status: Some("draining".into()),
        leases_in_flight: Some(2),
    };
    assert_eq!(draining.reply().unwrap().status, 202);
    let key = StoredKey {
        id: "key-1".into(),
        name: "n".into(),
        hash: "h".into(),
        created_ms: 1,
        priority: 0,
        residency: vec!["eu".into()],
    };
    let (reply, back) = through_the_wire(&key);
    assert_eq!(reply.status, 201);
    assert_eq!(back, Ok(key));
    let page = MetricsPage("# HELP x y\nx 1\n".into());
    let (reply, back) = through_the_wire(&page);
    assert_eq!(reply.content_type, "text/plain; version=0.0.4");
    assert_eq!(back, Ok(page));
}

#[test]
fn each_message_names_its_route_and_body() {
    let entry = PoolEntry {
        name: "eu".into(),
        region: String::new(),
        location_hint: None,
        shards: 1,
        shard_objects: 1,
        jurisdiction: String::new(),
        residency: Vec::new(),
        card: None,
    };
    assert_eq!(entry.route(), Route::PutPool("eu".into()));
    let patch = PatchBackend {
        id: "b-1".into(),
        json: r#"{"api_key":null}"#.into(),
    };
    assert_eq!(patch.route(), Route::PatchBackend("b-1".into()));
    assert_eq!(
        patch.body().unwrap().as_deref(),
        Some(r#"{"api_key":null}"#)
    );
    let delete = DeleteBackend {
        id: "b-1".into(),
        force: true,
    };
    assert_eq!(delete.route().path(), "/backends/b-1?force=true");
    assert_eq!(Metrics.route(), Route::Metrics);
    assert_eq!(ListPools.body().unwrap(), None);
    let body = AcquireBody::new(&routing_core::request::prompt::RequestFeatures::default());
    let acquire = Acquire {
        body: &body,
        admission: None,
        spill_ok: true,
    };
    assert_eq!(acquire.route(), Route::Acquire { spill_ok: true });
    assert_eq!(acquire.body().unwrap(), Some(body.call(None)));
}

#[test]
fn a_take_answer_says_what_is_left_and_an_old_limiters_ok_reads_as_nothing_known() {
    use crate::messages::Taken;
    use routing_core::request::rate_limit::Left;
    let taken = Taken {
        left: Left {
            requests: Some(3.0),
            tokens: None,
            version: 7,
        },
    };
    let reply = taken.reply().unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(Taken::read(200, &reply.body).unwrap(), taken);
    assert_eq!(Taken::read(200, "ok").unwrap(), Taken::default());
    assert!(Taken::read(200, "garbage").is_err());
}
