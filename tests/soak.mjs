#!/usr/bin/env node
// Soak: many concurrent OpenAI requests through the gateway while random faults come and go on
// random backends, then proof that nothing was lost: every request either succeeded with a
// complete body (streams end with `data: [DONE]`, carry one id, one role chunk and at most one
// finish, also when resumed on another backend after a mid-stream failure) or got a well-formed
// OpenAI error (JSON, or an SSE error event then `[DONE]` once streaming had started); the gateway
// never answered 500;
// every lease came back (`in_flight` and `in_flight_tokens` of every pool return to 0).
//
// Besides the random faults, the mix holds requests that make the backends fail and clients that
// misbehave: poison requests (a marker every backend answers with vLLM's 500: each must get a
// 5xx-class OpenAI error, never a 200, and must not take the pool from the others), slow readers
// (streams read a chunk at a time with pauses), a backend that redirects to another local listener
// (which must never receive a request) and a backend behind a login page (its HTML must never
// reach a client).
//
//   node tests/soak.mjs [--url http://127.0.0.1:PORT --admin-token T] [--requests 5000]
//        [--concurrency 200] [--sims 4] [--seconds-limit 240] [--seed 1] [--time-scale 50]
//        [--fault-interval-ms 500] [--no-crash] [--keep-backends] [--max-stream-resumes N]
//
// Without --url it serves the built Worker (build/index.js) under Miniflare on a free 127.0.0.1
// port itself. It starts `--sims` vllm-sim processes on 127.0.0.1 (pool "soak"), and stops every
// process it started. Prints one summary JSON object on stdout; exits 1 on any violation. Its
// `streams` part says how many streams failed mid-answer and were resumed, and how many still
// ended with the error event (`--max-stream-resumes 0` gives the figures without resumption).
//
// `runSoak(options)` is the same run as a function (tests/soak.test.mjs runs a reduced one).
import http from "node:http";
import path from "node:path";
import { pathToFileURL } from "node:url";
import { startGatewayServer, startSim, adminFetch, setFaults, parseMetrics, ADMIN_TOKEN } from "./lib/harness.mjs";

export const SOAK_MODEL = "soak-model";
export const SOAK_POOL = "soak";

/** Gateway settings the soak relies on (Miniflare mode sets them; pass them to `wrangler dev`). */
export const SOAK_BINDINGS = {
  PROBE_INTERVAL_MS: "1000",
  FIRST_BYTE_TIMEOUT_MS: "2000",
  RESPONSE_TIMEOUT_MS: "8000",
  STREAM_IDLE_TIMEOUT_MS: "2000",
  MAX_RETRIES: "2",
  // The simulated backends listen on 127.0.0.1.
  ALLOW_IP_BACKENDS: "true",
  // The soak's clients send no key (the Worker is closed by default).
  REQUIRE_CLIENT_KEYS: "false",
};

const DEFAULTS = {
  url: null,
  adminToken: null,
  requests: 5000,
  concurrency: 200,
  sims: 4,
  secondsLimit: 240,
  seed: 1,
  timeScale: 50,
  faultIntervalMs: 500,
  crash: true,
  keepBackends: false,
  maxStreamResumes: null,
  requestTimeoutMs: 60000,
  leaseWaitMs: 30000,
  signal: undefined,
  log: (msg) => process.stderr.write(`soak: ${msg}\n`),
};

/** The text that makes every backend answer vLLM's 500 (each sim's `poison_marker` fault). */
export const SOAK_POISON = "SOAK-POISON-7d1e";

/** The codes of the SSE error event that ends a stream whose backend failed after its first byte. */
const STREAM_ERROR_CODES = ["upstream_stream_error", "upstream_idle_timeout"];

/** Fault profiles, each applied to one random backend for a while. */
const FAULTS = [
  ["error_500", { error_rate: 0.5, error_status: 500 }],
  ["error_503", { error_rate: 0.5, error_status: 503 }],
  ["rate_limit_429", { rate_limit_rate: 0.6 }],
  ["hang", { hang_rate: 0.3 }],
  ["disconnect_mid_stream", { disconnect_after_tokens: 2 }],
  ["health_fail", { health_fail: true }],
  ["slow_first_byte", { first_byte_delay_ms: 300 }],
  ["crash", { crash: true }],
  ["stall", { stall_after_tokens: 2 }],
  ["truncated_body", { truncate_body: true }],
  ["disconnect_mid_event", { disconnect_mid_event_after_tokens: 2 }],
  // `redirect_to` is filled in with the run's redirect target (a listener that must see nothing).
  ["redirect", { redirect_to: null }],
  ["login_page", { login_page: true }],
];

