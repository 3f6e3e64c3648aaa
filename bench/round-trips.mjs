// The gateway's own round trips on the platform (issue 27): how much of a request's time to first
// byte the gateway adds beyond the one round trip and the backend's own time that no router can
// avoid, without and with the regional hop.
//
// One fast vllm-sim (--time-scale 1000) stands for the pool's GPUs; the client is in region
// "client-r", the pool in "pool-r", and the gateway runs with SIMULATE_NETWORK=true, so it waits out
// the configured round trip (REGION_RTT_MS) where the platform would pay one: without the hop,
// before the lease call and again before the backend fetch (the edge Worker talks to the pool's
// Durable Object and then to its backend, both near the GPUs); with the hop, once, before the
// hand-over to the regional Worker, which is in the pool's region and waits nothing. The round
// trips (50 and 150 ms) are assumed figures, not measurements. One request at a time.
//
// Per round trip it measures: the direct TTFB (the client calling vllm-sim itself, on this
// machine) and adds the round trip: the unavoidable path; then the gateway without the hop and
// with it. Reports TTFB p50/p99 and the excess over the unavoidable path (the target: <= 10 ms at
// p50 with the hop), then a local breakdown of the gateway's own time without any modelled network
// (from its Server-Timing parts).
//
// The same two again with rate limits on (a client key, limits high enough never to refuse), so
// every request is charged to its key's rate limiter: without the hop the limiter is modelled as
// far from the edge as the pool (SIMULATE_LIMITER_RTT_MS = the round trip: a key first seen near
// its pool), asked beside the lease call; with the hop the regional Worker charges it, the limiter
// in the pool's region (0 modelled). Both assumed. And with the hop twice more, for a key whose
// limiter is one round trip from the pool's region (a key first seen elsewhere; assumed the same
// round trip): charged exactly (the request waits for the limiter) and with RATE_LIMIT_AHEAD (a
// key this far from its limits is served without waiting). And both without and with the hop
// once more with ROUTE_AHEAD: the backend fetch sent beside the lease call (without the hop the
// edge then waits its two round trips at once, not one after the other).
//
// The model has a cost of its own: a timer in workerd fires a little late, and work after an idle
// wait runs on a cold core. So each round trip also measures the modelled floor: a forward-only
// JavaScript Worker (bench/floor-worker.mjs, `pass`, in its own workerd) that waits the same round
// trip on a timer and then forwards to vllm-sim: the unavoidable path as this model realizes it,
// which every excess is also reported against. Writes bench/results/round-trips-<date>.{json,md}
// (or -<suffix> with --suffix).
//
//   node bench/round-trips.mjs [--requests 150] [--warmup 20] [--rtts 50,150] [--suffix b]
import { startSim, adminFetch, waitReady, ROOT } from "../tests/lib/harness.mjs";
import { startWithHop } from "../tests/lib/hop.mjs";
import { writeFileSync, mkdirSync } from "node:fs";
import path from "node:path";
import { chatBody, floorWorker, machine, pct, rounded, streamClient } from "./overhead-lib.mjs";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const REQUESTS = Number(args.requests ?? 150);
const WARMUP = Number(args.warmup ?? 20);
const RTTS = String(args.rtts ?? "50,150").split(",").map(Number);
const MODEL = "rt-model";
const CLIENT = "client-r";
const POOL_REGION = "pool-r";
const PROMPT_TOKENS = 64;
const MAX_TOKENS = 16;
const KEY = "sk-round-trips-client";
const AUTH = { authorization: `Bearer ${KEY}` };

/** `n` sequential streamed requests to `url` (after `warmup` unmeasured ones): their TTFBs. */
async function ttfbs(url, n, headers = {}) {
  return (await records(url, n, headers)).map((r) => r.ttfb_ms);
}

/** `n` sequential streamed requests to `url` (after `warmup` unmeasured ones): their records. */
async function records(url, n, headers = {}) {
  const client = streamClient(1);
  const out = [];
  try {
    for (let i = 0; i < WARMUP + n; i++) {
      const r = await client.post(url, chatBody(MODEL, PROMPT_TOKENS, MAX_TOKENS, `${Date.now()}-${i}`), { headers });
      if (r.status !== 200 || r.error) throw new Error(`request ${i} to ${url}: ${r.status} ${r.error ?? ""}`);
      if (i >= WARMUP) out.push(r);
    }
  } finally {
    client.close();
  }
  return out;
}

