// Every request's lease and stream end correctly, and the gateway counts real usage (issue 12).
// The built Worker in workerd (Miniflare, on a real 127.0.0.1 port so the OpenAI Node client can
// reach it) in front of real vllm-sim processes and, for faults vllm-sim cannot produce, small
// local servers that misbehave on purpose: a backend that goes silent after its first tokens, one
// that cuts a JSON body or an SSE event in half, one that never answers. Each test asserts what
// the client sees, what the breaker records, and that leases and in-flight tokens return to zero.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import OpenAI from "openai";
import {
  startGateway, startGatewayServer, startSim, waitFor, waitReady, errorBody, parseMetrics, metricValue, poolObjectCall, setFaults, tempDir,
} from "./lib/harness.mjs";

const FIRST_BYTE_TIMEOUT_MS = 3000;
const RESPONSE_TIMEOUT_MS = 5000;
const STREAM_IDLE_TIMEOUT_MS = 1000;
const BINDINGS = {
  // These tests hold the error path: resuming a failed stream elsewhere is tested in resume.test.mjs.
  MAX_STREAM_RESUMES: "0",
  PROBE_INTERVAL_MS: "500",
  FIRST_BYTE_TIMEOUT_MS: String(FIRST_BYTE_TIMEOUT_MS),
  RESPONSE_TIMEOUT_MS: String(RESPONSE_TIMEOUT_MS),
  STREAM_IDLE_TIMEOUT_MS: String(STREAM_IDLE_TIMEOUT_MS),
  ALLOW_REGION_HEADER: "true",
};
// Enough retry budget that no test's retries are refused by it.
const ROOMY_BUDGET = { retry_budget: { ratio: 1.0, min_per_window: 1000, window_ms: 10000 } };
const STRICT_BREAKER = { breaker: { failure_threshold: 1, base_cooldown_ms: 60000, max_cooldown_ms: 60000, jitter_ratio: 0 } };

let gw;
const logs = [];
const closers = [];
let seq = 0;

before(async () => {
  gw = await startGatewayServer({ bindings: BINDINGS, onLog: (line) => logs.push(line) });
});

after(async () => {
  for (const close of closers.reverse()) await close();
  await gw?.close();
});

afterEach(async () => {
  // No lease may outlive its request, whatever happened to it.
  await waitFor(async () => {
    const pools = (await (await gw.admin("/admin/pools")).json()).data;
    return pools.every((p) => p.in_flight === 0 && p.in_flight_tokens === 0) ? pools : null;
  }, { timeoutMs: 5000, what: "every pool's leases and in-flight tokens back to zero" });
});

/** The next test's pool and model names (each test routes its own model to its own pool). */
function next() {
  seq += 1;
  return { name: `life${seq}`, model: `life-model-${seq}` };
}

/** Pool `name` serving `model` on `backends` (`{ url }`: sims or fake servers), all ready. */
async function freshPool({ name, model }, backends, { policy = "round_robin", settings = {}, roles = [] } = {}) {
  const put = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy, ...ROOMY_BUDGET, ...settings } });
  assert.equal(put.status, 200, await put.text());
  const ids = [];
  for (const [i, b] of backends.entries()) {
    const id = `${name}-b${i}`;
    const r = await gw.admin("/admin/backends", { method: "POST", body: { url: b.url, pool: name, models: [model], id, role: roles[i] } });
    assert.equal(r.status, 201, await r.text());
    ids.push(id);
  }
  for (const id of ids) await waitReady(gw, id);
  return { name, model, ids };
}

async function sim(model, args, opts) {
  const s = await startSim(["--model", model, ...args], opts);
  closers.push(s.close);
  return s;
}

/**
 * A local backend serving `model`: answers probes (health, models) and hands generation requests
 * to `handler(req, res, record)`. `requests` records each generation request and whether its
 * connection was closed by the gateway before the handler finished (`aborted`).
 */
async function fakeBackend(model, handler) {
  const state = { requests: [] };
  const server = http.createServer((req, res) => {
    let body = "";
    req.on("data", (d) => (body += d));
    req.on("end", () => {
      if (req.url === "/health") return res.end("ok");
      if (req.url === "/v1/models") {
        res.writeHead(200, { "content-type": "application/json" });
        return res.end(JSON.stringify({ object: "list", data: [{ id: model, object: "model" }] }));
      }
      if (req.method === "GET") { res.writeHead(404); return res.end(); }
      const record = { body: JSON.parse(body || "{}"), aborted: false, finished: false };
      state.requests.push(record);
      res.on("close", () => { if (!res.writableFinished) record.aborted = true; });
      handler(req, res, record);
    });
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  state.url = `http://127.0.0.1:${server.address().port}`;
  state.close = () => new Promise((r) => { server.closeAllConnections(); server.close(r); });
  closers.push(state.close);
  return state;
}

const chunk = (content, extra = {}) =>
  `data: ${JSON.stringify({ id: "chatcmpl-fake", object: "chat.completion.chunk", created: 1, model: "m", choices: [{ index: 0, delta: { content }, finish_reason: null }], ...extra })}\n\n`;

async function chat(model, { stream = false, max_tokens = 8, extra = {}, signal, content = "hello there" } = {}) {
  const r = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model, messages: [{ role: "user", content }], stream, max_tokens, ...extra }),
    signal,
  });
  const text = await r.text();
  return { status: r.status, text, headers: r.headers, backend: r.headers.get("x-gateway-backend"), attempts: Number(r.headers.get("x-gateway-attempts")) };
}

