// Coordinator shards in workerd against real vllm-sim processes on 127.0.0.1: a pool with
// `shards: 4` keeps a conversation on one shard and one backend across turns while different keys
// spread over shards; after a burst every shard's leases and counters are back to zero and the
// admin API and /metrics add the shards up; changing `shards` on a live pool drains over safely;
// and restarting the gateway (every shard's object; Miniflare cannot restart a single Durable
// Object) keeps each shard's backends, settings and health.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import {
  startGateway, startSim, waitFor, waitReady, onlyPool, parseMetrics, tempDir,
} from "./lib/harness.mjs";

const MODEL = "shard-model";

let gw;
let state;
const sims = [];

before(async () => {
  state = tempDir();
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500" }, persistDir: state.dir });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
  state?.cleanup();
});

/** Deterministic filler of about `tokens` tokens. */
const words = (seed, tokens) => Array.from({ length: tokens }, (_, i) => `w${(seed * 7919 + i * 31) % 9973}`).join(" ");

async function chat(messages, { session, stream = false, max_tokens = 4, slow = false } = {}) {
  const headers = { "content-type": "application/json" };
  if (session) headers["x-session-id"] = session;
  const r = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers,
    body: JSON.stringify({ model: MODEL, messages, stream, ...(slow ? { max_tokens: 300, ignore_eos: true } : { max_tokens }) }),
  });
  const text = await r.text();
  return { status: r.status, shard: r.headers.get("x-gateway-shard"), backend: r.headers.get("x-gateway-backend"), text };
}

/** A pool of `n` sims with `settings`, its backends ready (`timeScale` 1: about 10 ms a token). */
async function pool(name, n, settings, { timeScale = 20 } = {}) {
  const r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: settings });
  assert.equal(r.status, 200, await r.text());
  const ids = [];
  for (let i = 0; i < n; i++) {
    const sim = await startSim(["--model", MODEL, "--seed", String(i + 1), "--time-scale", String(timeScale)]);
    sims.push(sim);
    const id = `${name}-b${i}`;
    const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: name, models: [MODEL], id } });
    assert.equal(reg.status, 201, await reg.text());
    ids.push(id);
  }
  for (const id of ids) await waitReady(gw, id);
  await onlyPool(gw, name);
  return ids;
}

/** Waits until requests on `keys` distinct sessions all succeed (every shard has had its probe round). */
async function everyShardServes(keys = 16) {
  await waitFor(async () => {
    for (let k = 0; k < keys; k++) {
      const r = await chat([{ role: "user", content: `warm ${k}` }], { session: `warm-${k}` });
      if (r.status !== 200) return null;
    }
    return true;
  }, { timeoutMs: 15000, what: "every shard serving" });
}

async function summary(name) {
  return (await gw.admin(`/admin/pools/${name}`)).json();
}

async function backendsOf(name) {
  const list = await (await gw.admin("/admin/backends")).json();
  return list.data.filter((b) => b.pool === name);
}

async function metricSum(name, pool) {
  const samples = parseMetrics(await (await gw.admin("/metrics")).text());
  return samples.filter((s) => s.name === name && s.labels.pool === pool).reduce((a, s) => a + s.value, 0);
}

async function waitIdle(name) {
  return waitFor(async () => {
    const s = await summary(name);
    const busy = (await backendsOf(name)).some((b) => b.leases_in_flight !== 0);
    return s.in_flight === 0 && s.in_flight_tokens === 0 && !busy ? s : null;
  }, { timeoutMs: 15000, what: `pool ${name} back to zero` });
}

test("shards are validated with OpenAI-style errors", async () => {
  for (const body of [{ shards: 0 }, { shards: 65 }, { shards: 2, shard_exchange_ms: 10 }, { shard_exchange_ms: 5000 }]) {
    const r = await gw.admin("/admin/pools/bad", { method: "PUT", body });
    assert.equal(r.status, 400, JSON.stringify(body));
    const e = await r.json();
    assert.match(e.error.message, /shard/, JSON.stringify(e));
    assert.equal(e.error.type, "invalid_request_error");
  }
});

