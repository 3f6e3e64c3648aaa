// The pool's own rules hold whatever one client, request or backend does (issue 23): the admission
// queue never blocks a request on a model it cannot place, a grant whose Worker gave up on it goes
// back at once, a move onto a full backend is refused, a drain survives a Durable Object restart
// until the streams on it have renewed and ended, and a restarted pool with admission control on
// grants nothing on top of the streams it lost until they renewed (issue 42). The built Worker
// runs under Miniflare with real vllm-sim processes; where a test plays the Worker's side of the protocol (a wait it abandoned, a
// renewal after a restart, a retry onto a named backend) it calls the pool's Durable Object through
// `poolObjectCall`, exactly as the Worker does. After each test, leases, queue lengths and in-flight
// counters are back to zero.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitFor, waitReady, poolObjectCall, tempDir, drained, poolState } from "./lib/harness.mjs";

let gw;
const sims = [];
const pools = [];

before(async () => {
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500" } });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

afterEach(async () => {
  for (const name of pools.splice(0)) await drained(gw, name);
});

async function sim(model, args = []) {
  const s = await startSim(["--model", model, "--max-num-seqs", "1", ...args]);
  sims.push(s);
  return s;
}

async function register(g, pool, id, model, s) {
  const r = await g.admin("/admin/backends", { method: "POST", body: { url: s.url, pool, models: [model], id, max_num_seqs: 1 } });
  assert.equal(r.status, 201, await r.text());
  await waitReady(g, id);
}

async function putPool(g, name, body) {
  const r = await g.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy: "least_load", ...body } });
  assert.equal(r.status, 200, await r.text());
}

function features(model, id) {
  return { model, request_id: id, prompt_tokens: 10, max_tokens: 5 };
}

function chat(model, tokens = 4) {
  return gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model, max_tokens: tokens, ignore_eos: true, messages: [{ role: "user", content: `q ${Math.random()}` }] }),
  }).then(async (r) => ({ status: r.status, body: await r.text() }));
}

test("a mixed-model queue: a request for a model with an idle backend is granted at once, behind any number waiting for a saturated one", async () => {
  const name = "tp-mixed";
  await putPool(gw, name, { admission: { enabled: true, poll_ms: 1000, max_wait_ms: 8000, lookahead: 4 } });
  pools.push(name);
  await register(gw, name, "tp-mixed-a", "tp-model-a", await sim("tp-model-a"));
  await register(gw, name, "tp-mixed-b", "tp-model-b", await sim("tp-model-b"));
  const call = await poolObjectCall(gw, name);
  // Model A's only backend is held full by a lease the test owns.
  const held = await call("acquire", { features: features("tp-model-a", "tp-hold"), admission: { tenant: "holder" } });
  assert.equal(held.status, 200);
  const { lease_id } = await held.json();
  // More requests wait for model A than the look-ahead window holds.
  const waitersA = Array.from({ length: 10 }, () => chat("tp-model-a"));
  await waitFor(async () => ((await poolState(gw, name)).queue.length >= 10 ? true : null), { intervalMs: 20, what: "10 queued for model A" });
  // Model B's backend is idle: its request is served while every A waiter still waits.
  const b = await chat("tp-model-b");
  assert.equal(b.status, 200, b.body);
  const during = await poolState(gw, name);
  assert.equal(during.queue.length, 10, "model A's waiters were not served before B's request");
  assert.equal(during.queue.dropped.queue_timeout ?? 0, 0);
  // A's backend frees: its waiters are served in turn.
  assert.deepEqual(await (await call("release", { lease_id, outcome: { kind: "success" } })).json(), { released: true });
  for (const r of await Promise.all(waitersA)) assert.equal(r.status, 200, r.body);
});

