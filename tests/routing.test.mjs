// The default policy, predicted_latency, in workerd against real vllm-sim processes on 127.0.0.1:
// a conversation returns to the backend holding its history while that backend is not backed up,
// a hot prefix gains a replica once its holder's prefill backlog exceeds a cold prefill elsewhere,
// and each backend's prefill and decode rates are learned from what its requests measured.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitFor, waitReady, onlyPool } from "./lib/harness.mjs";

const MODEL = "routing-model";

let gw;
const sims = [];
let pools = 0;

before(async () => {
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500" } });
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

afterEach(async () => {
  for (let p = 1; p <= pools; p++) {
    await waitFor(async () => {
      const s = await (await gw.admin(`/admin/pools/r${p}`)).json();
      return s.in_flight === 0 ? s : null;
    }, { timeoutMs: 10000, what: `pool r${p} leases back to zero` });
  }
});

/** A pool of `n` sims (extra vllm-sim args per backend) under the default policy. */
async function freshPool(n, { args = () => [], settings = {} } = {}) {
  pools += 1;
  const name = `r${pools}`;
  const r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: settings });
  assert.equal(r.status, 200, await r.text());
  const summary = await (await gw.admin(`/admin/pools/${name}`)).json();
  assert.equal(summary.settings?.policy ?? summary.policy, "predicted_latency", JSON.stringify(summary));
  const backends = [];
  for (let i = 0; i < n; i++) {
    const sim = await startSim(["--model", MODEL, "--seed", String(pools * 10 + i), ...args(i)]);
    sims.push(sim);
    const id = `${name}-b${i}`;
    const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: name, models: [MODEL], id } });
    assert.equal(reg.status, 201, await reg.text());
    backends.push({ id, sim });
  }
  for (const b of backends) await waitReady(gw, b.id);
  return { name, backends };
}

/** Only pool `name` serves the test's models. */
const only = (name) => onlyPool(gw, name);

async function chat(messages, { stream = false, max_tokens = 4 } = {}) {
  const r = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: MODEL, messages, stream, max_tokens }),
  });
  const text = await r.text();
  assert.equal(r.status, 200, text);
  const predicted = r.headers.get("x-gateway-predicted-ttft-ms");
  assert.match(predicted ?? "", /^\d+$/, "x-gateway-predicted-ttft-ms is whole milliseconds");
  const backend = r.headers.get("x-gateway-backend");
  const receipt = parseReceipt(r.headers.get("x-gateway-route-receipt"));
  // The receipt names the backend chosen (which served: no fallback here) and the same prediction.
  assert.equal(receipt.backend, backend, JSON.stringify(receipt));
  assert.equal(receipt.predicted_ttft_ms, Number(predicted), JSON.stringify(receipt));
  return {
    backend,
    decision: r.headers.get("x-gateway-decision"),
    predicted: Number(predicted),
    receipt,
    text,
  };
}

/** `backend=<id>;predicted_ttft_ms=<n>[;alt=<id>;alt_predicted_ttft_ms=<n>]` as an object. */
function parseReceipt(header) {
  assert.match(
    header ?? "",
    /^backend=[^;]+;predicted_ttft_ms=\d+(;alt=[^;]+;alt_predicted_ttft_ms=\d+)?$/,
    `x-gateway-route-receipt: ${header}`,
  );
  const out = Object.fromEntries(header.split(";").map((kv) => kv.split("=")));
  for (const k of ["predicted_ttft_ms", "alt_predicted_ttft_ms"]) if (k in out) out[k] = Number(out[k]);
  return out;
}

/** Deterministic filler of about `tokens` tokens (the gateway estimates 4 bytes a token). */
const words = (seed, tokens) => Array.from({ length: tokens }, (_, i) => `w${(seed * 7919 + i * 31) % 9973}`).join(" ");

test("predicted_latency: a conversation returns to the backend holding its history", async () => {
  const p = await freshPool(3, { args: () => ["--time-scale", "20"] });
  await only(p.name);
  const homes = new Set();
  for (let c = 0; c < 4; c++) {
    const messages = [{ role: "system", content: `conversation ${c}: ${words(c, 300)}` }];
    let home = null;
    for (let turn = 0; turn < 4; turn++) {
      messages.push({ role: "user", content: `turn ${turn}: ${words(c * 100 + turn, 40)}` });
      const r = await chat(messages);
      if (turn === 0) home = r.backend;
      else {
        assert.equal(r.backend, home, `conversation ${c} turn ${turn} left its home`);
        assert.equal(r.decision, "cache_hit", `conversation ${c} turn ${turn}`);
      }
      const answer = JSON.parse(r.text).choices[0].message.content;
      messages.push({ role: "assistant", content: answer });
    }
    homes.add(home);
  }
  // Idle backends' predictions tie; ties go to the backend whose cache holds least, so four new
  // conversations use all three backends (a coin toss put all four on one about 1 run in 27).
  assert.equal(homes.size, 3, `four idle-time conversations started on ${[...homes]}`);
});

