// Faults, in workerd against real vllm-sim processes on 127.0.0.1: a backend that is killed,
// answers 500/503/429, hangs before its first byte, is slow but in time, drops a stream half-way,
// flaps its health, or disappears while streaming; every backend down; the Durable Object
// restarted. Whatever happens, a client gets either its answer or a well-formed error within a
// bounded time, breakers count what they must (and only that), and every lease comes back.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import {
  startGateway, startSim, waitFor, waitReady, errorBody, tempDir, setFaults, parseMetrics, metricValue, onlyPool,
} from "./lib/harness.mjs";

const MODEL = "fault-model";
const FIRST_BYTE_TIMEOUT_MS = 1500;
const RESPONSE_TIMEOUT_MS = 3000;
const simArgs = (seed) => ["--model", MODEL, "--time-scale", "50", "--seed", String(seed), "--kv-blocks", "2048"];
// Enough retry budget that a test's retries are never refused by it (the budget has its own tests).
const ROOMY_BUDGET = { retry_budget: { ratio: 1.0, min_per_window: 1000, window_ms: 10000 } };

let gw;
const sims = [];
let pool = 0;

before(async () => {
  gw = await startGateway({
    bindings: {
      PROBE_INTERVAL_MS: "500",
      FIRST_BYTE_TIMEOUT_MS: String(FIRST_BYTE_TIMEOUT_MS),
      RESPONSE_TIMEOUT_MS: String(RESPONSE_TIMEOUT_MS),
    },
  });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

afterEach(async () => {
  // No lease may outlive its request, whatever the fault was.
  await waitFor(async () => {
    const pools = (await (await gw.admin("/admin/pools")).json()).data;
    return pools.every((p) => p.in_flight === 0 && p.in_flight_tokens === 0) ? pools : null;
  }, { timeoutMs: 8000, what: "every pool's leases back to zero" });
});

async function sim(args = [], opts) {
  const s = await startSim(args, opts);
  sims.push(s);
  return s;
}

/** A fresh pool `f<n>` of `n` sims; returns { name, backends: [{ id, sim }] }. */
async function freshPool(n, policy, { args = [], settings = {} } = {}) {
  pool += 1;
  const name = `f${pool}`;
  const r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy, ...ROOMY_BUDGET, ...settings } });
  assert.equal(r.status, 200, await r.text());
  const backends = [];
  for (let i = 0; i < n; i++) {
    const s = await sim([...simArgs(pool * 10 + i), ...args]);
    const id = `${name}-b${i}`;
    const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models: [MODEL], id } });
    assert.equal(reg.status, 201, await reg.text());
    backends.push({ id, sim: s });
  }
  for (const b of backends) await waitReady(gw, b.id);
  return { name, backends };
}

/** Only pool `name` serves the test's models. */
const only = (name) => onlyPool(gw, name);

async function chat(content, { stream = false, max_tokens = 8, extra = {}, headers = {}, via = gw } = {}) {
  const started = Date.now();
  const r = await via.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", ...headers },
    body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content }], stream, max_tokens, ...extra }),
  });
  const text = await r.text();
  return {
    status: r.status, text, headers: r.headers, ms: Date.now() - started,
    backend: r.headers.get("x-gateway-backend"), attempts: Number(r.headers.get("x-gateway-attempts")),
  };
}

async function backendView(id, via = gw) {
  const r = await via.admin(`/admin/backends/${id}`);
  assert.equal(r.status, 200, `GET /admin/backends/${id}`);
  return r.json();
}

async function metrics() {
  const r = await gw.admin("/metrics");
  assert.equal(r.status, 200);
  return parseMetrics(await r.text());
}

const outcomes = (m, backend, outcome) => metricValue(m, "llm_gateway_request_outcomes_total", { backend, outcome }) ?? 0;

/** A complete successful stream: data events, then `data: [DONE]`, and no error event. */
function assertCompleteStream(r) {
  assert.equal(r.status, 200, r.text);
  assert.ok(r.text.trimEnd().endsWith("data: [DONE]"), `stream not terminated: ${r.text.slice(-200)}`);
  assert.ok(!r.text.includes("upstream_stream_error"), `stream carries an error event: ${r.text.slice(-300)}`);
}

