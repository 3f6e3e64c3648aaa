"""The pass-through routes (issue 43) through the gateway with the real `openai` client.

The built Worker runs under Miniflare in front of real vllm-sim processes serving vLLM 0.34's routes
by task: a chat model (with a LoRA adapter), a cross-encoder (rerank/score/classify) and a Whisper-
class transcription model. `client.audio.transcriptions.create` sends a small WAV made here; the SDK
has no rerank/score/tokenize calls, so those go through `client.post` (the SDK's own HTTP stack,
auth and error mapping; `cast_to=object` returns the parsed JSON); the root routes (`/tokenize`,
`/classify`) go through the fixture's plain HTTP helper. A chat model asked to rerank raises the
SDK's NotFoundError (404 `model_does_not_support_endpoint`) naming the model and the route, and
its backend stays healthy with its breaker closed.
"""

from __future__ import annotations

import io
import struct

import openai
import pytest
from openai import OpenAI

SIM = ("--time-scale", "50")


def wav(seconds: int) -> bytes:
    rate, data = 16000, 32000 * seconds
    header = b"RIFF" + struct.pack("<I", 36 + data) + b"WAVEfmt "
    header += struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16) + b"data" + struct.pack("<I", data)
    return header + bytes(data)


@pytest.fixture(scope="module")
def gw(module_gateway, module_vllm_sim):
    gw = module_gateway()
    chat = module_vllm_sim(*SIM, "--model", "py-chat", "--lora-modules", "py-lora=/loras/py")
    rr = module_vllm_sim(*SIM, "--model", "py-rr", "--task", "classify")
    whisper = module_vllm_sim(*SIM, "--model", "py-whisper", "--task", "transcription")
    for sim, model, pool in ((chat, "py-chat", "py-chat"), (rr, "py-rr", "py-rr"), (whisper, "py-whisper", "py-audio")):
        backend = gw.register(sim.base_url, [model], pool=pool, id=f"{pool}-0")
        gw.wait_ready(backend["id"])
    return gw


@pytest.fixture(scope="module")
def client(gw) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=10.0)


def test_transcription_with_the_sdk(client):
    result = client.audio.transcriptions.create(model="py-whisper", file=("clip.wav", io.BytesIO(wav(1)), "audio/wav"))
    assert result.text
    translated = client.audio.translations.create(model="py-whisper", file=("clip.wav", io.BytesIO(wav(1)), "audio/wav"))
    assert translated.text == result.text


def test_streamed_transcription_with_the_sdk(client):
    stream = client.audio.transcriptions.create(
        model="py-whisper", file=("clip.wav", io.BytesIO(wav(1)), "audio/wav"), stream=True
    )
    # vLLM streams `transcription.chunk` objects (chat-like deltas), which the SDK hands over as
    # events; at least the text's chunks arrive.
    events = list(stream)
    assert len(events) >= 1


def test_rerank_and_score_through_client_post(client):
    docs = ["bananas are yellow", "Paris is the capital of France"]
    v = client.post("/rerank", body={"model": "py-rr", "query": "capital of France", "documents": docs}, cast_to=object)
    assert v["results"][0]["index"] == 1
    assert v["usage"]["prompt_tokens"] > 0
    score = client.post("/score", body={"model": "py-rr", "text_1": "q", "text_2": ["a", "b"]}, cast_to=object)
    assert [d["index"] for d in score["data"]] == [0, 1]


def test_tokenize_detokenize_classify_at_the_root(gw):
    status, t = gw.request("POST", "/tokenize", {"model": "py-chat", "prompt": "abcdefgh"})
    assert status == 200, t
    assert t["count"] == 2
    status, d = gw.request("POST", "/detokenize", {"model": "py-chat", "tokens": t["tokens"]})
    assert (status, d["prompt"]) == (200, "abcdefgh")
    status, c = gw.request("POST", "/classify", {"model": "py-rr", "input": "fine"})
    assert status == 200 and c["data"][0]["num_classes"] == 1


def test_a_chat_model_asked_to_rerank_is_not_found_and_no_breaker_opens(gw, client):
    for _ in range(6):
        with pytest.raises(openai.NotFoundError) as err:
            client.post("/rerank", body={"model": "py-chat", "query": "q", "documents": ["d"]}, cast_to=object)
        assert "py-chat" in str(err.value) and "/v1/rerank" in str(err.value)
    status, backend = gw.admin("GET", "/admin/backends/py-chat-0")
    assert status == 200
    assert (backend["health"], backend["breaker"]) == ("healthy", "closed")


def test_lora_adapter_listed_and_served(client):
    models = {m.id: m for m in client.models.list().data}
    assert "py-lora" in models
    card = models["py-lora"].model_dump()
    assert (card.get("parent"), card.get("root")) == ("py-chat", "/loras/py")
    reply = client.chat.completions.create(model="py-lora", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert reply.model == "py-lora"