/** The `data:` payloads of an SSE body, `[DONE]` included, each checked to be a whole event. */
function sseEvents(text) {
  const events = text.split("\n\n");
  assert.equal(events.pop(), "", `the stream does not end on an event boundary: ${JSON.stringify(text.slice(-120))}`);
  return events.map((e) => {
    assert.ok(e.startsWith("data: "), `not a data event: ${JSON.stringify(e.slice(0, 120))}`);
    const data = e.slice(6);
    return data === "[DONE]" ? data : JSON.parse(data);
  });
}

async function metrics() {
  const r = await gw.admin("/metrics");
  assert.equal(r.status, 200);
  return parseMetrics(await r.text());
}

async function simCounter(s, name) {
  const text = await (await fetch(`${s.url}/metrics`)).text();
  return parseMetrics(text).filter((x) => x.name === name).reduce((a, x) => a + x.value, 0);
}

async function backendView(id) {
  const r = await gw.admin(`/admin/backends/${id}`);
  assert.equal(r.status, 200);
  return r.json();
}

const outcomes = (m, backend, outcome) => metricValue(m, "llm_gateway_request_outcomes_total", { backend, outcome }) ?? 0;

test("usage: counted by kind, equal to the backends' own counters; clients see exactly the usage they asked for", async () => {
  const n = next();
  const sims = [await sim(n.model, ["--time-scale", "200", "--seed", "1"]), await sim(n.model, ["--time-scale", "200", "--seed", "2"])];
  const p = await freshPool(n, sims, { policy: "cache_aware" });
  const shared = "You are a careful assistant. ".repeat(20);
  let asked = 0;
  for (let i = 0; i < 12; i++) {
    const content = `${shared} question ${i % 4}`;
    const stream = i % 3 !== 0;
    const wantUsage = i % 3 === 2;
    const extra = { ignore_eos: true, ...(wantUsage ? { stream_options: { include_usage: true } } : {}) };
    const r = await chat(p.model, { stream, max_tokens: 5 + i, extra, content });
    assert.equal(r.status, 200, r.text);
    if (!stream) {
      const body = JSON.parse(r.text);
      assert.equal(body.usage.completion_tokens, 5 + i);
      assert.ok(body.usage.prompt_tokens > 100);
      continue;
    }
    const events = sseEvents(r.text);
    assert.equal(events.at(-1), "[DONE]");
    const usageChunks = events.filter((e) => e !== "[DONE]" && e.usage);
    if (wantUsage) {
      asked += 1;
      assert.equal(usageChunks.length, 1, "the usage chunk the client asked for arrives once");
      assert.deepEqual(usageChunks[0].choices, []);
      assert.equal(usageChunks[0].usage.completion_tokens, 5 + i);
    } else {
      assert.equal(usageChunks.length, 0, `a usage chunk the client did not ask for: ${r.text.slice(-400)}`);
      assert.ok(events.every((e) => e === "[DONE]" || e.choices.length > 0), "no empty-choices chunk");
    }
  }
  assert.equal(asked, 4);
  // The OpenAI Node client sees the same.
  const client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: "unused", maxRetries: 0 });
  const plain = await client.chat.completions.create({ model: p.model, messages: [{ role: "user", content: "node" }], max_tokens: 6, stream: true, ignore_eos: true });
  let count = 0;
  for await (const c of plain) {
    assert.equal(c.usage ?? null, null);
    assert.ok(c.choices.length > 0);
    count += 1;
  }
  assert.ok(count >= 6);
  const withUsage = await client.chat.completions.create({ model: p.model, messages: [{ role: "user", content: "node" }], max_tokens: 6, stream: true, ignore_eos: true, stream_options: { include_usage: true } });
  let last;
  for await (const c of withUsage) last = c;
  assert.equal(last.usage.completion_tokens, 6);
  // Completions too.
  const comp = await gw.fetch("/v1/completions", { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ model: p.model, prompt: shared, max_tokens: 4, stream: true, ignore_eos: true }) });
  assert.equal(comp.status, 200);
  assert.ok(sseEvents(await comp.text()).every((e) => e === "[DONE]" || !e.usage));

  await waitFor(async () => {
    const s = await (await gw.admin(`/admin/pools/${p.name}`)).json();
    return s.in_flight === 0 ? s : null;
  }, { what: "leases back to zero" });
  // Every token the backends counted, the gateway counted, by kind.
  const m = await metrics();
  const gateway = (kind) => p.ids.reduce((a, id) => a + (metricValue(m, "llm_gateway_tokens_total", { backend: id, kind }) ?? 0), 0);
  const backends = async (name) => (await Promise.all(sims.map((s) => simCounter(s, name)))).reduce((a, b) => a + b, 0);
  const prompt = await backends("vllm:prompt_tokens_total");
  const generated = await backends("vllm:generation_tokens_total");
  const cached = await backends("vllm:prefix_cache_hits_total");
  assert.ok(prompt > 1000 && generated > 100 && cached > 0, `backend counters ${prompt} ${generated} ${cached}`);
  assert.equal(gateway("prompt"), prompt, "prompt tokens");
  assert.equal(gateway("completion"), generated, "completion tokens");
  assert.equal(gateway("cached"), cached, "cached prompt tokens");
  // And the access log line carries them.
  await waitFor(() => logs.some((l) => l.includes(`"pool":"${p.name}"`) && /"completion_tokens":\d+/.test(l)), { what: "an access log line with tokens" });
});