async function gateway(rtt, hop, sim, limiterRtt = null, ahead = false, routeAhead = false) {
  const quiet = { handleRuntimeStdio: (o, e) => (o.resume(), e.resume()) };
  const bindings = {
    PROBE_INTERVAL_MS: "1000",
    ALLOW_REGION_HEADER: "true",
    SIMULATE_NETWORK: rtt > 0 ? "true" : "false",
    REGION_RTT_MS: JSON.stringify({ [CLIENT]: { [POOL_REGION]: rtt } }),
    ROUTE_AHEAD: String(routeAhead),
  };
  if (limiterRtt !== null) {
    Object.assign(bindings, {
      CLIENT_API_KEYS: KEY,
      RATE_LIMIT_RPM: "1000000",
      RATE_LIMIT_TPM: "1000000000",
      SIMULATE_LIMITER_RTT_MS: String(limiterRtt),
      RATE_LIMIT_AHEAD: String(ahead),
    });
  }
  const gw = await startWithHop({ region: POOL_REGION, bindings, hop, options: { host: "127.0.0.1", port: 0, ...quiet } });
  const url = new URL(await gw.mf.ready).origin;
  const admin = (p, o) => adminFetch(url, p, o);
  const put = await admin("/admin/pools/rt", { method: "PUT", body: { region: POOL_REGION, probe_interval_ms: 60000 } });
  if (put.status !== 200) throw new Error(`pool: ${put.status} ${await put.text()}`);
  const reg = await admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: "rt", models: [MODEL], id: "rt-sim" } });
  if (reg.status !== 201) throw new Error(`register: ${reg.status} ${await reg.text()}`);
  await waitReady({ admin }, "rt-sim");
  return { url, close: () => gw.close() };
}

const summary = (xs, plus = 0) => ({ p50: pct(xs, 50) + plus, p99: pct(xs, 99) + plus, n: xs.length });

const sim = await startSim(["--model", MODEL, "--max-num-seqs", "256", "--time-scale", "1000"]);
const rows = [];
let breakdown = null;
try {
  for (const rtt of RTTS) {
    const direct = await ttfbs(`${sim.url}/v1/chat/completions`, REQUESTS);
    const row = { rtt_ms: rtt, unavoidable: summary(direct, rtt), direct: summary(direct) };
    const floor = await floorWorker({ upstream: sim.url, mode: "pass", waitMs: rtt });
    try {
      row.modelled_floor = summary(await ttfbs(`${floor.url}/v1/chat/completions`, REQUESTS));
    } finally {
      await floor.close();
    }
    const runs = [
      ["without_hop", false, null],
      ["with_hop", true, null],
      ["without_hop_limited", false, rtt],
      ["with_hop_limited", true, 0],
      ["with_hop_far_limiter", true, rtt],
      ["with_hop_far_limiter_ahead", true, rtt, true],
      ["without_hop_route_ahead", false, null, false, true],
      ["with_hop_route_ahead", true, null, false, true],
    ];
    for (const [name, hop, limiterRtt, ahead = false, routeAhead = false] of runs) {
      const g = await gateway(rtt, hop, sim, limiterRtt, ahead, routeAhead);
      try {
        const headers = { "x-gateway-region": CLIENT, ...(limiterRtt === null ? {} : AUTH) };
        const t = await ttfbs(`${g.url}/v1/chat/completions`, REQUESTS, headers);
        const s = summary(t);
        row[name] = {
          ...s,
          excess_p50: s.p50 - row.unavoidable.p50,
          excess_p99: s.p99 - row.unavoidable.p99,
          over_floor_p50: s.p50 - row.modelled_floor.p50,
          over_floor_p99: s.p99 - row.modelled_floor.p99,
        };
      } finally {
        await g.close();
      }
    }
    rows.push(row);
    console.log(JSON.stringify(rounded(row)));
  }
  // The local breakdown (no modelled network, no hop): where the gateway's own time goes, from
  // the Server-Timing parts the Worker reports (route: pool list and the lease call to the pool's
  // Durable Object; upstream: the backend fetch to its first byte) and the client's TTFB. The rest
  // (Worker CPU before the acquire, the first-chunk path and the relay, the HTTP hop into workerd)
  // is what is left: workerd's clock does not advance during pure computation, so CPU-only parts
  // cannot be timed from inside the Worker.
  const direct = await ttfbs(`${sim.url}/v1/chat/completions`, REQUESTS);
  const g = await gateway(0, false, sim);
  try {
    const recs = await records(`${g.url}/v1/chat/completions`, REQUESTS);
    const part = (name) => recs.map((r) => Number(new RegExp(`${name};dur=([0-9.]+)`).exec(r.server_timing ?? "")?.[1] ?? NaN));
    const route = part("route");
    const upstream = part("upstream");
    const ttfb = recs.map((r) => r.ttfb_ms);
    const rest = ttfb.map((t, i) => t - route[i] - upstream[i]);
    breakdown = {
      direct_ttfb: summary(direct),
      gateway_ttfb: summary(ttfb),
      excess_p50: pct(ttfb, 50) - pct(direct, 50),
      route_ms: summary(route),
      upstream_ms: summary(upstream),
      upstream_over_direct_p50: pct(upstream, 50) - pct(direct, 50),
      rest_ms: summary(rest),
    };
    console.log(JSON.stringify(rounded(breakdown)));
  } finally {
    await g.close();
  }
} finally {
  await sim.close();
}

