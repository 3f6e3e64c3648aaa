// Test harness: runs the real built Worker (build/index.js) in workerd through Miniflare, and real
// local servers on 127.0.0.1 for it to call. Every helper returns something with a close() so tests
// can always clean up what they started.
import { Miniflare } from "miniflare";
import { Agent, setGlobalDispatcher } from "undici";
import http from "node:http";
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

// workerd closes an idle keep-alive connection 5 s after its last response and sends no Keep-Alive
// header (workerd issue #7169). Node's fetch (and the OpenAI client on it) keeps idle sockets 4 s on
// coarse timers that can fire a second late on a loaded machine, so a request could go out on a
// socket workerd was closing and fail with "other side closed" (a CI run of 2026-12-04, in a test
// that polls the admin API while a stream stalls). Every test process's fetches drop idle sockets
// after 1 s instead, well inside workerd's 5 s.
setGlobalDispatcher(new Agent({ keepAliveTimeout: 1000, keepAliveMaxTimeout: 1000 }));

export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
export const ADMIN_TOKEN = "test-admin-token-5f1c2a";

/**
 * Starts the Worker under Miniflare. `persistDir` keeps Durable Object state across restarts.
 * `extraWorkers` (Miniflare worker options, each with a `name`) run beside it in the same workerd;
 * the gateway is then the worker named `gateway`, and still the one `fetch` reaches. `workerOptions`
 * are more Miniflare options of the gateway worker itself (e.g. `serviceBindings`). With
 * `defaults: false` the Worker gets exactly `bindings` (no test defaults merged in). With
 * `objectFaults: true` the Worker runs behind tests/lib/object-faults.mjs, whose pool coordinator
 * calls can be made to fail (`setObjectFaults`).
 */
export async function startGateway({ bindings = {}, defaults = true, persistDir, options = {}, extraWorkers = [], workerOptions = {}, objectFaults = false } = {}) {
  const worker = {
    scriptPath: path.join(ROOT, objectFaults ? "tests/lib/object-faults.mjs" : "build/index.js"),
    modules: true,
    modulesRules: [
      { type: "CompiledWasm", include: ["**/*.wasm"], fallthrough: true },
      ...(objectFaults ? [{ type: "ESModule", include: ["**/*.js", "**/*.mjs"] }] : []),
    ],
    ...(objectFaults ? { modulesRoot: ROOT } : {}),
    compatibilityDate: "2026-08-01",
    compatibilityFlags: ["enable_request_signal"],
    durableObjects: {
      POOL: { className: "PoolCoordinator", useSQLite: true },
      DIRECTORY: { className: "GatewayDirectory", useSQLite: true },
      RATE_LIMITER: { className: "ClientRateLimiter", useSQLite: true },
    },
    // ALLOW_IP_BACKENDS: the test backends listen on 127.0.0.1 (a deployed gateway refuses IP hosts).
    // REQUIRE_CLIENT_KEYS: the Worker is closed by default; most tests use the open surface (a test
    // of the closed one sets "true", or passes `defaults: false` with the deploy configuration).
    bindings: defaults
      ? { ADMIN_TOKEN, MAX_BODY_BYTES: "1048576", PROBE_INTERVAL_MS: "1000", ALLOW_IP_BACKENDS: "true", REQUIRE_CLIENT_KEYS: "false", ...bindings }
      : bindings,
    // More of the gateway's own Miniflare options (e.g. `serviceBindings`).
    ...workerOptions,
  };
  const shared = { durableObjectsPersist: persistDir ?? false, ...options };
  const mf = new Miniflare(
    extraWorkers.length ? { ...shared, workers: [{ name: "gateway", ...worker }, ...extraWorkers] } : { ...worker, ...shared },
  );
  await mf.ready;
  const base = "http://gateway.test";
  const gw = {
    mf,
    fetch: (p, init = {}) => mf.dispatchFetch(base + p, init),
    admin: (p, { method = "GET", body, token = ADMIN_TOKEN } = {}) =>
      mf.dispatchFetch(base + p, {
        method,
        headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
        body: body === undefined ? undefined : typeof body === "string" ? body : JSON.stringify(body),
      }),
    scheduled: async () => (await mf.getWorker()).scheduled({ cron: "* * * * *" }),
    close: () => mf.dispose(),
  };
  return gw;
}

