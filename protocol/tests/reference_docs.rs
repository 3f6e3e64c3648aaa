//! The book's reference pages stay true of the code: this test fails when a pool setting, an
//! environment variable or secret, an error code or a response header exists in the code but is
//! missing from `docs/src/reference/` (or is documented with another default or status), and its
//! message says what to add where.
//!
//! - pool settings: every leaf of `PoolSettings::default()` serialised to JSON, by its dotted path
//!   (`admission.enabled`), must be a row of `configuration.md` with that default;
//! - variables and secrets: every name the Worker (`src/`) or the Durable Objects
//!   (`durable-objects/src/`) read through `var_or`, `json_var_or_default`, `secret`, `var`,
//!   `env.var`, `env.secret` (every `.rs` file, recursively), and every `[vars]` key of
//!   `wrangler.toml`, must be a row of `configuration.md`;
//! - error codes: every code built in `protocol/src/error.rs` and `refusal.rs`, by `with_code` in
//!   the Worker, the Durable Objects and the protocol, the prompt errors' and the stream's error
//!   events' codes must be a row of `errors.md`, with the HTTP status where the code shows it;
//! - headers: every `"x-gateway-..."` and `"x-ratelimit-..."` literal in the Worker, the Durable
//!   Objects, the protocol and the routing core must appear in `headers.md`.

use coordinator_protocol::settings::PoolSettings;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

const CONFIGURATION: &str = "docs/src/reference/configuration.md";
const ERRORS: &str = "docs/src/reference/errors.md";
const HEADERS: &str = "docs/src/reference/headers.md";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

fn read(rel: &str) -> String {
    fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// Every `.rs` file under `rel`, recursively (file names and folders may change).
fn rust_files(rel: &str) -> Vec<(String, String)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut paths = Vec::new();
    walk(&root().join(rel), &mut paths);
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let name = p.strip_prefix(root()).unwrap().display().to_string();
            (name, fs::read_to_string(&p).unwrap())
        })
        .collect()
}

/// The rows of the markdown tables in `text`: first cell's backticked name -> the row's cells.
fn table_rows(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut rows = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<String> = line
            .trim_matches('|')
            .split(" | ")
            .map(|c| c.trim().to_string())
            .collect();
        if let Some(name) = cells.first().and_then(|c| backticked(c)) {
            rows.insert(name, cells);
        }
    }
    rows
}

/// The first `code span` of a cell.
fn backticked(cell: &str) -> Option<String> {
    let start = cell.find('`')? + 1;
    let len = cell[start..].find('`')?;
    Some(cell[start..start + len].to_string())
}

/// Every string literal in `text` with the text before its opening quote.
fn literals(text: &str) -> Vec<(&str, &str)> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'"' && (i == 0 || bytes[i - 1] != b'\\' && bytes[i - 1] != b'\'') {
            let start = i + 1;
            let mut j = start;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            let end = j.min(bytes.len());
            out.push((&text[..i], &text[start..end]));
            i = end + 1;
        } else {
            i += 1;
        }
    }
    out
}

/// Every leaf of a JSON value by its dotted path.
fn leaves(value: &Value, path: &str, out: &mut BTreeMap<String, Value>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                leaves(v, &p, out);
            }
        }
        _ => {
            out.insert(path.to_string(), value.clone());
        }
    }
}

/// Whether a documented default (`16.0`, `"predicted_latency"`, `null`, `[]`, `30000`) is `value`.
fn same_default(documented: &str, value: &Value) -> bool {
    let d = documented.trim();
    match value {
        Value::Number(n) => d
            .replace([',', '_'], "")
            .parse::<f64>()
            .is_ok_and(|x| (x - n.as_f64().unwrap()).abs() < 1e-9),
        Value::String(s) => d == format!("\"{s}\"") || (!s.is_empty() && d == s),
        Value::Null => d == "null",
        other => serde_json::from_str::<Value>(d).is_ok_and(|v| &v == other),
    }
}

