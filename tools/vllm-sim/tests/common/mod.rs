//! What the HTTP tests of the built `vllm-sim` binary share: starting a sim process on a free port
//! (its address read from the first line it prints), sending one HTTP/1.1 request over
//! `std::net::TcpStream` with `Connection: close`, and reading the answer exactly as it arrived
//! (status, headers, the de-chunked body and whether it was complete). Each test file uses what it
//! needs of it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// How long a test waits for a state (or a read) before failing.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// Starts the built binary with `--port 0` and `args`; returns the process and its `host:port`.
pub fn spawn(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args(["--port", "0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the sim starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the sim prints its address");
    let address = line
        .trim()
        .strip_prefix("vllm-sim listening on http://")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (child, address)
}

/// Opens a connection to `address` and sends one request with a JSON `body` (`Connection: close`).
pub fn send(address: &str, method: &str, path: &str, body: &str) -> TcpStream {
    let mut stream = TcpStream::connect(address).expect("connects");
    stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("writes");
    stream.write_all(body.as_bytes()).expect("writes");
    stream
}

/// A response as received: status, headers, the (de-chunked) body, and whether it was complete.
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub complete: bool,
}

impl Reply {
    pub fn parse(raw: &[u8]) -> Reply {
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a complete head");
        let head = std::str::from_utf8(&raw[..split]).expect("ascii head");
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|s| s.parse().ok())
            .expect("status");
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let rest = &raw[split + 4..];
        let mut reply = Reply {
            status,
            headers,
            body: Vec::new(),
            complete: false,
        };
        if reply.header("transfer-encoding") == Some("chunked") {
            (reply.body, reply.complete) = dechunk(rest);
        } else {
            let length: usize = reply
                .header("content-length")
                .and_then(|v| v.parse().ok())
                .expect("a length");
            reply.body = rest.to_vec();
            reply.complete = rest.len() == length;
        }
        reply
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        assert!(self.complete, "incomplete body: {}", self.text());
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.text()))
    }

    /// The SSE events that arrived whole (`data: ...` followed by a blank line) and what came after
    /// the last of them.
    pub fn events(&self) -> (Vec<String>, String) {
        let text = self.text();
        let mut parts: Vec<&str> = text.split("\n\n").collect();
        let tail = parts.pop().unwrap_or_default().to_string();
        let events = parts
            .iter()
            .map(|e| e.strip_prefix("data: ").expect("a data line").to_string())
            .collect();
        (events, tail)
    }
}

/// Decodes a chunked body; `true` when the terminating zero-size chunk arrived.
pub fn dechunk(mut rest: &[u8]) -> (Vec<u8>, bool) {
    let mut body = Vec::new();
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return (body, false);
        };
        let size_text = std::str::from_utf8(&rest[..eol]).expect("ascii size");
        let size = usize::from_str_radix(size_text.trim(), 16).expect("hex size");
        rest = &rest[eol + 2..];
        if size == 0 {
            return (body, true);
        }
        let take = size.min(rest.len());
        body.extend_from_slice(&rest[..take]);
        if take < size || rest.len() < size + 2 {
            return (body, false);
        }
        rest = &rest[size + 2..];
    }
}
