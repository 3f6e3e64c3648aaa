// What the operator surfaces do when one coordinator shard of a pool fails a call (issue 42, still
// open from the last round), in workerd against real vllm-sim processes. The shard's failure is
// made by tests/lib/object-faults.mjs, which wraps the built pool coordinator's call surfaces and
// throws, as a Durable Object that is overloaded or being reset does; nothing in the Worker knows.
// - `/metrics` never shows a counter lower than before because a shard did not answer: the pool's
//   counters are left out of that scrape and `llm_gateway_metrics_shards_missing` says so.
// - An admin change goes to every shard even when one fails, answers 502 `shards_incomplete`
//   naming the failed shard, and the same call repeated completes it (registration, settings,
//   delete).
// - `/v1/models` is kept a few seconds in the isolate instead of asking every pool each time, and
//   an admin change forgets it at once.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import {
  startGateway, startSim, waitFor, waitReady, onlyPool, parseMetrics, setObjectFaults, errorBody,
} from "./lib/harness.mjs";

const MODEL = "fault-model";

let gw;
const sims = [];

before(async () => {
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500" }, objectFaults: true });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

async function sim(seed) {
  const s = await startSim(["--model", MODEL, "--seed", String(seed), "--time-scale", "20"]);
  sims.push(s);
  return s;
}

async function chat(session) {
  const r = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", "x-session-id": session },
    body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content: `hello ${session}` }], max_tokens: 4 }),
  });
  await r.text();
  return { status: r.status, shard: r.headers.get("x-gateway-shard") };
}

/** The backends shard `k` of `pool` holds, asked of its object directly. */
async function shardBackends(pool, k) {
  const ns = await gw.mf.getDurableObjectNamespace("POOL");
  const stub = ns.get(ns.idFromName(k === 0 ? pool : `${pool}#${k}`));
  const r = await stub.fetch("https://do.internal/backends", { headers: { "x-gateway-pool": pool, "x-gateway-shard": String(k) } });
  assert.equal(r.status, 200, await r.clone().text());
  return (await r.json()).data.map((b) => b.id);
}

async function scrape() {
  const r = await gw.admin("/metrics");
  assert.equal(r.status, 200);
  return parseMetrics(await r.text());
}

const of = (samples, name, pool) => samples.filter((s) => s.name === name && s.labels.pool === pool);

test("a scrape that misses a shard leaves the pool's counters out and marks the gap, never lowers them", async () => {
  const put = await gw.admin("/admin/pools/mx", { method: "PUT", body: { shards: 2, shard_exchange_ms: 100 } });
  assert.equal(put.status, 200, await put.text());
  const s = await sim(1);
  const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: "mx", models: [MODEL], id: "mx-b0" } });
  assert.equal(reg.status, 201, await reg.text());
  await waitReady(gw, "mx-b0");
  await onlyPool(gw, "mx");
  // Requests on both shards.
  const served = new Set();
  await waitFor(async () => {
    for (let i = 0; i < 16; i++) {
      const r = await chat(`mx-${served.size}-${i}-${Date.now()}`);
      if (r.status === 200) served.add(r.shard);
    }
    return served.has("0") && served.has("1");
  }, { timeoutMs: 20000, what: "requests served on shards 0 and 1" });

  const full = await scrape();
  const requests = of(full, "llm_gateway_requests_total", "mx");
  assert.ok(requests.length > 0 && requests.some((x) => x.value > 0), JSON.stringify(requests));

  await setObjectFaults(gw, [{ pool: "mx", shard: 1, route: "/metrics" }]);
  const partial = await scrape();
  // Every counter series is either left out or at least what it was: none went backwards.
  for (const x of full.filter((x) => x.labels.pool === "mx" && /_total$|_count$|_sum$|_bucket$/.test(x.name))) {
    const now = partial.find((y) => y.name === x.name && JSON.stringify(y.labels) === JSON.stringify(x.labels));
    assert.ok(now === undefined || now.value >= x.value, `${x.name}${JSON.stringify(x.labels)} went from ${x.value} to ${now?.value}`);
  }
  assert.equal(of(partial, "llm_gateway_requests_total", "mx").length, 0, "the pool's counters are left out");
  assert.deepEqual(of(full, "llm_gateway_metrics_shards_missing", "mx").map((x) => x.value), [0]);
  assert.deepEqual(of(partial, "llm_gateway_metrics_shards_missing", "mx").map((x) => x.value), [1]);
  // The state gauges of the shard that answered are still there.
  assert.equal(of(partial, "llm_gateway_backend_healthy", "mx").length, 1);

  // A pool whose only shard fails still shows up, as missing.
  await setObjectFaults(gw, [{ pool: "mx", route: "/metrics" }]);
  const none = await scrape();
  assert.deepEqual(of(none, "llm_gateway_metrics_shards_missing", "mx").map((x) => x.value), [2]);

  await setObjectFaults(gw, []);
  const back = await scrape();
  assert.deepEqual(of(back, "llm_gateway_metrics_shards_missing", "mx").map((x) => x.value), [0]);
  const total = (xs) => xs.reduce((a, x) => a + x.value, 0);
  assert.ok(total(of(back, "llm_gateway_requests_total", "mx")) >= total(requests));
});

