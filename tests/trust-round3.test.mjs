// Issue 42 (trust round 3), the scenarios a user hits, against the built Worker under Miniflare and
// real vllm-sim processes on 127.0.0.1: a partial `PUT /admin/pools/{pool}` keeps the pool's
// residency (it is lifted only by an explicit `null`); the round trip measured to a pool does not
// include the wait for the client's rate limiter; vLLM gets a request id the gateway made, never the
// client's (two clients sending one id do not collide); a client (a Worker calling through a service
// binding, whose hang-up fires the request's signal) that leaves before the first byte is charged
// its prompt, streamed, or the estimate, whole (item 2), and one that hangs up mid-stream from a
// speculative-decoding backend the prompt plus the tokens it received, counted by the backend's
// tokenizer, not one per event; a client reading slowly holds no lease once the
// backend is done, and one that falls RELAY_BUFFER_BYTES behind is cut off (item 5). Native tests
// cover the rules behind them (protocol/src/settings.rs, routing-core: stream/settle.rs, coordinator
// waiting room, guesses); tests/ahead.test.mjs (item 11) and tests/hop.test.mjs (items 6, 7) the rest.
import { test, after } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startGatewayServer, startSim, waitFor, waitReady, drained, poolState, setFaults, parseMetrics, metricValue, stalledReader, readRest } from "./lib/harness.mjs";

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

// ---- 2. A hang-up never refunds the prompt --------------------------------------------------------

/** A Worker calling the gateway through a service binding, the way another Worker would be its
 * client: it sends the request it gets (`?after=ms`: and hangs up that long after sending it) and
 * answers with the gateway's status and body, or 499 when it hung up. */
const HANGING_CLIENT = `
export default {
  async fetch(request, env) {
    const after = Number(new URL(request.url).searchParams.get("after") ?? "0");
    const left = new AbortController();
    if (after > 0) setTimeout(() => left.abort(), after);
    try {
      const r = await env.GATEWAY.fetch("http://gateway.test/v1/chat/completions", {
        method: "POST", headers: request.headers, body: await request.text(), signal: left.signal,
      });
      return new Response(await r.text(), { status: r.status, headers: r.headers });
    } catch (e) {
      return new Response(String(e), { status: 499 });
    }
  },
};`;

test("a client that hangs up before the first byte, streamed or not, is charged its prompt at least, never refunded (the request's signal fires)", async () => {
  // Through a service binding the gateway's request signal fires as soon as its caller hangs up
  // (as on Cloudflare for a client's disconnect), before any byte of the answer.
  const TPM = 3000; // 50 tokens a second of refill: a ~2,000-token prompt is 40 s of it
  const [streamKey, wholeKey] = ["sk-r3-gone-stream", "sk-r3-gone-whole"];
  const g = await startGateway({
    bindings: { PROBE_INTERVAL_MS: "500", CLIENT_API_KEYS: `${streamKey},${wholeKey}`, RATE_LIMIT_TPM: String(TPM) },
    extraWorkers: [{ name: "client", modules: true, script: HANGING_CLIENT, serviceBindings: { GATEWAY: "gateway" } }],
  });
  closers.push(() => g.close());
  const name = "r3-gone";
  const model = "r3-gone-model";
  const p = await pool(g, name, model, {}, ["--time-scale", "1", "--max-model-len", "8192"]);
  const client = await g.mf.getWorker("client");
  const prompt = "lorem ipsum ".repeat(670); // ~2,000 tokens by the gateway's estimate
  const left = {};
  for (const [key, stream] of [[streamKey, true], [wholeKey, false]]) {
    // The backend would answer nothing for 30 s: the client leaves after 1.5 s.
    await setFaults(p.sim, { first_byte_delay_ms: 30000 });
    const r = await client.fetch("http://client.test/?after=1500", {
      method: "POST",
      headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
      body: JSON.stringify({ model, messages: [{ role: "user", content: prompt }], stream, max_tokens: 100, ignore_eos: true }),
    });
    assert.equal(r.status, 499, await r.text());
    // The hang-up ended the lease long before the backend's first byte would have.
    await drained(g, name, { timeoutMs: 15000 });
    await setFaults(p.sim, {});
    await new Promise((resolve) => setTimeout(resolve, 1000)); // the settlement follows the release
    const after = await chat(g, model, { key, max_tokens: 1 });
    assert.equal(after.status, 200, await after.clone().text());
    await after.text();
    left[stream ? "stream" : "whole"] = Number(after.headers.get("x-ratelimit-remaining-tokens"));
  }
  // Refunded, about 3,000 would be left; charged the prompt (streamed) or the ~2,100 estimate
  // (whole), about 1,000 plus the refill.
  assert.ok(left.stream < TPM - 600, `a streamed request's hang-up was refunded its prompt: ${JSON.stringify(left)}`);
  assert.ok(left.whole < TPM - 600, `a whole answer's hang-up was refunded: ${JSON.stringify(left)}`);
  await drained(g, name);
});