test("connection refused (backend killed): retried on another backend, no client-visible failure", async () => {
  const p = await freshPool(2, "round_robin", { settings: { breaker: { failure_threshold: 3 } } });
  await only(p.name);
  const [dead, alive] = p.backends;
  await dead.sim.close(); // SIGKILL: connection refused from now on
  let retried = 0;
  for (let i = 0; i < 6; i++) {
    const stream = i % 2 === 0;
    const r = await chat(`after the crash ${i}`, { stream });
    if (stream) assertCompleteStream(r);
    else assert.equal(r.status, 200, r.text);
    assert.equal(r.backend, alive.id);
    if (r.attempts === 2) retried += 1;
    assert.ok(r.attempts <= 2, `attempts ${r.attempts}`);
  }
  assert.ok(retried >= 1, "the dead backend was never tried, so nothing was retried");
  const m = await metrics();
  assert.ok(outcomes(m, dead.id, "transport") >= 1, "connection failures are counted against the dead backend");
  assert.equal(outcomes(m, alive.id, "transport"), 0);
});

test("500 and 503: retried elsewhere and counted by the breaker until it opens", async () => {
  const p = await freshPool(3, "round_robin", {
    // max_open_ratio 1: this test lets both failing breakers open (the cap has its own test).
    settings: { breaker: { failure_threshold: 3, base_cooldown_ms: 60000, max_cooldown_ms: 60000, jitter_ratio: 0, max_open_ratio: 1 } },
  });
  await only(p.name);
  const [b500, b503, good] = p.backends;
  await setFaults(b500.sim, { error_rate: 1.0, error_status: 500 });
  await setFaults(b503.sim, { error_rate: 1.0, error_status: 503 });
  let retried = 0;
  for (let i = 0; i < 12; i++) {
    const r = await chat(`q${i}`, { stream: i % 3 === 0 });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.backend, good.id, "only the healthy backend answers");
    assert.ok(r.attempts >= 1 && r.attempts <= 3, `attempts ${r.attempts}`);
    if (r.attempts > 1) retried += 1;
  }
  assert.ok(retried >= 2, `only ${retried} requests were retried`);
  const m = await metrics();
  assert.ok(outcomes(m, b500.id, "server_error") >= 3, "500s counted against their backend");
  assert.ok(outcomes(m, b503.id, "server_error") >= 3, "503s counted against their backend");
  assert.equal(outcomes(m, good.id, "server_error"), 0);
  for (const b of [b500, b503]) {
    const v = await backendView(b.id);
    assert.equal(v.breaker, "open", `${b.id}'s breaker`);
    assert.ok(v.breaker_open_until_ms > Date.now(), "open for its cooldown");
    assert.equal(metricValue(m, "llm_gateway_breaker_state", { backend: b.id, state: "open" }), 1);
  }
  assert.equal((await backendView(good.id)).breaker, "closed");
  // Open breakers shed traffic: no more attempts on the failing backends.
  for (let i = 0; i < 4; i++) {
    const r = await chat(`after open ${i}`);
    assert.equal(r.status, 200);
    assert.equal(r.attempts, 1, "an open breaker is not tried");
  }
});

