// Nothing one request or one backend does takes capacity from anyone else (issue 23, backends and
// the requests that make them fail), in workerd against real vllm-sim processes on 127.0.0.1:
// a poison request (vLLM's 500 on every backend) is answered after two attempts and charges no
// breaker, so other clients keep the whole pool; breakers never take more than
// `breaker.max_open_ratio` of a pool out; a backend behind a login page (200 text/html) or one
// that redirects elsewhere is a failed backend, retried, never passed on, and its probe says why;
// a route-not-found 404 (FastAPI's, vLLM's answer for a route its model's task lacks) charges no
// breaker and the request goes on to another backend (issue 41). After each test no
// lease is left and the retry budget was not exhausted.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import {
  startGateway, startSim, waitFor, waitReady, errorBody, setFaults, parseMetrics, metricValue, onlyPool,
} from "./lib/harness.mjs";

const MODEL = "trust-model";
const simArgs = (seed) => ["--model", MODEL, "--time-scale", "50", "--seed", String(seed), "--kv-blocks", "2048"];
// Enough retry budget that no test's retries are refused by it: what a test counts is its own.
const ROOMY_BUDGET = { retry_budget: { ratio: 1.0, min_per_window: 1000, window_ms: 10000 } };
// Breakers that open fast and stay open, so a charge that should not happen shows.
const TOUCHY = { failure_threshold: 2, base_cooldown_ms: 60000, max_cooldown_ms: 60000, jitter_ratio: 0 };

let gw;
const sims = [];
const closers = [];
let pools = 0;

before(async () => {
  // Probes only when a test asks (POST /admin/pools/{pool}/probe), so a test decides when the
  // pool learns from probes and its requests meet the fault first.
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "600000" } });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await Promise.all(closers.map((c) => c()));
  await gw?.close();
});

afterEach(async () => {
  // No lease may outlive its request, and the retries never ran out of budget.
  const summaries = await waitFor(async () => {
    const list = (await (await gw.admin("/admin/pools")).json()).data;
    return list.every((p) => p.in_flight === 0 && p.in_flight_tokens === 0) ? list : null;
  }, { timeoutMs: 8000, what: "every pool's leases back to zero" });
  for (const p of summaries) assert.equal(p.retry_budget_exhausted, 0, `${p.pool}: retry budget exhausted`);
});

async function sim(args = []) {
  const s = await startSim(args);
  sims.push(s);
  return s;
}

/** A fresh pool `t<n>` of `n` sims; returns { name, backends: [{ id, sim }] }. */
async function freshPool(n, { breaker = TOUCHY, policy = "round_robin" } = {}) {
  pools += 1;
  const name = `t${pools}`;
  const r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy, breaker, ...ROOMY_BUDGET } });
  assert.equal(r.status, 200, await r.text());
  const backends = [];
  for (let i = 0; i < n; i++) {
    const s = await sim(simArgs(pools * 10 + i));
    const id = `${name}-b${i}`;
    const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models: [MODEL], id } });
    assert.equal(reg.status, 201, await reg.text());
    backends.push({ id, sim: s });
  }
  await probe(name);
  for (const b of backends) await waitReady(gw, b.id);
  await onlyPool(gw, name);
  return { name, backends };
}

/** One probe round of pool `name`, now. */
async function probe(name) {
  const r = await gw.admin(`/admin/pools/${name}/probe`, { method: "POST" });
  assert.equal(r.status, 200, await r.text());
}

async function chat(content, { stream = false, headers = {} } = {}) {
  const r = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", ...headers },
    body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content }], stream, max_tokens: 6 }),
  });
  const text = await r.text();
  return {
    status: r.status, text, type: r.headers.get("content-type") ?? "",
    backend: r.headers.get("x-gateway-backend"), attempts: Number(r.headers.get("x-gateway-attempts")),
  };
}

/** A whole answer a client can use: 200, JSON (or a complete event stream), no HTML. */
function assertRealAnswer(r, stream) {
  assert.equal(r.status, 200, r.text);
  assert.ok(!/<html|<form/i.test(r.text), `HTML reached the client: ${r.text.slice(0, 200)}`);
  if (stream) {
    assert.ok(r.type.startsWith("text/event-stream"), r.type);
    assert.ok(r.text.trimEnd().endsWith("data: [DONE]"), r.text.slice(-200));
  } else {
    assert.ok(r.type.includes("json"), r.type);
    assert.equal(JSON.parse(r.text).object, "chat.completion");
  }
}

async function backendView(id) {
  const r = await gw.admin(`/admin/backends/${id}`);
  assert.equal(r.status, 200);
  return r.json();
}

