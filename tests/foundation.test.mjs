// The walking skeleton, end to end in workerd: health, admin auth and validation, persistence of
// the registry across a restart, the cron trigger reaching the pool's probe alarm, and a streamed
// completion that reaches the client before the backend has finished (no buffering).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readdirSync, rmSync } from "node:fs";
import path from "node:path";
import { startGateway, startSseServer, tempDir, waitFor, waitReady, errorBody, ADMIN_TOKEN } from "./lib/harness.mjs";

let gw, sse, persist;

before(async () => {
  persist = tempDir();
  gw = await startGateway({ persistDir: persist.dir });
  sse = await startSseServer({ chunks: 5, delayMs: 300 });
});

after(async () => {
  await gw?.close();
  await sse?.close();
  persist?.cleanup();
});

test("GET /healthz answers ok", async () => {
  const r = await gw.fetch("/healthz");
  assert.equal(r.status, 200);
  assert.equal((await r.json()).status, "ok");
  assert.ok(r.headers.get("x-request-id"));
});

test("admin API refuses a missing or wrong token with an OpenAI error", async () => {
  const none = await gw.fetch("/admin/backends");
  assert.equal(none.status, 401);
  assert.equal((await errorBody(none)).type, "authentication_error");
  const wrong = await gw.admin("/admin/backends", { token: ADMIN_TOKEN + "x" });
  assert.equal(wrong.status, 401);
  await errorBody(wrong);
  const short = await gw.admin("/admin/backends", { token: "t" });
  assert.equal(short.status, 401);
  await errorBody(short);
});

test("admin API rejects malformed JSON and bad URLs with 400", async () => {
  for (const body of ["{not json", '{"url": 5}', "[]"]) {
    const r = await gw.admin("/admin/backends", { method: "POST", body });
    assert.equal(r.status, 400, body);
    assert.equal((await errorBody(r)).type, "invalid_request_error");
  }
  for (const url of ["ftp://127.0.0.1:1", "file:///etc/passwd", "http://user:pw@127.0.0.1:1", "not a url", "http://127.0.0.1:1/?q=1"]) {
    const r = await gw.admin("/admin/backends", { method: "POST", body: { url, models: ["m"] } });
    assert.equal(r.status, 400, url);
    const e = await errorBody(r);
    assert.equal(e.param, "url", url);
  }
  const role = await gw.admin("/admin/backends", { method: "POST", body: { url: "http://127.0.0.1:9", role: "boss" } });
  assert.equal(role.status, 400);
});

test("a registered backend is listed with its API key redacted, and duplicates conflict", async () => {
  const secret = "sk-backend-secret-9a8b7c";
  const r = await gw.admin("/admin/backends", {
    method: "POST",
    body: { url: sse.url, models: ["sse-model"], api_key: secret, region: "us-east" },
  });
  const text = await r.text();
  assert.equal(r.status, 201, text);
  assert.ok(!text.includes(secret), "registration response leaks the API key");
  const created = JSON.parse(text);
  assert.match(created.id, /^b-[0-9a-f]+$/);

  const list = await gw.admin("/admin/backends");
  const listText = await list.text();
  assert.equal(list.status, 200);
  assert.ok(!listText.includes(secret), "listing leaks the API key");
  const item = JSON.parse(listText).data.find((b) => b.id === created.id);
  assert.equal(item.url, sse.url);
  assert.equal(item.api_key, undefined);
  assert.equal(item.has_api_key, true);
  assert.equal(item.pool, "default");
  // The registration's answer is the state before any probe (the listing may already follow the
  // first probe, which the registration starts at once).
  assert.equal(created.lifecycle, "pending", "a new backend serves nothing before its first probe");
  await waitReady(gw, created.id);

  const dup = await gw.admin("/admin/backends", { method: "POST", body: { url: sse.url + "/", models: ["x"] } });
  assert.equal(dup.status, 409);
  await errorBody(dup);
});

