// A Miniflare entry module for tests: the built Worker (build/index.js) whose pool coordinator
// objects can be made to fail calls, as a Durable Object does when it is overloaded, reset by a
// deploy, or when the connection to it breaks. It changes nothing in the Worker: it subclasses the
// exported `PoolCoordinator` and wraps its two call surfaces (`gatewayCall` by RPC and `fetch`), and
// reads its fault table from this module's memory, which the Worker's isolate shares with its
// objects under workerd. A test sets the table through `POST /__object-faults` (answered here,
// before the Worker sees the request) with a list of faults:
//   { pool, shard, method, route, mode, times }
// `route` is a substring of the call's URL path (e.g. "/metrics"), `method` its HTTP method; `shard`
// a number; any of the three absent matches every call;
// `mode` "throw" (the call fails before the object runs it), "lost" (the object runs it, then the
// caller gets an error instead of the answer) or "count" (nothing fails: the calls are counted);
// `times` how many calls fail (absent: every one); `answerIncludes` (with "lost") loses only an
// answer whose body contains that text (e.g. "lease_id": a grant), the other calls pass uncounted.
// `GET /__object-faults` answers the table with each fault's `hits`.
import * as gateway from "../../build/index.js";

export * from "../../build/index.js";

let faults = [];

function fault(method, url, pool, shard) {
  const path = new URL(url, "https://do.internal").pathname;
  for (const f of faults) {
    if (f.times !== undefined && f.hits >= f.times) continue;
    if (f.pool !== undefined && f.pool !== pool) continue;
    if (f.shard !== undefined && String(f.shard) !== String(shard ?? "0")) continue;
    if (f.route !== undefined && !path.includes(f.route)) continue;
    if (f.method !== undefined && f.method.toUpperCase() !== String(method).toUpperCase()) continue;
    if (f.answerIncludes === undefined) f.hits += 1;
    return f;
  }
  return null;
}

/** Whether fault `f` loses an answer whose body is `body` (and counts it when it does). */
function loses(f, body) {
  if (f?.mode !== "lost") return false;
  if (f.answerIncludes === undefined) return true;
  if (f.times !== undefined && f.hits >= f.times) return false;
  if (!String(body ?? "").includes(f.answerIncludes)) return false;
  f.hits += 1;
  return true;
}

function failure(f, path) {
  return new Error(`object-faults: ${f.mode} on ${f.pool ?? "*"}#${f.shard ?? "*"} ${path}`);
}

export class PoolCoordinator extends gateway.PoolCoordinator {
  async gatewayCall(method, url, pool, shard, body) {
    const f = fault(method, url, pool, shard);
    if (f?.mode === "throw") throw failure(f, url);
    const answer = await super.gatewayCall(method, url, pool, shard, body);
    if (loses(f, answer?.[1])) throw failure(f, url);
    return answer;
  }

  async fetch(request) {
    const f = fault(request.method, request.url, request.headers.get("x-gateway-pool"), request.headers.get("x-gateway-shard"));
    if (f?.mode === "throw") throw failure(f, request.url);
    const answer = await super.fetch(request);
    if (loses(f, f?.answerIncludes === undefined ? "" : await answer.clone().text())) throw failure(f, request.url);
    return answer;
  }
}

const Worker = gateway.default;

export default class extends Worker {
  async fetch(request) {
    const url = new URL(request.url);
    if (url.pathname === "/__object-faults") {
      if (request.method === "POST") faults = (await request.json()).map((f) => ({ mode: "throw", ...f, hits: 0 }));
      return Response.json(faults);
    }
    return super.fetch(request);
  }
}
