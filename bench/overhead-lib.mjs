// Shared pieces of the overhead benchmarks (bench/overhead.mjs): the workerd process's CPU time,
// percentiles, a closed-loop driver, a streaming HTTP client that times the first body byte, the
// machine's description, prompts of a given token count, and a seeded PRNG (also for bench/admission.mjs
// and bench/regions.mjs).
//
// CPU is read from /proc/<pid>/stat (utime + stime, in clock ticks of 1/CLK_TCK s, 10 ms here):
// the whole workerd process, every thread, including threads that already exited.
import { readFileSync, readdirSync } from "node:fs";
import { execFileSync } from "node:child_process";
import http from "node:http";
import os from "node:os";
import { Miniflare } from "miniflare";
import path from "node:path";
import { ROOT, startGateway, startSim, adminFetch, waitReady } from "../tests/lib/harness.mjs";

const CLK_TCK = Number(execFileSync("getconf", ["CLK_TCK"]).toString().trim()) || 100;

/** CPU seconds (user + system) used so far by process `pid`. */
export function processCpuS(pid) {
  const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
  // The command name (field 2) may hold spaces: split after its closing parenthesis.
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  return (Number(fields[11]) + Number(fields[12])) / CLK_TCK; // fields 14 and 15 of stat(5)
}

/** The pid of the newest `workerd` process started by this Node process (Miniflare's runtime). */
export function workerdPid() {
  const found = [];
  for (const name of readdirSync("/proc")) {
    if (!/^\d+$/.test(name)) continue;
    let stat;
    try {
      stat = readFileSync(`/proc/${name}/stat`, "utf8");
    } catch {
      continue; // exited meanwhile
    }
    const comm = stat.slice(stat.indexOf("(") + 1, stat.lastIndexOf(")"));
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    const ppid = Number(fields[1]);
    const start = Number(fields[19]);
    if (comm === "workerd" && isOurs(ppid)) found.push({ pid: Number(name), start });
  }
  if (!found.length) throw new Error("no workerd process found under this Node process");
  return found.sort((a, b) => b.start - a.start)[0].pid;
}

/** Whether `pid` is this process or one of its descendants. */
function isOurs(pid) {
  for (let p = pid, depth = 0; p > 1 && depth < 8; depth++) {
    if (p === process.pid) return true;
    try {
      const stat = readFileSync(`/proc/${p}/stat`, "utf8");
      p = Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[1]);
    } catch {
      return false;
    }
  }
  return false;
}

/** CPU use of `pid` and of this Node process over a span: call `.stop()` for the figures. */
export function cpuMeter(pid) {
  const t0 = performance.now();
  const w0 = processCpuS(pid);
  const n0 = process.cpuUsage();
  return {
    stop() {
      const n = process.cpuUsage(n0);
      return {
        wall_s: (performance.now() - t0) / 1000,
        workerd_cpu_s: processCpuS(pid) - w0,
        node_cpu_s: (n.user + n.system) / 1e6,
      };
    },
  };
}

/** workerd's CPU seconds per wall second while nothing is sent (timers, alarms, probes). */
export async function idleCpuRate(pid, seconds) {
  const m = cpuMeter(pid);
  await sleep(seconds * 1000);
  const s = m.stop();
  return s.workerd_cpu_s / s.wall_s;
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** A small seeded PRNG (mulberry32): `rng(seed)()` is uniform in [0, 1), the same for a seed. */
export function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Percentile `p` (0-100) of `xs`, nearest rank; null when empty. */
export function pct(xs, p) {
  if (!xs.length) return null;
  const s = Float64Array.from(xs).sort();
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))];
}

/**
 * Closed loop: `concurrency` workers each call `one(i)` (i counts calls) until `seconds` have
 * passed or `maxCalls` calls were started. Returns the calls' results and the wall time.
 */
export async function closedLoop({ concurrency, seconds, maxCalls = Infinity, one }) {
  const results = [];
  let started = 0;
  const t0 = performance.now();
  const deadline = t0 + seconds * 1000;
  const worker = async () => {
    while (started < maxCalls && performance.now() < deadline) {
      results.push(await one(started++));
    }
  };
  await Promise.all(Array.from({ length: concurrency }, worker));
  return { results, wall_s: (performance.now() - t0) / 1000 };
}

/**
 * A keep-alive HTTP client for one closed-loop phase: `post(url, body)` sends a JSON POST and
 * (with `headers`, if given) resolves with { status, headers_ms (to the response's headers), ttfb_ms (to
 * the first body byte), e2e_ms, chunks, bytes, server_timing (the response's header, or null), text? }.
 */
export function streamClient(maxSockets) {
  const agent = new http.Agent({ keepAlive: true, maxSockets });
  const post = (url, body, { keepText = false, headers = {} } = {}) =>
    new Promise((resolve) => {
      const t0 = performance.now();
      const rec = { status: 0, headers_ms: null, ttfb_ms: null, e2e_ms: null, chunks: 0, bytes: 0 };
      const parts = [];
      const req = http.request(url, { method: "POST", agent, headers: { "content-type": "application/json", "content-length": Buffer.byteLength(body), ...headers } }, (res) => {
        rec.headers_ms = performance.now() - t0;
        rec.status = res.statusCode;
        rec.server_timing = res.headers["server-timing"] ?? null;
        res.on("data", (d) => {
          if (rec.ttfb_ms === null) rec.ttfb_ms = performance.now() - t0;
          rec.chunks += 1;
          rec.bytes += d.length;
          if (keepText) parts.push(d);
        });
        res.on("end", () => {
          rec.e2e_ms = performance.now() - t0;
          if (keepText) rec.text = Buffer.concat(parts).toString();
          resolve(rec);
        });
        res.on("error", (e) => resolve({ ...rec, error: e.code ?? e.message }));
      });
      req.on("error", (e) => resolve({ ...rec, error: e.code ?? e.message }));
      req.end(body);
    });
  return { post, close: () => agent.destroy() };
}

