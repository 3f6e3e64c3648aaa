//! A pool's settings as the admin API sets them (`PUT /config`) and the pool stores them, and the
//! name rule every id, pool and region obeys. Both sides validate with the same functions: the
//! Worker before a new pool's first call carries its location hint, the pool before applying.

use crate::error::ApiError;
use crate::messages::PoolEntry;
use routing_core::coordinator::retry_budget::RetryBudgetConfig;
use routing_core::pool::PoolConfig;
use serde::{Deserialize, Serialize};

/// Default timeout of each probe request.
pub const DEFAULT_PROBE_TIMEOUT_MS: u64 = 2_000;
/// Longest accepted id or model name; ids appear in URLs and metric labels.
const MAX_NAME_LEN: usize = 128;
/// Durable Object location hints the platform knows.
const LOCATION_HINTS: [&str; 9] = [
    "wnam", "enam", "sam", "weur", "eeur", "apac", "oc", "afr", "me",
];

/// Checks a list of jurisdictions (a key's or a pool's residency): at most 16 names.
pub fn validate_residency(list: &[String]) -> Result<(), ApiError> {
    if list.len() > 16 {
        return Err(
            ApiError::bad_request("residency lists at most 16 jurisdictions")
                .with_param("residency"),
        );
    }
    list.iter().try_for_each(|j| validate_name("residency", j))
}

/// Checks a name used as an id, pool or region: printable, no path or label metacharacters.
pub fn validate_name(field: &str, value: &str) -> Result<(), ApiError> {
    let ok = !value.is_empty()
        && value.len() <= MAX_NAME_LEN
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '@'))
        && value != "."
        && value != "..";
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "`{field}` must be 1-{MAX_NAME_LEN} characters of letters, digits, '-', '_', '.', ':' or '@'"
        ))
        .with_param(field))
    }
}

/// A pool's settings: the routing core's configuration plus what the coordinator itself uses.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PoolSettings {
    /// Policy and routing knobs.
    #[serde(flatten)]
    pub routing: PoolConfig,
    /// Retry-budget knobs.
    pub retry_budget: RetryBudgetConfig,
    /// Time between probe rounds, ms (0: the `PROBE_INTERVAL_MS` var or 10,000).
    pub probe_interval_ms: u64,
    /// Timeout of each probe request, ms.
    pub probe_timeout_ms: u64,
    /// The pool counts as saturated, and new work spills to the next pool when there is one, when
    /// its backends' scraped waiting queues average more than this per ready backend (0: never).
    pub saturation_waiting_per_backend: f64,
    /// Autoscaling signal: the waiting requests one replica should carry (HPA/KEDA target).
    pub autoscale_target_waiting: f64,
    /// Durable Object location hint for this pool (for example `enam`, `weur`); used when the
    /// Worker first addresses the pool.
    pub location_hint: Option<String>,
    /// Jurisdiction of the pool's GPUs (for example `eu`): a request restricted to some
    /// jurisdictions is served only by pools in them.
    pub jurisdiction: String,
    /// Jurisdictions that may serve the requests whose nearest pool this is (empty: any): with
    /// `["eu"]`, requests from this pool's region never leave the EU, even when it is full.
    pub residency: Vec<String>,
}

impl Default for PoolSettings {
    fn default() -> Self {
        PoolSettings {
            routing: PoolConfig::default(),
            retry_budget: RetryBudgetConfig::default(),
            probe_interval_ms: 0,
            probe_timeout_ms: DEFAULT_PROBE_TIMEOUT_MS,
            saturation_waiting_per_backend: 16.0,
            autoscale_target_waiting: 4.0,
            location_hint: None,
            jurisdiction: String::new(),
            residency: Vec::new(),
        }
    }
}

impl PoolSettings {
    /// Parses settings as the admin API takes them: like any JSON of them (missing knobs
    /// default), but a key no knob has is refused (400 naming it, e.g.
    /// `predicted_latency.tail_harm_weight` sent at the top level), instead of being dropped and the
    /// pool running on defaults the caller did not ask for. (`deny_unknown_fields` does not work
    /// through the flattened routing config, so the parsed settings are written back and every
    /// key sent must be among those written.) The same as [`PoolSettings::merge_strict`] onto
    /// the defaults.
    pub fn parse_strict(text: &str) -> Result<PoolSettings, ApiError> {
        PoolSettings::default().merge_strict(text)
    }

