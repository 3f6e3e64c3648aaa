"""Admission control through the real `openai` client: a batch tenant and an interactive tenant
(two CLIENT_API_KEYS keys; the batch client lowers its own priority with `x-gateway-priority`)
share one vllm-sim backend that runs two sequences at a time.

Under contention the interactive requests are served ahead of the queued batch ones; queue
refusals reach the client as the OpenAI SDK's own exception types with the gateway's codes and
headers; a request that waited streams normally; everything returns to zero afterwards.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest
from openai import OpenAI

MODEL = "adm-model"
KEYS = {"batch": "sk-batch-1", "interactive": "sk-interactive-1"}
SEQS = 2
FULL = {"extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Summarise the queueing discipline of this gateway."}]


@pytest.fixture(scope="module")
def gw(module_gateway, module_vllm_sim):
    gw = module_gateway({"CLIENT_API_KEYS": ",".join(KEYS.values())})
    sim = module_vllm_sim("--model", MODEL, "--max-num-seqs", str(SEQS), "--seed", "7")
    status, body = gw.admin("PUT", "/admin/pools/default", {"admission": {"enabled": True, "poll_ms": 1000}})
    assert status == 200, body
    backend = gw.register(sim.base_url, [MODEL], max_num_seqs=SEQS)
    gw.wait_ready(backend["id"])
    gw.sim = sim
    return gw


def client(gw, who: str, **headers) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=KEYS[who], max_retries=0, timeout=60.0, default_headers=headers)


def queue(gw) -> dict:
    status, state = gw.admin("GET", "/admin/pools/default")
    assert status == 200, state
    return state["queue"] | {"in_flight": state["in_flight"]}


def wait_for(predicate, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def stream_text(c: OpenAI, max_tokens: int) -> str:
    stream = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, stream=True, **FULL)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_interactive_requests_overtake_queued_batch_work(gw):
    batch = client(gw, "batch", **{"x-gateway-priority": "-5"})
    interactive = client(gw, "interactive")
    finished: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run(label: str, c: OpenAI, tokens: int):
        try:
            text = stream_text(c, tokens)
            assert text, f"{label} streamed nothing"
            with lock:
                finished.append(label)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f"batch{i}", batch, 40)) for i in range(8)]
    for t in threads:
        t.start()
    wait_for(lambda: queue(gw)["length"] >= 6, "six batch requests queued")
    state = queue(gw)
    assert state["by_priority"] == {"-5": state["length"]}
    more = [threading.Thread(target=run, args=(f"interactive{i}", interactive, 10)) for i in range(3)]
    for t in more:
        t.start()
    for t in threads + more:
        t.join(timeout=60)
    assert not errors, errors
    assert len(finished) == 11
    last_interactive = max(i for i, label in enumerate(finished) if label.startswith("interactive"))
    later_batch = [label for label in finished[last_interactive + 1 :] if label.startswith("batch")]
    # Six batch requests were queued ahead of them; two backend slots serve the interactive three
    # first, so at least four queued batch requests finish after the last interactive one.
    assert len(later_batch) >= 4, finished


def test_queue_refusals_are_openai_errors_with_the_reason(gw):
    status, _ = gw.admin("PUT", "/admin/pools/default", {"admission": {"enabled": True, "poll_ms": 1000, "max_queue_per_tenant": 1}})
    assert status == 200
    hold = client(gw, "interactive")
    holders = [threading.Thread(target=stream_text, args=(hold, 150)) for _ in range(SEQS)]
    for t in holders:
        t.start()
    try:
        wait_for(lambda: queue(gw)["in_flight"] == SEQS, "the backend held")
        batch = client(gw, "batch")
        with pytest.raises(openai.InternalServerError) as timeout:
            batch.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"x-gateway-max-wait-ms": "0"})
        assert timeout.value.status_code == 503
        assert timeout.value.code == "queue_timeout"
        assert timeout.value.response.headers["x-gateway-queue-drop"] == "queue_timeout"
        assert int(timeout.value.response.headers["retry-after"]) >= 1

        waiting = threading.Thread(target=stream_text, args=(batch, 4))
        waiting.start()
        wait_for(lambda: queue(gw)["length"] == 1, "one batch request queued")
        with pytest.raises(openai.RateLimitError) as full:
            batch.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert full.value.code == "queue_full"
        assert full.value.response.headers["x-gateway-queue-drop"] == "tenant_limit"
        waiting.join(timeout=60)
    finally:
        for t in holders:
            t.join(timeout=60)
        gw.admin("PUT", "/admin/pools/default", {"admission": {"enabled": True, "poll_ms": 1000}})


def test_leases_queue_and_metrics_return_to_zero(gw):
    state = wait_for(lambda: (lambda s: s if s["in_flight"] == 0 and s["length"] == 0 else None)(queue(gw)), "drained")
    assert state["admitted"] >= 11
    assert state["dropped"]["queue_timeout"] == 1 and state["dropped"]["tenant_limit"] == 1
    status, text = gw.request("GET", "/metrics", headers={"authorization": f"Bearer {gw.admin_token}"})
    assert status == 200
    lines = text.splitlines()
    assert 'llm_gateway_queue_length{pool="default",priority="0"} 0' in lines
    count = next(line for line in lines if line.startswith('llm_gateway_queue_wait_seconds_count{pool="default"}'))
    assert float(count.split()[-1]) == state["admitted"]