#[test]
fn every_pool_setting_is_in_the_configuration_table_with_its_default() {
    let rows = table_rows(&read(CONFIGURATION));
    let mut settings = BTreeMap::new();
    leaves(
        &serde_json::to_value(PoolSettings::default()).unwrap(),
        "",
        &mut settings,
    );
    assert!(
        settings.len() > 50,
        "PoolSettings has {} leaves",
        settings.len()
    );
    let mut problems = Vec::new();
    for (path, value) in &settings {
        match rows.get(path) {
            None => problems.push(format!(
                "add a row `| `{path}` | pool | `{value}` | <what it does> |` to {CONFIGURATION}"
            )),
            Some(cells) => {
                let documented = cells.get(2).and_then(|c| backticked(c)).unwrap_or_default();
                if cells.get(1).map(String::as_str) != Some("pool") {
                    problems.push(format!(
                        "{CONFIGURATION}: `{path}` is a pool setting: its kind cell must be `pool`"
                    ));
                }
                if !same_default(&documented, value) {
                    problems.push(format!(
                        "{CONFIGURATION}: `{path}` is documented with default `{documented}`; PoolSettings::default() has `{value}`"
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

/// The variables and secrets the code reads: the first string argument of a read helper.
fn variables_read() -> BTreeMap<String, String> {
    const READERS: [&str; 7] = [
        "var_or(env, ",
        "json_var_or_default(env, ",
        "secret(env, ",
        ".var(",
        ".secret(",
        "var(",
        "matches(",
    ];
    let mut found = BTreeMap::new();
    for dir in ["src", "durable-objects/src"] {
        for (file, text) in rust_files(dir) {
            for (before, lit) in literals(&text) {
                let is_name = lit.len() > 2
                    && lit
                        .bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
                    && lit.as_bytes()[0].is_ascii_uppercase();
                let before = before.trim_end_matches([' ', '\n']);
                let call = READERS
                    .iter()
                    .any(|r| before.ends_with(r.trim_end()) || before.ends_with(r));
                if is_name && call {
                    found.entry(lit.to_string()).or_insert(file.clone());
                }
            }
        }
    }
    found
}

#[test]
fn every_variable_and_secret_read_is_in_the_configuration_table() {
    let rows = table_rows(&read(CONFIGURATION));
    let read_by_code = variables_read();
    for expected in [
        "ADMIN_TOKEN",
        "REQUIRE_CLIENT_KEYS",
        "PROBE_INTERVAL_MS",
        "TENANT_SALT",
    ] {
        assert!(
            read_by_code.contains_key(expected),
            "the scan of the read helpers no longer finds {expected}: update variables_read()"
        );
    }
    let toml = read("wrangler.toml");
    let vars = toml
        .split("\n[vars]\n")
        .nth(1)
        .map(|s| s.split("\n[").next().unwrap_or(""))
        .unwrap_or("");
    let mut problems = Vec::new();
    for (name, file) in &read_by_code {
        if !rows.contains_key(name) {
            problems.push(format!(
                "{file} reads `{name}`: add a row `| `{name}` | var (or secret) | <default> | <what it does> |` to {CONFIGURATION}"
            ));
        }
    }
    for line in vars
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
    {
        let name = line.split('=').next().unwrap().trim();
        if !rows.contains_key(name) {
            problems.push(format!(
                "wrangler.toml [vars] sets `{name}`: add a row for it to {CONFIGURATION}"
            ));
        }
        if !read_by_code.contains_key(name) {
            problems.push(format!(
                "wrangler.toml [vars] sets `{name}`, which no read helper in src/ or durable-objects/src/ reads"
            ));
        }
    }
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

/// Each error code the code builds, with its HTTP status where the code shows it.
fn error_codes() -> BTreeMap<String, (Option<u16>, String)> {
    let error_rs = read("protocol/src/error.rs");
    // Constructor name -> status, from `pub fn name(...) -> Self { Self::new(STATUS, ...`.
    let mut ctor_status = BTreeMap::new();
    for chunk in error_rs.split("pub fn ").skip(1) {
        let name: String = chunk
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let body = chunk.split("\n    }").next().unwrap_or("");
        if let Some(rest) = body.split("Self::new(").nth(1) {
            let digits: String = rest
                .trim_start()
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            if let Ok(status) = digits.parse::<u16>() {
                ctor_status.insert(name, status);
            }
        }
    }
    assert!(
        ctor_status.len() >= 10,
        "constructors read from error.rs: {ctor_status:?}"
    );
    let status_before = |before: &str| -> Option<u16> {
        // The nearest constructor or explicit status before the code, in the same expression.
        let window = &before[before.len().saturating_sub(600)..];
        let mut best: Option<(usize, u16)> = None;
        for (name, status) in &ctor_status {
            for pat in [format!("ApiError::{name}("), format!("Self::{name}(")] {
                if let Some(at) = window.rfind(&pat) {
                    if best.is_none_or(|(b, _)| at > b) {
                        best = Some((at, *status));
                    }
                }
            }
        }
        for pat in ["ApiError::new(", "Self::new("] {
            if let Some(at) = window.rfind(pat) {
                let digits: String = window[at + pat.len()..]
                    .trim_start()
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                if let (Ok(status), true) = (digits.parse(), best.is_none_or(|(b, _)| at > b)) {
                    best = Some((at, status));
                }
            }
        }
        best.map(|(_, s)| s)
    };
    let mut codes = BTreeMap::new();
    let is_code = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
    for dir in ["src", "durable-objects/src", "protocol/src"] {
        for (file, text) in rust_files(dir) {
            if file.ends_with("_tests.rs") {
                continue;
            }
            let text = text.split("#[cfg(test)]").next().unwrap();
            for (before, lit) in literals(text) {
                let b = before.trim_end();
                let recent = &before[before.len().saturating_sub(200)..];
                let built =
                    b.ends_with(".with_code(") || b.ends_with("Some(") && recent.contains("::new(");
                let event = b.ends_with("code:");
                if is_code(lit) && (built || event) {
                    let status = if event { None } else { status_before(before) };
                    codes
                        .entry(lit.to_string())
                        .or_insert((status, file.clone()));
                }
            }
        }
    }
    // The request-body errors' codes (completion.rs answers them as 400 with `e.code()`).
    let prompt = "routing-core/src/request/prompt/error.rs";
    let text = read(prompt);
    let code_fn = text.split("fn code(").nth(1).expect("PromptError::code");
    let code_fn = code_fn.split("\n    }").next().unwrap();
    for (before, lit) in literals(code_fn) {
        if is_code(lit) && before.trim_end().ends_with("=>") {
            codes
                .entry(lit.to_string())
                .or_insert((Some(400), prompt.to_string()));
        }
    }
    codes
}

#[test]
fn every_error_code_is_in_the_errors_reference_with_its_status() {
    let rows = table_rows(&read(ERRORS));
    let codes = error_codes();
    for expected in [
        "invalid_api_key",
        "queue_full",
        "residency_unavailable",
        "missing_model",
        "upstream_stream_error",
    ] {
        assert!(
            codes.contains_key(expected),
            "the scan no longer finds `{expected}`: update error_codes()"
        );
    }
    let mut problems = Vec::new();
    for (code, (status, file)) in &codes {
        match rows.get(code) {
            None => problems.push(match status {
                Some(s) => format!(
                    "{file} builds error code `{code}` (HTTP {s}): add a row `| `{code}` | {s} | <type> | <when> |` to {ERRORS}"
                ),
                None => format!(
                    "{file} builds error code `{code}` (a stream's error event or a code without a visible status): add a row `| `{code}` | <when> |` to {ERRORS}, under \"Errors inside a stream\" or with its status in \"HTTP errors\""
                ),
            }),
            Some(cells) => {
                if let Some(s) = status {
                    if cells.get(1).map(|c| c.trim()) != Some(s.to_string().as_str()) {
                        problems.push(format!(
                            "{ERRORS}: `{code}` is documented with status {}; {file} builds it with {s}",
                            cells.get(1).cloned().unwrap_or_default()
                        ));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

#[test]
fn every_header_the_gateway_sets_is_in_the_headers_reference() {
    let doc = read(HEADERS);
    let mut names = BTreeSet::new();
    for dir in [
        "src",
        "durable-objects/src",
        "protocol/src",
        "routing-core/src",
    ] {
        for (file, text) in rust_files(dir) {
            for (_, lit) in literals(&text) {
                let header = (lit.starts_with("x-gateway-") || lit.starts_with("x-ratelimit-"))
                    && lit
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
                if header {
                    names.insert((lit.to_string(), file.clone()));
                }
            }
        }
    }
    assert!(names.len() > 15, "headers found: {names:?}");
    let problems: Vec<String> = names
        .iter()
        .filter(|(name, _)| !doc.contains(&format!("`{name}`")))
        .map(|(name, file)| {
            format!("{file} uses header `{name}`: add it (in backticks) to a table of {HEADERS}")
        })
        .collect();
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}
