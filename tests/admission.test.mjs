// Admission control end to end: the built Worker in workerd, real vllm-sim processes with a small
// --max-num-seqs, and the pool's queue in its Durable Object. A backend never runs more than its
// capacity; what does not fit waits in the gateway's queue and is served by priority, then fairly
// between tenants; limits, timeouts and departed clients leave the queue with the documented
// errors; leases, queue lengths and in-flight counters return to zero after every test.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitFor, waitReady, errorBody, parseMetrics, metricValue, poolObjectCall, ADMIN_TOKEN, drained, poolState } from "./lib/harness.mjs";

let gw;
const sims = [];
const pools = [];

before(async () => {
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500", ALLOW_REGION_HEADER: "true" } });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

afterEach(async () => {
  // Whatever a test did, nothing stays queued or leased.
  for (const name of pools) await drained(gw, name);
});

let poolCount = 0;
/**
 * A fresh pool serving its own model, with admission control on: `n` sims running `seqs`
 * sequences each (registered with the same max_num_seqs). Returns { name, model, sims }.
 */
async function freshPool({ n = 1, seqs = 1, admission = {}, settings = {}, g = gw } = {}) {
  poolCount += 1;
  const name = `adm${poolCount}`;
  const model = `model-${name}`;
  const r = await g.admin(`/admin/pools/${name}`, {
    method: "PUT",
    body: { policy: "least_load", admission: { enabled: true, poll_ms: 1000, ...admission }, ...settings },
  });
  assert.equal(r.status, 200, await r.text());
  const started = [];
  for (let i = 0; i < n; i++) {
    const sim = await startSim(["--model", model, "--max-num-seqs", String(seqs), "--seed", String(poolCount * 10 + i)]);
    sims.push(sim);
    started.push(sim);
    await addBackend(g, name, model, sim, i, seqs);
  }
  if (g === gw) pools.push(name);
  return { name, model, sims: started };
}

async function addBackend(g, name, model, sim, i, seqs) {
  const id = `${name}-b${i}`;
  const reg = await g.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: name, models: [model], id, max_num_seqs: seqs } });
  assert.equal(reg.status, 201, await reg.text());
  await waitReady(g, id);
  return id;
}

/** A chat request; `tokens` output tokens at the sim's 10 ms per step (ignore_eos). */
async function chat(model, { tokens = 20, tenant, priority, maxWait, stream = false, key, signal, headers = {}, g = gw, text } = {}) {
  const h = { "content-type": "application/json", ...headers };
  if (tenant) h["x-tenant-id"] = tenant;
  if (priority !== undefined) h["x-gateway-priority"] = String(priority);
  if (maxWait !== undefined) h["x-gateway-max-wait-ms"] = String(maxWait);
  if (key) h.authorization = `Bearer ${key}`;
  const r = await g.fetch("/v1/chat/completions", {
    method: "POST",
    headers: h,
    signal,
    body: JSON.stringify({
      model, stream, max_tokens: tokens, ignore_eos: true,
      messages: [{ role: "user", content: text ?? `hello from ${tenant ?? "someone"} ${Math.random()}` }],
    }),
  });
  const body = await r.text();
  return { status: r.status, headers: r.headers, body, at: performance.now() };
}

/** The sim's gauge `name` (e.g. vllm:num_requests_running). */
async function simGauge(sim, name) {
  const text = await (await fetch(`${sim.url}/metrics`)).text();
  const v = parseMetrics(text).find((s) => s.name === name);
  return v?.value ?? 0;
}

async function gatewayMetrics(g = gw) {
  const r = await g.fetch("/metrics", { headers: { authorization: `Bearer ${ADMIN_TOKEN}` } });
  assert.equal(r.status, 200);
  return parseMetrics(await r.text());
}

async function waitQueued(name, n, g = gw) {
  return waitFor(async () => ((await poolState(g, name)).queue.length >= n ? true : null), { timeoutMs: 10000, intervalMs: 20, what: `${n} queued in ${name}` });
}

