// A reduced soak in the test suite: tests/soak.mjs's run (400 requests, 40 at a time, 3 backends,
// faults every 100 ms) against the built Worker under Miniflare. Every request must succeed with a
// complete body or get a well-formed OpenAI error, the gateway must never answer 500, and every
// lease must come back. The full-size run is `node tests/soak.mjs` (see its header).
import { test } from "node:test";
import assert from "node:assert/strict";
import { runSoak } from "./soak.mjs";

test("reduced soak: random faults under concurrent load lose nothing and leak no lease", { timeout: 120000 }, async () => {
  const lines = [];
  const summary = await runSoak({
    requests: 400,
    concurrency: 40,
    sims: 3,
    secondsLimit: 60,
    faultIntervalMs: 100,
    timeScale: 5,
    seed: 8,
    leaseWaitMs: 15000,
    requestTimeoutMs: 45000,
    log: (m) => lines.push(m),
  });
  const brief = JSON.stringify({ ...summary, leases_after: undefined }, null, 1);
  assert.equal(summary.violations, 0, `violations:\n${JSON.stringify(summary.violation_samples, null, 1)}\n${brief}`);
  assert.equal(summary.completed, 400, brief);
  assert.equal(summary.gateway_500s, 0, brief);
  for (const p of summary.leases_after.pools) {
    assert.equal(p.in_flight, 0, `pool ${p.pool}`);
    assert.equal(p.in_flight_tokens, 0, `pool ${p.pool}`);
  }
  // The faults were real: some were applied, and most requests still succeeded.
  const applied = Object.values(summary.faults_applied).reduce((a, b) => a + b, 0);
  assert.ok(applied >= 5, `only ${applied} faults applied: ${brief}`);
  const ok = (summary.by_outcome.ok ?? 0) + (summary.by_outcome.ok_stream ?? 0);
  assert.ok(ok >= 100, `only ${ok} of 400 succeeded: ${brief}`);
  assert.ok(summary.ok, brief);
});
