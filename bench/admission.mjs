// The admission-control benchmark: an overloaded fleet, with and without the gateway's queue.
//
// A batch tenant (long prompts, long answers) and an interactive tenant (short ones) send seeded
// Poisson arrivals at about 1.5x what the fleet can serve, through the built Worker (Miniflare,
// workerd) to real vllm-sim processes running in real time. Run once with admission control off
// (the backends' own first-come-first-served queues absorb the overload) and once on (each backend
// runs at most its max_num_seqs; the rest waits in the gateway's queue, interactive first, batch
// requests over max_wait_ms refused with 503 queue_timeout). Reports the interactive tenant's p50/p99
// time to first token, goodput (output tokens per second of requests that met their tenant's
// objective), batch throughput, and drops. Writes bench/results/admission-<date>.json.
//
//   node bench/admission.mjs [--seconds 40] [--load 1.5] [--sims 2] [--seqs 4] [--out file]
import { startGateway, startSim, waitReady, waitFor } from "../tests/lib/harness.mjs";
import { writeFileSync, mkdirSync } from "node:fs";
import path from "node:path";
import { ROOT } from "../tests/lib/harness.mjs";
import { rng } from "./overhead-lib.mjs";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const SECONDS = Number(args.seconds ?? 40);
const LOAD = Number(args.load ?? 1.5);
const SIMS = Number(args.sims ?? 2);
const SEQS = Number(args.seqs ?? 4);
const DRAIN_S = Number(args.drain ?? 30);
const SEED = Number(args.seed ?? 7);

// The two tenants. Durations follow vllm-sim's model: 10 ms per decode step (+0.15 ms per running
// sequence), 100 us per prompt token; prompts are ~4 characters per token.
const TENANTS = {
  interactive: { promptTokens: 100, maxTokens: 20, share: 0.1, priority: 10, ttftSloMs: 1000 },
  batch: { promptTokens: 400, maxTokens: 150, share: 0.9, priority: 0, ttftSloMs: Infinity },
};
const STEP_MS = 10 + 0.15 * SEQS;
const serviceS = (t) => (t.promptTokens * 0.1 + t.maxTokens * STEP_MS) / 1000;
const SLOTS = SIMS * SEQS;
// Arrival rates: `share` of the sequence-seconds each, together LOAD x the fleet's slots.
const RATES = Object.fromEntries(Object.entries(TENANTS).map(([k, t]) => [k, (LOAD * SLOTS * t.share) / serviceS(t)]));
const ADMISSION = { enabled: true, max_wait_ms: 15000, max_queue: 2000, max_queue_per_tenant: 0, poll_ms: 5000 };

/** Seeded Poisson arrivals of both tenants over SECONDS, in time order. */
function schedule(seed) {
  const rand = rng(seed);
  const out = [];
  for (const [tenant, rate] of Object.entries(RATES)) {
    for (let t = 0; ; ) {
      t += -Math.log(1 - rand()) / rate;
      if (t >= SECONDS) break;
      out.push({ tenant, at: t * 1000, nonce: Math.floor(rand() * 1e9) });
    }
  }
  return out.sort((a, b) => a.at - b.at);
}

function prompt(tokens, nonce) {
  const words = [];
  for (let i = 0; words.join(" ").length < tokens * 4; i++) words.push(`w${(nonce + i * 7919) % 100000}`);
  return words.join(" ").slice(0, tokens * 4);
}

async function one(gw, model, req, abort) {
  const t = TENANTS[req.tenant];
  const started = performance.now();
  const rec = { tenant: req.tenant, at: req.at, status: 0, ttft: null, e2e: null, tokens: 0, drop: null };
  try {
    const r = await gw.fetch("/v1/chat/completions", {
      method: "POST",
      signal: abort,
      headers: { "content-type": "application/json", "x-tenant-id": req.tenant, "x-gateway-priority": String(t.priority) },
      body: JSON.stringify({
        model, stream: true, max_tokens: t.maxTokens, ignore_eos: true,
        messages: [{ role: "user", content: prompt(t.promptTokens, req.nonce) }],
      }),
    });
    rec.status = r.status;
    rec.drop = r.headers.get("x-gateway-queue-drop");
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, i);
        buf = buf.slice(i + 2);
        if (!ev.startsWith("data: ") || ev === "data: [DONE]") continue;
        try {
          const c = JSON.parse(ev.slice(6)).choices?.[0]?.delta?.content;
          if (c) {
            rec.tokens += 1;
            if (rec.ttft === null) rec.ttft = performance.now() - started;
          }
        } catch { /* an error event */ }
      }
    }
    rec.e2e = performance.now() - started;
  } catch (e) {
    rec.status = rec.status || -1;
    rec.error = e.name;
  }
  rec.end = req.at + (performance.now() - started);
  return rec;
}

function pct(xs, p) {
  if (!xs.length) return null;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.ceil((p / 100) * s.length) - 1)];
}

