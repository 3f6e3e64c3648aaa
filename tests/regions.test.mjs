// Routing across regions on predicted time, end to end: the built Worker in workerd, pools of real
// vllm-sim processes, the far pools behind a local delay proxy that adds a round trip, and the
// client's region set by the test header. A skewed load moves traffic to the faster pool and back;
// a conversation keeps its home pool while home is not backed up; residency is never violated,
// under overload included; a stale time card is not trusted. Leases return to zero after each test.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitFor, waitReady, parseMetrics, metricValue, ADMIN_TOKEN, drained, poolState } from "./lib/harness.mjs";
import { startDelayProxy } from "./lib/delay-proxy.mjs";

const RTT_MS = 60;
const BINDINGS = {
  PROBE_INTERVAL_MS: "500",
  ALLOW_REGION_HEADER: "true",
  // The load's streams wait their turn in vLLM's own queue for longer than the default 30 s.
  FIRST_BYTE_TIMEOUT_MS: "120000",
  REGION_RTT_MS: JSON.stringify({ "r-near": { "r-far": RTT_MS }, "r-eu": { "r-us": RTT_MS } }),
};

let gw;
const closers = [];
const pools = [];

before(async () => {
  gw = await startGateway({ bindings: BINDINGS });
});

after(async () => {
  for (const c of closers.reverse()) await c.close();
  await gw?.close();
});

afterEach(async () => {
  for (const name of pools.splice(0)) await drained(gw, name);
});

let seq = 0;
/**
 * A pool in `region` whose backends are `sims` (each `{ url, models }`), reached through a delay
 * proxy of `delayMs` when given. Returns { name, proxies }.
 */
async function addPool(g, { region, settings = {}, backends, delayMs = 0 }) {
  seq += 1;
  const name = `rg${seq}`;
  const put = await g.admin(`/admin/pools/${name}`, { method: "PUT", body: { region, ...settings } });
  assert.equal(put.status, 200, await put.text());
  const proxies = [];
  for (const [i, b] of backends.entries()) {
    let url = b.sim.url;
    if (delayMs > 0) {
      const proxy = await startDelayProxy(url, { delayMs });
      closers.push(proxy);
      proxies.push(proxy);
      url = proxy.url;
    }
    const id = `${name}-b${i}`;
    const reg = await g.admin("/admin/backends", { method: "POST", body: { url, pool: name, models: b.models, id, max_num_seqs: b.seqs ?? 256 } });
    assert.equal(reg.status, 201, await reg.text());
    await waitReady(g, id);
  }
  if (g === gw) pools.push(name);
  return { name, proxies };
}

async function sim(args) {
  const s = await startSim(args);
  closers.push(s);
  return s;
}

function chatBody(model, { tokens = 8, text, messages } = {}) {
  return JSON.stringify({
    model, max_tokens: tokens, ignore_eos: true,
    messages: messages ?? [{ role: "user", content: text ?? `short question ${Math.random()}` }],
  });
}

async function chat(g, model, region, opts = {}) {
  const r = await g.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", "x-gateway-region": region },
    body: chatBody(model, opts),
    signal: opts.signal,
  });
  const body = await r.text();
  return { status: r.status, headers: r.headers, body, pool: r.headers.get("x-gateway-pool"), choice: r.headers.get("x-gateway-pool-choice") };
}

/** Starts `n` long streams for `model` (only the busy pool serves it); returns a stop function. */
function longStreams(g, model, region, n) {
  const ctl = new AbortController();
  const running = Array.from({ length: n }, () =>
    g.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json", "x-gateway-region": region },
      body: JSON.stringify({ model, stream: true, max_tokens: 4000, ignore_eos: true, messages: [{ role: "user", content: `long ${Math.random()}` }] }),
      signal: ctl.signal,
    }).then(async (r) => { try { await r.text(); } catch {} }).catch(() => {}),
  );
  return async () => {
    ctl.abort();
    await Promise.all(running);
  };
}

/**
 * Waits until `pool`'s time card shows a wait of more than a second, then until every Worker copy
 * of the pool list has it (the list is cached for 2 s and refreshed in the background).
 */
