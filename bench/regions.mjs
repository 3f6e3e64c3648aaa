// The cross-region benchmark (issue 25): three regions, each with its own pool of vllm-sim
// processes, modelled round trips between them, and a skewed load: one region's clients send about
// 1.5x what its pool can serve, the other two regions are light. Run once with nearest-first
// routing (TIME_ROUTING=false: a request leaves its region only when its pool refuses it) and once
// with routing on predicted time (the default); then a light phase with time routing, where every
// pool is lightly loaded and no request should leave its region.
//
// The network: every pool runs on this machine, so the gateway runs with SIMULATE_NETWORK=true and
// waits out the configured round trip between the client's region and the pool's before the lease
// call and again before the backend fetch (the two edge-to-pool round trips a request pays today),
// so the client's times include the modelled network and the Worker's own RTT measurements see it.
// The round trips (REGION_RTT below) are assumed figures of the size of inter-region RTTs (US East
// to EU West about 70-90 ms, to Asia 150-200 ms), not measurements.
//
// Reports per client region TTFT p50/p99 and e2e p50/p99 for each mode, the share of requests served
// in another region, and the light phase's cross-region count. Then the burst cell (issue 45): two
// regions, the busy one's single backend running 2 sequences at a time (the gateway is not told),
// 10 long streams arriving at once after the last probe round, and short requests from that
// region over the next 5 s, before any round: with lease evidence (the default) and without
// (`time_model.overdue_factor: 0`); it reports where the short requests went and their TTFT. Writes
// bench/results/regions-<date>.{json,md}.
//
//   node bench/regions.mjs [--seconds 30] [--load 1.5] [--light 0.3] [--sims 2] [--seqs 4] [--burst-only 1]
import { startGateway, startSim, waitReady, waitFor, ROOT, ADMIN_TOKEN } from "../tests/lib/harness.mjs";
import { writeFileSync, mkdirSync } from "node:fs";
import path from "node:path";
import { machine, pct, rng } from "./overhead-lib.mjs";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const SECONDS = Number(args.seconds ?? 30);
const LOAD = Number(args.load ?? 1.5);
const LIGHT = Number(args.light ?? 0.3);
const SIMS = Number(args.sims ?? 2);
const SEQS = Number(args.seqs ?? 4);
const SEED = Number(args.seed ?? 11);
const REGIONS = ["r-a", "r-b", "r-c"];
/** Assumed round trips between the regions, in ms. */
const REGION_RTT = { "r-a": { "r-b": 70, "r-c": 150 }, "r-b": { "r-c": 90 } };
const rtt = (a, b) => (a === b ? 0 : REGION_RTT[a]?.[b] ?? REGION_RTT[b]?.[a]);
const PROMPT_TOKENS = 200;
const MAX_TOKENS = 60;
// vllm-sim's model: 10 ms per decode step plus 0.15 ms per running sequence, 100 us per prompt token.
const SERVICE_S = (PROMPT_TOKENS * 0.1 + MAX_TOKENS * (10 + 0.15 * SEQS)) / 1000;
const POOL_RATE = (SIMS * SEQS) / SERVICE_S;

/** Seeded Poisson arrivals per region (`loads[region]` x a pool's capacity) over `seconds`. */
function schedule(loads, seconds, seed) {
  const rand = rng(seed);
  const out = [];
  for (const region of REGIONS) {
    const rate = loads[region] * POOL_RATE;
    for (let t = 0; ; ) {
      t += -Math.log(1 - rand()) / rate;
      if (t >= seconds) break;
      out.push({ region, at: t * 1000, nonce: Math.floor(rand() * 1e9) });
    }
  }
  return out.sort((a, b) => a.at - b.at);
}

function prompt(nonce) {
  const words = [];
  for (let i = 0; words.join(" ").length < PROMPT_TOKENS * 4; i++) words.push(`w${(nonce + i * 7919) % 100000}`);
  return words.join(" ").slice(0, PROMPT_TOKENS * 4);
}

async function one(gw, model, req) {
  const started = performance.now();
  const rec = { region: req.region, at_ms: Math.round(req.at), status: 0, pool: null, choice: null, predicted_ms: null, anchor_ms: null, ttft: null, e2e: null };
  try {
    const r = await gw.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json", "x-gateway-region": req.region },
      body: JSON.stringify({ model, stream: true, max_tokens: MAX_TOKENS, ignore_eos: true, messages: [{ role: "user", content: prompt(req.nonce) }] }),
    });
    rec.status = r.status;
    rec.pool = r.headers.get("x-gateway-pool");
    rec.choice = r.headers.get("x-gateway-pool-choice");
    rec.predicted_ms = Number(r.headers.get("x-gateway-pool-predicted-ms")) || null;
    rec.anchor_ms = Number(r.headers.get("x-gateway-pool-anchor-ms")) || null;
    const reader = r.body.getReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      if (rec.ttft === null && value?.length) rec.ttft = performance.now() - started;
    }
    rec.e2e = performance.now() - started;
  } catch (e) {
    rec.error = e.name;
  }
  return rec;
}