test("429: retried elsewhere, the backend is avoided for a while but its breaker stays closed", async () => {
  const p = await freshPool(2, "round_robin", { settings: { breaker: { failure_threshold: 2, saturation_ms: 2000 } } });
  await only(p.name);
  const [limited, other] = p.backends;
  await setFaults(limited.sim, { rate_limit_rate: 1.0 });
  // More 429s than the breaker's failure threshold, each after the previous saturation mark ended.
  let marks = 0;
  for (let round = 0; round < 3; round++) {
    const before = outcomes(await metrics(), limited.id, "rate_limited");
    for (let i = 0; i < 4 && outcomes(await metrics(), limited.id, "rate_limited") === before; i++) {
      const r = await chat(`round ${round} q${i}`, { stream: i % 2 === 1 });
      assert.equal(r.status, 200, r.text);
      assert.equal(r.backend, other.id);
    }
    assert.ok(outcomes(await metrics(), limited.id, "rate_limited") > before, `round ${round}: the 429 backend was not tried`);
    const v = await backendView(limited.id);
    assert.equal(v.breaker, "closed", "a 429 never trips the breaker");
    assert.ok(v.saturated_until_ms > Date.now(), `saturated_until_ms ${v.saturated_until_ms} is not in the future`);
    marks += 1;
    // While saturated it is skipped: no request started before the mark ends needs a retry.
    for (let i = 0; i < 3; i++) {
      const startedAt = Date.now();
      const r = await chat(`saturated ${round} ${i}`);
      assert.equal(r.status, 200);
      assert.equal(r.backend, other.id);
      if (startedAt < v.saturated_until_ms - 100) assert.equal(r.attempts, 1, "a saturated backend is not tried");
    }
    await waitFor(async () => (await backendView(limited.id)).saturated_until_ms <= Date.now(), { timeoutMs: 5000, what: "saturation to end" });
  }
  assert.equal(marks, 3);
  const m = await metrics();
  assert.ok(outcomes(m, limited.id, "rate_limited") >= 3);
  assert.equal(outcomes(m, limited.id, "server_error"), 0);
  assert.equal(metricValue(m, "llm_gateway_breaker_transitions_total", { backend: limited.id, to: "open" }), 0);
  // Back in rotation once it stops answering 429.
  await setFaults(limited.sim, {});
  const seen = new Set();
  for (let i = 0; i < 4; i++) seen.add((await chat(`recovered ${i}`)).backend);
  assert.ok(seen.has(limited.id), "the formerly rate-limited backend gets traffic again");
});

test("hang before the first byte: retried elsewhere after the first-byte timeout", async () => {
  const p = await freshPool(2, "round_robin");
  await only(p.name);
  const [hung, good] = p.backends;
  await setFaults(hung.sim, { hang_rate: 1.0 });
  const streamed = [];
  for (let i = 0; i < 2; i++) streamed.push(await chat(`hang ${i}`, { stream: true, max_tokens: 4 }));
  for (const r of streamed) {
    assertCompleteStream(r);
    assert.equal(r.backend, good.id);
  }
  const retried = streamed.filter((r) => r.attempts === 2);
  assert.equal(retried.length, 1, `attempts: ${streamed.map((r) => r.attempts)}`);
  assert.ok(retried[0].ms >= FIRST_BYTE_TIMEOUT_MS - 50, `retried after ${retried[0].ms} ms, before the timeout`);
  assert.ok(retried[0].ms < FIRST_BYTE_TIMEOUT_MS + 4000, `took ${retried[0].ms} ms`);
  // A non-streamed request that hangs is bounded by RESPONSE_TIMEOUT_MS, then retried.
  const plain = [];
  for (let i = 0; i < 2; i++) plain.push(await chat(`hang plain ${i}`, { max_tokens: 4 }));
  for (const r of plain) {
    assert.equal(r.status, 200, r.text);
    assert.equal(r.backend, good.id);
  }
  const slow = plain.filter((r) => r.attempts === 2);
  assert.equal(slow.length, 1, `attempts: ${plain.map((r) => r.attempts)}`);
  assert.ok(slow[0].ms >= RESPONSE_TIMEOUT_MS - 50 && slow[0].ms < RESPONSE_TIMEOUT_MS + 4000, `took ${slow[0].ms} ms`);
  assert.ok(outcomes(await metrics(), hung.id, "timeout") >= 2, "timeouts count against the hung backend");
});

test("slow first byte within the timeout: no retry", async () => {
  const delay = 300;
  const p = await freshPool(1, "round_robin", { args: ["--fault-first-byte-delay-ms", String(delay)] });
  await only(p.name);
  for (const stream of [true, false]) {
    const r = await chat(`slow ${stream}`, { stream, max_tokens: 4 });
    if (stream) assertCompleteStream(r);
    else assert.equal(r.status, 200, r.text);
    assert.equal(r.backend, p.backends[0].id);
    assert.equal(r.attempts, 1);
    assert.ok(r.ms >= delay - 20, `answered in ${r.ms} ms despite a ${delay} ms delay`);
  }
  const m = await metrics();
  assert.equal(outcomes(m, p.backends[0].id, "timeout"), 0);
  assert.ok(outcomes(m, p.backends[0].id, "success") >= 2);
});

