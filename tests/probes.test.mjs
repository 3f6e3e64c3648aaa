// Probes, regions, drain and the autoscaling signal, in workerd against real vllm-sim processes:
// the gateway learns by itself which backends can take work (health, loading, models, queues),
// sends clients to their nearest pool and spills when it cannot serve, and lets a draining
// backend finish its streams before it is removed.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitFor, waitReady } from "./lib/harness.mjs";

let gw;
const sims = [];
let n = 0;

before(async () => {
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "300", ALLOW_REGION_HEADER: "true" } });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

async function sim(args = [], opts) {
  const s = await startSim(["--time-scale", "50", "--seed", String(++n), ...args], opts);
  sims.push(s);
  return s;
}

async function register(s, body) {
  const r = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, ...body } });
  const text = await r.text();
  assert.equal(r.status, 201, text);
  return JSON.parse(text).id;
}

async function backend(id) {
  return (await gw.admin(`/admin/backends/${id}`)).json();
}

async function ask(model, { region, stream = false, max_tokens = 4, content = "hello" } = {}) {
  const headers = { "content-type": "application/json" };
  if (region) headers["x-gateway-region"] = region;
  const r = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers,
    body: JSON.stringify({ model, stream, max_tokens, messages: [{ role: "user", content }] }),
  });
  return { status: r.status, backend: r.headers.get("x-gateway-backend"), pool: r.headers.get("x-gateway-pool"), text: await r.text() };
}

test("a backend whose /health fails is taken out by probes and returns when it recovers", async () => {
  const rr = await gw.admin("/admin/pools/health", { method: "PUT", body: { policy: "round_robin" } });
  assert.equal(rr.status, 200);
  const [a, b] = [await sim(["--model", "m-health"]), await sim(["--model", "m-health"])];
  const ida = await register(a, { pool: "health", models: ["m-health"], id: "h-a" });
  const idb = await register(b, { pool: "health", models: ["m-health"], id: "h-b" });
  await waitReady(gw, ida);
  await waitReady(gw, idb);
  await fetch(`${a.url}/sim/faults`, { method: "POST", body: JSON.stringify({ health_fail: true }) });
  // vllm-sim answers 503 there: not serving, whether the core files it as loading or unhealthy.
  await waitFor(async () => (await backend(ida)).health !== "healthy", { what: "h-a out of rotation" });
  for (let i = 0; i < 4; i++) assert.equal((await ask("m-health")).backend, idb);
  await fetch(`${a.url}/sim/faults`, { method: "POST", body: "{}" });
  await waitReady(gw, ida);
  const seen = new Set();
  for (let i = 0; i < 6; i++) seen.add((await ask("m-health", { content: `q${i}` })).backend);
  assert.ok(seen.has(ida), "the recovered backend gets traffic again");
});

test("a loading backend gets no traffic until it is ready", async () => {
  // vLLM 0.34 (and vllm-sim by default) refuses connections while loading: a backend that has
  // never been healthy and cannot be reached is reported loading, not down.
  const s = await sim(["--model", "m-load", "--startup-delay-s", "2"], { waitHealthy: false });
  const id = await register(s, { pool: "loading", models: ["m-load"], id: "l-a" });
  await waitFor(async () => (await backend(id)).health === "loading", { what: "l-a reported loading" });
  assert.equal((await backend(id)).lifecycle, "pending");
  const early = await ask("m-load");
  assert.equal(early.status, 503, early.text);
  await waitReady(gw, id, 15000);
  const late = await ask("m-load");
  assert.equal(late.status, 200, late.text);
  assert.equal(late.backend, id);
});

test("a backend that stops serving a model stops receiving that model's requests", async () => {
  const a = await sim(["--model", "m-move", "--model", "m-other"]);
  const b = await sim(["--model", "m-move"]);
  const ida = await register(a, { pool: "models", models: ["m-move", "m-other"], id: "mm-a" });
  const idb = await register(b, { pool: "models", models: ["m-move"], id: "mm-b" });
  await waitReady(gw, ida);
  await waitReady(gw, idb);
  // Restart a on the same port serving only m-other.
  const port = a.port;
  await a.close();
  const a2 = await startSim(["--model", "m-other", "--time-scale", "50"], { port });
  sims.push(a2);
  await waitFor(async () => {
    const v = await backend(ida);
    return v.health === "healthy" && !v.served_models.includes("m-move") ? v : null;
  }, { what: "probe to notice the model list" });
  for (let i = 0; i < 6; i++) {
    const r = await ask("m-move", { content: `m${i}` });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.backend, idb);
  }
  assert.equal((await ask("m-other")).backend, ida);
});