// workerd (as Miniflare runs it here) does not tell a Worker that its client hung up before the
// response started: `request.signal` fires only on the edge then. Locally the upstream attempt
// runs to its timeout; what must hold everywhere is that the attempt is aborted, the lease comes
// back, and the client's socket is not kept.
test("a client that hangs up before the first byte: upstream closed and lease released (by the attempt's timeout locally)", async () => {
  const n = next();
  const silent = await fakeBackend(n.model, () => {}); // accepts the request, never answers
  const p = await freshPool(n, [silent]);
  for (const stream of [true, false]) {
    const controller = new AbortController();
    const pending = chat(p.model, { stream, signal: controller.signal }).catch((e) => e);
    await waitFor(async () => (await backendView(p.ids[0])).leases_in_flight === 1, { what: "the lease to be held" });
    controller.abort();
    assert.equal((await pending).name, "AbortError");
    const bound = (stream ? FIRST_BYTE_TIMEOUT_MS : RESPONSE_TIMEOUT_MS) + 3000;
    await waitFor(async () => (await backendView(p.ids[0])).leases_in_flight === 0, { timeoutMs: bound, what: `the lease released after the hang-up (stream ${stream})` });
    await waitFor(() => silent.requests.at(-1).aborted, { timeoutMs: bound, what: "the upstream request aborted" });
  }
  const pool = await (await gw.admin(`/admin/pools/${p.name}`)).json();
  assert.equal(pool.in_flight_tokens, 0);
});

test("a stream that goes silent after its first tokens: idle timeout, SSE error event, upstream aborted, breaker counts it", async () => {
  const n = next();
  const stalling = await fakeBackend(n.model, (req, res) => {
    res.writeHead(200, { "content-type": "text/event-stream" });
    res.write(chunk("one "));
    setTimeout(() => res.write(chunk("two ")), 100);
    // ...and then nothing, with the connection open.
  });
  const p = await freshPool(n, [stalling], { settings: STRICT_BREAKER });
  const r = await chat(p.model, { stream: true });
  assert.equal(r.status, 200);
  const events = sseEvents(r.text);
  assert.equal(events.at(-1), "[DONE]");
  assert.deepEqual(events.slice(0, 2).map((e) => e.choices[0].delta.content), ["one ", "two "]);
  const err = events.at(-2).error;
  assert.equal(err?.code, "upstream_idle_timeout", JSON.stringify(events.at(-2)));
  assert.equal(err.type, "server_error");
  assert.ok(!JSON.stringify(err).includes("127.0.0.1"), "no backend URL in the error");
  await waitFor(() => stalling.requests[0].aborted, { what: "the silent upstream request aborted" });
  await waitFor(async () => (await backendView(p.ids[0])).leases_in_flight === 0, { what: "the lease released" });
  const m = await metrics();
  assert.equal(outcomes(m, p.ids[0], "timeout"), 1, "the idle stream is the backend's timeout");
  assert.equal((await backendView(p.ids[0])).breaker, "open", "and counts against its breaker (threshold 1)");
});

test("a client that reads slowly is not mistaken for a silent backend", async () => {
  const n = next();
  const s = await sim(n.model, ["--time-scale", "1000", "--seed", "3"]);
  const p = await freshPool(n, [s], { settings: STRICT_BREAKER });
  const resp = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: p.model, messages: [{ role: "user", content: "a long one" }], stream: true, max_tokens: 300, ignore_eos: true, stream_options: { include_usage: true } }),
  });
  assert.equal(resp.status, 200);
  const reader = resp.body.getReader();
  let text = new TextDecoder().decode((await reader.read()).value);
  // The backend has long finished; the client pauses for twice the idle timeout before reading on.
  await new Promise((r) => setTimeout(r, 2 * STREAM_IDLE_TIMEOUT_MS));
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    text += new TextDecoder().decode(value);
  }
  const events = sseEvents(text);
  assert.equal(events.at(-1), "[DONE]");
  assert.ok(!text.includes("upstream_idle_timeout"), "a slow client made the backend look idle");
  assert.equal(events.at(-2).usage.completion_tokens, 300, "the whole answer arrived");
  await waitFor(async () => (await backendView(p.ids[0])).leases_in_flight === 0, { what: "the lease released" });
  const m = await metrics();
  assert.equal(outcomes(m, p.ids[0], "success"), 1);
  assert.equal(outcomes(m, p.ids[0], "timeout"), 0);
});