test("shards: 4 keeps a conversation on one shard and one backend, and spreads keys over shards", async () => {
  await pool("sh", 3, { shards: 4, shard_exchange_ms: 100 });
  const detail = await summary("sh");
  assert.equal(detail.config.shards, 4);
  await everyShardServes();
  const shards = new Set();
  for (let c = 0; c < 8; c++) {
    const session = `conversation-${c}`;
    const messages = [{ role: "system", content: `conversation ${c}: ${words(c, 300)}` }];
    let home = null;
    for (let turn = 0; turn < 4; turn++) {
      messages.push({ role: "user", content: `turn ${turn}: ${words(c * 100 + turn, 40)}` });
      const r = await chat(messages, { session });
      assert.equal(r.status, 200, r.text);
      home ??= { shard: r.shard, backend: r.backend };
      assert.equal(r.shard, home.shard, `conversation ${c} turn ${turn} changed shard`);
      assert.equal(r.backend, home.backend, `conversation ${c} turn ${turn} changed backend`);
      messages.push({ role: "assistant", content: JSON.parse(r.text).choices[0].message.content });
    }
    shards.add(home.shard);
  }
  assert.ok(shards.size > 1, `every conversation went to shard ${[...shards]}`);
  for (const s of shards) assert.ok(Number(s) >= 0 && Number(s) < 4, `shard ${s}`);
  await waitIdle("sh");
});

test("after a burst every shard's leases and counters are back to zero, and the admin API and /metrics add shards up", async () => {
  const before = await metricSum("llm_gateway_requests_total", "sh");
  const burst = 32;
  const shards = new Set();
  const results = await Promise.all(Array.from({ length: burst }, (_, i) =>
    chat([{ role: "user", content: `burst ${i}: ${words(i, 60)}` }], { session: `burst-${i}`, stream: i % 2 === 0, max_tokens: 16 })));
  for (const r of results) {
    assert.equal(r.status, 200, r.text);
    shards.add(r.shard);
  }
  assert.ok(shards.size > 1, `the burst used shards ${[...shards]}`);
  await waitIdle("sh");
  // Requests counted on every shard add up in /metrics: none is missing from the sum.
  await waitFor(async () => (await metricSum("llm_gateway_requests_total", "sh")) - before === burst ? true : null,
    { timeoutMs: 5000, what: "every request counted" });
  assert.equal(await metricSum("llm_gateway_leases_in_flight", "sh"), 0);
  assert.equal(await metricSum("llm_gateway_inflight_tokens", "sh"), 0);
  // Health is shard 0's, once per backend.
  const healthy = parseMetrics(await (await gw.admin("/metrics")).text())
    .filter((s) => s.name === "llm_gateway_backend_healthy" && s.labels.pool === "sh");
  assert.equal(healthy.length, 3);
  assert.ok(healthy.every((s) => s.value === 1), JSON.stringify(healthy));
  const listed = await (await gw.admin("/admin/pools")).json();
  const sh = listed.data.find((p) => p.pool === "sh");
  assert.equal(sh.in_flight, 0);
  assert.equal(sh.backends, 3);
});

test("in-flight figures are summed over shards while requests run", async () => {
  // Slow streams on many sessions: several shards hold leases at once, and the summary shows all.
  await pool("slow", 2, { shards: 4, shard_exchange_ms: 100 }, { timeScale: 1 });
  await everyShardServes();
  const n = 12;
  const running = Array.from({ length: n }, (_, i) =>
    chat([{ role: "user", content: `slow ${i}` }], { session: `slow-${i}`, stream: true, slow: true }));
  const seen = await waitFor(async () => {
    const s = await summary("slow");
    return s.in_flight === n ? s : null;
  }, { timeoutMs: 10000, intervalMs: 50, what: `all ${n} requests in flight in the summary` });
  assert.equal(seen.in_flight, n);
  const listed = (await backendsOf("slow")).reduce((a, b) => a + b.leases_in_flight, 0);
  assert.equal(listed, n);
  assert.equal(await metricSum("llm_gateway_leases_in_flight", "slow"), n);
  const results = await Promise.all(running);
  assert.ok(results.every((r) => r.status === 200));
  assert.ok(new Set(results.map((r) => r.shard)).size > 1);
  await waitIdle("slow");
});

