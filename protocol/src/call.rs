//! Each call names its route and its answer: a request message implements [`Call`], whose
//! `Answer` is the only type the caller can get back, so no caller pairs a message with the wrong
//! answer, and [`Answer`] is how that answer travels (its status and body, both ways).
//!
//! The object sends an answer as a [`Reply`] ([`Answer::reply`]); the caller reads it back with
//! [`read_answer`]: a 2xx answer as the call's `Answer`, an error answer as the [`ApiError`] it
//! carries. A pool's refusal (`routing_core::pool::Refusal`) travels as an error answer worded for
//! the client (so the object's answers stay OpenAI-shaped) with the refusal itself beside the
//! error; the acquire and reassign answers read it back as their `Refused` variant, typed.
//!
//! Routes without a body have small unit structs here ([`ListBackends`], [`Summary`], ...), and
//! routes whose path names something carry it ([`ShowBackend`], [`PatchKey`], ...). The hot
//! call's message and answers are in [`crate::acquire`]; the others' in [`crate::messages`].

use crate::acquire::{Acquire, AcquireAnswer};
use crate::error::{ApiError, ErrorObject};
use crate::messages::{
    AdminBackend, AlarmAnswer, BackendList, BackendRegistration, CardAnswer, DeleteAnswer,
    DequeueAnswer, DequeueRequest, KeyPatch, KeyPatchAnswer, LoadReportAnswer, ModelsAnswer,
    PoolEntry, PoolSummary, PrefillDone, PrefillDoneAnswer, ProbeRound, ReassignAnswer,
    ReassignRequest, ReleaseAnswer, ReleaseBatch, ReleaseBatchAnswer, ReleaseRequest, RenewAnswer,
    RenewRequest, ResponseHolder, ResponseHolderAnswer, SettleRequest, ShardAck, ShardRegistry,
    StoredKey, TakeRequest, Taken,
};
use crate::route::Route;
use crate::settings::PoolSettings;
use routing_core::pool::shard::LoadReport;
use routing_core::pool::{BackendView, Refusal};
use routing_core::region::TimeCard;
use serde::{Deserialize, Serialize};

/// A request to a Durable Object: where it goes, what it carries, what comes back.
pub trait Call {
    /// The answer.
    type Answer: Answer;
    /// The route the call goes to.
    fn route(&self) -> Route;
    /// The call's JSON body, if its route takes one.
    fn body(&self) -> Result<Option<String>, serde_json::Error>;
}

/// An answer as it travels.
pub trait Answer: Sized {
    /// Whether reading the answer needs its body (without it, the caller drops the body unread).
    const READS_BODY: bool = true;
    /// The answer as the object sends it.
    fn reply(&self) -> Result<Reply, serde_json::Error>;
    /// Reads a 2xx answer (its status and body) back.
    fn read(status: u16, body: &str) -> Result<Self, serde_json::Error>;
    /// The answer a pool's refusal stands for: `Ok` for the answers that include refusals
    /// (acquire, reassign); the others hand it back, and the caller gets it as its error.
    fn refused(refusal: Refusal) -> Result<Self, Refusal> {
        Err(refusal)
    }
}

/// An answer ready to send: status, content type, further headers, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// `content-type`.
    pub content_type: &'static str,
    /// Further headers.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: String,
}

impl Reply {
    /// `value` as JSON with `status`.
    pub fn json<T: Serialize + ?Sized>(status: u16, value: &T) -> Result<Reply, serde_json::Error> {
        Ok(Reply {
            status,
            content_type: "application/json",
            headers: Vec::new(),
            body: serde_json::to_string(value)?,
        })
    }

    /// An error answer: the error's body, status and headers, and the refusal it words, if any
    /// (so the caller reads the refusal back typed, see [`read_error`]).
    pub fn error(e: &ApiError, refusal: Option<&Refusal>) -> Reply {
        let body = ErrorAnswer {
            error: e.body().error,
            refusal: refusal.cloned(),
        };
        let mut headers = Vec::with_capacity(e.headers.len() + 1);
        if let Some(s) = e.retry_after_s {
            headers.push(("retry-after".to_string(), s.to_string()));
        }
        headers.extend(e.headers.iter().cloned());
        Reply {
            status: e.status,
            content_type: "application/json",
            headers,
            // An error body is strings and options only: it always serialises.
            body: serde_json::to_string(&body).unwrap_or_default(),
        }
    }

