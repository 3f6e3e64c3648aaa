// The regional hop (issue 27), end to end in one workerd: the built Worker as the edge gateway and
// a second time as a regional Worker (GATEWAY_ROLE=regional) sharing its Durable Objects, reached
// through a service binding named in REGIONAL_WORKERS; real vllm-sim backends on 127.0.0.1. A
// request through the hop gets the same answer and headers as without it; a hang-up mid-stream
// releases the lease; a token reservation is charged once and settled (and, with RATE_LIMIT_AHEAD,
// a request served ahead of a charge the limiter refuses is paid for); hop headers from a public
// request are not trusted (at the edge, and at a regional Worker without the HOP_SECRET); and with
// SIMULATE_NETWORK the hop waits out one modelled round trip where the edge alone waits two
// (counted, never timed). Issue 42: a hop context the regional Worker cannot read (a deploy in
// progress, stood for by a Worker that rewrites the context on the way) is served by the edge, not
// refused (item 7); the regional Worker applies the edge's signed rate limits, not its own vars,
// and refuses a decision changed on the way (item 6); the edge counts its sends through the hop
// and learns the grants' cards, so a pool it just filled no longer looks idle (item 4).
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitFor, waitReady, drained } from "./lib/harness.mjs";
import { startWithHop, regionalWorker } from "./lib/hop.mjs";

const REGION = "eu-west";
const KEY = "sk-hop-client-1";
const HOP_SECRET = "hop-secret-test-7d2e";
const NETWORK = {
  ALLOW_REGION_HEADER: "true",
  SIMULATE_NETWORK: "true",
  REGION_RTT_MS: JSON.stringify({ "us-east": { [REGION]: 20 } }),
};

const closers = [];
const drains = [];
let hopGw; // edge + regional Worker, with client keys and a token limit
let plainGw; // the same settings without the hop
let sim; // fast
let slow; // real-time, for the hang-up

before(async () => {
  const bindings = { PROBE_INTERVAL_MS: "500", CLIENT_API_KEYS: KEY, RATE_LIMIT_TPM: "1000", HOP_SECRET, ...NETWORK };
  hopGw = await startWithHop({ region: REGION, bindings });
  plainGw = await startGateway({ bindings });
  closers.push(hopGw, plainGw);
  sim = await startSim(["--model", "hop-model", "--time-scale", "1000", "--seed", "7"]);
  slow = await startSim(["--model", "hop-slow", "--time-scale", "1"]);
  closers.push(sim, slow);
  for (const g of [hopGw, plainGw]) {
    await addPool(g, "hop-eu", [sim], ["hop-model"]);
    await addPool(g, "hop-eu-slow", [slow], ["hop-slow"]);
  }
});

after(async () => {
  for (const c of closers.reverse()) await c.close();
});

afterEach(async () => {
  for (const [g, name] of drains) await drained(g, name);
});

async function addPool(g, name, sims, models, region = REGION) {
  const put = await g.admin(`/admin/pools/${name}`, { method: "PUT", body: { region } });
  assert.equal(put.status, 200, await put.text());
  for (const [i, s] of sims.entries()) {
    const id = `${name}-b${i}`;
    const reg = await g.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models, id } });
    assert.equal(reg.status, 201, await reg.text());
    await waitReady(g, id);
  }
  drains.push([g, name]);
}

function chat(g, { model = "hop-model", key = KEY, stream = false, maxTokens = 8, headers = {}, signal } = {}) {
  return g.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", ...(key ? { authorization: `Bearer ${key}` } : {}), ...headers },
    body: JSON.stringify({ model, messages: [{ role: "user", content: "count to ten" }], stream, max_tokens: maxTokens, ignore_eos: true }),
    signal,
  });
}

const ROUTING_HEADERS = ["x-gateway-pool", "x-gateway-backend", "x-gateway-pool-choice", "x-request-id"];