test("a non-streamed answer cut mid-body is retried on the next candidate, or answered 502; never a 200 with broken JSON", async () => {
  const answer = JSON.stringify({ id: "x", object: "chat.completion", choices: [{ index: 0, message: { role: "assistant", content: "hi ".repeat(200) }, finish_reason: "stop" }], usage: { prompt_tokens: 5, completion_tokens: 200, total_tokens: 205 } });
  const n = next();
  const truncate = (req, res) => {
    res.writeHead(200, { "content-type": "application/json", "content-length": String(answer.length) });
    res.write(answer.slice(0, 300));
    setTimeout(() => res.socket.destroy(), 50);
  };
  const cutJson = (req, res) => {
    const cut = answer.slice(0, 300);
    res.writeHead(200, { "content-type": "application/json", "content-length": String(cut.length) });
    res.end(cut); // a complete HTTP body that is not whole JSON
  };
  const truncated = await fakeBackend(n.model, truncate);
  const invalid = await fakeBackend(n.model, cutJson);
  const good = await fakeBackend(n.model, (req, res) => {
    res.writeHead(200, { "content-type": "application/json" });
    res.end(answer);
  });
  // Alone, each broken backend's answer becomes an OpenAI-style 502 (its own model, its own pool).
  for (const [i, handler] of [truncate, cutJson].entries()) {
    const alone = { name: `${n.name}-alone${i}`, model: `${n.model}-alone${i}` };
    const broken = await fakeBackend(alone.model, handler);
    const p = await freshPool(alone, [broken]);
    const r = await chat(p.model);
    assert.equal(r.status, 502, r.text);
    const err = await errorBody(new Response(r.text));
    assert.equal(err.type, "server_error");
    assert.ok(!r.text.includes("127.0.0.1"));
    const m = await metrics();
    assert.equal(outcomes(m, p.ids[0], "transport"), 1, "the broken body counts against the backend");
  }
  // With a good backend next in line, the client gets the good answer.
  const p = await freshPool(n, [truncated, invalid, good], { policy: "round_robin" });
  let retried = 0;
  for (let i = 0; i < 6; i++) {
    const r = await chat(p.model, { content: `q${i}` });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.backend, p.ids[2]);
    assert.deepEqual(JSON.parse(r.text), JSON.parse(answer));
    if (r.attempts > 1) retried += 1;
  }
  assert.ok(retried >= 2, `retried ${retried}`);
  const m = await metrics();
  assert.equal(metricValue(m, "llm_gateway_tokens_total", { backend: p.ids[2], kind: "completion" }), 6 * 200);
});

test("a backend that drops a stream mid-event: the error event starts on an event boundary and the OpenAI client raises APIError", async () => {
  const n = next();
  const cutting = await fakeBackend(n.model, (req, res) => {
    res.writeHead(200, { "content-type": "text/event-stream" });
    res.write(chunk("whole "));
    const partial = chunk("never finished");
    setTimeout(() => { res.write(partial.slice(0, 40)); setTimeout(() => res.socket.destroy(), 50); }, 50);
  });
  const p = await freshPool(n, [cutting]);
  const raw = await chat(p.model, { stream: true });
  assert.equal(raw.status, 200);
  const events = sseEvents(raw.text);
  assert.equal(events.at(-1), "[DONE]");
  assert.equal(events.at(-2).error?.code, "upstream_stream_error");
  assert.equal(events[0].choices[0].delta.content, "whole ");
  const client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: "unused", maxRetries: 0 });
  const stream = await client.chat.completions.create({ model: p.model, messages: [{ role: "user", content: "hi" }], stream: true });
  const seen = [];
  await assert.rejects(
    (async () => { for await (const c of stream) seen.push(c.choices[0].delta.content); })(),
    (e) => e instanceof OpenAI.APIError && /failed while streaming/.test(e.message),
  );
  assert.deepEqual(seen, ["whole "]);
  const m = await metrics();
  assert.equal(outcomes(m, p.ids[0], "transport"), 2);
});

