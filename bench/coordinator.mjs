// Part (a) of the overhead benchmark: one pool Durable Object's capacity in acquire+release pairs
// per second, called through its stub so that no Worker code runs.
//
// Two drivers call the same object: `workerd`, a small load driver running inside workerd beside
// the gateway (bench/do-driver.mjs: what the Worker's own stub calls look like, and the figure the
// target is judged on), and `node`, Node calling the stub through Miniflare's
// getDurableObjectNamespace (each call crosses Miniflare's Node-to-workerd proxy, whose own ceiling
// is measured as that driver's `floor`: the cheapest call there is, GET /config).
//
// Features are realistic: 64 registered, probed-healthy backends (tiny local HTTP servers that
// answer the probes; nothing else is sent to them); prompts of 2,048 and 16,384 tokens (128 and
// 1,024 block hashes of 16 tokens); the affinity table warmed to its default bound of 500,000
// entries (an entry is a chunk of up to 16 blocks: up to 8,000,000 blocks) by 8,000 acquires of
// 16k-token prompts with distinct prefixes. Each measured request
// shares the first half of its blocks with a random warm prompt (a prefix hit) and has fresh blocks
// after it (new entries, evicting old ones), as a stream of multi-turn conversations would. The
// wire format lives in bench/do-protocol.mjs alone.
//
//   node bench/overhead.mjs --only coordinator [--seconds 15] [--do-concurrency 16]
import path from "node:path";
import { appendFileSync } from "node:fs";
import { ROOT, startGateway, startSseServer, waitFor } from "../tests/lib/harness.mjs";
import { closedLoop, cpuMeter, idleCpuRate, pct, workerdPid } from "./overhead-lib.mjs";
import { PROTOCOL } from "./do-protocol.mjs";
import { features, records, step } from "./do-driver.mjs";

const POOL = "bench-do";
const MODEL = "sse-model"; // what startSseServer lists on /v1/models
const BACKENDS = 64;
const WARM_PROMPTS = 8000; // x 64 chunk entries each: past the 500,000-entry bound
const WARM_BLOCKS = 1024; // 16,384 tokens
// KV size hint per backend: 1,048,576 blocks of 16 tokens, so that whichever backends the policy
// prefers (with 16 calls in flight, about 16 of the 64) can hold their share of the table and the
// global bound is what is being exercised (at 262,144 the warm-up stopped at 16 backends' bounds).
const KV_BLOCKS = 1048576;
const RUN_SLICE_S = 2;

/** Miniflare options of the in-workerd load driver (bench/do-driver.mjs). */
export const DRIVER = {
  name: "bench-driver",
  modules: true,
  scriptPath: path.join(ROOT, "bench/do-driver.mjs"),
  compatibilityDate: "2026-08-01",
  durableObjects: { POOL: { className: "PoolCoordinator", scriptName: "gateway", useSQLite: true } },
};

/** Summarises the records of one phase (from either driver) with its CPU figures. */
function summary(name, driver, recs, wall_s, cpu) {
  const all = (k) => recs.flatMap((r) => r[k]);
  const pairs = recs.reduce((s, r) => s + r.pairs, 0);
  const ok = recs.reduce((s, r) => s + r.ok, 0);
  const statuses = {};
  for (const r of recs) for (const [k, v] of Object.entries(r.statuses)) statuses[k] = (statuses[k] ?? 0) + v;
  const acquire = all("acquire_ms");
  const release = all("release_ms");
  return {
    name, driver, pairs, ok_pairs: ok, acquire_statuses: statuses, wall_s,
    pairs_per_s: ok / wall_s,
    acquire_ms: { p50: pct(acquire, 50), p99: pct(acquire, 99) },
    release_ms: { p50: pct(release, 50), p99: pct(release, 99) },
    mean_cached_blocks: recs.reduce((s, r) => s + r.cached_blocks, 0) / Math.max(1, ok),
    workerd_cpu_ms_per_pair: (cpu.workerd_cpu_s * 1000) / Math.max(1, pairs),
    node_cpu_ms_per_pair: (cpu.node_cpu_s * 1000) / Math.max(1, pairs),
    workerd_cpu_share: cpu.workerd_cpu_s / wall_s,
  };
}

