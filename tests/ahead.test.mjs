// ROUTE_AHEAD (issue 27): the backend fetch sent beside the lease call, to the backend the
// isolate expects its pool shard to choose, and kept only if the shard chose it. The built Worker
// in workerd, real vllm-sim backends on 127.0.0.1. A conversation's next turns are sent ahead to
// the backend holding their history and served by it, with no second request to any backend; a
// fetch sent ahead to a backend the pool no longer chooses (drained meanwhile) is aborted at that
// backend (vLLM's finished_reason="abort") and the answer comes whole from the chosen one; a fetch
// sent ahead of a request the pool queues is aborted when the pool queues it, and the request is
// sent again when its turn comes (the pool counts each case in llm_gateway_pool_sent_ahead_total);
// a key's first request, whose limiter has not answered yet, is not sent ahead; and with SIMULATE_NETWORK
// a request sent ahead waits one modelled round trip where one without waits two (counted, never
// timed).
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitFor, waitReady, drained, parseMetrics, metricValue, setFaults } from "./lib/harness.mjs";

const KEY = "sk-ahead-client-1";
const REGION = "eu-west";
const closers = [];
const drains = [];
let gw;
let sims; // fast (time scale 1000), pool ahead-p
let slowSims; // real time, pool ahead-slow: a request is still running when its abort comes

const BINDINGS = {
  PROBE_INTERVAL_MS: "500",
  ROUTE_AHEAD: "true",
  CLIENT_API_KEYS: KEY,
  RATE_LIMIT_TPM: "10000000",
  RATE_LIMIT_AHEAD: "true",
  ALLOW_REGION_HEADER: "true",
  SIMULATE_NETWORK: "true",
  REGION_RTT_MS: JSON.stringify({ "us-east": { [REGION]: 20 } }),
};

before(async () => {
  gw = await startGateway({ bindings: BINDINGS });
  closers.push(gw);
  sims = [];
  for (let i = 0; i < 2; i++) {
    sims.push(await startSim(["--model", "ahead-model", "--time-scale", "1000", "--seed", String(11 + i)]));
  }
  closers.push(...sims);
  slowSims = [];
  for (let i = 0; i < 2; i++) {
    slowSims.push(await startSim(["--model", "ahead-slow", "--time-scale", "1", "--seed", String(21 + i)]));
  }
  closers.push(...slowSims);
  await addPool("ahead-p", sims, "ahead-model");
  await addPool("ahead-slow", slowSims, "ahead-slow");
  // A gateway of its own with one pool (so a full pool queues rather than spills): one real-time
  // backend with one sequence slot, admission control on.
  queueGw = await startGateway({ bindings: BINDINGS });
  closers.push(queueGw);
  queueSim = await startSim(["--model", "ahead-queue", "--time-scale", "1", "--max-num-seqs", "1", "--seed", "31"]);
  closers.push(queueSim);
  await addPool("ahead-q", [queueSim], "ahead-queue", { admission: { enabled: true, poll_ms: 1000 } }, 1, queueGw);
});

let queueGw;
let queueSim;

async function addPool(name, list, model, settings = {}, seqs = undefined, g = gw) {
  const put = await g.admin(`/admin/pools/${name}`, { method: "PUT", body: { region: REGION, ...settings } });
  assert.equal(put.status, 200, await put.text());
  for (const [i, s] of list.entries()) {
    const reg = await g.admin("/admin/backends", {
      method: "POST",
      body: { url: s.url, pool: name, models: [model], id: `${name}-b${i}`, ...(seqs ? { max_num_seqs: seqs } : {}) },
    });
    assert.equal(reg.status, 201, await reg.text());
    await waitReady(g, `${name}-b${i}`);
  }
  drains.push([g, name]);
}

after(async () => {
  for (const c of closers.reverse()) await c.close();
});

afterEach(async () => {
  for (const [g, name] of drains) await drained(g, name);
});

