// vLLM 0.34's real answers, in workerd against real vllm-sim processes taught them (issue 41):
// an error event inside a stream (first or later) is the backend's failure, not a success; a
// 503 with vLLM's load-shedding body is load, like a 429; a 404 from a route the model's server
// does not register (embeddings on a chat model) is an answer about the model, not a broken
// backend; keep-alive comments are no first token; a scrape without vllm:* series leaves the
// backend's load unknown, and says so.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import {
  startGateway, startSim, waitFor, waitReady, setFaults, parseMetrics, metricValue, onlyPool,
} from "./lib/harness.mjs";

const MODEL = "real-model";
const FIRST_BYTE_TIMEOUT_MS = 1500;
const simArgs = (seed) => ["--model", MODEL, "--time-scale", "50", "--seed", String(seed), "--kv-blocks", "2048"];
const ROOMY_BUDGET = { retry_budget: { ratio: 1.0, min_per_window: 1000, window_ms: 10000 } };
// One failure would open a breaker: a test that ends with it closed shows nothing was charged.
const TOUCHY = { breaker: { failure_threshold: 1, base_cooldown_ms: 60000, max_cooldown_ms: 60000, jitter_ratio: 0, max_open_ratio: 1 } };

let gw;
const sims = [];
let pool = 0;

before(async () => {
  gw = await startGateway({
    bindings: { PROBE_INTERVAL_MS: "500", FIRST_BYTE_TIMEOUT_MS: String(FIRST_BYTE_TIMEOUT_MS), RESPONSE_TIMEOUT_MS: "3000" },
  });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

afterEach(async () => {
  await waitFor(async () => {
    const pools = (await (await gw.admin("/admin/pools")).json()).data;
    return pools.every((p) => p.in_flight === 0) ? pools : null;
  }, { timeoutMs: 8000, what: "every pool's leases back to zero" });
});

/** A fresh pool of sims started with `args[i]` each; returns { name, backends: [{ id, sim }] }. */
async function freshPool(args, settings = {}) {
  pool += 1;
  const name = `r${pool}`;
  const r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy: "round_robin", ...ROOMY_BUDGET, ...settings } });
  assert.equal(r.status, 200, await r.text());
  const backends = [];
  for (let i = 0; i < args.length; i++) {
    const s = await startSim([...simArgs(pool * 10 + i), ...args[i]]);
    sims.push(s);
    const id = `${name}-b${i}`;
    const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models: [MODEL], id } });
    assert.equal(reg.status, 201, await reg.text());
    backends.push({ id, sim: s });
  }
  for (const b of backends) await waitReady(gw, b.id);
  await onlyPool(gw, name);
  return { name, backends };
}

async function post(path, body) {
  const r = await gw.fetch(path, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: MODEL, ...body }),
  });
  const text = await r.text();
  return { status: r.status, text, backend: r.headers.get("x-gateway-backend"), attempts: Number(r.headers.get("x-gateway-attempts")) };
}

const chat = (content, extra = {}) => post("/v1/chat/completions", { messages: [{ role: "user", content }], max_tokens: 12, ...extra });

async function metrics() {
  return parseMetrics(await (await gw.admin("/metrics")).text());
}

const outcomes = (m, backend, outcome) => metricValue(m, "llm_gateway_request_outcomes_total", { backend, outcome }) ?? 0;
const view = async (id) => (await gw.admin(`/admin/backends/${id}`)).json();

function assertCompleteStream(r) {
  assert.equal(r.status, 200, r.text);
  assert.ok(r.text.trimEnd().endsWith("data: [DONE]"), `stream not terminated: ${r.text.slice(-200)}`);
  assert.ok(!r.text.includes("\"error\""), `stream carries an error event: ${r.text.slice(-300)}`);
}

test("an error event as the first event fails the attempt: retried on another backend, breaker charged", async () => {
  const p = await freshPool([[], []], TOUCHY);
  const [bad, good] = p.backends;
  await setFaults(bad.sim, { stream_error_after_tokens: 0 });
  for (let i = 0; i < 4; i++) {
    const r = await chat(`first error ${i}`, { stream: true });
    assertCompleteStream(r);
    assert.equal(r.backend, good.id);
  }
  const m = await metrics();
  assert.ok(outcomes(m, bad.id, "server_error") >= 1, "the error event is the backend's failure");
  assert.equal(outcomes(m, bad.id, "success"), 0, "never a success");
  assert.equal((await view(bad.id)).breaker, "open");
});

