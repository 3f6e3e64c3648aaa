//! The gateway's admin API as the benchmark uses it: register the fleet in the pool, set the
//! policy, force probes until every backend is ready, dump the pool's state for diagnosis.

use crate::client::Http;
use hyper::Method;
use serde_json::json;
use std::path::Path;
use std::time::{Duration, Instant};

/// The gateway's admin API, as far as the benchmark needs it.
pub struct Gateway {
    /// Base URL.
    pub url: String,
    /// Admin bearer token.
    pub token: String,
    /// Pool name.
    pub pool: String,
    http: Http,
}

impl Gateway {
    /// A handle on the gateway at `url`.
    pub fn new(url: String, token: String, pool: String, http: Http) -> Self {
        Gateway {
            url,
            token,
            pool,
            http,
        }
    }

    async fn admin(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(u16, String), String> {
        self.http
            .call(
                method,
                &format!("{}/admin{path}", self.url),
                Some(&self.token),
                body.map(|b| b.to_string()),
            )
            .await
    }

    /// Checks the token works.
    pub async fn check(&self) -> Result<(), String> {
        match self.admin(Method::GET, "/backends", None).await? {
            (200, _) => Ok(()),
            (s, body) => Err(format!("admin API answered {s}: {body}")),
        }
    }

    /// Removes every backend of the pool (purging their affinity) and registers the fleet again.
    pub async fn register(&self, members: &[(String, String)], model: &str) -> Result<(), String> {
        let (_, listing) = self.admin(Method::GET, "/backends", None).await?;
        let listing: serde_json::Value = serde_json::from_str(&listing).unwrap_or_default();
        let urls: Vec<&str> = members.iter().map(|(_, u)| u.as_str()).collect();
        for b in listing
            .get("data")
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
        {
            let field = |k: &str| b.get(k).and_then(serde_json::Value::as_str).unwrap_or("");
            if field("pool") == self.pool || urls.contains(&field("url")) {
                let path = format!(
                    "/backends/{}?force=true&pool={}",
                    field("id"),
                    field("pool")
                );
                self.admin(Method::DELETE, &path, None).await?;
            }
        }
        for (id, url) in members {
            let body = json!({"id": id, "url": url, "pool": self.pool, "models": [model]});
            match self.admin(Method::POST, "/backends", Some(body)).await? {
                (200 | 201, _) => {}
                (s, b) => return Err(format!("registering {id}: HTTP {s}: {b}")),
            }
        }
        Ok(())
    }

    /// Sets the pool's policy (probing every second so scraped load stays fresh). `Ok(Err(..))`:
    /// the gateway refused the policy (400, e.g. a name this build does not know). A policy
    /// written `name+{json}` also sets the pool's knobs in that JSON object (for example
    /// `predicted_latency+{"time_model":{"prefill_interference":0}}`), so a knob's variants run
    /// side by side in one bench as rows of their own.
    pub async fn set_policy(&self, policy: &str) -> Result<Result<(), String>, String> {
        let (name, knobs) = match policy.split_once('+') {
            Some((name, knobs)) => match serde_json::from_str::<serde_json::Value>(knobs) {
                Ok(serde_json::Value::Object(knobs)) => (name, knobs),
                _ => {
                    return Ok(Err(format!(
                        "{policy}: the knobs after '+' are not a JSON object"
                    )))
                }
            },
            None => (policy, serde_json::Map::new()),
        };
        let mut body = json!({"policy": name, "probe_interval_ms": 1000});
        body.as_object_mut().expect("a JSON object").extend(knobs);
        match self
            .admin(Method::PUT, &format!("/pools/{}", self.pool), Some(body))
            .await?
        {
            (200, _) => Ok(Ok(())),
            (400 | 422, b) => Ok(Err(format!("HTTP 400: {b}"))),
            (s, b) => Err(format!("setting policy {policy}: HTTP {s}: {b}")),
        }
    }

    /// Writes the pool's state and backends (for diagnosis) to `path`; failures are ignored.
    pub async fn dump_state(&self, path: &Path) {
        let pool = self
            .admin(Method::GET, &format!("/pools/{}", self.pool), None)
            .await
            .map(|r| r.1)
            .unwrap_or_default();
        let backends = self
            .admin(Method::GET, "/backends", None)
            .await
            .map(|r| r.1)
            .unwrap_or_default();
        let parse = |t: &str| {
            serde_json::from_str::<serde_json::Value>(t).unwrap_or(serde_json::Value::Null)
        };
        let doc = json!({"pool": parse(&pool), "backends": parse(&backends)});
        let _ = std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap_or_default());
    }

    /// Forces probe rounds until `n` backends are ready.
    pub async fn wait_ready(&self, n: usize) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.admin(Method::POST, &format!("/pools/{}/probe", self.pool), None)
                .await?;
            let (_, body) = self
                .admin(Method::GET, &format!("/pools/{}", self.pool), None)
                .await?;
            let ready = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("ready_backends").and_then(serde_json::Value::as_u64))
                .unwrap_or(0);
            if ready as usize >= n {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("only {ready} of {n} backends became ready: {body}"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Splits a list of policies given as one comma-separated argument at its top-level commas only,
/// so a policy's knobs (`name+{json}`) may hold commas of their own:
/// `a,b+{"x":{"y":1,"z":2}}` is two policies.
pub fn split_policies(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for arg in args {
        let (mut depth, mut start) = (0i32, 0);
        for (i, ch) in arg.char_indices() {
            match ch {
                '{' | '[' => depth += 1,
                '}' | ']' => depth -= 1,
                ',' if depth == 0 => {
                    out.push(arg[start..i].to_string());
                    start = i + 1;
                }
                _ => {}
            }
        }
        out.push(arg[start..].to_string());
    }
    out.retain(|p| !p.is_empty());
    out
}

#[cfg(test)]
mod tests {
    use super::split_policies;

    #[test]
    fn policies_split_at_top_level_commas_only() {
        let args = vec![
            r#"round_robin,predicted_latency+{"predicted_latency":{"a":1,"b":[2,3]}}"#.to_string(),
            "smg,".to_string(),
        ];
        assert_eq!(
            split_policies(&args),
            vec![
                "round_robin",
                r#"predicted_latency+{"predicted_latency":{"a":1,"b":[2,3]}}"#,
                "smg"
            ]
        );
    }
}