/** A Worker reading the gateway's stream through a service binding, as a client would: once it
 * has `?tokens=` tokens of answer text (vllm-sim's are 4 bytes each) and nothing more came for
 * 500 ms, it hangs up, and answers with what it received: `{tokens, events}`. */
const READING_CLIENT = `
export default {
  async fetch(request, env) {
    const want = Number(new URL(request.url).searchParams.get("tokens"));
    const left = new AbortController();
    const r = await env.GATEWAY.fetch("http://gateway.test/v1/chat/completions", {
      method: "POST", headers: request.headers, body: await request.text(), signal: left.signal,
    });
    if (r.status !== 200) return new Response(await r.text(), { status: r.status });
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "", text = "", events = 0;
    let quiet = null;
    for (;;) {
      const next = reader.read();
      const got = text.length >= 4 * want
        ? await Promise.race([next, new Promise((res) => { quiet = setTimeout(() => res(null), 500); })])
        : await next;
      clearTimeout(quiet);
      if (got === null || got.done) break;
      buf += dec.decode(got.value, { stream: true });
      let end;
      while ((end = buf.indexOf("\\n\\n")) >= 0) {
        const data = buf.slice(0, end).replace(/^data: /, "");
        buf = buf.slice(end + 2);
        if (data === "[DONE]") continue;
        const content = JSON.parse(data).choices?.[0]?.delta?.content;
        if (content) { text += content; events += 1; }
      }
    }
    left.abort();
    return Response.json({ tokens: text.length / 4, events });
  },
};`;

test("a client that hangs up mid-stream from a speculative-decoding backend is charged the prompt plus the tokens it received, not one per event", async () => {
  // vLLM with speculative decoding streams each step's accepted draft tokens and the sampled one
  // as one event (vllm-sim --spec-tokens 2: 1 to 3 tokens an event). The backend stalls after 30
  // tokens; the client, having read them all, hangs up (through a service binding the gateway's
  // request signal fires): nothing was in flight, so what it received is exactly known.
  const key = "sk-r3-spec";
  const TPM = 180;
  const logs = [];
  const g = await startGateway({
    bindings: { PROBE_INTERVAL_MS: "500", CLIENT_API_KEYS: key, RATE_LIMIT_TPM: String(TPM), STREAM_IDLE_TIMEOUT_MS: "30000" },
    extraWorkers: [{ name: "client", modules: true, script: READING_CLIENT, serviceBindings: { GATEWAY: "gateway" } }],
    options: {
      handleRuntimeStdio: (stdout, stderr) => {
        for (const stream of [stdout, stderr]) {
          let rest = "";
          stream.on("data", (d) => {
            const lines = (rest + d).split("\n");
            rest = lines.pop();
            logs.push(...lines);
          });
        }
      },
    },
  });
  closers.push(() => g.close());
  const name = "r3-spec";
  const model = "r3-spec-model";
  await pool(g, name, model, {}, ["--time-scale", "1", "--spec-tokens", "2", "--fault-stall-after-tokens", "30"]);
  const client = await g.mf.getWorker("client");
  // The key's token bucket (TPM a minute's capacity, 3 tokens a second of refill) read before and
  // after: a first request is charged its estimate (the prompt's estimate P, plus 1), then
  // settled with its usage; what is left after the third says what the hang-up was charged.
  const started = Date.now();
  const first = await chat(g, model, { key, max_tokens: 1 });
  assert.equal(first.status, 200, await first.clone().text());
  const P = TPM - 1 - Number(first.headers.get("x-ratelimit-remaining-tokens"));
  const firstUsage = (await first.json()).usage;
  const r = await client.fetch("http://client.test/?tokens=30", {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
    body: JSON.stringify({ model, messages: [{ role: "user", content: "count" }], stream: true, max_tokens: 60, ignore_eos: true }),
  });
  assert.equal(r.status, 200, await r.clone().text());
  const received = await r.json();
  assert.ok(received.tokens >= 30, JSON.stringify(received));
  assert.ok(received.events < received.tokens, `several tokens in some events: ${JSON.stringify(received)}`);
  await drained(g, name, { timeoutMs: 15000 });
  // The access log line shows what the client was charged (the settlement's own figures): the
  // prompt's estimate and every token it received, counted by the backend's tokenizer.
  const json = (l) => { try { return JSON.parse(l.slice(l.indexOf("{"))); } catch { return null; } };
  const line = await waitFor(() => logs.filter((l) => l.includes('"event":"request"')).map(json)
    .find((l) => l?.pool === name && l.outcome === "cancelled"), { what: "the hang-up's access log line" });
  // The bucket: what the third request leaves is TPM less the first's usage, the hang-up's
  // charge and the third's estimate, plus what refilled meanwhile (3 tokens a second).
  await new Promise((resolve) => setTimeout(resolve, 500)); // the settlement follows the log line
  const third = await chat(g, model, { key, max_tokens: 1 });
  assert.equal(third.status, 200, await third.clone().text());
  await third.text();
  const refilled = ((Date.now() - started) / 1000) * (TPM / 60);
  const left = Number(third.headers.get("x-ratelimit-remaining-tokens"));
  const charged = TPM - (firstUsage.prompt_tokens + firstUsage.completion_tokens) - (P + 1) - left;
  const expected = P + received.tokens;
  assert.ok(charged <= expected + 1 && charged >= expected - refilled - 1,
    `the hang-up was charged about ${charged} (up to ${refilled.toFixed(1)} refilled), not the prompt ${P} plus the ${received.tokens} tokens received (${received.events} events)`);
  assert.equal(line.completion_tokens, received.tokens, `charged ${line.completion_tokens} completion tokens for ${received.tokens} received in ${received.events} events: ${JSON.stringify(line)}`);
  assert.ok(line.prompt_tokens > 0, JSON.stringify(line));
  assert.equal(line.prompt_tokens, P, "the prompt's estimate");
  assert.ok(!logs.some((l) => l.includes("counted one per event")), "the count fell back to one per event");
});

