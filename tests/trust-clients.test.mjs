// Issue 23, the clients' part: nothing one client does takes capacity, money or data from anyone
// else. The built Worker in workerd, real vllm-sim processes on 127.0.0.1, the OpenAI Node client
// where a client reads. A started response is paid for (a hang-up mid-stream is charged what was
// streamed; a refused request refunds; token buckets survive a restart); a lease follows the
// backend's work, not the client's reading (a stalled reader gives its share back when the
// backend is done, and is cut off past RELAY_BUFFER_BYTES); a stream complete with
// `data: [DONE]` stays complete whatever the socket does next; the key surface stays closed
// (REQUIRE_CLIENT_KEYS, deleting the last minted key); the rate limiter, asked beside the lease
// call, never lets a refused request reach a backend or keep a lease or a queue place; with
// RATE_LIMIT_AHEAD a key well within its limits does not wait for the limiter, and one near or over
// them is checked as before. After each test, leases are back to zero.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";
import { startGatewayServer, startSim, waitFor, waitReady, tempDir, setFaults, parseMetrics, metricValue, drained, poolState, stalledReader, readRest } from "./lib/harness.mjs";

const KEYS = ["sk-trust-hangup", "sk-trust-refund", "sk-trust-restart", "sk-trust-steps", "sk-trust-spare", "sk-trust-queued", "sk-trust-blocker", "sk-trust-ahead"];
const TPM = 1000;
const SLOW_CLIENT_TIMEOUT_MS = 3000;

const sims = [];
const closers = [];
let persist;
let limited; // client keys and a 1,000 tokens-per-minute limit
let open; // no keys: slow readers and resets (its streams are larger than a minute's allowance)
let far; // as `limited`, with the rate limiter modelled 300 ms away (started by the first test that needs it)
let poolCount = 0;

const limitedBindings = {
  PROBE_INTERVAL_MS: "500",
  CLIENT_API_KEYS: KEYS.join(","),
  RATE_LIMIT_TPM: String(TPM),
  SLOW_CLIENT_TIMEOUT_MS: String(SLOW_CLIENT_TIMEOUT_MS),
};

before(async () => {
  persist = tempDir();
  limited = await startGatewayServer({ bindings: limitedBindings, persistDir: persist.dir });
  open = await startGatewayServer({
    bindings: { PROBE_INTERVAL_MS: "500", SLOW_CLIENT_TIMEOUT_MS: String(SLOW_CLIENT_TIMEOUT_MS) },
  });
});

after(async () => {
  for (const c of closers.reverse()) await c();
  await Promise.all(sims.map((s) => s.close()));
  await limited?.close();
  await open?.close();
  persist?.cleanup();
});

/** The gateway whose rate limiter is modelled 300 ms away (its pools are local): a pool's answer
 * comes back before the limiter's, so what the overlap does is what a test sees. */
async function farGateway() {
  if (!far) {
    far = await startGatewayServer({
      bindings: { ...limitedBindings, SIMULATE_NETWORK: "true", SIMULATE_LIMITER_RTT_MS: "300" },
    });
    closers.push(() => far.close());
  }
  return far;
}

async function sim(args) {
  const s = await startSim(args);
  sims.push(s);
  return s;
}

/** A fresh pool on gateway `g` with one sim serving its own model; returns { name, model, sim, id }. */
async function freshPool(g, simArgs = [], settings = {}) {
  poolCount += 1;
  const name = `trust${poolCount}`;
  const model = `model-${name}`;
  const { backend = {}, ...pool } = settings;
  const put = await g.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy: "round_robin", ...pool } });
  assert.equal(put.status, 200, await put.text());
  const s = await sim(["--model", model, "--seed", String(poolCount), ...simArgs]);
  const id = `${name}-b0`;
  const reg = await g.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models: [model], id, ...backend } });
  assert.equal(reg.status, 201, await reg.text());
  await waitReady(g, id);
  return { name, model, sim: s, id };
}

const client = (g, apiKey = "none") => new OpenAI({ baseURL: `${g.url}/v1`, apiKey, maxRetries: 0 });