test("a backend never runs more than its capacity; the rest wait in the gateway's queue and all are served", async () => {
  const p = await freshPool({ n: 2, seqs: 2 });
  let sampling = true;
  const seen = { running: 0, waiting: 0, queued: 0 };
  const sampler = (async () => {
    while (sampling) {
      for (const sim of p.sims) {
        seen.running = Math.max(seen.running, await simGauge(sim, "vllm:num_requests_running"));
        seen.waiting = Math.max(seen.waiting, await simGauge(sim, "vllm:num_requests_waiting"));
      }
      seen.queued = Math.max(seen.queued, (await poolState(gw, p.name)).queue.length);
      await new Promise((r) => setTimeout(r, 15));
    }
  })();
  const results = await Promise.all(Array.from({ length: 16 }, (_, i) => chat(p.model, { tokens: 30, tenant: `t${i % 3}`, stream: i % 2 === 0 })));
  sampling = false;
  await sampler;
  for (const r of results) assert.equal(r.status, 200, r.body);
  assert.ok(seen.running <= 2, `a sim ran ${seen.running} sequences with max_num_seqs 2`);
  assert.equal(seen.waiting, 0, "nothing waited inside a backend: the gateway held the excess");
  assert.ok(seen.queued >= 1, "requests waited in the gateway's queue");
  assert.ok(results.some((r) => Number(r.headers.get("x-gateway-queue-wait-ms")) > 0), "queued answers say how long they waited");
  const s = await drained(gw, p.name);
  assert.equal(s.queue.admitted, 16);
  assert.ok(s.queue.queued >= 1);
  for (const [reason, n] of Object.entries(s.queue.dropped)) assert.equal(n, 0, `dropped for ${reason}`);
  const m = await gatewayMetrics();
  assert.equal(metricValue(m, "llm_gateway_queue_length", { pool: p.name }), 0);
  assert.equal(metricValue(m, "llm_gateway_queue_wait_seconds_count", { pool: p.name }), 16);
  assert.equal(metricValue(m, "llm_gateway_leases_in_flight", { pool: p.name }) ?? 0, 0);
});

test("higher priority is served first under contention", async () => {
  const p = await freshPool({ seqs: 1 });
  const blocker = chat(p.model, { tokens: 150 });
  await waitFor(async () => ((await poolState(gw, p.name)).in_flight === 1 ? true : null), { what: "the blocker holds the backend" });
  const done = [];
  // One at a time, each queued before the next is sent, so their arrival order at the pool is
  // known (requests sent at once reach the Durable Object in no fixed order).
  const low = [];
  for (let i = 0; i < 5; i++) {
    low.push(chat(p.model, { tokens: 5, tenant: "batch", priority: -5 }).then((r) => done.push(`low${i}`) && r));
    await waitQueued(p.name, i + 1);
  }
  const high = Array.from({ length: 3 }, (_, i) => chat(p.model, { tokens: 5, tenant: "batch", priority: 5 }).then((r) => done.push(`high${i}`) && r));
  const s = await waitQueued(p.name, 8);
  assert.ok(s);
  const byPriority = (await poolState(gw, p.name)).queue.by_priority;
  assert.deepEqual(byPriority, { 5: 3, "-5": 5 });
  const results = await Promise.all([blocker, ...low, ...high]);
  for (const r of results) assert.equal(r.status, 200, r.body);
  assert.deepEqual(done.slice(0, 3).sort(), ["high0", "high1", "high2"], `completion order ${done}`);
  assert.deepEqual(done.slice(3), ["low0", "low1", "low2", "low3", "low4"], "arrival order within a tenant and band");
});

/** Jain's fairness index of the amounts in `xs`: 1 when equal, 1/n when one gets everything. */
function jain(xs) {
  const sum = xs.reduce((a, b) => a + b, 0);
  const sq = xs.reduce((a, b) => a + b * b, 0);
  return (sum * sum) / (xs.length * sq);
}

