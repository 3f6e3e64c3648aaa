//! Another router in front of the fleet, for the goodput benchmark (the SGLang/Shepherd gateway,
//! smg, by default): a command template started fresh for every window on a free loopback port
//! (its own process group, stopped with the group), waited for until it reports the fleet
//! healthy, and an optional set-up command run once before its first start (an install).

use crate::client::Http;
use hyper::Method;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// An external router as the goodput config describes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExternalRouter {
    /// Its name in `--routers` and the tables.
    pub name: String,
    /// Run once before its first start when the command's program is missing (an install); a
    /// failure skips the router with the command's last output line as the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub setup: Vec<String>,
    /// The command; `{port}` is its port, `{metrics_port}` another free one, and an argument
    /// `{workers}` becomes one argument per backend URL.
    pub command: Vec<String>,
    /// The readiness path, answered with 200 once the router routes.
    pub ready_path: String,
    /// A JSON number field of the readiness answer that must reach the fleet's size (smg's
    /// `healthy_workers`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_count_field: Option<String>,
}

/// The command line of `router` for `port`, `metrics_port` and `workers`.
pub fn command_line(
    router: &ExternalRouter,
    port: u16,
    metrics_port: u16,
    workers: &[String],
) -> Vec<String> {
    router
        .command
        .iter()
        .flat_map(|a| {
            if a == "{workers}" {
                workers.to_vec()
            } else {
                vec![a
                    .replace("{port}", &port.to_string())
                    .replace("{metrics_port}", &metrics_port.to_string())]
            }
        })
        .collect()
}

/// Whether a readiness answer `body` counts `backends` healthy (always, without a count field).
pub fn ready_answer(field: Option<&str>, body: &str, backends: usize) -> bool {
    let Some(field) = field else { return true };
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get(field).and_then(serde_json::Value::as_u64))
        .is_some_and(|n| n as usize >= backends)
}

/// A free loopback port (bound and released: another process may take it in between, rarely).
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// Runs `router`'s set-up if its program is missing; `Err` (the reason to skip it) on failure.
pub async fn set_up(router: &ExternalRouter) -> Result<(), String> {
    let program = router.command.first().ok_or("an empty command")?;
    if Path::new(program).exists() || router.setup.is_empty() {
        return Ok(());
    }
    eprintln!(
        "goodput: setting up {}: {}",
        router.name,
        router.setup.join(" ")
    );
    let out = Command::new(&router.setup[0])
        .args(&router.setup[1..])
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| format!("{}: {e}", router.setup[0]))?;
    let last = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .lines()
            .last()
            .unwrap_or("")
            .to_string()
    };
    if !out.status.success() {
        return Err(format!(
            "set-up `{}` failed: {}",
            router.setup.join(" "),
            last(&out.stderr)
        ));
    }
    if !Path::new(program).exists() {
        return Err(format!("set-up ran but {program} is missing"));
    }
    Ok(())
}

/// A started external router.
pub struct Running {
    /// Its base URL.
    pub url: String,
    child: Child,
}

/// Starts `router` in front of `workers` and waits (60 s at most) until it is ready; its output
/// is appended to `<log_dir>/<name>.log`.
pub async fn start(
    router: &ExternalRouter,
    workers: &[String],
    log_dir: &Path,
    http: &Http,
) -> Result<Running, String> {
    let (port, metrics_port) = (free_port()?, free_port()?);
    let args = command_line(router, port, metrics_port, workers);
    let log_path: PathBuf = log_dir.join(format!("{}.log", router.name.replace(' ', "_")));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| format!("{}: {e}", log_path.display()))?;
    let child = Command::new(&args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", args[0]))?;
    let mut running = Running {
        url: format!("http://127.0.0.1:{port}"),
        child,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let answer = http
            .call(
                Method::GET,
                &format!("{}{}", running.url, router.ready_path),
                None,
                None,
            )
            .await;
        if let Ok((200, body)) = answer {
            if ready_answer(router.ready_count_field.as_deref(), &body, workers.len()) {
                return Ok(running);
            }
        }
        if let Ok(Some(status)) = running.child.try_wait() {
            return Err(format!(
                "{} exited ({status}); see {}",
                router.name,
                log_path.display()
            ));
        }
        if Instant::now() > deadline {
            running.stop().await;
            return Err(format!(
                "{} was not ready in 60 s; see {}",
                router.name,
                log_path.display()
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

impl Running {
    /// Stops the router's process group: SIGTERM, then SIGKILL after 10 s.
    pub async fn stop(&mut self) {
        let Some(pid) = self.child.id() else { return };
        let group = |sig: &str| {
            std::process::Command::new("kill")
                .args([sig, "--", &format!("-{pid}")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
        };
        let _ = group("-TERM");
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = group("-KILL");
            let _ = self.child.wait().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_template_and_the_readiness_count() {
        let r = ExternalRouter {
            name: "smg".into(),
            setup: vec![],
            command: [
                "smg",
                "--port",
                "{port}",
                "--worker-urls",
                "{workers}",
                "--prom",
                "{metrics_port}",
            ]
            .map(String::from)
            .to_vec(),
            ready_path: "/readiness".into(),
            ready_count_field: Some("healthy_workers".into()),
        };
        let workers = ["http://a".to_string(), "http://b".to_string()];
        assert_eq!(
            command_line(&r, 9000, 9001, &workers),
            [
                "smg",
                "--port",
                "9000",
                "--worker-urls",
                "http://a",
                "http://b",
                "--prom",
                "9001"
            ]
        );
        let field = r.ready_count_field.as_deref();
        assert!(ready_answer(
            field,
            r#"{"healthy_workers": 2, "total": 2}"#,
            2
        ));
        assert!(!ready_answer(field, r#"{"healthy_workers": 1}"#, 2));
        assert!(!ready_answer(field, "not json", 2));
        assert!(ready_answer(None, "", 2));
    }
}