/** A small seeded PRNG (mulberry32), so the request mix and the fault schedule are reproducible. */
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function percentile(sorted, p) {
  if (sorted.length === 0) return null;
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1))];
}

const SYSTEMS = [
  "You are a careful assistant who answers briefly. ".repeat(12),
  "You are a senior engineer reviewing code for reliability problems. ".repeat(10),
  "You translate English into French, faithfully and without commentary. ".repeat(8),
];

/** The i-th request of the run: kind, stream, body, and whether it is poison or read slowly. */
function makeRequest(i, rand) {
  const r = rand();
  const chat = r < 0.7;
  const stream = rand() < 0.5;
  const max_tokens = 1 + Math.floor(rand() * 24);
  const system = SYSTEMS[Math.floor(rand() * SYSTEMS.length)];
  // Drawn from the request's own figures, so the rest of the mix stays what it was.
  const poison = Math.floor(r * 1e6) % 40 === 7;
  const slowReader = stream && !poison && Math.floor(r * 1e6) % 25 === 3;
  const user = `Request ${i}: ${"tell me about topic ".repeat(1 + Math.floor(rand() * 8))}${Math.floor(rand() * 1e6)}${poison ? ` ${SOAK_POISON}` : ""}`;
  const body = chat
    ? { model: SOAK_MODEL, stream, max_tokens, messages: [{ role: "system", content: system }, { role: "user", content: user }] }
    : { model: SOAK_MODEL, stream, max_tokens, prompt: system + user };
  return { path: chat ? "/v1/chat/completions" : "/v1/completions", chat, stream, body, poison, slowReader };
}

/** Reads a response body a chunk at a time with a pause after each (a slow client). */
async function readSlowly(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let text = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return text + decoder.decode();
    text += decoder.decode(value, { stream: true });
    await sleep(40);
  }
}