test("two equal tenants, one flooding, get fair shares (Jain's index over the contended period)", async (t) => {
  const p = await freshPool({ seqs: 2, admission: { max_queue_per_tenant: 0 } });
  const order = [];
  const flood = Array.from({ length: 30 }, () => chat(p.model, { tokens: 8, tenant: "flood" }).then((r) => (order.push("flood"), r)));
  await waitQueued(p.name, 20);
  const light = Array.from({ length: 8 }, () => chat(p.model, { tokens: 8, tenant: "light" }).then((r) => (order.push("light"), r)));
  const results = await Promise.all([...flood, ...light]);
  for (const r of results) assert.equal(r.status, 200, r.body);
  // The contended period: from the first light completion to the last one.
  const first = order.indexOf("light");
  const last = order.lastIndexOf("light");
  const window = order.slice(first, last + 1);
  const shares = [window.filter((t) => t === "flood").length, window.filter((t) => t === "light").length];
  const index = jain(shares);
  t.diagnostic(`Jain's index ${index.toFixed(3)} over ${JSON.stringify(shares)} (flood, light)`);
  // First come, first served would serve the 8 light requests back to back after the flood's
  // queued ones, so this window would hold light requests only (index 0.5); deficit round robin
  // alternates the two tenants (index near 1).
  assert.ok(index >= 0.9, `Jain's index ${index.toFixed(3)} over ${JSON.stringify(shares)} (order ${order.join(",")})`);
  assert.ok(order.lastIndexOf("light") < order.length - 10, "the light tenant finished well before the flood");
});

test("queue limits: 429 queue_full for a tenant over its limit or share, eviction for a tenant under it", async () => {
  const p = await freshPool({ seqs: 1, admission: { max_queue: 3, max_queue_per_tenant: 2, max_wait_ms: 20000 } });
  const blocker = chat(p.model, { tokens: 300 });
  await waitFor(async () => ((await poolState(gw, p.name)).in_flight === 1 ? true : null), { what: "blocker" });
  const a1 = chat(p.model, { tokens: 2, tenant: "a" });
  const a2 = chat(p.model, { tokens: 2, tenant: "a" });
  await waitQueued(p.name, 2);
  const a3 = await chat(p.model, { tokens: 2, tenant: "a" });
  assert.equal(a3.status, 429);
  assert.equal(a3.headers.get("x-gateway-queue-drop"), "tenant_limit");
  assert.ok(Number(a3.headers.get("retry-after")) >= 1);
  assert.equal(JSON.parse(a3.body).error.code, "queue_full");
  const b1 = chat(p.model, { tokens: 2, tenant: "b" });
  await waitQueued(p.name, 3);
  // The queue is full; tenant c has nothing queued, so a's newest request makes room.
  const c1 = chat(p.model, { tokens: 2, tenant: "c" });
  const evicted = await a2;
  assert.equal(evicted.status, 429, evicted.body);
  assert.equal(evicted.headers.get("x-gateway-queue-drop"), "evicted");
  const err = JSON.parse(evicted.body).error;
  assert.equal(err.code, "queue_full");
  assert.equal(err.type, "rate_limit_error");
  // b has its share (1 of 3 with three tenants): a second request is refused, not queued.
  const b2 = await chat(p.model, { tokens: 2, tenant: "b" });
  assert.equal(b2.status, 429);
  assert.equal(b2.headers.get("x-gateway-queue-drop"), "queue_full");
  for (const r of await Promise.all([blocker, a1, b1, c1])) assert.equal(r.status, 200, r.body);
  const s = await drained(gw, p.name);
  assert.deepEqual(
    { tenant_limit: s.queue.dropped.tenant_limit, evicted: s.queue.dropped.evicted, queue_full: s.queue.dropped.queue_full },
    { tenant_limit: 1, evicted: 1, queue_full: 1 },
  );
  const m = await gatewayMetrics();
  assert.equal(metricValue(m, "llm_gateway_queue_dropped_total", { pool: p.name, reason: "evicted" }), 1);
});

test("timeouts: 503 queue_timeout with Retry-After after max_wait_ms or the client's shorter limit; nothing refused while it can wait", async () => {
  const p = await freshPool({ seqs: 1, admission: { max_wait_ms: 1500 } });
  const blocker = chat(p.model, { tokens: 400 });
  await waitFor(async () => ((await poolState(gw, p.name)).in_flight === 1 ? true : null), { what: "blocker" });
  // No time to wait: refused at once.
  const now = await chat(p.model, { maxWait: 0 });
  assert.equal(now.status, 503);
  assert.equal(now.headers.get("x-gateway-queue-drop"), "queue_timeout");
  assert.equal(JSON.parse(now.body).error.code, "queue_timeout");
  const [short, pooled] = await Promise.all([chat(p.model, { maxWait: 300 }), chat(p.model, { maxWait: 999999 })]);
  for (const r of [short, pooled]) {
    assert.equal(r.status, 503, r.body);
    assert.equal(JSON.parse(r.body).error.code, "queue_timeout");
    assert.ok(Number(r.headers.get("retry-after")) >= 1);
  }
  assert.equal((await blocker).status, 200);
  // With room again, a request with a wait limit is served, not refused.
  assert.equal((await chat(p.model, { maxWait: 0 })).status, 200);
  const s = await drained(gw, p.name);
  assert.equal(s.queue.dropped.queue_timeout, 3);
  // Bad admission headers are the client's error.
  for (const headers of [{ "x-gateway-priority": "high" }, { "x-gateway-priority": "5000" }, { "x-gateway-max-wait-ms": "-1" }]) {
    const r = await chat(p.model, { headers });
    assert.equal(r.status, 400, JSON.stringify(headers));
    await errorBody(new Response(r.body));
  }
});

