// Nobody gets in without a key, nobody exceeds their rate limit, and no secret ever leaves the
// gateway: planted secrets (admin token, client keys, backend key) are searched for in every
// response, listing, metric and log line the gateway produced during the test.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSseServer, waitReady, errorBody, ADMIN_TOKEN } from "./lib/harness.mjs";

const CLIENT_KEY = "sk-client-planted-7c1d";
const OTHER_KEY = "sk-client-planted-other-2b9e";
const BACKEND_KEY = "sk-backend-planted-55aa";
const METRICS_TOKEN = "metrics-planted-9f0e";

let gw, sse, logs = "", seen = "";

before(async () => {
  gw = await startGateway({
    bindings: { CLIENT_API_KEYS: `${CLIENT_KEY},${OTHER_KEY}`, RATE_LIMIT_RPM: "4", RATE_LIMIT_TPM: "5000", METRICS_TOKEN },
    options: {
      handleRuntimeStdio(stdout, stderr) {
        stdout.on("data", (d) => (logs += d));
        stderr.on("data", (d) => (logs += d));
      },
    },
  });
  sse = await startSseServer({ chunks: 2, delayMs: 10 });
  const r = await record(gw.admin("/admin/backends", { method: "POST", body: { url: sse.url, models: ["sse-model"], api_key: BACKEND_KEY, id: "sec-1" } }));
  assert.equal(r.status, 201);
  await waitReady(gw, "sec-1");
});

after(async () => {
  await gw?.close();
  await sse?.close();
});

/** Awaits a response and remembers its headers and body for the leak check. */
async function record(promise) {
  const r = await promise;
  const body = await r.text();
  seen += JSON.stringify([...r.headers]) + body;
  return { status: r.status, headers: r.headers, body, json: () => JSON.parse(body) };
}

const chat = (key, extra = {}) =>
  record(gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", ...(key ? { authorization: `Bearer ${key}` } : {}), cookie: "session=planted-cookie" },
    // stream: the SSE test server answers every request with an event stream, which only a
    // streamed request may get (a whole answer must be JSON).
    body: JSON.stringify({ model: "sse-model", messages: [{ role: "user", content: "hi" }], max_tokens: 16, stream: true, ...extra }),
  }));

test("client keys: none or a wrong one is refused with 401; the backend gets its own key, never the client's", async () => {
  const none = await chat(null);
  assert.equal(none.status, 401);
  assert.equal(none.json().error.type, "authentication_error");
  const wrong = await chat("sk-client-wrong");
  assert.equal(wrong.status, 401);
  const models = await record(gw.fetch("/v1/models"));
  assert.equal(models.status, 401);
  const before = sse.requests.length;
  const ok = await chat(OTHER_KEY);
  assert.equal(ok.status, 200, ok.body);
  const upstream = sse.requests.slice(before).find((r) => r.url === "/v1/chat/completions");
  assert.equal(upstream.headers.authorization, `Bearer ${BACKEND_KEY}`);
  assert.equal(upstream.headers.cookie, undefined, "the client's cookie was forwarded");
});

test("rate limits: per key, requests per minute, with Retry-After", async () => {
  const statuses = [];
  for (let i = 0; i < 4; i++) statuses.push((await chat(CLIENT_KEY)).status);
  assert.deepEqual(statuses, [200, 200, 200, 200]);
  const limited = await chat(CLIENT_KEY);
  assert.equal(limited.status, 429);
  assert.ok(Number(limited.headers.get("retry-after")) >= 1);
  assert.equal(limited.json().error.code, "rate_limit_exceeded");
  // Another key has its own budget (it used one request in the first test).
  assert.equal((await chat(OTHER_KEY)).status, 200);
});

test("rate limits: a request larger than a minute's token allowance is refused outright", async () => {
  const big = await chat(OTHER_KEY, { max_tokens: 10000 });
  assert.equal(big.status, 429);
  assert.equal(big.json().error.code, "request_too_large_for_rate_limit");
});

test("metrics need their token; admin needs the admin token, not a client key", async () => {
  assert.equal((await record(gw.fetch("/metrics", { headers: { authorization: `Bearer ${CLIENT_KEY}` } }))).status, 401);
  const m = await record(gw.fetch("/metrics", { headers: { authorization: `Bearer ${METRICS_TOKEN}` } }));
  assert.equal(m.status, 200);
  const admin = await record(gw.admin("/admin/backends", { token: CLIENT_KEY }));
  assert.equal(admin.status, 401);
  await record(gw.admin("/admin/backends"));
  await record(gw.admin("/admin/backends/sec-1"));
  await record(gw.admin("/admin/pools"));
  await record(gw.admin("/admin/pools/default"));
  await record(gw.admin("/admin/keys"));
});

test("no planted secret appears in any response, listing, metric or log line", async () => {
  // Give the runtime a moment to flush its log lines.
  await new Promise((r) => setTimeout(r, 200));
  assert.ok(seen.length > 1000, "the test saw too little to be meaningful");
  assert.match(logs, /"event":"request"/, "the access log was not captured");
  for (const secret of [CLIENT_KEY, OTHER_KEY, BACKEND_KEY, METRICS_TOKEN, ADMIN_TOKEN, "planted-cookie"]) {
    assert.ok(!seen.includes(secret), `${secret} leaked into a response`);
    assert.ok(!logs.includes(secret), `${secret} leaked into the logs`);
  }
});

test("backend URLs are validated: no credentials, only http(s)", async () => {
  for (const url of ["http://admin:hunter2@127.0.0.1:1", "javascript:alert(1)", "http://", "gopher://127.0.0.1:70"]) {
    const r = await record(gw.admin("/admin/backends", { method: "POST", body: { url, models: ["m"] } }));
    assert.equal(r.status, 400, url);
    assert.ok(!r.body.includes("hunter2"), "the rejected URL's password was echoed back");
  }
});