/** A raw chat request (for statuses and bodies the OpenAI client would turn into exceptions). */
async function chat(g, model, { key, stream = false, max_tokens = 8, signal, extra = {} } = {}) {
  const headers = { "content-type": "application/json" };
  if (key) headers.authorization = `Bearer ${key}`;
  const r = await g.fetch("/v1/chat/completions", {
    method: "POST",
    headers,
    body: JSON.stringify({ model, messages: [{ role: "user", content: "count" }], stream, max_tokens, ignore_eos: true, ...extra }),
    signal,
  });
  return { status: r.status, text: await r.text(), headers: r.headers };
}

async function metrics(g) {
  const r = await g.admin("/metrics");
  assert.equal(r.status, 200);
  return parseMetrics(await r.text());
}
const outcomes = (m, backend, outcome) => metricValue(m, "llm_gateway_request_outcomes_total", { backend, outcome }) ?? 0;

// ---- Money ----------------------------------------------------------------------------------

test("a hang-up after N of M streamed tokens is charged about N + prompt, not nothing", async () => {
  // 10 ms a token: 900 tokens take 9 s, so the client hangs up long before the end.
  const p = await freshPool(limited, ["--time-scale", "1"]);
  const key = KEYS[0];
  const openai = client(limited, key);
  // Estimated at admission as prompt + 900 (fits the 1,000-token minute).
  const stream = await openai.chat.completions.create({
    model: p.model, messages: [{ role: "user", content: "count" }], stream: true, max_tokens: 900,
    // @ts-ignore vLLM's sampling parameter
    ignore_eos: true,
  });
  let tokens = 0;
  for await (const chunk of stream) {
    if (chunk.choices[0]?.delta?.content) tokens += 1;
    if (tokens >= 500) break; // leaving the loop aborts the request: the client hangs up
  }
  assert.equal(tokens, 500);
  await drained(limited, p.name);
  // Charged ~510 (500 streamed + the prompt), ~490 are left plus what refilled meanwhile (17 a
  // second): an 800-token request must wait (charged nothing, as before, it would fit at once)...
  const over = await chat(limited, p.model, { key, max_tokens: 800 });
  assert.equal(over.status, 429, `a request over what is left was admitted: the hang-up was not charged (${over.text.slice(0, 200)})`);
  assert.equal(JSON.parse(over.text).error.code, "rate_limit_exceeded");
  // ...but the estimate (910) was not kept either: a 400-token request fits.
  const under = await chat(limited, p.model, { key, max_tokens: 400 });
  assert.equal(under.status, 200, under.text);
  await drained(limited, p.name);
});

test("a request every pool refuses gives its reservation back", async () => {
  const p = await freshPool(limited, ["--time-scale", "1000"]);
  const key = KEYS[1];
  // The only backend drains: no pool has anybody to grant, the request is refused.
  const drain = await limited.admin(`/admin/backends/${p.id}`, { method: "PATCH", body: { drain: true } });
  assert.equal(drain.status, 200, await drain.text());
  const refused = await chat(limited, p.model, { key, max_tokens: 900 });
  assert.ok([404, 503].includes(refused.status), `${refused.status} ${refused.text}`);
  const undrain = await limited.admin(`/admin/backends/${p.id}`, { method: "PATCH", body: { drain: false } });
  assert.equal(undrain.status, 200, await undrain.text());
  await waitReady(limited, p.id);
  // Without the refund the bucket would need ~55 s to fit another 900.
  const again = await waitFor(async () => {
    const r = await chat(limited, p.model, { key, max_tokens: 900 });
    return r.status === 200 ? r : null;
  }, { timeoutMs: 4000, intervalMs: 300, what: "the refunded reservation" });
  assert.equal(again.status, 200);
  await drained(limited, p.name);
});