    /// A pool's refusal, worded for the client, with the refusal itself.
    pub fn refusal(r: &Refusal) -> Reply {
        Reply::error(&ApiError::from(r.clone()), Some(r))
    }
}

/// The name of the method a pool coordinator answers calls on by Durable Object RPC (the same
/// calls as its `fetch`, without a request and a response object on either side: see
/// `Reply::into_rpc` and [`RpcAnswer`]).
pub const RPC_METHOD: &str = "gatewayCall";

/// An answer as it came back over RPC: its status, `Retry-After` and body, the only parts of an
/// answer [`read_answer`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcAnswer {
    /// HTTP status.
    pub status: u16,
    /// `Retry-After`, seconds.
    pub retry_after_s: Option<u32>,
    /// The body.
    pub body: String,
}

impl Reply {
    /// The `Retry-After` of an answer that has one.
    pub fn retry_after_s(&self) -> Option<u32> {
        self.headers
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case("retry-after"))
            .and_then(|(_, v)| v.parse().ok())
    }
}

#[cfg(feature = "worker")]
impl Reply {
    /// The answer as it travels back over RPC: `[status, body, retry-after seconds or null]`
    /// (read back with [`RpcAnswer::from_js`]).
    pub fn into_rpc(self) -> wasm_bindgen::JsValue {
        let out = js_sys::Array::new_with_length(3);
        out.set(0, wasm_bindgen::JsValue::from(self.status));
        let retry_after = self
            .retry_after_s()
            .map_or(wasm_bindgen::JsValue::NULL, wasm_bindgen::JsValue::from);
        out.set(1, wasm_bindgen::JsValue::from(self.body));
        out.set(2, retry_after);
        out.into()
    }
}

#[cfg(feature = "worker")]
impl RpcAnswer {
    /// Reads what [`Reply::into_rpc`] sent (`None` when it is not that shape).
    pub fn from_js(value: &wasm_bindgen::JsValue) -> Option<RpcAnswer> {
        let array: &js_sys::Array = wasm_bindgen::JsCast::dyn_ref(value)?;
        let status = array.get(0).as_f64()?;
        if !(100.0..600.0).contains(&status) {
            return None;
        }
        Some(RpcAnswer {
            status: status as u16,
            body: array.get(1).as_string()?,
            retry_after_s: array.get(2).as_f64().map(|s| s as u32),
        })
    }
}

#[cfg(feature = "worker")]
impl Reply {
    /// The platform's response.
    pub fn into_response(self) -> worker::Result<worker::Response> {
        let mut builder = worker::ResponseBuilder::new()
            .with_status(self.status)
            .with_header("content-type", self.content_type)?;
        for (name, value) in &self.headers {
            builder = builder.with_header(name, value)?;
        }
        Ok(builder.fixed(self.body.into_bytes()))
    }
}

/// The body of an error answer: the OpenAI error, and the pool's refusal it words, if it is one.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorAnswer {
    /// The error, as the client would see it.
    pub error: ErrorObject,
    /// The refusal, typed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<Refusal>,
}

/// Why a call brought back no answer of its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// The object answered with an error (a refusal the answer has no place for, worded).
    Answered(ApiError),
    /// The answer does not read as the call's answer.
    Unreadable(String),
}

/// Reads a call's answer from its status, `Retry-After` header and body.
pub fn read_answer<A: Answer>(
    status: u16,
    retry_after_s: Option<u32>,
    body: &str,
) -> Result<A, CallError> {
    if (200..300).contains(&status) {
        return A::read(status, body).map_err(|e| CallError::Unreadable(e.to_string()));
    }
    match read_error(status, retry_after_s, body) {
        Ok(refusal) => A::refused(refusal).map_err(|r| CallError::Answered(ApiError::from(r))),
        Err(e) => Err(CallError::Answered(e)),
    }
}