    /// `PUT /admin/pools/{pool}`'s rule: the knobs sent are merged onto `self` (the settings in
    /// effect), so a partial body changes only what it names and keeps every other knob, `region`,
    /// `location_hint`, `shards`, `jurisdiction` and `residency` included (objects merge key by
    /// key; any other value replaces). Keys no knob has are refused as in
    /// [`PoolSettings::parse_strict`].
    ///
    /// Residency only widens on purpose: a pool's `jurisdiction` or `residency` is removed only by
    /// sending it as an explicit `null`; an empty value (`""`, `[]`, what a settings template
    /// defaults to) where one is set is refused with 400 naming the field. Another non-empty value
    /// replaces it (naming the jurisdictions is the explicit call).
    pub fn merge_strict(&self, text: &str) -> Result<PoolSettings, ApiError> {
        let invalid = |e: serde_json::Error| ApiError::invalid_body("pool configuration", e);
        let mut sent: serde_json::Value = serde_json::from_str(text).map_err(invalid)?;
        let serde_json::Value::Object(fields) = &mut sent else {
            return Err(ApiError::bad_request(
                "invalid pool configuration: expected a JSON object of settings",
            ));
        };
        for (key, set, empty) in [
            (
                "jurisdiction",
                !self.jurisdiction.is_empty(),
                serde_json::json!(""),
            ),
            (
                "residency",
                !self.residency.is_empty(),
                serde_json::json!([]),
            ),
        ] {
            match fields.get_mut(key) {
                // The explicit removal.
                Some(v) if v.is_null() => *v = empty,
                Some(v) if set && *v == empty => {
                    return Err(ApiError::bad_request(format!(
                        "the pool's `{key}` is set: an empty `{key}` would lift its residency; \
                         send `\"{key}\": null` to remove it on purpose, or leave it out to keep it"
                    ))
                    .with_param(key))
                }
                _ => {}
            }
        }
        let mut merged = serde_json::to_value(self).map_err(invalid)?;
        merge_json(&mut merged, &sent);
        let settings: PoolSettings = serde_json::from_value(merged).map_err(invalid)?;
        let known = serde_json::to_value(&settings).map_err(invalid)?;
        match unknown_key(&sent, &known, "") {
            Some(key) => Err(ApiError::bad_request(format!(
                "invalid pool configuration: unknown setting `{key}`"
            ))
            .with_param(key)),
            None => Ok(settings),
        }
    }

    /// The settings in effect for a pool the directory lists as `entry`: these (the pool's
    /// stored ones) with the placement and residency the directory routes on wherever these
    /// leave them unset (a pool a registration created has its region in the directory only).
    /// What a partial `PUT` is merged onto, so it cannot drop what routing enforces.
    pub fn in_effect(mut self, entry: &PoolEntry) -> PoolSettings {
        if self.routing.region.is_empty() {
            self.routing.region = entry.region.clone();
        }
        if self.location_hint.is_none() {
            self.location_hint = entry.location_hint.clone();
        }
        if self.jurisdiction.is_empty() {
            self.jurisdiction = entry.jurisdiction.clone();
        }
        if self.residency.is_empty() {
            self.residency = entry.residency.clone();
        }
        self
    }