test("a shard's load reaches its siblings: shard 0 counts requests only other shards hold", async () => {
  // Sessions that belong to shards other than 0 (the shard is a fixed function of the key).
  const elsewhere = [];
  for (let i = 0; elsewhere.length < 6 && i < 64; i++) {
    const r = await chat([{ role: "user", content: "where" }], { session: `steer-${i}` });
    assert.equal(r.status, 200, r.text);
    if (r.shard !== "0") elsewhere.push(`steer-${i}`);
  }
  assert.equal(elsewhere.length, 6);
  await waitIdle("slow");
  const running = elsewhere.map((session, i) =>
    chat([{ role: "user", content: `held ${i}` }], { session, stream: true, slow: true }));
  // Shard 0 holds none of these leases, yet its view of the backends' load (the listing shows
  // shard 0's `load`) rises: its siblings pushed their load reports to it.
  await waitFor(async () => {
    const list = await backendsOf("slow");
    const leases = list.reduce((a, b) => a + b.leases_in_flight, 0);
    return leases === elsewhere.length && list.some((b) => b.load > 0) ? true : null;
  }, { timeoutMs: 10000, intervalMs: 50, what: "shard 0 to see its siblings' load" });
  const results = await Promise.all(running);
  assert.ok(results.every((r) => r.status === 200 && r.shard !== "0"));
  // When the requests end, a trailing report brings shard 0's view back to zero.
  await waitFor(async () => ((await backendsOf("slow")).every((b) => b.load === 0) ? true : null),
    { timeoutMs: 10000, what: "the siblings' last report to reach shard 0" });
});

test("changing shards on a live pool drains over: leases release to the shard that granted them", async () => {
  const n = 12;
  const running = Array.from({ length: n }, (_, i) =>
    chat([{ role: "user", content: `move ${i}` }], { session: `move-${i}`, stream: true, slow: true }));
  await waitFor(async () => ((await summary("slow")).in_flight === n ? true : null),
    { timeoutMs: 10000, intervalMs: 50, what: "requests in flight" });
  const r = await gw.admin("/admin/pools/slow", { method: "PUT", body: { shards: 2, shard_exchange_ms: 100 } });
  assert.equal(r.status, 200, await r.text());
  // Requests started before the change still count (on the shards retired since, too).
  assert.equal((await summary("slow")).in_flight, n);
  const results = await Promise.all(running);
  assert.ok(results.every((x) => x.status === 200));
  assert.ok(results.some((x) => Number(x.shard) >= 2), "no request ran on a shard the change retired");
  await waitIdle("slow");
  // New requests go to the two remaining shards only.
  for (let i = 0; i < 12; i++) {
    const x = await chat([{ role: "user", content: `after ${i}` }], { session: `after-${i}` });
    assert.equal(x.status, 200, x.text);
    assert.ok(["0", "1"].includes(x.shard), `shard ${x.shard}`);
  }
  // Back to 4: the shards retired a moment ago serve again, with every backend.
  const again = await gw.admin("/admin/pools/slow", { method: "PUT", body: { shards: 4, shard_exchange_ms: 100 } });
  assert.equal(again.status, 200, await again.text());
  await everyShardServes();
  await waitIdle("slow");
});

test("a pool that gains shards later gives every new shard its backends", async () => {
  await pool("grow", 2, {});
  const one = await chat([{ role: "user", content: "before" }], { session: "grow-0" });
  assert.equal(one.status, 200, one.text);
  assert.equal(one.shard, "0");
  const r = await gw.admin("/admin/pools/grow", { method: "PUT", body: { shards: 3 } });
  assert.equal(r.status, 200, await r.text());
  await everyShardServes();
  const shards = new Set();
  for (let i = 0; i < 12; i++) {
    const x = await chat([{ role: "user", content: `grown ${i}` }], { session: `grown-${i}` });
    assert.equal(x.status, 200, x.text);
    shards.add(x.shard);
  }
  assert.ok(shards.size > 1, `shards ${[...shards]}`);
  await waitIdle("grow");
});

test("restarting the shards' objects keeps each shard's backends, settings and health", async () => {
  const session = "conversation-restart";
  const first = await chat([{ role: "user", content: "before the restart" }], { session });
  assert.equal(first.status, 200, first.text);
  await waitIdle("grow");
  await gw.close();
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500" }, persistDir: state.dir });
  const detail = await summary("grow");
  assert.equal(detail.config.shards, 3);
  assert.equal(detail.backends, 2);
  // Each shard restored its registry and health from its own storage: requests on every shard
  // are served (within a probe round or two, as the health snapshots and probes allow).
  await everyShardServes();
  const again = await chat([{ role: "user", content: "after the restart" }], { session });
  assert.equal(again.status, 200, again.text);
  assert.equal(again.shard, first.shard, "a key keeps its shard across restarts");
  await waitIdle("grow");
});