test("through the regional Worker a request gets the same answer and headers as without the hop", async () => {
  for (const stream of [false, true]) {
    const opts = { stream, maxTokens: 12, headers: { "x-request-id": `hop-same-${stream}`, "x-gateway-region": "us-east" } };
    const [a, b] = [await chat(hopGw, opts), await chat(plainGw, opts)];
    assert.equal(a.status, 200, await a.clone().text());
    assert.equal(b.status, 200);
    for (const h of ROUTING_HEADERS) assert.equal(a.headers.get(h), b.headers.get(h), h);
    assert.equal(a.headers.get("x-gateway-pool"), "hop-eu");
    // Served through the hop (one modelled wait), not by the edge's fallback (two).
    assert.equal(a.headers.get("x-gateway-simulated-waits"), "1");
    assert.equal(b.headers.get("x-gateway-simulated-waits"), "2");
    assert.equal(a.headers.get("content-type"), b.headers.get("content-type"));
    const [ta, tb] = [await a.text(), await b.text()];
    if (!stream) {
      const [ja, jb] = [JSON.parse(ta), JSON.parse(tb)];
      assert.deepEqual(ja.usage, jb.usage);
      assert.equal(ja.choices[0].message.content, jb.choices[0].message.content);
    } else {
      // The client did not ask for usage: neither path lets the gateway's own usage event through.
      assert.ok(!ta.includes('"usage":{'), "usage event leaked through the hop");
      assert.ok(ta.trimEnd().endsWith("data: [DONE]"));
      const events = (t) => t.split("\n\n").filter((e) => e.startsWith("data: ")).length;
      assert.equal(events(ta), events(tb));
    }
  }
});

test("a hang-up at the edge mid-stream reaches the regional Worker and its lease is released", async () => {
  const ctl = new AbortController();
  const r = await chat(hopGw, { model: "hop-slow", stream: true, maxTokens: 400, signal: ctl.signal, headers: { "x-gateway-region": "us-east" } });
  assert.equal(r.status, 200);
  assert.equal(r.headers.get("x-gateway-pool"), "hop-eu-slow");
  assert.equal(r.headers.get("x-gateway-simulated-waits"), "1", "served through the hop");
  const reader = r.body.getReader();
  assert.ok(!(await reader.read()).done);
  const pool = await (await hopGw.admin("/admin/pools/hop-eu-slow")).json();
  assert.equal(pool.in_flight, 1);
  ctl.abort();
  await reader.cancel().catch(() => {});
  // Without the hang-up the 400 tokens would take 4 s or more; drained() waits for in_flight 0.
  await drained(hopGw, "hop-eu-slow");
  // The upstream was aborted too: the backend stops running the request (it sees the closed
  // connection a moment after the lease is released).
  await waitFor(async () => {
    const m = await (await fetch(`${slow.url}/metrics`)).text();
    return /vllm:num_requests_running(\{[^}]*\})? 0(\.0)?\b/.test(m) ? true : null;
  }, { timeoutMs: 3000, what: "the backend's request aborted" });
});

test("a reservation is charged once (by the regional Worker, beside its lease call) and settled once; the limit still holds through the hop", async () => {
  const fresh = await startWithHop({ region: REGION, bindings: { PROBE_INTERVAL_MS: "500", CLIENT_API_KEYS: KEY, RATE_LIMIT_TPM: "1000", ...NETWORK } });
  closers.push(fresh);
  await addPool(fresh, "hop-eu", [sim], ["hop-model"]);
  // About 450 tokens each: a second fits in 1,000 only if the first was charged once.
  const via = { "x-gateway-region": "us-east" };
  const first = await chat(fresh, { maxTokens: 440, headers: via });
  assert.equal(first.status, 200, await first.clone().text());
  assert.equal(first.headers.get("x-gateway-simulated-waits"), "1", "served through the hop");
  // The regional Worker charged it, and its rate-limit headers reach the client.
  assert.equal(first.headers.get("x-ratelimit-limit-tokens"), "1000");
  assert.ok(Number(first.headers.get("x-ratelimit-remaining-tokens")) < 600, first.headers.get("x-ratelimit-remaining-tokens"));
  const used = (await first.json()).usage.total_tokens;
  assert.ok(used > 400, `usage ${used}`);
  const second = await chat(fresh, { maxTokens: 440, headers: via });
  assert.equal(second.status, 200, `charged twice? ${await second.clone().text()}`);
  await second.text();
  // Both were settled at their real usage, not refunded: a third does not fit.
  const third = await chat(fresh, { maxTokens: 440, headers: via });
  assert.equal(third.status, 429, await third.text());
});