// ---- 5. A slow reader holds no lease once the backend is done ------------------------------------

const bigSim = ["--time-scale", "1000", "--max-model-len", "70000", "--kv-blocks", "8192"];

test("a client reading slowly holds no lease once the backend is done, and still gets the whole answer within RELAY_BUFFER_BYTES", async () => {
  // 60,000 tokens (about 10 MB of events), produced within seconds: more than the sockets
  // between the client and the gateway absorb, less than the relay may hold for the client.
  const g = await gateway({ PROBE_INTERVAL_MS: "500", RELAY_BUFFER_BYTES: String(32 << 20), SLOW_CLIENT_TIMEOUT_MS: "60000" }, { server: true });
  const name = "r3-slow";
  const model = "r3-slow-model";
  await pool(g, name, model, {}, bigSim);
  const { reader, close } = await stalledReader(g, model, 60000);
  closers.push(close);
  // The client reads nothing more until the pool's lease is gone: with the backend held up by
  // the client's pace, it never would be.
  await waitFor(async () => (await poolState(g, name)).in_flight === 0, { timeoutMs: 60000, intervalMs: 250, what: "the lease ended with the backend's work while the client was not reading" });
  // Then it reads slowly, and gets every token and the end.
  const rest = await readRest(reader, 5);
  assert.equal(rest.error, null, String(rest.error));
  assert.ok(rest.text.trimEnd().endsWith("data: [DONE]"), rest.text.slice(-200));
  assert.ok(!rest.text.includes("\"error\""));
  const m = parseMetrics(await (await g.admin("/metrics")).text());
  assert.equal(metricValue(m, "llm_gateway_request_outcomes_total", { backend: `${name}-b0`, outcome: "success" }), 1);
});

test("a client that falls RELAY_BUFFER_BYTES behind the backend is cut off, its lease released and nobody blamed", async () => {
  const g = await gateway({ PROBE_INTERVAL_MS: "500", RELAY_BUFFER_BYTES: String(256 << 10), SLOW_CLIENT_TIMEOUT_MS: "60000" }, { server: true });
  const name = "r3-cut";
  const model = "r3-cut-model";
  await pool(g, name, model, {}, bigSim);
  const { reader, close } = await stalledReader(g, model, 60000);
  closers.push(close);
  // Released long before the 60 s slow-client bound: the relay's bound cut the client.
  await waitFor(async () => (await poolState(g, name)).in_flight === 0, { timeoutMs: 30000, intervalMs: 250, what: "the lease released" });
  const rest = await readRest(reader);
  assert.ok(rest.error !== null || !rest.text.includes("data: [DONE]"), "a cut-off client got a complete-looking stream");
  const m = parseMetrics(await (await g.admin("/metrics")).text());
  const outcome = (o) => metricValue(m, "llm_gateway_request_outcomes_total", { backend: `${name}-b0`, outcome: o }) ?? 0;
  assert.equal(outcome("cancelled"), 1);
  assert.equal(outcome("transport") + outcome("timeout") + outcome("success"), 0);
  assert.equal((await (await g.admin(`/admin/backends/${name}-b0`)).json()).breaker, "closed");
});