test("keyless clients are told apart by a salted hash of their address, never the address itself, and share the queue fairly", async () => {
  const name = "tp-keyless";
  await putPool(gw, name, { admission: { enabled: true, poll_ms: 1000, max_wait_ms: 30000, max_queue_per_tenant: 0 } });
  pools.push(name);
  const model = "tp-model-k";
  await register(gw, name, "tp-keyless-0", model, await sim(model));
  const call = await poolObjectCall(gw, name);
  const held = await call("acquire", { features: features(model, "tp-k-hold"), admission: { tenant: "holder" } });
  assert.equal(held.status, 200);
  const { lease_id } = await held.json();
  const done = [];
  const ask = (ip, label) => gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", "cf-connecting-ip": ip },
    body: JSON.stringify({ model, max_tokens: 2, ignore_eos: true, messages: [{ role: "user", content: `${label} ${Math.random()}` }] }),
  }).then(async (r) => { await r.text(); done.push(label); return r.status; });
  // One address sends three, then another sends one.
  const asks = [];
  for (const i of [1, 2, 3]) {
    asks.push(ask("203.0.113.7", `x${i}`));
    await waitFor(async () => ((await poolState(gw, name)).queue.length >= i ? true : null), { intervalMs: 20, what: `${i} queued` });
  }
  asks.push(ask("2001:db8::9", "y1"));
  await waitFor(async () => ((await poolState(gw, name)).queue.length >= 4 ? true : null), { intervalMs: 20, what: "4 queued" });
  const summary = await poolState(gw, name);
  assert.equal(summary.queue.tenants, 2, "two addresses, two tenants");
  const metrics = await (await gw.admin("/metrics")).text();
  for (const text of [JSON.stringify(summary), metrics]) {
    assert.ok(!text.includes("203.0.113.7") && !text.includes("2001:db8::9"), "an address leaked");
  }
  await call("release", { lease_id, outcome: { kind: "success" } });
  for (const status of await Promise.all(asks)) assert.equal(status, 200);
  // Fair shares: the second address is served second, not after every request of the first.
  assert.deepEqual(done, ["x1", "y1", "x2", "x3"]);
});

test("a grant whose Worker gave up on it (before any answer, or while it was on its way back) is released at once", async () => {
  const name = "tp-hangup";
  // Long leases: a leaked one would stay for a minute, far past this test's waits.
  await putPool(gw, name, { lease_ttl_ms: 120000, admission: { enabled: true, poll_ms: 20000, max_wait_ms: 60000 } });
  pools.push(name);
  const model = "tp-model-h";
  await register(gw, name, "tp-hangup-0", model, await sim(model));
  const call = await poolObjectCall(gw, name);
  const acquire = (who) => call("acquire", { features: features(model, `tp-${who.wait_id}`), admission: { tenant: "t", ...who } });
  const inFlight = async () => (await poolState(gw, name)).in_flight;

  // 1. Granted at once, but the Worker's client had hung up before the answer came back.
  const quick = await acquire({ wait_id: 1111 });
  assert.equal(quick.status, 200);
  assert.equal(await inFlight(), 1);
  assert.deepEqual(await (await call("dequeue", { ticket: 1111 })).json(), { dequeued: true });
  assert.equal(await inFlight(), 0, "the undelivered grant's lease went back at once");

  // 2. Queued with no answer yet (no ticket) when the client hung up.
  const held = await acquire({ wait_id: 9999 });
  assert.equal(held.status, 200);
  const heldLease = (await held.json()).lease_id;
  const abandoned = acquire({ wait_id: 2222 });
  await waitFor(async () => ((await poolState(gw, name)).queue.length === 1 ? true : null), { intervalMs: 20, what: "one queued" });
  assert.deepEqual(await (await call("dequeue", { ticket: 2222 })).json(), { dequeued: true });
  assert.equal((await poolState(gw, name)).queue.length, 0);

  // 3. The grant is on its way back along an open call when the client hangs up.
  const onItsWay = acquire({ wait_id: 3333 });
  await waitFor(async () => ((await poolState(gw, name)).queue.length === 1 ? true : null), { intervalMs: 20, what: "one queued" });
  assert.deepEqual(await (await call("release", { lease_id: heldLease, outcome: { kind: "success" } })).json(), { released: true });
  const granted = await onItsWay;
  assert.equal(granted.status, 200, "the waiting call got the freed backend");
  assert.equal(await inFlight(), 1);
  // The Worker had dropped that call: its dequeue names the wait and the lease goes back.
  assert.deepEqual(await (await call("dequeue", { ticket: 3333 })).json(), { dequeued: true });
  assert.equal(await inFlight(), 0, "in-flight back to 0 at once, not after lease_ttl_ms");
  // The abandoned call of case 2 answers "still queued" or nothing useful; it holds no lease.
  assert.notEqual((await abandoned).status, 200);
  const s = await poolState(gw, name);
  assert.equal(s.queue.dropped.client_gone, 3, JSON.stringify(s.queue));
});