test("disconnect mid-stream: SSE error event, terminated stream, lease released, breaker counts it", async () => {
  const p = await freshPool(1, "round_robin", {
    args: ["--fault-disconnect-after-tokens", "3"],
    settings: { breaker: { failure_threshold: 1, base_cooldown_ms: 60000, max_cooldown_ms: 60000, jitter_ratio: 0 } },
  });
  await only(p.name);
  const [b] = p.backends;
  const r = await chat("tell me a long story", { stream: true, max_tokens: 40, extra: { ignore_eos: true } });
  assert.equal(r.status, 200);
  assert.equal(r.attempts, 1);
  const events = r.text.split("\n\n").filter((e) => e.startsWith("data: "));
  assert.ok(events.length >= 3, r.text);
  assert.equal(events.at(-1), "data: [DONE]", "the stream ends with [DONE]");
  const payload = JSON.parse(events.at(-2).slice("data: ".length));
  assert.equal(payload.error?.code, "upstream_stream_error", events.at(-2));
  assert.equal(typeof payload.error?.message, "string");
  assert.equal(payload.error?.type, "server_error");
  assert.ok(!payload.error.message.includes("127.0.0.1"), "the backend's URL leaked into the error");
  await waitFor(async () => {
    const s = await (await gw.admin(`/admin/pools/${p.name}`)).json();
    return s.in_flight === 0 && s.in_flight_tokens === 0;
  }, { timeoutMs: 5000, what: "the lease to be released" });
  const v = await backendView(b.id);
  assert.equal(v.leases_in_flight, 0);
  assert.equal(v.breaker, "open", "the mid-stream failure counted against the backend (threshold 1)");
  assert.equal(outcomes(await metrics(), b.id, "transport"), 1);
});

test("a backend that rejects the gateway's API key (401): retried elsewhere, never relayed to the client", async () => {
  // A misconfigured backend (wrong api_key) must not tell clients that *their* key is wrong: its
  // 401 is the backend's fault (retry on the next candidate, count it), not the client's.
  pool += 1;
  const name = `f${pool}`;
  const put = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy: "round_robin", ...ROOMY_BUDGET } });
  assert.equal(put.status, 200);
  const locked = await sim([...simArgs(pool * 10), "--api-key", "the-right-key"]);
  const open = await sim(simArgs(pool * 10 + 1));
  for (const [id, s, api_key] of [[`${name}-locked`, locked, "a-wrong-key"], [`${name}-open`, open, undefined]]) {
    const r = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models: [MODEL], id, api_key } });
    assert.equal(r.status, 201, await r.text());
  }
  await waitReady(gw, `${name}-open`);
  // Probes already see it: /v1/models answers 401 to the configured key, so it never gets ready.
  const locked_view = await waitFor(async () => {
    const v = await backendView(`${name}-locked`);
    return v.last_probe?.error?.includes("api_key") ? v : null;
  }, { what: "the probe to report the rejected key" });
  assert.notEqual(locked_view.lifecycle, "ready");
  await only(name);
  for (let i = 0; i < 4; i++) {
    const r = await chat(`key ${i}`, { stream: i % 2 === 1 });
    assert.equal(r.status, 200, `request ${i}: ${r.status} ${r.text.slice(0, 200)} from ${r.backend}`);
    assert.equal(r.backend, `${name}-open`);
  }
  // Fix the key: the backend joins. Then break it again: until probes notice (3 failed rounds),
  // requests reach it, get 401, and are retried on the other backend.
  const fix = await gw.admin(`/admin/backends/${name}-locked`, { method: "PATCH", body: { api_key: "the-right-key" } });
  assert.equal(fix.status, 200, await fix.text());
  await waitReady(gw, `${name}-locked`);
  const brk = await gw.admin(`/admin/backends/${name}-locked`, { method: "PATCH", body: { api_key: "wrong-again" } });
  assert.equal(brk.status, 200);
  let retried = 0;
  for (let i = 0; i < 4; i++) {
    const r = await chat(`again ${i}`);
    assert.equal(r.status, 200, `request ${i}: ${r.status} ${r.text.slice(0, 200)}`);
    assert.equal(r.backend, `${name}-open`);
    if (Number(r.headers.get("x-gateway-attempts")) > 1) retried += 1;
  }
  assert.ok(retried >= 1, "no request reached the backend with the broken key");
});