test("with RATE_LIMIT_AHEAD a request served ahead of its charge that the limiter then refuses is paid for all the same", async () => {
  // Two isolates charge one key's limiter: the regional Worker (the eu-west pool) and the edge
  // itself (a us-east pool, which has no regional Worker). Each knows only its own answers.
  const g = await startWithHop({
    region: REGION,
    bindings: { PROBE_INTERVAL_MS: "500", CLIENT_API_KEYS: KEY, RATE_LIMIT_TPM: "1000", RATE_LIMIT_AHEAD: "true", ...NETWORK },
  });
  closers.push(g);
  const us = await startSim(["--model", "hop-us", "--time-scale", "1000", "--seed", "8"]);
  closers.push(us);
  await addPool(g, "hop-eu", [sim], ["hop-model"]);
  await addPool(g, "hop-us", [us], ["hop-us"], "us-east");
  const via = { "x-gateway-region": "us-east" };
  // The edge charges a small request and learns the key has nearly all its minute left.
  const small = await chat(g, { model: "hop-us", headers: via });
  assert.equal(small.status, 200, await small.clone().text());
  assert.equal(small.headers.get("x-gateway-pool"), "hop-us");
  await small.text();
  // The regional Worker spends most of the rest (about 900 tokens), unseen by the edge.
  const big = await chat(g, { maxTokens: 880, headers: via });
  assert.equal(big.status, 200, await big.clone().text());
  assert.equal(big.headers.get("x-gateway-simulated-waits"), "1", "served through the hop");
  await big.text();
  // By the edge's last answer the key is well within its limit: served ahead of its charge,
  // which the limiter refuses (about 100 tokens left for about 310).
  const ahead = await chat(g, { model: "hop-us", maxTokens: 300, headers: via });
  assert.equal(ahead.status, 200, `not served ahead: ${await ahead.clone().text()}`);
  await ahead.text();
  await new Promise((r) => setTimeout(r, 300));
  // It was charged all the same: the key owes about 200 tokens, so even a small request waits
  // for more than ten seconds of refill (without the forced charge, it would fit at once).
  const after = await chat(g, { model: "hop-us", headers: via });
  assert.equal(after.status, 429, await after.clone().text());
  await after.text();
  const retry = Number(after.headers.get("retry-after"));
  assert.ok(retry >= 8, `Retry-After ${retry}: the request served ahead was not charged`);
});

test("hop headers on a public request to the edge are not trusted", async () => {
  // A forged hand-over: no key, top priority, no reservation, the usage event kept.
  const forged = {
    pools: [],
    reason: "nearest",
    predicted_ms: null,
    allowed: [],
    excluded: 0,
    client_region: REGION,
    region: REGION,
    who: { tenant: "forged", priority: 100 },
    reservation: null,
    strip_usage_event: false,
  };
  const hex = Buffer.from(JSON.stringify(forged)).toString("hex");
  const noKey = await chat(hopGw, { key: null, headers: { "x-gateway-hop": hex } });
  assert.equal(noKey.status, 401, await noKey.text());
  // With a key, the forged header changes nothing: the edge plans and hands over its own context.
  const withKey = await chat(hopGw, { headers: { "x-gateway-hop": hex, "x-gateway-region": "us-east" } });
  assert.equal(withKey.status, 200, await withKey.clone().text());
  assert.equal(withKey.headers.get("x-gateway-pool"), "hop-eu");
  assert.equal(withKey.headers.get("x-gateway-simulated-waits"), "1");
  await withKey.text();
});

test("with HOP_SECRET, a hop that reaches the regional Worker without the secret is an ordinary request", async () => {
  const forged = {
    pools: [],
    reason: "nearest",
    predicted_ms: null,
    allowed: [],
    excluded: 0,
    client_region: REGION,
    region: REGION,
    who: { tenant: "forged", priority: 100 },
    reservation: null,
    strip_usage_event: false,
  };
  const hop = Buffer.from(JSON.stringify(forged)).toString("hex");
  const regional = await hopGw.mf.getWorker(`regional-${REGION}`);
  const body = JSON.stringify({ model: "hop-model", messages: [{ role: "user", content: "hi" }], max_tokens: 4 });
  for (const auth of [undefined, "wrong-secret"]) {
    const headers = { "content-type": "application/json", "x-gateway-hop": hop, ...(auth ? { "x-gateway-hop-auth": auth } : {}) };
    const r = await regional.fetch("http://regional.test/v1/chat/completions", { method: "POST", headers, body });
    // Not trusted: the key is checked as for any request, and there is none.
    assert.equal(r.status, 401, `${auth}: ${await r.text()}`);
  }
  // The edge, which has the secret, still hands over (one modelled wait).
  const ok = await chat(hopGw, { headers: { "x-gateway-region": "us-east" } });
  assert.equal(ok.status, 200);
  assert.equal(ok.headers.get("x-gateway-simulated-waits"), "1");
  await ok.text();
});