test("the limiter is asked beside the lease call: a refused request never reaches a backend or keeps a lease, and a refused client is asked first", async () => {
  // The pool's grant comes back before the limiter's answer.
  const far = await farGateway();
  const p = await freshPool(far, ["--time-scale", "1000"]);
  const key = KEYS[4];
  const decisions = async () => (await metrics(far))
    .filter((s) => s.name === "llm_gateway_decisions_total" && s.labels.pool === p.name)
    .reduce((n, s) => n + s.value, 0);
  const served = async () => {
    const r = await fetch(`${p.sim.url}/metrics`);
    return parseMetrics(await r.text()).filter((s) => s.name === "vllm:request_success_total").reduce((n, s) => n + s.value, 0);
  };
  // 900 tokens generated: the key has about 90 left of its minute.
  const big = await chat(far, p.model, { key, max_tokens: 900 });
  assert.equal(big.status, 200, big.text);
  // The OpenAI API's rate-limit headers, from the limiter's answer to this request.
  assert.equal(big.headers.get("x-ratelimit-limit-tokens"), "1000");
  const remaining = Number(big.headers.get("x-ratelimit-remaining-tokens"));
  assert.ok(remaining >= 0 && remaining < 100, `remaining tokens ${remaining} after a 900-token request`);
  assert.match(big.headers.get("x-ratelimit-reset-tokens"), /^(\d+m)?\d+(ms|s)$/);
  assert.equal(big.headers.get("x-ratelimit-limit-requests"), null, "no request limit set");
  await drained(far, p.name);
  const [decided, done] = [await decisions(), await served()];
  assert.ok(decided >= 1 && done >= 1, `the served request was not counted (${decided} decisions, ${done} served)`);
  // Asked beside the lease call: the pool granted before the refusal came, but the backend was
  // never fetched and the lease went back unused.
  const first = await chat(far, p.model, { key, max_tokens: 500 });
  assert.equal(first.status, 429, first.text);
  assert.equal(JSON.parse(first.text).error.code, "rate_limit_exceeded");
  await drained(far, p.name);
  assert.equal(await decisions(), decided + 1, "the first refused request was not asked beside its lease call");
  assert.equal(outcomes(await metrics(far), p.id, "cancelled"), 1, "the unused lease was not released as cancelled");
  // Refused once, the client is asked first until its Retry-After: no pool is asked again.
  for (let i = 0; i < 3; i++) {
    const again = await chat(far, p.model, { key, max_tokens: 500 });
    assert.equal(again.status, 429, again.text);
    assert.ok(Number(again.headers.get("retry-after")) >= 1);
  }
  assert.equal(await decisions(), decided + 1, "a client refused recently was routed before the limiter answered");
  assert.equal(await served(), done, "a refused request reached the backend");
  const state = await drained(far, p.name);
  assert.equal(state.in_flight, 0);
});

test("with RATE_LIMIT_AHEAD a key well within its limits is served without waiting for its limiter, and still charged; near them it waits, and over them it is refused", async () => {
  // The limiter modelled 1.5 s away: a request that waits for its answer takes longer than that,
  // one served ahead of it a few milliseconds. The key has 1,000 tokens a minute.
  const g = await startGatewayServer({
    bindings: { ...limitedBindings, RATE_LIMIT_AHEAD: "true", SIMULATE_NETWORK: "true", SIMULATE_LIMITER_RTT_MS: "1500" },
  });
  closers.push(() => g.close());
  const p = await freshPool(g, ["--time-scale", "1000"]);
  const key = KEYS[7];
  const served = async () => {
    const r = await fetch(`${p.sim.url}/metrics`);
    return parseMetrics(await r.text()).filter((s) => s.name === "vllm:request_success_total").reduce((n, s) => n + s.value, 0);
  };
  const timed = async (max_tokens) => {
    const t0 = performance.now();
    const r = await chat(g, p.model, { key, max_tokens });
    return { ...r, ms: performance.now() - t0 };
  };
  // Nothing known of the key yet: the first request waits for the limiter.
  const first = await timed(8);
  assert.equal(first.status, 200, first.text);
  assert.ok(first.ms >= 1500, `the first request did not wait for the limiter (${first.ms.toFixed(0)} ms)`);
  // Nearly all of its minute left: about 410 tokens leave more than half, served ahead.
  const ahead = await timed(400);
  assert.equal(ahead.status, 200, ahead.text);
  assert.ok(ahead.ms < 1000, `a key well within its limit waited for the limiter (${ahead.ms.toFixed(0)} ms)`);
  // Its rate-limit headers are the isolate's estimate, the charge in flight counted.
  const [r1, r2] = [first, ahead].map((r) => Number(r.headers.get("x-ratelimit-remaining-tokens")));
  assert.ok(r1 > 900 && r2 <= r1 - 400, `remaining tokens ${r1} then ${r2}`);
  // With those 410 still on their way to the limiter, another 300 would leave under half: it
  // waits (counted alone it would have gone ahead), and fits.
  const near = await timed(292);
  assert.equal(near.status, 200, near.text);
  assert.ok(near.ms >= 1500, `a request that would leave under half went ahead (${near.ms.toFixed(0)} ms)`);
  const before = await served();
  // About 500 more do not fit, because the request served ahead was charged (without its charge
  // they would): refused, as without the setting, and never served.
  const over = await timed(492);
  assert.equal(over.status, 429, `the request served ahead was not charged: ${over.text}`);
  assert.equal(JSON.parse(over.text).error.code, "rate_limit_exceeded");
  assert.equal(await served(), before, "a refused request reached the backend");
  const state = await drained(g, p.name);
  assert.equal(state.in_flight, 0);
});