/// Reads an error answer: the refusal it carries (`Ok`), else the error itself.
pub fn read_error(
    status: u16,
    retry_after_s: Option<u32>,
    body: &str,
) -> Result<Refusal, ApiError> {
    let mut e = match serde_json::from_str::<ErrorAnswer>(body) {
        Ok(ErrorAnswer {
            refusal: Some(r), ..
        }) => return Ok(r),
        Ok(ErrorAnswer { error, .. }) => ApiError::from_parts(status, error),
        Err(_) => ApiError::internal(format!("pool answered {status}")),
    };
    e.retry_after_s = retry_after_s;
    Err(e)
}

#[cfg(test)]
mod tests;

// ---- The lease calls, whose answers include refusals ------------------------------------

impl Call for Acquire<'_> {
    type Answer = AcquireAnswer;
    fn route(&self) -> Route {
        Route::Acquire {
            spill_ok: self.spill_ok,
        }
    }
    fn body(&self) -> Result<Option<String>, serde_json::Error> {
        Ok(Some(self.body.call(self.admission)))
    }
}

impl Answer for AcquireAnswer {
    fn reply(&self) -> Result<Reply, serde_json::Error> {
        match self {
            AcquireAnswer::Granted(granted) => Reply::json(200, granted),
            AcquireAnswer::Queued(queued) => Reply::json(202, queued),
            AcquireAnswer::Refused(r) => Ok(Reply::refusal(r)),
        }
    }
    fn read(status: u16, body: &str) -> Result<Self, serde_json::Error> {
        Ok(match status {
            202 => AcquireAnswer::Queued(serde_json::from_str(body)?),
            _ => AcquireAnswer::Granted(serde_json::from_str(body)?),
        })
    }
    fn refused(refusal: Refusal) -> Result<Self, Refusal> {
        Ok(AcquireAnswer::Refused(refusal))
    }
}

impl Call for ReassignRequest {
    type Answer = ReassignAnswer;
    fn route(&self) -> Route {
        Route::Reassign
    }
    fn body(&self) -> Result<Option<String>, serde_json::Error> {
        serde_json::to_string(self).map(Some)
    }
}

impl Answer for ReassignAnswer {
    fn reply(&self) -> Result<Reply, serde_json::Error> {
        match self {
            ReassignAnswer::Moved(candidate) => Reply::json(200, candidate),
            ReassignAnswer::Refused(r) => Ok(Reply::refusal(r)),
        }
    }
    fn read(_status: u16, body: &str) -> Result<Self, serde_json::Error> {
        Ok(ReassignAnswer::Moved(serde_json::from_str(body)?))
    }
    fn refused(refusal: Refusal) -> Result<Self, Refusal> {
        Ok(ReassignAnswer::Refused(refusal))
    }
}

// ---- The other answers ----------------------------------------------------------------------

/// JSON answers sent with `status`.
macro_rules! json_answers {
    ($status:expr => $($t:ty),+ $(,)?) => {$(
        impl Answer for $t {
            fn reply(&self) -> Result<Reply, serde_json::Error> {
                Reply::json($status, self)
            }
            fn read(_status: u16, body: &str) -> Result<Self, serde_json::Error> {
                serde_json::from_str(body)
            }
        }
    )+};
}

json_answers!(200 =>
    DequeueAnswer, ReleaseAnswer, ReleaseBatchAnswer, RenewAnswer, PrefillDoneAnswer,
    ResponseHolderAnswer, BackendList, AdminBackend, ModelsAnswer, PoolSettings, PoolSummary, AlarmAnswer,
    LoadReportAnswer, ShardAck, Vec<PoolEntry>, PoolEntry, CardAnswer, Vec<StoredKey>,
    KeyPatchAnswer,
);
// Created.
json_answers!(201 => BackendView, StoredKey);

impl Answer for DeleteAnswer {
    fn reply(&self) -> Result<Reply, serde_json::Error> {
        // 202: a backend with requests in flight drains first.
        Reply::json(if self.deleted { 200 } else { 202 }, self)
    }
    fn read(_status: u16, body: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(body)
    }
}

