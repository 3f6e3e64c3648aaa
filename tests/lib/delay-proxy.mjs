// A local HTTP proxy that adds a fixed delay in front of one upstream on 127.0.0.1: the way a test
// models a network round trip (a far region's pool, an edge-to-pool hop) without leaving this
// machine. Each request waits `delayMs` before it is forwarded (the request's way out and the
// answer's way back, taken together), then the answer streams back as it arrives, unbuffered.
// `setDelay(ms)` changes it for later requests; `requests` counts what went through,
// `posts` the POSTs among them (the generation requests, not the probes).
import http from "node:http";

export async function startDelayProxy(upstream, { delayMs = 0 } = {}) {
  const target = new URL(upstream);
  const state = { delayMs, requests: 0, posts: 0 };
  const server = http.createServer((req, res) => {
    state.requests += 1;
    if (req.method === "POST") state.posts += 1;
    const chunks = [];
    req.on("data", (c) => chunks.push(c));
    req.on("end", () => {
      setTimeout(() => {
        const out = http.request(
          { host: target.hostname, port: target.port, path: req.url, method: req.method, headers: { ...req.headers, host: target.host } },
          (up) => {
            res.writeHead(up.statusCode, up.headers);
            up.pipe(res);
          },
        );
        out.on("error", () => res.destroy());
        res.on("close", () => out.destroy());
        out.end(Buffer.concat(chunks));
      }, state.delayMs);
    });
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  const url = `http://127.0.0.1:${server.address().port}`;
  return {
    url,
    get requests() { return state.requests; },
    get posts() { return state.posts; },
    setDelay: (ms) => { state.delayMs = ms; },
    close: () => new Promise((r) => { server.closeAllConnections?.(); server.close(() => r()); }),
  };
}