test("a client that hangs up mid-stream: upstream aborted, lease released, nobody blamed", async () => {
  const p = await freshPool(1, "round_robin", { args: ["--decode-ms-per-step", "5000"] }); // 100 ms a token
  await only(p.name);
  const [b] = p.backends;
  const controller = new AbortController();
  const resp = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: MODEL, stream: true, max_tokens: 100, ignore_eos: true, messages: [{ role: "user", content: "go on and on" }] }),
    signal: controller.signal,
  });
  assert.equal(resp.status, 200);
  const reader = resp.body.getReader();
  const first = await reader.read();
  assert.ok(!first.done);
  await waitFor(async () => (await backendView(b.id)).leases_in_flight === 1, { what: "the lease to be held" });
  controller.abort();
  await reader.cancel().catch(() => {});
  await waitFor(async () => (await backendView(b.id)).leases_in_flight === 0, { timeoutMs: 8000, what: "the lease to be released after the hang-up" });
  // The backend saw the abort (vLLM's finished_reason="abort") long before the 10 s the answer needed.
  await waitFor(async () => {
    const text = await (await fetch(`${b.sim.url}/metrics`)).text();
    return /vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} 1/.test(text);
  }, { timeoutMs: 5000, what: "the backend to see the upstream request aborted" });
  const m = await metrics();
  const byOutcome = Object.fromEntries(["success", "cancelled", "transport", "timeout", "server_error"].map((k) => [k, outcomes(m, b.id, k)]));
  assert.equal(outcomes(m, b.id, "transport"), 0, "a client hang-up is nobody's fault");
  assert.equal(outcomes(m, b.id, "server_error"), 0, "a client hang-up is nobody's fault");
  assert.equal((await backendView(b.id)).breaker, "closed");
  // ...and it is recorded as what it was: cancelled, not a success.
  assert.equal(outcomes(m, b.id, "cancelled"), 1, `outcomes recorded: ${JSON.stringify(byOutcome)}`);
});

/** Runs one probe round now and returns the backend's view. */
async function probeNow(poolName, id) {
  const r = await gw.admin(`/admin/pools/${poolName}/probe`, { method: "POST" });
  assert.equal(r.status, 200, await r.text());
  return backendView(id);
}

/** Which backends 4 round-robin requests reach. */
async function reached(n = 4) {
  const seen = new Set();
  for (let i = 0; i < n; i++) {
    const r = await chat(`flap ${i}`);
    assert.equal(r.status, 200, r.text);
    seen.add(r.backend);
  }
  return seen;
}

/**
 * A pool whose alarm probes once (at registration) and then only when the test says so, so each
 * probe verdict is the test's choice. Health thresholds are the defaults: 3 failures, 2 successes.
 */
async function manualProbePool() {
  pool += 1;
  const name = `f${pool}`;
  const r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy: "round_robin", probe_interval_ms: 3600000, ...ROOMY_BUDGET } });
  assert.equal(r.status, 200, await r.text());
  const backends = [];
  for (let i = 0; i < 2; i++) {
    const s = await sim(simArgs(pool * 10 + i));
    const id = `${name}-b${i}`;
    const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models: [MODEL], id } });
    assert.equal(reg.status, 201, await reg.text());
    backends.push({ id, sim: s });
  }
  await probeNow(name, backends[0].id);
  for (const b of backends) await waitReady(gw, b.id);
  const cfg = (await (await gw.admin(`/admin/pools/${name}`)).json()).config;
  assert.equal(cfg.health.failure_threshold, 3);
  assert.equal(cfg.health.success_threshold, 2);
  await only(name);
  return { name, backends };
}

/**
 * Drives a probe sequence on backend `flappy` with `down(true|false)` and checks, after every
 * probe, that its health and the traffic follow the thresholds and nothing else.
 */