/** A streamed chat body of `tokens` prompt tokens (4 bytes a token), unique by `nonce`. */
export function chatBody(model, tokens, maxTokens, nonce) {
  let content = `${nonce} `;
  for (let i = 0; content.length < tokens * 4; i++) content += ((nonce * 7919 + i * 104729) % 46656).toString(36).padStart(3, "0") + " ";
  return JSON.stringify({
    model,
    stream: true,
    max_tokens: maxTokens,
    ignore_eos: true,
    messages: [{ role: "user", content: content.slice(0, tokens * 4) }],
  });
}

/** The machine, as `nproc` and `lscpu` describe it, plus the load at the start. */
export function machine() {
  const lscpu = (() => {
    try {
      return execFileSync("lscpu", { encoding: "utf8" });
    } catch {
      return "";
    }
  })();
  const field = (name) => new RegExp(`^${name}:\\s*(.+)$`, "m").exec(lscpu)?.[1]?.trim() ?? null;
  return {
    nproc: Number(execFileSync("nproc", { encoding: "utf8" }).trim()),
    model_name: field("Model name"),
    hypervisor: field("Hypervisor vendor"),
    memory_gib: Math.round(os.totalmem() / 2 ** 30),
    loadavg_at_start: os.loadavg().map((x) => Number(x.toFixed(2))),
    node: process.version,
  };
}

/** Rounds every number in a plain object tree to `digits` significant decimals, for the JSON. */
export function rounded(value, digits = 4) {
  if (typeof value === "number") return Number.isInteger(value) ? value : Number(value.toPrecision(digits));
  if (Array.isArray(value)) return value.map((v) => rounded(v, digits));
  if (value && typeof value === "object") return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, rounded(v, digits)]));
  return value;
}

/**
 * The built Worker under Miniflare on a 127.0.0.1 port (clients reach workerd directly, not through
 * Miniflare's Node proxy), its console discarded, with one vllm-sim registered in pool `pool`
 * (`options`: more Miniflare options, e.g. `inspectorPort`).
 * Returns { gw, url, admin, sim, model, close }.
 */
export async function gatewayWithSim({ pool, model = "bench-model", simArgs = [], extraWorkers = [], options = {}, workerOptions = {}, bindings: extra = {}, sim: shared = null }) {
  const quiet = { handleRuntimeStdio: (out, err) => (out.resume(), err.resume()) };
  // MAX_STREAM_RESUMES=0 measures the stream path without resumption (the answer is not read).
  const resumes = process.env.MAX_STREAM_RESUMES;
  const bindings = { PROBE_INTERVAL_MS: "1000", ...(resumes === undefined ? {} : { MAX_STREAM_RESUMES: resumes }), ...extra };
  const gw = await startGateway({ bindings, options: { host: "127.0.0.1", port: 0, ...quiet, ...options }, extraWorkers, workerOptions });
  const url = new URL(await gw.mf.ready).origin;
  const admin = (p, opts) => adminFetch(url, p, opts);
  // A second gateway may share the first one's sim (`sim`), which it then leaves running.
  const sim = shared ?? (await startSim(["--model", model, "--max-num-seqs", "256", ...simArgs]));
  try {
    const r = await admin("/admin/backends", { method: "POST", body: { url: sim.url, pool, models: [model], id: `${pool}-sim` } });
    if (r.status !== 201) throw new Error(`register: ${r.status} ${await r.text()}`);
    await waitReady({ admin }, `${pool}-sim`);
    // Probes (one backend) stay rare during the measurement.
    const c = await admin(`/admin/pools/${pool}`, { method: "PUT", body: { probe_interval_ms: 60000 } });
    if (c.status !== 200) throw new Error(`pool config: ${c.status} ${await c.text()}`);
  } catch (e) {
    await gw.close();
    if (!shared) await sim.close();
    throw e;
  }
  return { gw, url, admin, sim, model, close: async () => { await gw.close(); if (!shared) await sim.close(); } };
}

/**
 * The floor (bench/floor-worker.mjs): a minimal JavaScript Worker in its own workerd, with the
 * gateway's compatibility date and flags, that forwards every request to `upstream` in `mode`
 * ("pass", "identity" or "transform"), after a `waitMs` timer when given. Returns { url, pid (its
 * workerd), close }.
 */
export async function floorWorker({ upstream, mode, waitMs = 0 }) {
  const mf = new Miniflare({
    name: `floor-${mode}`,
    scriptPath: path.join(ROOT, "bench/floor-worker.mjs"),
    modules: true,
    compatibilityDate: "2026-08-01",
    compatibilityFlags: ["enable_request_signal"],
    bindings: { UPSTREAM: upstream, MODE: mode, WAIT_MS: String(waitMs) },
    host: "127.0.0.1",
    port: 0,
    handleRuntimeStdio: (out, err) => (out.resume(), err.resume()),
  });
  const url = new URL(await mf.ready).origin;
  return { url, pid: workerdPid(), close: () => mf.dispose() };
}