test("leases live as long as their requests: renewed past lease_ttl_ms while streaming, never expired", async () => {
  const n = next();
  const s = await sim(n.model, ["--time-scale", "1", "--decode-ms-per-step", "100", "--seed", "4"]); // ~10 tokens a second
  // The shortest lease accepted (10 s) and a stream of about 13 s.
  const p = await freshPool(n, [s], { settings: { lease_ttl_ms: 10000 } });
  const started = Date.now();
  const streaming = chat(p.model, { stream: true, max_tokens: 130, extra: { ignore_eos: true } });
  await waitFor(async () => (await backendView(p.ids[0])).leases_in_flight === 1, { what: "the stream to start" });
  // Past a lease period the request is still counted.
  await new Promise((r) => setTimeout(r, Math.max(0, started + 11500 - Date.now())));
  const mid = await backendView(p.ids[0]);
  assert.equal(mid.leases_in_flight, 1, "the lease of a running stream expired");
  const r = await streaming;
  assert.equal(r.status, 200);
  assert.equal(sseEvents(r.text).at(-1), "[DONE]");
  await waitFor(async () => (await backendView(p.ids[0])).leases_in_flight === 0, { what: "the lease released" });
  const m = await metrics();
  assert.equal(metricValue(m, "llm_gateway_leases_expired_by_backend_total", { backend: p.ids[0] }), 0);
  assert.equal(outcomes(m, p.ids[0], "success"), 1);
});

test("disaggregated: each stage reports its own outcome and the prefill share ends with the prefill", async () => {
  const n = next();
  const prefill = await sim(n.model, ["--role", "prefill", "--time-scale", "100", "--seed", "5"]);
  const decode = await sim(n.model, ["--role", "decode", "--time-scale", "1", "--decode-ms-per-step", "100", "--seed", "6"]);
  const p = await freshPool(n, [prefill, decode], { policy: "disaggregated", roles: ["prefill", "decode"], settings: STRICT_BREAKER });
  const [pf, dc] = p.ids;
  // While the decode server streams (slowly), only its share is counted.
  const streaming = chat(p.model, { stream: true, max_tokens: 15, extra: { ignore_eos: true }, content: "disaggregate me ".repeat(30) });
  await waitFor(async () => (await backendView(dc)).leases_in_flight === 1 && (await backendView(pf)).leases_in_flight === 0, { what: "the prefill share to end while decode streams" });
  const r = await streaming;
  assert.equal(r.status, 200, r.text);
  assert.equal(r.headers.get("x-gateway-prefill-backend"), pf);
  assert.equal(sseEvents(r.text).at(-1), "[DONE]");
  await waitFor(async () => (await backendView(dc)).leases_in_flight === 0, { what: "the decode share released" });
  let m = await metrics();
  assert.equal(outcomes(m, pf, "success"), 1);
  assert.equal(outcomes(m, dc, "success"), 1);
  // Each backend's tokens are its own: the prefill counted the prompt and its one token.
  assert.equal(metricValue(m, "llm_gateway_tokens_total", { backend: pf, kind: "completion" }), await simCounter(prefill, "vllm:generation_tokens_total"));
  assert.equal(metricValue(m, "llm_gateway_tokens_total", { backend: dc, kind: "completion" }), await simCounter(decode, "vllm:generation_tokens_total"));
  // A failing prefill blames the prefill server only.
  await setFaults(prefill, { error_rate: 1.0 });
  const failed = await chat(p.model, { max_tokens: 4 });
  assert.equal(failed.status, 502, failed.text);
  await waitFor(async () => (await backendView(dc)).leases_in_flight === 0, { what: "the lease released" });
  m = await metrics();
  assert.equal(outcomes(m, pf, "server_error"), 1);
  assert.equal(outcomes(m, dc, "cancelled"), 1, "the decode stage never ran");
  assert.equal((await backendView(pf)).breaker, "open");
  assert.equal((await backendView(dc)).breaker, "closed", "the decode server is not blamed for the prefill's failure");
});

test("retries learn: the prefix is recorded on the backend that served, not the one that failed", async () => {
  const n = next();
  const sims = [await sim(n.model, ["--time-scale", "200", "--seed", "7"]), await sim(n.model, ["--time-scale", "200", "--seed", "8"])];
  const p = await freshPool(n, sims, { policy: "cache_aware", settings: { breaker: { failure_threshold: 100 } } });
  const system = "A long shared system prompt for this conversation. ".repeat(20);
  // Kill one backend (still in rotation) and start conversations until one is retried off it.
  await sims[0].close();
  let retried = null;
  for (let i = 0; i < 8 && !retried; i++) {
    // Each conversation's prefix is its own (nothing shared that another request could have cached).
    const messages = [{ role: "system", content: `Conversation ${i}. ${system}` }, { role: "user", content: "first turn" }];
    const r = await gw.fetch("/v1/chat/completions", { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ model: p.model, messages, max_tokens: 4 }) });
    const text = await r.text();
    assert.equal(r.status, 200, text);
    if (Number(r.headers.get("x-gateway-attempts")) === 2) retried = { messages, answer: JSON.parse(text).choices[0].message.content, backend: r.headers.get("x-gateway-backend") };
  }
  assert.ok(retried, "no conversation was first routed to the dead backend");
  assert.equal(retried.backend, p.ids[1]);
  // Take the dead backend out; the next turn finds its prefix where it was really served.
  const drain = await gw.admin(`/admin/backends/${p.ids[0]}`, { method: "PATCH", body: { drain: true } });
  assert.equal(drain.status, 200);
  const messages = [...retried.messages, { role: "assistant", content: retried.answer }, { role: "user", content: "second turn" }];
  const r = await gw.fetch("/v1/chat/completions", { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ model: p.model, messages, max_tokens: 4 }) });
  const text = await r.text();
  assert.equal(r.status, 200, text);
  assert.equal(r.headers.get("x-gateway-backend"), p.ids[1]);
  assert.equal(r.headers.get("x-gateway-decision"), "cache_hit", "the serving backend's prefix was not recorded");
});

