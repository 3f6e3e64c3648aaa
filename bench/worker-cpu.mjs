// Part (b) of the overhead benchmark: the CPU the gateway spends per request (routing and proxy)
// and per streamed token, read from the workerd process that runs the built Worker.
//
// Method: the workerd process's CPU time (/proc/<pid>/stat utime + stime) over N streamed chat
// requests, minus its idle rate (measured for a few seconds with nothing sent) times the phase's
// wall time, divided by N. Two phases differ only in max_tokens (1 and 256, ignore_eos): the slope
// is the CPU per streamed token, and the intercept the CPU per request. A third phase with a
// 2,048-token prompt shows how the per-request figure grows with the prompt (parsing, canonical
// rendering, block hashing). The sim runs at --time-scale 10 (a decode step of about 1 ms), so its
// tokens arrive as separate chunks as they would from a GPU (the client-side chunk count is
// reported). workerd also runs the pool's Durable Object, so every figure includes the request's
// two Durable Object calls (acquire, release); `do_pair_ms` is that pair measured alone through
// the object's stub from inside workerd (bench/do-driver.mjs), for subtraction.
//
//   node bench/overhead.mjs --only worker-cpu [--cpu-requests 600]
import { chatBody, closedLoop, cpuMeter, floorWorker, gatewayWithSim, idleCpuRate, pct, streamClient, workerdPid } from "./overhead-lib.mjs";
import { DRIVER, workerdPhase } from "./coordinator.mjs";

const POOL = "bench-cpu";
const CONCURRENCY = 8;
/** Requests sent before anything is measured. */
const WARM_UP = 300;
/** The floor's modes (bench/floor-worker.mjs), each measured like the gateway. */
const FLOOR_MODES = ["pass", "identity", "loop"];

/** Part (b). `requests`: requests in each of the 1-token phases (the 256-token phase runs a third). */
export async function measureWorkerCpu({ requests = 600, log = console.error } = {}) {
  const env = await gatewayWithSim({ pool: POOL, simArgs: ["--time-scale", "10"], extraWorkers: [DRIVER] });
  const client = streamClient(CONCURRENCY);
  try {
    const target = `${env.url}/v1/chat/completions`;
    const pid = workerdPid();
    // Warm-up: the isolate, the pool list cache, connections, and V8's optimised code for the hot
    // paths (with 50 requests the first phase still paid for some of it).
    await closedLoop({ concurrency: CONCURRENCY, seconds: 30, maxCalls: WARM_UP, one: (i) => client.post(target, chatBody(env.model, 128, 4, 1e6 + i)) });
    // One request read whole, to check the stream's shape.
    const sample = await client.post(target, chatBody(env.model, 128, 256, 7), { keepText: true });
    const sampleTokens = (sample.text.match(/"content":"[^"]/g) ?? []).length;
    if (sample.status !== 200 || sampleTokens !== 256) throw new Error(`sample stream: status ${sample.status}, ${sampleTokens} tokens`);
    const idle = await idleCpuRate(pid, 3);
    log(`worker-cpu: workerd idle ${(idle * 100).toFixed(2)}% of a core`);

    const phases = [
      ["128-token prompt, 1 output token", 128, 1, requests],
      ["128-token prompt, 256 output tokens", 128, 256, Math.ceil(requests / 3)],
      ["2,048-token prompt, 1 output token", 2048, 1, requests],
    ];
    const points = await measurePhases({ client, target, pid, idle, model: env.model, phases, log });
    const [one, many, long] = points;
    const perToken = slope(one, many);

    // The same request's Durable Object pair alone (8 block hashes = 128 tokens), through the stub
    // from inside workerd (bench/do-driver.mjs), as the Worker calls it.
    const driver = await env.gw.mf.getWorker(DRIVER.name);
    const pairSeconds = Math.min(10, Math.max(3, requests / 200));
    const pair = await workerdPhase(driver, pid, "DO pair", { pool: POOL, model: env.model, mode: "measure", blocks: 8, shared: 0, seconds: pairSeconds }, CONCURRENCY);
    const doPair = pair.workerd_cpu_ms_per_pair - (idle * pair.wall_s * 1000) / Math.max(1, pair.pairs);
    const floors = [];
    for (const mode of FLOOR_MODES) floors.push(await measureFloor({ mode, sim: env.sim, model: env.model, requests, client, log }));
    const result = {
      method:
        "workerd CPU (/proc/<pid>/stat utime+stime, 10 ms ticks) over N closed-loop streamed requests (8 in flight) from a Node http client " +
        "straight to workerd's port, minus the idle rate times the wall time, over N. Per token: slope between max_tokens 1 and 256 " +
        "(ignore_eos, same 128-token prompt); per request: the 1-token figure minus one token. Includes the request's Durable Object calls.",
      concurrency: CONCURRENCY,
      sim_time_scale: 10,
      workerd_idle_cpu_share: idle,
      points,
      cpu_ms_per_request: one.workerd_cpu_ms_per_request - perToken,
      cpu_us_per_token: perToken * 1000,
      cpu_ms_per_request_2k_prompt: long.workerd_cpu_ms_per_request - perToken,
      do_pair_ms: doPair,
      do_pairs: `${pair.ok_pairs}/${pair.pairs}`,
      // The driver's pair also counts the driver's own JavaScript and both ends of each stub call:
      // an upper bound on the object's share, so this is a lower bound on the Worker's own.
      worker_own_ms_per_request_at_least: one.workerd_cpu_ms_per_request - perToken - doPair,
      floors,
      all_ok: [...points, ...floors.flatMap((f) => f.points)].every((p) => p.ok === p.requests) && pair.ok_pairs === pair.pairs,
    };
    log(`worker-cpu: ${result.cpu_ms_per_request.toFixed(3)} ms/request, ${result.cpu_us_per_token.toFixed(1)} us/token; DO pair ${doPair.toFixed(3)} ms`);
    return result;
  } finally {
    client.close();
    await env.close();
  }
}