/** A local listener that counts what reaches it: the redirecting backend's target. */
async function redirectTarget() {
  const state = { hits: 0, samples: [] };
  const server = http.createServer((req, res) => {
    state.hits += 1;
    if (state.samples.length < 5) state.samples.push(`${req.method} ${req.url}`);
    req.resume();
    res.writeHead(200, { "content-type": "application/json" });
    res.end("{}");
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  state.url = `http://127.0.0.1:${server.address().port}`;
  state.close = () => new Promise((r) => { server.closeAllConnections(); server.close(r); });
  return state;
}

function isOpenAIError(json) {
  return json && typeof json === "object" && json.error && typeof json.error.message === "string" && typeof json.error.type === "string";
}

/**
 * Classifies one answer. Returns { outcome, violation? }: outcomes are `ok`, `ok_stream`,
 * `stream_error_event` (a backend failed after the first byte: SSE error, then [DONE]) and
 * `error_<status>` (a well-formed OpenAI error).
 */
function classify(req, status, headers, text) {
  if (req.poison) {
    if (status === 200) return { outcome: "poison_served", violation: `a poison request got 200: ${text.slice(0, 160)}` };
    const verdict = classifyError(status, headers, text);
    if (verdict.violation) return verdict;
    let code = null;
    try { code = JSON.parse(text).error.code; } catch { /* classified above */ }
    return { outcome: code === "upstream_request_error" ? "poison_request_error" : `poison_${verdict.outcome}` };
  }
  const ct = headers.get("content-type") ?? "";
  if (status === 200) {
    if (!req.stream) {
      let json;
      try { json = JSON.parse(text); } catch { return { outcome: "bad_body", violation: `200 with a body that is not JSON: ${text.slice(0, 120)}` }; }
      const want = req.chat ? "chat.completion" : "text_completion";
      if (json.object !== want || !Array.isArray(json.choices) || json.choices.length < 1) {
        return { outcome: "bad_body", violation: `200 with an unexpected body: ${text.slice(0, 160)}` };
      }
      if (req.chat ? typeof json.choices[0].message?.content !== "string" : typeof json.choices[0].text !== "string") {
        return { outcome: "bad_body", violation: `200 without content: ${text.slice(0, 160)}` };
      }
      return { outcome: "ok" };
    }
    if (!ct.startsWith("text/event-stream")) return { outcome: "bad_body", violation: `streamed 200 with content-type ${ct}` };
    if (!text.endsWith("data: [DONE]\n\n")) return { outcome: "truncated_stream", violation: `stream not terminated by [DONE]: ...${JSON.stringify(text.slice(-160))}` };
    const events = text.split("\n\n").filter((e) => e.length > 0);
    let errorEvent = null;
    let chunks = 0;
    // A resumed stream must still look like one answer.
    const ids = new Set();
    let roles = 0;
    let finishes = 0;
    for (const [k, e] of events.entries()) {
      if (!e.startsWith("data: ")) return { outcome: "bad_body", violation: `not an SSE data event: ${JSON.stringify(e.slice(0, 120))}` };
      const data = e.slice(6);
      if (data === "[DONE]") {
        if (k !== events.length - 1) return { outcome: "bad_body", violation: "[DONE] before the end of the stream" };
        continue;
      }
      let json;
      try { json = JSON.parse(data); } catch { return { outcome: "bad_body", violation: `SSE event is not JSON: ${JSON.stringify(data.slice(0, 120))}` }; }
      if (json.error) {
        if (!isOpenAIError(json) || !STREAM_ERROR_CODES.includes(json.error.code) || k !== events.length - 2) {
          return { outcome: "bad_body", violation: `malformed SSE error event: ${data.slice(0, 200)}` };
        }
        errorEvent = json;
      } else {
        const want = req.chat ? "chat.completion.chunk" : "text_completion";
        if (json.object !== want) return { outcome: "bad_body", violation: `unexpected chunk: ${data.slice(0, 160)}` };
        chunks += 1;
        ids.add(json.id);
        for (const c of json.choices ?? []) {
          if (c.delta?.role !== undefined) roles += 1;
          if (c.finish_reason) finishes += 1;
        }
      }
    }
    if (ids.size > 1) return { outcome: "bad_body", violation: `a stream with ${ids.size} ids: ${[...ids].join(", ")}` };
    if (roles > 1 || finishes > 1) return { outcome: "bad_body", violation: `a stream with ${roles} role chunks and ${finishes} finishes` };
    if (errorEvent) return { outcome: "stream_error_event" };
    if (chunks === 0) return { outcome: "bad_body", violation: "a stream with no chunks" };
    return { outcome: "ok_stream" };
  }
  return classifyError(status, headers, text);
}

/** Classifies an error answer: a well-formed OpenAI error with a status a client may get. */
function classifyError(status, headers, text) {
  const ct = headers.get("content-type") ?? "";
  let json = null;
  try { json = JSON.parse(text); } catch { /* below */ }
  if (!isOpenAIError(json) || !ct.startsWith("application/json")) {
    return { outcome: `malformed_error_${status}`, violation: `${status} without an OpenAI error body (${ct}): ${text.slice(0, 160)}` };
  }
  if (status === 500) return { outcome: "error_500", violation: `the gateway answered 500: ${text.slice(0, 200)}` };
  if (![429, 502, 503, 504].includes(status)) {
    return { outcome: `error_${status}`, violation: `unexpected status ${status} for a valid request: ${text.slice(0, 200)}` };
  }
  if ((status === 503 || status === 429) && !(Number(headers.get("retry-after")) >= 1)) {
    return { outcome: `error_${status}`, violation: `${status} without Retry-After: ${text.slice(0, 160)}` };
  }
  return { outcome: `error_${status}` };
}

/** Runs the soak; returns the summary (its `ok` says whether there was no violation). */
export async function runSoak(options = {}) {
  const o = { ...DEFAULTS, ...Object.fromEntries(Object.entries(options).filter(([, v]) => v !== undefined)) };
  const log = o.log ?? (() => {});
  const rand = rng(o.seed);
  const faultRand = rng(o.seed * 7919 + 13);
  const started = Date.now();
  let deadline = started + o.secondsLimit * 1000;
  o.signal?.addEventListener("abort", () => { deadline = Date.now(); });
  const violations = [];
  const violation = (kind, detail) => violations.push({ kind, detail });
  let gateway = null;
  const sims = [];
  const restarts = new Set();
  const summary = { ok: false };
  let target = null;
  try {
    // --- the gateway ---
    let base = o.url;
    const token = o.adminToken ?? ADMIN_TOKEN;
    // The Worker's own log (Miniflare mode): kept out of stdout; panics and uncaught errors count.
    const workerLog = { lines: 0, errors: 0 };
    const onLog = (line) => {
      workerLog.lines += 1;
      if (/panicked at|RuntimeError|unreachable|Uncaught|internal error/i.test(line)) {
        workerLog.errors += 1;
        violation("worker_error_log", line.slice(0, 300));
      }
    };
    if (!base) {
      const resumes = o.maxStreamResumes === null ? {} : { MAX_STREAM_RESUMES: String(o.maxStreamResumes) };
      gateway = await startGatewayServer({ bindings: { ...SOAK_BINDINGS, ...resumes }, onLog });
      base = gateway.url;
      log(`gateway under Miniflare at ${base}`);
    }
    const admin = (p, opts = {}) => adminFetch(base, p, { token, ...opts });
    const health = await fetch(`${base}/healthz`);
    if (health.status !== 200) throw new Error(`gateway ${base} /healthz answered ${health.status}`);

    // --- the backends ---
    target = await redirectTarget();
    // Every fault setting keeps the poison marker: a poison request fails on every backend.
    const applyFaults = (sim, faults) => setFaults(sim, { poison_marker: SOAK_POISON, ...faults });
    for (let i = 0; i < o.sims; i++) {
      // The marker from the start, so a sim restarted after a crash fails poison requests at once.
      const args = ["--model", SOAK_MODEL, "--time-scale", String(o.timeScale), "--seed", String(1000 + i), "--mean-output-tokens", "16", "--fault-poison-marker", SOAK_POISON];
      const sim = await startSim(args);
      await applyFaults(sim, {});
      sims.push({ i, args, sim, faulted: null, crashed: false });
    }
    // Stale soak backends of an earlier run (persisted state) are removed first.
    const listed = await admin("/admin/backends");
    if (listed.status !== 200) throw new Error(`GET /admin/backends: ${listed.status} ${await listed.text()}`);
    for (const b of (await listed.json()).data) {
      if (b.pool === SOAK_POOL) await admin(`/admin/backends/${b.id}?force=true`, { method: "DELETE" });
    }
    const put = await admin(`/admin/pools/${SOAK_POOL}`, {
      method: "PUT",
      body: { policy: "cache_aware", probe_interval_ms: 1000, breaker: { failure_threshold: 5, base_cooldown_ms: 1000, max_cooldown_ms: 4000 } },
    });
    if (put.status !== 200) throw new Error(`PUT /admin/pools/${SOAK_POOL}: ${put.status} ${await put.text()}`);
    for (const s of sims) {
      const r = await admin("/admin/backends", { method: "POST", body: { url: s.sim.url, pool: SOAK_POOL, models: [SOAK_MODEL], id: `soak-${s.i}` } });
      if (r.status !== 201) throw new Error(`registering soak-${s.i}: ${r.status} ${await r.text()}`);
    }
    // Every backend ready before the load starts (the pool probes new backends at once).
    for (let k = 0; ; k++) {
      const data = (await (await admin("/admin/backends")).json()).data.filter((b) => b.pool === SOAK_POOL);
      if (data.length === o.sims && data.every((b) => b.lifecycle === "ready" && b.health === "healthy")) break;
      if (k >= 150 || Date.now() > deadline) throw new Error(`backends not ready: ${JSON.stringify(data.map((b) => [b.id, b.lifecycle, b.health]))}`);
      await sleep(200);
    }
    log(`${o.sims} backends ready; firing ${o.requests} requests, ${o.concurrency} at a time`);

    // --- faults on and off, at random, while the load runs ---
    const faultCounts = {};
    let loadDone = false;
    const restartSim = (s) => {
      const p = (async () => {
        await sleep(1000 + Math.floor(faultRand() * 1000));
        const old = s.sim;
        await old.close();
        for (let tries = 0; tries < 20; tries++) {
          try {
            s.sim = await startSim(s.args, { port: old.port });
            await applyFaults(s.sim, {});
            break;
          } catch (e) {
            if (tries === 19) violation("harness", `cannot restart soak-${s.i}: ${e.message}`);
            await sleep(200);
          }
        }
        s.crashed = false;
        s.faulted = null;
      })();
      restarts.add(p);
      p.finally(() => restarts.delete(p));
    };
    const chaos = (async () => {
      for (let n = 0; n < 100000 && !loadDone && Date.now() < deadline; n++) {
        await sleep(o.faultIntervalMs);
        if (loadDone) break;
        // Now and then a storm: every backend fails every request for a moment, so clients see
        // the gateway's own errors (502/503 with Retry-After), which must be well-formed too.
        if (faultRand() < 0.015) {
          faultCounts.storm = (faultCounts.storm ?? 0) + 1;
          const live = sims.filter((x) => !x.crashed);
          await Promise.all(live.map((x) => applyFaults(x.sim, { error_rate: 1.0, error_status: 503 }).catch(() => {})));
          await sleep(300);
          await Promise.all(live.filter((x) => !x.crashed).map((x) => applyFaults(x.sim, {}).catch(() => {})));
          for (const x of live) if (!x.crashed) x.faulted = null;
          continue;
        }
        const s = sims[Math.floor(faultRand() * sims.length)];
        if (s.crashed) continue;
        const healthyLeft = sims.filter((x) => !x.faulted && !x.crashed).length;
        // Clear a fault half the time; never fault the last fault-free backend.
        if (s.faulted && faultRand() < 0.5) {
          await applyFaults(s.sim, {}).catch(() => {});
          s.faulted = null;
          continue;
        }
        if (!s.faulted && healthyLeft <= 1) continue;
        const choices = FAULTS.filter(([name]) => o.crash || name !== "crash");
        const [name, profile] = choices[Math.floor(faultRand() * choices.length)];
        const faults = name === "redirect" ? { redirect_to: `${target.url}/v1/chat/completions` } : profile;
        faultCounts[name] = (faultCounts[name] ?? 0) + 1;
        if (name === "crash") {
          s.crashed = true;
          s.faulted = name;
          await applyFaults(s.sim, faults).catch(() => {}); // answers, then exits
          restartSim(s);
        } else {
          await applyFaults(s.sim, faults).catch((e) => violation("harness", `setting ${name} on soak-${s.i}: ${e.message}`));
          s.faulted = name;
        }
      }
    })();

    // --- the load ---
    const byStatus = {};
    const byOutcome = {};
    const mix = { poison: 0, slow_readers: 0 };
    const latencies = [];
    let next = 0;
    let sent = 0;
    const one = async (i) => {
      const req = makeRequest(i, rand);
      const t0 = performance.now();
      let status = null;
      try {
        const resp = await fetch(base + req.path, {
          method: "POST",
          headers: { "content-type": "application/json", "x-request-id": `soak-${o.seed}-${i}` },
          body: JSON.stringify(req.body),
          signal: o.signal ? AbortSignal.any([o.signal, AbortSignal.timeout(o.requestTimeoutMs)]) : AbortSignal.timeout(o.requestTimeoutMs),
        });
        status = resp.status;
        if (req.poison) mix.poison += 1;
        const slow = req.slowReader && status === 200;
        if (slow) mix.slow_readers += 1;
        const text = slow ? await readSlowly(resp) : await resp.text();
        const { outcome, violation: v } = classify(req, status, resp.headers, text);
        byOutcome[outcome] = (byOutcome[outcome] ?? 0) + 1;
        if (v) violation(outcome, `request ${i} (${req.path}, stream ${req.stream}): ${v}`);
      } catch (e) {
        const kind = e.name === "TimeoutError" ? "client_timeout" : "transport_error";
        byOutcome[kind] = (byOutcome[kind] ?? 0) + 1;
        violation(kind, `request ${i} (${req.path}, stream ${req.stream}) after ${Math.round(performance.now() - t0)} ms: ${e.cause?.code ?? e.message}`);
      }
      byStatus[status ?? "none"] = (byStatus[status ?? "none"] ?? 0) + 1;
      latencies.push(performance.now() - t0);
    };
    const workers = Array.from({ length: Math.max(1, o.concurrency) }, async () => {
      while (next < o.requests && Date.now() < deadline) {
        const i = next++;
        sent += 1;
        await one(i);
      }
    });
    const loadStarted = Date.now();
    let progressTimer = setInterval(() => log(`${latencies.length}/${o.requests} done`), 10000);
    await Promise.all(workers);
    clearInterval(progressTimer);
    progressTimer = null;
    const loadMs = Date.now() - loadStarted;
    loadDone = true;
    await chaos;
    await Promise.all([...restarts]);
    if (target.hits > 0) violation("redirect_followed", `the redirect target got ${target.hits} request(s): ${target.samples.join(", ")}`);
    if (sent < o.requests) violation("time_limit", `only ${sent} of ${o.requests} requests were sent within ${o.secondsLimit} s`);

    // --- afterwards: faults off, every lease back ---
    for (const s of sims) await setFaults(s.sim, {}).catch(() => {});
    const leaseWaitStart = Date.now();
    let pools = [];
    for (;;) {
      const r = await admin("/admin/pools");
      pools = r.status === 200 ? (await r.json()).data : [];
      if (pools.length > 0 && pools.every((p) => p.in_flight === 0 && p.in_flight_tokens === 0)) break;
      if (Date.now() - leaseWaitStart > o.leaseWaitMs) {
        violation("leases_leaked", JSON.stringify(pools.map((p) => ({ pool: p.pool, in_flight: p.in_flight, in_flight_tokens: p.in_flight_tokens }))));
        break;
      }
      await sleep(250);
    }
    const leaseWaitMs = Date.now() - leaseWaitStart;
    const soakState = pools.find((p) => p.pool === SOAK_POOL) ?? {};
    const afterHealth = await fetch(`${base}/healthz`).then((r) => r.status).catch(() => null);
    if (afterHealth !== 200) violation("gateway_down", `/healthz answered ${afterHealth} after the run`);
    const backends = (await (await admin("/admin/backends")).json()).data.filter((b) => b.pool === SOAK_POOL);
    if (backends.length !== o.sims) violation("registry", `${backends.length} soak backends listed after the run, expected ${o.sims}`);

    // Usage: what the gateway counted against what the backends say they generated. A crashed
    // sim's counters restart at zero, so with crashes the backends' figure is a lower bound.
    const sumOf = (samples, name, labels = {}) =>
      samples.filter((x) => x.name === name && Object.entries(labels).every(([k, v]) => x.labels[k] === v)).reduce((a, x) => a + x.value, 0);
    const gatewayMetrics = parseMetrics(await (await admin("/metrics")).text());
    const simTokens = { prompt: 0, completion: 0 };
    for (const s of sims) {
      const m = parseMetrics(await fetch(`${s.sim.url}/metrics`).then((r) => r.text()).catch(() => ""));
      simTokens.prompt += sumOf(m, "vllm:prompt_tokens_total");
      simTokens.completion += sumOf(m, "vllm:generation_tokens_total");
    }
    const tokens = {
      counted: {
        prompt: sumOf(gatewayMetrics, "llm_gateway_tokens_total", { pool: SOAK_POOL, kind: "prompt" }),
        cached: sumOf(gatewayMetrics, "llm_gateway_tokens_total", { pool: SOAK_POOL, kind: "cached" }),
        completion: sumOf(gatewayMetrics, "llm_gateway_tokens_total", { pool: SOAK_POOL, kind: "completion" }),
      },
      generated_by_backends: simTokens,
      sims_restarted: faultCounts.crash ?? 0,
    };
    // Streams that failed after their first byte: what the pool counted of their resumptions.
    const resumeOutcomes = {};
    for (const x of gatewayMetrics) {
      if (x.name === "llm_gateway_stream_resumes_total" && x.labels.pool === SOAK_POOL && x.value > 0) {
        resumeOutcomes[x.labels.outcome] = (resumeOutcomes[x.labels.outcome] ?? 0) + x.value;
      }
    }
    const streams = {
      resumed: resumeOutcomes.success ?? 0,
      ended_by_error_event: byOutcome.stream_error_event ?? 0,
      resume_outcomes: resumeOutcomes,
    };

    latencies.sort((a, b) => a - b);
    const violationKinds = {};
    for (const v of violations) violationKinds[v.kind] = (violationKinds[v.kind] ?? 0) + 1;
    Object.assign(summary, {
      ok: violations.length === 0,
      gateway: o.url ? o.url : "miniflare",
      requests: o.requests,
      sent,
      completed: latencies.length,
      concurrency: o.concurrency,
      sims: o.sims,
      duration_s: Number(((Date.now() - started) / 1000).toFixed(1)),
      load_s: Number((loadMs / 1000).toFixed(1)),
      throughput_rps: Number((latencies.length / (loadMs / 1000)).toFixed(1)),
      by_status: byStatus,
      by_outcome: byOutcome,
      gateway_500s: byStatus[500] ?? 0,
      mix: { ...mix, redirect_target_hits: target.hits },
      latency_ms: {
        p50: Math.round(percentile(latencies, 50)),
        p90: Math.round(percentile(latencies, 90)),
        p99: Math.round(percentile(latencies, 99)),
        max: Math.round(latencies.at(-1) ?? 0),
      },
      faults_applied: faultCounts,
      worker_log: o.url ? "not captured (external gateway)" : workerLog,
      tokens,
      streams,
      pool: { retries: soakState.retries, spills: soakState.spills, retry_budget_exhausted: soakState.retry_budget_exhausted },
      leases_after: {
        waited_ms: leaseWaitMs,
        pools: pools.map((p) => ({ pool: p.pool, in_flight: p.in_flight, in_flight_tokens: p.in_flight_tokens })),
      },
      violations: violations.length,
      violation_kinds: violationKinds,
      violation_samples: violations.slice(0, 20),
    });

    if (!o.keepBackends) {
      for (const b of backends) await admin(`/admin/backends/${b.id}?force=true`, { method: "DELETE" }).catch(() => {});
    }
    return summary;
  } finally {
    await Promise.all([...restarts]).catch(() => {});
    await Promise.all(sims.map((s) => s.sim.close()));
    await target?.close();
    await gateway?.close();
  }
}

function parseArgs(argv) {
  const o = {};
  const num = (v, name) => {
    const n = Number(v);
    if (!Number.isFinite(n) || n < 0) throw new Error(`${name} must be a non-negative number, got ${v}`);
    return n;
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const val = () => {
      if (i + 1 >= argv.length) throw new Error(`${a} needs a value`);
      return argv[++i];
    };
    switch (a) {
      case "--url": o.url = val().replace(/\/$/, ""); break;
      case "--admin-token": o.adminToken = val(); break;
      case "--requests": o.requests = num(val(), a); break;
      case "--concurrency": o.concurrency = num(val(), a); break;
      case "--sims": o.sims = Math.max(2, num(val(), a)); break;
      case "--seconds-limit": o.secondsLimit = num(val(), a); break;
      case "--seed": o.seed = num(val(), a); break;
      case "--time-scale": o.timeScale = num(val(), a); break;
      case "--fault-interval-ms": o.faultIntervalMs = num(val(), a); break;
      case "--request-timeout-ms": o.requestTimeoutMs = num(val(), a); break;
      case "--no-crash": o.crash = false; break;
      case "--keep-backends": o.keepBackends = true; break;
      case "--max-stream-resumes": o.maxStreamResumes = num(val(), a); break;
      case "-h":
      case "--help":
        process.stdout.write(`usage: node tests/soak.mjs [--url URL --admin-token T] [--requests N] [--concurrency N] [--sims N] [--seconds-limit S] [--seed N] [--time-scale X] [--fault-interval-ms MS] [--request-timeout-ms MS] [--no-crash] [--keep-backends] [--max-stream-resumes N]\n` +
          `A gateway given by --url should run with ${Object.entries(SOAK_BINDINGS).map(([k, v]) => `${k}=${v}`).join(" ")}.\n`);
        process.exit(0);
        break;
      default: throw new Error(`unknown argument ${a}`);
    }
  }
  if (o.url && !o.adminToken) throw new Error("--url needs --admin-token");
  return o;
}

if (process.argv[1] && pathToFileURL(path.resolve(process.argv[1])).href === import.meta.url) {
  let options;
  try {
    options = parseArgs(process.argv.slice(2));
  } catch (e) {
    process.stderr.write(`soak: ${e.message}\n`);
    process.exit(2);
  }
  // A signal ends the run early but still stops every process it started.
  const abort = new AbortController();
  const stop = () => { process.stderr.write("soak: interrupted; cleaning up\n"); abort.abort(); };
  process.once("SIGINT", stop);
  process.once("SIGTERM", stop);
  try {
    const summary = await runSoak({ ...options, signal: abort.signal });
    process.stdout.write(JSON.stringify(summary, null, 2) + "\n");
    process.exit(summary.ok ? 0 : 1);
  } catch (e) {
    process.stderr.write(`soak: ${e.stack ?? e.message}\n`);
    process.exit(1);
  }
}
