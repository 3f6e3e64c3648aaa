// Where the gateway's CPU goes: a V8 CPU profile of the built Worker's isolate (the Worker and its
// Durable Objects share it under Miniflare) over a closed loop of streamed requests through one
// vllm-sim, taken through workerd's inspector (Chrome DevTools protocol). Prints the functions with
// the most self time and the inclusive time of the gateway's main entry points, as a share of the
// profiled time and in microseconds per request; writes the raw profile for DevTools beside it.
//
//   node bench/profile.mjs [--requests 600] [--concurrency 1] [--max-tokens 16] [--prompt-tokens 128]
//                          [--top 40] [--out /tmp/gateway.cpuprofile]
//
// It also splits the samples by when they were taken: inside a request's time to first byte (from
// the client sending it to its first body byte, the client's monotonic clock, which is the
// profile's too on one machine) or outside it (the stream after its first byte, the release, the
// access log, the Durable Objects' work after the answer), and prints the top of each: what the
// time to first byte is made of, at one request in flight.
//
// The wasm keeps its name section (Cargo.toml: no wasm-opt), so Rust functions show by name. The
// sampling interval is 100 us; profiling slows the isolate, so read shares, not absolute times.
import { writeFileSync } from "node:fs";
import WebSocket from "ws";
import { chatBody, closedLoop, gatewayWithSim, streamClient } from "./overhead-lib.mjs";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const REQUESTS = Number(args.requests ?? 600);
const CONCURRENCY = Number(args.concurrency ?? 1);
const MAX_TOKENS = Number(args["max-tokens"] ?? 16);
const PROMPT_TOKENS = Number(args["prompt-tokens"] ?? 128);
const TOP = Number(args.top ?? 40);
const OUT = args.out ?? "/tmp/gateway.cpuprofile";
const INSPECTOR_PORT = 9239;

/** A Chrome DevTools protocol session on `url`: `send(method, params)` resolves with the result. */
async function devtools(url) {
  const ws = new WebSocket(url);
  await new Promise((resolve, reject) => (ws.once("open", resolve), ws.once("error", reject)));
  let next = 1;
  const waiting = new Map();
  ws.on("message", (data) => {
    const m = JSON.parse(data);
    if (m.id && waiting.has(m.id)) {
      const { resolve, reject } = waiting.get(m.id);
      waiting.delete(m.id);
      m.error ? reject(new Error(JSON.stringify(m.error))) : resolve(m.result);
    }
  });
  return {
    send: (method, params = {}) =>
      new Promise((resolve, reject) => {
        const id = next++;
        waiting.set(id, { resolve, reject });
        ws.send(JSON.stringify({ id, method, params }));
      }),
    close: () => ws.close(),
  };
}

/** A CPU profile's nodes by id, and each node's parent id. */
function tree(profile) {
  const byId = new Map(profile.nodes.map((n) => [n.id, n]));
  const parent = new Map();
  for (const n of profile.nodes) for (const c of n.children ?? []) parent.set(c, n.id);
  return { byId, parent };
}

/** Self and inclusive sample counts per function name of a CPU profile. */
function tally(profile) {
  const { byId, parent } = tree(profile);
  const hits = new Map();
  for (const s of profile.samples) hits.set(s, (hits.get(s) ?? 0) + 1);
  const self = new Map();
  const inclusive = new Map();
  const name = (n) => n.callFrame.functionName || `(anonymous ${n.callFrame.url.split("/").pop()}:${n.callFrame.lineNumber})`;
  for (const [id, count] of hits) {
    const leaf = byId.get(id);
    self.set(name(leaf), (self.get(name(leaf)) ?? 0) + count);
    const seen = new Set();
    for (let at = id; at !== undefined; at = parent.get(at)) {
      const nm = name(byId.get(at));
      if (seen.has(nm)) continue;
      seen.add(nm);
      inclusive.set(nm, (inclusive.get(nm) ?? 0) + count);
    }
  }
  return { self, inclusive, samples: profile.samples.length };
}

/**
 * Prints the samples taken inside requests' time to first byte (`windows`, [start, end] in the
 * profile's microseconds) apart from the rest: their share, us per request, and the top
 * functions of the Worker's own code (inclusive) and overall (self) inside the windows.
 */
