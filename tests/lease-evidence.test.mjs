// Lease evidence end to end (issue 45): the built Worker in workerd and real vllm-sim processes. A
// region whose one backend runs 2 sequences at a time (which the gateway is not told) takes a burst
// of 10 long streams; another region has two idle backends. The probe interval is long, so no
// probe round runs after the burst: the busy pool learns of its queue only from its own leases (the
// Worker reports the streams with no first token by their due time), scrapes that backend at once,
// and hands its card back on those renewals. Short requests from the busy region sent 1-5 s after
// the burst are served by the idle region. With `shards: 2`, a burst granted by shard 1 (which does
// not probe) has its backend scraped by shard 0 all the same. The tests assert where requests went
// and what was scraped, never how fast; leases return to zero at the end.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitFor, waitReady, parseMetrics, metricValue, ADMIN_TOKEN, drained, poolState } from "./lib/harness.mjs";

const BINDINGS = {
  // No probe round after the ones that bring the backends up.
  PROBE_INTERVAL_MS: "600000",
  ALLOW_REGION_HEADER: "true",
  // The burst's queued streams wait in vLLM's own queue longer than the default 30 s.
  FIRST_BYTE_TIMEOUT_MS: "120000",
  REGION_RTT_MS: JSON.stringify({ "r-busy": { "r-idle": 20 } }),
};

let gw;
const closers = [];

before(async () => {
  gw = await startGateway({ bindings: BINDINGS });
});

after(async () => {
  for (const c of closers.reverse()) await c.close();
  await gw?.close();
});

async function sim(args) {
  const s = await startSim(args);
  closers.push(s);
  return s;
}

/** A pool in `region` of `sims`, each registered with the gateway's default `max_num_seqs`. */
async function addPool(name, region, sims, models) {
  const put = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { region } });
  assert.equal(put.status, 200, await put.text());
  for (const [i, s] of sims.entries()) {
    const id = `${name}-b${i}`;
    const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models, id } });
    assert.equal(reg.status, 201, await reg.text());
    await waitReady(gw, id);
  }
  return name;
}

async function chat(model, region, { stream = false, tokens = 8, signal } = {}) {
  const r = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", "x-gateway-region": region },
    body: JSON.stringify({ model, stream, max_tokens: tokens, ignore_eos: true, messages: [{ role: "user", content: `question ${Math.random()}` }] }),
    signal,
  });
  return r;
}

async function short(region) {
  // A request that waits behind the burst would wait for minutes: the test ends it.
  const r = await chat("le", region, { signal: AbortSignal.timeout(15000) });
  const body = await r.text();
  return { status: r.status, body, pool: r.headers.get("x-gateway-pool"), choice: r.headers.get("x-gateway-pool-choice"), headers: r.headers };
}