/**
 * POSTs to a pool's shard-0 Durable Object through its internal routes, as the Worker calls them:
 * `(route, body) => Response`, e.g. `call("release_batch", { releases })`.
 */
export async function poolObjectCall(gw, pool) {
  const ns = await gw.mf.getDurableObjectNamespace("POOL");
  const stub = ns.get(ns.idFromName(pool));
  return (route, body) => stub.fetch(`https://do.internal/${route}`, {
    method: "POST",
    headers: { "x-gateway-pool": pool, "content-type": "application/json" },
    body: JSON.stringify(body),
  });
}

/**
 * Sets the pool coordinator faults of a gateway started with `objectFaults: true` (see
 * tests/lib/object-faults.mjs; `[]` clears them). Returns the table as set.
 */
export async function setObjectFaults(gw, faults) {
  const r = await gw.fetch("/__object-faults", { method: "POST", body: JSON.stringify(faults) });
  if (r.status !== 200) throw new Error(`object faults: ${r.status} ${await r.text()}`);
  return r.json();
}

/** A fresh directory for persisted Durable Object state; removed by the returned cleanup. */
export function tempDir() {
  const dir = mkdtempSync(path.join(tmpdir(), "gw-test-"));
  return { dir, cleanup: () => rmSync(dir, { recursive: true, force: true }) };
}

/**
 * A minimal OpenAI-like server that streams `chunks` SSE events `delayMs` apart, then `[DONE]`.
 * `finishedAt` is the time (ms, performance.now()) the last byte was written.
 */
export async function startSseServer({ chunks = 5, delayMs = 300 } = {}) {
  const state = { requests: [], finishedAt: null };
  const server = http.createServer((req, res) => {
    let body = "";
    req.on("data", (d) => (body += d));
    req.on("end", async () => {
      state.requests.push({ url: req.url, headers: req.headers, body });
      if (req.url === "/health") return res.end("ok");
      if (req.url === "/v1/models") {
        res.writeHead(200, { "content-type": "application/json" });
        return res.end(JSON.stringify({ object: "list", data: [{ id: "sse-model", object: "model" }] }));
      }
      if (req.method === "GET") { res.writeHead(404); return res.end(); }
      res.writeHead(200, { "content-type": "text/event-stream" });
      for (let i = 0; i < chunks; i++) {
        res.write(`data: ${JSON.stringify({ object: "chat.completion.chunk", choices: [{ index: 0, delta: { content: `tok${i} ` } }] })}\n\n`);
        await new Promise((r) => setTimeout(r, delayMs));
      }
      res.end("data: [DONE]\n\n");
      state.finishedAt = performance.now();
    });
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  state.url = `http://127.0.0.1:${server.address().port}`;
  state.close = () => new Promise((r) => { server.closeAllConnections(); server.close(r); });
  return state;
}

/** Waits until the admin API reports backend `id` ready (probed healthy). */
export async function waitReady(gw, id, timeoutMs = 10000) {
  return waitFor(async () => {
    const r = await gw.admin(`/admin/backends/${id}`);
    if (r.status !== 200) return null;
    const b = await r.json();
    return b.lifecycle === "ready" && b.health === "healthy" ? b : null;
  }, { timeoutMs, what: `backend ${id} ready` });
}

/**
 * Leaves only pool `name` in routing: drains every other pool's backends and undrains this
 * pool's, so a test's requests reach the pool it just built (pools share the test's models).
 */
export async function onlyPool(gw, name) {
  const list = await (await gw.admin("/admin/backends")).json();
  for (const b of list.data) {
    const want = b.pool === name;
    const draining = b.lifecycle === "draining" || b.lifecycle === "drained";
    if (want === draining) {
      const r = await gw.admin(`/admin/backends/${b.id}`, { method: "PATCH", body: { drain: !want } });
      if (r.status !== 200) throw new Error(`drain ${b.id}: ${r.status} ${await r.text()}`);
    }
  }
}

/**
 * Polls `fn` until it returns a truthy value or `timeoutMs` passes (on the monotonic clock: a
 * wall-clock step on a virtual machine must not end the wait early).
 */
export async function waitFor(fn, { timeoutMs = 10000, intervalMs = 100, what = "condition" } = {}) {
  const deadline = performance.now() + timeoutMs;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (performance.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, intervalMs));
  }
}

