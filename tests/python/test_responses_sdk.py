"""The Responses API and Anthropic Messages through the gateway with the real Python SDKs (issue 43).

The built Worker runs under Miniflare in front of real vllm-sim processes; client keys are required,
so every call carries one (`Authorization: Bearer` from the `openai` SDK, `x-api-key` from the
`anthropic` SDK). `openai`: `client.responses.create` whole and streamed; `previous_response_id`
across turns landing on the backend that stored the first turn (the `x-gateway-backend` header via
`with_raw_response`) in a round-robin pool of three backends and four coordinator shards, where
nothing but the pool's record of the response keeps the turns together; another client key's
follow-up or retrieval of the response is `NotFoundError`; `responses.retrieve` and
`cancel` reaching that backend, `delete` answered 405 as vLLM 0.34 does; and a response whose
backend was removed with the admin API raising `NotFoundError` (`response_not_found`) instead of
reaching another backend. `anthropic`: `messages.create`, `messages.stream`, and the gateway's own
errors raised as the SDK's exception types.
"""

from __future__ import annotations

import time

import anthropic
import openai
import pytest
from openai import OpenAI

SIM = ("--time-scale", "50", "--enable-prompt-tokens-details")
KEY = "sk-resp-1"
OTHER_KEY = "sk-resp-2"
MODEL = "py-resp-model"
LOST_MODEL = "py-resp-lost"
MSG_MODEL = "py-msg-model"
INSTRUCTIONS = (
    "You are a careful assistant for an inference fleet. Answer briefly, cite the settings you rely on, "
    "and never guess at a number you were not given. Keep every answer under three sentences."
)


@pytest.fixture(scope="module")
def gw(module_gateway, module_vllm_sim):
    gw = module_gateway({"CLIENT_API_KEYS": f"{KEY},{OTHER_KEY}", "PROBE_INTERVAL_MS": "500"})
    # Round robin: without the pool's record, consecutive turns would go to different backends.
    status, body = gw.admin("PUT", "/admin/pools/py-resp", {"policy": "round_robin", "shards": 4})
    assert status == 200, body
    for i in range(3):
        sim = module_vllm_sim(*SIM, "--model", MODEL, "--seed", str(i))
        gw.wait_ready(gw.register(sim.base_url, [MODEL], pool="py-resp", id=f"py-resp-{i}")["id"])
    for i in range(2):
        sim = module_vllm_sim(*SIM, "--model", LOST_MODEL, "--seed", str(10 + i))
        gw.wait_ready(gw.register(sim.base_url, [LOST_MODEL], pool="py-lost", id=f"py-lost-{i}")["id"])
    sim = module_vllm_sim(*SIM, "--model", MSG_MODEL)
    gw.wait_ready(gw.register(sim.base_url, [MSG_MODEL], pool="py-msg", id="py-msg-0")["id"])
    return gw


@pytest.fixture(scope="module")
def client(gw) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=10.0)


@pytest.fixture(scope="module")
def claude(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=10.0)


def create(client: OpenAI, **kw):
    """(parsed response, backend that served it)."""
    raw = client.responses.with_raw_response.create(model=kw.pop("model", MODEL), **kw)
    return raw.parse(), raw.headers["x-gateway-backend"]


def test_responses_create_whole_and_streamed(client):
    first, backend = create(client, instructions=INSTRUCTIONS, input="What is a KV cache?", max_output_tokens=12)
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.output_text
    assert first.usage.input_tokens > 20 and first.usage.output_tokens >= 1
    assert backend.startswith("py-resp-")

    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Stream me a short answer.", max_output_tokens=10, stream=True
    )
    types, completed = [], None
    for event in raw.parse():
        types.append(event.type)
        # `response.incomplete` when `max_output_tokens` cut the answer.
        if event.type in ("response.completed", "response.incomplete"):
            completed = event
    assert types[0] == "response.created"
    assert "response.output_text.delta" in types
    assert completed is not None, types
    assert completed.response.usage.output_tokens >= 1
    assert raw.headers["x-gateway-backend"].startswith("py-resp-")


def test_previous_response_id_stays_on_the_backend_that_stored_it(client):
    first, home = create(client, instructions=INSTRUCTIONS, input="Explain prefix caching.", max_output_tokens=16)
    previous = first.id
    # Round robin moves every other request on; each turn of the conversation stays home.
    for turn in range(4):
        create(client, input=f"An unrelated request {turn}.", max_output_tokens=2)
        reply, backend = create(
            client, instructions=INSTRUCTIONS, input=f"And turn {turn}?", previous_response_id=previous, max_output_tokens=6
        )
        assert backend == home, f"turn {turn} went to {backend}, the response is on {home}"
        assert reply.previous_response_id == previous
        previous = reply.id
    # The conversation's prompt is the server's own history: its prefix cache hits.
    assert reply.usage.input_tokens_details.cached_tokens > 0


