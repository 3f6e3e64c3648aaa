// Part (a) of the overhead benchmark: one pool Durable Object's capacity in acquire+release pairs
// per second, driven from Node through its stub (Miniflare's getDurableObjectNamespace, then
// stub.fetch), so no Worker code runs: only the Durable Object (and Miniflare's Node-to-workerd
// proxy, whose own ceiling is measured alongside as `floor`).
//
// Features are realistic: 64 registered, probed-healthy backends (tiny local HTTP servers that
// answer the probes; nothing else is ever sent to them); prompts of 2,048 and 16,384 tokens (128 and
// 1,024 block hashes of 16 tokens); the affinity table warmed to its default bound of 1,000,000
// entries by 1,000 acquires of 16k-token prompts with distinct prefixes. Each measured request
// shares the first half of its blocks with a random warm prompt (a prefix hit) and has fresh blocks
// after it (new entries, evicting old ones), as a stream of multi-turn conversations would.
//
//   node bench/overhead.mjs --only coordinator [--seconds 15] [--do-concurrency 16]
import { startGateway, startSseServer, waitFor } from "../tests/lib/harness.mjs";
import { closedLoop, cpuMeter, idleCpuRate, pct, workerdPid } from "./overhead-lib.mjs";
import { randomFillSync } from "node:crypto";

const POOL = "bench-do";
const MODEL = "sse-model"; // what startSseServer lists on /v1/models
const BACKENDS = 64;
const BLOCK_TOKENS = 16;
const WARM_PROMPTS = 1000;
const WARM_BLOCKS = 1024; // 16,384 tokens

// ---------------------------------------------------------------------------------------------
// The Worker <-> pool Durable Object protocol, as of 2026-12-01 (durable-objects/src/protocol.rs:
// AcquireRequest = routing_core::prompt::RequestFeatures flattened, JSON; block hashes as decimal
// u64s; ReleaseRequest; the grant is routing_core::pool::Grant as JSON). Everything that knows the
// wire format is in this block: when the protocol changes (block hashes are to become a compact
// binary encoding), update these four members and nothing else.
export const PROTOCOL = {
  acquirePath: "/acquire",
  releasePath: "/release",
  /** Request init for POST /acquire of `f` ({ request_id, model, prompt_tokens, max_tokens, block_hashes: BigUint64Array }). */
  acquire(f) {
    const body =
      `{"request_id":"${f.request_id}","kind":"chat","model":${JSON.stringify(f.model)},"stream":true,` +
      `"prompt_tokens":${f.prompt_tokens},"max_tokens":${f.max_tokens},"routing_key":null,` +
      `"block_tokens":${BLOCK_TOKENS},"block_hashes":[${f.block_hashes.join(",")}],"role_hint":null}`;
    return { method: "POST", headers: { "content-type": "application/json" }, body };
  },
  /** The lease in a granted acquire's response. */
  async grant(resp) {
    const g = await resp.json();
    return { lease_id: g.lease_id, backend: g.backend, cached_blocks: g.cached_blocks };
  },
  /** Request init for POST /release of grant `g` of request `f`, ended successfully. */
  release(g, f) {
    const body =
      `{"lease_id":${g.lease_id},"outcome":{"status":200,"kind":"success","ttfb_ms":20,` +
      `"prompt_tokens":${f.prompt_tokens},"cached_tokens":${Math.min(f.prompt_tokens, g.cached_blocks * BLOCK_TOKENS)},` +
      `"completion_tokens":${f.max_tokens}},"backend":${JSON.stringify(g.backend)}}`;
    return { method: "POST", headers: { "content-type": "application/json" }, body };
  },
};
// ---------------------------------------------------------------------------------------------

/** Fresh random block hashes (random u64s stand in for chained xxh3 values). */
function freshBlocks(n) {
  return randomFillSync(new BigUint64Array(n));
}

/** Request features: the first `shared` blocks of `prefix`, then fresh blocks up to `blocks`. */
function features(id, blocks, prefix, shared) {
  const h = freshBlocks(blocks);
  if (prefix) h.set(prefix.subarray(0, shared));
  return { request_id: `bench-${id}`, model: MODEL, prompt_tokens: blocks * BLOCK_TOKENS + 7, max_tokens: 128, block_hashes: h };
}

