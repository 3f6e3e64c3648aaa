// The overhead benchmark (issue 15, "measure first"): what one request costs the gateway itself.
//
//   (a) coordinator: one pool Durable Object's capacity in acquire+release pairs per second
//       (bench/coordinator.mjs), target >= 2,000 pairs/s;
//   (b) worker-cpu: the workerd CPU per request and per streamed token (bench/worker-cpu.mjs),
//       beside the floor: a minimal JavaScript Worker that only forwards (bench/floor-worker.mjs);
//   (c) latency: closed-loop request rate and added time to first byte against calling vllm-sim
//       directly at 1, 16 and 64 concurrent requests, and the floor's (bench/latency.mjs), targets: added TTFB
//       <= 2 ms p50 and <= 5 ms p99 at 1 and 16; gateway rate >= 0.85x direct at 16 and 64.
//
// Everything runs the built Worker (build/index.js) in workerd through Miniflare and real local
// processes on 127.0.0.1; each part stays under about two minutes. Writes
// bench/results/overhead-<date>.json and .md and prints the markdown.
//
//   node bench/overhead.mjs [--only coordinator,worker-cpu,latency] [--seconds 15] [--do-concurrency 16]
//                           [--cpu-requests 600] [--latency-seconds 8] [--latency-concurrency 1,16,64]
//                           [--out bench/results/overhead-x]
import { writeFileSync, mkdirSync } from "node:fs";
import path from "node:path";
import { ROOT } from "../tests/lib/harness.mjs";
import { machine, rounded } from "./overhead-lib.mjs";
import { measureCoordinator } from "./coordinator.mjs";
import { measureWorkerCpu } from "./worker-cpu.mjs";
import { measureLatency } from "./latency.mjs";

/** How the floor's modes (bench/floor-worker.mjs) are named in the report. */
const FLOOR_NAMES = { pass: "body passed as is", identity: "through an identity TransformStream", loop: "read chunk by chunk into an IdentityTransformStream" };

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const only = new Set((args.only ?? "coordinator,worker-cpu,latency").split(","));
for (const part of only) {
  if (!["coordinator", "worker-cpu", "latency"].includes(part)) throw new Error(`unknown part ${part}`);
}

const started = new Date();
const result = { date: started.toISOString(), machine: machine(), parts: {} };
const t0 = performance.now();
const timed = async (name, fn) => {
  const s = performance.now();
  result.parts[name] = await fn();
  result.parts[name].duration_s = (performance.now() - s) / 1000;
};
if (only.has("coordinator")) {
  await timed("coordinator", () => measureCoordinator({ seconds: Number(args.seconds ?? 15), concurrency: Number(args["do-concurrency"] ?? 16) }));
}
if (only.has("worker-cpu")) await timed("worker-cpu", () => measureWorkerCpu({ requests: Number(args["cpu-requests"] ?? 600) }));
if (only.has("latency")) await timed("latency", () => measureLatency({
  seconds: Number(args["latency-seconds"] ?? 8),
  concurrencies: (args["latency-concurrency"] ?? "1,16,64").split(",").map(Number),
}));
result.duration_s = (performance.now() - t0) / 1000;
result.targets = targets(result.parts);

const base = args.out ?? path.join(ROOT, "bench/results", `overhead-${result.date.slice(0, 10)}`);
mkdirSync(path.dirname(base), { recursive: true });
writeFileSync(`${base}.json`, JSON.stringify(rounded(result), null, 2) + "\n");
const md = markdown(result);
writeFileSync(`${base}.md`, md);
console.log(md);
console.log(`written ${path.relative(ROOT, base)}.json and .md`);

