// The check of a real deployment's backend before it takes traffic: the part of the integration
// suite that needs no fault injection, run through the built Worker (Miniflare) against any vLLM
// server it can reach:
//
//   make test-real VLLM_URL=http://gpu-1.internal:8000 [VLLM_MODEL=...] [VLLM_API_KEY=...]
//
// Without VLLM_URL (as in `make test`) it runs against a vllm-sim started with vLLM 0.34's own
// defaults (no sim flags at all), so the check cannot rot. It covers what an operator needs to see
// work: the model listed, whole and streamed chat and text completions with usage, the backend's
// /metrics scraped and its load known, the error shapes of an unknown model and a bad body, and
// every lease returned. It sends a handful of short requests (max_tokens 8).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitFor, waitReady, errorBody } from "./lib/harness.mjs";

const REAL = process.env.VLLM_URL?.replace(/\/+$/, "");
const API_KEY = process.env.VLLM_API_KEY || undefined;
let gw;
let sim;
let model;
const BACKEND = "real-0";

before(async () => {
  let url = REAL;
  if (!url) {
    sim = await startSim([]);
    url = sim.url;
  }
  model = process.env.VLLM_MODEL || (await backendModels(url))[0];
  assert.ok(model, `${url}/v1/models lists no model`);
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "1000" } });
  const reg = await gw.admin("/admin/backends", {
    method: "POST",
    body: { id: BACKEND, url, pool: "real", models: [model], ...(API_KEY ? { api_key: API_KEY } : {}) },
  });
  assert.equal(reg.status, 201, await reg.text());
  await waitReady(gw, BACKEND, 30000);
});

after(async () => {
  await gw?.close();
  await sim?.close();
});

/** The model ids a vLLM server lists (its base models, not its LoRA adapters). */
async function backendModels(url) {
  const r = await fetch(`${url}/v1/models`, { headers: API_KEY ? { authorization: `Bearer ${API_KEY}` } : {} });
  assert.equal(r.status, 200, `GET ${url}/v1/models: ${r.status}`);
  return (await r.json()).data.filter((m) => !m.parent).map((m) => m.id);
}

function post(path, body) {
  return gw.fetch(path, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) });
}

/** The `data:` payloads of an SSE body, `[DONE]` included. */
function events(text) {
  return text.split("\n\n").map((e) => e.trim()).filter((e) => e.startsWith("data: ")).map((e) => e.slice(6));
}

test("the backend's model is listed through the gateway", async () => {
  const list = await (await gw.fetch("/v1/models")).json();
  assert.ok(list.data.some((m) => m.id === model), JSON.stringify(list));
});

test("a whole chat completion: an answer, its usage, the backend that served it", async () => {
  const r = await post("/v1/chat/completions", { model, max_tokens: 8, messages: [{ role: "user", content: "Say hello." }] });
  const text = await r.text();
  assert.equal(r.status, 200, text);
  assert.equal(r.headers.get("x-gateway-backend"), BACKEND);
  const v = JSON.parse(text);
  assert.equal(v.object, "chat.completion");
  assert.equal(typeof v.choices[0].message.content, "string");
  assert.ok(v.usage.prompt_tokens > 0 && v.usage.completion_tokens >= 1 && v.usage.completion_tokens <= 8, JSON.stringify(v.usage));
});

test("a streamed chat completion: chunks, the usage asked for, [DONE]", async () => {
  const r = await post("/v1/chat/completions", {
    model, max_tokens: 8, stream: true, stream_options: { include_usage: true },
    messages: [{ role: "user", content: "Count to five." }],
  });
  assert.equal(r.status, 200);
  assert.match(r.headers.get("content-type"), /text\/event-stream/);
  const data = events(await r.text());
  assert.equal(data.at(-1), "[DONE]");
  const chunks = data.slice(0, -1).map((d) => JSON.parse(d));
  assert.ok(chunks.every((c) => !c.error), "no error event");
  assert.ok(chunks.some((c) => c.choices?.[0]?.delta?.content !== undefined), "some content");
  const usage = chunks.at(-1).usage;
  assert.ok(usage && usage.completion_tokens >= 1, JSON.stringify(chunks.at(-1)));
  // Not asked for: the gateway asks the backend anyway, and takes the event out again.
  const plain = await post("/v1/chat/completions", { model, max_tokens: 4, stream: true, messages: [{ role: "user", content: "Hi." }] });
  const plainChunks = events(await plain.text()).slice(0, -1).map((d) => JSON.parse(d));
  assert.ok(plainChunks.every((c) => !c.usage), "no usage event unasked");
});

test("a text completion, whole and streamed", async () => {
  const whole = await post("/v1/completions", { model, prompt: "Once upon a time", max_tokens: 8 });
  const v = JSON.parse(await whole.text());
  assert.equal(whole.status, 200, JSON.stringify(v));
  assert.ok(v.usage.completion_tokens >= 1);
  const streamed = await post("/v1/completions", { model, prompt: "Once upon a time", max_tokens: 8, stream: true });
  assert.equal(streamed.status, 200);
  assert.equal(events(await streamed.text()).at(-1), "[DONE]");
});

test("the backend's /metrics are scraped: its load is known and its gauges are read", async () => {
  const view = await waitFor(async () => {
    const b = await (await gw.admin(`/admin/backends/${BACKEND}`)).json();
    return b.load_unknown === false && b.scraped?.running !== undefined && b.scraped?.running !== null ? b : null;
  }, { timeoutMs: 15000, what: "a scrape with vllm:* series (a server started with --disable-log-stats exports none)" });
  assert.ok(view.scraped.kv_usage >= 0 && view.scraped.kv_usage <= 1, JSON.stringify(view.scraped));
});

test("errors in OpenAI's shape: an unknown model is 404, a bad body 400", async () => {
  const unknown = await post("/v1/chat/completions", { model: "no-such-model-on-this-fleet", messages: [{ role: "user", content: "x" }] });
  assert.equal(unknown.status, 404);
  assert.equal((await errorBody(unknown)).code, "model_not_found");
  const bad = await gw.fetch("/v1/chat/completions", { method: "POST", headers: { "content-type": "application/json" }, body: "{not json" });
  assert.equal(bad.status, 400);
  assert.equal((await errorBody(bad)).type, "invalid_request_error");
});

test("every lease was returned", async () => {
  await waitFor(async () => {
    const p = await (await gw.admin("/admin/pools/real")).json();
    return p.in_flight === 0 ? p : null;
  }, { timeoutMs: 10000, what: "the pool's leases back to zero" });
});