/**
 * One phase driven from inside workerd: `concurrency` loops at once (options `o`, see
 * do-driver.mjs), each a series of /run calls of at most RUN_SLICE_S seconds (one long invocation
 * making thousands of subrequests is not what the Worker does, and workerd cut such calls off).
 */
export async function workerdPhase(driver, pid, name, o, concurrency) {
  const meter = cpuMeter(pid);
  const t0 = performance.now();
  const end = t0 + o.seconds * 1000;
  const maxPairs = o.max_pairs ?? 1e9;
  const recs = await Promise.all(
    Array.from({ length: concurrency }, async (_, k) => {
      const sum = records();
      for (let left; (left = (end - performance.now()) / 1000) > 0.05 && sum.pairs < maxPairs; ) {
        const r = await driver.fetch("http://driver/run", {
          method: "POST",
          body: JSON.stringify({
            pool: POOL, model: MODEL, warm_prompts: WARM_PROMPTS, warm_blocks: WARM_BLOCKS, ...o,
            first_index: k + sum.pairs * concurrency, stride: concurrency,
            seconds: Math.min(RUN_SLICE_S, left), max_pairs: maxPairs - sum.pairs,
          }),
        });
        const j = await r.json();
        if (r.status !== 200) throw new Error(`driver: ${j.error}`);
        if (j.pairs === 0) break; // nothing left to do (a warm-up's prompts are all sent)
        sum.pairs += j.pairs;
        sum.ok += j.ok;
        for (const [s, n] of Object.entries(j.statuses)) sum.statuses[s] = (sum.statuses[s] ?? 0) + n;
        sum.acquire_ms.push(...j.acquire_ms);
        sum.release_ms.push(...j.release_ms);
        sum.cached_blocks += j.cached_blocks;
      }
      return sum;
    }),
  );
  return summary(name, "workerd", recs, (performance.now() - t0) / 1000, meter.stop());
}

/** The same phase driven from Node through Miniflare's stub proxy. */
async function nodePhase(call, pid, name, o, concurrency) {
  const meter = cpuMeter(pid);
  const rec = records();
  const full = { model: MODEL, warm_prompts: WARM_PROMPTS, warm_blocks: WARM_BLOCKS, ...o };
  const { wall_s } = await closedLoop({ concurrency, seconds: o.seconds, one: (i) => step(call, full, i, rec) });
  return summary(name, "node", [rec], wall_s, meter.stop());
}

async function metric(call, name) {
  const text = await (await call("/metrics", { method: "GET" })).text();
  const m = new RegExp(`^${name}(\\{[^}]*\\})? (\\S+)$`, "m").exec(text);
  return m ? Number(m[2]) : null;
}