/** A quiet gateway with the modelled network between the regions, and `bindings`. */
function benchGateway(bindings) {
  const quiet = { handleRuntimeStdio: (out, err) => (out.resume(), err.resume()) };
  return startGateway({
    bindings: {
      FIRST_BYTE_TIMEOUT_MS: "120000",
      ALLOW_REGION_HEADER: "true",
      REGION_RTT_MS: JSON.stringify(REGION_RTT),
      SIMULATE_NETWORK: "true",
      ...bindings,
    },
    options: quiet,
  });
}

/** One gateway, three pools of fresh sims; `phases` are [{ name, loads, seconds }]. */
async function run(label, timeRouting, phases) {
  const gw = await benchGateway({ PROBE_INTERVAL_MS: "1000", TIME_ROUTING: timeRouting ? "true" : "false" });
  const sims = [];
  const model = "bench-regions";
  const poolOf = {};
  try {
    for (const region of REGIONS) {
      const name = `pool-${region}`;
      poolOf[name] = region;
      const r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { region } });
      if (r.status !== 200) throw new Error(await r.text());
      for (let i = 0; i < SIMS; i++) {
        const sim = await startSim(["--model", model, "--max-num-seqs", String(SEQS), "--seed", String(SEED + sims.length)]);
        sims.push(sim);
        const id = `${name}-${i}`;
        const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: name, models: [model], id, max_num_seqs: SEQS } });
        if (reg.status !== 201) throw new Error(await reg.text());
        await waitReady(gw, id);
      }
    }
    // Every pool's card published and in the Worker's copy of the pool list.
    await new Promise((r) => setTimeout(r, 5000));
    const out = {};
    for (const [k, phase] of phases.entries()) {
      const arrivals = schedule(phase.loads, phase.seconds, SEED + 100 * k);
      const t0 = performance.now();
      const pending = [];
      for (const a of arrivals) {
        const wait = a.at - (performance.now() - t0);
        if (wait > 0) await new Promise((res) => setTimeout(res, wait));
        pending.push(one(gw, model, a));
      }
      const recs = await Promise.all(pending);
      for (const name of Object.keys(poolOf)) {
        await waitFor(async () => (await (await gw.admin(`/admin/pools/${name}`)).json()).in_flight === 0, { timeoutMs: 30000, what: "leases back" });
      }
      out[phase.name] = summarise(recs, poolOf);
      // What each pool's card and backends' learned timing said at the end of the phase.
      const pools = (await (await gw.admin("/admin/pools")).json()).data;
      const backends = (await (await gw.admin("/admin/backends")).json()).data;
      out[phase.name].cards = Object.fromEntries(pools.map((p) => [p.pool, p.time_card]));
      out[phase.name].timing = Object.fromEntries(backends.map((b) => [b.id, b.timing]));
      console.error(`${label} ${phase.name}: ${JSON.stringify(out[phase.name])}`);
    }
    return out;
  } finally {
    await Promise.all(sims.map((s) => s.close()));
    await gw.close();
  }
}

function summarise(recs, poolOf) {
  const by = {};
  for (const region of REGIONS) {
    const mine = recs.filter((r) => r.region === region);
    const ok = mine.filter((r) => r.status === 200 && r.ttft !== null && !r.error);
    const away = ok.filter((r) => poolOf[r.pool] !== region);
    by[region] = {
      requests: mine.length,
      failed: mine.length - ok.length,
      ttft_p50_ms: pct(ok.map((r) => r.ttft), 50),
      ttft_p99_ms: pct(ok.map((r) => r.ttft), 99),
      e2e_p50_ms: pct(ok.map((r) => r.e2e), 50),
      e2e_p99_ms: pct(ok.map((r) => r.e2e), 99),
      cross_region: away.length,
      // Each request served away: when in the phase it arrived, why the Worker chose that pool,
      // and what it predicted there.
      away: away.map((r) => ({ at_ms: r.at_ms, pool: r.pool, choice: r.choice, predicted_ms: r.predicted_ms, anchor_ms: r.anchor_ms, ttft_ms: Math.round(r.ttft) })),
      served_by: Object.fromEntries(Object.keys(poolOf).map((p) => [p, ok.filter((r) => r.pool === p).length])),
    };
  }
  return by;
}

/**
 * The burst cell: a gateway whose probe round does not come back during the cell, pool r-a of one
 * backend running 2 sequences (registered with the default 256), pool r-b of two idle backends;
 * 10 streams of 2,000 tokens on r-a at once, then a short request from r-a every 500 ms for 5 s.
 * A short request still waiting after 20 s is given up and counted as such.
 */