impl Answer for Taken {
    fn reply(&self) -> Result<Reply, serde_json::Error> {
        Reply::json(200, self)
    }
    /// A limiter deployed before its answers said what is left answers `ok`: read as nothing
    /// known (the client then waits for its answers, as without `RATE_LIMIT_AHEAD`), so a
    /// regional Worker deployed before the edge keeps charging through the old limiter.
    fn read(_status: u16, body: &str) -> Result<Self, serde_json::Error> {
        if body.trim() == "ok" {
            return Ok(Taken::default());
        }
        serde_json::from_str(body)
    }
}

/// A 2xx answer whose body says nothing more (the rate limiter's settle).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack;

impl Answer for Ack {
    const READS_BODY: bool = false;
    fn reply(&self) -> Result<Reply, serde_json::Error> {
        Ok(Reply {
            status: 200,
            content_type: "text/plain;charset=UTF-8",
            headers: Vec::new(),
            body: "ok".to_string(),
        })
    }
    fn read(_status: u16, _body: &str) -> Result<Self, serde_json::Error> {
        Ok(Ack)
    }
}

/// A Prometheus text exposition (a pool shard's `/metrics` page).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsPage(pub String);

impl Answer for MetricsPage {
    fn reply(&self) -> Result<Reply, serde_json::Error> {
        Ok(Reply {
            status: 200,
            content_type: "text/plain; version=0.0.4",
            headers: Vec::new(),
            body: self.0.clone(),
        })
    }
    fn read(_status: u16, body: &str) -> Result<Self, serde_json::Error> {
        Ok(MetricsPage(body.to_string()))
    }
}

/// A JSON page the Worker relays to the admin API as it is, never reading it (the pool's
/// history, a `crate::messages::PoolHistory`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPage(pub String);

impl Answer for JsonPage {
    fn reply(&self) -> Result<Reply, serde_json::Error> {
        Ok(Reply {
            status: 200,
            content_type: "application/json",
            headers: Vec::new(),
            body: self.0.clone(),
        })
    }
    fn read(_status: u16, body: &str) -> Result<Self, serde_json::Error> {
        Ok(JsonPage(body.to_string()))
    }
}

// ---- Calls ----------------------------------------------------------------------------------

/// Messages that are their call's JSON body, on a route that names nothing.
macro_rules! json_calls {
    ($($msg:ty => $answer:ty, $route:expr;)+) => {$(
        impl Call for $msg {
            type Answer = $answer;
            fn route(&self) -> Route {
                $route
            }
            fn body(&self) -> Result<Option<String>, serde_json::Error> {
                serde_json::to_string(self).map(Some)
            }
        }
    )+};
}

json_calls! {
    DequeueRequest => DequeueAnswer, Route::Dequeue;
    ReleaseRequest => ReleaseAnswer, Route::Release;
    ReleaseBatch => ReleaseBatchAnswer, Route::ReleaseBatch;
    RenewRequest => RenewAnswer, Route::Renew;
    PrefillDone => PrefillDoneAnswer, Route::PrefillDone;
    ResponseHolder => ResponseHolderAnswer, Route::ResponseHolder;
    BackendRegistration => BackendView, Route::RegisterBackend;
    PoolSettings => PoolSettings, Route::PutConfig;
    LoadReport => LoadReportAnswer, Route::ShardLoad;
    ProbeRound => ShardAck, Route::ShardProbes;
    ShardRegistry => ShardAck, Route::ShardRegistry;
    StoredKey => StoredKey, Route::AddKey;
    TakeRequest => Taken, Route::TakeTokens;
    SettleRequest => Ack, Route::SettleTokens;
}

