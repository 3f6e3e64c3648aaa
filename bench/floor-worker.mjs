// The floor of the overhead benchmark (bench/worker-cpu.mjs, bench/latency.mjs): the least any
// Worker in workerd can do to proxy a streamed completion, to compare the gateway's CPU with.
// It forwards every request to one upstream (`UPSTREAM`, a vllm-sim) with `fetch` and answers
// with the upstream's status, content type and body, in one of three modes (`MODE`):
//   "pass":      the upstream body returned as is (no JavaScript runs per chunk);
//   "identity":  piped through `new TransformStream()` from `waitUntil`, as the gateway's relay
//                pipes it (the stream's own per-chunk cost, no callback);
//   "transform": the same with a `transform(chunk, controller)` callback that only enqueues the
//                chunk (the cost of calling JavaScript per chunk, which the gateway's relay does).
// Nothing else: no routing, leases, logging or parsing.

export default {
  async fetch(request, env, ctx) {
    const url = new URL(request.url);
    const upstream = await fetch(env.UPSTREAM + url.pathname, {
      method: request.method,
      headers: { "content-type": request.headers.get("content-type") ?? "application/json" },
      body: request.body,
    });
    const init = { status: upstream.status, headers: { "content-type": upstream.headers.get("content-type") ?? "text/plain" } };
    if (env.MODE === "pass" || !upstream.body) return new Response(upstream.body, init);
    const relay = env.MODE === "transform"
      ? new TransformStream({ transform: (chunk, controller) => controller.enqueue(chunk) })
      : new TransformStream();
    ctx.waitUntil(upstream.body.pipeTo(relay.writable));
    return new Response(relay.readable, init);
  },
};