test("a backend that answers 404 for a model it no longer serves: retried elsewhere, nobody blamed, its models refreshed", async () => {
  const n = next();
  const moving = await sim(n.model, ["--time-scale", "200", "--seed", "9"]);
  const steady = await sim(n.model, ["--time-scale", "200", "--seed", "10"]);
  const p = await freshPool(n, [moving, steady], { settings: { probe_interval_ms: 3600000, ...STRICT_BREAKER } });
  // The first backend now serves another model (restarted on the same port), unknown to probes.
  await moving.close();
  await sim(`${n.model}-other`, ["--time-scale", "200"], { port: moving.port });
  const results = [];
  for (let i = 0; i < 4; i++) results.push(await chat(p.model, { stream: i % 2 === 1, content: `q${i}` }));
  for (const r of results) {
    assert.equal(r.status, 200, r.text);
    assert.equal(r.backend, p.ids[1]);
  }
  assert.ok(results.some((r) => r.attempts === 2), "no request reached the backend that lost the model");
  const m = await metrics();
  assert.ok(outcomes(m, p.ids[0], "client_error") >= 1);
  assert.equal(outcomes(m, p.ids[0], "server_error") + outcomes(m, p.ids[0], "transport"), 0);
  assert.equal((await backendView(p.ids[0])).breaker, "closed", "a missing model is not a backend failure");
  // The 404 made the pool probe at once: its served models now say what it really serves.
  await waitFor(async () => !(await backendView(p.ids[0])).served_models.includes(p.model), { what: "the backend's models refreshed" });
  const after = await chat(p.model, { content: "after the refresh" });
  assert.equal(after.attempts, 1);
});

test("per-key token limits charge an estimate and settle with the tokens really used", async () => {
  const model = "life-limited";
  // Chat requests without max_tokens may use the whole context: 1,200 tokens here.
  const s = await sim(model, ["--time-scale", "1000", "--max-model-len", "1200"]);
  const limited = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500", CLIENT_API_KEYS: "sk-life-a,sk-life-b", RATE_LIMIT_TPM: "1000" } });
  closers.push(() => limited.close());
  const reg = await limited.admin("/admin/backends", { method: "POST", body: { url: s.url, models: [model], id: "limited-0" } });
  assert.equal(reg.status, 201, await reg.text());
  await waitReady(limited, "limited-0");
  const ask = async (key, extra) => {
    const r = await limited.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
      body: JSON.stringify({ model, messages: [{ role: "user", content: "hi" }], ...extra }),
    });
    return { status: r.status, body: await r.text() };
  };
  // Estimated at admission as prompt + 256 (DEFAULT_MAX_TOKENS), it generates ~1,190 tokens.
  const big = await ask("sk-life-a", { ignore_eos: true });
  assert.equal(big.status, 200, big.body);
  assert.ok(JSON.parse(big.body).usage.completion_tokens > 1000);
  // Settled with the real count, the key is over its minute's allowance: small requests are now
  // refused (without settlement ~730 tokens would be left and they would all pass).
  const refused = await waitFor(async () => {
    const r = await ask("sk-life-a", { max_tokens: 1 });
    return r.status === 429 ? r : null;
  }, { timeoutMs: 3000, intervalMs: 200, what: "the key to be over its limit" });
  assert.equal(JSON.parse(refused.body).error.code, "rate_limit_exceeded");
  // A request that fails gives its reservation back: the same 900-token request fits again at
  // once (without the refund the bucket would need ~50 s to refill).
  await setFaults(s, { error_rate: 1.0 });
  const failed = await ask("sk-life-b", { max_tokens: 900 });
  assert.equal(failed.status, 502, failed.body);
  await setFaults(s, {});
  const again = await waitFor(async () => {
    const r = await ask("sk-life-b", { max_tokens: 900 });
    return r.status === 200 ? r : null;
  }, { timeoutMs: 3000, intervalMs: 300, what: "the refunded reservation" });
  assert.equal(again.status, 200);
  await waitFor(async () => {
    const pools = (await (await limited.admin("/admin/pools")).json()).data;
    return pools.every((p) => p.in_flight === 0 && p.in_flight_tokens === 0);
  }, { what: "leases back to zero" });
});