def stored_responses(gw, pool: str) -> float:
    """The pool's `llm_gateway_stored_responses` gauge on `/metrics`."""
    status, page = gw.request("GET", "/metrics", headers={"authorization": f"Bearer {gw.admin_token}"})
    assert status == 200
    prefix = f'llm_gateway_stored_responses{{pool="{pool}"}} '
    return sum(float(line[len(prefix):]) for line in page.splitlines() if line.startswith(prefix))


def wait_stored(gw, pool: str, at_least: float) -> float:
    """The gauge once it reached `at_least` (a release reaches the pool after the answer)."""
    deadline = time.monotonic() + 5
    while (n := stored_responses(gw, pool)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_the_pool_counts_the_responses_it_recorded(gw, client):
    time.sleep(0.3)  # the earlier tests' releases reach the pool
    before = stored_responses(gw, "py-resp")
    create(client, input="Count me.", max_output_tokens=2)
    assert wait_stored(gw, "py-resp", before + 1) == before + 1
    # `store: false` leaves nothing on the backend and nothing in the record; a stored one after
    # it is counted.
    client.responses.create(model=MODEL, input="Forget me.", store=False, max_output_tokens=2)
    create(client, input="Count me too.", max_output_tokens=2)
    assert wait_stored(gw, "py-resp", before + 2) == before + 2
    time.sleep(0.3)
    assert stored_responses(gw, "py-resp") == before + 2


def test_a_streamed_response_is_recorded_too(client):
    raw = client.responses.with_raw_response.create(
        model=MODEL, instructions=INSTRUCTIONS, input="Stream a first turn.", max_output_tokens=8, stream=True
    )
    home = raw.headers["x-gateway-backend"]
    response_id = None
    for event in raw.parse():
        if event.type in ("response.completed", "response.incomplete"):
            response_id = event.response.id
    assert response_id
    for turn in range(3):
        create(client, input=f"Filler {turn}.", max_output_tokens=2)
        _, backend = create(client, input="Next?", previous_response_id=response_id, max_output_tokens=4)
        assert backend == home


def test_retrieve_and_cancel_reach_the_holder_and_delete_is_vllms_405(client):
    first, home = create(client, input="Keep this one.", max_output_tokens=6)
    for _ in range(3):
        raw = client.responses.with_raw_response.retrieve(first.id)
        assert raw.headers["x-gateway-backend"] == home
        got = raw.parse()
        assert got.id == first.id and got.output_text == first.output_text
    # vLLM refuses to cancel a response that is not running in the background.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(first.id)
    assert "cancel" in str(e.value).lower()
    # vLLM 0.34 serves no DELETE for a response: 405, as it answers.
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.delete(first.id)
    assert e.value.status_code == 405
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve("resp_never_made_here")
    assert e.value.body["code"] == "response_not_found"
    assert e.value.body["param"] == "response_id"


def test_an_unknown_previous_response_id_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nowhere", max_output_tokens=2)
    assert e.value.body["code"] == "response_not_found"
    assert e.value.body["param"] == "previous_response_id"
    assert "resp_nowhere" in e.value.body["message"]
    # A bad type is the client's error, said clearly.
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body={"model": MODEL, "input": "x", "previous_response_id": 7}, cast_to=object)
    assert e.value.body["param"] == "previous_response_id"


def test_another_keys_response_is_not_found(gw, client):
    first, _ = create(client, input="Mine alone.", max_output_tokens=4)
    other = OpenAI(base_url=gw.url + "/v1", api_key=OTHER_KEY, max_retries=0, timeout=10.0)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model=MODEL, input="Let me in.", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    # Its owner still follows it up.
    reply, _ = create(client, input="Still mine?", previous_response_id=first.id, max_output_tokens=2)
    assert reply.previous_response_id == first.id


def test_a_follow_up_whose_backend_was_removed_is_not_found(gw, client):
    first, home = create(client, model=LOST_MODEL, input="Remember this.", max_output_tokens=6)
    status, body = gw.admin("DELETE", f"/admin/backends/{home}?force=true")
    assert status == 200, body
    # The other backend serves the model, but holds nothing of this conversation.
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=LOST_MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=4)
    assert e.value.body["code"] == "response_not_found"
    assert first.id in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    # The model itself is still served.
    reply, backend = create(client, model=LOST_MODEL, input="A new conversation.", max_output_tokens=4)
    assert backend != home and reply.output_text


def test_anthropic_messages_create_and_stream(claude):
    message = claude.messages.create(
        model=MSG_MODEL, max_tokens=12, system=INSTRUCTIONS, messages=[{"role": "user", "content": "What is a KV cache?"}]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.input_tokens > 0 and message.usage.output_tokens >= 1

    with claude.messages.stream(
        model=MSG_MODEL, max_tokens=10, messages=[{"role": "user", "content": "Stream a short answer."}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens >= 1

    counted = claude.messages.count_tokens(model=MSG_MODEL, messages=[{"role": "user", "content": "Hi there"}])
    assert counted.input_tokens > 0


def test_anthropic_errors_are_its_own_exception_types(gw, claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=gw.url, api_key="sk-wrong", max_retries=0, timeout=10.0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MSG_MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MSG_MODEL, max_tokens=4, messages=[])