async function overloaded(g, pool) {
  await waitFor(async () => ((await poolState(g, pool)).time_card?.short_ms > 1000 ? true : null), { timeoutMs: 15000, what: `the ${pool} card shows the overload` });
  await new Promise((r) => setTimeout(r, 4500));
}

/** Waits until `pool`'s time card shows it idle again, and every Worker copy has it. */
async function calmed(g, pool) {
  await waitFor(async () => ((await poolState(g, pool)).time_card?.short_ms < 500 ? true : null), { timeoutMs: 15000, what: `the ${pool} card shows it idle` });
  await new Promise((r) => setTimeout(r, 4500));
}

/** Sends short requests until one is served as `want` says; returns it. */
async function until(what, send, want) {
  return waitFor(async () => {
    const r = await send();
    assert.equal(r.status, 200, r.body);
    return want(r) ? r : null;
  }, { timeoutMs: 20000, intervalMs: 200, what });
}

test("a skewed load moves traffic to the faster pool, the network included, and back when it ends; conversations keep their home", async () => {
  // Near: one backend running 2 sequences at a time, which also serves the load's model.
  const nearSim = await sim(["--model", "rm", "--model", "rm-load", "--max-num-seqs", "2"]);
  const near = await addPool(gw, { region: "r-near", backends: [{ sim: nearSim, models: ["rm", "rm-load"], seqs: 2 }] });
  // Far: two idle backends, 60 ms away.
  const farSims = [await sim(["--model", "rm"]), await sim(["--model", "rm"])];
  const far = await addPool(gw, { region: "r-far", delayMs: RTT_MS, backends: farSims.map((s) => ({ sim: s, models: ["rm"] })) });

  // Lightly loaded: no cross-region traffic.
  const calm = await until("cards published", () => chat(gw, "rm", "r-near"), (r) => r.choice === "nearest");
  assert.equal(calm.pool, near.name);
  for (let i = 0; i < 5; i++) {
    const r = await chat(gw, "rm", "r-near");
    assert.equal(r.pool, near.name, "nothing leaves a lightly loaded region");
    assert.equal(r.headers.get("x-gateway-pool-anchor-ms"), null, "a request at its anchor names no other cost");
  }

  // Ten long streams on near's one backend: it runs 2, vLLM queues 8.
  const stop = await longStreams(gw, "rm-load", "r-near", 10);
  await overloaded(gw, near.name);
  const moved = await until("traffic moves to the faster pool", () => chat(gw, "rm", "r-near"), (r) => r.pool === far.name);
  assert.equal(moved.choice, "faster");
  // What moving saved, by the prediction: the anchor's cost beside the chosen pool's.
  const anchorMs = Number(moved.headers.get("x-gateway-pool-anchor-ms"));
  const chosenMs = Number(moved.headers.get("x-gateway-pool-predicted-ms"));
  assert.ok(anchorMs > chosenMs && chosenMs > 0, `anchor ${anchorMs} ms against ${chosenMs} ms`);
  const state = await poolState(gw, near.name);
  assert.ok(state.time_card?.short_ms > 1000, `the busy pool predicts its wait: ${JSON.stringify(state.time_card)}`);
  // A conversation that starts now goes far too, with a long history.
  const history = [{ role: "user", content: Array.from({ length: 1500 }, (_, i) => `fact${i} about the plan`).join(" ") }];
  const turn1 = await until("a long first turn moves too", () => chat(gw, "rm", "r-near", { messages: history }), (r) => r.pool === far.name);
  const answer = JSON.parse(turn1.body).choices[0].message.content;

  await stop();
  await drained(gw, near.name);
  await calmed(gw, near.name);
  const back = await until("traffic comes back when the load ends", () => chat(gw, "rm", "r-near"), (r) => r.pool === near.name);
  assert.equal(back.choice, "nearest");
  // The conversation's next turn stays where its history is cached: recomputing it near costs
  // more than the round trips.
  const turn2 = await chat(gw, "rm", "r-near", {
    messages: [...history, { role: "assistant", content: answer }, { role: "user", content: "and then?" }],
  });
  assert.equal(turn2.status, 200, turn2.body);
  assert.equal(turn2.pool, far.name, "the conversation kept its home pool");
  assert.equal(turn2.choice, "home");

  const m = parseMetrics(await (await gw.fetch("/metrics", { headers: { authorization: `Bearer ${ADMIN_TOKEN}` } })).text());
  assert.ok(metricValue(m, "llm_gateway_pool_routed_total", { pool: far.name, reason: "faster", cross_region: "true" }) >= 2);
  assert.ok(metricValue(m, "llm_gateway_pool_routed_total", { pool: near.name, reason: "nearest", cross_region: "false" }) >= 6);
});