    /// Checks every knob.
    pub fn validate(&self) -> Result<(), ApiError> {
        self.routing
            .validate()
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        self.retry_budget
            .validate()
            .map_err(ApiError::bad_request)?;
        if self.probe_interval_ms != 0 && !(500..=3_600_000).contains(&self.probe_interval_ms) {
            return Err(ApiError::bad_request(
                "probe_interval_ms must be 0 (default) or 500-3,600,000",
            )
            .with_param("probe_interval_ms"));
        }
        if !self.routing.region.is_empty() {
            validate_name("region", &self.routing.region)?;
        }
        if !self.jurisdiction.is_empty() {
            validate_name("jurisdiction", &self.jurisdiction)?;
        }
        validate_residency(&self.residency)?;
        if !(self.saturation_waiting_per_backend.is_finite()
            && self.saturation_waiting_per_backend >= 0.0)
        {
            return Err(ApiError::bad_request(
                "saturation_waiting_per_backend must be a number >= 0",
            )
            .with_param("saturation_waiting_per_backend"));
        }
        if !(self.autoscale_target_waiting.is_finite() && self.autoscale_target_waiting > 0.0) {
            return Err(
                ApiError::bad_request("autoscale_target_waiting must be a number > 0")
                    .with_param("autoscale_target_waiting"),
            );
        }
        if let Some(hint) = &self.location_hint {
            if !LOCATION_HINTS.contains(&hint.as_str()) {
                return Err(ApiError::bad_request(
                    "location_hint must be one of wnam, enam, sam, weur, eeur, apac, oc, afr, me",
                )
                .with_param("location_hint"));
            }
        }
        if !(100..=60_000).contains(&self.probe_timeout_ms) {
            return Err(
                ApiError::bad_request("probe_timeout_ms must be between 100 and 60,000")
                    .with_param("probe_timeout_ms"),
            );
        }
        Ok(())
    }
}

