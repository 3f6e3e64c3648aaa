// A disaggregated (prefill/decode) request whose prefill server sends its answer's headers and
// then stalls in the middle of the body (issue 42, still open from the last round): the prefill's
// body is read by the attempt's deadline (`RESPONSE_TIMEOUT_MS`), so the client gets 504 in about
// that time and the lease ends, instead of waiting as long as the server keeps the connection open.
// The decode server is a real vllm-sim; the stalling prefill server is a small local server that
// passes the probes like a vLLM server and answers generation requests with half a JSON body.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import { startGateway, startSim, waitReady, onlyPool, drained, errorBody } from "./lib/harness.mjs";

const MODEL = "pd-model";
let gw;
let decode;
let stalling;

before(async () => {
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500", RESPONSE_TIMEOUT_MS: "1500" } });
  decode = await startSim(["--model", MODEL, "--role", "decode", "--time-scale", "20"]);
  const open = new Set();
  const server = http.createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      if (req.url === "/health") return res.end("ok");
      if (req.url === "/v1/models") {
        res.writeHead(200, { "content-type": "application/json" });
        return res.end(JSON.stringify({ object: "list", data: [{ id: MODEL, object: "model" }] }));
      }
      if (req.method === "GET") { res.writeHead(404); return res.end(); }
      // Headers and the start of the answer, then nothing, the connection held open.
      res.writeHead(200, { "content-type": "application/json" });
      res.write('{"id":"cmpl-stalled","object":"chat.completion","choices":[');
      open.add(res);
    });
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  stalling = {
    url: `http://127.0.0.1:${server.address().port}`,
    close: () => new Promise((r) => { for (const res of open) res.destroy(); server.closeAllConnections(); server.close(r); }),
  };
});

after(async () => {
  await stalling?.close();
  await decode?.close();
  await gw?.close();
});

test("a prefill server that stalls mid-body ends the request with 504 by the attempt's deadline", async () => {
  const put = await gw.admin("/admin/pools/pd", { method: "PUT", body: { policy: "disaggregated" } });
  assert.equal(put.status, 200, await put.text());
  for (const [id, url, role] of [["pd-prefill", stalling.url, "prefill"], ["pd-decode", decode.url, "decode"]]) {
    const r = await gw.admin("/admin/backends", { method: "POST", body: { url, pool: "pd", models: [MODEL], id, role } });
    assert.equal(r.status, 201, await r.text());
  }
  await waitReady(gw, "pd-prefill");
  await waitReady(gw, "pd-decode");
  await onlyPool(gw, "pd");
  const started = performance.now();
  let r;
  try {
    r = await gw.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content: "hello" }], max_tokens: 4 }),
      signal: AbortSignal.timeout(15000),
    });
  } catch (e) {
    assert.fail(`no answer within 15 s (the prefill body was read without a deadline): ${e}`);
  }
  const took = performance.now() - started;
  assert.equal(r.status, 504, await r.clone().text());
  const e = await errorBody(r);
  assert.match(e.message, /prefill/);
  assert.ok(took < 8000, `answered after ${Math.round(took)} ms`);
  // The lease ended with it.
  await drained(gw, "pd");
});