test("an admin change reaches every shard though one fails, names the failed shard, and completes when repeated", async () => {
  const put = await gw.admin("/admin/pools/ad", { method: "PUT", body: { shards: 3, shard_exchange_ms: 100 } });
  assert.equal(put.status, 200, await put.text());
  const s = await sim(2);
  const body = { url: s.url, pool: "ad", models: [MODEL], id: "ad-b0" };

  // Registration: shard 2 fails once (shards go 1, 2, then 0).
  await setObjectFaults(gw, [{ pool: "ad", shard: 2, method: "POST", route: "/backends", times: 1 }]);
  const first = await gw.admin("/admin/backends", { method: "POST", body });
  assert.equal(first.status, 502, await first.clone().text());
  const e = await errorBody(first);
  assert.equal(e.code, "shards_incomplete");
  assert.match(e.message, /failed on shards \[2\]/);
  assert.match(e.message, /done on shards \[0, 1\]/);
  // The other shards got it: the fan-out did not stop at the failure.
  assert.deepEqual(await shardBackends("ad", 1), ["ad-b0"]);
  assert.deepEqual(await shardBackends("ad", 0), ["ad-b0"]);
  assert.deepEqual(await shardBackends("ad", 2), []);
  // The same call again completes it.
  const again = await gw.admin("/admin/backends", { method: "POST", body });
  assert.equal(again.status, 201, await again.text());
  for (const k of [0, 1, 2]) assert.deepEqual(await shardBackends("ad", k), ["ad-b0"], `shard ${k}`);
  // Once every shard holds it, registering it again is the conflict it always was.
  const dup = await gw.admin("/admin/backends", { method: "POST", body });
  assert.equal(dup.status, 409);
  await waitReady(gw, "ad-b0");

  // Settings: shard 1 fails once; the others take the change; repeated, every shard has it.
  await setObjectFaults(gw, [{ pool: "ad", shard: 1, method: "PUT", route: "/config", times: 1 }]);
  const change = await gw.admin("/admin/pools/ad", { method: "PUT", body: { shard_exchange_ms: 250 } });
  assert.equal(change.status, 502);
  assert.match((await errorBody(change)).message, /failed on shards \[1\]/);
  const redo = await gw.admin("/admin/pools/ad", { method: "PUT", body: { shard_exchange_ms: 250 } });
  assert.equal(redo.status, 200, await redo.text());
  assert.equal((await (await gw.admin("/admin/pools/ad")).json()).config.shard_exchange_ms, 250);

  // Delete: shard 2 fails once; repeated, every shard has let the backend go.
  await setObjectFaults(gw, [{ pool: "ad", shard: 2, method: "DELETE", route: "/backends/", times: 1 }]);
  const del = await gw.admin("/admin/backends/ad-b0?force=true&pool=ad", { method: "DELETE" });
  assert.equal(del.status, 502, await del.clone().text());
  assert.match((await errorBody(del)).message, /failed on shards \[2\]/);
  assert.deepEqual(await shardBackends("ad", 2), ["ad-b0"]);
  const del2 = await gw.admin("/admin/backends/ad-b0?force=true&pool=ad", { method: "DELETE" });
  assert.equal(del2.status, 200, await del2.text());
  for (const k of [0, 1, 2]) assert.deepEqual(await shardBackends("ad", k), [], `shard ${k}`);
  await setObjectFaults(gw, []);
});

test("/v1/models asks the pools once per few seconds, and an admin change shows at once", async () => {
  const a = await startSim(["--model", "list-a", "--seed", "3"]);
  const b = await startSim(["--model", "list-b", "--seed", "4"]);
  sims.push(a, b);
  for (const [pool, s, model] of [["la", a, "list-a"], ["lb", b, "list-b"]]) {
    const r = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool, models: [model], id: `${pool}-b0` } });
    assert.equal(r.status, 201, await r.text());
  }
  await waitReady(gw, "la-b0");
  await waitReady(gw, "lb-b0");
  const ids = async () => (await (await gw.fetch("/v1/models")).json()).data.map((m) => m.id);
  await setObjectFaults(gw, [{ mode: "count", method: "GET", route: "/models" }]);
  const hits = async () => (await (await gw.fetch("/__object-faults")).json())[0].hits;
  const first = await ids();
  assert.ok(first.includes("list-a") && first.includes("list-b"), JSON.stringify(first));
  const pools = await hits();
  assert.ok(pools >= 2, `the first listing asked ${pools} pools`);
  for (let i = 0; i < 5; i++) assert.deepEqual(await ids(), first);
  assert.equal(await hits(), pools, "the listings within the cache's life asked no pool again");
  // A change through the admin API shows at once.
  const patch = await gw.admin("/admin/backends/lb-b0", { method: "PATCH", body: { drain: true } });
  assert.equal(patch.status, 200, await patch.text());
  assert.ok(!(await ids()).includes("list-b"), "a drained backend's model is gone from the next listing");
  // And the list is asked again once it is a few seconds old.
  const before = await hits();
  await new Promise((r) => setTimeout(r, 3500));
  await ids();
  assert.ok((await hits()) > before, "the pools were asked again after the cache's life");
  await setObjectFaults(gw, []);
});
