// The regional hop (issue 27) in one workerd: the built Worker a second time as a regional Worker
// (GATEWAY_ROLE=regional) that shares the gateway's Durable Objects (`scriptName: "gateway"`), and
// the edge gateway's service binding and REGIONAL_WORKERS var that reach it. Used by
// tests/hop.test.mjs and bench/round-trips.mjs.
import path from "node:path";
import { ROOT, ADMIN_TOKEN, startGateway } from "./harness.mjs";

/** The Miniflare options of a regional Worker named `name` with extra `bindings`. */
export function regionalWorker(name, bindings = {}) {
  return {
    name,
    scriptPath: path.join(ROOT, "build/index.js"),
    modules: true,
    modulesRules: [{ type: "CompiledWasm", include: ["**/*.wasm"], fallthrough: true }],
    compatibilityDate: "2026-08-01",
    compatibilityFlags: ["enable_request_signal"],
    // The same namespaces as the edge: one PoolCoordinator per pool, whichever Worker calls it.
    durableObjects: {
      POOL: { className: "PoolCoordinator", scriptName: "gateway" },
      DIRECTORY: { className: "GatewayDirectory", scriptName: "gateway" },
      RATE_LIMITER: { className: "ClientRateLimiter", scriptName: "gateway" },
    },
    bindings: { ADMIN_TOKEN, ALLOW_IP_BACKENDS: "true", REQUIRE_CLIENT_KEYS: "false", GATEWAY_ROLE: "regional", ...bindings },
  };
}

/**
 * The gateway with a regional Worker for `region` when `hop` is true (else the gateway alone, as
 * without the hop). `bindings` go to both Workers. Returns startGateway's handle.
 */
export async function startWithHop({ region, bindings = {}, hop = true, options = {} }) {
  if (!hop) return startGateway({ bindings, options });
  const binding = `REGIONAL_${region.toUpperCase().replace(/[^A-Z0-9]/g, "_")}`;
  return startGateway({
    bindings: { ...bindings, REGIONAL_WORKERS: JSON.stringify({ [region]: binding }) },
    options,
    extraWorkers: [regionalWorker(`regional-${region}`, bindings)],
    workerOptions: { serviceBindings: { [binding]: `regional-${region}` } },
  });
}
