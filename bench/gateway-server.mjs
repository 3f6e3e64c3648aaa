// The gateway the routing benchmark (scripts/bench.sh) measures: the built Worker (build/index.js)
// in one workerd process through Miniflare, listening on 127.0.0.1:PORT until SIGTERM or SIGINT.
//
// `wrangler dev` puts a second workerd in front of the Worker (its proxy worker, one more HTTP hop
// and one more stream copy per request), which on a two-core machine shared with the fleet and the
// load generator costs every policy the same tens of milliseconds of time to first token at 64
// concurrent streams; a deployed Worker has no such hop. `BENCH_GATEWAY=wrangler make bench` still
// runs the benchmark under `wrangler dev` for comparison.
//
//   ADMIN_TOKEN=... [BENCH_VARS='{"ROUTE_AHEAD":"true"}'] node bench/gateway-server.mjs PORT PERSIST_DIR
import { readFileSync } from "node:fs";
import path from "node:path";
import { ROOT, startGateway } from "../tests/lib/harness.mjs";

/** wrangler.toml's [vars] (flat `KEY = "value"` lines), the settings `wrangler dev` would give. */
function wranglerVars() {
  const toml = readFileSync(path.join(ROOT, "wrangler.toml"), "utf8");
  const section = toml.split(/^\[vars\]\s*$/m)[1]?.split(/^\[/m)[0] ?? "";
  return Object.fromEntries([...section.matchAll(/^([A-Z0-9_]+)\s*=\s*"([^"]*)"/gm)].map((m) => [m[1], m[2]]));
}

const [port, persistDir] = process.argv.slice(2);
if (!port || !persistDir || !process.env.ADMIN_TOKEN) {
  console.error("usage: ADMIN_TOKEN=... node bench/gateway-server.mjs PORT PERSIST_DIR");
  process.exit(2);
}
// BENCH_VARS (JSON) sets more vars on top, e.g. '{"ROUTE_AHEAD":"true"}' to bench a setting.
const extra = process.env.BENCH_VARS ? JSON.parse(process.env.BENCH_VARS) : {};
const gw = await startGateway({
  persistDir,
  bindings: { ...wranglerVars(), ADMIN_TOKEN: process.env.ADMIN_TOKEN, PROBE_INTERVAL_MS: "1000", ALLOW_IP_BACKENDS: "true", REQUIRE_CLIENT_KEYS: "false", ...extra },
  options: { host: "127.0.0.1", port: Number(port) },
});
console.log(`gateway: the built Worker in workerd on ${await gw.mf.ready}`);
let closing = false;
for (const sig of ["SIGTERM", "SIGINT"]) {
  process.on(sig, async () => {
    if (closing) return;
    closing = true;
    await gw.close();
    process.exit(0);
  });
}