/** Asserts an OpenAI-style error body and returns it. */
export async function errorBody(resp) {
  const text = await resp.text();
  let json;
  try { json = JSON.parse(text); } catch { throw new Error(`not JSON (${resp.status}): ${text}`); }
  if (!json.error || typeof json.error.message !== "string" || typeof json.error.type !== "string") {
    throw new Error(`not an OpenAI error body: ${text}`);
  }
  return json.error;
}

/** Starts a vllm-sim process on a free port and waits until /health answers. */
export async function startSim(args = [], { waitHealthy = true, port: fixedPort } = {}) {
  const bin = process.env.VLLM_SIM_BIN ?? path.join(ROOT, "target/release/vllm-sim");
  const port = fixedPort ?? (await freePort());
  const child = spawn(bin, ["--port", String(port), ...args], { stdio: ["ignore", "ignore", "pipe"] });
  let stderr = "";
  child.stderr.on("data", (d) => (stderr += d));
  const url = `http://127.0.0.1:${port}`;
  const sim = {
    url, port, child,
    close: () => new Promise((r) => { if (child.exitCode !== null || child.signalCode !== null) return r(); child.once("exit", r); child.kill("SIGKILL"); }),
  };
  if (waitHealthy) {
    await waitFor(async () => {
      if (child.exitCode !== null) throw new Error(`vllm-sim exited: ${stderr}`);
      try { return (await fetch(url + "/health")).status === 200; } catch { return false; }
    }, { what: `vllm-sim on ${port}` });
  }
  return sim;
}

export function freePort() {
  return new Promise((resolve, reject) => {
    const s = http.createServer();
    s.listen(0, "127.0.0.1", () => { const { port } = s.address(); s.close(() => resolve(port)); });
    s.on("error", reject);
  });
}

// ---- Additions for the fault, bad-input and soak tests (issue 8) ----

/**
 * Starts the Worker under Miniflare listening on a real 127.0.0.1 port (for raw-socket tests and
 * for clients outside `dispatchFetch`). Returns the same shape as `startGateway` plus `url`;
 * `fetch`/`admin` go over the network. `onLog(line, stream)`, if given, receives the runtime's
 * output (the Worker's console) line by line instead of this process's stdout/stderr.
 */
export async function startGatewayServer({ bindings = {}, persistDir, onLog } = {}) {
  const stdio = onLog && {
    handleRuntimeStdio: (stdout, stderr) => {
      for (const [stream, name] of [[stdout, "stdout"], [stderr, "stderr"]]) {
        let rest = "";
        stream.on("data", (d) => {
          const lines = (rest + d).split("\n");
          rest = lines.pop();
          for (const line of lines) onLog(line, name);
        });
      }
    },
  };
  const gw = await startGateway({ bindings, persistDir, options: { host: "127.0.0.1", port: 0, ...stdio } });
  const url = new URL(await gw.mf.ready).origin;
  return {
    ...gw,
    url,
    fetch: (p, init = {}) => fetch(url + p, init),
    admin: (p, opts = {}) => adminFetch(url, p, opts),
  };
}

/** An admin API call against a gateway at `base` (a URL), with the bearer token. */
export function adminFetch(base, p, { method = "GET", body, token = ADMIN_TOKEN } = {}) {
  return fetch(base + p, {
    method,
    headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
    body: body === undefined ? undefined : typeof body === "string" ? body : JSON.stringify(body),
  });
}

/**
 * Sends raw bytes to host:port and reads one HTTP/1.1 response: until its body is complete
 * (content-length or chunked), the server closes the connection, or `timeoutMs` passes. Returns
 * { status, head, headers (lower-case names), body, error, timedOut }.
 */