async function burstCell(evidence) {
  const gw = await benchGateway({ PROBE_INTERVAL_MS: "600000" });
  const sims = [];
  const model = "bench-burst";
  const poolOf = { "burst-a": "r-a", "burst-b": "r-b" };
  const settings = evidence ? {} : { time_model: { overdue_factor: 0 } };
  const ctl = new AbortController();
  let load = [];
  try {
    for (const [name, region] of Object.entries(poolOf)) {
      const r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { region, ...settings } });
      if (r.status !== 200) throw new Error(await r.text());
      const busy = region === "r-a";
      for (let i = 0; i < (busy ? 1 : 2); i++) {
        const sim = await startSim(["--model", model, "--model", `${model}-load`, ...(busy ? ["--max-num-seqs", "2"] : []), "--seed", String(SEED + sims.length)]);
        sims.push(sim);
        const id = `${name}-${i}`;
        const models = busy ? [model, `${model}-load`] : [model];
        const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: name, models, id } });
        if (reg.status !== 201) throw new Error(await reg.text());
        await waitReady(gw, id);
      }
    }
    // Both cards published and in the Worker's copy of the pool list.
    await new Promise((r) => setTimeout(r, 5000));
    load = Array.from({ length: 10 }, (_, i) =>
      gw.fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "content-type": "application/json", "x-gateway-region": "r-a" },
        body: JSON.stringify({ model: `${model}-load`, stream: true, max_tokens: 2000, ignore_eos: true, messages: [{ role: "user", content: prompt(900 + i) }] }),
        signal: ctl.signal,
      }).then(async (r) => { try { await r.text(); } catch {} }).catch(() => {}),
    );
    await waitFor(async () => (await (await gw.admin("/admin/pools/burst-a")).json()).in_flight >= 10, { timeoutMs: 30000, what: "the burst leased" });
    const t0 = performance.now();
    const shorts = [];
    for (let k = 1; k <= 10; k++) {
      const wait = k * 500 - (performance.now() - t0);
      if (wait > 0) await new Promise((res) => setTimeout(res, wait));
      shorts.push((async () => {
        const started = performance.now();
        const rec = { at_ms: k * 500, pool: null, choice: null, ttft: null, gave_up: false };
        try {
          const r = await gw.fetch("/v1/chat/completions", {
            method: "POST",
            headers: { "content-type": "application/json", "x-gateway-region": "r-a" },
            body: JSON.stringify({ model, stream: true, max_tokens: MAX_TOKENS, ignore_eos: true, messages: [{ role: "user", content: prompt(k) }] }),
            signal: AbortSignal.timeout(20000),
          });
          rec.pool = r.headers.get("x-gateway-pool");
          rec.choice = r.headers.get("x-gateway-pool-choice");
          const reader = r.body.getReader();
          for (;;) {
            const { value, done } = await reader.read();
            if (done) break;
            if (rec.ttft === null && value?.length) rec.ttft = performance.now() - started;
          }
        } catch {
          rec.gave_up = true;
        }
        return rec;
      })());
    }
    const recs = await Promise.all(shorts);
    const m = await (await gw.fetch("/metrics", { headers: { authorization: `Bearer ${ADMIN_TOKEN}` } })).text();
    const scrapes = Number(/llm_gateway_evidence_scrapes_total\{pool="burst-a"\} (\S+)/.exec(m)?.[1] ?? 0);
    const ok = recs.filter((r) => r.ttft !== null && !r.gave_up);
    const out = {
      requests: recs.length,
      served_elsewhere: recs.filter((r) => r.pool === "burst-b").length,
      gave_up_after_20s: recs.filter((r) => r.gave_up).length,
      ttft_p50_ms: pct(ok.map((r) => r.ttft), 50),
      ttft_max_ms: ok.length ? Math.max(...ok.map((r) => r.ttft)) : null,
      evidence_scrapes: scrapes,
      requests_detail: recs.map((r) => ({ at_ms: r.at_ms, pool: r.pool, choice: r.choice, ttft_ms: r.ttft === null ? null : Math.round(r.ttft) })),
    };
    console.error(`burst ${evidence ? "with" : "without"} lease evidence: ${JSON.stringify(out)}`);
    return out;
  } finally {
    ctl.abort();
    await Promise.all(load);
    await Promise.all(sims.map((s) => s.close()));
    await gw.close();
  }
}

if (args["burst-only"]) {
  const burst = { with: await burstCell(true), without: await burstCell(false) };
  console.log(JSON.stringify(burst, null, 2));
  process.exit(0);
}