test("residency: a restricted region's requests never leave its jurisdiction, under overload and with no backend left", async () => {
  const euSim = await sim(["--model", "res", "--model", "res-load", "--max-num-seqs", "2"]);
  const eu = await addPool(gw, {
    region: "r-eu",
    settings: { jurisdiction: "eu", residency: ["eu"] },
    backends: [{ sim: euSim, models: ["res", "res-load"], seqs: 2 }],
  });
  const usSims = [await sim(["--model", "res"]), await sim(["--model", "res"])];
  const us = await addPool(gw, { region: "r-us", settings: { jurisdiction: "us" }, delayMs: 5, backends: usSims.map((s) => ({ sim: s, models: ["res"] })) });
  const posts = () => us.proxies.reduce((n, p) => n + p.posts, 0);
  await until("cards published", () => chat(gw, "res", "r-eu"), (r) => r.choice === "nearest");
  const stop = await longStreams(gw, "res-load", "r-eu", 10);
  // Once the cards show the overload, send requests that would go to r-us if allowed.
  await overloaded(gw, eu.name);
  const before = posts();
  const sent = Array.from({ length: 4 }, () => chat(gw, "res", "r-eu"));
  // They wait in the eu backend's own queue behind the load; then the load ends and they are served.
  await waitFor(async () => ((await poolState(gw, eu.name)).in_flight >= 14 ? true : null), { timeoutMs: 15000, what: "the eu requests leased in the eu" });
  await stop();
  for (const r of await Promise.all(sent)) {
    assert.equal(r.status, 200, r.body);
    assert.equal(r.pool, eu.name, "served in the eu, though the us pool was faster");
  }
  assert.equal(posts(), before, "the us pool received no eu request");
  // No backend left in the eu: a clear 503 that says why, and still nothing sent to the us.
  const del = await gw.admin(`/admin/backends/${eu.name}-b0?force=true`, { method: "DELETE" });
  assert.equal(del.status, 200, await del.text());
  const refused = await chat(gw, "res", "r-eu");
  assert.equal(refused.status, 503, refused.body);
  const err = JSON.parse(refused.body).error;
  assert.equal(err.code, "residency_unavailable");
  assert.match(err.message, /eu/);
  assert.equal(posts(), before);
  // A client of another region is not restricted by the eu pool's rule.
  const other = await chat(gw, "res", "r-us");
  assert.equal(other.status, 200, other.body);
  assert.equal(other.pool, us.name);
});