test("clients go to their nearest pool and spill over when it is drained or saturated", async () => {
  const us = await sim(["--model", "m-geo", "--max-num-seqs", "1", "--decode-ms-per-step", "5000"]);
  const eu = await sim(["--model", "m-geo"]);
  for (const [pool, region] of [["geo-us", "us-east"], ["geo-eu", "eu-west"]]) {
    const r = await gw.admin(`/admin/pools/${pool}`, { method: "PUT", body: { region, policy: "least_load", saturation_waiting_per_backend: 1, autoscale_target_waiting: 1 } });
    assert.equal(r.status, 200, await r.text());
  }
  const idus = await register(us, { pool: "geo-us", region: "us-east", models: ["m-geo"], id: "geo-us-1" });
  const ideu = await register(eu, { pool: "geo-eu", region: "eu-west", models: ["m-geo"], id: "geo-eu-1" });
  await waitReady(gw, idus);
  await waitReady(gw, ideu);
  const fromUs = await ask("m-geo", { region: "us-east" });
  assert.equal(fromUs.pool, "geo-us");
  const fromEu = await ask("m-geo", { region: "eu-west" });
  assert.equal(fromEu.pool, "geo-eu");

  // Saturate us-east: one running sequence, several waiting (slow decode), then let a probe see it.
  const slow = [0, 1, 2, 3].map((i) => fetch(`${us.url}/v1/chat/completions`, {
    method: "POST",
    body: JSON.stringify({ model: "m-geo", max_tokens: 20, ignore_eos: true, messages: [{ role: "user", content: `busy ${i}` }] }),
  }).catch(() => null));
  await waitFor(async () => (await (await gw.admin("/admin/pools/geo-us")).json()).saturated, { what: "geo-us saturated" });
  const state = await (await gw.admin("/admin/pools/geo-us")).json();
  assert.ok(state.autoscaling.desired_replicas > state.ready_backends, JSON.stringify(state));
  const spilled = await ask("m-geo", { region: "us-east" });
  assert.equal(spilled.status, 200, spilled.text);
  assert.equal(spilled.pool, "geo-eu", "a saturated nearest pool spills to the next");
  await Promise.all(slow);

  // Drained: no ready backend in us-east, so us-east clients are served from eu-west.
  await waitFor(async () => !(await (await gw.admin("/admin/pools/geo-us")).json()).saturated, { what: "geo-us queue drained" });
  const d = await gw.admin(`/admin/backends/${idus}`, { method: "PATCH", body: { drain: true } });
  assert.equal(d.status, 200);
  const drainedOut = await ask("m-geo", { region: "us-east" });
  assert.equal(drainedOut.pool, "geo-eu");
  await gw.admin(`/admin/backends/${idus}`, { method: "PATCH", body: { drain: false } });
  assert.equal((await ask("m-geo", { region: "us-east" })).pool, "geo-us");
});

test("a draining backend finishes its streams, then is removed", async () => {
  const s = await sim(["--model", "m-drain", "--decode-ms-per-step", "5000"]);
  const id = await register(s, { pool: "drain", models: ["m-drain"], id: "d-a" });
  await waitReady(gw, id);
  const streaming = ask("m-drain", { stream: true, max_tokens: 30, content: "a long answer please" });
  await waitFor(async () => (await backend(id)).leases_in_flight === 1, { what: "the stream to start" });
  const del = await gw.admin(`/admin/backends/${id}`, { method: "DELETE" });
  assert.equal(del.status, 202, "a busy backend drains before it is removed");
  assert.equal((await backend(id)).lifecycle, "draining");
  const done = await streaming;
  assert.equal(done.status, 200);
  assert.ok(done.text.trimEnd().endsWith("data: [DONE]"));
  assert.ok(!done.text.includes("upstream_stream_error"), "the stream completed");
  await waitFor(async () => (await gw.admin(`/admin/backends/${id}`)).status === 404, { what: "removal after the drain" });
});

test("/metrics has every family, and the autoscaling signal rises with the queues", async () => {
  const bad = await gw.fetch("/metrics");
  assert.equal(bad.status, 401);
  const r = await gw.admin("/metrics");
  assert.equal(r.status, 200);
  const text = await r.text();
  for (const family of [
    "llm_gateway_requests_total", "llm_gateway_request_outcomes_total", "llm_gateway_decisions_total",
    "llm_gateway_breaker_state", "llm_gateway_breaker_transitions_total", "llm_gateway_backend_health_state",
    "llm_gateway_backend_lifecycle", "llm_gateway_leases_in_flight", "llm_gateway_inflight_tokens",
    "llm_gateway_ttfb_seconds", "llm_gateway_request_duration_seconds", "llm_gateway_affinity_entries",
    "llm_gateway_retries_total", "llm_gateway_retry_budget_exhausted_total", "llm_gateway_probes_total",
    "llm_gateway_probe_duration_seconds", "llm_gateway_backend_scraped", "llm_gateway_pool_waiting",
    "llm_gateway_pool_running", "llm_gateway_pool_desired_replicas",
  ]) {
    assert.match(text, new RegExp(`^# TYPE ${family} `, "m"), `missing family ${family}`);
  }
  const types = text.split("\n").filter((l) => l.startsWith("# TYPE ")).map((l) => l.split(" ")[2]);
  assert.equal(new Set(types).size, types.length, "a family is declared twice");
  assert.ok(!/https?:\/\//.test(text), "a URL leaked into the metrics");
  assert.match(text, /llm_gateway_pool_desired_replicas\{pool="geo-us"\} \d/);
});