const skew = { "r-a": LOAD, "r-b": LIGHT, "r-c": LIGHT };
const light = { "r-a": LIGHT, "r-b": LIGHT, "r-c": LIGHT };
console.error(`3 regions x ${SIMS} sims x ${SEQS} seqs; a pool serves ~${POOL_RATE.toFixed(1)} req/s; skew ${JSON.stringify(skew)} for ${SECONDS} s`);
const nearest = await run("nearest-first", false, [{ name: "skew", loads: skew, seconds: SECONDS }]);
const timed = await run("time", true, [
  { name: "skew", loads: skew, seconds: SECONDS },
  { name: "light", loads: light, seconds: Math.max(10, SECONDS / 2) },
]);

const burst = { with: await burstCell(true), without: await burstCell(false) };

const ratio = (a, b) => (a && b ? a / b : null);
const verdict = {
  overloaded_ttft_p99_improvement: ratio(nearest.skew["r-a"].ttft_p99_ms, timed.skew["r-a"].ttft_p99_ms),
  worse_by_more_than_rtt: REGIONS.filter((r) => {
    const worst = Math.max(...REGIONS.filter((x) => x !== r).map((x) => rtt(r, x)));
    return timed.skew[r].ttft_p99_ms > nearest.skew[r].ttft_p99_ms + 2 * worst;
  }),
  light_cross_region: REGIONS.reduce((n, r) => n + timed.light[r].cross_region, 0),
};
const date = new Date().toISOString().slice(0, 10);
const result = { date: new Date().toISOString(), machine: machine(), method: { seconds: SECONDS, load: LOAD, light: LIGHT, sims: SIMS, seqs: SEQS, pool_rate: POOL_RATE, region_rtt_ms: REGION_RTT, prompt_tokens: PROMPT_TOKENS, max_tokens: MAX_TOKENS }, nearest, timed, verdict, burst };
const dir = path.join(ROOT, "bench/results");
mkdirSync(dir, { recursive: true });
writeFileSync(path.join(dir, `regions-${date}.json`), JSON.stringify(result, null, 2));
const f = (x) => (x === null || x === undefined ? "-" : Math.round(x).toLocaleString("en-US"));
const lines = [
  `# Cross-region routing, ${date}`,
  "",
  `3 regions, ${SIMS} vllm-sim x ${SEQS} sequences each (a pool serves about ${POOL_RATE.toFixed(1)} requests/s of ${PROMPT_TOKENS}-token prompts and ${MAX_TOKENS}-token answers); r-a's clients at ${LOAD}x its pool, r-b and r-c at ${LIGHT}x, ${SECONDS} s of seeded Poisson arrivals; modelled round trips ${JSON.stringify(REGION_RTT)} ms, paid twice per request (lease and fetch). Machine: ${result.machine.nproc} cores, ${result.machine.model_name ?? ""}, load at start ${(result.machine.loadavg_at_start ?? []).join(" ")}.`,
  "",
  "| client region | mode | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 | served elsewhere | failed |",
  "|---|---|---|---|---|---|---|---|",
];
for (const r of REGIONS) {
  for (const [mode, res] of [["nearest-first", nearest.skew], ["time", timed.skew]]) {
    const x = res[r];
    lines.push(`| ${r} | ${mode} | ${f(x.ttft_p50_ms)} | ${f(x.ttft_p99_ms)} | ${f(x.e2e_p50_ms)} | ${f(x.e2e_p99_ms)} | ${x.cross_region} of ${x.requests} | ${x.failed} |`);
  }
}
lines.push("", `Overloaded region's TTFT p99, nearest-first over time routing: ${verdict.overloaded_ttft_p99_improvement?.toFixed(2)}x. Regions worse by more than their round trip: ${verdict.worse_by_more_than_rtt.length ? verdict.worse_by_more_than_rtt.join(", ") : "none"}. Light phase (every region at ${LIGHT}x): ${verdict.light_cross_region} requests served in another region.`);
lines.push(
  "",
  "Burst between probe rounds (r-a: one backend running 2 sequences, registered with the default 256; 10 streams of 2,000 tokens at once; a short request from r-a every 500 ms for 5 s, no probe round meanwhile):",
  "",
  "| lease evidence | served in r-b | given up after 20 s | TTFT p50 | TTFT max | evidence scrapes |",
  "|---|---|---|---|---|---|",
);
for (const [mode, x] of [["on", burst.with], ["off", burst.without]]) {
  lines.push(`| ${mode} | ${x.served_elsewhere} of ${x.requests} | ${x.gave_up_after_20s} | ${f(x.ttft_p50_ms)} | ${f(x.ttft_max_ms)} | ${x.evidence_scrapes} |`);
}
writeFileSync(path.join(dir, `regions-${date}.md`), lines.join("\n") + "\n");
console.log(lines.join("\n"));