test("a refusal by the limiter while the request waits in the pool's queue ends the wait: 429, nothing left queued", async () => {
  const far = await farGateway();
  // One sequence at a time, queueing on: a 300-token blocker (3 s) holds the only slot.
  const slow = await freshPool(far, ["--time-scale", "1", "--max-num-seqs", "1"], {
    admission: { enabled: true, poll_ms: 1000, max_wait_ms: 20000 },
    backend: { max_num_seqs: 1 },
  });
  const fast = await freshPool(far, ["--time-scale", "1000"]);
  const key = KEYS[5];
  // 900 tokens generated elsewhere: the key has about 90 left of its minute.
  const big = await chat(far, fast.model, { key, max_tokens: 900 });
  assert.equal(big.status, 200, big.text);
  const blocker = chat(far, slow.model, { key: KEYS[6], max_tokens: 300 });
  await waitFor(async () => (await poolState(far, slow.name)).in_flight === 1, { what: "the blocker's lease" });
  // Asked beside its lease call, the over-limit request waits in the queue until the limiter's
  // refusal comes (300 ms), not until the blocker is done.
  const over = chat(far, slow.model, { key, max_tokens: 500 });
  await waitFor(async () => (await poolState(far, slow.name)).queue.length === 1, { intervalMs: 20, what: "the request queued" });
  const refused = await over;
  assert.equal(refused.status, 429, refused.text);
  assert.equal(JSON.parse(refused.text).error.code, "rate_limit_exceeded");
  assert.equal(refused.headers.get("x-gateway-queue-drop"), null, "refused by the queue, not the limiter");
  const state = await waitFor(async () => {
    const s = await poolState(far, slow.name);
    return s.queue.length === 0 ? s : null;
  }, { what: "the queue empty" });
  assert.equal(state.in_flight, 1, "the blocker ended before the refusal: the test saw nothing");
  const done = await blocker;
  assert.equal(done.status, 200, done.text);
  await drained(far, slow.name);
  const r = await fetch(`${slow.sim.url}/metrics`);
  const served = parseMetrics(await r.text()).filter((x) => x.name === "vllm:request_success_total").reduce((n, x) => n + x.value, 0);
  assert.equal(served, 1, "the refused request reached the backend");
});

test("a hang-up while waiting for the first byte, and one mid-stream, leave leases and reservations at zero", async () => {
  // (A hang-up while queued before the grant is not seen by workerd under Miniflare until it
  // writes to the socket, so it cannot be exercised here; admission's own tests cover the queue.)
  const p = await freshPool(limited, ["--time-scale", "1"]);
  const key = KEYS[3];
  // While waiting for the first byte (the backend takes 3 s to answer): the client leaves; the
  // gateway sees it when it first writes, and the request is charged at most the first event.
  await setFaults(p.sim, { first_byte_delay_ms: 3000 });
  const wait = new AbortController();
  const waiting = chat(limited, p.model, { key, stream: true, max_tokens: 900, signal: wait.signal }).catch((e) => e);
  await waitFor(async () => (await poolState(limited, p.name)).in_flight === 1, { what: "the lease granted" });
  wait.abort();
  await waiting;
  await drained(limited, p.name);
  await setFaults(p.sim, {});
  // Mid-stream, right after the first chunk: the lease ends, and the client pays what it got.
  const mid = new AbortController();
  const r = await limited.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
    body: JSON.stringify({ model: p.model, messages: [{ role: "user", content: "count" }], stream: true, max_tokens: 900, ignore_eos: true }),
    signal: mid.signal,
  });
  assert.equal(r.status, 200);
  const reader = r.body.getReader();
  assert.ok(!(await reader.read()).done);
  mid.abort();
  await reader.cancel().catch(() => {});
  await drained(limited, p.name);
  // Neither hang-up kept its 900-token estimate: another 900-token request fits at once.
  const fits = await waitFor(async () => {
    const again = await chat(limited, p.model, { key, max_tokens: 900 });
    return again.status === 200 ? again : null;
  }, { timeoutMs: 8000, intervalMs: 300, what: "the reservations settled" });
  assert.equal(fits.status, 200);
  await drained(limited, p.name);
});