test("a queued request is granted when a backend joins", async () => {
  const p = await freshPool({ seqs: 1 });
  const blocker = chat(p.model, { tokens: 600 });
  await waitFor(async () => ((await poolState(gw, p.name)).in_flight === 1 ? true : null), { what: "blocker" });
  const waiting = chat(p.model, { tokens: 2 });
  await waitQueued(p.name, 1);
  const sim = await startSim(["--model", p.model, "--max-num-seqs", "1"]);
  sims.push(sim);
  const id = await addBackend(gw, p.name, p.model, sim, 1, 1);
  const r = await waiting;
  assert.equal(r.status, 200, r.body);
  assert.equal(r.headers.get("x-gateway-backend"), id, "served by the new backend while the first was busy");
  assert.equal((await blocker).status, 200);
});

test("spillover happens before queueing: a full pool sends work to one with room; when all are full, the nearest queues it", async () => {
  const near = await freshPool({ seqs: 1, settings: { region: "near-r" } });
  // A second pool serving the same model, further away.
  const far = await freshPool({ n: 0, settings: { region: "far-r" } });
  const farSim = await startSim(["--model", near.model, "--max-num-seqs", "1"]);
  sims.push(farSim);
  await addBackend(gw, far.name, near.model, farSim, 0, 1);
  const region = { "x-gateway-region": "near-r" };
  const first = chat(near.model, { tokens: 400, headers: region });
  await waitFor(async () => ((await poolState(gw, near.name)).in_flight === 1 ? true : null), { what: "near pool busy" });
  const second = chat(near.model, { tokens: 400, headers: region });
  await waitFor(async () => ((await poolState(gw, far.name)).in_flight === 1 ? true : null), { what: "spilled to the far pool" });
  const third = chat(near.model, { tokens: 2, headers: region });
  await waitQueued(near.name, 1);
  assert.equal((await poolState(gw, far.name)).queue.length, 0, "queued at the nearest pool only");
  const [r1, r2, r3] = await Promise.all([first, second, third]);
  assert.equal(r1.headers.get("x-gateway-pool"), near.name);
  assert.equal(r2.headers.get("x-gateway-pool"), far.name);
  assert.equal(r3.status, 200, r3.body);
});