/** One acquire+release pair; returns timings and statuses. */
async function pair(call, f) {
  const t0 = performance.now();
  const a = await call(PROTOCOL.acquirePath, PROTOCOL.acquire(f));
  const t1 = performance.now();
  if (a.status !== 200) {
    await a.text();
    return { acquire_status: a.status, acquire_ms: t1 - t0 };
  }
  const g = await PROTOCOL.grant(a);
  const r = await call(PROTOCOL.releasePath, PROTOCOL.release(g, f));
  const ok = r.status === 200 && (await r.json()).released === true;
  return { acquire_status: 200, released: ok, acquire_ms: t1 - t0, release_ms: performance.now() - t1, cached_blocks: g.cached_blocks };
}

/** Runs a closed-loop phase of pairs and summarises it. */
async function phase(name, pid, call, { concurrency, seconds, maxCalls, make }) {
  const meter = cpuMeter(pid);
  const { results, wall_s } = await closedLoop({ concurrency, seconds, maxCalls, one: (i) => pair(call, make(i)) });
  const cpu = meter.stop();
  const ok = results.filter((r) => r.acquire_status === 200 && r.released);
  const statuses = {};
  for (const r of results) statuses[r.acquire_status] = (statuses[r.acquire_status] ?? 0) + 1;
  return {
    name,
    pairs: results.length,
    ok_pairs: ok.length,
    acquire_statuses: statuses,
    wall_s,
    pairs_per_s: ok.length / wall_s,
    acquire_ms: { p50: pct(ok.map((r) => r.acquire_ms), 50), p99: pct(ok.map((r) => r.acquire_ms), 99) },
    release_ms: { p50: pct(ok.map((r) => r.release_ms), 50), p99: pct(ok.map((r) => r.release_ms), 99) },
    mean_cached_blocks: ok.reduce((s, r) => s + r.cached_blocks, 0) / Math.max(1, ok.length),
    workerd_cpu_ms_per_pair: (cpu.workerd_cpu_s * 1000) / Math.max(1, results.length),
    node_cpu_ms_per_pair: (cpu.node_cpu_s * 1000) / Math.max(1, results.length),
    workerd_cpu_share: cpu.workerd_cpu_s / wall_s,
  };
}

async function metric(call, name) {
  const text = await (await call("/metrics", { method: "GET" })).text();
  const m = new RegExp(`^${name}(\\{[^}]*\\})? (\\S+)$`, "m").exec(text);
  return m ? Number(m[2]) : null;
}

