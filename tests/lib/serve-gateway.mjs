// Serves the built Worker (build/index.js) under Miniflare on a free 127.0.0.1 port, for clients
// outside Node (the Python tests drive it with the real `openai` client).
//
//   node tests/lib/serve-gateway.mjs ['{"EXTRA_BINDING": "value"}']
//
// Prints one JSON line {"url": ..., "admin_token": ...} once ready; disposes Miniflare and exits on
// SIGTERM, SIGINT or when stdin closes (so a parent that dies takes the gateway with it).
import { Miniflare } from "miniflare";
import path from "node:path";
import { ROOT, ADMIN_TOKEN } from "./harness.mjs";

const extra = process.argv[2] ? JSON.parse(process.argv[2]) : {};

const mf = new Miniflare({
  scriptPath: path.join(ROOT, "build/index.js"),
  modules: true,
  modulesRules: [{ type: "CompiledWasm", include: ["**/*.wasm"], fallthrough: true }],
  compatibilityDate: "2026-08-01",
  compatibilityFlags: ["enable_request_signal"],
  durableObjects: {
    POOL: { className: "PoolCoordinator", useSQLite: true },
    DIRECTORY: { className: "PoolDirectory", useSQLite: true },
    RATE_LIMITER: { className: "RateLimiter", useSQLite: true },
  },
  durableObjectsPersist: false,
  host: "127.0.0.1",
  port: 0,
  bindings: { ADMIN_TOKEN, MAX_BODY_BYTES: "1048576", PROBE_INTERVAL_MS: "500", ...extra },
});

let closing = false;
async function shutdown(code = 0) {
  if (closing) return;
  closing = true;
  try {
    await mf.dispose();
  } finally {
    process.exit(code);
  }
}
process.on("SIGTERM", () => shutdown(0));
process.on("SIGINT", () => shutdown(0));
process.stdin.on("end", () => shutdown(0));
process.stdin.on("close", () => shutdown(0));
process.stdin.resume();

try {
  const url = new URL(await mf.ready);
  process.stdout.write(JSON.stringify({ url: url.origin, admin_token: ADMIN_TOKEN }) + "\n");
} catch (e) {
  console.error(e);
  await shutdown(1);
}
