// The gateway data path in workerd against real vllm-sim processes on 127.0.0.1: each policy does
// what it says, failures before the first byte are retried invisibly, failures after it end the
// stream with an SSE error event, breakers open and later admit trials, and every lease is
// returned after every test.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitFor, waitReady, errorBody, onlyPool } from "./lib/harness.mjs";

const MODEL = "test-model";
// Fast sims: 50x time scale, small cache so prefixes matter, fixed seeds.
const simArgs = (seed) => ["--model", MODEL, "--time-scale", "50", "--seed", String(seed), "--kv-blocks", "2048"];

let gw;
let sims = [];
let pool = 0;

before(async () => {
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500", FIRST_BYTE_TIMEOUT_MS: "1500" } });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

afterEach(async () => {
  // No lease may outlive its request, whatever the test did.
  for (let p = 1; p <= pool; p++) {
    await waitFor(async () => {
      const s = await (await gw.admin(`/admin/pools/p${p}`)).json();
      return s.in_flight === 0 ? s : null;
    }, { timeoutMs: 8000, what: `pool p${p} leases back to zero` });
  }
});

/** A fresh pool of `n` sims with the given policy; returns { name, backends: [{id, sim}] }. */
async function freshPool(n, policy, { args = [], settings = {}, roles = [] } = {}) {
  pool += 1;
  const name = `p${pool}`;
  const r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy, ...settings } });
  assert.equal(r.status, 200, await r.text());
  const backends = [];
  for (let i = 0; i < n; i++) {
    const role = roles[i] ?? "mixed";
    const sim = await startSim([...simArgs(pool * 10 + i), ...args, "--role", role]);
    sims.push(sim);
    const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: name, models: [MODEL], id: `${name}-b${i}`, role } });
    assert.equal(reg.status, 201, await reg.text());
    backends.push({ id: `${name}-b${i}`, sim });
  }
  for (const b of backends) await waitReady(gw, b.id);
  return { name, backends };
}

async function chat(messages, { headers = {}, stream = false, max_tokens = 8 } = {}) {
  const r = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", ...headers },
    body: JSON.stringify({ model: MODEL, messages, stream, max_tokens }),
  });
  const text = await r.text();
  return { status: r.status, backend: r.headers.get("x-gateway-backend"), pool: r.headers.get("x-gateway-pool"), attempts: Number(r.headers.get("x-gateway-attempts")), decision: r.headers.get("x-gateway-decision"), text, headers: r.headers };
}

/** Only pool `name` serves the test's models. */
const only = (name) => onlyPool(gw, name);

test("round_robin spreads requests evenly", async () => {
  const p = await freshPool(3, "round_robin");
  await only(p.name);
  const counts = {};
  for (let i = 0; i < 9; i++) {
    const r = await chat([{ role: "user", content: `question ${i}` }]);
    assert.equal(r.status, 200, r.text);
    assert.equal(r.pool, p.name);
    counts[r.backend] = (counts[r.backend] ?? 0) + 1;
  }
  assert.deepEqual(Object.values(counts).sort(), [3, 3, 3], JSON.stringify(counts));
});

test("consistent_hash keeps a session on one backend and spreads sessions", async () => {
  const p = await freshPool(3, "consistent_hash");
  await only(p.name);
  const owners = new Set();
  for (let s = 0; s < 12; s++) {
    const seen = new Set();
    for (let i = 0; i < 3; i++) {
      const r = await chat([{ role: "user", content: `turn ${i}` }], { headers: { "x-session-id": `session-${s}` } });
      assert.equal(r.status, 200, r.text);
      seen.add(r.backend);
    }
    assert.equal(seen.size, 1, `session-${s} moved between ${[...seen]}`);
    owners.add([...seen][0]);
  }
  assert.ok(owners.size >= 2, `12 sessions all landed on ${[...owners]}`);
});

