// Part (c) of the overhead benchmark: the gateway's closed-loop request rate and added time to
// first byte against calling vllm-sim directly, at 1, 16 and 64 concurrent requests.
//
// One vllm-sim at --time-scale 1000 (a decode step of ~10 us, prefill of 128 tokens ~13 us) with
// room for 256 sequences, so the backend is not the bottleneck. The same Node http client (keep-
// alive, one connection per concurrent request) sends the same kind of request, a streamed chat of
// a unique 128-token prompt with 16 output tokens, first straight to the sim, then to the gateway
// (the built Worker in workerd, on its own 127.0.0.1 port), for a fixed time each after a short
// warm-up. Time to first byte is from sending the request to the first body byte; added latency
// is gateway minus direct at the same percentile; the rate ratio is gateway over direct. Then the
// floors (bench/floor-worker.mjs, a JavaScript Worker that only forwards, each in its own workerd)
// run the same phase: "pass" returns the body as is (the least any Worker adds), "loop" reads it
// chunk by chunk into a native stream, as the gateway's relay does. Before the floors, at each
// concurrency: the same gateway with ROUTE_AHEAD (its own workerd, the same sim: the backend fetch
// sent beside the lease call), and the first gateway through its second door, a socket workerd
// serves straight to the Worker (Miniflare's `unsafeDirectSockets`), without Miniflare's entry
// worker, the JavaScript proxy `wrangler dev` and Miniflare put in front of every Worker (on the
// platform no such proxy runs; the front line is Cloudflare's own).
//
// Each gateway phase also splits its time to first byte per request (`breakdown`), from the
// Worker's `Server-Timing` (whole milliseconds: workerd's clock) and the client's timestamps:
// `pre` (the Worker before the lease call: key, body, features, pool list, plan), `acquire` (the
// lease call to the pool's Durable Object), `upstream` (the backend fetch to its first chunk),
// `after_grant` (the rest of the Worker's time to the response's headers: the guard, the
// upstream request, the headers), `outside` (client to the Worker's start and the headers back:
// HTTP into workerd, the runtime's glue, the microtasks before the response leaves) and `relay`
// (headers to the first body byte: the relay's first write). Parts add up to the client's TTFB.
//
//   node bench/overhead.mjs --only latency [--latency-seconds 8] [--latency-concurrency 1,16,64]
import { chatBody, closedLoop, cpuMeter, floorWorker, gatewayWithSim, pct, streamClient, workerdPid } from "./overhead-lib.mjs";

const POOL = "bench-latency";
const PROMPT_TOKENS = 128;
const MAX_TOKENS = 16;
/** The floors run after the gateway at each concurrency (bench/floor-worker.mjs modes). */
const FLOOR_MODES = ["pass", "loop"];
/** The Worker's `Server-Timing` parts the breakdown reads (src/request/forward/proxy.rs, `Timing`). */
const TIMING_PARTS = ["pre", "acquire", "upstream", "worker"];

/** One `Server-Timing` part's duration in ms, or NaN when the header lacks it. */
function timingPart(header, name) {
  return Number(new RegExp(`(?:^|,)\\s*${name};dur=([0-9.]+)`).exec(header ?? "")?.[1] ?? NaN);
}

/**
 * Where each request's time to first byte went (see the file's comment): p50, p99 and mean of
 * every part over the requests whose header has all of them (null when none has: a build before
 * the parts existed).
 */
export function ttfbBreakdown(records) {
  const rows = records.flatMap((r) => {
    const t = Object.fromEntries(TIMING_PARTS.map((n) => [n, timingPart(r.server_timing, n)]));
    if (TIMING_PARTS.some((n) => Number.isNaN(t[n])) || r.headers_ms === null) return [];
    return [{
      pre: t.pre,
      acquire: t.acquire,
      upstream: t.upstream,
      after_grant: t.worker - t.pre - t.acquire - t.upstream,
      outside: r.headers_ms - t.worker,
      relay: r.ttfb_ms - r.headers_ms,
      ttfb: r.ttfb_ms,
    }];
  });
  if (!rows.length) return null;
  const stat = (xs) => ({ p50: pct(xs, 50), p99: pct(xs, 99), mean: xs.reduce((a, b) => a + b, 0) / xs.length });
  const parts = Object.fromEntries(Object.keys(rows[0]).map((k) => [k, stat(rows.map((r) => r[k]))]));
  // The slowest 1%: which part the time went to in the requests that make the p99.
  const slow = rows.filter((r) => r.ttfb >= parts.ttfb.p99);
  const slowest_1pct_mean = Object.fromEntries(Object.keys(rows[0]).map((k) => [k, slow.reduce((a, r) => a + r[k], 0) / slow.length]));
  return { requests: rows.length, parts, slowest_1pct_mean };
}

async function closedPhase(client, pid, target, model, concurrency, seconds, nonce0) {
  const body = (i) => chatBody(model, PROMPT_TOKENS, MAX_TOKENS, nonce0 + i);
  await closedLoop({ concurrency, seconds: 0.5, one: (i) => client.post(target, body(1e6 + i)) });
  const meter = cpuMeter(pid);
  const run = await closedLoop({ concurrency, seconds, one: (i) => client.post(target, body(i)) });
  const cpu = meter.stop();
  const ok = run.results.filter((r) => r.status === 200 && !r.error);
  const ttfb = ok.map((r) => r.ttfb_ms);
  return {
    requests: run.results.length,
    errors: run.results.length - ok.length,
    requests_per_s: ok.length / run.wall_s,
    ttfb_ms: { p50: pct(ttfb, 50), p90: pct(ttfb, 90), p99: pct(ttfb, 99) },
    e2e_ms_p50: pct(ok.map((r) => r.e2e_ms), 50),
    breakdown: ttfbBreakdown(ok),
    workerd_cpu_share: cpu.workerd_cpu_s / cpu.wall_s,
    client_cpu_ms_per_request: (cpu.node_cpu_s * 1000) / Math.max(1, run.results.length),
  };
}