async function flapScenario(p, flappy, steady, down, { servesWhileFailing }) {
  const step = async (fail, expected, label) => {
    await down(fail);
    const v = await probeNow(p.name, flappy.id);
    assert.equal(v.health, expected, `${label}: after a ${fail ? "failed" : "good"} probe`);
    // A process that is down cannot serve even while still in rotation (its requests are retried
    // and count against its breaker, which is not what this test is about): no traffic then.
    if (fail && !servesWhileFailing) return;
    const seen = await reached();
    if (expected === "healthy") assert.ok(seen.has(flappy.id) && seen.has(steady.id), `${label}: traffic ${[...seen]}`);
    else assert.deepEqual([...seen], [steady.id], `${label}: traffic ${[...seen]}`);
  };
  // Flapping faster than the failure threshold: never 3 failures in a row, so it stays in rotation.
  for (const [i, fail] of [true, false, true, true, false, true, false, true, true, false].entries()) {
    await step(fail, "healthy", `flap A${i}`);
  }
  // Three failures in a row take it out...
  await step(true, "healthy", "B0");
  await step(true, "healthy", "B1");
  await step(true, "unhealthy", "B2");
  // ...and flapping faster than the success threshold keeps it out.
  for (const [i, fail] of [false, true, false, true, false, true].entries()) {
    await step(fail, "unhealthy", `flap C${i}`);
  }
  // Two good probes in a row bring it back.
  await step(false, "unhealthy", "D0");
  await step(false, "healthy", "D1");
}

test("health flapping (process down/up) is absorbed by the probe hysteresis", async () => {
  const p = await manualProbePool();
  const [flappy, steady] = p.backends;
  const port = flappy.sim.port;
  let current = flappy.sim;
  await flapScenario(p, flappy, steady, async (fail) => {
    const running = current.child.exitCode === null && current.child.signalCode === null;
    if (fail && running) await current.close();
    if (!fail && !running) current = await sim(simArgs(pool * 10), { port });
  }, { servesWhileFailing: false });
});

test("health flapping (/health answering 503 on and off) is absorbed by the probe hysteresis", async () => {
  const p = await manualProbePool();
  const [flappy, steady] = p.backends;
  // vllm-sim's /v1 routes keep serving while /health answers 503.
  await flapScenario(p, flappy, steady, (fail) => setFaults(flappy.sim, fail ? { health_fail: true } : {}), { servesWhileFailing: true });
});

test("every backend down: 502/503 within a bounded time, then 503 with Retry-After; never a hang", async () => {
  // max_open_ratio 1: every breaker may open (by default at most half of them do, see
  // tests/trust-backends.test.mjs), so the pool can say 503 before probes find the backends down.
  const p = await freshPool(2, "least_load", { settings: { breaker: { failure_threshold: 1, base_cooldown_ms: 30000, max_cooldown_ms: 30000, max_open_ratio: 1 } } });
  await only(p.name);
  for (const b of p.backends) await b.sim.close();
  const answers = [];
  for (let i = 0; i < 6; i++) {
    const r = await chat(`anyone ${i}?`, { stream: i % 2 === 1 });
    assert.ok(r.ms < 5000, `request ${i} took ${r.ms} ms`);
    assert.ok([502, 503, 504].includes(r.status), `${r.status} ${r.text}`);
    assert.equal(r.headers.get("content-type"), "application/json", "errors before the first byte are JSON, not SSE");
    const err = JSON.parse(r.text).error;
    assert.equal(typeof err?.message, "string", r.text);
    assert.equal(typeof err?.type, "string", r.text);
    assert.ok(!r.text.includes("127.0.0.1"), "a backend URL leaked into the error");
    answers.push({ status: r.status, retryAfter: r.headers.get("retry-after"), code: err.code });
  }
  const unavailable = answers.filter((a) => a.status === 503);
  assert.ok(unavailable.length >= 4, JSON.stringify(answers));
  for (const a of unavailable) {
    assert.ok(Number(a.retryAfter) >= 1, `503 without Retry-After: ${JSON.stringify(a)}`);
    assert.equal(a.code, "no_backend_available");
  }
  assert.equal(answers.at(-1).status, 503, "once the breakers are open, the answer is 503");
});