/** The issue's targets, each with the measured figure and whether it is met. */
function targets(parts) {
  const out = [];
  const co = parts.coordinator;
  for (const p of co?.phases.filter((x) => x.driver === "workerd" && !x.name.startsWith("warm")) ?? []) {
    out.push({ target: `Durable Object pairs/s, ${p.name} (>= 2,000)`, value: p.pairs_per_s, met: p.pairs_per_s >= 2000 });
  }
  for (const p of parts.latency?.points ?? []) {
    if (p.concurrency === 1 || p.concurrency === 16) {
      out.push({ target: `added TTFB p50 at ${p.concurrency} (<= 2 ms)`, value: p.added_ttfb_ms.p50, met: p.added_ttfb_ms.p50 <= 2 });
      out.push({ target: `added TTFB p99 at ${p.concurrency} (<= 5 ms)`, value: p.added_ttfb_ms.p99, met: p.added_ttfb_ms.p99 <= 5 });
      for (const [name, v] of [["direct socket", p.direct_socket], ["ROUTE_AHEAD", p.route_ahead]]) {
        if (!v) continue;
        const a = v.added_ttfb_ms;
        out.push({ target: `added TTFB p50 at ${p.concurrency}, ${name} (<= 2 ms)`, value: a.p50, met: a.p50 <= 2 });
        out.push({ target: `added TTFB p99 at ${p.concurrency}, ${name} (<= 5 ms)`, value: a.p99, met: a.p99 <= 5 });
      }
    }
    if (p.concurrency === 16 || p.concurrency === 64) {
      out.push({ target: `gateway/direct rate at ${p.concurrency} (>= 0.85)`, value: p.rate_ratio, met: p.rate_ratio >= 0.85 });
    }
  }
  return out;
}