test("an error event mid-stream: resumed on another backend when allowed, else a proper error event", async () => {
  const p = await freshPool([[], []], TOUCHY);
  const [bad, good] = p.backends;
  await setFaults(bad.sim, { stream_error_after_tokens: 3 });
  // Resumable: the client gets one complete answer, spliced from the good backend.
  let resumed = 0;
  for (let i = 0; i < 2; i++) {
    const r = await chat(`mid error ${i}`, { stream: true });
    assertCompleteStream(r);
    if (r.backend === bad.id) resumed += 1;
  }
  assert.ok(resumed >= 1, "no stream started on the failing backend");
  const m = await metrics();
  assert.ok(outcomes(m, bad.id, "server_error") >= 1, "the error event is the backend's failure");
  assert.equal(outcomes(m, bad.id, "success"), 0);
  // Not resumable (logprobs): the stream ends with the gateway's error event, not a success.
  const q = await freshPool([[]], {});
  await setFaults(q.backends[0].sim, { stream_error_after_tokens: 3 });
  const r = await chat("not resumable", { stream: true, logprobs: true });
  assert.equal(r.status, 200);
  assert.match(r.text, /"code":"upstream_stream_error"/);
  const events = r.text.trim().split("\n\n");
  assert.match(events.at(-2), /"error"/, "the error event comes right before [DONE]");
  assert.ok(!r.text.includes("Internal server error") || r.text.includes("upstream_stream_error"));
});

test("vLLM's 503 load shedding is load: next backend, no breaker charge, counted as shed", async () => {
  const p = await freshPool([["--max-num-queued-reqs", "1"], []], TOUCHY);
  const [busy, free] = p.backends;
  // One long request sent straight to the busy sim fills its queue limit.
  const hold = new AbortController();
  const held = fetch(`${busy.sim.url}/v1/chat/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content: "hold" }], max_tokens: 100000, stream: true, ignore_eos: true }),
    signal: hold.signal,
  }).then((r) => r.body?.getReader().read()).catch(() => {});
  await held;
  try {
    let retried = 0;
    for (let i = 0; i < 4; i++) {
      const r = await chat(`shed ${i}`, { stream: i % 2 === 0 });
      assert.equal(r.status, 200, r.text);
      assert.equal(r.backend, free.id);
      if (r.attempts === 2) retried += 1;
    }
    assert.ok(retried >= 1, "the busy backend was never tried");
    const m = await metrics();
    assert.ok((metricValue(m, "llm_gateway_backend_shed_total", { backend: busy.id }) ?? 0) >= 1, "counted as shed");
    assert.equal(outcomes(m, busy.id, "server_error"), 0, "not a server error");
    assert.equal((await view(busy.id)).breaker, "closed", "load never trips the breaker");
  } finally {
    hold.abort();
  }
});

test("embeddings for a chat model: 404 model_does_not_support_endpoint, no breaker charge", async () => {
  const p = await freshPool([["--task", "generate"]], TOUCHY);
  const [b] = p.backends;
  const r = await post("/v1/embeddings", { input: "hello" });
  assert.equal(r.status, 404, r.text);
  const body = JSON.parse(r.text);
  assert.equal(body.error.code, "model_does_not_support_endpoint");
  assert.match(body.error.message, /does not support \/v1\/embeddings/);
  assert.equal((await view(b.id)).breaker, "closed");
  assert.equal(outcomes(await metrics(), b.id, "server_error"), 0);
  // The backend still serves chat.
  assert.equal((await chat("still fine")).status, 200);
});

test("keep-alive comments are no first token: a backend that only sends them is retried", async () => {
  const p = await freshPool([["--sse-keep-alive-interval", "0.05"], []], {});
  const [silent, good] = p.backends;
  await setFaults(silent.sim, { stall_after_tokens: 0 });
  for (let i = 0; i < 2; i++) {
    const started = Date.now();
    const r = await chat(`keep alive ${i}`, { stream: true });
    assertCompleteStream(r);
    assert.equal(r.backend, good.id);
    assert.ok(Date.now() - started < FIRST_BYTE_TIMEOUT_MS * 3, "bounded by the first-byte timeout");
  }
});

test("a backend without vllm:* series is load unknown: in its view and a metric", async () => {
  const p = await freshPool([["--disable-log-stats"], []], {});
  const [blind, seen] = p.backends;
  await waitFor(async () => ((await view(blind.id)).load_unknown === true ? true : null), { timeoutMs: 5000, what: "load_unknown" });
  assert.equal((await view(seen.id)).load_unknown, false);
  const m = await metrics();
  assert.equal(metricValue(m, "llm_gateway_backend_load_unknown", { backend: blind.id }), 1);
  assert.equal(metricValue(m, "llm_gateway_backend_load_unknown", { backend: seen.id }), 0);
  assert.equal((await chat("still routed")).status, 200);
});