test("a breaker opened by a request's ending is persisted (only that backend's state is written) and survives a restart", async () => {
  const dir = tempDir();
  const model = "life-persist";
  const failing = await sim(model, ["--time-scale", "200", "--fault-error-rate", "1.0"]);
  const fine = await sim(model, ["--time-scale", "200"]);
  let g = null;
  try {
    const bindings = { PROBE_INTERVAL_MS: "60000" };
    g = await startGateway({ bindings, persistDir: dir.dir });
    const put = await g.admin("/admin/pools/persisted", { method: "PUT", body: { policy: "round_robin", ...STRICT_BREAKER, ...ROOMY_BUDGET } });
    assert.equal(put.status, 200);
    for (const [id, s] of [["persist-bad", failing], ["persist-ok", fine]]) {
      const r = await g.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: "persisted", models: [model], id } });
      assert.equal(r.status, 201);
      await waitReady(g, id);
    }
    for (let i = 0; i < 4; i++) {
      const r = await g.fetch("/v1/chat/completions", { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ model, messages: [{ role: "user", content: `q${i}` }], max_tokens: 2 }) });
      assert.equal(r.status, 200, await r.text());
    }
    assert.equal((await (await g.admin("/admin/backends/persist-bad")).json()).breaker, "open");
    await waitFor(async () => (await (await g.admin("/admin/pools/persisted")).json()).in_flight === 0, { what: "leases back to zero" });
    await g.close();
    g = await startGateway({ bindings, persistDir: dir.dir });
    const bad = await (await g.admin("/admin/backends/persist-bad")).json();
    assert.equal(bad.breaker, "open", "the open breaker was not persisted");
    assert.equal((await (await g.admin("/admin/backends/persist-ok")).json()).breaker, "closed");
  } finally {
    await g?.close();
    dir.cleanup();
  }
});

test("spillover cannot make things worse: a saturated nearest pool still serves when no later pool can", async () => {
  const model = "life-spill";
  // One sequence at a time, 5 tokens a second: a few direct requests leave some waiting.
  const near = await sim(model, ["--max-num-seqs", "1", "--decode-ms-per-step", "200"]);
  const far = await sim(model, ["--time-scale", "200"]);
  for (const [pool, region] of [["spill-near", "us-east"], ["spill-far", "eu-west"]]) {
    const r = await gw.admin(`/admin/pools/${pool}`, { method: "PUT", body: { region, policy: "least_load", saturation_waiting_per_backend: 0.5 } });
    assert.equal(r.status, 200, await r.text());
  }
  for (const [pool, region, s, id] of [["spill-near", "us-east", near, "spill-near-0"], ["spill-far", "eu-west", far, "spill-far-0"]]) {
    const r = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool, region, models: [model], id } });
    assert.equal(r.status, 201, await r.text());
    await waitReady(gw, id);
  }
  // The farther pool has nothing ready; the nearer one is saturated.
  assert.equal((await gw.admin("/admin/backends/spill-far-0", { method: "PATCH", body: { drain: true } })).status, 200);
  const busy = [0, 1, 2, 3].map((i) => fetch(`${near.url}/v1/chat/completions`, {
    method: "POST",
    body: JSON.stringify({ model, max_tokens: 4, ignore_eos: true, messages: [{ role: "user", content: `busy ${i}` }] }),
  }).then((r) => r.text()).catch(() => null));
  await waitFor(async () => (await (await gw.admin("/admin/pools/spill-near")).json()).saturated, { what: "spill-near saturated" });
  const r = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", "x-gateway-region": "us-east" },
    body: JSON.stringify({ model, max_tokens: 1, messages: [{ role: "user", content: "anyone?" }] }),
  });
  const text = await r.text();
  assert.equal(r.status, 200, `a saturated pool refused although no other pool could serve: ${text}`);
  assert.equal(r.headers.get("x-gateway-pool"), "spill-near");
  await Promise.all(busy);
});

// ---- The same faults from real vllm-sim processes (`/sim/faults`: stall, truncated body, mid-event cut).