/// Unit structs for the routes without a body or a name in their path.
macro_rules! bodiless_calls {
    ($($(#[$doc:meta])* $msg:ident => $answer:ty, $route:expr;)+) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $msg;

        impl Call for $msg {
            type Answer = $answer;
            fn route(&self) -> Route {
                $route
            }
            fn body(&self) -> Result<Option<String>, serde_json::Error> {
                Ok(None)
            }
        }
    )+};
}

bodiless_calls! {
    /// `GET /backends`: the pool shard's backends.
    ListBackends => BackendList, Route::ListBackends;
    /// `GET /models`: the models some ready, healthy backend serves.
    Models => ModelsAnswer, Route::Models;
    /// `GET /config`: the pool's settings.
    GetConfig => PoolSettings, Route::GetConfig;
    /// `GET /state`: the pool shard at a glance.
    Summary => PoolSummary, Route::Summary;
    /// `GET /metrics`: the pool shard's Prometheus page.
    Metrics => MetricsPage, Route::Metrics;
    /// `GET /history`: the pool's last hour, minute by minute.
    History => JsonPage, Route::History;
    /// `POST /probe/ensure`: keep the probe alarm armed (the cron trigger).
    EnsureProbeAlarm => AlarmAnswer, Route::EnsureProbeAlarm;
    /// `POST /probe/now`: probe every backend now, then summarise the pool.
    ProbeNow => PoolSummary, Route::ProbeNow;
    /// `GET /pools` (directory): every pool.
    ListPools => Vec<PoolEntry>, Route::ListPools;
    /// `GET /keys` (directory): every minted client key (hashes only).
    ListKeys => Vec<StoredKey>, Route::ListKeys;
}

/// `GET /backends/{id}`: one backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShowBackend(pub String);

impl Call for ShowBackend {
    type Answer = AdminBackend;
    fn route(&self) -> Route {
        Route::ShowBackend(self.0.clone())
    }
    fn body(&self) -> Result<Option<String>, serde_json::Error> {
        Ok(None)
    }
}

/// `PATCH /backends/{id}`: the admin's patch as written (checked as a
/// [`crate::messages::AdminPatch`] first; re-encoding it would lose an `api_key` set to `null`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatchBackend {
    /// The backend.
    pub id: String,
    /// The patch's JSON text.
    pub json: String,
}

impl Call for PatchBackend {
    type Answer = AdminBackend;
    fn route(&self) -> Route {
        Route::PatchBackend(self.id.clone())
    }
    fn body(&self) -> Result<Option<String>, serde_json::Error> {
        Ok(Some(self.json.clone()))
    }
}

/// `DELETE /backends/{id}[?force=true]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteBackend {
    /// The backend.
    pub id: String,
    /// Remove it now even with requests in flight.
    pub force: bool,
}

impl Call for DeleteBackend {
    type Answer = DeleteAnswer;
    fn route(&self) -> Route {
        Route::DeleteBackend {
            id: self.id.clone(),
            force: self.force,
        }
    }
    fn body(&self) -> Result<Option<String>, serde_json::Error> {
        Ok(None)
    }
}

impl Call for PoolEntry {
    type Answer = PoolEntry;
    fn route(&self) -> Route {
        Route::PutPool(self.name.clone())
    }
    fn body(&self) -> Result<Option<String>, serde_json::Error> {
        serde_json::to_string(self).map(Some)
    }
}

/// `PUT /pools/{name}/card` (pool shard 0 to the directory): the pool's latest time card.
#[derive(Debug, Clone, PartialEq)]
pub struct PutCard {
    /// The pool.
    pub pool: String,
    /// Its card.
    pub card: TimeCard,
}

impl Call for PutCard {
    type Answer = CardAnswer;
    fn route(&self) -> Route {
        Route::PutCard(self.pool.clone())
    }
    fn body(&self) -> Result<Option<String>, serde_json::Error> {
        serde_json::to_string(&self.card).map(Some)
    }
}

/// `PATCH /keys/{id}` (directory).
#[derive(Debug, Clone)]
pub struct PatchKey {
    /// The key's id.
    pub id: String,
    /// The change.
    pub patch: KeyPatch,
}

impl Call for PatchKey {
    type Answer = KeyPatchAnswer;
    fn route(&self) -> Route {
        Route::PatchKey(self.id.clone())
    }
    fn body(&self) -> Result<Option<String>, serde_json::Error> {
        serde_json::to_string(&self.patch).map(Some)
    }
}

/// `DELETE /keys/{id}` (directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteKey(pub String);

impl Call for DeleteKey {
    type Answer = DeleteAnswer;
    fn route(&self) -> Route {
        Route::DeleteKey(self.0.clone())
    }
    fn body(&self) -> Result<Option<String>, serde_json::Error> {
        Ok(None)
    }
}