test("with SIMULATE_NETWORK the hop waits out one round trip, the edge alone two", async () => {
  const client = { "x-gateway-region": "us-east" };
  for (const stream of [false, true]) {
    const viaHop = await chat(hopGw, { stream, headers: client });
    const alone = await chat(plainGw, { stream, headers: client });
    assert.equal(viaHop.status, 200);
    assert.equal(alone.status, 200);
    await Promise.all([viaHop.text(), alone.text()]);
    assert.equal(viaHop.headers.get("x-gateway-simulated-waits"), "1", "hop: one wait, before the hand-over");
    assert.equal(alone.headers.get("x-gateway-simulated-waits"), "2", "edge alone: before the lease and the fetch");
  }
  // A client in the pool's own region waits nothing either way.
  const local = await chat(hopGw, { headers: { "x-gateway-region": REGION } });
  assert.equal(local.headers.get("x-gateway-simulated-waits"), "0");
  await local.text();
});

/** A Worker between the edge and the regional Worker that rewrites the hop context with
 * `rewrite` (JavaScript statements on `context`) and passes the request on, the HOP_SECRET header
 * included. */
const rewriting = (rewrite) => `
const unhex = (h) => new TextDecoder().decode(new Uint8Array(h.match(/../g).map((b) => parseInt(b, 16))));
const hex = (t) => [...new TextEncoder().encode(t)].map((b) => b.toString(16).padStart(2, "0")).join("");
export default {
  async fetch(request, env) {
    const headers = new Headers(request.headers);
    const context = JSON.parse(unhex(headers.get("x-gateway-hop")));
    ${rewrite}
    headers.set("x-gateway-hop", hex(JSON.stringify(context)));
    return env.REGIONAL.fetch(new Request(request, { headers }));
  },
};`;

/** The gateway with its regional Worker (`regionalBindings`) reached through `between`, a
 * [`rewriting`] Worker, when given. */
async function edgeAndRegional(bindings, regionalBindings, between) {
  const regional = `regional-${REGION}`;
  const g = await startGateway({
    bindings: { ...bindings, REGIONAL_WORKERS: JSON.stringify({ [REGION]: "REGIONAL_EU_WEST" }) },
    extraWorkers: [
      regionalWorker(regional, regionalBindings),
      ...(between ? [{ name: "between", modules: true, script: between, serviceBindings: { REGIONAL: regional } }] : []),
    ],
    workerOptions: { serviceBindings: { REGIONAL_EU_WEST: between ? "between" : regional } },
  });
  closers.push(g);
  return g;
}

// An edge of a later deploy might write a later version, with a field moved.
const NEWER_EDGE = rewriting(`context.version = (context.version ?? 0) + 1; context.admission = context.who; delete context.who;`);

test("a hop context the regional Worker cannot read (a deploy in progress) is served by the edge, not refused (issue 42, item 7)", async () => {
  const bindings = { PROBE_INTERVAL_MS: "500", CLIENT_API_KEYS: KEY, RATE_LIMIT_TPM: "1000", HOP_SECRET, ...NETWORK };
  const g = await edgeAndRegional(bindings, bindings, NEWER_EDGE);
  await addPool(g, "hop-skew", [sim], ["hop-model"]);
  for (const stream of [false, true]) {
    const r = await chat(g, { stream, headers: { "x-gateway-region": "us-east" } });
    const text = await r.text();
    assert.equal(r.status, 200, text);
    assert.equal(r.headers.get("x-gateway-pool"), "hop-skew");
    // Served by the edge itself (two modelled waits), after the regional Worker refused the hop.
    assert.equal(r.headers.get("x-gateway-simulated-waits"), "2");
    assert.equal(r.headers.get("x-gateway-hop-refused"), null, "the refusal stays between the Workers");
    if (stream) assert.ok(text.trimEnd().endsWith("data: [DONE]"));
  }
  // Nothing leased is left behind by the refused hops.
  await drained(g, "hop-skew");
});