test("the Durable Objects restarted: registry and pool config survive, traffic resumes", async () => {
  const dir = tempDir();
  let g = null;
  try {
    const bindings = { PROBE_INTERVAL_MS: "500", FIRST_BYTE_TIMEOUT_MS: String(FIRST_BYTE_TIMEOUT_MS) };
    g = await startGateway({ bindings, persistDir: dir.dir });
    const cfg = { policy: "round_robin", region: "eu-west", breaker: { failure_threshold: 7, saturation_ms: 2500 }, health: { failure_threshold: 4, success_threshold: 3 } };
    const put = await g.admin("/admin/pools/persist", { method: "PUT", body: cfg });
    assert.equal(put.status, 200, await put.text());
    const ss = [await sim(simArgs(901)), await sim(simArgs(902))];
    for (const [i, s] of ss.entries()) {
      const reg = await g.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: "persist", region: "eu-west", models: [MODEL], id: `persist-${i}`, weight: 3 + i } });
      assert.equal(reg.status, 201, await reg.text());
    }
    for (let i = 0; i < 2; i++) await waitReady(g, `persist-${i}`);
    const drained = await g.admin("/admin/backends/persist-1", { method: "PATCH", body: { drain: true } });
    assert.equal(drained.status, 200);
    const before = await chat("before the restart", { via: g });
    assert.equal(before.status, 200, before.text);
    assert.equal(before.backend, "persist-0");
    await g.close();
    g = null;

    g = await startGateway({ bindings, persistDir: dir.dir });
    const list = (await (await g.admin("/admin/backends")).json()).data;
    assert.deepEqual(list.map((b) => b.id).sort(), ["persist-0", "persist-1"]);
    const b0 = list.find((b) => b.id === "persist-0");
    const b1 = list.find((b) => b.id === "persist-1");
    assert.equal(b0.url, ss[0].url);
    assert.equal(b0.weight, 3);
    assert.equal(b0.region, "eu-west");
    assert.deepEqual(b0.models, [MODEL]);
    assert.ok(["draining", "drained"].includes(b1.lifecycle), `drain survived: ${b1.lifecycle}`);
    const state = await (await g.admin("/admin/pools/persist")).json();
    assert.equal(state.policy, "round_robin");
    assert.equal(state.config.region, "eu-west");
    assert.equal(state.config.breaker.failure_threshold, 7);
    assert.equal(state.config.breaker.saturation_ms, 2500);
    assert.equal(state.config.health.failure_threshold, 4);
    assert.equal(state.config.health.success_threshold, 3);
    assert.equal(state.in_flight, 0);
    // Traffic resumes (the restored snapshot or the first probe puts the backend back in rotation).
    const afterRestart = await waitFor(async () => {
      const r = await chat("after the restart", { via: g });
      return r.status === 200 ? r : null;
    }, { timeoutMs: 10000, intervalMs: 200, what: "traffic after the restart" });
    assert.equal(afterRestart.backend, "persist-0");
    await waitFor(async () => (await (await g.admin("/admin/pools/persist")).json()).in_flight === 0, { timeoutMs: 5000, what: "leases back to zero" });
  } finally {
    await g?.close();
    dir.cleanup();
  }
});

test("a backend removed (DELETE ?force=true) while streaming: the stream still completes", async () => {
  const p = await freshPool(1, "round_robin", { args: ["--decode-ms-per-step", "5000"] }); // 100 ms a token
  await only(p.name);
  const [b] = p.backends;
  const streaming = chat("a long answer please", { stream: true, max_tokens: 20, extra: { ignore_eos: true } });
  await waitFor(async () => (await backendView(b.id)).leases_in_flight === 1, { what: "the stream to start" });
  const del = await gw.admin(`/admin/backends/${b.id}?force=true`, { method: "DELETE" });
  assert.equal(del.status, 200, await del.text());
  assert.equal((await gw.admin(`/admin/backends/${b.id}`)).status, 404);
  const done = await streaming;
  assertCompleteStream(done);
  assert.equal(done.backend, b.id);
  const chunks = done.text.split("\n\n").filter((e) => e.startsWith("data: {"));
  assert.ok(chunks.length >= 20, `only ${chunks.length} chunks`);
  // Nothing else serves the model now: a clear error, not a hang.
  const next = await chat("anyone left?");
  assert.ok([404, 503].includes(next.status), `${next.status} ${next.text}`);
  await errorBody(new Response(next.text));
});