/** CPU ms per streamed token: the slope between a 1-token and a many-token phase. */
function slope(one, many) {
  return (many.workerd_cpu_ms_per_request - one.workerd_cpu_ms_per_request) / (many.max_tokens - one.max_tokens);
}

/**
 * Runs closed-loop phases ([name, prompt tokens, max tokens, requests]) against `target` and
 * returns each one's workerd CPU per request, net of workerd's `idle` rate.
 */
async function measurePhases({ client, target, pid, idle, model, phases, log, label = "" }) {
  const points = [];
  for (const [name, promptTokens, maxTokens, n] of phases) {
    const meter = cpuMeter(pid);
    const run = await closedLoop({
      concurrency: CONCURRENCY, seconds: 100, maxCalls: n,
      one: (i) => client.post(target, chatBody(model, promptTokens, maxTokens, promptTokens * 1e6 + maxTokens * 1e4 + i)),
    });
    const cpu = meter.stop();
    const ok = run.results.filter((r) => r.status === 200 && !r.error);
    const net = cpu.workerd_cpu_s - idle * cpu.wall_s;
    const p = {
      name, prompt_tokens: promptTokens, max_tokens: maxTokens,
      requests: run.results.length, ok: ok.length, wall_s: cpu.wall_s,
      client_chunks_per_request: ok.reduce((s, r) => s + r.chunks, 0) / Math.max(1, ok.length),
      workerd_cpu_s: cpu.workerd_cpu_s,
      workerd_cpu_ms_per_request: (net * 1000) / Math.max(1, run.results.length),
      e2e_ms_p50: pct(ok.map((r) => r.e2e_ms), 50),
    };
    log(`worker-cpu: ${label}${name}: ${p.workerd_cpu_ms_per_request.toFixed(3)} ms CPU/request over ${p.requests} (${p.client_chunks_per_request.toFixed(0)} chunks each)`);
    points.push(p);
  }
  return points;
}

/**
 * The floor in one mode (bench/floor-worker.mjs, its own workerd) against the same sim: CPU per
 * request and per token measured as the gateway's are, over the two 128-token-prompt phases.
 */
async function measureFloor({ mode, sim, model, requests, client, log }) {
  const floor = await floorWorker({ upstream: sim.url, mode });
  try {
    const target = `${floor.url}/v1/chat/completions`;
    await closedLoop({ concurrency: CONCURRENCY, seconds: 30, maxCalls: WARM_UP, one: (i) => client.post(target, chatBody(model, 128, 4, 2e6 + i)) });
    const idle = await idleCpuRate(floor.pid, 2);
    const phases = [
      ["128-token prompt, 1 output token", 128, 1, requests],
      ["128-token prompt, 256 output tokens", 128, 256, Math.ceil(requests / 3)],
    ];
    const points = await measurePhases({ client, target, pid: floor.pid, idle, model, phases, log, label: `floor ${mode}: ` });
    const perToken = slope(points[0], points[1]);
    return {
      mode,
      workerd_idle_cpu_share: idle,
      points,
      cpu_ms_per_request: points[0].workerd_cpu_ms_per_request - perToken,
      cpu_us_per_token: perToken * 1000,
    };
  } finally {
    await floor.close();
  }
}
