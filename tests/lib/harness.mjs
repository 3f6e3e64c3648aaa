// Test harness: runs the real built Worker (build/index.js) in workerd through Miniflare, and real
// local servers on 127.0.0.1 for it to call. Every helper returns something with a close() so tests
// can always clean up what they started.
import { Miniflare } from "miniflare";
import http from "node:http";
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
export const ADMIN_TOKEN = "test-admin-token-5f1c2a";

/** Starts the Worker under Miniflare. `persistDir` keeps Durable Object state across restarts. */
export async function startGateway({ bindings = {}, persistDir, options = {} } = {}) {
  const mf = new Miniflare({
    scriptPath: path.join(ROOT, "build/index.js"),
    modules: true,
    modulesRules: [{ type: "CompiledWasm", include: ["**/*.wasm"], fallthrough: true }],
    compatibilityDate: "2026-08-01",
    compatibilityFlags: ["enable_request_signal"],
    durableObjects: {
      POOL: { className: "PoolCoordinator", useSQLite: true },
      DIRECTORY: { className: "PoolDirectory", useSQLite: true },
      RATE_LIMITER: { className: "RateLimiter", useSQLite: true },
    },
    durableObjectsPersist: persistDir ?? false,
    bindings: { ADMIN_TOKEN, MAX_BODY_BYTES: "1048576", PROBE_INTERVAL_MS: "1000", ...bindings },
    ...options,
  });
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

/** Polls `fn` until it returns a truthy value or `timeoutMs` passes. */
export async function waitFor(fn, { timeoutMs = 10000, intervalMs = 100, what = "condition" } = {}) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
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