test("the regional Worker applies the edge's signed rate limits, not its own RATE_LIMIT_* vars (issue 42, item 6)", async () => {
  const edge = { PROBE_INTERVAL_MS: "500", CLIENT_API_KEYS: KEY, RATE_LIMIT_TPM: "1000", HOP_SECRET, ...NETWORK };
  // The regional Worker's own vars say something else: a million tokens a minute.
  const g = await edgeAndRegional(edge, { ...edge, RATE_LIMIT_TPM: "1000000" });
  await addPool(g, "hop-limits", [sim], ["hop-model"]);
  const via = { "x-gateway-region": "us-east" };
  const first = await chat(g, { maxTokens: 440, headers: via });
  assert.equal(first.status, 200, await first.clone().text());
  assert.equal(first.headers.get("x-gateway-simulated-waits"), "1", "served through the hop");
  assert.equal(first.headers.get("x-ratelimit-limit-tokens"), "1000", "the edge's limit, as the client's headers say");
  await first.text();
  assert.equal((await chat(g, { maxTokens: 440, headers: via })).status, 200);
  // The edge's 1,000 tokens a minute hold through the hop.
  const third = await chat(g, { maxTokens: 440, headers: via });
  assert.equal(third.status, 429, await third.text());
  await drained(g, "hop-limits");
});

test("a hop whose rate-limit decision was changed on the way (not signed with HOP_SECRET) is refused by the regional Worker and served by the edge under its own limits", async () => {
  const bindings = { PROBE_INTERVAL_MS: "500", CLIENT_API_KEYS: KEY, RATE_LIMIT_TPM: "1000", HOP_SECRET, ...NETWORK };
  const unlimited = rewriting(`if (context.charge?.limits) context.charge.limits.tokens_per_minute = 0;`);
  const g = await edgeAndRegional(bindings, bindings, unlimited);
  await addPool(g, "hop-forged", [sim], ["hop-model"]);
  const via = { "x-gateway-region": "us-east" };
  const r = await chat(g, { maxTokens: 440, headers: via });
  assert.equal(r.status, 200, await r.clone().text());
  assert.equal(r.headers.get("x-gateway-simulated-waits"), "2", "served by the edge itself");
  assert.equal(r.headers.get("x-ratelimit-limit-tokens"), "1000");
  await r.text();
  await drained(g, "hop-forged");
});

test("through the hop the edge counts its own sends and learns the grants' cards: a pool it just filled no longer looks idle (issue 42, item 4)", async (t) => {
  // The pool's own probes (and so the directory's card) stay quiet for the test: what the edge
  // knows of the pool's load comes from its grants through the hop, or nowhere.
  const bindings = { PROBE_INTERVAL_MS: "500", CLIENT_API_KEYS: KEY, HOP_SECRET, TIME_CARD_MAX_AGE_MS: "600000", ...NETWORK };
  const g = await edgeAndRegional(bindings, bindings);
  const one = await startSim(["--model", "hop-count", "--time-scale", "1", "--max-num-seqs", "1", "--seed", "9"]);
  closers.push(one);
  const put = await g.admin("/admin/pools/hop-count", { method: "PUT", body: { region: REGION, probe_interval_ms: 60000 } });
  assert.equal(put.status, 200, await put.text());
  const reg = await g.admin("/admin/backends", { method: "POST", body: { url: one.url, pool: "hop-count", models: ["hop-count"], id: "hop-count-b0", max_num_seqs: 1 } });
  assert.equal(reg.status, 201, await reg.text());
  await waitReady(g, "hop-count-b0", 20000);
  const via = { "x-gateway-region": "us-east" };
  // The edge's card of the idle pool, from the directory.
  const idle = await chat(g, { model: "hop-count", maxTokens: 1, headers: via });
  assert.equal(idle.status, 200, await idle.clone().text());
  await idle.text();
  const leave = new AbortController();
  // A long stream takes the pool's only slot...
  const busy = await chat(g, { model: "hop-count", stream: true, maxTokens: 600, headers: via, signal: leave.signal });
  assert.equal(busy.status, 200);
  assert.equal(busy.headers.get("x-gateway-simulated-waits"), "1", "served through the hop");
  assert.equal(busy.headers.get("x-gateway-hop-card"), null, "the card stays between the Workers");
  const before = Number(busy.headers.get("x-gateway-pool-predicted-ms"));
  // ...and the next request's prediction at the edge counts it.
  const next = await chat(g, { model: "hop-count", maxTokens: 1, headers: via });
  const after = Number(next.headers.get("x-gateway-pool-predicted-ms"));
  leave.abort();
  await next.text().catch(() => {});
  t.diagnostic(`predicted at the edge: ${before} ms idle, ${after} ms with the slot taken`);
  assert.ok(Number.isFinite(before) && Number.isFinite(after), `${before} ${after}`);
  assert.ok(after > before + 200, `the edge still sees the pool idle: predicted ${before} ms, then ${after} ms with its only slot taken`);
  await drained(g, "hop-count");
});
