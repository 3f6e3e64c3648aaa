// The Responses API and Anthropic Messages through the built Worker in workerd (Miniflare on a real
// 127.0.0.1 port) against real vllm-sim processes, with the OpenAI Node client: responses.create
// whole and streamed (usage, the backend header), two turns with previous_response_id reaching the
// backend that stored the first with a prefix-cache hit, every turn pinned to that backend in a
// round-robin pool of three (and its retrieval too), and after a restart of the gateway (the
// pool's record is in its storage), a Messages conversation's turn 2 going
// where turn 1's prefix is, usage settled in the access log, and Messages errors in Anthropic's
// shape (the gateway's own 404 for an unknown model, 400 for a body without max_tokens).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";
import { startGatewayServer, startSim, tempDir, waitFor, waitReady } from "./lib/harness.mjs";

const BASE_MODEL = "resp-model";
let MODEL = BASE_MODEL;
const SYSTEM = "You are a careful assistant for an inference fleet. Answer briefly, cite the settings you rely on, "
  + "and never guess at a number you were not given. Keep every answer under three sentences.";

let gw;
let client;
const sims = [];
const logs = [];
let pool = 0;

before(async () => {
  gw = await startGatewayServer({ bindings: { PROBE_INTERVAL_MS: "500" }, onLog: (line) => logs.push(line) });
  client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: "unused", maxRetries: 0 });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

async function freshPool(n, policy) {
  pool += 1;
  const name = `r${pool}`;
  // A model of its own per pool: no other test's pool serves it.
  MODEL = `${BASE_MODEL}-${pool}`;
  const r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy } });
  assert.equal(r.status, 200, await r.text());
  const backends = [];
  for (let i = 0; i < n; i++) {
    const sim = await startSim(["--model", MODEL, "--time-scale", "50", "--seed", String(pool * 10 + i), "--enable-prompt-tokens-details"]);
    sims.push(sim);
    const id = `${name}-b${i}`;
    const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: name, models: [MODEL], id } });
    assert.equal(reg.status, 201, await reg.text());
    backends.push({ id, sim });
  }
  for (const b of backends) await waitReady(gw, b.id);
  return { name, backends };
}

function requestLog(requestId) {
  return waitFor(() => logs.map((l) => { try { return JSON.parse(l); } catch { return null; } })
    .find((l) => l && l.event === "request" && l.request_id === requestId && l.backend), { timeoutMs: 5000, what: "the access log line" });
}

test("responses.create, whole and streamed, through the gateway with usage and the backend named", async () => {
  const { backends } = await freshPool(1, "cache_aware");
  const { data, response } = await client.responses
    .create({ model: MODEL, instructions: SYSTEM, input: "What is a KV cache?", max_output_tokens: 12 })
    .withResponse();
  assert.equal(data.object, "response");
  assert.ok(data.id.startsWith("resp_"));
  assert.ok(typeof data.output_text === "string");
  assert.ok(data.usage.input_tokens > 20 && data.usage.output_tokens >= 1);
  assert.equal(response.headers.get("x-gateway-backend"), backends[0].id);

  const stream = await client.responses.create({ model: MODEL, input: "Stream me a short answer.", max_output_tokens: 10, stream: true });
  const types = [];
  let completed;
  for await (const event of stream) {
    types.push(event.type);
    if (event.type === "response.completed" || event.type === "response.incomplete") completed = event;
  }
  assert.equal(types[0], "response.created");
  assert.ok(types.includes("response.output_text.delta"));
  assert.ok(completed, `a terminal event in ${types.join(",")}`);
  assert.ok(completed.response.usage.output_tokens >= 1);
  const line = await requestLog(response.headers.get("x-request-id"));
  assert.ok(line.prompt_tokens > 20 || line.usage || line.status === 200, JSON.stringify(line));
});

test("previous_response_id: turn 2 reaches the backend that stored turn 1 and hits its prefix cache", async () => {
  await freshPool(1, "cache_aware");
  const first = await client.responses.create({ model: MODEL, instructions: SYSTEM, input: "Explain prefix caching.", max_output_tokens: 16 });
  const { data: second, response } = await client.responses
    .create({ model: MODEL, instructions: SYSTEM, input: "And eviction?", previous_response_id: first.id, max_output_tokens: 8 })
    .withResponse();
  assert.equal(second.previous_response_id, first.id);
  assert.ok(second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16,
    `cached ${second.usage.input_tokens_details.cached_tokens} of ${first.usage.input_tokens}`);
  assert.ok(response.headers.get("x-gateway-backend"));
  // An id no backend stored: the gateway's 404 response_not_found, the OpenAI client's NotFoundError.
  await assert.rejects(
    client.responses.create({ model: MODEL, input: "x", previous_response_id: "resp_nowhere" }),
    (e) => e instanceof OpenAI.NotFoundError,
  );
});