test("vllm-sim faults: an engine that stalls mid-stream, a truncated body, a mid-event cut; each handled, leases back to zero", async () => {
  const n = next();
  const faulty = await sim(n.model, ["--time-scale", "200", "--seed", "11"]);
  const good = await sim(n.model, ["--time-scale", "200", "--seed", "12"]);
  const p = await freshPool(n, [faulty, good], { policy: "round_robin", settings: { breaker: { failure_threshold: 100 } } });
  const [bad, fine] = p.ids;
  const onFaulty = async (fn) => {
    // Round robin: ask until a request lands on the faulty backend.
    for (let i = 0; i < 6; i++) {
      const r = await fn(i);
      if (r.backend === bad || r.attempts > 1) return r;
    }
    throw new Error("no request reached the faulty backend");
  };
  // Engine hang after 3 tokens: the stream ends with the idle-timeout error event.
  await setFaults(faulty, { stall_after_tokens: 3 });
  const stalled = await onFaulty((i) => chat(p.model, { stream: true, max_tokens: 10, extra: { ignore_eos: true }, content: `stall ${i}` }));
  const events = sseEvents(stalled.text);
  assert.equal(events.at(-1), "[DONE]");
  assert.equal(events.at(-2).error?.code, "upstream_idle_timeout");
  assert.equal(events.filter((e) => e !== "[DONE]" && e.choices?.[0]?.delta?.content).length, 3);
  // The sim saw its stalled request aborted.
  await waitFor(async () => /vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} [1-9]/.test(await (await fetch(`${faulty.url}/metrics`)).text()), { what: "the stalled request aborted upstream" });
  // Truncated non-streamed body: retried on the good backend, never a broken 200.
  await setFaults(faulty, { truncate_body: true });
  const cut = await onFaulty((i) => chat(p.model, { max_tokens: 20, extra: { ignore_eos: true }, content: `truncate ${i}` }));
  assert.equal(cut.status, 200, cut.text);
  assert.equal(cut.backend, fine);
  assert.equal(JSON.parse(cut.text).usage.completion_tokens, 20);
  // Disconnect in the middle of an event: the client sees whole events, then the error event.
  await setFaults(faulty, { disconnect_mid_event_after_tokens: 2 });
  const midEvent = await onFaulty((i) => chat(p.model, { stream: true, max_tokens: 10, extra: { ignore_eos: true }, content: `mid ${i}` }));
  const ev = sseEvents(midEvent.text);
  assert.equal(ev.at(-1), "[DONE]");
  assert.equal(ev.at(-2).error?.code, "upstream_stream_error");
  await setFaults(faulty, {});
  const m = await metrics();
  assert.ok(outcomes(m, bad, "timeout") >= 1, "the stall counts as the backend's timeout");
  assert.ok(outcomes(m, bad, "transport") >= 2, "the truncated body and the cut stream count against it");
  assert.equal(outcomes(m, fine, "timeout") + outcomes(m, fine, "transport"), 0);
});

test("releases ending together are sent in batches: every lease ends once, with its own outcome", async () => {
  const n = next();
  const s = await sim(n.model, ["--time-scale", "100", "--max-num-seqs", "64"]);
  const p = await freshPool(n, [s]);
  const [backend] = p.ids;
  const before = await metrics();
  // Many streams ending at about the same time: an isolate sends their releases together while
  // one is in flight. Each must count once, as a success, with its own tokens.
  const results = await Promise.all(
    Array.from({ length: 48 }, (_, i) => chat(p.model, { stream: true, max_tokens: 3 + (i % 4), extra: { ignore_eos: true }, content: `batch ${i}` })),
  );
  for (const r of results) assert.equal(r.status, 200, r.text);
  const expectedTokens = results.reduce((sum, _, i) => sum + 3 + (i % 4), 0);
  const tokens = (m) => metricValue(m, "llm_gateway_tokens_total", { backend, kind: "completion" }) ?? 0;
  const after = await waitFor(async () => {
    const m = await metrics();
    return outcomes(m, backend, "success") - outcomes(before, backend, "success") === 48 ? m : null;
  }, { what: "48 successful outcomes" });
  assert.equal(tokens(after) - tokens(before), expectedTokens);

  // The batch route itself, as a Worker calls it: each lease ends once, in the order given.
  const call = await poolObjectCall(gw, p.name);
  const leases = [];
  for (let i = 0; i < 3; i++) {
    const r = await call("acquire", { features: { model: p.model, request_id: `batch-direct-${i}`, prompt_tokens: 10, max_tokens: 5 } });
    assert.equal(r.status, 200, await r.clone().text());
    leases.push((await r.json()).lease_id);
  }
  const inFlight = async () => (await (await gw.admin("/admin/pools")).json()).data.find((x) => x.pool === p.name).in_flight;
  assert.equal(await inFlight(), 3);
  const outcome = { status: 200, kind: "success", ttfb_ms: 5, prompt_tokens: 10, cached_tokens: 0, completion_tokens: 5 };
  const releases = (ids) => ({ releases: ids.map((lease_id) => ({ lease_id, outcome, backend })) });
  const first = await call("release_batch", releases([leases[0], leases[1], leases[0]]));
  assert.equal(first.status, 200);
  assert.deepEqual(await first.json(), { released: [true, true, false] });
  assert.equal(await inFlight(), 1);
  const second = await call("release_batch", releases([leases[1], leases[2]]));
  assert.deepEqual(await second.json(), { released: [false, true] });
  assert.equal(await inFlight(), 0);
  const m = await metrics();
  assert.equal(outcomes(m, backend, "success") - outcomes(after, backend, "success"), 2 + 1);
});