// Requests each sim has seen end, by how they ended.
async function finished(sim) {
  const text = await (await fetch(`${sim.url}/metrics`)).text();
  const out = {};
  for (const s of parseMetrics(text).filter((s) => s.name === "vllm:request_success_total")) {
    out[s.labels.finished_reason] = s.value;
  }
  return out;
}

// Requests running or waiting in a sim's engine.
async function engineBusy(sim) {
  const samples = parseMetrics(await (await fetch(`${sim.url}/metrics`)).text());
  return samples
    .filter((s) => s.name === "vllm:num_requests_running" || s.name === "vllm:num_requests_waiting")
    .reduce((n, s) => n + s.value, 0);
}

async function totals() {
  const all = await Promise.all(sims.map(finished));
  return all.map((f) => ({ done: (f.stop ?? 0) + (f.length ?? 0), abort: f.abort ?? 0 }));
}

const history = (turns) =>
  Array.from({ length: turns }, (_, i) => [
    { role: "user", content: `Turn ${i}: tell me about the harbour at dusk, the boats and the lights, in detail please.` },
    { role: "assistant", content: `The harbour at dusk, turn ${i}: boats, lanterns and the slow water under them.` },
  ]).flat();

async function chat(messages, headers = {}, model = "ahead-model", maxTokens = 8, g = gw) {
  const r = await g.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${KEY}`, ...headers },
    body: JSON.stringify({ model, messages, max_tokens: maxTokens, stream: true, ignore_eos: true }),
  });
  const text = await r.text();
  assert.equal(r.status, 200, text);
  assert.match(text, /data: \[DONE\]/, "a whole stream");
  return { r, text };
}

test("a conversation's next turns are sent ahead to the backend holding its history, and served by it alone", async () => {
  const before = await totals();
  const seen = [];
  for (let turn = 1; turn <= 6; turn++) {
    const { r } = await chat([...history(turn), { role: "user", content: "And then?" }]);
    seen.push({ ahead: r.headers.get("x-gateway-ahead"), backend: r.headers.get("x-gateway-backend") });
  }
  // The key's first request waits for its limiter (RATE_LIMIT_AHEAD has no answer yet): not sent ahead.
  assert.equal(seen[0].ahead, null, JSON.stringify(seen));
  const kept = seen.filter((s) => s.ahead === "kept");
  assert.ok(kept.length >= 4, `most turns sent ahead and kept: ${JSON.stringify(seen)}`);
  const missed = seen.filter((s) => s.ahead === "missed").length;
  // Each request reached a backend once, plus one aborted fetch per miss: nothing else.
  await waitFor(async () => {
    const after = await totals();
    const done = after.reduce((n, t, i) => n + t.done - before[i].done, 0);
    const aborted = after.reduce((n, t, i) => n + t.abort - before[i].abort, 0);
    return done === seen.length && aborted === missed;
  }, { what: "one finished request per answer, one abort per miss" });
});

test("a fetch sent ahead to a backend the pool no longer chooses is aborted there, and the answer comes from the chosen one", async () => {
  const messages = [...history(3), { role: "user", content: "Something else now, about rivers." }];
  const slow = (m) => chat(m, {}, "ahead-slow");
  const first = await slow(messages);
  const held = first.r.headers.get("x-gateway-backend");
  const other = held === "ahead-slow-b0" ? "ahead-slow-b1" : "ahead-slow-b0";
  const heldSim = slowSims[Number(held.at(-1))];
  const before = await finished(heldSim);
  // Out of rotation by its probes (no admin call, so no isolate was told): the pool stops
  // choosing it while the isolate still guesses it.
  await setFaults(heldSim, { health_fail: true });
  await waitFor(async () => (await (await gw.admin(`/admin/backends/${held}`)).json()).health !== "healthy", { what: `${held} out of rotation` });
  try {
    const next = await slow([...messages, { role: "assistant", content: "Rivers run." }, { role: "user", content: "More." }]);
    assert.equal(next.r.headers.get("x-gateway-ahead"), "missed");
    assert.equal(next.r.headers.get("x-gateway-backend"), other, "served where the pool chose");
    // The failing backend ran nothing to its end: the fetch sent there was aborted (counted as
    // vLLM's finished_reason="abort" when the abort found it in the engine; a fetch aborted before
    // the backend read it never reaches the engine at all).
    await waitFor(async () => (await engineBusy(heldSim)) === 0, { what: "the failing backend idle" });
    const after = await finished(heldSim);
    assert.equal(after.stop ?? 0, before.stop ?? 0, "nothing answered there");
    assert.equal(after.length ?? 0, before.length ?? 0, "nothing answered there");
    assert.ok((after.abort ?? 0) - (before.abort ?? 0) <= 1, "at most the one fetch sent ahead aborted");
    // The isolate no longer guesses the backend it missed on: the next turn goes ahead to the other.
    const third = await slow([...messages, { role: "user", content: "Yet more." }]);
    assert.equal(third.r.headers.get("x-gateway-ahead"), "kept");
    assert.equal(third.r.headers.get("x-gateway-backend"), other);
  } finally {
    await setFaults(heldSim, {});
    await waitReady(gw, held);
  }
});

test("a force-deleted backend gets nothing sent ahead from the moment of its deletion (issue 42, item 11)", async () => {
  const delSims = [];
  for (let i = 0; i < 2; i++) {
    delSims.push(await startSim(["--model", "ahead-del", "--time-scale", "1000", "--seed", String(41 + i)]));
  }
  closers.push(...delSims);
  await addPool("ahead-del", delSims, "ahead-del");
  const messages = [...history(3), { role: "user", content: "Now about the mountains." }];
  const turn = (extra) => chat([...messages, ...extra], {}, "ahead-del");
  // Turns until the isolate sends ahead to the backend holding the conversation.
  let last;
  await waitFor(async () => {
    last = await turn([{ role: "assistant", content: "Mountains." }, { role: "user", content: `More ${Math.random()}` }]);
    return last.r.headers.get("x-gateway-ahead") === "kept";
  }, { timeoutMs: 20000, intervalMs: 50, what: "a turn sent ahead and kept" });
  const held = last.r.headers.get("x-gateway-backend");
  const heldSim = delSims[Number(held.at(-1))];
  const before = await finished(heldSim);
  const gone = await gw.admin(`/admin/backends/${held}?force=true`, { method: "DELETE" });
  assert.equal(gone.status, 200, await gone.text());
  // The next turn, at once: nothing goes ahead to the deleted backend (before, its guess was
  // still fresh: the whole prompt went there and was aborted, "missed").
  const next = await turn([{ role: "assistant", content: "Mountains." }, { role: "user", content: "And the valleys?" }]);
  assert.notEqual(next.r.headers.get("x-gateway-ahead"), "missed", "a fetch went ahead to the deleted backend");
  assert.notEqual(next.r.headers.get("x-gateway-backend"), held);
  const after = await finished(heldSim);
  assert.deepEqual(after, before, "the deleted backend saw a request");
});

test("a fetch sent ahead with a backend's old key is not kept: the request is sent again as the grant says", async () => {
  const messages = [
    { role: "user", content: "Key test: tell me about the lighthouse keeper's logbook, entry by entry." },
    { role: "assistant", content: "Entry one: fog. Entry two: more fog, and a ship's bell far off." },
  ];
  const first = await chat([...messages, { role: "user", content: "Go on." }]);
  const held = first.r.headers.get("x-gateway-backend");
  const next = await chat([...messages, { role: "user", content: "And then?" }]);
  assert.equal(next.r.headers.get("x-gateway-ahead"), "kept", "the isolate knows the backend");
  assert.equal(next.r.headers.get("x-gateway-backend"), held);
  // The operator rotates the backend's key: the isolate's view of it is now stale.
  const patch = await gw.admin(`/admin/backends/${held}`, { method: "PATCH", body: { api_key: "sk-rotated-ahead-1" } });
  assert.equal(patch.status, 200, await patch.text());
  const after = await chat([...messages, { role: "user", content: "After the rotation?" }]);
  assert.equal(after.r.headers.get("x-gateway-backend"), held, "the pool still chooses it");
  assert.equal(after.r.headers.get("x-gateway-ahead"), "missed", "sent with the old key: not kept");
  const again = await chat([...messages, { role: "user", content: "Once more." }]);
  assert.equal(again.r.headers.get("x-gateway-ahead"), "kept", "learned with the new key");
});

test("a fetch sent ahead of a request the pool queues is aborted when it is queued, and the request is sent again at its turn", async () => {
  const model = "ahead-queue";
  // Its own conversation: one that shares another test's history has its home in that pool.
  const messages = [
    { role: "user", content: "Queue test: describe a railway station at noon, the trains and the clocks." },
    { role: "assistant", content: "At noon the station hums: trains in, trains out, every clock agreeing." },
    { role: "user", content: "A queue, please." },
  ];
  // Teach the isolate the backend (the key's first request may wait for its limiter).
  await chat(messages, {}, model, 8, queueGw);
  await chat([...messages, { role: "user", content: "Again." }], {}, model, 8, queueGw);
  const before = await finished(queueSim);
  // The backend refuses a request id it still holds, as vLLM before PR #27987 does while an
  // aborted request's abort has not reached its engine: the request sent again at its turn must
  // not carry the id of the fetch that was sent ahead and aborted.
  await setFaults(queueSim, { request_id_linger_ms: 60000 });
  // One long answer holds the backend's only slot; the next request is sent ahead and queued.
  const long = chat([...messages, { role: "user", content: "A long one." }], {}, model, 60, queueGw);
  await waitFor(async () => (await engineBusy(queueSim)) === 1, { what: "the long answer running" });
  const queued = await chat([...messages, { role: "user", content: "Queued." }], {}, model, 8, queueGw);
  const held = await long;
  assert.equal(held.r.headers.get("x-gateway-ahead"), "kept");
  assert.equal(queued.r.headers.get("x-gateway-ahead"), "queued");
  assert.ok(Number(queued.r.headers.get("x-gateway-queue-wait-ms")) > 0, "it waited in the pool's queue");
  await waitFor(async () => (await engineBusy(queueSim)) === 0, { what: "the backend idle" });
  const after = await finished(queueSim);
  // Two answers, and at most the one fetch sent ahead aborted (none when the abort came before the
  // backend read it).
  assert.equal((after.length ?? 0) + (after.stop ?? 0) - (before.length ?? 0) - (before.stop ?? 0), 2);
  assert.ok((after.abort ?? 0) - (before.abort ?? 0) <= 1);
  // The pool counted the queued request's fetch as not granted, and the others as kept.
  const m = parseMetrics(await (await queueGw.admin("/metrics")).text());
  assert.equal(metricValue(m, "llm_gateway_pool_sent_ahead_total", { pool: "ahead-q", result: "not_granted" }), 1);
  assert.ok(metricValue(m, "llm_gateway_pool_sent_ahead_total", { pool: "ahead-q", result: "kept" }) >= 2);
  await setFaults(queueSim, {});
});

test("with SIMULATE_NETWORK a request sent ahead waits one modelled round trip, not two", async () => {
  const messages = [...history(2), { role: "user", content: "Tell me about lighthouses, from far away." }];
  const far = { "x-gateway-region": "us-east" };
  const first = await chat(messages, far);
  const second = await chat([...messages, { role: "user", content: "And their keepers?" }], far);
  const waits = (r) => r.headers.get("x-gateway-simulated-waits");
  // The first of a new prefix may go ahead on the last cold grant's backend; either way the
  // count says whether the fetch waited after the lease call.
  assert.equal(waits(first.r), first.r.headers.get("x-gateway-ahead") === "kept" ? "1" : "2");
  assert.equal(second.r.headers.get("x-gateway-ahead"), "kept");
  assert.equal(waits(second.r), "1", "the lease call and the fetch overlapped");
});
