"""What the real `openai` Python client sees when backends misbehave mid-answer (issue 12).

The built Worker runs under Miniflare (the `gateway` fixture) in front of real vllm-sim processes
and, for faults vllm-sim cannot produce, small local HTTP servers that misbehave on purpose. A
stream cut in the middle of an event, or one that goes silent, must make the client raise
`openai.APIError` (never a JSON decode error); a non-streamed body cut half-way must be a 502
`APIStatusError`, never a parsed-looking 200; usage must be exactly what the client asked for; and
every lease comes back.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import openai
import pytest
from openai import OpenAI

MODEL = "life-model"
STREAM_IDLE_TIMEOUT_MS = 1000


class FakeBackend:
    """A local OpenAI-like server whose generation answer is `answer(handler, body)`."""

    def __init__(self, answer):
        outer = self
        self.requests: list[dict] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):  # noqa: N802 - http.server's naming
                if self.path == "/health":
                    self._send(200, b"ok", "text/plain")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode())
                else:
                    self._send(404, b"{}")

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                outer.requests.append(body)
                answer(self, body)

            def _send(self, status, payload, ctype="application/json"):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def sse(content: str) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
             "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


def start_stream(handler):
    handler.send_response(200)
    handler.send_header("content-type", "text/event-stream")
    handler.send_header("transfer-encoding", "chunked")
    handler.end_headers()


def write_chunk(handler, data: bytes):
    handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    handler.wfile.flush()


def hang_up(handler):
    """Closes the connection now, whatever the response still owed."""
    handler.wfile.flush()
    handler.connection.shutdown(socket.SHUT_RDWR)
    handler.close_connection = True


@pytest.fixture
def fake_backend():
    started = []

    def start(answer):
        b = FakeBackend(answer)
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop()


@pytest.fixture
def gw(gateway):
    return gateway({"STREAM_IDLE_TIMEOUT_MS": str(STREAM_IDLE_TIMEOUT_MS), "FIRST_BYTE_TIMEOUT_MS": "3000", "RESPONSE_TIMEOUT_MS": "5000"})


def serve(gw, url: str) -> str:
    backend = gw.register(url, [MODEL])
    gw.wait_ready(backend["id"])
    return backend["id"]


def client_for(gw) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20.0)


def assert_leases_return(gw, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        status, pools = gw.admin("GET", "/admin/pools")
        assert status == 200
        if all(p["in_flight"] == 0 and p["in_flight_tokens"] == 0 for p in pools["data"]):
            return
        assert time.monotonic() < deadline, f"leases still held: {pools}"
        time.sleep(0.1)


def backend_view(gw, backend_id: str) -> dict:
    status, view = gw.admin("GET", f"/admin/backends/{backend_id}")
    assert status == 200
    return view


def test_usage_is_exactly_what_the_client_asked_for(gw, vllm_sim):
    sim = vllm_sim("--model", MODEL, "--time-scale", "200")
    serve(gw, sim.base_url)
    c = client_for(gw)
    full = {"extra_body": {"ignore_eos": True}}
    messages = [{"role": "user", "content": "count my tokens"}]
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, **full)
    assert plain.usage.completion_tokens == 7
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, stream=True, **full))
    assert all(ch.usage is None for ch in chunks), "usage the client did not ask for"
    assert all(ch.choices for ch in chunks), "an empty-choices chunk the client did not ask for"
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}, **full))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert_leases_return(gw)


def test_a_stream_cut_mid_event_raises_the_api_error(gw, fake_backend):
    def cut(handler, body):
        start_stream(handler)
        write_chunk(handler, sse("whole "))
        write_chunk(handler, sse("never finished")[:40])
        time.sleep(0.05)
        hang_up(handler)  # in the middle of the chunked body

    backend_id = serve(gw, fake_backend(cut).url)
    stream = client_for(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    seen = []
    with pytest.raises(openai.APIError) as raised:
        for ch in stream:
            seen.append(ch.choices[0].delta.content)
    assert seen == ["whole "]
    assert "failed while streaming" in str(raised.value) or "ended the stream early" in str(raised.value)
    assert_leases_return(gw)
    assert backend_view(gw, backend_id)["leases_in_flight"] == 0


def test_a_stream_closed_early_without_done_raises_the_api_error(gw, fake_backend):
    def close_delimited(handler, body):
        # HTTP/1.0-style body ended by closing the connection, half-way through an event.
        handler.protocol_version = "HTTP/1.0"
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream")
        handler.end_headers()
        handler.wfile.write(sse("first ") + sse("second")[:30])
        handler.wfile.flush()
        handler.close_connection = True

    serve(gw, fake_backend(close_delimited).url)
    stream = client_for(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    seen = []
    with pytest.raises(openai.APIError):
        for ch in stream:
            seen.append(ch.choices[0].delta.content)
    assert seen == ["first "]
    assert_leases_return(gw)


def test_a_silent_stream_ends_with_the_idle_timeout_error(gw, fake_backend):
    release = threading.Event()

    def stall(handler, body):
        start_stream(handler)
        write_chunk(handler, sse("only "))
        release.wait(30)  # silent until the test ends

    backend_id = serve(gw, fake_backend(stall).url)
    try:
        stream = client_for(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
        seen = []
        with pytest.raises(openai.APIError) as raised:
            for ch in stream:
                seen.append(ch.choices[0].delta.content)
        assert seen == ["only "]
        assert raised.value.code == "upstream_idle_timeout"
        assert_leases_return(gw)
        status, text = gw.admin("GET", "/metrics")
        assert status == 200
        assert f'llm_gateway_request_outcomes_total{{pool="default",backend="{backend_id}",outcome="timeout"}} 1' in text
    finally:
        release.set()


def test_a_truncated_json_answer_is_a_502_never_a_broken_200(gw, fake_backend):
    answer = json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": MODEL,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi " * 100}, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 100, "total_tokens": 103}}).encode()

    def truncated(handler, body):
        handler.send_response(200)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(answer)))
        handler.end_headers()
        handler.wfile.write(answer[:120])
        hang_up(handler)

    serve(gw, fake_backend(truncated).url)
    with pytest.raises(openai.APIStatusError) as raised:
        client_for(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 502
    assert raised.value.body["type"] == "server_error"
    assert_leases_return(gw)


def set_faults(sim, faults: dict) -> None:
    import urllib.request

    req = urllib.request.Request(sim.url("/sim/faults"), data=json.dumps(faults).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as response:
        assert response.status == 200


def test_vllm_sim_faults_reach_the_client_as_api_errors(gw, vllm_sim):
    sim = vllm_sim("--model", MODEL, "--time-scale", "200")
    backend_id = serve(gw, sim.base_url)
    c = client_for(gw)
    messages = [{"role": "user", "content": "misbehave"}]
    full = {"extra_body": {"ignore_eos": True}}
    # An engine that hangs after 2 tokens: the stream ends with the idle-timeout error.
    set_faults(sim, {"stall_after_tokens": 2})
    seen = []
    with pytest.raises(openai.APIError) as raised:
        for ch in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True, **full):
            if ch.choices and ch.choices[0].delta.content:
                seen.append(ch.choices[0].delta.content)
    assert raised.value.code == "upstream_idle_timeout"
    assert len(seen) == 2
    # Half an event, then the connection drops: an APIError, not a JSON decode error.
    set_faults(sim, {"disconnect_mid_event_after_tokens": 2})
    with pytest.raises(openai.APIError) as raised:
        for _ in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True, **full):
            pass
    assert raised.value.code == "upstream_stream_error"
    # A non-streamed body cut half-way: a 502 error, never a 200 with broken JSON.
    set_faults(sim, {"truncate_body": True})
    with pytest.raises(openai.APIStatusError) as raised:
        c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **full)
    assert raised.value.status_code == 502
    set_faults(sim, {})
    ok = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **full)
    assert ok.usage.completion_tokens == 8
    assert_leases_return(gw)
    assert backend_view(gw, backend_id)["leases_in_flight"] == 0
