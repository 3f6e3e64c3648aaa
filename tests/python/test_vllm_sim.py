"""End-to-end tests of vllm-sim driven by the real `openai` client against real processes.

Each test starts its own vllm-sim on a free loopback port (see conftest.py) with a small
`--time-scale` divisor so simulated GPU time passes quickly, and checks what a client or a metrics
scraper can observe: OpenAI-compatible responses and streams, vLLM's errors, prefix-cache hits and
evictions in `/metrics`, queueing, prefill/decode hand-offs, and every injectable fault.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

FAST = ("--time-scale", "200")


# ---------------------------------------------------------------------------------------------------
# helpers


def client(server, api_key: str = "sim", timeout: float = 10.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=api_key, max_retries=0, timeout=timeout)


def http(server, method: str, path: str, body=None, headers=None, timeout: float = 5.0):
    """(status, body bytes) of a raw HTTP request; `body` is bytes or JSON-serialisable."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    request = urllib.request.Request(
        server.url(path),
        data=data,
        method=method,
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def set_faults(server, **settings) -> dict:
    status, body = http(server, "POST", "/sim/faults", settings)
    assert status == 200, body
    return json.loads(body)


def metrics(server) -> dict[str, float]:
    """Samples of /metrics keyed by name, plus `name{label=value}` for labels other than the
    model_name/engine pair (histogram buckets are left out)."""
    status, body = http(server, "GET", "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            extra = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            if "le" in extra:
                continue
            key = sample.name
            if extra and family.name != "vllm:cache_config_info":
                key += "{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}"
            out[key] = sample.value
    return out


def render_chat(messages: list[dict]) -> str:
    """The sim's documented chat template."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def tokens(text: str) -> int:
    return math.ceil(len(text.encode()) / 4)


def filler(tag: str, n_bytes: int) -> str:
    """Distinct ASCII text of exactly n_bytes bytes."""
    base = "".join(f"{tag}-{i} " for i in range(n_bytes // 4 + 1))
    return base[:n_bytes]


def stream_ttft(cl: openai.OpenAI, **kwargs) -> tuple[float, str, object]:
    """Streams a chat completion; returns (seconds to the first content, text, usage)."""
    start = time.perf_counter()
    first = None
    text = ""
    usage = None
    for chunk in cl.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if first is None:
                    first = time.perf_counter() - start
                text += choice.delta.content
    assert first is not None
    return first, text, usage


# ---------------------------------------------------------------------------------------------------
# OpenAI surface


def test_health_models_and_version(vllm_sim):
    server = vllm_sim("--model", "llama-a", "--model", "llama-b", "--max-model-len", "4096", *FAST)
    status, body = http(server, "GET", "/health")
    assert (status, body) == (200, b"")
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["llama-a", "llama-b"]
    assert models.data[0].model_extra["max_model_len"] == 4096
    assert models.data[1].owned_by == "vllm"
    status, body = http(server, "GET", "/version")
    assert status == 200 and "version" in json.loads(body)
    # An alias serves requests too; metrics are labelled with the first name.
    cl = client(server)
    cl.chat.completions.create(model="llama-b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert 'model_name="llama-a"' in http(server, "GET", "/metrics")[1].decode()


def test_chat_non_streaming_reports_usage(vllm_sim):
    server = vllm_sim(*FAST)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    resp = client(server).chat.completions.create(
        model="sim-model", messages=messages, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert len(choice.message.content.encode()) == 8 * 4
    assert resp.usage.prompt_tokens == tokens(render_chat(messages))
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8


def test_chat_streaming_with_include_usage(vllm_sim):
    server = vllm_sim(*FAST)
    messages = [{"role": "user", "content": "Stream please."}]
    chunks = list(
        client(server).chat.completions.create(
            model="sim-model",
            messages=messages,
            max_completion_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 6 * 4
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == tokens(render_chat(messages))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_streaming_and_not(vllm_sim):
    server = vllm_sim(*FAST)
    cl = client(server)
    resp = cl.completions.create(model="sim-model", prompt="Once upon a time", max_tokens=5, extra_body={"ignore_eos": True})
    assert resp.object == "text_completion"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == tokens("Once upon a time")
    assert resp.usage.completion_tokens == 5
    # vLLM's default max_tokens for completions is 16.
    default = cl.completions.create(model="sim-model", prompt="Once", extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16
    # Token-id prompts count one token per id.
    ids = cl.completions.create(model="sim-model", prompt=[1, 2, 3, 4, 5], max_tokens=1)
    assert ids.usage.prompt_tokens == 5
    chunks = list(
        cl.completions.create(
            model="sim-model",
            prompt="Once upon a time",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == resp.choices[0].text  # same seed, same prompt, same text
    assert chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_output_is_deterministic_per_seed_and_prompt(vllm_sim):
    server = vllm_sim("--seed", "7", *FAST)
    cl = client(server)

    def text(**kw):
        return cl.completions.create(model="sim-model", max_tokens=12, extra_body={"ignore_eos": True}, **kw).choices[0].text

    assert text(prompt="abc") == text(prompt="abc")
    assert text(prompt="abc") != text(prompt="abd")
    assert text(prompt="abc", temperature=0.8, seed=1) == text(prompt="abc", temperature=0.8, seed=1)
    assert text(prompt="abc", temperature=0.8, seed=1) != text(prompt="abc", temperature=0.8, seed=2)
    # Greedy decoding ignores the request seed.
    assert text(prompt="abc", temperature=0, seed=1) == text(prompt="abc", temperature=0, seed=2)
    other = vllm_sim("--seed", "8", *FAST)
    assert client(other).completions.create(
        model="sim-model", prompt="abc", max_tokens=12, extra_body={"ignore_eos": True}
    ).choices[0].text != text(prompt="abc")


def test_eos_min_tokens_and_stop_strings(vllm_sim):
    server = vllm_sim("--mean-output-tokens", "4", *FAST)
    cl = client(server)
    natural = cl.completions.create(model="sim-model", prompt="eos please", max_tokens=100)
    assert natural.choices[0].finish_reason == "stop"
    assert natural.usage.completion_tokens < 10
    at_least = cl.completions.create(model="sim-model", prompt="eos please", max_tokens=100, extra_body={"min_tokens": 30})
    assert at_least.usage.completion_tokens >= 30

    full = cl.completions.create(model="sim-model", prompt="stop test", max_tokens=30, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[40:47]
    cut = cl.completions.create(
        model="sim-model", prompt="stop test", max_tokens=30, stop=[stop, "zzzz"], extra_body={"ignore_eos": True}
    )
    expected = text[: text.index(stop)]
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    streamed = cl.completions.create(
        model="sim-model", prompt="stop test", max_tokens=30, stop=stop, stream=True, extra_body={"ignore_eos": True}
    )
    pieces = [c.choices[0] for c in streamed]
    assert "".join(p.text for p in pieces) == expected
    assert pieces[-1].finish_reason == "stop"


def test_vllm_errors(vllm_sim):
    server = vllm_sim("--max-model-len", "256", *FAST)
    cl = client(server)
    status, body = http(server, "POST", "/v1/chat/completions", b'{"model": "sim-model", "messages": [')
    assert status == 400
    error = json.loads(body)["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    status, body = http(server, "POST", "/v1/chat/completions", {"model": "sim-model"})
    assert status == 400 and "messages" in json.loads(body)["error"]["message"]
    status, _ = http(server, "POST", "/v1/completions", {"model": "sim-model"})
    assert status == 400
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        cl.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x" * 2000}])
    # A max_tokens past the context is lowered to what fits (vLLM 0.34's get_max_tokens), not a 400.
    lowered = cl.completions.create(model="sim-model", prompt="short", max_tokens=1000, extra_body={"ignore_eos": True})
    assert lowered.usage.prompt_tokens + lowered.usage.completion_tokens == 256
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        cl.completions.create(model="sim-model", prompt="short", max_tokens=2, extra_body={"min_tokens": 3})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        cl.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        cl.completions.create(model="sim-model", prompt="hi", stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError):
        cl.completions.create(model="sim-model", prompt="hi", n=2)
    status, body = http(server, "GET", "/nope")
    assert status == 404
    # Unknown fields are accepted and ignored; a missing model means the first served one.
    status, body = http(
        server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 5, "frobnicate": True}
    )
    assert status == 200 and json.loads(body)["model"] == "sim-model"


def test_api_key_guards_v1_only(vllm_sim):
    server = vllm_sim("--api-key", "s3cret", *FAST)
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="wrong").models.list()
    status, body = http(server, "POST", "/v1/completions", {"prompt": "hi"})
    assert status == 401 and json.loads(body) == {"error": "Unauthorized"}
    resp = client(server, api_key="s3cret").completions.create(model="sim-model", prompt="hi", max_tokens=1)
    assert resp.usage.completion_tokens == 1
    assert http(server, "GET", "/health")[0] == 200
    assert http(server, "GET", "/metrics")[0] == 200


def test_embeddings(vllm_sim):
    # vLLM serves /v1/embeddings only for an embedding model's task; a chat model has no such route.
    chat_only = vllm_sim(*FAST)
    status, body = http(chat_only, "POST", "/v1/embeddings", {"model": "sim-model", "input": "x"})
    assert (status, json.loads(body)) == (404, {"detail": "Not Found"})
    server = vllm_sim("--task", "embed", *FAST)
    cl = client(server)
    resp = cl.embeddings.create(model="sim-model", input=["hello", "world"])  # base64 on the wire
    assert [d.index for d in resp.data] == [0, 1]
    assert len(resp.data[0].embedding) == 32
    assert abs(sum(x * x for x in resp.data[0].embedding) - 1.0) < 1e-3
    again = cl.embeddings.create(model="sim-model", input="hello", encoding_format="float", dimensions=32)
    assert again.data[0].embedding == pytest.approx(resp.data[0].embedding, abs=1e-6)
    assert resp.usage.prompt_tokens == tokens("hello") + tokens("world")
    assert len(cl.embeddings.create(model="sim-model", input="x", dimensions=8).data[0].embedding) == 8


# ---------------------------------------------------------------------------------------------------
# engine behaviour: prefix cache, eviction, queueing, time


def test_shared_prefix_hits_cache_and_lowers_ttft(vllm_sim):
    server = vllm_sim("--time-scale", "4")
    cl = client(server)
    cl.models.list()  # connect first: only the requests are timed
    shared = filler("doc", 16000)  # ~4000 tokens: 410 ms simulated prefill, ~100 ms real
    first = [{"role": "system", "content": shared}, {"role": "user", "content": "Question one?"}]
    second = [{"role": "system", "content": shared}, {"role": "user", "content": "Question two?"}]
    before = metrics(server)
    ttft_cold, _, usage_cold = stream_ttft(cl, model="sim-model", messages=first, max_tokens=2)
    after_first = metrics(server)
    ttft_warm, _, usage_warm = stream_ttft(cl, model="sim-model", messages=second, max_tokens=2)
    after_second = metrics(server)

    hits = "vllm:prefix_cache_hits_total"
    queries = "vllm:prefix_cache_queries_total"
    assert after_first[hits] - before[hits] == 0
    assert after_first[queries] - before[queries] == usage_cold.prompt_tokens
    shared_tokens = after_second[hits] - after_first[hits]
    assert shared_tokens >= len(shared.encode()) // 4 - 64  # whole 64-token blocks
    assert usage_warm.prompt_tokens_details.cached_tokens == shared_tokens
    assert "vllm:gpu_prefix_cache_hits_total" not in after_second  # removed before vLLM 0.34
    # Time to first token: seen by the client and in the histogram.
    assert ttft_warm < ttft_cold / 2, (ttft_warm, ttft_cold)
    ttft_sum = "vllm:time_to_first_token_seconds_sum"
    cold_sum = after_first[ttft_sum] - before[ttft_sum]
    warm_sum = after_second[ttft_sum] - after_first[ttft_sum]
    assert warm_sum < cold_sum / 2, (warm_sum, cold_sum)
    assert after_second["vllm:time_to_first_token_seconds_count"] == 2


def test_next_chat_turn_hits_previous_prompt_and_reply(vllm_sim):
    server = vllm_sim(*FAST)
    cl = client(server)
    turn1 = [{"role": "system", "content": filler("sys", 700)}, {"role": "user", "content": "First question"}]
    r1 = cl.chat.completions.create(model="sim-model", messages=turn1, max_tokens=40, extra_body={"ignore_eos": True})
    reply = r1.choices[0].message.content
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Second question"}]
    r2 = cl.chat.completions.create(model="sim-model", messages=turn2, max_tokens=1)
    assert render_chat(turn2).startswith(render_chat(turn1) + reply)
    # Cached: full 64-token blocks (vLLM 0.34's default) of turn 1's prompt + reply whose KV was
    # computed (all but the reply's last token).
    computed = r1.usage.prompt_tokens + r1.usage.completion_tokens - 1
    shared_bytes = len((render_chat(turn1) + reply).encode())
    expected = min(computed // 64, shared_bytes // 256) * 64
    assert r2.usage.prompt_tokens_details.cached_tokens == expected
    assert expected > r1.usage.prompt_tokens - 64


def test_filling_the_cache_evicts_old_prefixes(vllm_sim):
    server = vllm_sim("--kv-blocks", "32", "--block-size", "16", *FAST)
    cl = client(server)
    hits = "vllm:prefix_cache_hits_total"

    def run(prompt: str) -> float:
        before = metrics(server)[hits]
        cl.completions.create(model="sim-model", prompt=prompt, max_tokens=1)
        return metrics(server)[hits] - before

    a = filler("alpha", 20 * 64)  # 20 blocks of the 32
    assert run(a) == 0
    assert run(a) == 19 * 16  # the last block is recomputed, as in vLLM
    run(filler("bravo", 20 * 64))
    run(filler("charlie", 20 * 64))  # 60 blocks requested in total: A must go
    assert run(a) == 0
    m = metrics(server)
    assert m["vllm_sim:prefix_cache_evictions_total"] > 0
    assert m["vllm_sim:cached_blocks"] <= 32
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    # A prompt that cannot fit in the whole cache is refused up front.
    with pytest.raises(openai.BadRequestError, match="KV cache"):
        cl.completions.create(model="sim-model", prompt=filler("huge", 40 * 64), max_tokens=1)


def test_requests_beyond_max_num_seqs_wait(vllm_sim):
    server = vllm_sim("--max-num-seqs", "1", "--time-scale", "20")
    cl = client(server)
    finished: list[int] = []

    def run(i: int) -> None:
        # 200 steps of ~10 ms simulated = ~100 ms real each.
        cl.completions.create(model="sim-model", prompt=f"request {i}", max_tokens=200, extra_body={"ignore_eos": True})
        finished.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    seen_waiting = 0.0
    for i, t in enumerate(threads):
        t.start()
        # Arrival order 0, 1, 2: wait until the server holds request i before sending the next.
        deadline = time.monotonic() + 5
        while True:
            m = metrics(server)
            seen_waiting = max(seen_waiting, m["vllm:num_requests_waiting"])
            if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] + len(finished) >= i + 1:
                break
            assert time.monotonic() < deadline
            time.sleep(0.002)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(finished) < 3:
        m = metrics(server)
        assert m["vllm:num_requests_running"] <= 1
        seen_waiting = max(seen_waiting, m["vllm:num_requests_waiting"])
        time.sleep(0.005)
    for t in threads:
        t.join(timeout=10)
    assert seen_waiting >= 1
    assert finished == [0, 1, 2]  # FIFO
    m = metrics(server)
    assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (0, 0)
    assert m["vllm:generation_tokens_total"] == 600
    assert m["vllm:e2e_request_latency_seconds_count"] == 3


def test_stream_chunks_arrive_at_decode_step_pace(vllm_sim):
    # The "tiny mode" for gateway tests: real-time steps so a client sees the first chunk early.
    server = vllm_sim("--time-scale", "1", "--decode-ms-per-step", "25", "--prefill-us-per-token", "0")
    cl = client(server)
    cl.models.list()  # connect first: only the stream is timed
    start = time.perf_counter()
    arrivals = []
    for chunk in cl.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - start)
    assert len(arrivals) == 10
    assert arrivals[-1] - arrivals[0] > 0.15  # the first chunk came 9 steps of 25 ms before the last


def test_metrics_use_vllm_names(vllm_sim):
    server = vllm_sim("--model", "m1", "--kv-blocks", "1000", "--block-size", "32", *FAST)
    client(server).completions.create(model="m1", prompt="hello", max_tokens=3, extra_body={"ignore_eos": True})
    text = http(server, "GET", "/metrics")[1].decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:cache_config_info",
    ]:
        assert name in families, name
        if name != "vllm:cache_config_info":  # an info metric: the cache's settings, no model_name
            assert all(s.labels.get("model_name") == "m1" for s in families[name].samples), name
    # The gpu_* names vLLM removed are gone, as in vLLM 0.34.
    for gone in ["vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits"]:
        assert gone not in families, gone
    assert families["vllm:prefix_cache_hits"].type == "counter"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    info = families["vllm:cache_config_info"].samples[0].labels
    assert (info["num_gpu_blocks"], info["block_size"]) == ("1000", "32")
    m = metrics(server)
    assert m["vllm:generation_tokens_total"] == 3
    assert m["vllm:prompt_tokens_total"] == tokens("hello")
    assert m["vllm:request_success_total{finished_reason=length}"] == 1


# ---------------------------------------------------------------------------------------------------
# prefill/decode disaggregation


PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def test_prefill_decode_handoff(vllm_sim):
    prefill = vllm_sim("--role", "prefill", "--time-scale", "4")
    decode = vllm_sim("--role", "decode", "--time-scale", "4")
    messages = [{"role": "user", "content": filler("ctx", 16000)}]
    p = client(prefill).chat.completions.create(
        model="sim-model", messages=messages, max_tokens=50, extra_body={"kv_transfer_params": PREFILL_PARAMS}
    )
    assert p.usage.completion_tokens == 1  # a hand-off prefill generates one token
    params = p.model_extra["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_port"] == prefill.port and params["remote_host"] == "127.0.0.1"
    assert len(params["remote_block_ids"]) == math.ceil(p.usage.prompt_tokens / 64)
    assert params["remote_engine_id"]

    dc = client(decode)
    dc.models.list()  # connect first: only the requests are timed
    ttft_remote, text, usage = stream_ttft(
        dc, model="sim-model", messages=messages, max_tokens=5, extra_body={"kv_transfer_params": params, "ignore_eos": True}
    )
    assert usage.completion_tokens == 5 and len(text) == 20
    cold_messages = [{"role": "user", "content": filler("other", 16000)}]
    ttft_cold, _, _ = stream_ttft(dc, model="sim-model", messages=cold_messages, max_tokens=1)
    assert ttft_remote < ttft_cold / 2, (ttft_remote, ttft_cold)
    # The transferred blocks are now cached on the decode server.
    again = dc.chat.completions.create(model="sim-model", messages=messages, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= p.usage.prompt_tokens - 64


def test_decode_rejects_params_it_cannot_verify(vllm_sim):
    prefill = vllm_sim("--role", "prefill", *FAST)
    short_lived = vllm_sim("--role", "prefill", "--kv-transfer-ttl-s", "0.2", *FAST)
    decode = vllm_sim("--role", "decode", *FAST)
    stranger = vllm_sim("--role", "decode", "--kv-transfer-secret", "another-secret", *FAST)
    messages = [{"role": "user", "content": "hand me off"}]

    def issue(server):
        return client(server).chat.completions.create(
            model="sim-model", messages=messages, max_tokens=1, extra_body={"kv_transfer_params": PREFILL_PARAMS}
        ).model_extra["kv_transfer_params"]

    params = issue(prefill)
    expiring = issue(short_lived)
    dc = client(decode)

    def decode_with(p, msgs=messages, cl=dc):
        return cl.chat.completions.create(model="sim-model", messages=msgs, max_tokens=2, extra_body={"kv_transfer_params": p})

    assert decode_with(params).usage.completion_tokens >= 1
    # As in vLLM 0.34, no transfer parameter is a 400. Params the decode server cannot load (forged,
    # edited, for another prompt, signed with another secret, expired) are a failed KV load: vLLM's
    # kv_load_failure_policy "fail" ends a whole request with its 500.
    for bad, cl, msgs in [
        ({**params, "remote_block_ids": params["remote_block_ids"] + [999]}, dc, messages),
        (params, dc, [{"role": "user", "content": "another prompt"}]),
        ({k: v for k, v in params.items() if k != "sim_tag"}, dc, messages),
        (params, client(stranger), messages),
    ]:
        with pytest.raises(openai.InternalServerError):
            decode_with(bad, msgs=msgs, cl=cl)
    # Params for the other role are ignored: the prompt is computed here.
    assert decode_with(PREFILL_PARAMS).usage.completion_tokens >= 1
    time.sleep(max(0.0, expiring["sim_expires_at_ms"] / 1000 - time.time()) + 0.05)
    with pytest.raises(openai.InternalServerError):
        decode_with(expiring)
    assert decode_with(params).usage.completion_tokens >= 1


# ---------------------------------------------------------------------------------------------------
# faults


def chat(cl, **kw):
    return cl.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, **kw)


def test_fault_error_statuses_and_reset(vllm_sim):
    server = vllm_sim(*FAST)
    cl = client(server)
    settings = set_faults(server, error_rate=1.0, error_status=500)
    assert settings["settings"]["error_rate"] == 1.0
    with pytest.raises(openai.InternalServerError) as e500:
        chat(cl)
    assert e500.value.status_code == 500
    set_faults(server, error_rate=1.0, error_status=503)
    with pytest.raises(openai.APIStatusError) as e503:
        chat(cl)
    assert e503.value.status_code == 503
    status, body = http(server, "GET", "/sim/faults")
    assert json.loads(body)["settings"]["error_status"] == 503
    set_faults(server)  # {} clears everything
    assert chat(cl).usage.completion_tokens >= 1
    set_faults(server, error_rate=1.0)
    set_faults(server, reset=True)
    assert chat(cl).usage.completion_tokens >= 1
    status, _ = http(server, "POST", "/sim/faults", {"error_rate": 2})
    assert status == 400
    status, _ = http(server, "POST", "/sim/faults", {"eror_rate": 1})
    assert status == 400


def test_fault_flags_apply_from_start(vllm_sim):
    server = vllm_sim("--fault-error-rate", "1", "--fault-error-status", "503", *FAST)
    with pytest.raises(openai.APIStatusError) as e:
        chat(client(server))
    assert e.value.status_code == 503
    # Health and models are not generation endpoints.
    assert http(server, "GET", "/health")[0] == 200
    client(server).models.list()


def test_fault_rate_limit(vllm_sim):
    server = vllm_sim(*FAST)
    set_faults(server, rate_limit_rate=1.0)
    with pytest.raises(openai.RateLimitError) as e:
        chat(client(server))
    assert e.value.response.headers.get("retry-after") == "1"


def test_fault_hang_before_first_byte(vllm_sim):
    server = vllm_sim(*FAST)
    set_faults(server, hang_rate=1.0)
    start = time.perf_counter()
    with pytest.raises(openai.APITimeoutError):
        chat(client(server, timeout=0.5))
    assert time.perf_counter() - start >= 0.5
    set_faults(server)
    assert chat(client(server)).usage.completion_tokens >= 1


def test_fault_slow_first_byte(vllm_sim):
    server = vllm_sim(*FAST)
    cl = client(server)
    set_faults(server, first_byte_delay_ms=300)
    start = time.perf_counter()
    chat(cl)
    assert time.perf_counter() - start >= 0.3
    set_faults(server)
    start = time.perf_counter()
    chat(cl)
    assert time.perf_counter() - start < 0.25


def test_fault_disconnect_mid_stream(vllm_sim):
    server = vllm_sim(*FAST)
    cl = client(server)
    set_faults(server, disconnect_after_tokens=3)
    received = ""
    with pytest.raises((openai.APIConnectionError, Exception)) as e:
        for chunk in cl.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=20,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices:
                received += chunk.choices[0].delta.content or ""
    assert not isinstance(e.value, AssertionError)
    assert len(received) == 3 * 4
    with pytest.raises(openai.APIConnectionError):
        cl.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=20, extra_body={"ignore_eos": True}
        )
    # Shorter than the cut-off: served normally.
    short = cl.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert short.usage.completion_tokens <= 2


def test_fault_health_fail(vllm_sim):
    server = vllm_sim(*FAST)
    set_faults(server, health_fail=True)
    assert http(server, "GET", "/health")[0] == 503
    assert chat(client(server)).usage.completion_tokens >= 1
    set_faults(server)
    assert http(server, "GET", "/health")[0] == 200


def test_fault_startup_loading_phase(vllm_sim):
    # vLLM 0.34 binds its port only once loaded: connections are refused meanwhile.
    loading = vllm_sim("--startup-delay-s", "3", *FAST, wait=False)
    time.sleep(0.3)
    with pytest.raises(OSError):
        http(loading, "GET", "/health", timeout=1.0)
    deadline = time.monotonic() + 10
    while True:
        try:
            if http(loading, "GET", "/health", timeout=1.0)[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # The older answer, a 503 while loading, is the loading_answers_503 fault.
    server = vllm_sim("--startup-delay-s", "0.6", "--fault-loading-answers-503", *FAST, wait_healthy=False)
    assert http(server, "GET", "/health")[0] == 503
    with pytest.raises(openai.APIStatusError) as e:
        chat(client(server))
    assert e.value.status_code == 503
    deadline = time.monotonic() + 5
    while http(server, "GET", "/health")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert chat(client(server)).usage.completion_tokens >= 1
    # A loading phase can also be started at run time (a simulated restart): with the faults set
    # anew (the 503 fault off), connections are refused until it ends.
    set_faults(server, loading_s=0.5)
    with pytest.raises(OSError):
        http(server, "GET", "/health", timeout=1.0)
    time.sleep(0.7)
    assert http(server, "GET", "/health")[0] == 200


def test_fault_crash_exits_the_process(vllm_sim):
    server = vllm_sim(*FAST)
    status, body = http(server, "POST", "/sim/faults", {"crash": True})
    assert status == 200 and json.loads(body) == {"crashing": True}
    assert server.process.wait(timeout=5) != 0
    with pytest.raises(openai.APIConnectionError):
        chat(client(server, timeout=1))


# ---------------------------------------------------------------------------------------------------
# Faults on the wire, usage details and continued answers, as the openai client sees them


def wait_for(condition, what: str, patience: float = 20.0) -> None:
    """Polls `condition` until it holds; fails after `patience` seconds (a bound, not a measurement)."""
    deadline = time.monotonic() + patience
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_fault_stall_keeps_the_stream_open_until_the_client_gives_up(vllm_sim):
    server = vllm_sim(*FAST)
    set_faults(server, stall_after_tokens=2)
    received = ""
    with pytest.raises(openai.APITimeoutError):
        for chunk in client(server, timeout=1.0).chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=20,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices:
                received += chunk.choices[0].delta.content or ""
    assert len(received) == 2 * 4
    # The client's timeout closed the connection: the hung sequence is aborted and its slot freed.
    wait_for(lambda: metrics(server)["vllm:num_requests_running"] == 0, "the abort")
    m = metrics(server)
    assert m["vllm:request_success_total{finished_reason=abort}"] == 1
    assert m["vllm:generation_tokens_total"] == 2


def test_fault_truncated_body_is_a_connection_error(vllm_sim):
    server = vllm_sim("--fault-truncate-body", *FAST)
    cl = client(server)
    with pytest.raises(openai.APIConnectionError):
        cl.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    # Streams are unaffected.
    text = "".join(
        c.choices[0].delta.content or ""
        for c in cl.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    assert len(text) == 3 * 4


def test_fault_disconnect_mid_event_breaks_the_stream_after_n_tokens(vllm_sim):
    server = vllm_sim(*FAST)
    set_faults(server, disconnect_mid_event_after_tokens=3)
    received = ""
    with pytest.raises(Exception) as e:
        for chunk in client(server).chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=20,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices:
                received += chunk.choices[0].delta.content or ""
    assert not isinstance(e.value, AssertionError)
    assert len(received) == 3 * 4


def test_cached_tokens_and_continuing_a_partial_answer(vllm_sim):
    server = vllm_sim(*FAST)
    cl = client(server)
    question = [{"role": "user", "content": filler("q", 616)}]  # renders to 640 bytes, 160 tokens
    first = cl.chat.completions.create(
        model="sim-model", messages=question, max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    partial = first.choices[0].message.content
    hits = metrics(server)["vllm:prefix_cache_hits_total"]
    continued = cl.chat.completions.create(
        model="sim-model",
        messages=question + [{"role": "assistant", "content": partial}],
        max_tokens=8,
        extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False},
    )
    # History plus the 40-token partial answer; every full block of it computed by the first request.
    assert continued.usage.prompt_tokens == 200
    assert continued.usage.prompt_tokens_details.cached_tokens == 192
    assert metrics(server)["vllm:prefix_cache_hits_total"] - hits == 192
    with pytest.raises(openai.BadRequestError) as e:
        cl.chat.completions.create(
            model="sim-model",
            messages=question + [{"role": "assistant", "content": partial}],
            max_tokens=8,
            extra_body={"continue_final_message": True},
        )
    assert "Cannot set both `continue_final_message` and `add_generation_prompt` to True." in str(e.value)