test("a retry onto a full backend is refused and the lease moves to one with room", async () => {
  const name = "tp-retry";
  await putPool(gw, name, { admission: { enabled: true, poll_ms: 1000 } });
  pools.push(name);
  const model = "tp-model-r";
  for (const i of [0, 1, 2]) await register(gw, name, `tp-retry-${i}`, model, await sim(model));
  const call = await poolObjectCall(gw, name);
  const grants = [];
  for (const i of [0, 1]) {
    const r = await call("acquire", { features: features(model, `tp-r${i}`), admission: { tenant: `t${i}` } });
    assert.equal(r.status, 200);
    grants.push(await r.json());
  }
  const [a, b] = grants;
  assert.notEqual(a.backend, b.backend, "one sequence each: two leases on two backends");
  const free = ["tp-retry-0", "tp-retry-1", "tp-retry-2"].find((id) => id !== a.backend && id !== b.backend);
  // a's backend failed before the first byte; the next candidate is b's, which is full.
  const refused = await call("reassign", { lease_id: a.lease_id, to: b.backend, failure: { kind: "transport" } });
  assert.equal(refused.status, 503, await refused.text());
  const full = await (await gw.admin(`/admin/backends/${b.backend}`)).json();
  assert.equal(full.leases_in_flight, 1, "the full backend was not overfilled");
  // The Worker tries the next candidate: it has room.
  const moved = await call("reassign", { lease_id: a.lease_id, to: free, failure: { kind: "transport" } });
  const movedBody = await moved.text();
  assert.equal(moved.status, 200, movedBody);
  assert.equal(JSON.parse(movedBody).id, free);
  assert.equal((await (await gw.admin(`/admin/backends/${free}`)).json()).leases_in_flight, 1);
  assert.equal((await (await gw.admin(`/admin/backends/${a.backend}`)).json()).leases_in_flight, 0);
  for (const g of grants) await call("release", { lease_id: g.lease_id, outcome: { kind: "success" } });
});

