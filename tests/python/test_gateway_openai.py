"""The gateway driven by the real `openai` client, end to end over HTTP on 127.0.0.1.

The built Worker (build/index.js) runs under Miniflare (tests/lib/serve-gateway.mjs, through the
`module_gateway` fixture) in front of real vllm-sim processes. Two gateways are shared by the tests
of this module: an open one with two backends, and one with client keys configured whose backend
requires its own, different key. The last test checks that every request returned its lease.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

MODEL = "test-model"
# vLLM serves /v1/embeddings only for an embedding model's task (`--task embed` in vllm-sim).
EMBED_MODEL = "test-embed"
SIM_ARGS = ("--model", MODEL, "--time-scale", "50")
CLIENT_KEYS = ("sk-test-1", "sk-test-2")
BACKEND_KEY = "sk-backend-xyz"
MESSAGES = [{"role": "user", "content": "Say something about gateways."}]
# vllm-sim draws EOS per seed and prompt, possibly at the first token: ask for exactly max_tokens.
FULL = {"extra_body": {"ignore_eos": True}}


def make_client(gw, api_key: str = "unused") -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=api_key, max_retries=0, timeout=10.0)


@pytest.fixture(scope="module")
def open_gw(module_gateway, module_vllm_sim):
    """A gateway without client keys, in front of two ready chat backends and an embedding one."""
    gw = module_gateway()
    sims = [module_vllm_sim(*SIM_ARGS, "--seed", str(i)) for i in range(2)]
    ids = [gw.register(sim.base_url, [MODEL])["id"] for sim in sims]
    embedder = module_vllm_sim("--model", EMBED_MODEL, "--task", "embed", "--time-scale", "50")
    ids.append(gw.register(embedder.base_url, [EMBED_MODEL])["id"])
    for backend_id in ids:
        gw.wait_ready(backend_id)
    return gw


@pytest.fixture(scope="module")
def client(open_gw) -> OpenAI:
    return make_client(open_gw)


@pytest.fixture(scope="module")
def keyed_sim(module_vllm_sim):
    """A vllm-sim that requires the backend's own key on /v1/*."""
    return module_vllm_sim(*SIM_ARGS, "--api-key", BACKEND_KEY)


@pytest.fixture(scope="module")
def keyed_gw(module_gateway, keyed_sim):
    """A gateway with CLIENT_API_KEYS set, in front of the key-protected backend."""
    gw = module_gateway({"CLIENT_API_KEYS": ",".join(CLIENT_KEYS)})
    backend = gw.register(keyed_sim.base_url, [MODEL], api_key=BACKEND_KEY)
    gw.wait_ready(backend["id"])
    return gw


def chat(c: OpenAI, **kw):
    return c.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **FULL, **kw})


# ---------------------------------------------------------------------------------------------------
# the OpenAI surface


def test_streaming_chat_parses_chunk_by_chunk_with_final_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        **FULL,
    )
    chunks = list(stream)
    assert len(chunks) >= 2, chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), chunks
    final = chunks[-1]
    assert final.usage is not None, final
    assert final.choices == []
    assert final.usage.prompt_tokens > 0
    assert final.usage.completion_tokens == 16
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_non_streaming_chat_has_usage(client):
    resp = chat(client)
    assert resp.object == "chat.completion"
    assert resp.model == MODEL
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.completion_tokens > 0


def test_completions_api_streaming_and_not(client):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, **FULL)
    assert resp.object == "text_completion"
    assert resp.choices[0].text
    assert resp.usage.prompt_tokens > 0

    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True, **FULL))
    assert len(chunks) >= 2, chunks
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip()


def test_models_list_shows_the_served_model(client):
    ids = [m.id for m in client.models.list()]
    assert MODEL in ids, ids


def test_embeddings(client):
    resp = client.embeddings.create(model=EMBED_MODEL, input=["hello", "world"])
    assert len(resp.data) == 2
    assert [d.index for d in resp.data] == [0, 1]
    assert len(resp.data[0].embedding) > 0
    assert all(isinstance(x, float) for x in resp.data[0].embedding)
    assert resp.usage.prompt_tokens > 0
    # A chat model's servers have no embeddings route: the SDK's NotFoundError naming the model.
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model=MODEL, input="hello")
    assert info.value.code == "model_does_not_support_endpoint" and MODEL in str(info.value)


# ---------------------------------------------------------------------------------------------------
# errors, as the client classifies them


def test_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"


def test_missing_messages_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=openai.omit, max_tokens=4)
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict) and info.value.body.get("message"), info.value.body


def test_request_id_is_echoed(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"x-request-id": "abc-123"}, **FULL
    )
    assert raw.headers["x-request-id"] == "abc-123"
    assert raw.parse().choices[0].message.content

    # Without one, the gateway makes one up.
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert raw.headers.get("x-request-id")