const date = new Date().toISOString().slice(0, 10);
const dir = path.join(ROOT, "bench/results");
mkdirSync(dir, { recursive: true });
const result = { bench: "round-trips", date, requests: REQUESTS, warmup: WARMUP, machine: machine(), rows, breakdown };
const stem = `round-trips-${date}${args.suffix ? `-${args.suffix}` : ""}`;
writeFileSync(path.join(dir, `${stem}.json`), JSON.stringify(rounded(result), null, 2) + "\n");
const f = (x) => x.toFixed(1);
const md = [
  `# The gateway's own round trips (bench/round-trips.mjs), ${date}`,
  "",
  `One request at a time, ${REQUESTS} measured after ${WARMUP} warm-up, streamed, ${PROMPT_TOKENS} prompt tokens; one vllm-sim at --time-scale 1000; ` +
    "SIMULATE_NETWORK=true with the client-to-pool round trip below (assumed, not measured). Unavoidable = direct TTFB + one round trip. TTFB in ms.",
  "",
  "| round trip | unavoidable p50 / p99 | without hop p50 / p99 | excess p50 / p99 | with hop p50 / p99 | excess p50 / p99 |",
  "|---|---|---|---|---|---|",
  ...rows.map((r) =>
    `| ${r.rtt_ms} ms | ${f(r.unavoidable.p50)} / ${f(r.unavoidable.p99)} | ${f(r.without_hop.p50)} / ${f(r.without_hop.p99)} | ${f(r.without_hop.excess_p50)} / ${f(r.without_hop.excess_p99)} | ${f(r.with_hop.p50)} / ${f(r.with_hop.p99)} | ${f(r.with_hop.excess_p50)} / ${f(r.with_hop.excess_p99)} |`),
  "",
  "With rate limits on (every request charged to its key's limiter; without the hop the limiter modelled one round trip from the edge, asked beside the lease call; with the hop charged by the regional Worker, the limiter in the pool's region):",
  "",
  "| round trip | without hop p50 / p99 | excess p50 / p99 | with hop p50 / p99 | excess p50 / p99 |",
  "|---|---|---|---|---|",
  ...rows.map((r) =>
    `| ${r.rtt_ms} ms | ${f(r.without_hop_limited.p50)} / ${f(r.without_hop_limited.p99)} | ${f(r.without_hop_limited.excess_p50)} / ${f(r.without_hop_limited.excess_p99)} | ${f(r.with_hop_limited.p50)} / ${f(r.with_hop_limited.p99)} | ${f(r.with_hop_limited.excess_p50)} / ${f(r.with_hop_limited.excess_p99)} |`),
  "",
  "With the hop, for a key whose rate limiter is one round trip from the pool's region (assumed: a key first seen in another region), charged exactly or with RATE_LIMIT_AHEAD (a key far from its limits served without waiting for the limiter):",
  "",
  "| round trip | exact p50 / p99 | excess p50 / p99 | ahead p50 / p99 | excess p50 / p99 |",
  "|---|---|---|---|---|",
  ...rows.map((r) =>
    `| ${r.rtt_ms} ms | ${f(r.with_hop_far_limiter.p50)} / ${f(r.with_hop_far_limiter.p99)} | ${f(r.with_hop_far_limiter.excess_p50)} / ${f(r.with_hop_far_limiter.excess_p99)} | ${f(r.with_hop_far_limiter_ahead.p50)} / ${f(r.with_hop_far_limiter_ahead.p99)} | ${f(r.with_hop_far_limiter_ahead.excess_p50)} / ${f(r.with_hop_far_limiter_ahead.excess_p99)} |`),
  "",
  "With ROUTE_AHEAD (the backend fetch sent beside the lease call, to the backend the isolate expects the pool to choose; one backend here, so every guess is right), without and with the hop:",
  "",
  "| round trip | without hop p50 / p99 | excess p50 / p99 | over floor p50 / p99 | with hop p50 / p99 | excess p50 / p99 | over floor p50 / p99 |",
  "|---|---|---|---|---|---|---|",
  ...rows.map((r) => {
    const a = r.without_hop_route_ahead;
    const b = r.with_hop_route_ahead;
    return `| ${r.rtt_ms} ms | ${f(a.p50)} / ${f(a.p99)} | ${f(a.excess_p50)} / ${f(a.excess_p99)} | ${f(a.over_floor_p50)} / ${f(a.over_floor_p99)} | ${f(b.p50)} / ${f(b.p99)} | ${f(b.excess_p50)} / ${f(b.excess_p99)} | ${f(b.over_floor_p50)} / ${f(b.over_floor_p99)} |`;
  }),
  "",
  "Against the modelled floor (a forward-only JavaScript Worker in its own workerd that waits the same round trip on a timer, then forwards: the unavoidable path as this model realizes it), ms p50 / p99:",
  "",
  "| round trip | floor | floor over unavoidable | without hop over floor | with hop over floor | without hop, limits, over floor | with hop, limits, over floor |",
  "|---|---|---|---|---|---|---|",
  ...rows.map((r) => {
    const fl = r.modelled_floor;
    const over = (c) => `${f(r[c].over_floor_p50)} / ${f(r[c].over_floor_p99)}`;
    return `| ${r.rtt_ms} ms | ${f(fl.p50)} / ${f(fl.p99)} | ${f(fl.p50 - r.unavoidable.p50)} / ${f(fl.p99 - r.unavoidable.p99)} | ${over("without_hop")} | ${over("with_hop")} | ${over("without_hop_limited")} | ${over("with_hop_limited")} |`;
  }),
  "",
  "Locally, no modelled network, without the hop (ms, p50 / p99; route and upstream from the Worker's Server-Timing, whole ms):",
  "",
  "| part | p50 / p99 |",
  "|---|---|",
  `| direct vllm-sim TTFB | ${f(breakdown.direct_ttfb.p50)} / ${f(breakdown.direct_ttfb.p99)} |`,
  `| gateway TTFB | ${f(breakdown.gateway_ttfb.p50)} / ${f(breakdown.gateway_ttfb.p99)} (excess p50 ${f(breakdown.excess_p50)}) |`,
  `| route (pool list + lease call to the pool's Durable Object) | ${f(breakdown.route_ms.p50)} / ${f(breakdown.route_ms.p99)} |`,
  `| upstream (backend fetch to first byte, from the Worker) | ${f(breakdown.upstream_ms.p50)} / ${f(breakdown.upstream_ms.p99)} |`,
  `| rest (CPU before the acquire, first chunk, relay, HTTP into workerd) | ${f(breakdown.rest_ms.p50)} / ${f(breakdown.rest_ms.p99)} |`,
  "",
  `Machine: ${result.machine.nproc} cores, ${result.machine.model_name ?? "unknown CPU"}, load at start ${result.machine.loadavg_at_start.join(" ")}.`,
  "",
];
writeFileSync(path.join(dir, `${stem}.md`), md.join("\n"));
console.log(md.join("\n"));