test("a restart while draining: the drain holds until the streams on it renewed and ended, then the pending delete removes it", async () => {
  const dir = tempDir();
  const name = "tp-drain";
  const model = "tp-model-d";
  const bindings = { PROBE_INTERVAL_MS: "60000" };
  let g = null;
  try {
    g = await startGateway({ bindings, persistDir: dir.dir });
    await putPool(g, name, { lease_ttl_ms: 10000 }); // the shortest accepted
    const s = await sim(model, ["--decode-ms-per-step", "20"]);
    await register(g, name, "tp-drain-0", model, s);
    let call = await poolObjectCall(g, name);
    const acquired = await call("acquire", { features: features(model, "tp-stream") });
    assert.equal(acquired.status, 200);
    const lease = await acquired.json();
    assert.equal(lease.backend, "tp-drain-0");
    // The request's stream runs on the backend (about 6 s of tokens).
    const stream = fetch(`${s.url}/v1/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ model, stream: true, max_tokens: 300, ignore_eos: true, messages: [{ role: "user", content: "a long answer" }] }),
    }).then((r) => r.text());
    const del = await g.admin("/admin/backends/tp-drain-0", { method: "DELETE" });
    assert.equal(del.status, 202, "it waits for its drain");

    // A deploy restarts the Durable Object: the lease is gone from its memory.
    await g.close();
    g = await startGateway({ bindings, persistDir: dir.dir });
    call = await poolObjectCall(g, name);
    const probe = async () => assert.equal((await call("probe/now", {})).status, 200);
    const backend = async () => g.admin("/admin/backends/tp-drain-0");
    await probe();
    const kept = await backend();
    assert.equal(kept.status, 200, "the draining backend was removed before its stream could renew");
    const view = await kept.json();
    assert.equal(view.lifecycle, "draining");
    assert.equal(view.delete_pending, true);

    // The Worker renews while the stream runs: the pool counts the lease again.
    const terms = { backend: "tp-drain-0", prompt_tokens: 10, max_tokens: 5, stream: true, request_id: "tp-stream" };
    let renewed = await (await call("renew", { lease_id: lease.lease_id, terms })).json();
    assert.equal(renewed.reestablished, true);
    let done = false;
    const renewing = (async () => {
      while (!done) {
        renewed = await (await call("renew", { lease_id: lease.lease_id, terms })).json();
        await new Promise((r) => setTimeout(r, 500));
      }
    })();
    await probe();
    assert.equal((await backend()).status, 200, "still there while its stream runs");
    const text = await stream;
    done = true;
    await renewing;
    assert.ok(text.includes("[DONE]"), "the stream ran to its end");
    assert.deepEqual(await (await call("release", { lease_id: lease.lease_id, outcome: { kind: "success" } })).json(), { released: true });
    // Once the restart's hold (a lease lifetime) is over, the pending delete completes.
    await waitFor(async () => {
      await probe();
      return (await backend()).status === 404 ? true : null;
    }, { timeoutMs: 20000, intervalMs: 250, what: "the drained backend removed" });
    const after = await poolState(g, name);
    assert.equal(after.in_flight, 0);
    assert.equal(after.queue.length, 0);
    assert.equal(after.backends, 0);
  } finally {
    await g?.close();
    dir.cleanup();
  }
});

test("a restart with admission control on: a new request waits until the stream the pool lost has renewed, then for its slot (issue 42)", async () => {
  const dir = tempDir();
  const name = "tp-restart-admission";
  const model = "tp-model-r";
  const bindings = { PROBE_INTERVAL_MS: "60000" };
  let g = null;
  try {
    g = await startGateway({ bindings, persistDir: dir.dir });
    // The shortest lease accepted: one renewal period is a third of it (3.3 s), plus 1 s.
    await putPool(g, name, { lease_ttl_ms: 10000, admission: { enabled: true, poll_ms: 1000, max_wait_ms: 30000 } });
    const s = await sim(model);
    await register(g, name, "tp-restart-0", model, s);
    let call = await poolObjectCall(g, name);
    // A stream holds the backend's only sequence.
    const acquired = await call("acquire", { features: features(model, "tp-running"), admission: { tenant: "t" } });
    assert.equal(acquired.status, 200);
    const lease = await acquired.json();

    // A deploy restarts the Durable Object: the lease is gone from its memory, the stream is not.
    await g.close();
    g = await startGateway({ bindings, persistDir: dir.dir });
    call = await poolObjectCall(g, name);
    // A client's request right after the restart is not granted on top of the stream: it waits.
    let servedAt = null;
    const asked = g.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ model, max_tokens: 2, ignore_eos: true, messages: [{ role: "user", content: "after the restart" }] }),
    }).then(async (r) => { servedAt = Date.now(); return { status: r.status, body: await r.text() }; });
    await waitFor(async () => ((await poolState(g, name)).queue.length === 1 ? true : null), { timeoutMs: 5000, intervalMs: 50, what: "the request queued" });
    assert.equal((await poolState(g, name)).in_flight, 0, "nothing granted on top of the stream");
    // The stream renews: the pool counts it again, and the request keeps waiting for its slot
    // past the end of the hold.
    const terms = { backend: "tp-restart-0", prompt_tokens: 10, max_tokens: 5, stream: true, request_id: "tp-running" };
    const renewed = await (await call("renew", { lease_id: lease.lease_id, terms })).json();
    assert.equal(renewed.reestablished, true);
    await new Promise((r) => setTimeout(r, 5500));
    assert.equal(servedAt, null, "granted while the stream held the only sequence");
    assert.equal((await poolState(g, name)).queue.length, 1);
    // The stream ends: the request gets the slot.
    const releasedAt = Date.now();
    assert.deepEqual(await (await call("release", { lease_id: lease.lease_id, outcome: { kind: "success" } })).json(), { released: true });
    const answer = await asked;
    assert.equal(answer.status, 200, answer.body);
    assert.ok(servedAt >= releasedAt);
    await drained(g, name);
  } finally {
    await g?.close();
    dir.cleanup();
  }
});