test("a streamed completion reaches the client before the backend finishes", async () => {
  const requestsBefore = sse.requests.length;
  const started = performance.now();
  const r = await gw.fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "content-type": "application/json", "x-request-id": "stream-test-1" },
    body: JSON.stringify({ model: "sse-model", stream: true, messages: [{ role: "user", content: "hi" }] }),
  });
  assert.equal(r.status, 200);
  assert.equal(r.headers.get("x-request-id"), "stream-test-1");
  const reader = r.body.getReader();
  const first = await reader.read();
  const firstAt = performance.now();
  assert.ok(!first.done);
  assert.match(new TextDecoder().decode(first.value), /tok0/);
  let rest = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    rest += new TextDecoder().decode(value);
  }
  assert.match(rest, /\[DONE\]/);
  assert.ok(sse.finishedAt, "backend finished");
  // The backend needs 5 x 300 ms; the first chunk must have arrived long before its end.
  assert.ok(firstAt < sse.finishedAt - 800, `first chunk at ${firstAt - started} ms, backend done at ${sse.finishedAt - started} ms`);
  const upstream = sse.requests[requestsBefore];
  assert.equal(upstream.url, "/v1/chat/completions");
  assert.equal(upstream.headers.authorization, "Bearer sk-backend-secret-9a8b7c");
  // vLLM gets an id the gateway made for the fetch, never the client's (issue 42 item 9).
  assert.match(upstream.headers["x-request-id"], /^gw-[0-9a-f]{24}$/);
});

test("errors: unknown model 404, wrong method 405, bad JSON 400, oversize 413", async () => {
  const post = (body, headers = {}) =>
    gw.fetch("/v1/chat/completions", { method: "POST", headers: { "content-type": "application/json", ...headers }, body });
  const unknown = await post(JSON.stringify({ model: "no-such-model", messages: [{ role: "user", content: "x" }] }));
  assert.equal(unknown.status, 404);
  assert.equal((await errorBody(unknown)).code, "model_not_found");
  const get = await gw.fetch("/v1/chat/completions");
  assert.equal(get.status, 405);
  await errorBody(get);
  const bad = await post("{oops", { "x-request-id": "bad-json-1" });
  assert.equal(bad.status, 400);
  assert.equal(bad.headers.get("x-request-id"), "bad-json-1");
  await errorBody(bad);
  const huge = await post(JSON.stringify({ model: "sse-model", messages: [{ role: "user", content: "x".repeat(1_100_000) }] }));
  assert.equal(huge.status, 413);
  await errorBody(huge);
});

test("the cron trigger arms the pool's probe alarm, which records its probe", async () => {
  const res = await gw.scheduled();
  assert.equal(res.outcome, "ok");
  const state = await waitFor(async () => {
    const s = await (await gw.admin("/admin/pools/default")).json();
    return s.last_probe_ms ? s : null;
  }, { what: "a recorded probe" });
  assert.ok(state.last_probe_ms > Date.now() - 60_000);
  assert.equal(state.backends, 1);
  assert.ok(state.probe_rounds >= 1);
});

test("the registry survives a restart of the gateway", async () => {
  await gw.close();
  gw = await startGateway({ persistDir: persist.dir });
  const list = await (await gw.admin("/admin/backends")).json();
  assert.equal(list.data.length, 1);
  assert.equal(list.data[0].url, sse.url);
});

test("a directory that lost its pools finds them again when a backend is registered anew", async () => {
  // Local state kept across a rename of the directory's class starts the directory empty while
  // the pools keep their backends: the listing is empty, and registering answers 409.
  const before = (await (await gw.admin("/admin/backends")).json()).data[0];
  await gw.close();
  const dirs = readdirSync(persist.dir).filter((d) => d.includes("GatewayDirectory"));
  assert.equal(dirs.length, 1, `persisted objects: ${readdirSync(persist.dir)}`);
  rmSync(path.join(persist.dir, dirs[0]), { recursive: true, force: true });
  gw = await startGateway({ persistDir: persist.dir });
  assert.deepEqual((await (await gw.admin("/admin/backends")).json()).data, []);
  const again = await gw.admin("/admin/backends", {
    method: "POST",
    body: { id: before.id, url: before.url, models: before.models, pool: before.pool },
  });
  assert.equal(again.status, 409, await again.text());
  const list = (await (await gw.admin("/admin/backends")).json()).data;
  assert.deepEqual(list.map((b) => [b.id, b.url]), [[before.id, sse.url]]);
  assert.equal((await gw.admin(`/admin/backends/${before.id}`)).status, 200);
});
