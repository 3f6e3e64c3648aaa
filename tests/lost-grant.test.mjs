// A grant whose answer is lost on its way back to the Worker (issue 42, item 8), end to end in
// workerd against a real vllm-sim: the pool granted a lease, but the call that carried the grant
// failed (tests/lib/object-faults.mjs runs the pool's call, then throws instead of answering, as a
// broken connection to a Durable Object does). The lease must not stay held until it expires
// (`lease_ttl_ms`, 60 s) beside the request's next one:
// - a queued request whose grant is lost asks again with its ticket, and the pool releases the
//   lost lease before granting it anew: one lease, the request served, the pool back to zero;
// - a request whose first acquire's grant is lost gives up on the pool under its wait's id, and
//   the pool releases that lease at once.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import {
  startGateway, startSim, waitReady, waitFor, onlyPool, poolState, drained, setObjectFaults,
} from "./lib/harness.mjs";

const MODEL = "lost-model";
let gw;
let sim;

before(async () => {
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "500" }, objectFaults: true });
  sim = await startSim(["--model", MODEL, "--time-scale", "1", "--max-num-seqs", "1"]);
  const put = await gw.admin("/admin/pools/lg", { method: "PUT", body: { admission: { enabled: true, poll_ms: 200 } } });
  assert.equal(put.status, 200, await put.text());
  const reg = await gw.admin("/admin/backends", { method: "POST", body: { url: sim.url, pool: "lg", models: [MODEL], id: "lg-b0", max_num_seqs: 1 } });
  assert.equal(reg.status, 201, await reg.text());
  await waitReady(gw, "lg-b0");
  await onlyPool(gw, "lg");
});

after(async () => {
  await sim?.close();
  await gw?.close();
});

const hits = async () => (await (await gw.fetch("/__object-faults")).json()).reduce((a, f) => a + f.hits, 0);

function chat(content, { stream = false, max_tokens = 4 } = {}) {
  return gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content }], stream, max_tokens, ignore_eos: true }),
  });
}

test("a queued request whose grant is lost is served on one lease, and the lost lease goes back at once", async () => {
  // A holds the only slot; B queues behind it.
  const a = await chat("first", { stream: true, max_tokens: 150 });
  assert.equal(a.status, 200);
  const reader = a.body.getReader();
  await reader.read();
  const b = chat("second");
  await waitFor(async () => ((await poolState(gw, "lg")).queue?.length ?? 0) >= 1 ? true : null,
    { timeoutMs: 5000, intervalMs: 50, what: "B queued" });
  // The next grant's answer is lost (the queued answers pass).
  await setObjectFaults(gw, [{ pool: "lg", route: "/acquire", mode: "lost", answerIncludes: "lease_id", times: 1 }]);
  for (;;) if ((await reader.read()).done) break;
  const rb = await b;
  assert.equal(rb.status, 200, await rb.clone().text());
  await rb.text();
  assert.equal(await hits(), 1, "B's grant was answered and lost once");
  // Both leases back well within lease_ttl_ms (60 s): the lost one did not linger.
  await drained(gw, "lg", { timeoutMs: 5000 });
  await setObjectFaults(gw, []);
});

test("a request whose first grant is lost gives it back at once", async () => {
  await setObjectFaults(gw, [{ pool: "lg", route: "/acquire", mode: "lost", answerIncludes: "lease_id", times: 1 }]);
  const r = await chat("third");
  await r.text();
  assert.equal(await hits(), 1, "the grant was answered and lost");
  // Whatever the client got, the lease the lost answer carried is back within seconds.
  await drained(gw, "lg", { timeoutMs: 5000 });
  // And the next request is served on the free slot.
  await setObjectFaults(gw, []);
  const next = await chat("fourth");
  assert.equal(next.status, 200, await next.text());
  await drained(gw, "lg", { timeoutMs: 5000 });
});
