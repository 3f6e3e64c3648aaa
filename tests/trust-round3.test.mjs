// Issue 42 (trust round 3), the scenarios a user hits, against the built Worker under Miniflare and
// real vllm-sim processes on 127.0.0.1: a partial `PUT /admin/pools/{pool}` keeps the pool's
// residency (it is lifted only by an explicit `null`); the round trip measured to a pool does not
// include the wait for the client's rate limiter; vLLM gets a request id the gateway made, never the
// client's (two clients sending one id do not collide). Native tests cover the rules behind them
// (protocol/src/settings.rs, routing-core: stream/settle.rs, coordinator waiting room, guesses).
import { test, after } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startGatewayServer, startSim, waitFor, waitReady, drained, poolState, setFaults } from "./lib/harness.mjs";

const closers = [];
after(async () => {
  for (const c of closers.reverse()) await c();
});

async function gateway(bindings, { server = false } = {}) {
  const g = server ? await startGatewayServer({ bindings }) : await startGateway({ bindings });
  closers.push(() => g.close());
  return g;
}

async function sim(args) {
  const s = await startSim(args);
  closers.push(() => s.close());
  return s;
}

/** A pool `name` with one sim serving `model`, set with `settings`; returns { id, sim }. */
async function pool(g, name, model, settings = {}, simArgs = ["--time-scale", "1000"]) {
  const put = await g.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy: "round_robin", ...settings } });
  assert.equal(put.status, 200, await put.text());
  const s = await sim(["--model", model, ...simArgs]);
  const id = `${name}-b0`;
  const reg = await g.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models: [model], id } });
  assert.equal(reg.status, 201, await reg.text());
  await waitReady(g, id);
  return { id, sim: s };
}

function chat(g, model, { key, headers = {}, stream = false, max_tokens = 8, signal } = {}) {
  return g.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", ...(key ? { authorization: `Bearer ${key}` } : {}), ...headers },
    body: JSON.stringify({ model, messages: [{ role: "user", content: "count" }], stream, max_tokens, ignore_eos: true }),
    signal,
  });
}

// ---- 1. Residency no admin call drops ------------------------------------------------------------

test("a partial PUT of a pool keeps its residency and every knob not sent; only an explicit null lifts it", async () => {
  const g = await gateway({ PROBE_INTERVAL_MS: "500" });
  const name = "r3-eu";
  const model = "r3-eu-model";
  await pool(g, name, model, { region: "eu-west", location_hint: "weur", jurisdiction: "eu", residency: ["eu"], probe_interval_ms: 2000 });
  const minted = await g.admin("/admin/keys", { method: "POST", body: { name: "eu only", residency: ["eu"] } });
  assert.equal(minted.status, 201);
  const { key } = JSON.parse(await minted.text());
  const before = await chat(g, model, { key });
  assert.equal(before.status, 200, await before.text());

  // The README's scaling example.
  const scaled = await g.admin(`/admin/pools/${name}`, { method: "PUT", body: { shards: 2 } });
  assert.equal(scaled.status, 200, await scaled.text());
  const detail = await poolState(g, name);
  assert.equal(detail.config.shards, 2);
  assert.equal(detail.config.jurisdiction, "eu", "a partial PUT dropped the pool's jurisdiction");
  assert.deepEqual(detail.config.residency, ["eu"]);
  assert.equal(detail.config.region, "eu-west");
  assert.equal(detail.config.location_hint, "weur");
  assert.equal(detail.config.policy, "round_robin");
  assert.equal(detail.config.probe_interval_ms, 2000);
  const listed = (await (await g.admin("/admin/pools")).json()).data.find((p) => p.pool === name);
  assert.equal(listed.jurisdiction, "eu", "the directory routes on the pool's jurisdiction");
  // A key restricted to the EU is still served by its EU pool.
  const after = await chat(g, model, { key });
  assert.equal(after.status, 200, await after.text());

  // An empty value where one is set would lift residency by accident: refused, naming the field.
  for (const [body, param] of [[{ residency: [] }, "residency"], [{ jurisdiction: "" }, "jurisdiction"]]) {
    const r = await g.admin(`/admin/pools/${name}`, { method: "PUT", body });
    assert.equal(r.status, 400, await r.clone().text());
    assert.equal((await r.json()).error.param, param);
  }
  assert.equal((await poolState(g, name)).config.jurisdiction, "eu");
  // The explicit call lifts it.
  const lifted = await g.admin(`/admin/pools/${name}`, { method: "PUT", body: { jurisdiction: null, residency: null } });
  assert.equal(lifted.status, 200, await lifted.text());
  const now = await poolState(g, name);
  assert.equal(now.config.jurisdiction, "");
  assert.deepEqual(now.config.residency, []);
  assert.equal(now.config.shards, 2, "the lift changed nothing else");
  await drained(g, name);
});

// ---- 3. The round trip to a pool is the pool call's --------------------------------------------

test("the round trip measured to a pool leaves out the wait for the client's rate limiter", async () => {
  const key = "sk-r3-rtt";
  const g = await gateway({
    PROBE_INTERVAL_MS: "500",
    CLIENT_API_KEYS: key,
    RATE_LIMIT_TPM: "1000000",
    ALLOW_REGION_HEADER: "true",
    SIMULATE_NETWORK: "true",
    SIMULATE_LIMITER_RTT_MS: "700",
    REGION_RTT_MS: JSON.stringify({ "us-east": { "us-east": 10 } }),
  });
  const name = "r3-rtt";
  const model = "r3-rtt-model";
  await pool(g, name, model, { region: "us-east" });
  const headers = { "x-gateway-region": "us-east" };
  let predicted = [];
  // Four measurements make the isolate use them (routing_core::region::network::MIN_SAMPLES).
  for (let i = 0; i < 6; i++) {
    const r = await chat(g, model, { key, headers });
    assert.equal(r.status, 200, await r.text());
    predicted.push(Number(r.headers.get("x-gateway-pool-predicted-ms")));
  }
  const last = predicted.at(-1);
  assert.ok(Number.isFinite(last), `no predicted time: ${predicted}`);
  assert.ok(last < 500, `the pool looks as far away as the limiter (predicted ${predicted.join(", ")} ms)`);
  await drained(g, name);
});

// ---- 9. vLLM gets the gateway's request id ----------------------------------------------------------

test("two clients sending one x-request-id do not collide on a vLLM that rejects a running id, and each sees its own id back", async () => {
  const g = await gateway({ PROBE_INTERVAL_MS: "500" });
  const name = "r3-ids";
  const model = "r3-ids-model";
  const p = await pool(g, name, model, {}, ["--time-scale", "1"]);
  // vLLM before PR #27987: an id still running (or lingering) is refused with 400.
  await setFaults(p.sim, { request_id_linger_ms: 5000 });
  const headers = { "x-request-id": "constant-id-1" };
  const [a, b] = await Promise.all([chat(g, model, { headers, max_tokens: 20 }), chat(g, model, { headers, max_tokens: 20 })]);
  for (const r of [a, b]) {
    assert.equal(r.status, 200, await r.clone().text());
    assert.equal(r.headers.get("x-request-id"), "constant-id-1");
  }
  // A client retry with the same id right after.
  const again = await chat(g, model, { headers });
  assert.equal(again.status, 200, await again.clone().text());
  await setFaults(p.sim, {});
  await drained(g, name);
});
