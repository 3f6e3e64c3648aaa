// Serves the built Worker (build/index.js) under Miniflare on a free 127.0.0.1 port, for clients
// outside Node (the Python tests drive it with the real `openai` client).
//
//   node tests/lib/serve-gateway.mjs ['{"EXTRA_BINDING": "value"}']
//
// Prints one JSON line {"url": ..., "admin_token": ...} once ready; disposes Miniflare and exits on
// SIGTERM, SIGINT or when stdin closes (so a parent that dies takes the gateway with it).
import { startGatewayServer, ADMIN_TOKEN } from "./harness.mjs";

const extra = process.argv[2] ? JSON.parse(process.argv[2]) : {};
const gw = await startGatewayServer({ bindings: { PROBE_INTERVAL_MS: "500", REQUIRE_CLIENT_KEYS: "false", ...extra } });

let closing = false;
async function shutdown(code = 0) {
  if (closing) return;
  closing = true;
  try {
    await gw.close();
  } finally {
    process.exit(code);
  }
}
process.on("SIGTERM", () => shutdown(0));
process.on("SIGINT", () => shutdown(0));
process.stdin.on("end", () => shutdown(0));
process.stdin.on("close", () => shutdown(0));
process.stdin.resume();

process.stdout.write(JSON.stringify({ url: gw.url, admin_token: ADMIN_TOKEN }) + "\n");