test("residency on a client key: its requests go only where the key allows, whatever is nearer; patched, the rule follows", async () => {
  const g = await startGateway({ bindings: BINDINGS });
  try {
    const usSim = await sim(["--model", "kres"]);
    const euSim = await sim(["--model", "kres"]);
    const us = await addPool(g, { region: "r-us", settings: { jurisdiction: "us" }, delayMs: 1, backends: [{ sim: usSim, models: ["kres"] }] });
    const eu = await addPool(g, { region: "r-eu", settings: { jurisdiction: "eu" }, delayMs: 1, backends: [{ sim: euSim, models: ["kres"] }] });
    const posts = (pool) => pool.proxies.reduce((n, p) => n + p.posts, 0);
    const mint = async (body) => {
      const r = await g.admin("/admin/keys", { method: "POST", body });
      const text = await r.text();
      assert.equal(r.status, 201, text);
      return JSON.parse(text);
    };
    const euOnly = await mint({ name: "eu-only", residency: ["eu"] });
    assert.deepEqual(euOnly.residency, ["eu"]);
    const free = await mint({ name: "anywhere" });
    const send = async (key) => {
      const r = await g.fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "content-type": "application/json", "x-gateway-region": "r-us", authorization: `Bearer ${key.key}` },
        body: chatBody("kres"),
      });
      return { status: r.status, body: await r.text(), pool: r.headers.get("x-gateway-pool") };
    };
    // A client in r-us: the free key is served next door, the eu key only in the eu.
    for (let i = 0; i < 3; i++) {
      const r = await send(free);
      assert.equal(r.status, 200, r.body);
      assert.equal(r.pool, us.name);
    }
    const usBefore = posts(us);
    for (let i = 0; i < 4; i++) {
      const r = await send(euOnly);
      assert.equal(r.status, 200, r.body);
      assert.equal(r.pool, eu.name, "an eu-only key's request is served in the eu");
    }
    assert.equal(posts(us), usBefore, "the us pool received none of the eu key's requests");
    // Restricted to a jurisdiction no pool has: a clear 503, and nothing sent anywhere.
    const patch = async (body) => {
      const r = await g.admin(`/admin/keys/${euOnly.id}`, { method: "PATCH", body });
      const text = await r.text();
      assert.equal(r.status, 200, text);
      return JSON.parse(text);
    };
    assert.deepEqual((await patch({ residency: ["ch"] })).residency, ["ch"]);
    const sentBefore = posts(us) + posts(eu);
    const refused = await send(euOnly);
    assert.equal(refused.status, 503, refused.body);
    const err = JSON.parse(refused.body).error;
    assert.equal(err.code, "residency_unavailable");
    assert.match(err.message, /ch/);
    assert.equal(posts(us) + posts(eu), sentBefore, "no pool received the request");
    const listed = (await (await g.admin("/admin/keys")).json()).data;
    assert.deepEqual(listed.find((k) => k.id === euOnly.id).residency, ["ch"]);
    assert.deepEqual(listed.find((k) => k.id === free.id).residency, []);
    // Lifted: the nearest pool again.
    assert.deepEqual((await patch({ residency: [] })).residency, []);
    const lifted = await send(euOnly);
    assert.equal(lifted.status, 200, lifted.body);
    assert.equal(lifted.pool, us.name);
    // Bad lists are refused with the parameter named.
    for (const residency of [["not a name"], Array.from({ length: 17 }, (_, i) => `j${i}`)]) {
      const bad = await g.admin("/admin/keys", { method: "POST", body: { name: "bad", residency } });
      assert.equal(bad.status, 400, await bad.text());
    }
  } finally {
    await g.close();
  }
});

test("a pool whose card is stale is not trusted: requests stay in the nearest pool", async () => {
  const g = await startGateway({ bindings: { ...BINDINGS, TIME_CARD_MAX_AGE_MS: "1" } });
  closers.push(g);
  const nearSim = await sim(["--model", "st", "--model", "st-load", "--max-num-seqs", "2"]);
  const near = await addPool(g, { region: "r-near", backends: [{ sim: nearSim, models: ["st", "st-load"], seqs: 2 }] });
  const farSim = await sim(["--model", "st"]);
  const far = await addPool(g, { region: "r-far", delayMs: RTT_MS, backends: [{ sim: farSim, models: ["st"] }] });
  const stop = await longStreams(g, "st-load", "r-near", 10);
  await overloaded(g, near.name);
  const sent = Array.from({ length: 3 }, () => chat(g, "st", "r-near", { tokens: 2 }));
  await waitFor(async () => ((await poolState(g, near.name)).in_flight >= 13 ? true : null), { timeoutMs: 15000, what: "the requests leased near" });
  await stop();
  for (const r of await Promise.all(sent)) {
    assert.equal(r.status, 200, r.body);
    assert.equal(r.pool, near.name, "a card older than TIME_CARD_MAX_AGE_MS moves nothing");
    assert.equal(r.choice, "nearest");
  }
  await drained(g, near.name);
  await drained(g, far.name);
});