# ---------------------------------------------------------------------------------------------------
# client keys


def test_wrong_client_key_raises_authentication_error(keyed_gw):
    for key in ("sk-test-3", "sk-test-1x", BACKEND_KEY):
        with pytest.raises(openai.AuthenticationError) as info:
            chat(make_client(keyed_gw, key))
        assert info.value.status_code == 401, key
    with pytest.raises(openai.AuthenticationError):
        make_client(keyed_gw, "wrong").models.list()


def test_configured_client_keys_work(keyed_gw):
    for key in CLIENT_KEYS:
        c = make_client(keyed_gw, key)
        assert chat(c).choices[0].message.content
        assert MODEL in [m.id for m in c.models.list()]


def test_backend_gets_its_own_key_never_the_clients(keyed_gw, keyed_sim):
    # The backend itself refuses the client's key and accepts only its own...
    direct = OpenAI(base_url=keyed_sim.url("/v1"), api_key=CLIENT_KEYS[0], max_retries=0, timeout=10.0)
    with pytest.raises(openai.AuthenticationError):
        chat(direct)
    assert chat(OpenAI(base_url=keyed_sim.url("/v1"), api_key=BACKEND_KEY, max_retries=0, timeout=10.0)).choices

    # ...so requests through the gateway with a client key succeed only if the gateway swapped it.
    c = make_client(keyed_gw, CLIENT_KEYS[0])
    assert chat(c).usage.prompt_tokens > 0
    assert "".join(ch.choices[0].delta.content or "" for ch in chat(c, stream=True) if ch.choices)
    assert c.completions.create(model=MODEL, prompt="hi", max_tokens=4, **FULL).choices[0].text


@pytest.fixture(scope="module")
def limited_gw(module_gateway, module_vllm_sim):
    """A gateway with a client key and rate limits, in front of one vllm-sim."""
    gw = module_gateway({"CLIENT_API_KEYS": CLIENT_KEYS[0], "RATE_LIMIT_RPM": "100", "RATE_LIMIT_TPM": "10000"})
    sim = module_vllm_sim(*SIM_ARGS, "--seed", "5")
    gw.wait_ready(gw.register(sim.base_url, [MODEL])["id"])
    return gw


def test_rate_limit_headers_as_the_openai_api_sends_them(limited_gw):
    c = make_client(limited_gw, CLIENT_KEYS[0])
    seen = []
    for _ in range(2):
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=50, **FULL)
        assert raw.parse().usage.completion_tokens == 50
        h = raw.headers
        assert h["x-ratelimit-limit-requests"] == "100"
        assert h["x-ratelimit-limit-tokens"] == "10000"
        seen.append((int(h["x-ratelimit-remaining-requests"]), int(h["x-ratelimit-remaining-tokens"])))
        for name in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
            assert h[name].endswith("s"), h[name]
    # Charged at admission: each request one unit and its estimate (prompt plus 50 tokens).
    (req1, tok1), (req2, tok2) = seen
    assert req1 <= 99 and tok1 <= 10000 - 50, seen
    assert req2 < req1 and tok2 <= tok1 - 20, seen


def test_minted_key_works_until_revoked(keyed_gw):
    status, minted = keyed_gw.admin("POST", "/admin/keys", {"name": "ci"})
    assert status == 201, minted
    assert minted["name"] == "ci"
    key, key_id = minted["key"], minted["id"]
    status, listing = keyed_gw.admin("GET", "/admin/keys")
    assert status == 200
    assert key_id in [k["id"] for k in listing["data"]]
    assert key not in str(listing), "the key listing shows the key itself"

    c = make_client(keyed_gw, key)
    assert chat(c).choices[0].message.content

    status, body = keyed_gw.admin("DELETE", f"/admin/keys/{key_id}")
    assert status == 200, body
    revoked_at = time.monotonic()
    while True:
        try:
            chat(c, max_tokens=1)
        except openai.AuthenticationError:
            break
        assert time.monotonic() - revoked_at < 6.5, "a revoked key still works after 6.5 s"
        time.sleep(0.2)
    # The configured keys are unaffected.
    assert chat(make_client(keyed_gw, CLIENT_KEYS[1])).choices


# ---------------------------------------------------------------------------------------------------
# leases (keep last: it checks what the tests above left behind)


def test_every_lease_was_returned(open_gw, keyed_gw):
    for gw in (open_gw, keyed_gw):
        deadline = time.monotonic() + 5.0
        while True:
            status, state = gw.admin("GET", "/admin/pools/default")
            assert status == 200, state
            if state["in_flight"] == 0:
                break
            assert time.monotonic() < deadline, f"leases still in flight after 5 s: {state}"
            time.sleep(0.1)