test("token buckets survive a restart of the gateway (written behind to the rate limiter's storage)", async () => {
  const p = await freshPool(limited, ["--time-scale", "1000"]);
  const key = KEYS[2];
  // 900 tokens generated: the key has about 90 left of its minute.
  const big = await chat(limited, p.model, { key, max_tokens: 900 });
  assert.equal(big.status, 200, big.text);
  assert.equal(JSON.parse(big.text).usage.completion_tokens, 900);
  await drained(limited, p.name);
  // The limiter writes its buckets behind, a second after a change (FLUSH_AFTER_MS): a
  // restart loses the charges not yet written.
  await new Promise((resolve) => setTimeout(resolve, 1500));
  await limited.close();
  limited = await startGatewayServer({ bindings: limitedBindings, persistDir: persist.dir });
  await waitReady(limited, p.id);
  // A restarted limiter that forgot the bucket would admit this at once.
  const after = await chat(limited, p.model, { key, max_tokens: 500 });
  assert.equal(after.status, 429, `admitted after the restart: the bucket was not persisted (${after.text.slice(0, 200)})`);
});

// ---- Leases follow the backend's work ---------------------------------------------------------

// (This one passes on main too: on 127.0.0.1 the sockets absorb ~4 MB, so main's relay reached the
// end as well; it guards that ending the lease early neither cuts nor truncates a draining client.)
test("a slow reader gives the backend's share back when the backend is done, then drains the rest", async () => {
  // 20,000 tokens (~4 MB of events) produced at once: vllm-sim finishes them all within a second
  // whatever the client reads (TCP backpressure stops at its HTTP body, not its engine, as in
  // vLLM). The client reads a little at a time, never stalling for the slow-client bound.
  const p = await freshPool(open, ["--time-scale", "1000", "--max-model-len", "40000", "--kv-blocks", "4096"]);
  const slow = await stalledReader(open, p.model, 20000);
  closers.push(slow.close);
  const dec = new TextDecoder();
  let text = "";
  let leaseEndedAt = null; // how much the client had read when the pool's in-flight count hit 0
  const watch = (async () => {
    while (leaseEndedAt === null && !text.includes("data: [DONE]")) {
      if ((await poolState(open, p.name)).in_flight === 0) leaseEndedAt = text.length;
      await new Promise((r) => setTimeout(r, 100));
    }
  })();
  for (;;) {
    const { done, value } = await slow.reader.read();
    if (done) break;
    text += dec.decode(value, { stream: true });
    await new Promise((r) => setTimeout(r, 50));
  }
  await watch;
  // The lease ended while the client still had part of the answer to read, and the client then
  // got all of it: released with the backend's work, not cut off.
  assert.notEqual(leaseEndedAt, null, "the lease outlived the client's reading");
  assert.ok(!text.slice(0, leaseEndedAt).includes("data: [DONE]"));
  assert.ok(text.trimEnd().endsWith("data: [DONE]"), text.slice(-200));
  assert.ok(!text.includes("\"error\""));
  await drained(open, p.name);
  const m = await metrics(open);
  assert.equal(outcomes(m, p.id, "success"), 1);
});

test("a client that stops reading while the backend streams more than the sockets and RELAY_BUFFER_BYTES hold is cut off", async () => {
  // 60,000 tokens (~10 MB of events) produced at once: more than the sockets absorb and the
  // relay's default 4 MiB hold for a client that never reads again (issue 42, item 5: the relay
  // never holds the backend up; a client that far behind is cut off).
  const p = await freshPool(open, ["--time-scale", "1000", "--max-model-len", "70000", "--kv-blocks", "8192"]);
  const slow = await stalledReader(open, p.model, 60000);
  closers.push(slow.close);
  // Cut off past the bound: the lease is released while the client's socket is still open.
  const state = await drained(open, p.name, { timeoutMs: SLOW_CLIENT_TIMEOUT_MS + 8000 });
  assert.equal(state.in_flight, 0);
  // The client's stream was failed, not ended as if complete.
  const rest = await readRest(slow.reader);
  assert.ok(rest.error !== null || !rest.text.includes("data: [DONE]"), "a cut-off client got a complete-looking stream");
  // Nobody is blamed: the backend's breaker saw a cancellation, not a failure.
  const m = await metrics(open);
  assert.equal(outcomes(m, p.id, "cancelled"), 1);
  assert.equal(outcomes(m, p.id, "transport") + outcomes(m, p.id, "timeout"), 0);
  assert.equal((await (await open.admin(`/admin/backends/${p.id}`)).json()).breaker, "closed");
});