/** Part (a). Options: seconds per measured phase, concurrency (calls in flight). */
export async function measureCoordinator({ seconds = 15, concurrency = 16, log = console.error } = {}) {
  const quiet = { handleRuntimeStdio: (out, err) => (out.resume(), err.resume()) };
  const gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "1000" }, options: quiet });
  const servers = [];
  try {
    for (let i = 0; i < BACKENDS; i++) servers.push(await startSseServer({ chunks: 1, delayMs: 0 }));
    const ns = await gw.mf.getDurableObjectNamespace("POOL");
    const stub = ns.get(ns.idFromName(POOL));
    const call = (path, init) =>
      stub.fetch(`https://do.internal${path}`, { ...init, headers: { ...init.headers, "x-gateway-pool": POOL } });

    // Register 64 backends through the admin API, with a KV size that lets the fleet hold 1M entries.
    for (let i = 0; i < BACKENDS; i++) {
      const r = await gw.admin("/admin/backends", {
        method: "POST",
        body: { url: servers[i].url, pool: POOL, models: [MODEL], id: `be-${String(i).padStart(2, "0")}`, kv_blocks: 65536, block_size: 16, max_num_seqs: 256 },
      });
      if (r.status !== 201) throw new Error(`register backend ${i}: ${r.status} ${await r.text()}`);
    }
    await waitFor(async () => (await (await call("/state", { method: "GET" })).json()).ready_backends === BACKENDS, {
      timeoutMs: 60000, intervalMs: 250, what: `${BACKENDS} backends ready`,
    });
    // Probes stay out of the measurement: the next round is an hour away.
    const cfg = await gw.admin(`/admin/pools/${POOL}`, { method: "PUT", body: { probe_interval_ms: 3600000 } });
    if (cfg.status !== 200) throw new Error(`pool config: ${cfg.status} ${await cfg.text()}`);
    const policy = (await (await call("/state", { method: "GET" })).json()).policy;
    const pid = workerdPid();
    const idle = await idleCpuRate(pid, 2);
    log(`coordinator: ${BACKENDS} backends ready, policy ${policy}; workerd idle ${(idle * 100).toFixed(1)}% of a core`);

    // The ceiling of this method: the cheapest call there is (GET /config) through the same stub.
    const meter = cpuMeter(pid);
    const floorRun = await closedLoop({
      concurrency, seconds: Math.min(seconds, 5),
      one: async () => { const r = await call("/config", { method: "GET" }); await r.text(); return r.status; },
    });
    const floorCpu = meter.stop();
    const floor = {
      calls: floorRun.results.length,
      calls_per_s: floorRun.results.filter((s) => s === 200).length / floorRun.wall_s,
      workerd_cpu_ms_per_call: (floorCpu.workerd_cpu_s * 1000) / floorRun.results.length,
      node_cpu_ms_per_call: (floorCpu.node_cpu_s * 1000) / floorRun.results.length,
    };
    log(`coordinator: floor (GET /config) ${floor.calls_per_s.toFixed(0)} calls/s`);

    // Warm the affinity table: 1,000 distinct 16k-token prompts (1,024,000 blocks; the bound is 1M).
    const warm = Array.from({ length: WARM_PROMPTS }, () => freshBlocks(WARM_BLOCKS));
    const warmPhase = await phase("warm-up: 16k tokens, distinct prefixes", pid, call, {
      concurrency, seconds: 120, maxCalls: WARM_PROMPTS,
      make: (i) => ({ request_id: `warm-${i}`, model: MODEL, prompt_tokens: WARM_BLOCKS * BLOCK_TOKENS, max_tokens: 128, block_hashes: warm[i] }),
    });
    const entries = await metric(call, "llm_gateway_affinity_entries");
    log(`coordinator: warmed, ${entries} affinity entries (${warmPhase.pairs_per_s.toFixed(0)} pairs/s while warming)`);

    const phases = [warmPhase];
    for (const [name, blocks] of [["2k tokens", 128], ["16k tokens", 1024]]) {
      const p = await phase(name, pid, call, {
        concurrency, seconds,
        make: (i) => features(`${blocks}-${i}`, blocks, warm[Math.floor(Math.random() * WARM_PROMPTS)], blocks / 2),
      });
      p.prompt_tokens = blocks * BLOCK_TOKENS;
      p.acquire_body_bytes = PROTOCOL.acquire(features("size", blocks, null, 0)).body.length;
      log(`coordinator: ${name}: ${p.pairs_per_s.toFixed(0)} pairs/s, acquire p50 ${p.acquire_ms.p50?.toFixed(2)} ms, workerd ${p.workerd_cpu_ms_per_pair.toFixed(3)} ms CPU/pair`);
      phases.push(p);
    }
    const after = await (await call("/state", { method: "GET" })).json();
    return {
      method:
        "Closed loop from Node through Miniflare's Durable Object stub (getDurableObjectNamespace('POOL').get(idFromName(pool)).fetch), " +
        `${concurrency} pairs in flight; each pair is POST /acquire then POST /release of the granted lease (outcome success). ` +
        "CPU from /proc/<workerd pid>/stat (utime+stime) over each phase; the Worker's code never runs. " +
        "`floor` is GET /config through the same stub: the ceiling of this method (Node + Miniflare's proxy + the object's fetch entry).",
      backends: BACKENDS,
      policy,
      concurrency,
      seconds,
      affinity_entries_after_warmup: entries,
      affinity_entries_at_end: await metric(call, "llm_gateway_affinity_entries"),
      in_flight_at_end: after.in_flight,
      workerd_idle_cpu_share: idle,
      floor,
      phases,
    };
  } finally {
    await gw.close();
    await Promise.all(servers.map((s) => s.close()));
  }
}
