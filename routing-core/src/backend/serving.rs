//! Whether a backend serves a model now: the one rule the acquire's filter, the pool's time card
//! and the `/v1/models` list all ask, so a pool never lists a model it would refuse, nor refuses a
//! model its card advertises.
//!
//! A backend serves `model` when it takes traffic at all ([`is_up`]: its lifecycle is
//! [`Lifecycle::Ready`] and its probes say [`HealthState::Healthy`]) and lists the model (its last
//! probe's `/v1/models` when it has one, else the models it was registered with, less a model it
//! answered "does not exist" for since). A backend still loading its weights (`/health` answers
//! 503), never probed yet ([`HealthState::Unknown`]) or failing its probes serves nothing: a request
//! sent there now is refused or waits for a server that cannot answer it, so a pool whose only
//! backends are loading must not advertise their models, or the Worker's walk prefers it over a
//! pool that can answer. The filter still tells "lists the model but is not up" (come back later,
//! 503) from "does not list it" (404), which is why [`Serving::lists`] is separate.

use super::health::{Health, HealthState};
use super::{BackendSpec, Lifecycle};

/// Whether a backend in `lifecycle` with probe state `health` takes any traffic now.
pub fn is_up(lifecycle: Lifecycle, health: HealthState) -> bool {
    lifecycle == Lifecycle::Ready && health == HealthState::Healthy
}

/// What the rule reads of one backend, borrowed from wherever the pool keeps it.
#[derive(Debug, Clone, Copy)]
pub struct Serving<'a> {
    /// What was registered (its models are the fallback list).
    pub spec: &'a BackendSpec,
    /// The models its last successful probe listed, if any.
    pub probed_models: Option<&'a [String]>,
    /// Whether it may take new traffic.
    pub lifecycle: Lifecycle,
    /// Its probes' state and the model it said it lacks.
    pub health: &'a Health,
}

impl<'a> Serving<'a> {
    /// The models the backend says it has: its probe's list when non-empty, else the registered
    /// ones (whether it is up or not).
    pub fn listed_models(&self) -> &'a [String] {
        match self.probed_models {
            Some(models) if !models.is_empty() => models,
            _ => &self.spec.models,
        }
    }

    /// Whether it lists `model` (and has not answered since that it lacks it), up or not.
    pub fn lists(&self, model: &str) -> bool {
        self.health.missing_model.as_deref() != Some(model)
            && self.listed_models().iter().any(|m| m == model)
    }

    /// Whether it takes any traffic now (see [`is_up`]).
    pub fn is_up(&self) -> bool {
        is_up(self.lifecycle, self.health.state)
    }

    /// The rule: whether it serves `model` now.
    pub fn serves(&self, model: &str) -> bool {
        self.is_up() && self.lists(model)
    }

    /// Every model it serves now (none when it is not up).
    pub fn served_models(&self) -> impl Iterator<Item = &'a String> + 'a {
        let up = self.is_up();
        let missing = self.health.missing_model.as_deref();
        self.listed_models()
            .iter()
            .filter(move |m| up && Some(m.as_str()) != missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(models: &[&str]) -> BackendSpec {
        BackendSpec {
            models: models.iter().map(|m| m.to_string()).collect(),
            ..BackendSpec::default()
        }
    }

    fn health(state: HealthState) -> Health {
        Health {
            state,
            ..Health::default()
        }
    }

    #[test]
    fn only_a_ready_healthy_backend_serves() {
        let s = spec(&["m"]);
        for state in [
            HealthState::Unknown,
            HealthState::Loading,
            HealthState::Unhealthy,
        ] {
            let h = health(state);
            let b = Serving {
                spec: &s,
                probed_models: None,
                lifecycle: Lifecycle::Ready,
                health: &h,
            };
            assert!(b.lists("m") && !b.serves("m"), "{state:?}");
            assert_eq!(b.served_models().count(), 0, "{state:?}");
        }
        let h = health(HealthState::Healthy);
        for lifecycle in [Lifecycle::Pending, Lifecycle::Draining, Lifecycle::Drained] {
            let b = Serving {
                spec: &s,
                probed_models: None,
                lifecycle,
                health: &h,
            };
            assert!(!b.serves("m"), "{lifecycle:?}");
        }
        let b = Serving {
            spec: &s,
            probed_models: None,
            lifecycle: Lifecycle::Ready,
            health: &h,
        };
        assert!(b.serves("m") && !b.serves("other"));
    }

    #[test]
    fn the_probe_list_replaces_the_registered_one_and_a_missing_model_is_not_served() {
        let s = spec(&["registered"]);
        let probed = vec!["a".to_string(), "b".to_string()];
        let mut h = health(HealthState::Healthy);
        let b = Serving {
            spec: &s,
            probed_models: Some(&probed),
            lifecycle: Lifecycle::Ready,
            health: &h,
        };
        assert!(b.serves("a") && b.serves("b") && !b.serves("registered"));
        let empty: Vec<String> = Vec::new();
        let b = Serving {
            probed_models: Some(&empty),
            ..b
        };
        assert!(
            b.serves("registered"),
            "an empty probe list means as registered"
        );
        h.missing_model = Some("registered".into());
        let b = Serving {
            spec: &s,
            probed_models: Some(&empty),
            lifecycle: Lifecycle::Ready,
            health: &h,
        };
        assert!(!b.lists("registered") && !b.serves("registered"));
        assert_eq!(b.served_models().count(), 0);
    }
}