/** A phase's figures with what it adds to calling vllm-sim directly (`d`, the same concurrency). */
function againstDirect(x, d) {
  return {
    ...x,
    added_ttfb_ms: { p50: x.ttfb_ms.p50 - d.ttfb_ms.p50, p99: x.ttfb_ms.p99 - d.ttfb_ms.p99 },
    rate_ratio: x.requests_per_s / d.requests_per_s,
  };
}

/** Part (c). `seconds`: measured time of each phase (direct and gateway at each concurrency). */
export async function measureLatency({ seconds = 8, concurrencies = [1, 16, 64], log = console.error } = {}) {
  const env = await gatewayWithSim({
    pool: POOL,
    simArgs: ["--time-scale", "1000"],
    workerOptions: { unsafeDirectSockets: [{ host: "127.0.0.1", port: 0 }] },
  });
  const pid = workerdPid();
  const bypass = (await env.gw.mf.unsafeGetDirectURL()).origin;
  const floors = [];
  let ahead = null;
  try {
    // The same gateway with ROUTE_AHEAD (the backend fetch sent beside the lease call), in its
    // own workerd, on the same sim.
    ahead = await gatewayWithSim({ pool: POOL, sim: env.sim, bindings: { ROUTE_AHEAD: "true" } });
    ahead.pid = workerdPid();
    for (const mode of FLOOR_MODES) floors.push({ mode, ...(await floorWorker({ upstream: env.sim.url, mode })) });
  } catch (e) {
    for (const fl of floors) await fl.close();
    await ahead?.close();
    await env.close();
    throw e;
  }
  const client = streamClient(Math.max(...concurrencies));
  try {
    const direct = `${env.sim.url}/v1/chat/completions`;
    const gateway = `${env.url}/v1/chat/completions`;
    const points = [];
    for (const [k, c] of concurrencies.entries()) {
      const nonce = (j) => 1e7 * ((5 + FLOOR_MODES.length) * k + j);
      const d = await closedPhase(client, pid, direct, env.model, c, seconds, nonce(1));
      const g = await closedPhase(client, pid, gateway, env.model, c, seconds, nonce(2));
      const a = await closedPhase(client, ahead.pid, `${ahead.url}/v1/chat/completions`, env.model, c, seconds, nonce(3 + FLOOR_MODES.length));
      const b = await closedPhase(client, pid, `${bypass}/v1/chat/completions`, env.model, c, seconds, nonce(4 + FLOOR_MODES.length));
      const { added_ttfb_ms, rate_ratio } = againstDirect(g, d);
      const point = {
        concurrency: c,
        direct: d,
        gateway: g,
        added_ttfb_ms,
        rate_ratio,
        route_ahead: againstDirect(a, d),
        direct_socket: againstDirect(b, d),
        floors: [],
      };
      for (const [j, fl] of floors.entries()) {
        const f = await closedPhase(client, fl.pid, `${fl.url}/v1/chat/completions`, env.model, c, seconds, nonce(3 + j));
        point.floors.push({ mode: fl.mode, ...againstDirect(f, d) });
      }
      log(
        `latency: c=${c}: direct ${d.requests_per_s.toFixed(0)} req/s, TTFB p50 ${d.ttfb_ms.p50.toFixed(2)} p99 ${d.ttfb_ms.p99.toFixed(2)} ms; ` +
          `gateway ${g.requests_per_s.toFixed(0)} req/s, p50 ${g.ttfb_ms.p50.toFixed(2)} p99 ${g.ttfb_ms.p99.toFixed(2)} ms (workerd ${(g.workerd_cpu_share * 100).toFixed(0)}% of a core); ` +
          `ROUTE_AHEAD ${a.requests_per_s.toFixed(0)} req/s, p50 ${a.ttfb_ms.p50.toFixed(2)} p99 ${a.ttfb_ms.p99.toFixed(2)} ms; ` +
          `direct socket ${b.requests_per_s.toFixed(0)} req/s, p50 ${b.ttfb_ms.p50.toFixed(2)} p99 ${b.ttfb_ms.p99.toFixed(2)} ms` +
          point.floors.map((f) => `; floor ${f.mode} ${f.requests_per_s.toFixed(0)} req/s, p50 ${f.ttfb_ms.p50.toFixed(2)} p99 ${f.ttfb_ms.p99.toFixed(2)} ms`).join(""),
      );
      points.push(point);
    }
    return {
      method:
        `Closed loop, Node http client (keep-alive), streamed chat, unique ${PROMPT_TOKENS}-token prompt, ${MAX_TOKENS} output tokens (ignore_eos); ` +
        `one vllm-sim --time-scale 1000 --max-num-seqs 256; each phase ${seconds} s after a 0.5 s warm-up; at each concurrency direct first, then the gateway ` +
        "(built Worker under Miniflare/workerd on its own 127.0.0.1 port, through Miniflare's entry worker as `wrangler dev` serves it), the same gateway with " +
        "ROUTE_AHEAD (its own workerd), the first gateway through a socket workerd serves straight to it (no Miniflare entry worker, as on the platform), then " +
        "the floors (a JavaScript Worker in its own workerd that forwards with fetch and returns the body as is, `pass`, or reads it chunk by chunk into a native " +
        "stream, `loop`). TTFB = first body byte at the client.",
      prompt_tokens: PROMPT_TOKENS,
      max_tokens: MAX_TOKENS,
      seconds,
      points,
    };
  } finally {
    client.close();
    for (const fl of floors) await fl.close();
    await ahead.close();
    await env.close();
  }
}