/// Merges `sent` onto `base`: objects key by key, any other value replaces.
fn merge_json(base: &mut serde_json::Value, sent: &serde_json::Value) {
    match (base, sent) {
        (serde_json::Value::Object(base), serde_json::Value::Object(sent)) => {
            for (key, value) in sent {
                match base.get_mut(key) {
                    Some(b) if b.is_object() && value.is_object() => merge_json(b, value),
                    _ => {
                        base.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        (base, sent) => *base = sent.clone(),
    }
}

/// The first key of `sent` (dotted from `at`) that `known` lacks, looking into objects both have.
fn unknown_key(sent: &serde_json::Value, known: &serde_json::Value, at: &str) -> Option<String> {
    let (serde_json::Value::Object(sent), serde_json::Value::Object(known)) = (sent, known) else {
        return None;
    };
    sent.iter().find_map(|(key, value)| {
        let path = if at.is_empty() {
            key.clone()
        } else {
            format!("{at}.{key}")
        };
        match known.get(key) {
            None => Some(path),
            Some(known) => unknown_key(value, known, &path),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setting_no_knob_has_is_refused_by_its_path() {
        let ok = PoolSettings::parse_strict(
            r#"{"policy": "predicted_latency", "probe_interval_ms": 1000,
                "predicted_latency": {"tail_harm_weight": 0.5}, "location_hint": null}"#,
        )
        .unwrap();
        assert_eq!(ok.routing.predicted_latency.tail_harm_weight, 0.5);
        assert_eq!(ok.probe_interval_ms, 1000);
        for (body, key) in [
            (r#"{"tail_harm_weight": 0.5}"#, "tail_harm_weight"),
            (
                r#"{"predicted_latency": {"tail_harm": 0.5}}"#,
                "predicted_latency.tail_harm",
            ),
            (
                r#"{"retry_budget": {"ratio": 0.2, "oops": 1}}"#,
                "retry_budget.oops",
            ),
        ] {
            let e = PoolSettings::parse_strict(body).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some(key)), "{body}");
            assert!(e.message.contains(key), "{}", e.message);
        }
        assert_eq!(PoolSettings::parse_strict("{").unwrap_err().status, 400);
        assert_eq!(
            PoolSettings::parse_strict("{}").unwrap(),
            PoolSettings::default()
        );
    }

    /// Issue 42, item 1: the README's own scaling example must not clear a pool's residency.
    #[test]
    fn a_partial_put_keeps_every_knob_not_sent_residency_included() {
        let stored = PoolSettings::parse_strict(
            r#"{"region": "eu-west", "location_hint": "weur", "jurisdiction": "eu",
                "residency": ["eu"], "policy": "power_of_two", "probe_interval_ms": 2000,
                "predicted_latency": {"tail_harm_weight": 0.5}}"#,
        )
        .unwrap();
        let scaled = stored.merge_strict(r#"{"shards": 4}"#).unwrap();
        assert_eq!(scaled.routing.shards, 4);
        assert_eq!(
            scaled,
            PoolSettings {
                routing: PoolConfig {
                    shards: 4,
                    ..stored.routing.clone()
                },
                ..stored.clone()
            }
        );
        // Nested objects merge key by key.
        let nested = stored
            .merge_strict(r#"{"predicted_latency": {"tail_harm_weight": 0.25}}"#)
            .unwrap();
        assert_eq!(nested.routing.predicted_latency.tail_harm_weight, 0.25);
        assert_eq!(nested.routing.policy, stored.routing.policy);
        assert_eq!(nested.residency, vec!["eu".to_string()]);
        // Widening is explicit: empty values are refused, `null` removes.
        for (body, key) in [
            (r#"{"jurisdiction": ""}"#, "jurisdiction"),
            (r#"{"residency": []}"#, "residency"),
        ] {
            let e = stored.merge_strict(body).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some(key)), "{body}");
        }
        let lifted = stored
            .merge_strict(r#"{"jurisdiction": null, "residency": null}"#)
            .unwrap();
        assert_eq!(
            (lifted.jurisdiction.as_str(), lifted.residency.len()),
            ("", 0)
        );
        assert_eq!(lifted.routing.region, "eu-west");
        let moved = stored
            .merge_strict(r#"{"residency": ["eu", "ch"]}"#)
            .unwrap();
        assert_eq!(moved.residency, vec!["eu".to_string(), "ch".to_string()]);
        // Unknown keys are still refused, and a body that is not an object too.
        let e = stored
            .merge_strict(r#"{"tail_harm_weight": 1}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tail_harm_weight"));
        assert_eq!(stored.merge_strict("[1]").unwrap_err().status, 400);
    }

    #[test]
    fn the_directory_fills_what_the_stored_settings_leave_unset() {
        let entry = PoolEntry {
            name: "p".into(),
            region: "eu-west".into(),
            location_hint: Some("weur".into()),
            shards: 1,
            shard_objects: 1,
            jurisdiction: "eu".into(),
            residency: vec!["eu".into()],
            card: None,
        };
        let s = PoolSettings::default().in_effect(&entry);
        assert_eq!(s.routing.region, "eu-west");
        assert_eq!(s.location_hint.as_deref(), Some("weur"));
        assert_eq!((s.jurisdiction.as_str(), s.residency.len()), ("eu", 1));
        let s = s.merge_strict(r#"{"shards": 2}"#).unwrap();
        assert_eq!((s.jurisdiction.as_str(), s.routing.shards), ("eu", 2));
    }

    #[test]
    fn names_allow_ids_and_refuse_path_tricks() {
        assert!(validate_name("id", "b-1.eu:x@y_z").is_ok());
        for bad in ["", ".", "..", "a/b", "a b", "a?b", &"x".repeat(129)] {
            let e = validate_name("id", bad).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some("id")), "{bad}");
        }
    }

    #[test]
    fn defaults_validate_and_bad_knobs_name_their_field() {
        assert!(PoolSettings::default().validate().is_ok());
        let bad = |f: fn(&mut PoolSettings)| {
            let mut s = PoolSettings::default();
            f(&mut s);
            s.validate().unwrap_err().param
        };
        assert_eq!(
            bad(|s| s.probe_interval_ms = 10).as_deref(),
            Some("probe_interval_ms")
        );
        assert_eq!(
            bad(|s| s.autoscale_target_waiting = 0.0).as_deref(),
            Some("autoscale_target_waiting")
        );
        assert_eq!(
            bad(|s| s.location_hint = Some("mars".into())).as_deref(),
            Some("location_hint")
        );
        assert_eq!(
            bad(|s| s.probe_timeout_ms = 5).as_deref(),
            Some("probe_timeout_ms")
        );
        assert_eq!(
            bad(|s| s.saturation_waiting_per_backend = f64::NAN).as_deref(),
            Some("saturation_waiting_per_backend")
        );
    }
}