test("previous_response_id pins every turn to the backend holding the response, in a round-robin pool of three", async () => {
  const { name } = await freshPool(3, "round_robin");
  const first = await client.responses
    .create({ model: MODEL, instructions: SYSTEM, input: "Explain prefix caching.", max_output_tokens: 8 })
    .withResponse();
  const home = first.response.headers.get("x-gateway-backend");
  assert.ok(home.startsWith(name));
  let previous = first.data.id;
  for (let turn = 0; turn < 3; turn++) {
    // Round robin moves every other request on; the conversation stays where its response is.
    await client.responses.create({ model: MODEL, input: `Filler ${turn}.`, max_output_tokens: 2 });
    const { data, response } = await client.responses
      .create({ model: MODEL, input: `Turn ${turn}?`, previous_response_id: previous, max_output_tokens: 4 })
      .withResponse();
    assert.equal(response.headers.get("x-gateway-backend"), home, `turn ${turn}`);
    previous = data.id;
  }
  // Retrieval goes to the same backend.
  const { data: got, response } = await client.responses.retrieve(previous).withResponse();
  assert.equal(got.id, previous);
  assert.equal(response.headers.get("x-gateway-backend"), home);
});

test("the pool's record of a stored response survives a restart of the gateway", async () => {
  const persist = tempDir();
  const model = `${BASE_MODEL}-restart`;
  let g = await startGatewayServer({ persistDir: persist.dir, bindings: { PROBE_INTERVAL_MS: "500" } });
  try {
    const put = await g.admin("/admin/pools/rr-restart", { method: "PUT", body: { policy: "round_robin" } });
    assert.equal(put.status, 200, await put.text());
    for (let i = 0; i < 3; i++) {
      const sim = await startSim(["--model", model, "--time-scale", "50", "--seed", String(90 + i)]);
      sims.push(sim);
      const reg = await g.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: "rr-restart", models: [model], id: `rs-b${i}` } });
      assert.equal(reg.status, 201, await reg.text());
      await waitReady(g, `rs-b${i}`);
    }
    const before = new OpenAI({ baseURL: `${g.url}/v1`, apiKey: "unused", maxRetries: 0 });
    const first = await before.responses.create({ model, input: "Remember this.", max_output_tokens: 4 }).withResponse();
    const home = first.response.headers.get("x-gateway-backend");
    // The pool's objects start again from their storage.
    await g.close();
    g = await startGatewayServer({ persistDir: persist.dir, bindings: { PROBE_INTERVAL_MS: "500" } });
    for (let i = 0; i < 3; i++) await waitReady(g, `rs-b${i}`);
    const after = new OpenAI({ baseURL: `${g.url}/v1`, apiKey: "unused", maxRetries: 0 });
    for (let turn = 0; turn < 3; turn++) {
      await after.responses.create({ model, input: `Filler ${turn}.`, max_output_tokens: 2 });
      const { response } = await after.responses
        .create({ model, input: `Turn ${turn}?`, previous_response_id: first.data.id, max_output_tokens: 2 })
        .withResponse();
      assert.equal(response.headers.get("x-gateway-backend"), home, `turn ${turn} after the restart`);
    }
  } finally {
    await g.close();
    persist.cleanup();
  }
});

test("a Messages conversation's turn 2 goes where turn 1's prefix is", async () => {
  const { name } = await freshPool(3, "cache_aware");
  const turn1 = [{ role: "user", content: "Describe, in detail, how a gateway can place a conversation's next turn on the server that cached it." }];
  const send = (messages) => gw.fetch("/v1/messages", {
    method: "POST",
    headers: { "content-type": "application/json", "anthropic-version": "2023-06-01" },
    body: JSON.stringify({ model: MODEL, max_tokens: 8, system: SYSTEM, messages }),
  });
  const r1 = await send(turn1);
  assert.equal(r1.status, 200, await r1.clone().text());
  const m1 = await r1.json();
  assert.equal(m1.type, "message");
  const home = r1.headers.get("x-gateway-backend");
  assert.ok(home.startsWith(name));
  for (let i = 0; i < 3; i++) {
    const turn2 = [...turn1, { role: "assistant", content: m1.content[0].text }, { role: "user", content: `Follow-up number ${i}?` }];
    const r2 = await send(turn2);
    assert.equal(r2.status, 200);
    assert.equal(r2.headers.get("x-gateway-backend"), home, "turn 2 follows turn 1's prefix");
    const m2 = await r2.json();
    assert.ok(m2.usage.cache_read_input_tokens > 0, JSON.stringify(m2.usage));
  }
});

test("Messages streams end with message_stop and the gateway's errors are Anthropic's", async () => {
  await freshPool(1, "cache_aware");
  const r = await gw.fetch("/v1/messages", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: MODEL, max_tokens: 6, stream: true, messages: [{ role: "user", content: "Hi" }] }),
  });
  assert.equal(r.status, 200);
  const text = await r.text();
  assert.match(text, /^event: message_start\n/);
  assert.match(text, /event: message_stop\n/);

  const unknown = await gw.fetch("/v1/messages", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: "no-such-model", max_tokens: 6, messages: [{ role: "user", content: "Hi" }] }),
  });
  assert.equal(unknown.status, 404);
  const e = await unknown.json();
  assert.equal(e.type, "error");
  assert.equal(e.error.type, "not_found_error");

  const noMax = await gw.fetch("/v1/messages", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content: "Hi" }] }),
  });
  assert.equal(noMax.status, 400);
  assert.equal((await noMax.json()).error.type, "invalid_request_error");

  const count = await gw.fetch("/v1/messages/count_tokens", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content: "Hi" }] }),
  });
  assert.equal(count.status, 200);
  assert.ok((await count.json()).input_tokens > 0);
});