test("departures: a client that hangs up, a Worker that stops asking, a parked grant nobody collects, a restarted queue", async () => {
  const p = await freshPool({ seqs: 1, admission: { poll_ms: 500, max_wait_ms: 60000 } });
  // The pool's own side, through its internal routes, as a Worker calls them.
  const call = await poolObjectCall(gw, p.name);
  const acquire = (admission) => call("acquire", { features: { model: p.model, request_id: "do-test", prompt_tokens: 10, max_tokens: 5 }, admission });
  // A lease held by the test itself keeps the backend full until it is released.
  const held = await acquire({ tenant: "holder" });
  assert.equal(held.status, 200);
  const { lease_id } = await held.json();

  // A streaming client hangs up while queued. Locally workerd does not report a hang-up before the
  // response starts (see the README), so its request waits until granted; then the first write
  // fails and the upstream request is aborted. Its lease must not leak either way.
  const ctl = new AbortController();
  const hung = chat(p.model, { tokens: 200, stream: true, signal: ctl.signal }).catch((e) => ({ error: e.name }));
  await waitQueued(p.name, 1);
  ctl.abort();

  // A Worker that stops asking after a 202 leaves the queue within poll_ms plus the grace.
  const first = await acquire({ tenant: "gone" });
  assert.equal(first.status, 202);
  const { ticket } = await first.json();
  assert.ok(ticket > 0);
  await waitFor(async () => ((await poolState(gw, p.name)).queue.dropped.client_gone >= 1 ? true : null), { timeoutMs: 10000, what: "the silent waiter swept" });
  // An explicit dequeue (what the Worker sends when its client's signal aborts) leaves at once.
  const second = await acquire({ tenant: "leaves" });
  assert.equal(second.status, 202);
  const dq = await call("dequeue", { ticket: (await second.json()).ticket });
  assert.deepEqual(await dq.json(), { dequeued: true });
  // A ticket the pool does not know (it restarted) re-enters with the time it already waited...
  const reentry = await acquire({ tenant: "back", ticket: 4242, waited_ms: 100 });
  assert.equal(reentry.status, 202);
  assert.equal((await reentry.json()).ticket, 4242);
  // ... and one that already waited past the deadline gets a clean 503.
  const late = await acquire({ tenant: "late", ticket: 4343, waited_ms: 61000 });
  assert.equal(late.status, 503);
  assert.equal(late.headers.get("x-gateway-queue-drop"), "queue_timeout");
  const s = await poolState(gw, p.name);
  assert.equal(s.queue.reentered, 2);
  assert.equal(s.queue.dropped.client_gone, 2);

  // The backend frees: the hung client's request is granted (and cancelled at its first write);
  // then ticket 4242, never asked for again, is granted while no call is open, parked, and
  // released when nobody collects it.
  const released = await call("release", { lease_id, outcome: { kind: "success" } });
  assert.deepEqual(await released.json(), { released: true });
  assert.deepEqual(await hung, { error: "AbortError" });
  const after = await drained(gw, p.name);
  assert.equal(after.queue.dropped.client_gone, 3, JSON.stringify(after.queue));
});

test("priority from a minted key: x-gateway-priority may lower it, never raise it", async () => {
  const g = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500" } });
  try {
    const mint = async (name, priority) => {
      const r = await g.admin("/admin/keys", { method: "POST", body: { name, priority } });
      const text = await r.text();
      assert.equal(r.status, 201, text);
      return JSON.parse(text);
    };
    const batch = await mint("batch", -10);
    const interactive = await mint("interactive", 10);
    assert.equal(interactive.priority, 10);
    const bad = await g.admin("/admin/keys", { method: "POST", body: { name: "x", priority: 100000 } });
    assert.equal(bad.status, 400);
    const patched = await g.admin(`/admin/keys/${batch.id}`, { method: "PATCH", body: { priority: -5 } });
    assert.equal(patched.status, 200, await patched.text());
    const listed = (await (await g.admin("/admin/keys")).json()).data;
    assert.equal(listed.find((k) => k.id === batch.id).priority, -5);

    const p = await freshPool({ seqs: 1, g });
    const blocker = chat(p.model, { tokens: 150, key: interactive.key, g });
    await waitFor(async () => ((await poolState(g, p.name)).in_flight === 1 ? true : null), { what: "blocker" });
    const done = [];
    const send = (label, opts) => chat(p.model, { tokens: 3, g, ...opts }).then((r) => (done.push(label), r));
    const lows = [0, 1].map((i) => send(`batch${i}`, { key: batch.key }));
    await waitQueued(p.name, 2, g);
    // The batch key cannot raise itself; the interactive key lowered below batch waits last.
    const raised = send("batch-raised", { key: batch.key, priority: 50 });
    await waitQueued(p.name, 3, g);
    const lowered = send("interactive-lowered", { key: interactive.key, priority: -8 });
    await waitQueued(p.name, 4, g);
    const urgent = send("interactive", { key: interactive.key });
    await waitQueued(p.name, 5, g);
    const bp = (await poolState(g, p.name)).queue.by_priority;
    assert.deepEqual(bp, { 10: 1, "-5": 3, "-8": 1 });
    for (const r of await Promise.all([blocker, ...lows, raised, lowered, urgent])) assert.equal(r.status, 200, r.body);
    assert.deepEqual(done, ["interactive", "batch0", "batch1", "batch-raised", "interactive-lowered"]);
    await drained(g, p.name);
  } finally {
    await g.close();
  }
});