function ttfbSplit(profile, windows, ok) {
  windows.sort((a, b) => a[0] - b[0]);
  const { byId, parent } = tree(profile);
  const name = (n) => n.callFrame.functionName.replace(/::h[0-9a-f]{16}.*/, "") || `(anonymous ${n.callFrame.url.split("/").pop()}:${n.callFrame.columnNumber})`;
  const usPerSample = (profile.endTime - profile.startTime) / profile.samples.length;
  const self = new Map();
  const inclusive = new Map();
  let t = profile.startTime;
  let w = 0;
  let inside = 0;
  let outside = 0;
  for (let i = 0; i < profile.samples.length; i++) {
    t += profile.timeDeltas[i];
    const leaf = byId.get(profile.samples[i]);
    if (leaf.callFrame.functionName === "(idle)") continue;
    while (w < windows.length && windows[w][1] < t) w++;
    if (w >= windows.length || windows[w][0] > t) {
      outside++;
      continue;
    }
    inside++;
    self.set(name(leaf), (self.get(name(leaf)) ?? 0) + 1);
    const seen = new Set();
    for (let at = leaf.id; at !== undefined; at = parent.get(at)) {
      const nm = name(byId.get(at));
      if (seen.has(nm) || !/^(llm_gateway|gateway_durable_objects|routing_core|coordinator_protocol|worker)::|^<worker::/.test(nm)) continue;
      seen.add(nm);
      inclusive.set(nm, (inclusive.get(nm) ?? 0) + 1);
    }
  }
  const us = (c) => ((c * usPerSample) / ok).toFixed(1).padStart(7);
  const busy = inside + outside;
  console.log(`\ninside the requests' time to first byte: ${((100 * inside) / busy).toFixed(0)}% of the isolate's busy samples (${us(inside).trim()} us per request), outside it ${us(outside).trim()} us`);
  console.log(`the Worker's code inside it, inclusive, top ${TOP} (us per request):`);
  for (const [nm, c] of [...inclusive].sort((a, b) => b[1] - a[1]).slice(0, TOP)) console.log(`${us(c)}  ${nm.slice(0, 140)}`);
  console.log(`self time inside it, top ${TOP} (us per request):`);
  for (const [nm, c] of [...self].sort((a, b) => b[1] - a[1]).slice(0, TOP)) console.log(`${us(c)}  ${nm.slice(0, 140)}`);
}

const env = await gatewayWithSim({ pool: "profile", simArgs: ["--time-scale", "1000"], options: { inspectorPort: INSPECTOR_PORT } });
const client = streamClient(CONCURRENCY);
try {
  const targets = await (await fetch(`http://127.0.0.1:${INSPECTOR_PORT}/json`)).json();
  const target = targets.find((t) => /gateway|core:user/.test(t.title ?? t.id)) ?? targets[0];
  console.error(`profile: inspector targets ${targets.map((t) => t.title).join(", ")}; profiling ${target.title}`);
  const url = `${env.url}/v1/chat/completions`;
  const body = (i) => chatBody(env.model, PROMPT_TOKENS, MAX_TOKENS, i);
  await closedLoop({ concurrency: CONCURRENCY, seconds: 60, maxCalls: 100, one: (i) => client.post(url, body(1e6 + i)) });
  const dt = await devtools(target.webSocketDebuggerUrl);
  await dt.send("Profiler.enable");
  await dt.send("Profiler.setSamplingInterval", { interval: 100 });
  await dt.send("Profiler.start");
  // The client's clock as the profile's: performance.now() in ms plus this offset is
  // CLOCK_MONOTONIC in us (process.hrtime), the clock V8's profiler stamps samples with.
  const offsetUs = Number(process.hrtime.bigint() / 1000n) - performance.now() * 1000;
  const windows = [];
  const run = await closedLoop({
    concurrency: CONCURRENCY,
    seconds: 600,
    maxCalls: REQUESTS,
    one: async (i) => {
      const sent = performance.now();
      const r = await client.post(url, body(i));
      if (r.ttfb_ms !== null) windows.push([sent * 1000 + offsetUs, (sent + r.ttfb_ms) * 1000 + offsetUs]);
      return r;
    },
  });
  const { profile } = await dt.send("Profiler.stop");
  dt.close();
  writeFileSync(OUT, JSON.stringify(profile));
  const ok = run.results.filter((r) => r.status === 200 && !r.error).length;
  const { self, inclusive, samples } = tally(profile);
  const wallUs = profile.endTime - profile.startTime;
  const usPerSample = wallUs / samples;
  const idle = self.get("(idle)") ?? 0;
  const busy = samples - idle;
  const perRequest = (count) => ((count * usPerSample) / ok).toFixed(1);
  console.log(`${ok}/${run.results.length} requests ok in ${run.wall_s.toFixed(1)} s at ${CONCURRENCY} in flight; ${samples} samples over ${(wallUs / 1e6).toFixed(1)} s, ${((100 * busy) / samples).toFixed(0)}% not idle; ${perRequest(busy)} us of the isolate's thread per request`);
  console.log(`\nself time, top ${TOP} (share of non-idle samples, us per request):`);
  for (const [nm, c] of [...self].filter(([nm]) => nm !== "(idle)").sort((a, b) => b[1] - a[1]).slice(0, TOP)) {
    console.log(`${((100 * c) / busy).toFixed(1).padStart(5)}%  ${perRequest(c).padStart(7)}  ${nm.slice(0, 150)}`);
  }
  console.log(`\ninclusive time, top ${TOP}:`);
  for (const [nm, c] of [...inclusive].filter(([nm]) => !["(root)", "(idle)"].includes(nm)).sort((a, b) => b[1] - a[1]).slice(0, TOP)) {
    console.log(`${((100 * c) / busy).toFixed(1).padStart(5)}%  ${perRequest(c).padStart(7)}  ${nm.slice(0, 150)}`);
  }
  ttfbSplit(profile, windows, ok);
  console.log(`\nraw profile: ${OUT} (open in Chrome DevTools' Performance panel)`);
} finally {
  client.close();
  await env.close();
}