test("cache_aware keeps a conversation's turns on the backend that holds its prefix", async () => {
  const p = await freshPool(3, "cache_aware");
  await only(p.name);
  const system = { role: "system", content: "You are a meticulous assistant. ".repeat(40) };
  const convs = [0, 1, 2, 3].map((c) => [system, { role: "user", content: `Conversation ${c}: ${"context ".repeat(60)}` }]);
  const homes = convs.map(() => new Set());
  for (let turn = 0; turn < 4; turn++) {
    for (let c = 0; c < convs.length; c++) {
      const r = await chat(convs[c]);
      assert.equal(r.status, 200, r.text);
      homes[c].add(r.backend);
      const reply = JSON.parse(r.text).choices[0].message.content;
      convs[c].push({ role: "assistant", content: reply }, { role: "user", content: `follow-up ${turn} of ${c}` });
      if (turn > 0) assert.equal(r.decision, "cache_hit", `turn ${turn} of conversation ${c}`);
    }
  }
  homes.forEach((h, c) => assert.equal(h.size, 1, `conversation ${c} moved: ${[...h]}`));
});

test("a killed backend causes no client-visible failure before streaming starts", async () => {
  const p = await freshPool(2, "round_robin", { settings: { breaker: { failure_threshold: 3 } } });
  await only(p.name);
  await p.backends[0].sim.close(); // SIGKILL: connection refused from now on
  let retried = 0;
  for (let i = 0; i < 6; i++) {
    const r = await chat([{ role: "user", content: `after the crash ${i}` }], { stream: i % 2 === 0 });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.backend, p.backends[1].id);
    if (r.attempts > 1) retried += 1;
  }
  assert.ok(retried >= 1, "no request needed a retry: the dead backend was never tried");
  const dead = await (await gw.admin(`/admin/backends/${p.backends[0].id}`)).json();
  assert.notEqual(dead.breaker === "closed" && dead.health === "healthy", true, "the dead backend still looks fine");
});

test("a backend that fails mid-stream ends the stream with an SSE error event", async () => {
  const p = await freshPool(1, "round_robin", { args: ["--fault-disconnect-after-tokens", "3"] });
  await only(p.name);
  const r = await chat([{ role: "user", content: "tell me a long story" }], { stream: true, max_tokens: 50 });
  assert.equal(r.status, 200);
  const events = r.text.split("\n\n").filter((e) => e.startsWith("data: "));
  assert.ok(events.length >= 3, r.text);
  const last = events.filter((e) => e !== "data: [DONE]").at(-1);
  const payload = JSON.parse(last.slice("data: ".length));
  assert.equal(payload.error?.code, "upstream_stream_error", last);
  assert.ok(r.text.trimEnd().endsWith("data: [DONE]"));
});

test("a breaker opens on 5xx, sheds traffic, then admits a trial and closes", async () => {
  const p = await freshPool(2, "round_robin", {
    settings: { breaker: { failure_threshold: 2, success_threshold: 1, base_cooldown_ms: 1500, max_cooldown_ms: 1500, jitter_ratio: 0 } },
  });
  await only(p.name);
  const [bad, good] = p.backends;
  const f = await fetch(`${bad.sim.url}/sim/faults`, { method: "POST", body: JSON.stringify({ error_rate: 1.0, error_status: 500 }) });
  assert.equal(f.status, 200);
  for (let i = 0; i < 6; i++) {
    const r = await chat([{ role: "user", content: `q${i}` }]);
    assert.equal(r.status, 200, r.text);
    assert.equal(r.backend, good.id);
  }
  const opened = await (await gw.admin(`/admin/backends/${bad.id}`)).json();
  assert.equal(opened.breaker, "open");
  await fetch(`${bad.sim.url}/sim/faults`, { method: "POST", body: "{}" });
  const closed = await waitFor(async () => {
    await chat([{ role: "user", content: "probe traffic" }]);
    const v = await (await gw.admin(`/admin/backends/${bad.id}`)).json();
    return v.breaker === "closed" ? v : null;
  }, { timeoutMs: 10000, intervalMs: 200, what: "the breaker to close after its cooldown" });
  assert.equal(closed.breaker, "closed");
});

