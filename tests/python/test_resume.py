"""A stream survives its backend (issue 16), as the real `openai` Python client sees it.

The built Worker runs under Miniflare (the `gateway` fixture) in front of two real vllm-sim processes
that both drop every stream after 4 tokens: whichever serves first, the gateway resumes the answer on
the other, and the client must get exactly the tokens it asked for (`ignore_eos`) in one seamless
stream: one role chunk, one id, one finish, one usage total with the prompt counted once. With
`MAX_STREAM_RESUMES=0`, or a request that rules resumption out (`logprobs`), the same failure
reaches the client as `openai.APIError` with today's code. Every lease ends on both backends.
"""

from __future__ import annotations

import time

import openai
import pytest
from openai import OpenAI

MODEL = "resume-model"
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
DROP_AFTER = 4


def serve_two_dropping(gw, vllm_sim) -> list[str]:
    ids = []
    for seed in ("1", "2"):
        sim = vllm_sim("--model", MODEL, "--time-scale", "50", "--seed", seed,
                       "--fault-disconnect-after-tokens", str(DROP_AFTER))
        backend = gw.register(sim.base_url, [MODEL])
        gw.wait_ready(backend["id"])
        ids.append(backend["id"])
    return ids


def client_for(gw) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20.0)


def assert_leases_end(gw, ids: list[str], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        views = [gw.admin("GET", f"/admin/backends/{i}")[1] for i in ids]
        if all(v["leases_in_flight"] == 0 for v in views):
            return
        assert time.monotonic() < deadline, f"leases still held: {views}"
        time.sleep(0.1)


def resume_counts(gw) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = gw.admin("GET", "/metrics")
    assert status == 200
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "llm_gateway_stream_resumes_total" and s.value > 0:
                counts[s.labels["outcome"]] = counts.get(s.labels["outcome"], 0) + s.value
    return counts


def expect_resume_counts(gw, expected: dict[str, float]) -> None:
    """The counts are taken when the lease is released, which for a stream that ended without usage
    comes after the count of what its client received (one /tokenize call): wait a little."""
    import time

    counts: dict[str, float] = {}
    for _ in range(50):
        counts = resume_counts(gw)
        if counts == expected:
            return
        time.sleep(0.1)
    assert counts == expected


def test_a_dropped_chat_stream_is_resumed_seamlessly(gateway, vllm_sim):
    gw = gateway({"STREAM_IDLE_TIMEOUT_MS": "1000"})
    ids = serve_two_dropping(gw, vllm_sim)
    c = client_for(gw)
    prompt_tokens = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    for _ in range(3):
        chunks = list(c.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=7, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert len({ch.id for ch in chunks}) == 1
        assert len({ch.created for ch in chunks}) == 1
        choices = [choice for ch in chunks for choice in ch.choices]
        assert sum(1 for choice in choices if choice.delta.role) == 1, "one role chunk"
        content = [choice.delta.content for choice in choices if choice.delta.content]
        assert len(content) == 7 and len("".join(content)) == 28
        assert [choice.finish_reason for choice in choices if choice.finish_reason] == ["length"]
        usage = [ch.usage for ch in chunks if ch.usage]
        assert len(usage) == 1
        assert usage[0].prompt_tokens == prompt_tokens
        assert usage[0].completion_tokens == 7
        assert usage[0].total_tokens == prompt_tokens + 7
    expect_resume_counts(gw, {"success": 3})
    assert_leases_end(gw, ids)


def test_a_dropped_completion_stream_is_resumed(gateway, vllm_sim):
    gw = gateway()
    ids = serve_two_dropping(gw, vllm_sim)
    c = client_for(gw)
    chunks = list(c.completions.create(model=MODEL, prompt="The lighthouse keeper", max_tokens=7,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert len({ch.id for ch in chunks}) == 1
    texts = [choice.text for ch in chunks for choice in ch.choices if choice.text]
    assert len(texts) == 7
    assert [choice.finish_reason for ch in chunks for choice in ch.choices if choice.finish_reason] == ["length"]
    expect_resume_counts(gw, {"success": 1})
    assert_leases_end(gw, ids)


def test_without_resumption_or_with_logprobs_the_client_gets_the_api_error(gateway, vllm_sim):
    off = gateway({"MAX_STREAM_RESUMES": "0"})
    ids = serve_two_dropping(off, vllm_sim)
    seen = []
    with pytest.raises(openai.APIError) as raised:
        for ch in client_for(off).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=7, stream=True, extra_body={"ignore_eos": True}):
            seen.extend(choice.delta.content for choice in ch.choices if choice.delta.content)
    assert raised.value.code == "upstream_stream_error"
    assert len(seen) == DROP_AFTER
    expect_resume_counts(off, {"not_resumed": 1})
    assert_leases_end(off, ids)

    on = gateway()
    ids = serve_two_dropping(on, vllm_sim)
    with pytest.raises(openai.APIError) as raised:
        for _ in client_for(on).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=7, stream=True, logprobs=True,
                extra_body={"ignore_eos": True}):
            pass
    assert raised.value.code == "upstream_stream_error"
    expect_resume_counts(on, {"not_resumable": 1})
    assert_leases_end(on, ids)
