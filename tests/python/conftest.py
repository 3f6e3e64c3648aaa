"""Shared pytest fixtures: start and stop vllm-sim processes on free loopback ports.

`vllm_sim` is a factory fixture: `server = vllm_sim("--time-scale", "100", ...)` starts a vllm-sim
process on a free 127.0.0.1 port with the given arguments, waits until `/health` answers (200, or any
status with `wait_healthy=False`), and returns a `SimServer`. Every server a test started is stopped at
teardown. The binary comes from `$VLLM_SIM_BIN` (default: target/release/vllm-sim in the repo).
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM_SIM_BIN = os.environ.get("VLLM_SIM_BIN", str(REPO_ROOT / "target" / "release" / "vllm-sim"))


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int:
    """The status of a GET, or raises OSError when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


class SimServer:
    """A running vllm-sim process."""

    def __init__(self, process: subprocess.Popen, port: int, args: tuple[str, ...]):
        self.process = process
        self.port = port
        self.args = args
        self.base_url = f"http://127.0.0.1:{port}"

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def start_vllm_sim(*args: str, wait_healthy: bool = True, wait: bool = True, timeout: float = 10.0) -> SimServer:
    """Starts vllm-sim with `args` on a free port and waits for `/health` (200 with `wait_healthy`,
    any answer without it; `wait=False` returns at once, e.g. to see a loading server refuse)."""
    if not os.path.isfile(VLLM_SIM_BIN):
        pytest.fail(f"vllm-sim binary not found at {VLLM_SIM_BIN}; build it or set VLLM_SIM_BIN")
    port = free_port()
    process = subprocess.Popen(
        [VLLM_SIM_BIN, "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    server = SimServer(process, port, args)
    if not wait:
        return server
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"vllm-sim exited with {process.returncode} (args {args})")
        try:
            status = http_status(server.url("/health"), timeout=1.0)
            if status == 200 or not wait_healthy:
                return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise TimeoutError(f"vllm-sim did not become ready within {timeout}s (args {args})")
        time.sleep(0.02)


def started_by(start_one):
    """A fixture body: yields a factory that calls `start_one` and stops everything it started."""
    started = []

    def start(*args, **kwargs):
        thing = start_one(*args, **kwargs)
        started.append(thing)
        return thing

    yield start
    for thing in started:
        thing.stop()


@pytest.fixture
def vllm_sim():
    """Factory: `vllm_sim(*args, wait_healthy=True)` -> SimServer; all are stopped at teardown."""
    yield from started_by(start_vllm_sim)


# ---------------------------------------------------------------------------------------------------
# The gateway: the built Worker (build/index.js) served by Miniflare over real HTTP on 127.0.0.1.

import json  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

NODE_BIN = os.environ.get("NODE_BIN", str(REPO_ROOT / "node_modules" / ".bin" / "node"))
SERVE_GATEWAY = REPO_ROOT / "tests" / "lib" / "serve-gateway.mjs"


class Gateway:
    """A running gateway (tests/lib/serve-gateway.mjs) and stdlib helpers for its admin API."""

    def __init__(self, process: subprocess.Popen, url: str, admin_token: str, stderr_file, lines: list[str]):
        self.process = process
        self.url = url
        self.admin_token = admin_token
        self._stderr = stderr_file
        self._lines = lines

    def request(self, method: str, path: str, json_body=None, headers=None, timeout: float = 5.0):
        """(status, parsed JSON or raw text) of a request to the gateway."""
        data = None if json_body is None else json.dumps(json_body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"content-type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def admin(self, method: str, path: str, json=None, timeout: float = 5.0):  # noqa: A002 - mirrors requests
        """(status, parsed JSON) of an admin call with the admin bearer token."""
        return self.request(method, path, json, {"authorization": f"Bearer {self.admin_token}"}, timeout)

    def register(self, url: str, models, **kw) -> dict:
        """Registers a backend (POST /admin/backends); returns the created view."""
        status, body = self.admin("POST", "/admin/backends", {"url": url, "models": list(models), **kw})
        assert status == 201, f"registering {url}: {status} {body}"
        return body

    def wait_ready(self, backend_id: str, timeout: float = 15.0) -> dict:
        """Polls the backend until it is ready and healthy; returns its view."""
        deadline = time.monotonic() + timeout
        last = None
        while True:
            status, last = self.admin("GET", f"/admin/backends/{backend_id}")
            if status == 200 and last.get("lifecycle") == "ready" and last.get("health") == "healthy":
                return last
            if time.monotonic() > deadline:
                raise TimeoutError(f"backend {backend_id} not ready within {timeout}s: {status} {last}")
            time.sleep(0.1)

    def logs(self) -> str:
        """What the gateway process wrote so far (stdout lines and stderr)."""
        fd = self._stderr.fileno()
        # pread leaves the offset the child shares with us alone.
        stderr = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        return "".join(self._lines) + stderr

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self.process.stdin:
            self.process.stdin.close()
        self._stderr.close()


def start_gateway(extra_bindings: dict | None = None, timeout: float = 30.0) -> Gateway:
    """Spawns serve-gateway.mjs and waits for its `{"url": ...}` line."""
    if not (REPO_ROOT / "build" / "index.js").is_file():
        pytest.fail("build/index.js not found; run `make build`")
    stderr_file = tempfile.TemporaryFile()
    process = subprocess.Popen(
        [NODE_BIN, str(SERVE_GATEWAY), json.dumps(extra_bindings or {})],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,  # closing it (or dying) stops the gateway
        stdout=subprocess.PIPE,
        stderr=stderr_file,
        text=True,
    )
    lines: list[str] = []
    ready: dict = {}
    got_url = threading.Event()

    def drain() -> None:
        # Keeps reading after the URL line so workerd's logs never fill the pipe.
        for line in process.stdout:
            lines.append(line)
            if not got_url.is_set():
                try:
                    info = json.loads(line)
                except ValueError:
                    continue
                if isinstance(info, dict) and "url" in info:
                    ready.update(info)
                    got_url.set()
        got_url.set()

    threading.Thread(target=drain, daemon=True).start()
    if not got_url.wait(timeout) or not ready:
        gw = Gateway(process, "", "", stderr_file, lines)
        logs = gw.logs()
        gw.stop()
        raise RuntimeError(f"gateway did not start within {timeout}s:\n{logs}")
    return Gateway(process, ready["url"], ready["admin_token"], stderr_file, lines)


@pytest.fixture
def gateway():
    """Factory: `gateway(extra_bindings=None)` -> Gateway; all are stopped at teardown."""
    yield from started_by(start_gateway)


@pytest.fixture(scope="module")
def module_gateway():
    """Like `gateway`, shared by the tests of a module."""
    yield from started_by(start_gateway)


@pytest.fixture(scope="module")
def module_vllm_sim():
    """Like `vllm_sim`, shared by the tests of a module."""
    yield from started_by(start_vllm_sim)