function markdown(r) {
  const f = (x, d = 2) => (x === null || x === undefined ? "-" : Number(x).toFixed(d));
  const m = r.machine;
  const lines = [
    `# Overhead benchmark, ${r.date}`,
    "",
    `Machine: ${m.nproc} cores (\`nproc\`), \`lscpu\` model name ${m.model_name}${m.hypervisor ? ` (${m.hypervisor} guest)` : ""}, ${m.memory_gib} GiB; ` +
      `load average at start ${m.loadavg_at_start.join(", ")}; Node ${m.node}. Everything (workerd, Node, vllm-sim) shares these cores. Total ${f(r.duration_s, 0)} s.`,
    "",
    "## Targets",
    "",
    "| target | measured | met |",
    "|---|---|---|",
    ...r.targets.map((t) => `| ${t.target} | ${f(t.value)} | ${t.met ? "yes" : "**no**"} |`),
  ];
  const co = r.parts.coordinator;
  if (co) {
    lines.push(
      "", "## (a) One pool Durable Object: acquire+release pairs per second", "", co.method, "",
      `${co.backends} backends (KV hint ${co.kv_blocks_per_backend} blocks each), policy \`${co.policy}\`, ${co.concurrency} calls in flight; affinity entries after the warm-up ${co.affinity_entries_after_warmup}, at the end ${co.affinity_entries_at_end}; leases in flight at the end ${co.in_flight_at_end}; workerd idle ${f(co.workerd_idle_cpu_share * 100, 1)}% of a core.`,
      "",
      "| phase | driver | acquire body | pairs ok / sent | pairs/s | acquire p50 / p99 ms | release p50 / p99 ms | mean cached blocks | affinity entries after (probe rounds) | workerd CPU ms/pair | Node CPU ms/pair | workerd busy |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
      ...[...co.floors, ...co.phases].map((p) =>
        `| ${p.name} | ${p.driver} | ${p.acquire_body_bytes ? `${(p.acquire_body_bytes / 1024).toFixed(1)} KiB` : "-"} | ${p.ok_pairs}/${p.pairs} | ${f(p.pairs_per_s, 0)} | ${f(p.acquire_ms.p50)} / ${f(p.acquire_ms.p99)} | ${f(p.release_ms.p50)} / ${f(p.release_ms.p99)} | ${f(p.mean_cached_blocks, 0)} | ${p.affinity_entries_after ?? "-"}${p.probe_rounds_after === undefined ? "" : ` (${p.probe_rounds_after})`} | ${f(p.workerd_cpu_ms_per_pair, 3)} | ${f(p.node_cpu_ms_per_pair, 3)} | ${f(p.workerd_cpu_share * 100, 0)}% |`),
      "",
      "Floor rows are single GET /config calls (calls/s in the pairs/s column, the call's latency in the acquire column).",
      "",
      "workerd CPU per pair beyond two floor calls of the same driver (the object's own acquire and release work): " +
        co.phases.filter((p) => p.driver === "workerd").map((p) => `${p.name} ${f(p.cpu_ms_beyond_two_floor_calls, 3)} ms`).join("; ") + ".",
    );
  }
  const wc = r.parts["worker-cpu"];
  if (wc) {
    lines.push(
      "", "## (b) The gateway's CPU per request and per streamed token", "", wc.method, "",
      "| phase | requests ok | client chunks/request | workerd CPU ms/request (net of idle) |",
      "|---|---|---|---|",
      ...wc.points.map((p) => `| ${p.name} | ${p.ok}/${p.requests} | ${f(p.client_chunks_per_request, 0)} | ${f(p.workerd_cpu_ms_per_request, 3)} |`),
      ...(wc.floors ?? []).flatMap((fl) =>
        fl.points.map((p) => `| floor (${fl.mode}): ${p.name} | ${p.ok}/${p.requests} | ${f(p.client_chunks_per_request, 0)} | ${f(p.workerd_cpu_ms_per_request, 3)} |`)),
      "",
      `Per request (128-token prompt, Worker + its two Durable Object calls): **${f(wc.cpu_ms_per_request, 3)} ms**; with a 2,048-token prompt ${f(wc.cpu_ms_per_request_2k_prompt, 3)} ms. ` +
        `Per streamed token: **${f(wc.cpu_us_per_token, 1)} us**. The request's Durable Object pair alone (8 block hashes, driven from inside workerd): ${f(wc.do_pair_ms, 3)} ms, ` +
        `so the Worker's own share is at least ${f(wc.worker_own_ms_per_request_at_least, 3)} ms per request. ` +
        `workerd idle: ${f(wc.workerd_idle_cpu_share * 100)}% of a core.`,
    );
    if (wc.floors?.length) {
      lines.push(
        "",
        "The floor, a minimal JavaScript Worker in its own workerd with the same setup (bench/floor-worker.mjs), measured the same way: " +
          wc.floors.map((fl) => `${FLOOR_NAMES[fl.mode] ?? fl.mode} **${f(fl.cpu_ms_per_request, 3)} ms** per request and **${f(fl.cpu_us_per_token, 1)} us** per token`).join("; ") + ". " +
          wc.floors.map((fl) => `Beyond the ${fl.mode} floor, the gateway (its Durable Object pair included) costs ${f(wc.cpu_ms_per_request - fl.cpu_ms_per_request, 3)} ms per request and ${f(wc.cpu_us_per_token - fl.cpu_us_per_token, 1)} us per token.`).join(" "),
      );
    }
  }
  const la = r.parts.latency;
  if (la) {
    lines.push(
      "", "## (c) Closed-loop rate and added time to first byte, gateway vs direct", "", la.method, "",
      "| concurrency | direct req/s | gateway req/s | ratio | direct TTFB p50 / p99 ms | gateway TTFB p50 / p99 ms | added p50 / p99 ms | workerd busy | client CPU ms/req (d/g) | errors (d/g) |",
      "|---|---|---|---|---|---|---|---|---|---|",
      ...la.points.map((p) =>
        `| ${p.concurrency} | ${f(p.direct.requests_per_s, 0)} | ${f(p.gateway.requests_per_s, 0)} | ${f(p.rate_ratio)} | ${f(p.direct.ttfb_ms.p50)} / ${f(p.direct.ttfb_ms.p99)} | ${f(p.gateway.ttfb_ms.p50)} / ${f(p.gateway.ttfb_ms.p99)} | ${f(p.added_ttfb_ms.p50)} / ${f(p.added_ttfb_ms.p99)} | ${f(p.gateway.workerd_cpu_share * 100, 0)}% | ${f(p.direct.client_cpu_ms_per_request)} / ${f(p.gateway.client_cpu_ms_per_request)} | ${p.direct.errors}/${p.gateway.errors} |`),
      ...(la.points.some((p) => p.route_ahead)
        ? [
          "",
          "The same gateway with `ROUTE_AHEAD` (the backend fetch sent beside the lease call; its own workerd, the same sim), in the same run:",
          "",
          "| concurrency | req/s | ratio to direct | TTFB p50 / p99 ms | added p50 / p99 ms | against the gateway without it, p50 / p99 ms | workerd busy | errors |",
          "|---|---|---|---|---|---|---|---|",
          ...la.points.filter((p) => p.route_ahead).map((p) => {
            const a = p.route_ahead;
            return `| ${p.concurrency} | ${f(a.requests_per_s, 0)} | ${f(a.rate_ratio)} | ${f(a.ttfb_ms.p50)} / ${f(a.ttfb_ms.p99)} | ${f(a.added_ttfb_ms.p50)} / ${f(a.added_ttfb_ms.p99)} | ${f(a.ttfb_ms.p50 - p.gateway.ttfb_ms.p50)} / ${f(a.ttfb_ms.p99 - p.gateway.ttfb_ms.p99)} | ${f(a.workerd_cpu_share * 100, 0)}% | ${a.errors} |`;
          }),
        ]
        : []),
      ...(la.points.some((p) => p.direct_socket)
        ? [
          "",
          "The same gateway (the same workerd and Durable Objects) through a socket workerd serves straight to it, without Miniflare's entry worker " +
            "(the JavaScript proxy `wrangler dev` and Miniflare put in front of a Worker; none runs on the platform), in the same run:",
          "",
          "| concurrency | req/s | ratio to direct | TTFB p50 / p99 ms | added p50 / p99 ms | against the entry worker's door, p50 / p99 ms | errors |",
          "|---|---|---|---|---|---|---|",
          ...la.points.filter((p) => p.direct_socket).map((p) => {
            const b = p.direct_socket;
            return `| ${p.concurrency} | ${f(b.requests_per_s, 0)} | ${f(b.rate_ratio)} | ${f(b.ttfb_ms.p50)} / ${f(b.ttfb_ms.p99)} | ${f(b.added_ttfb_ms.p50)} / ${f(b.added_ttfb_ms.p99)} | ${f(b.ttfb_ms.p50 - p.gateway.ttfb_ms.p50)} / ${f(b.ttfb_ms.p99 - p.gateway.ttfb_ms.p99)} | ${b.errors} |`;
          }),
        ]
        : []),
      ...(la.points.some((p) => p.floors?.length)
        ? [
          "",
          "The floors, the same phases against a minimal JavaScript Worker (bench/floor-worker.mjs), in its own workerd:",
          "",
          "| concurrency | floor | req/s | ratio to direct | TTFB p50 / p99 ms | added p50 / p99 ms | workerd busy | errors |",
          "|---|---|---|---|---|---|---|---|",
          ...la.points.flatMap((p) => (p.floors ?? []).map((fl) =>
            `| ${p.concurrency} | ${fl.mode} | ${f(fl.requests_per_s, 0)} | ${f(fl.rate_ratio)} | ${f(fl.ttfb_ms.p50)} / ${f(fl.ttfb_ms.p99)} | ${f(fl.added_ttfb_ms.p50)} / ${f(fl.added_ttfb_ms.p99)} | ${f(fl.workerd_cpu_share * 100, 0)}% | ${fl.errors} |`)),
        ]
        : []),
    );
    const withParts = la.points.filter((p) => p.gateway.breakdown);
    if (withParts.length) {
      const names = [
        ["pre", "Worker before the lease call (key, body, features, pool list, plan)"],
        ["acquire", "lease call to the pool's Durable Object"],
        ["upstream", "backend fetch to its first chunk (from the Worker)"],
        ["after_grant", "rest of the Worker to the response's headers"],
        ["outside", "HTTP into workerd and back, runtime glue (client headers - Worker)"],
        ["relay", "headers to the first body byte (the relay's first write)"],
        ["ttfb", "gateway TTFB at the client"],
      ];
      lines.push(
        "",
        "Where the gateway's time to first byte went, per request (ms; `pre`, `acquire`, `upstream` and the Worker's total from its `Server-Timing`, whole ms; " +
          "the rest from the client's timestamps; the last columns are the mean of each part over the slowest 1% of requests):",
        "",
        `| part | ${withParts.map((p) => `c=${p.concurrency} p50 / p99 / mean | c=${p.concurrency} slowest 1%`).join(" | ")} |`,
        `|---|${withParts.map(() => "---|---|").join("")}`,
        ...names.map(([k, label]) =>
          `| ${label} | ${withParts.map((p) => { const b = p.gateway.breakdown; return `${f(b.parts[k].p50)} / ${f(b.parts[k].p99)} / ${f(b.parts[k].mean)} | ${f(b.slowest_1pct_mean[k])}`; }).join(" | ")} |`),
      );
    }
  }
  return lines.join("\n") + "\n";
}
