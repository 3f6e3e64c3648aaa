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


def start_vllm_sim(*args: str, wait_healthy: bool = True, timeout: float = 10.0) -> SimServer:
    """Starts vllm-sim with `args` on a free port and waits for `/health`."""
    if not os.path.isfile(VLLM_SIM_BIN):
        pytest.fail(f"vllm-sim binary not found at {VLLM_SIM_BIN}; build it or set VLLM_SIM_BIN")
    port = free_port()
    process = subprocess.Popen(
        [VLLM_SIM_BIN, "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    server = SimServer(process, port, args)
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


@pytest.fixture
def vllm_sim():
    """Factory: `vllm_sim(*args, wait_healthy=True)` -> SimServer; all are stopped at teardown."""
    servers: list[SimServer] = []

    def start(*args: str, **kwargs) -> SimServer:
        server = start_vllm_sim(*args, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
