// A load driver that runs inside workerd, beside the gateway (bench/coordinator.mjs starts it as a
// second Miniflare worker bound to the gateway's PoolCoordinator class): it calls one pool Durable
// Object through its stub, as the Worker does (by RPC, `gatewayCall`; `transport: "fetch"` calls
// through the stub's fetch instead), without Miniflare's Node-to-workerd proxy in the way.
//
// POST /run {pool, mode, seconds, max_pairs, first_index, stride, blocks, shared, warm_prompts,
// warm_blocks, model} runs ONE sequential loop (the caller sends several /run calls at once for
// concurrency) and answers its records:
//   mode "warm":    acquire+release of warm prompt first_index, first_index + stride, ... (each a
//                   distinct chain of warm_blocks hashes) below warm_prompts;
//   mode "measure": acquire+release of requests of `blocks` hashes whose first `shared` are a random
//                   warm prompt's and the rest fresh, until `seconds` or max_pairs;
//   mode "floor":   GET /config (the cheapest call), the same way.
// Block hashes come from a seeded generator, so a warm prompt's chain is re-made from its index.
import { PROTOCOL, BLOCK_TOKENS } from "./do-protocol.mjs";

const WARM_SEED = 0x5eed0000;

/** `n` pseudo-random u64 block hashes from `seed` (mulberry32 words, two per hash). */
export function hashes(n, seed) {
  const words = new Uint32Array(2 * n);
  let a = seed >>> 0;
  for (let i = 0; i < words.length; i++) {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), a | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    words[i] = (t ^ (t >>> 14)) >>> 0;
  }
  return new BigUint64Array(words.buffer);
}

/** Request features of call `i` of a /run with options `o` (also used from Node). */
export function features(o, i) {
  let h;
  if (o.mode === "warm") {
    h = hashes(o.warm_blocks, WARM_SEED + i);
  } else {
    h = hashes(o.blocks, (Math.random() * 2 ** 32) >>> 0);
    h.set(hashes(o.shared, WARM_SEED + Math.floor(Math.random() * o.warm_prompts)));
  }
  return { request_id: `bench-${o.mode}-${i}`, model: o.model, prompt_tokens: h.length * BLOCK_TOKENS + 7, max_tokens: 128, block_hashes: h };
}

/** An empty record of a loop's calls. */
export function records() {
  return { pairs: 0, ok: 0, statuses: {}, acquire_ms: [], release_ms: [], cached_blocks: 0 };
}

/**
 * Call `i` of a loop with options `o` through `call(path, init)`: GET /config in mode "floor", else
 * an acquire+release pair; recorded in `out` (also used from Node, bench/coordinator.mjs).
 */
export async function step(call, o, i, out) {
  out.pairs += 1;
  const s = performance.now();
  if (o.mode === "floor") {
    const r = await call("/config", { method: "GET" });
    await r.arrayBuffer();
    out.statuses[r.status] = (out.statuses[r.status] ?? 0) + 1;
    if (r.status === 200) out.ok += 1;
    out.acquire_ms.push(performance.now() - s);
    return;
  }
  const f = features(o, i);
  const a = await call(PROTOCOL.acquirePath, PROTOCOL.acquire(f));
  const m = performance.now();
  out.statuses[a.status] = (out.statuses[a.status] ?? 0) + 1;
  if (a.status !== 200) {
    await a.arrayBuffer();
    return;
  }
  const g = await PROTOCOL.grant(a);
  const released = await PROTOCOL.released(await call(PROTOCOL.releasePath, PROTOCOL.release(g, f)));
  out.acquire_ms.push(m - s);
  out.release_ms.push(performance.now() - m);
  out.cached_blocks += g.cached_blocks;
  if (released) out.ok += 1;
}

/** Calls through the stub's `fetch`, the pool named in its header (the admin API's path). */
function fetchCall(stub, pool) {
  return (path, init) =>
    stub.fetch(`https://do.internal${path}`, { ...init, headers: { ...(init.headers ?? {}), [PROTOCOL.poolHeader]: pool } });
}

/**
 * Calls by Durable Object RPC, as the Worker's lease calls go (`gatewayCall(method, url, pool,
 * shard, body)` answering `[status, body, retry-after]`, protocol/src/call.rs): the answer is
 * given the three members of a response that `step` reads.
 */
function rpcCall(stub, pool) {
  return async (path, init) => {
    const [status, body] = await stub[PROTOCOL.rpcMethod](init.method, `https://do.internal${path}`, pool, null, init.body ?? null);
    return { status, json: async () => JSON.parse(body), arrayBuffer: async () => body };
  };
}

async function run(env, o) {
  const stub = env.POOL.get(env.POOL.idFromName(o.pool));
  const call = o.transport === "fetch" ? fetchCall(stub, o.pool) : rpcCall(stub, o.pool);
  const out = records();
  const t0 = Date.now();
  const deadline = t0 + o.seconds * 1000;
  const more = (i) => out.pairs < o.max_pairs && Date.now() < deadline && (o.mode !== "warm" || i < o.warm_prompts);
  for (let i = o.first_index; more(i); i += o.stride) await step(call, o, i, out);
  out.wall_ms = Date.now() - t0;
  return out;
}

export default {
  async fetch(req, env) {
    if (req.method !== "POST" || new URL(req.url).pathname !== "/run") return new Response("POST /run\n", { status: 404 });
    try {
      return Response.json(await run(env, await req.json()));
    } catch (e) {
      return Response.json({ error: String(e?.stack ?? e) }, { status: 500 });
    }
  },
};
