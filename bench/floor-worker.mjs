// The floor of the overhead benchmark (bench/worker-cpu.mjs, bench/latency.mjs): the least any
// Worker in workerd can do to proxy a streamed completion, to compare the gateway's CPU with.
// It forwards every request to one upstream (`UPSTREAM`, a vllm-sim) with `fetch` and answers
// with the upstream's status, content type and body, in one of three modes (`MODE`):
//   "pass":     the upstream body returned as is (no JavaScript runs per chunk);
//   "identity": piped through `new TransformStream()` from `waitUntil` (the standard way to see a
//               stream's chunks on their way: the stream's own per-chunk cost, no callback);
//   "loop":     a loop in `waitUntil` reads each chunk and writes it to a native
//               `IdentityTransformStream`, as the gateway's relay does (which also hands each chunk
//               to its wasm scanner, and writes one chunk per whole event).
// With `WAIT_MS` set, it first waits that long on a timer, as the gateway waits out a modelled round
// trip with SIMULATE_NETWORK=true (bench/round-trips.mjs: what the model itself costs).
// Nothing else: no routing, leases, logging or parsing.

export default {
  async fetch(request, env, ctx) {
    const url = new URL(request.url);
    const wait = Number(env.WAIT_MS ?? 0);
    if (wait > 0) await new Promise((resolve) => setTimeout(resolve, wait));
    const upstream = await fetch(env.UPSTREAM + url.pathname, {
      method: request.method,
      headers: { "content-type": request.headers.get("content-type") ?? "application/json" },
      body: request.body,
    });
    const init = { status: upstream.status, headers: { "content-type": upstream.headers.get("content-type") ?? "text/plain" } };
    if (env.MODE === "pass" || !upstream.body) return new Response(upstream.body, init);
    if (env.MODE === "identity") {
      const relay = new TransformStream();
      ctx.waitUntil(upstream.body.pipeTo(relay.writable));
      return new Response(relay.readable, init);
    }
    const relay = new IdentityTransformStream();
    const reader = upstream.body.getReader();
    const writer = relay.writable.getWriter();
    ctx.waitUntil((async () => {
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        await writer.write(value);
      }
      await writer.close();
    })());
    return new Response(relay.readable, init);
  },
};