async function metrics() {
  const text = await (await gw.fetch("/metrics", { headers: { authorization: `Bearer ${ADMIN_TOKEN}` } })).text();
  return parseMetrics(text);
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

test("a burst queued in a backend shows from the pool's own leases before any probe round: short requests go to the idle region", async () => {
  const busySim = await sim(["--model", "le", "--model", "le-load", "--max-num-seqs", "2"]);
  const idleSims = [await sim(["--model", "le"]), await sim(["--model", "le"])];
  const busy = await addPool("lebusy", "r-busy", [busySim], ["le", "le-load"]);
  const idle = await addPool("leidle", "r-idle", idleSims, ["le"]);

  // Both pools' cards are in the directory, and in the Worker's copy of the pool list (cached for
  // 2 s, refreshed in the background).
  for (const name of [busy, idle]) {
    await waitFor(async () => ((await poolState(gw, name)).time_card?.short_ms > 0 ? true : null), { timeoutMs: 15000, what: `${name}'s card listed` });
  }
  await sleep(2500);
  // Lightly loaded: the busy region's requests stay there.
  const calm = await waitFor(async () => {
    const r = await short("r-busy");
    assert.equal(r.status, 200, r.body);
    return r.choice === "nearest" ? r : null;
  }, { timeoutMs: 20000, intervalMs: 200, what: "cards published" });
  assert.equal(calm.pool, busy);
  // The busy pool thinks its backend has 256 sequence slots: nothing on its card (the directory's
  // copy) says otherwise.
  const before = await poolState(gw, busy);
  assert.equal(before.time_card?.max_seqs, 256, JSON.stringify(before.time_card));
  const roundsBefore = metricValue(await metrics(), "llm_gateway_probe_rounds_total", { pool: busy });

  // Ten long streams on the busy backend at once: it runs 2, vLLM queues 8.
  const ctl = new AbortController();
  const load = Array.from({ length: 10 }, () =>
    chat("le-load", "r-busy", { stream: true, tokens: 4000, signal: ctl.signal })
      .then(async (r) => { try { await r.text(); } catch {} })
      .catch(() => {}),
  );
  try {
    await waitFor(async () => ((await poolState(gw, busy)).in_flight >= 10 ? true : null), { timeoutMs: 15000, what: "the burst leased" });
    const burstAt = performance.now();

    // Short requests from the busy region 1 to 5 s after the burst: all served by the idle region.
    const served = [];
    for (const at of [1000, 2000, 3000, 4000, 5000]) {
      await sleep(Math.max(0, burstAt + at - performance.now()));
      const r = await short("r-busy");
      assert.equal(r.status, 200, r.body);
      served.push({ at, pool: r.pool, choice: r.choice, predicted: r.headers.get("x-gateway-pool-predicted-ms"), anchor: r.headers.get("x-gateway-pool-anchor-ms") });
    }
    for (const s of served) {
      assert.equal(s.pool, idle, `served in the idle region ${s.at} ms after the burst: ${JSON.stringify(served)}`);
      assert.notEqual(s.choice, "nearest", JSON.stringify(s));
      assert.ok(Number(s.anchor) > Number(s.predicted), `the busy region predicted slower: ${JSON.stringify(s)}`);
    }

    // No probe round ran: what the pool knows came from its leases and the scrape they asked for.
    const m = await metrics();
    assert.equal(metricValue(m, "llm_gateway_probe_rounds_total", { pool: busy }), roundsBefore, "no probe round since the burst");
    assert.ok(metricValue(m, "llm_gateway_evidence_scrapes_total", { pool: busy }) >= 1, "the busy backend was scraped on the leases' evidence");
    // The directory lists the card the scrape brought: the batch limit learned, the wait predicted.
    const card = await waitFor(async () => {
      const c = (await poolState(gw, busy)).time_card;
      return c?.max_seqs <= 2 ? c : null;
    }, { timeoutMs: 5000, what: "the directory's card of the busy pool shows its 2 slots" });
    assert.ok(card.short_ms > 1000, `the busy pool's card predicts the wait: ${JSON.stringify(card)}`);
  } finally {
    ctl.abort();
    await Promise.all(load);
  }
  await drained(gw, busy);
  await drained(gw, idle);
});

test("with shards: 2, a burst granted by shard 1 has its backend scraped by shard 0 before any probe round", async () => {
  const s = await sim(["--model", "les", "--max-num-seqs", "2"]);
  const name = "leshards";
  const put = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { region: "r-shards", shards: 2, shard_exchange_ms: 100 } });
  assert.equal(put.status, 200, await put.text());
  const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models: ["les"], id: `${name}-b0` } });
  assert.equal(reg.status, 201, await reg.text());
  await waitReady(gw, `${name}-b0`);

  const send = (session, { stream = false, tokens = 8, signal } = {}) =>
    gw.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json", "x-gateway-region": "r-shards", "x-session-id": session },
      body: JSON.stringify({ model: "les", stream, max_tokens: tokens, ignore_eos: true, messages: [{ role: "user", content: `question ${Math.random()}` }] }),
      signal,
    });
  // A session the pool coordinates on shard 1 (not shard 0, the one that probes).
  let session = null;
  for (let i = 0; i < 64 && session === null; i++) {
    const r = await waitFor(async () => {
      const r = await send(`les-${i}`);
      await r.text();
      return r.status === 200 ? r : null;
    }, { timeoutMs: 10000, what: "every shard serves" });
    if (r.headers.get("x-gateway-shard") === "1") session = `les-${i}`;
  }
  assert.ok(session, "a session on shard 1");
  const scrapes = async () => metricValue(await metrics(), "llm_gateway_evidence_scrapes_total", { pool: name }) ?? 0;
  const rounds = async () => metricValue(await metrics(), "llm_gateway_probe_rounds_total", { pool: name });
  const roundsBefore = await rounds();
  assert.equal(await scrapes(), 0);

  // Ten long streams of that session: shard 1 grants them, the backend runs 2 and queues 8.
  const ctl = new AbortController();
  const shardsSeen = [];
  const load = Array.from({ length: 10 }, () =>
    send(session, { stream: true, tokens: 4000, signal: ctl.signal })
      .then(async (r) => {
        shardsSeen.push(r.headers.get("x-gateway-shard"));
        try { await r.text(); } catch {}
      })
      .catch(() => {}),
  );
  try {
    await waitFor(async () => ((await poolState(gw, name)).in_flight >= 10 ? true : null), { timeoutMs: 15000, what: "the burst leased" });
    // Shard 1's streams are overdue: it asks shard 0, which scrapes the backend.
    await waitFor(async () => ((await scrapes()) >= 1 ? true : null), { timeoutMs: 5000, intervalMs: 100, what: "the backend scraped on shard 1's evidence" });
    // The scrape's findings reach the directory's card: 2 sequence slots, a wait.
    const card = await waitFor(async () => {
      const c = (await poolState(gw, name)).time_card;
      return c?.max_seqs <= 2 ? c : null;
    }, { timeoutMs: 5000, what: "the directory's card shows the 2 slots" });
    assert.ok(card.short_ms > 1000, JSON.stringify(card));
    assert.equal(await rounds(), roundsBefore, "no probe round since the burst");
    // The running streams answered: shard 1 granted them.
    assert.ok(shardsSeen.length >= 2 && shardsSeen.every((k) => k === "1"), JSON.stringify(shardsSeen));
    // Rate-limited: at most one scrape a second per backend.
    await sleep(2000);
    assert.ok((await scrapes()) <= 5, `scrapes ${await scrapes()}`);
  } finally {
    ctl.abort();
    // A client's abort does not always reach the backend at once under Miniflare: stop the
    // backend, so no stream waits for its turn.
    await s.close();
    await Promise.all(load);
  }
  await drained(gw, name);
});