test("predicted_latency: a hot prefix gains a replica once its holder is backed up", async () => {
  // Real time (scale 1), so prefill queues for real: 200 us a token.
  const p = await freshPool(3, { args: () => ["--time-scale", "1", "--prefill-us-per-token", "200"] });
  await only(p.name);
  const hot = `shared instructions: ${words(42, 1500)}`;
  const warm = await chat([{ role: "system", content: hot }, { role: "user", content: "warm up" }]);
  const holder = warm.backend;
  // Sequential requests behind the hot prefix stay on its holder: nothing is queued there.
  let idlePrediction = 0;
  for (let i = 0; i < 3; i++) {
    const r = await chat([{ role: "system", content: hot }, { role: "user", content: `quick question ${i}` }]);
    assert.equal(r.backend, holder, "an idle holder keeps its prefix's traffic");
    assert.equal(r.decision, "cache_hit");
    idlePrediction = Math.max(idlePrediction, r.predicted);
  }
  // A burst of requests with long unique tails: each adds its tail's prefill to the holder's
  // queue until waiting there costs more than the whole prompt elsewhere.
  const burst = await Promise.all(
    Array.from({ length: 10 }, (_, i) =>
      chat([{ role: "system", content: hot }, { role: "user", content: `long question ${i}: ${words(500 + i, 500)}` }], { stream: true })),
  );
  const served = new Set(burst.map((r) => r.backend));
  // The queue shows in the predictions the responses carry: the burst's slowest predicted start
  // on the holder is well above an idle holder's.
  const onHolder = burst.filter((r) => r.backend === holder).map((r) => r.predicted);
  assert.ok(Math.max(...onHolder) > 2 * idlePrediction + 20, `predicted ${onHolder} ms on the holder, ${idlePrediction} ms idle`);
  assert.ok(served.size >= 2, `the burst all went to ${[...served]}`);
  assert.ok(burst.some((r) => r.decision === "spill"), `decisions: ${burst.map((r) => r.decision)}`);
  assert.ok(burst.filter((r) => r.backend === holder).length >= 2, "the holder kept part of the burst");
  // The new holder is recorded as holding the prefix, so later traffic for it is shared.
  const replica = p.backends.find((b) => b.id !== holder && served.has(b.id));
  assert.ok(replica, "a second backend took part of the burst");
  const view = await (await gw.admin(`/admin/backends/${replica.id}`)).json();
  assert.ok(view.affinity_blocks >= 90, `the replica records the hot prefix (${view.affinity_blocks} blocks)`);
});

test("predicted_latency: rates are learned from a backend of a different speed", async () => {
  // A sim three times slower at prefill than the pool's configured 100 us a token.
  const p = await freshPool(1, { args: () => ["--time-scale", "1", "--prefill-us-per-token", "300"] });
  await only(p.name);
  const id = p.backends[0].id;
  const before = (await (await gw.admin(`/admin/backends/${id}`)).json()).timing;
  assert.equal(before.prefill_us_per_token, 100, JSON.stringify(before));
  for (let i = 0; i < 24; i++) {
    await chat([{ role: "user", content: `cold prompt ${i}: ${words(1000 + i, 800)}` }], { stream: true, max_tokens: 2 });
  }
  const learned = await waitFor(async () => {
    const t = (await (await gw.admin(`/admin/backends/${id}`)).json()).timing;
    return t.observations >= 20 ? t : null;
  }, { what: "releases learned from" });
  assert.ok(
    learned.prefill_us_per_token > 220 && learned.prefill_us_per_token < 400,
    `learned ${learned.prefill_us_per_token.toFixed(0)} us/token for a 300 us/token backend`,
  );
});

test("predicted_latency: the route receipt names the best alternative and what it was predicted", async () => {
  const p = await freshPool(2, { args: () => ["--time-scale", "20"] });
  await only(p.name);
  const ids = p.backends.map((b) => b.id);
  // A cold prompt: the receipt names the other backend as the alternative.
  const first = await chat([{ role: "user", content: words(501, 2000) }], { max_tokens: 2 });
  assert.ok(ids.includes(first.backend), first.backend);
  assert.ok(ids.includes(first.receipt.alt), JSON.stringify(first.receipt));
  assert.notEqual(first.receipt.alt, first.backend);
  assert.ok(first.receipt.alt_predicted_ttft_ms >= 0);
  const again = await chat([{ role: "user", content: words(501, 2000) }], { max_tokens: 2 });
  // The same prompt again: its holder is chosen, and the alternative (a cold prefill) is slower.
  assert.equal(again.backend, first.backend);
  assert.ok(again.receipt.alt_predicted_ttft_ms > again.receipt.predicted_ttft_ms, JSON.stringify(again.receipt));
});