async function metrics() {
  const r = await gw.admin("/metrics");
  assert.equal(r.status, 200);
  return parseMetrics(await r.text());
}

const outcomes = (m, backend, outcome) => metricValue(m, "llm_gateway_request_outcomes_total", { backend, outcome }) ?? 0;

async function summary(name) {
  const list = (await (await gw.admin("/admin/pools")).json()).data;
  return list.find((p) => p.pool === name);
}

/** A local listener that records every request it gets (the host a redirect points to). */
async function recorder() {
  const seen = [];
  const server = http.createServer((req, res) => {
    let body = "";
    req.on("data", (d) => (body += d));
    req.on("end", () => {
      seen.push({ method: req.method, url: req.url, body });
      res.writeHead(200, { "content-type": "application/json" });
      res.end(JSON.stringify({ object: "chat.completion", choices: [{ index: 0, message: { role: "assistant", content: "stolen" } }] }));
    });
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  const close = () => new Promise((r) => { server.closeAllConnections(); server.close(r); });
  closers.push(close);
  return { url: `http://127.0.0.1:${server.address().port}`, seen };
}

test("a poison request fails alone: two attempts, its 5xx, no breaker charged, other clients keep the pool", async () => {
  const p = await freshPool(3);
  const marker = "POISON-c0ffee";
  for (const b of p.backends) await setFaults(b.sim, { poison_marker: marker });
  const retriesBefore = (await summary(p.name)).retries;
  for (let i = 0; i < 8; i++) {
    const r = await gw.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json", "x-user-id": "mallory" },
      body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content: `${marker} #${i}` }], stream: i % 2 === 1, max_tokens: 6 }),
    });
    assert.ok(r.status >= 500 && r.status < 600, `poison request ${i}: ${r.status}`);
    assert.notEqual(r.status, 500, "a 500 from the gateway means a gateway bug");
    const e = await errorBody(r);
    assert.equal(e.type, "server_error");
    assert.equal(e.code, "upstream_request_error", e.message);
    assert.ok(!/InternalServerError|Simulated|fault injection/.test(e.message), `backend internals in: ${e.message}`);
  }
  const m = await metrics();
  const tried = p.backends.reduce((n, b) => n + outcomes(m, b.id, "server_error"), 0);
  assert.equal(tried, 16, "each poison request was tried on exactly two backends");
  // The retry budget counted the retries (one per poison request).
  assert.equal((await summary(p.name)).retries - retriesBefore, 8);
  for (const b of p.backends) {
    const v = await backendView(b.id);
    assert.equal(v.breaker, "closed", `${b.id}'s breaker was charged for the request's failure`);
  }
  // Another client's ordinary requests all succeed, on every backend.
  const served = new Set();
  for (let i = 0; i < 10; i++) {
    const r = await chat(`an ordinary question ${i}`, { stream: i % 3 === 0, headers: { "x-user-id": "alice" } });
    assertRealAnswer(r, i % 3 === 0);
    assert.equal(r.attempts, 1);
    served.add(r.backend);
  }
  assert.equal(served.size, 3, `served by ${[...served]}`);
});

test("the official OpenAI client gets the poison request's error as an APIError after two attempts", async () => {
  const { default: OpenAI } = await import("openai");
  const p = await freshPool(2);
  const marker = "POISON-openai";
  for (const b of p.backends) await setFaults(b.sim, { poison_marker: marker });
  const client = new OpenAI({ apiKey: "unused", baseURL: "http://gateway.test/v1", maxRetries: 0, fetch: (url, init) => gw.mf.dispatchFetch(url, init) });
  await assert.rejects(
    client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: `${marker} please` }], max_tokens: 4 }),
    (e) => {
      assert.equal(e.status, 502);
      assert.equal(e.code, "upstream_request_error");
      return true;
    },
  );
  const ok = await client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "fine" }], max_tokens: 4 });
  assert.equal(ok.object, "chat.completion");
  for (const b of p.backends) assert.equal((await backendView(b.id)).breaker, "closed");
});

test("breakers never take more than max_open_ratio of the pool out, even when two of three backends fail", async () => {
  const p = await freshPool(3, { breaker: { ...TOUCHY, max_open_ratio: 0.5 } });
  const [a, b, good] = p.backends;
  // Two statuses, so no request sees the same 5xx twice (that would be the request's fault).
  await setFaults(a.sim, { error_rate: 1.0, error_status: 500 });
  await setFaults(b.sim, { error_rate: 1.0, error_status: 502 });
  const openNow = async () => {
    let open = 0;
    for (const x of p.backends) if ((await backendView(x.id)).breaker !== "closed") open += 1;
    return open;
  };
  for (let i = 0; i < 16; i++) {
    const r = await chat(`q${i}`, { stream: i % 4 === 0 });
    assertRealAnswer(r, i % 4 === 0);
    assert.equal(r.backend, good.id);
    assert.ok((await openNow()) <= 1, `after request ${i}: more than half of the pool's breakers open`);
  }
  assert.equal(await openNow(), 1, "one failing backend's breaker opened");
  assert.equal((await backendView(good.id)).breaker, "closed");
  const m = await metrics();
  assert.ok(outcomes(m, a.id, "server_error") >= 2 && outcomes(m, b.id, "server_error") >= 2);
});