async function run(gw, label, admission, seed) {
  const name = `bench-${label}`;
  const model = `bench-model-${label}`;
  let r = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy: "least_load", admission } });
  if (r.status !== 200) throw new Error(await r.text());
  const sims = [];
  for (let i = 0; i < SIMS; i++) {
    const sim = await startSim(["--model", model, "--max-num-seqs", String(SEQS), "--seed", String(seed + i)]);
    sims.push(sim);
    const id = `${name}-${i}`;
    r = await gw.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: name, models: [model], id, max_num_seqs: SEQS } });
    if (r.status !== 201) throw new Error(await r.text());
    await waitReady(gw, id);
  }
  const arrivals = schedule(seed);
  const cutoff = new AbortController();
  const t0 = performance.now();
  const pending = [];
  for (const a of arrivals) {
    const wait = a.at - (performance.now() - t0);
    if (wait > 0) await new Promise((res) => setTimeout(res, wait));
    pending.push(one(gw, model, a, cutoff.signal));
  }
  const timer = setTimeout(() => cutoff.abort(), DRAIN_S * 1000);
  const recs = await Promise.all(pending);
  clearTimeout(timer);
  await Promise.all(sims.map((s) => s.close()));
  await waitFor(async () => (await (await gw.admin(`/admin/pools/${name}`)).json()).in_flight === 0, { timeoutMs: 30000, what: "leases back" }).catch(() => {});
  const windowS = SECONDS + DRAIN_S;
  const by = (t) => recs.filter((x) => x.tenant === t);
  const ok = (x) => x.status === 200 && x.tokens > 0 && !x.error;
  const good = (x) => ok(x) && x.ttft <= TENANTS[x.tenant].ttftSloMs;
  const inter = by("interactive");
  const batch = by("batch");
  const tokens = (xs) => xs.reduce((s, x) => s + x.tokens, 0);
  const drops = {};
  for (const x of recs) {
    const k = x.error ? `client_cutoff` : x.status === 200 ? null : (x.drop ?? `http_${x.status}`);
    if (k) drops[k] = (drops[k] ?? 0) + 1;
  }
  return {
    label,
    admission: admission.enabled,
    requests: { interactive: inter.length, batch: batch.length },
    interactive: {
      ttft_p50_ms: pct(inter.filter(ok).map((x) => x.ttft), 50),
      ttft_p99_ms: pct(inter.filter(ok).map((x) => x.ttft), 99),
      completed: inter.filter(ok).length,
      met_slo: inter.filter(good).length,
    },
    batch: {
      completed: batch.filter(ok).length,
      throughput_tokens_per_s: tokens(batch.filter(ok)) / windowS,
      e2e_p50_ms: pct(batch.filter(ok).map((x) => x.e2e), 50),
    },
    goodput_tokens_per_s: tokens(recs.filter(good)) / windowS,
    throughput_tokens_per_s: tokens(recs.filter(ok)) / windowS,
    drops,
  };
}

// The Worker's per-request log lines are dropped: the report goes to stdout.
const quiet = { handleRuntimeStdio: (out, err) => (out.resume(), err.resume()) };
const gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "1000", FIRST_BYTE_TIMEOUT_MS: "120000" }, options: quiet });
const results = [];
try {
  console.error(`fleet ${SIMS} x ${SEQS} slots; arrivals/s ${JSON.stringify(RATES)} (${LOAD}x capacity) for ${SECONDS} s`);
  results.push(await run(gw, "off", { ...ADMISSION, enabled: false }, SEED));
  console.error(JSON.stringify(results.at(-1)));
  results.push(await run(gw, "on", ADMISSION, SEED));
  console.error(JSON.stringify(results.at(-1)));
} finally {
  await gw.close();
}
const [off, on] = results;
const summary = {
  date: new Date().toISOString(),
  method: { seconds: SECONDS, load: LOAD, sims: SIMS, max_num_seqs: SEQS, drain_s: DRAIN_S, seed: SEED, tenants: TENANTS, rates_per_s: RATES, admission: ADMISSION },
  results,
  targets: {
    interactive_p99_ratio: on.interactive.ttft_p99_ms / off.interactive.ttft_p99_ms,
    p99_met: on.interactive.ttft_p99_ms <= off.interactive.ttft_p99_ms / 3,
    goodput_ratio: on.goodput_tokens_per_s / off.goodput_tokens_per_s,
    goodput_met: on.goodput_tokens_per_s >= off.goodput_tokens_per_s,
  },
};
const out = args.out ?? path.join(ROOT, "bench/results", `admission-${summary.date.slice(0, 10)}.json`);
mkdirSync(path.dirname(out), { recursive: true });
writeFileSync(out, JSON.stringify(summary, null, 2) + "\n");
const row = (r) =>
  `| ${r.admission ? "on" : "off"} | ${r.interactive.ttft_p50_ms?.toFixed(0)} | ${r.interactive.ttft_p99_ms?.toFixed(0)} | ${r.interactive.met_slo}/${r.requests.interactive} | ${r.goodput_tokens_per_s.toFixed(0)} | ${r.throughput_tokens_per_s.toFixed(0)} | ${r.batch.throughput_tokens_per_s.toFixed(0)} | ${r.batch.completed}/${r.requests.batch} | ${JSON.stringify(r.drops)} |`;
console.log("| admission | interactive TTFT p50 ms | p99 ms | interactive within 1 s | goodput tok/s | throughput tok/s | batch tok/s | batch done | drops |");
console.log("|---|---|---|---|---|---|---|---|---|");
console.log(row(off));
console.log(row(on));
console.log(`interactive p99 with/without: ${summary.targets.interactive_p99_ratio.toFixed(3)} (target <= 0.333: ${summary.targets.p99_met ? "met" : "missed"}); goodput with/without: ${summary.targets.goodput_ratio.toFixed(3)} (target >= 1: ${summary.targets.goodput_met ? "met" : "missed"})`);
console.log(`written ${path.relative(ROOT, out)}`);
