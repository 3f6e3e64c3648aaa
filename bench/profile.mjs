// Where the gateway's CPU goes: a V8 CPU profile of the built Worker's isolate (the Worker and its
// Durable Objects share it under Miniflare) over a closed loop of streamed requests through one
// vllm-sim, taken through workerd's inspector (Chrome DevTools protocol). Prints the functions with
// the most self time and the inclusive time of the gateway's main entry points, as a share of the
// profiled time and in microseconds per request; writes the raw profile for DevTools beside it.
//
//   node bench/profile.mjs [--requests 600] [--concurrency 1] [--max-tokens 16] [--prompt-tokens 128]
//                          [--top 40] [--out /tmp/gateway.cpuprofile]
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

/** Self and inclusive sample counts per function name of a CPU profile. */
function tally(profile) {
  const byId = new Map(profile.nodes.map((n) => [n.id, n]));
  const parent = new Map();
  for (const n of profile.nodes) for (const c of n.children ?? []) parent.set(c, n.id);
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
  const run = await closedLoop({ concurrency: CONCURRENCY, seconds: 600, maxCalls: REQUESTS, one: (i) => client.post(url, body(i)) });
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
  console.log(`\nraw profile: ${OUT} (open in Chrome DevTools' Performance panel)`);
} finally {
  client.close();
  await env.close();
}