test("a login page (200 text/html) is a failed backend: retried, never a 200 to the client; the probe says why", async () => {
  const p = await freshPool(2);
  const [login, good] = p.backends;
  await setFaults(login.sim, { login_page: true });
  let retried = 0;
  for (let i = 0; i < 6; i++) {
    const stream = i % 2 === 1;
    const r = await chat(`behind the portal ${i}`, { stream });
    assertRealAnswer(r, stream);
    assert.equal(r.backend, good.id);
    if (r.attempts === 2) retried += 1;
  }
  assert.ok(retried >= 2, `the login-page backend was tried ${retried} times`);
  assert.ok(outcomes(await metrics(), login.id, "server_error") >= 2, "counted against the login-page backend");
  for (let i = 0; i < 3; i++) await probe(p.name);
  const v = await waitFor(async () => {
    const v = await backendView(login.id);
    return v.health === "unhealthy" ? v : null;
  }, { what: "the login-page backend unhealthy" });
  assert.match(v.last_probe.error, /not a model list/);
  assert.match(v.last_probe.error, /text\/html/);
});

test("a redirect is not followed: the other host never gets the prompt, the client is served elsewhere, the probe says why", async () => {
  const p = await freshPool(2);
  const [moved, good] = p.backends;
  const elsewhere = await recorder();
  await setFaults(moved.sim, { redirect_to: `${elsewhere.url}/v1/chat/completions` });
  let retried = 0;
  for (let i = 0; i < 6; i++) {
    const stream = i % 2 === 0;
    const r = await chat(`secret prompt ${i}`, { stream });
    assertRealAnswer(r, stream);
    assert.equal(r.backend, good.id);
    assert.ok(!r.text.includes("stolen"));
    if (r.attempts === 2) retried += 1;
  }
  assert.ok(retried >= 2, `the redirecting backend was tried ${retried} times`);
  assert.equal(elsewhere.seen.length, 0, `the redirect target got ${JSON.stringify(elsewhere.seen).slice(0, 300)}`);
  for (let i = 0; i < 3; i++) await probe(p.name);
  const v = await waitFor(async () => {
    const v = await backendView(moved.id);
    return v.health === "unhealthy" ? v : null;
  }, { what: "the redirecting backend unhealthy" });
  assert.equal(v.last_probe.health_status, 307);
  assert.match(v.last_probe.error, /redirect/);
  assert.equal(elsewhere.seen.length, 0, "the probes did not follow the redirect either");
});

test("a route-not-found 404 (FastAPI's {\"detail\":\"Not Found\"}) is about the model, not the backend: no breaker charge", async () => {
  const p = await freshPool(2);
  const [misrouted, good] = p.backends;
  await setFaults(misrouted.sim, { route_not_found: true });
  const roundsBefore = (await summary(p.name)).probe_rounds;
  for (let i = 0; i < 6; i++) {
    const r = await chat(`where is it ${i}`);
    assertRealAnswer(r, false);
    assert.equal(r.backend, good.id);
  }
  // vLLM registers only its model's task's routes (issue 41): the same 404 is what a pooling
  // model's server answers for chat. Not the backend's failure: no breaker charge.
  const m = await metrics();
  assert.equal(outcomes(m, misrouted.id, "server_error"), 0, "the 404s are not the backend's failure");
  assert.ok(outcomes(m, misrouted.id, "client_error") >= 2);
  const v = await backendView(misrouted.id);
  assert.equal(v.breaker, "closed", "its breaker stays closed (threshold 2)");
  assert.ok(v.served_models.includes(MODEL), "the model was not forgotten");
  // No probe was asked for: nothing says the model went away.
  assert.equal((await summary(p.name)).probe_rounds, roundsBefore);
});

test("an absurd model id is a 400 invalid_request_error", async () => {
  for (const model of ["m".repeat(257), "llama\u0000", "bad\nmodel"]) {
    const r = await gw.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ model, messages: [{ role: "user", content: "x" }] }),
    });
    assert.equal(r.status, 400);
    const e = await errorBody(r);
    assert.equal(e.type, "invalid_request_error");
    assert.equal(e.param, "model");
  }
});