// ---- A complete stream stays complete ----------------------------------------------------------

test("a stream reset after data: [DONE] reaches the client complete, and its backend is not blamed", async () => {
  const p = await freshPool(open, ["--time-scale", "1000"]);
  await setFaults(p.sim, { reset_after_done: true });
  // The real OpenAI client reads it to the end.
  const stream = await client(open).chat.completions.create({
    model: p.model, messages: [{ role: "user", content: "count" }], stream: true, max_tokens: 12,
    // @ts-ignore vLLM's sampling parameter
    ignore_eos: true,
  });
  let tokens = 0;
  for await (const chunk of stream) if (chunk.choices[0]?.delta?.content) tokens += 1;
  assert.equal(tokens, 12);
  // The bytes: one data: [DONE], last, and no error event anywhere.
  const raw = await chat(open, p.model, { stream: true, max_tokens: 12 });
  assert.equal(raw.status, 200);
  assert.ok(raw.text.trimEnd().endsWith("data: [DONE]"), raw.text.slice(-300));
  assert.equal(raw.text.split("data: [DONE]").length, 2, `more than one end: ${raw.text.slice(-400)}`);
  assert.ok(!raw.text.includes("\"error\""), `an error event after the end: ${raw.text.slice(-400)}`);
  await drained(open, p.name);
  const m = await metrics(open);
  assert.equal(outcomes(m, p.id, "success"), 2);
  assert.equal(outcomes(m, p.id, "transport"), 0);
  assert.equal(metricValue(m, "llm_gateway_stream_resumes_total", {}) ?? 0, 0);
});

// ---- Keys -------------------------------------------------------------------------------------

test("REQUIRE_CLIENT_KEYS keeps the surface closed with no key configured or minted", async () => {
  const g = await startGatewayServer({ bindings: { PROBE_INTERVAL_MS: "500", REQUIRE_CLIENT_KEYS: "true" } });
  closers.push(() => g.close());
  const p = await freshPool(g, ["--time-scale", "1000"]);
  const none = await chat(g, p.model);
  assert.equal(none.status, 401, none.text);
  assert.equal(JSON.parse(none.text).error.code, "invalid_api_key");
  const guessed = await chat(g, p.model, { key: "sk-anything" });
  assert.equal(guessed.status, 401, guessed.text);
  // A minted key opens it for its holder only.
  const minted = await (await g.admin("/admin/keys", { method: "POST", body: { name: "first" } })).json();
  assert.equal((await chat(g, p.model, { key: minted.key })).status, 200);
  assert.equal((await chat(g, p.model)).status, 401);
  await drained(g, p.name);
});

test("deleting the last minted key does not open the surface", async () => {
  const g = await startGatewayServer({ bindings: { PROBE_INTERVAL_MS: "500" } });
  closers.push(() => g.close());
  const p = await freshPool(g, ["--time-scale", "1000"]);
  // Open while no key exists (local development)...
  assert.equal((await chat(g, p.model)).status, 200);
  const minted = await (await g.admin("/admin/keys", { method: "POST", body: { name: "only" } })).json();
  assert.equal((await chat(g, p.model, { key: minted.key })).status, 200);
  assert.equal((await chat(g, p.model)).status, 401);
  const del = await g.admin(`/admin/keys/${minted.id}`, { method: "DELETE" });
  assert.equal(del.status, 200, await del.text());
  // ...closed once a key was minted, with none left: the revoked key and no key alike.
  const revoked = await chat(g, p.model, { key: minted.key });
  assert.equal(revoked.status, 401, revoked.text);
  const none = await chat(g, p.model);
  assert.equal(none.status, 401, `the surface opened when the last key was deleted: ${none.text.slice(0, 200)}`);
  // The listing shows no key (the seal is not one).
  assert.deepEqual((await (await g.admin("/admin/keys")).json()).data, []);
  await drained(g, p.name);
});