/** Part (a). Options: seconds per measured phase (the Node driver gets a third), calls in flight. */
export async function measureCoordinator({ seconds = 15, concurrency = 16, log = console.error } = {}) {
  // The runtime's output is dropped, except lines that say the object failed (kept for the report).
  const failures = [];
  const logFile = process.env.BENCH_RUNTIME_LOG; // set to keep all of the runtime's output, for diagnosis
  const keep = (stream) => stream.on("data", (d) => {
    if (logFile) appendFileSync(logFile, d);
    for (const l of String(d).split("\n")) if (/panic|error|unreachable|exceed|memory|reset|abort/i.test(l)) failures.push(l.slice(0, 300));
  });
  const quiet = { handleRuntimeStdio: (out, err) => (keep(out), keep(err)) };
  const gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "1000" }, options: quiet, extraWorkers: [DRIVER] });
  const servers = [];
  try {
    for (let i = 0; i < BACKENDS; i++) servers.push(await startSseServer({ chunks: 1, delayMs: 0 }));
    const ns = await gw.mf.getDurableObjectNamespace("POOL", "gateway");
    const stub = ns.get(ns.idFromName(POOL));
    const call = (p, init) =>
      stub.fetch(`https://do.internal${p}`, { ...init, headers: { ...(init.headers ?? {}), [PROTOCOL.poolHeader]: POOL } });
    const driver = await gw.mf.getWorker("bench-driver");

    for (let i = 0; i < BACKENDS; i++) {
      const r = await gw.admin("/admin/backends", {
        method: "POST",
        body: { url: servers[i].url, pool: POOL, models: [MODEL], id: `be-${String(i).padStart(2, "0")}`, kv_blocks: KV_BLOCKS, block_size: 16, max_num_seqs: 256 },
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

    const floorSeconds = Math.min(seconds, 4);
    const floors = [
      await workerdPhase(driver, pid, "floor: GET /config", { mode: "floor", seconds: floorSeconds }, concurrency),
      await nodePhase(call, pid, "floor: GET /config", { mode: "floor", seconds: floorSeconds }, concurrency),
    ];
    log(`coordinator: floor (GET /config): workerd driver ${floors[0].pairs_per_s.toFixed(0)} calls/s, node driver ${floors[1].pairs_per_s.toFixed(0)} calls/s`);

    const warm = await workerdPhase(driver, pid, "warm-up: 16k tokens, distinct prefixes", { mode: "warm", seconds: 120 }, concurrency);
    const entries = await metric(call, "llm_gateway_affinity_entries");
    warm.affinity_entries_after = entries;
    warm.probe_rounds_after = await metric(call, "llm_gateway_probe_rounds_total");
    log(`coordinator: warmed, ${entries} affinity entries (${warm.pairs_per_s.toFixed(0)} pairs/s while warming)`);

    const phases = [warm];
    for (const [name, blocks] of [["2k tokens", 128], ["16k tokens", 1024]]) {
      const o = { mode: "measure", blocks, shared: blocks / 2 };
      const bytes = PROTOCOL.acquire(features({ ...o, model: MODEL, warm_prompts: WARM_PROMPTS }, 0)).body.length;
      for (const run of [
        () => workerdPhase(driver, pid, name, { ...o, seconds }, concurrency),
        () => nodePhase(call, pid, name, { ...o, seconds: Math.max(2, seconds / 3) }, concurrency),
      ]) {
        const p = await run();
        p.prompt_tokens = blocks * 16;
        p.acquire_body_bytes = bytes;
        p.affinity_entries_after = await metric(call, "llm_gateway_affinity_entries");
        // In-memory counter: a drop means the object restarted.
        p.probe_rounds_after = await metric(call, "llm_gateway_probe_rounds_total");
        log(`coordinator: ${name} (${p.driver} driver): ${p.pairs_per_s.toFixed(0)} pairs/s, acquire p50 ${p.acquire_ms.p50?.toFixed(2)} ms, workerd ${p.workerd_cpu_ms_per_pair.toFixed(3)} ms CPU/pair; ${p.affinity_entries_after} affinity entries after`);
        phases.push(p);
      }
    }
    // What a pair costs beyond two of the cheapest calls through the same path: the object's own
    // work on acquire and release (parsing, routing, recording), less its trivial-call share.
    for (const p of phases) {
      const floor = floors.find((f) => f.driver === p.driver);
      p.cpu_ms_beyond_two_floor_calls = p.workerd_cpu_ms_per_pair - 2 * floor.workerd_cpu_ms_per_pair;
    }
    const after = await (await call("/state", { method: "GET" })).json();
    return {
      method:
        `Closed loop, ${concurrency} calls in flight, against one pool Durable Object through its stub; each pair is POST /acquire, ` +
        "then POST /release of the granted lease (outcome success); no Worker code runs. Driver `workerd`: a load driver inside workerd " +
        "(bench/do-driver.mjs, a second Miniflare worker bound to the gateway's PoolCoordinator) calling by Durable Object RPC " +
        "(gatewayCall, as the Worker's lease calls go), the target's figure. Driver `node`: " +
        "Node through Miniflare's getDurableObjectNamespace stub and its fetch (every call crosses Miniflare's Node-to-workerd proxy). " +
        "CPU: /proc/<workerd pid>/stat utime+stime over each phase (the workerd driver's own JavaScript included). " +
        "Floor: GET /config, the cheapest call, through the same path: each driver's ceiling.",
      backends: BACKENDS,
      kv_blocks_per_backend: KV_BLOCKS,
      policy,
      concurrency,
      seconds,
      affinity_entries_after_warmup: entries,
      affinity_entries_at_end: await metric(call, "llm_gateway_affinity_entries"),
      in_flight_at_end: after.in_flight,
      runtime_failures: failures.slice(0, 20),
      workerd_idle_cpu_share: idle,
      floors,
      phases,
    };
  } finally {
    await gw.close();
    await Promise.all(servers.map((s) => s.close()));
  }
}