export async function rawHttp(port, bytes, { timeoutMs = 5000, host = "127.0.0.1" } = {}) {
  const net = await import("node:net");
  return new Promise((resolve) => {
    const socket = net.connect(port, host);
    let buf = Buffer.alloc(0);
    let error = null;
    let timedOut = false;
    let done = false;
    const parse = () => {
      const text = buf.toString("latin1");
      const split = text.indexOf("\r\n\r\n");
      const head = split >= 0 ? text.slice(0, split) : text;
      let body = split >= 0 ? text.slice(split + 4) : "";
      const lines = head.split("\r\n");
      const m = /^HTTP\/1\.[01] (\d{3})/.exec(lines[0] ?? "");
      const headers = {};
      for (const l of lines.slice(1)) {
        const i = l.indexOf(":");
        if (i > 0) headers[l.slice(0, i).trim().toLowerCase()] = l.slice(i + 1).trim();
      }
      let complete = false;
      if (split >= 0) {
        if (headers["content-length"] !== undefined) complete = body.length >= Number(headers["content-length"]);
        else if (/chunked/i.test(headers["transfer-encoding"] ?? "")) {
          complete = /(^|\r\n)0\r\n\r\n$/.test(body);
          if (complete) {
            let out = "", rest = body;
            for (;;) {
              const nl = rest.indexOf("\r\n");
              const n = parseInt(rest.slice(0, nl), 16);
              if (!n) break;
              out += rest.slice(nl + 2, nl + 2 + n);
              rest = rest.slice(nl + 2 + n + 2);
            }
            body = out;
          }
        }
      }
      return { status: m ? Number(m[1]) : null, head, headers, body, complete };
    };
    const finish = () => {
      if (done) return;
      done = true;
      clearTimeout(timer);
      const { complete, ...r } = parse();
      socket.destroy();
      resolve({ ...r, error, timedOut });
    };
    const timer = setTimeout(() => { timedOut = true; finish(); }, timeoutMs);
    socket.on("data", (d) => { buf = Buffer.concat([buf, d]); if (parse().complete) finish(); });
    socket.on("error", (e) => { error = e.code ?? e.message; });
    socket.on("close", finish);
    socket.write(bytes);
  });
}

/** POSTs a fault setting to a vllm-sim (`{}` clears every fault). */
export async function setFaults(sim, faults = {}) {
  const url = typeof sim === "string" ? sim : sim.url;
  const r = await fetch(`${url}/sim/faults`, { method: "POST", body: JSON.stringify(faults) });
  if (r.status !== 200) throw new Error(`POST /sim/faults ${JSON.stringify(faults)}: ${r.status} ${await r.text()}`);
  return r.json();
}

/** Parses Prometheus text into [{ name, labels, value }] (enough for the gateway's own families). */
export function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const lm of (m[3] ?? "").matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[lm[1]] = lm[2];
    out.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return out;
}

/** The value of the first sample of `name` whose labels include `labels`, or undefined. */
export function metricValue(samples, name, labels = {}) {
  const s = samples.find((x) => x.name === name && Object.entries(labels).every(([k, v]) => x.labels[k] === v));
  return s?.value;
}

/** A pool's detail as the admin API shows it (`GET /admin/pools/{name}`); throws unless 200. */
export async function poolState(g, name) {
  const r = await g.admin(`/admin/pools/${name}`);
  if (r.status !== 200) throw new Error(`GET /admin/pools/${name}: ${r.status} ${await r.text()}`);
  return r.json();
}

/** Waits until pool `name` has no lease, no in-flight tokens and nothing queued; returns its state. */
export async function drained(g, name, { timeoutMs = 20000 } = {}) {
  return waitFor(async () => {
    const s = await poolState(g, name);
    return s.in_flight === 0 && s.in_flight_tokens === 0 && (s.queue?.length ?? 0) === 0 ? s : null;
  }, { timeoutMs, what: `pool ${name} leases, in-flight tokens and queue back to zero` });
}

// ---- Slow readers (tests/trust-clients.test.mjs, tests/trust-round3.test.mjs) ----

/**
 * A streamed chat request whose client reads the first chunk and then stops reading, socket open.
 * Returns { reader, close } (`close` hangs up).
 */
export async function stalledReader(g, model, max_tokens) {
  const controller = new AbortController();
  const r = await g.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model, messages: [{ role: "user", content: "count" }], stream: true, max_tokens, ignore_eos: true }),
    signal: controller.signal,
  });
  if (r.status !== 200) throw new Error(`stalled reader: ${r.status} ${await r.text()}`);
  const reader = r.body.getReader();
  if ((await reader.read()).done) throw new Error("stalled reader: the stream ended at once");
  return { reader, close: () => { controller.abort(); return reader.cancel().catch(() => {}); } };
}

/** Reads the rest of a stream, pausing `pauseMs` after each chunk; returns { text, error }. */
export async function readRest(reader, pauseMs = 0) {
  const dec = new TextDecoder();
  let text = "";
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return { text, error: null };
      text += dec.decode(value, { stream: true });
      if (pauseMs) await new Promise((r) => setTimeout(r, pauseMs));
    }
  } catch (e) {
    return { text, error: e };
  }
}