test("every backend down: a clear error quickly, then 503 with Retry-After", async () => {
  // max_open_ratio 1: every breaker may open (by default at most half of them do, see
  // tests/trust-backends.test.mjs), so the pool can say 503 before probes find the backends down.
  const p = await freshPool(2, "least_load", { settings: { breaker: { failure_threshold: 1, base_cooldown_ms: 30000, max_cooldown_ms: 30000, max_open_ratio: 1 } } });
  await only(p.name);
  for (const b of p.backends) await b.sim.close();
  const started = Date.now();
  const first = await chat([{ role: "user", content: "anyone?" }]);
  assert.ok([502, 503].includes(first.status), `${first.status} ${first.text}`);
  assert.ok(Date.now() - started < 5000, "the failure took too long");
  const r = await gw.fetch("/v1/chat/completions", { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content: "again" }] }) });
  assert.equal(r.status, 503);
  assert.ok(Number(r.headers.get("retry-after")) >= 1);
  assert.equal((await errorBody(r)).code, "no_backend_available");
});

test("draining a backend takes it out of rotation; DELETE waits for the drain unless forced", async () => {
  const p = await freshPool(2, "round_robin");
  await only(p.name);
  const [a, b] = p.backends;
  const del = await gw.admin(`/admin/backends/${a.id}`, { method: "DELETE" });
  assert.equal(del.status, 200, "an idle backend is removed at once");
  for (let i = 0; i < 4; i++) {
    const r = await chat([{ role: "user", content: `x${i}` }]);
    assert.equal(r.backend, b.id);
  }
  const gone = await gw.admin(`/admin/backends/${a.id}`);
  assert.equal(gone.status, 404);
  await errorBody(gone);
});

test("disaggregated: a prefill server computes the prompt, a decode server streams the answer", async () => {
  const p = await freshPool(2, "disaggregated", { roles: ["prefill", "decode"] });
  await only(p.name);
  const [prefill, decode] = p.backends;
  for (const stream of [true, false]) {
    const r = await chat([{ role: "user", content: "explain disaggregated serving " + "in detail ".repeat(30) }], { stream, max_tokens: 6 });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.headers.get("x-gateway-prefill-backend"), prefill.id);
    assert.equal(r.backend, decode.id);
    // The decode server only accepts kv_transfer_params its peer issued for this very prompt.
    if (!stream) assert.equal(JSON.parse(r.text).usage.completion_tokens, 6);
  }
});

test("cache_aware: a new backend starts cold and is neither flooded nor starved", async () => {
  const p = await freshPool(3, "cache_aware");
  await only(p.name);
  const system = { role: "system", content: "Shared instructions for every user. ".repeat(30) };
  const old = [0, 1, 2, 3, 4, 5].map((c) => [system, { role: "user", content: `existing user ${c} ${"history ".repeat(40)}` }]);
  const homes = old.map(() => null);
  for (let c = 0; c < old.length; c++) homes[c] = (await chat(old[c])).backend;
  // A fourth backend joins.
  const sim = await startSim(simArgs(999));
  sims.push(sim);
  const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: p.name, models: [MODEL], id: `${p.name}-new` } });
  assert.equal(reg.status, 201);
  await waitReady(gw, `${p.name}-new`);
  // Fresh users tie on load and go to a random one of the four, so the newcomer takes about a
  // quarter: over 32 the odds of none are (3/4)^32 (1 in 10,000; over 16 they were 1 in 100, and
  // a run saw it), and of more than 24 smaller still.
  let toNew = 0;
  for (let i = 0; i < 32; i++) {
    const fresh = await chat([{ role: "user", content: `brand new user ${i} ${"unique ".repeat(40)} ${i}` }]);
    if (fresh.backend === `${p.name}-new`) toNew += 1;
    // Existing conversations keep their homes: the newcomer does not steal cached prefixes.
    const c = i % old.length;
    assert.equal((await chat(old[c])).backend, homes[c], `existing conversation ${c} moved`);
  }
  assert.ok(toNew >= 1, "the new backend was starved");
  assert.ok(toNew <= 24, `the new backend was flooded (${toNew}/32)`);
});
