// Bad input and abuse against the OpenAI surface and the admin API, over a real socket to the
// Worker in workerd: malformed, truncated, mistyped, deeply nested, invalid UTF-8 and oversized
// bodies; absurd numbers; odd content types; oversized and hostile headers; path tricks in admin
// routes; header injection through x-request-id. Every case must get the right 4xx with an
// OpenAI-style JSON error body (never a 500, never a bare body), and the gateway must still serve
// afterwards with its state intact (a panic in wasm would reset in-memory state).
//
// Decided behaviour, asserted here:
// - Content-Type is not enforced: a JSON body is parsed as JSON whatever the header says
//   (`text/plain`, none, or `application/x-www-form-urlencoded`, which is what `curl -d` sends).
// - Headers the platform refuses (a bare CR or NUL, a header block over its limit) never reach the
//   Worker: the platform answers 400/431 itself. Headers it accepts must be handled by the gateway.
// - A client's x-request-id is echoed only if it is 1-128 characters of [A-Za-z0-9-_.:@/+=];
//   otherwise the response carries a fresh `req-<24 hex>` id.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startGatewayServer, startSim, waitReady, waitFor, rawHttp, ADMIN_TOKEN } from "./lib/harness.mjs";

const MODEL = "bad-input-model";
const MAX_BODY_BYTES = 1048576;
const SAFE_ID = /^[A-Za-z0-9\-_.:@/+=]{1,128}$/;
const FRESH_ID = /^req-[0-9a-f]{24}$/;

let gw, port;
const sims = [];
let probeRoundsBefore = 0;

before(async () => {
  gw = await startGatewayServer({ bindings: { PROBE_INTERVAL_MS: "500", MAX_BODY_BYTES: String(MAX_BODY_BYTES) } });
  port = Number(new URL(gw.url).port);
  const put = await gw.admin("/admin/pools/bi", { method: "PUT", body: { policy: "round_robin" } });
  assert.equal(put.status, 200, await put.text());
  for (let i = 0; i < 2; i++) {
    const s = await startSim(["--model", MODEL, "--time-scale", "50", "--seed", String(70 + i)]);
    sims.push(s);
    const r = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: "bi", models: [MODEL], id: `bi-${i}` } });
    assert.equal(r.status, 201, await r.text());
  }
  for (let i = 0; i < 2; i++) await waitReady(gw, `bi-${i}`);
  probeRoundsBefore = (await (await gw.admin("/admin/pools/bi")).json()).probe_rounds;
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

const chatBody = (extra = {}) => ({ model: MODEL, messages: [{ role: "user", content: "hello" }], max_tokens: 2, ...extra });
const nestedArrays = (depth) => "[".repeat(depth) + "]".repeat(depth);
const nestedObjects = (depth) => '{"a":'.repeat(depth) + "1" + "}".repeat(depth);
const bytes = (...parts) => Buffer.concat(parts.map((p) => (typeof p === "string" ? Buffer.from(p) : Buffer.from(p))));

/** Sends one request; `body` may be an object (JSON-encoded), a string or a Buffer. */
async function send({ method = "POST", path, body, headers = {}, admin = false, contentType = "application/json" }) {
  const h = { ...headers };
  if (contentType !== null && h["content-type"] === undefined) h["content-type"] = contentType;
  if (admin) h.authorization = `Bearer ${ADMIN_TOKEN}`;
  const payload = body === undefined ? undefined : typeof body === "string" || Buffer.isBuffer(body) ? body : JSON.stringify(body);
  const r = await gw.fetch(path, { method, headers: h, body: payload });
  return { status: r.status, headers: r.headers, text: await r.text() };
}

/** Asserts the right status and an OpenAI-style JSON error body; returns the error object. */
function assertOpenAIError(r, status, { code, param } = {}, label = "") {
  const where = `${label} -> ${r.status} ${r.text.slice(0, 300)}`;
  assert.notEqual(r.status, 500, `a 500: ${where}`);
  assert.equal(r.status, status, `wrong status: ${where}`);
  assert.match(r.headers.get("content-type") ?? "", /^application\/json/, `not JSON: ${where}`);
  let json;
  try { json = JSON.parse(r.text); } catch { assert.fail(`body is not JSON: ${where}`); }
  const e = json.error;
  assert.ok(e && typeof e === "object", `no error object: ${where}`);
  assert.equal(typeof e.message, "string", where);
  assert.ok(e.message.length > 0, where);
  assert.equal(typeof e.type, "string", where);
  assert.ok("param" in e && "code" in e, `error lacks param/code: ${where}`);
  if (code !== undefined) assert.equal(e.code, code, `code: ${where}`);
  if (param !== undefined) assert.equal(e.param, param, `param: ${where}`);
  assert.ok(FRESH_ID.test(r.headers.get("x-request-id") ?? ""), `x-request-id: ${r.headers.get("x-request-id")}`);
  return e;
}

// ---- The OpenAI surface ------------------------------------------------------------------------

const CHAT = "/v1/chat/completions";
const COMPLETIONS = "/v1/completions";
const EMBEDDINGS = "/v1/embeddings";

/** [name, request, status, {code, param}] */
const openaiCases = [
  ["malformed JSON", { path: CHAT, body: "{model: bad-input-model}" }, 400],
  ["truncated JSON", { path: CHAT, body: JSON.stringify(chatBody()).slice(0, 40) }, 400],
  ["empty body", { path: CHAT, body: "" }, 400],
  ["no body at all", { path: CHAT }, 400],
  ["JSON array body", { path: CHAT, body: "[1,2,3]" }, 400],
  ["JSON string body", { path: CHAT, body: '"hello"' }, 400],
  ["JSON null body", { path: CHAT, body: "null" }, 400],
  ["trailing garbage after the JSON", { path: CHAT, body: JSON.stringify(chatBody()) + "}{" }, 400],
  ["model: 5", { path: CHAT, body: chatBody({ model: 5 }) }, 400, { param: "model" }],
  ["model: empty string", { path: CHAT, body: chatBody({ model: "" }) }, 400, { param: "model" }],
  ["model missing", { path: CHAT, body: { messages: [{ role: "user", content: "x" }] } }, 400, { param: "model" }],
  ["model: object", { path: CHAT, body: chatBody({ model: { a: 1 } }) }, 400, { param: "model" }],
  ["messages: \"x\"", { path: CHAT, body: chatBody({ messages: "x" }) }, 400, { param: "messages" }],
  ["messages: [1]", { path: CHAT, body: chatBody({ messages: [1] }) }, 400, { param: "messages" }],
  ["messages: []", { path: CHAT, body: chatBody({ messages: [] }) }, 400, { param: "messages" }],
  ["messages missing", { path: CHAT, body: { model: MODEL } }, 400, { param: "messages" }],
  ["messages: [{role: 5}]", { path: CHAT, body: chatBody({ messages: [{ role: 5, content: "x" }] }) }, 400, { param: "messages" }],
  ["message content: 5", { path: CHAT, body: chatBody({ messages: [{ role: "user", content: 5 }] }) }, 400, { param: "messages" }],
  ["message content parts: [1]", { path: CHAT, body: chatBody({ messages: [{ role: "user", content: [1] }] }) }, 400, { param: "messages" }],
  ["chat with only a prompt", { path: CHAT, body: { model: MODEL, prompt: "x" } }, 400, { param: "messages" }],
  ["tools: {}", { path: CHAT, body: chatBody({ tools: {} }) }, 400, { param: "tools" }],
  ["stream: \"yes\"", { path: CHAT, body: chatBody({ stream: "yes" }) }, 400, { param: "stream" }],
  ["max_tokens: -1", { path: CHAT, body: chatBody({ max_tokens: -1 }) }, 400, { param: "max_tokens" }],
  ["max_tokens: 1e30", { path: CHAT, body: JSON.stringify(chatBody()).replace('"max_tokens":2', '"max_tokens":1e30') }, 400, { param: "max_tokens" }],
  ["max_tokens: \"ten\"", { path: CHAT, body: chatBody({ max_tokens: "ten" }) }, 400, { param: "max_tokens" }],
  ["max_tokens: 1.5", { path: CHAT, body: chatBody({ max_tokens: 1.5 }) }, 400, { param: "max_tokens" }],
  ["max_tokens: true", { path: CHAT, body: chatBody({ max_tokens: true }) }, 400, { param: "max_tokens" }],
  ["max_tokens: 2^53", { path: CHAT, body: chatBody({ max_tokens: 2 ** 53 }) }, 400, { param: "max_tokens" }],
  ["max_completion_tokens: -5", { path: CHAT, body: chatBody({ max_completion_tokens: -5 }) }, 400, { param: "max_completion_tokens" }],
  ["prompt: {}", { path: COMPLETIONS, body: { model: MODEL, prompt: {} } }, 400, { param: "prompt" }],
  ["prompt: []", { path: COMPLETIONS, body: { model: MODEL, prompt: [] } }, 400, { param: "prompt" }],
  ["prompt: [-1] (token ids)", { path: COMPLETIONS, body: { model: MODEL, prompt: [-1] } }, 400, { param: "prompt" }],
  ["prompt: [[{}]]", { path: COMPLETIONS, body: { model: MODEL, prompt: [[{}]] } }, 400, { param: "prompt" }],
  ["prompt: [\"a\", 1] (mixed)", { path: COMPLETIONS, body: { model: MODEL, prompt: ["a", 1] } }, 400, { param: "prompt" }],
  ["completions with messages instead of prompt", { path: COMPLETIONS, body: chatBody() }, 400, { param: "prompt" }],
  ["completions max_tokens: -1", { path: COMPLETIONS, body: { model: MODEL, prompt: "x", max_tokens: -1 } }, 400, { param: "max_tokens" }],
  ["embeddings input: {}", { path: EMBEDDINGS, body: { model: MODEL, input: {} } }, 400, { param: "input" }],
  ["embeddings input missing", { path: EMBEDDINGS, body: { model: MODEL } }, 400, { param: "input" }],
  ["embeddings model: 5", { path: EMBEDDINGS, body: { model: 5, input: "x" } }, 400, { param: "model" }],
  ["10,000 nested arrays in an extra field", { path: CHAT, body: JSON.stringify(chatBody()).slice(0, -1) + ',"x":' + nestedArrays(10000) + "}" }, 400],
  ["10,000 nested arrays as messages", { path: CHAT, body: `{"model":"${MODEL}","messages":${nestedArrays(10000)}}` }, 400],
  ["10,000 nested objects", { path: CHAT, body: JSON.stringify(chatBody()).slice(0, -1) + ',"x":' + nestedObjects(10000) + "}" }, 400],
  ["100,000 nested arrays as the whole body", { path: CHAT, body: nestedArrays(100000) }, 400],
  ["10,000 nested arrays as a prompt", { path: COMPLETIONS, body: `{"model":"${MODEL}","prompt":${nestedArrays(10000)}}` }, 400],
  ["invalid UTF-8 inside a string", { path: CHAT, body: bytes(`{"model":"${MODEL}","messages":[{"role":"user","content":"`, [0xff, 0xfe, 0xc3], '"}]}') }, 400],
  ["invalid UTF-8 outside strings", { path: CHAT, body: bytes(`{"model":"${MODEL}",`, [0xc0, 0xaf], `"messages":[]}`) }, 400],
  ["truncated UTF-8 sequence at the end", { path: CHAT, body: bytes(`{"model":"${MODEL}","messages":[{"role":"user","content":"\u00e9`, [0xe2, 0x82]) }, 400],
  ["lone surrogate escape", { path: CHAT, body: `{"model":"${MODEL}","messages":[{"role":"user","content":"\\ud800"}]}` }, 400],
  ["unknown model", { path: CHAT, body: chatBody({ model: "no-such-model" }) }, 404, { code: "model_not_found", param: "model" }],
  ["body over MAX_BODY_BYTES (content-length)", { path: CHAT, body: JSON.stringify(chatBody({ pad: "x".repeat(MAX_BODY_BYTES + 10) })) }, 413, { code: "payload_too_large" }],
  ["body far over MAX_BODY_BYTES (8 MiB)", { path: CHAT, body: JSON.stringify(chatBody({ pad: "x".repeat(8 * MAX_BODY_BYTES) })) }, 413, { code: "payload_too_large" }],
  ["embeddings body over MAX_BODY_BYTES", { path: EMBEDDINGS, body: JSON.stringify({ model: MODEL, input: "x".repeat(MAX_BODY_BYTES + 1) }) }, 413, { code: "payload_too_large" }],
  ["GET on /v1/chat/completions", { method: "GET", path: CHAT }, 405, { code: "method_not_allowed" }],
  ["PUT on /v1/completions", { method: "PUT", path: COMPLETIONS, body: "{}" }, 405, { code: "method_not_allowed" }],
  ["POST on /v1/models", { path: "/v1/models", body: "{}" }, 405, { code: "method_not_allowed" }],
  ["unknown route", { path: "/v1/chat/completions/../../etc/passwd", body: "{}" }, 404],
  ["unknown route with encoded traversal", { path: "/v1/..%2F..%2Fadmin%2Fbackends", body: "{}" }, 404],
];

for (const [name, req, status, expect = {}] of openaiCases) {
  test(`OpenAI surface: ${name} -> ${status}`, async () => {
    const r = await send(req);
    assertOpenAIError(r, status, expect, `${req.method ?? "POST"} ${req.path} (${name})`);
  });
}

test("OpenAI surface: a body over MAX_BODY_BYTES without content-length (chunked) -> 413", async () => {
  const payload = new TextEncoder().encode(JSON.stringify(chatBody({ pad: "y".repeat(MAX_BODY_BYTES + 100) })));
  let offset = 0;
  const stream = new ReadableStream({
    pull(c) {
      if (offset >= payload.length) return c.close();
      c.enqueue(payload.slice(offset, offset + 65536));
      offset += 65536;
    },
  });
  const resp = await fetch(gw.url + CHAT, { method: "POST", headers: { "content-type": "application/json" }, body: stream, duplex: "half" });
  const r = { status: resp.status, headers: resp.headers, text: await resp.text() };
  assertOpenAIError(r, 413, { code: "payload_too_large" }, "chunked 1 MiB + 100 bytes");
});

test("OpenAI surface: a body of exactly MAX_BODY_BYTES is accepted", async () => {
  const base = JSON.stringify(chatBody({ pad: "" }));
  const body = base.replace('"pad":""', `"pad":"${"z".repeat(MAX_BODY_BYTES - base.length)}"`);
  assert.equal(Buffer.byteLength(body), MAX_BODY_BYTES);
  const r = await send({ path: CHAT, body });
  assert.equal(r.status, 200, r.text.slice(0, 300));
});

test("OpenAI surface: a content-length that lies (larger than the body) is not a 500", async () => {
  const body = JSON.stringify(chatBody());
  const raw = `POST ${CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${body.length + 50}\r\n\r\n${body}`;
  const r = await rawHttp(port, Buffer.from(raw), { timeoutMs: 3000 });
  // The platform waits for the rest of the body, then gives up; it must not be a 500 from the gateway.
  assert.notEqual(r.status, 500, r.head);
});

test("content type is not enforced: a JSON body is served as text/plain, form-encoded or without a type", async () => {
  for (const contentType of ["text/plain", "application/x-www-form-urlencoded", "application/octet-stream", null]) {
    const r = await send({ path: CHAT, body: chatBody(), contentType });
    assert.equal(r.status, 200, `${contentType}: ${r.text.slice(0, 200)}`);
    assert.equal(JSON.parse(r.text).object, "chat.completion");
  }
  // ...but a body that is not JSON is a 400 whatever the content type says.
  const form = await send({ path: CHAT, body: "model=x&messages=y", contentType: "application/x-www-form-urlencoded" });
  assertOpenAIError(form, 400, {}, "form-encoded fields");
});

test("a 32 KiB header the platform accepts is handled (served, or a JSON 4xx)", async () => {
  const r = await send({ path: CHAT, body: chatBody(), headers: { "x-padding": "p".repeat(32 * 1024) } });
  if (r.status !== 200) assertOpenAIError(r, r.status, {}, "32 KiB header");
});

test("150 headers, which the platform accepts, are handled (served, or a JSON 4xx)", async () => {
  const headers = {};
  for (let i = 0; i < 150; i++) headers[`x-extra-${i}`] = `v${i}`;
  const r = await send({ path: CHAT, body: chatBody(), headers });
  if (r.status !== 200) {
    assert.ok(r.status >= 400 && r.status < 500, `${r.status} ${r.text}`);
    assertOpenAIError(r, r.status, {}, "150 headers");
  }
});

test("a header block over the platform's limit is refused with 431/400 before the Worker, never a 500", async () => {
  for (const size of [200 * 1024, 2 * 1024 * 1024]) {
    const raw = `GET /healthz HTTP/1.1\r\nHost: x\r\nx-padding: ${"p".repeat(size)}\r\n\r\n`;
    const r = await rawHttp(port, Buffer.from(raw), { timeoutMs: 5000 });
    assert.ok(!r.timedOut, `${size}: the connection hung`);
    // The platform answers 431 and resets the connection; the reset can race the answer (a reset
    // discards what the client had not read yet), so a reset without an answer is accepted too.
    if (r.status === null) assert.ok(["ECONNRESET", "EPIPE"].includes(r.error), `${size}: no answer, ${r.error}`);
    else assert.ok([400, 431].includes(r.status), `${size}: ${r.status} ${r.head.slice(0, 200)}`);
  }
});

// ---- x-request-id ------------------------------------------------------------------------------

const rawGet = (headerLines) => Buffer.concat([Buffer.from("GET /healthz HTTP/1.1\r\nHost: x\r\n"), Buffer.isBuffer(headerLines) ? headerLines : Buffer.from(headerLines, "latin1"), Buffer.from("\r\n")]);

test("x-request-id: a safe id is echoed, an unsafe one is replaced by a fresh one", async () => {
  const cases = [
    ["ok-id_1.2:3@x/y+z=", "echo"],
    ["a".repeat(128), "echo"],
    ["a".repeat(129), "fresh"],
    ["x".repeat(8000), "fresh"],
    ["with space", "fresh"],
    ["<script>alert(1)</script>", "fresh"],
    ["a%0D%0Ax-evil:%201", "fresh"],
    ["quote\"d", "fresh"],
    ["semi;colon", "fresh"],
    ["", "fresh"],
  ];
  for (const [id, want] of cases) {
    for (const path of ["/healthz", CHAT]) {
      const r = path === CHAT
        ? await send({ path, body: chatBody(), headers: { "x-request-id": id } })
        : await send({ method: "GET", path, headers: { "x-request-id": id }, contentType: null });
      const echoed = r.headers.get("x-request-id");
      assert.equal(r.status, 200, `${path} ${JSON.stringify(id.slice(0, 40))}: ${r.status}`);
      if (want === "echo") assert.equal(echoed, id);
      else assert.match(echoed ?? "", FRESH_ID, `${path} ${JSON.stringify(id.slice(0, 40))} echoed as ${echoed?.slice(0, 60)}`);
      if (path === CHAT) {
        const completion = JSON.parse(r.text);
        if (want === "fresh") assert.ok(!completion.id.includes("script") && !completion.id.includes("evil"), completion.id);
      }
    }
  }
});

test("x-request-id: CR/LF, NUL, obs-fold and non-ASCII bytes cannot inject a header or reach the response raw", async () => {
  const cases = [
    ["CRLF then a header", "x-request-id: a\r\nx-evil: 1\r\n"],
    ["bare LF then a header", "x-request-id: a\nx-evil: 1\r\n"],
    ["bare CR", "x-request-id: a\rx-evil: 1\r\n"],
    ["NUL", "x-request-id: a\x00x-evil\r\n"],
    ["obs-fold continuation", "x-request-id: a\r\n x-evil: 1\r\n"],
    ["tab inside", "x-request-id: a\tx-evil\r\n"],
    ["UTF-8 bytes", Buffer.from("x-request-id: r\u00e9q-\u00fc-\u4e2d\r\n", "utf8")],
    ["Latin-1 bytes", Buffer.from([...Buffer.from("x-request-id: r"), 0xe9, 0xff, ...Buffer.from("q\r\n")])],
    ["two x-request-id headers", "x-request-id: one\r\nx-request-id: two\r\n"],
  ];
  for (const [name, line] of cases) {
    const r = await rawHttp(port, rawGet(line), { timeoutMs: 5000 });
    assert.ok(!r.timedOut, `${name}: no answer`);
    assert.ok(r.status !== null && r.status !== 500, `${name}: ${r.status} ${r.head}`);
    assert.ok(!("x-evil" in r.headers), `${name}: injected header reached the response: ${r.head}`);
    const id = r.headers["x-request-id"];
    if (r.status === 200) {
      assert.ok(id !== undefined, `${name}: no x-request-id`);
      assert.match(id, SAFE_ID, `${name}: unsafe id echoed: ${JSON.stringify(id)}`);
      assert.ok(!/evil/.test(id), `${name}: ${id}`);
    } else {
      assert.ok([400, 431].includes(r.status), `${name}: ${r.status}`); // refused by the platform
    }
  }
});

// ---- The admin API -----------------------------------------------------------------------------

const adminCases = [
  ["GET /admin/backends/..%2F..%2Fetc", { method: "GET", path: "/admin/backends/..%2F..%2Fetc" }, 400, { param: "id" }],
  ["PATCH /admin/backends/..%2F..%2Fetc", { method: "PATCH", path: "/admin/backends/..%2F..%2Fetc", body: { weight: 2 } }, 400, { param: "id" }],
  ["DELETE /admin/backends/..%2F..%2Fetc?force=true", { method: "DELETE", path: "/admin/backends/..%2F..%2Fetc?force=true" }, 400, { param: "id" }],
  ["GET /admin/backends/a%20b (space)", { method: "GET", path: "/admin/backends/a%20b" }, 400, { param: "id" }],
  ["GET /admin/backends/bi-0%2Fx", { method: "GET", path: "/admin/backends/bi-0%2Fx" }, 400, { param: "id" }],
  ["GET /admin/backends/%00", { method: "GET", path: "/admin/backends/%00" }, 400, { param: "id" }],
  ["GET /admin/backends/%C3%A9 (non-ASCII)", { method: "GET", path: "/admin/backends/%C3%A9" }, 400, { param: "id" }],
  ["GET /admin/backends/<200 chars>", { method: "GET", path: `/admin/backends/${"a".repeat(200)}` }, 400, { param: "id" }],
  ["GET /admin/backends/%2e%2e (normalised away)", { method: "GET", path: "/admin/backends/%2e%2e" }, 404],
  ["GET /admin/backends/bi-0/extra", { method: "GET", path: "/admin/backends/bi-0/extra" }, 404],
  ["GET /admin/backends/no-such-backend", { method: "GET", path: "/admin/backends/no-such-backend" }, 404],
  ["GET /admin/pools/..%2Fx", { method: "GET", path: "/admin/pools/..%2Fx" }, 400, { param: "pool" }],
  ["PUT /admin/pools/a%20b", { method: "PUT", path: "/admin/pools/a%20b", body: {} }, 400, { param: "pool" }],
  // A knob sent where no knob is (here at the top level, not under `predicted_latency`) is refused by its path,
  // not dropped with the pool left on defaults.
  ["PUT /admin/pools knob at the wrong level", { method: "PUT", path: "/admin/pools/bi", body: { tail_harm_weight: 0.5 } }, 400, { param: "tail_harm_weight" }],
  ["PUT /admin/pools misspelt nested knob", { method: "PUT", path: "/admin/pools/bi", body: { predicted_latency: { tail_harm: 0.5 } } }, 400, { param: "predicted_latency.tail_harm" }],
  ["POST /admin/pools/..%2Fbi/probe", { method: "POST", path: "/admin/pools/..%2Fbi/probe" }, 400, { param: "pool" }],
  ["DELETE /admin/keys/..%2F..%2Fx", { method: "DELETE", path: "/admin/keys/..%2F..%2Fx" }, 400, { param: "id" }],
  ["POST id with a space", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", id: "a b" } }, 400, { param: "id" }],
  ["POST id with a slash", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", id: "a/b" } }, 400, { param: "id" }],
  ["POST id ../x", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", id: "../x" } }, 400, { param: "id" }],
  ["POST id ..", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", id: ".." } }, 400, { param: "id" }],
  ["POST id with CR/LF", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", id: "a\r\nb" } }, 400, { param: "id" }],
  ["POST id with a quote", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", id: 'a"b' } }, 400, { param: "id" }],
  ["POST id empty", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", id: "" } }, 400, { param: "id" }],
  ["POST id 200 chars", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", id: "i".repeat(200) } }, 400, { param: "id" }],
  ["POST id: 5", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", id: 5 } }, 400],
  ["POST pool with a space", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", pool: "p q" } }, 400, { param: "pool" }],
  ["POST pool ../p", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", pool: "../p" } }, 400, { param: "pool" }],
  ["POST region with a slash", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", region: "a/b" } }, 400, { param: "region" }],
  ["POST url: 5", { path: "/admin/backends", body: { url: 5 } }, 400],
  ["POST url missing", { path: "/admin/backends", body: { id: "x" } }, 400],
  ["POST url file:///etc/passwd", { path: "/admin/backends", body: { url: "file:///etc/passwd" } }, 400, { param: "url" }],
  ["POST url javascript:", { path: "/admin/backends", body: { url: "javascript:alert(1)" } }, 400, { param: "url" }],
  ["POST url with credentials", { path: "/admin/backends", body: { url: "http://user:pw@127.0.0.1:1" } }, 400, { param: "url" }],
  ["POST url with a query", { path: "/admin/backends", body: { url: "http://127.0.0.1:1/?a=b" } }, 400, { param: "url" }],
  ["POST url relative", { path: "/admin/backends", body: { url: "/v1" } }, 400, { param: "url" }],
  ["POST unknown field", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", admin: true } }, 400],
  ["POST weight: -1", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", weight: -1 } }, 400],
  ["POST weight: 1e30", { path: "/admin/backends", body: JSON.stringify({ url: "http://127.0.0.1:1", weight: 1 }).replace('"weight":1', '"weight":1e30') }, 400],
  ["POST weight: \"x\"", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", weight: "x" } }, 400],
  ["POST role: admin", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", role: "admin" } }, 400, { param: "role" }],
  ["POST models: \"m\" (not a list)", { path: "/admin/backends", body: { url: "http://127.0.0.1:1", models: "m" } }, 400],
  ["POST models with control characters", { path: "/admin/backends", body: { url: "http://127.0.0.1:2", models: ["a\nb\u0000c"] } }, 400, { param: "models" }],
  ["POST truncated JSON", { path: "/admin/backends", body: '{"url": "http://127.0.0.1:1"' }, 400],
  ["POST malformed JSON", { path: "/admin/backends", body: "{url: x}" }, 400],
  ["POST empty body", { path: "/admin/backends", body: "" }, 400],
  ["POST JSON array", { path: "/admin/backends", body: "[]" }, 400],
  ["POST 10,000 nested arrays", { path: "/admin/backends", body: nestedArrays(10000) }, 400],
  ["POST nested in a field", { path: "/admin/backends", body: `{"url":"http://127.0.0.1:1","models":${nestedArrays(10000)}}` }, 400],
  ["POST invalid UTF-8", { path: "/admin/backends", body: bytes('{"url":"http://127.0.0.1:1","id":"a', [0xff, 0xfe], '"}') }, 400],
  ["POST body over MAX_BODY_BYTES", { path: "/admin/backends", body: JSON.stringify({ url: "http://127.0.0.1:3", pool: "huge", models: ["m".repeat(MAX_BODY_BYTES + 10)] }) }, 413, { code: "payload_too_large" }],
  ["PUT pool body over MAX_BODY_BYTES", { method: "PUT", path: "/admin/pools/huge-config", body: JSON.stringify({ policy: "round_robin", region: "r".repeat(MAX_BODY_BYTES + 10) }) }, 413, { code: "payload_too_large" }],
  ["PATCH body over MAX_BODY_BYTES", { method: "PATCH", path: "/admin/backends/bi-1", body: JSON.stringify({ models: ["m".repeat(MAX_BODY_BYTES + 10)] }) }, 413, { code: "payload_too_large" }],
  ["POST key body over MAX_BODY_BYTES", { path: "/admin/keys", body: JSON.stringify({ name: "n".repeat(MAX_BODY_BYTES + 10) }) }, 413, { code: "payload_too_large" }],
  ["PUT pool policy: 5", { method: "PUT", path: "/admin/pools/bad-config", body: { policy: 5 } }, 400],
  ["PUT pool policy: nope", { method: "PUT", path: "/admin/pools/bad-config", body: { policy: "nope" } }, 400],
  ["PUT pool failure_threshold: -1", { method: "PUT", path: "/admin/pools/bad-config", body: { breaker: { failure_threshold: -1 } } }, 400],
  ["PUT pool failure_threshold: 0", { method: "PUT", path: "/admin/pools/bad-config", body: { breaker: { failure_threshold: 0 } } }, 400],
  ["PUT pool probe_interval_ms: 1", { method: "PUT", path: "/admin/pools/bad-config", body: { probe_interval_ms: 1 } }, 400],
  ["PUT pool jitter_ratio: 7", { method: "PUT", path: "/admin/pools/bad-config", body: { breaker: { jitter_ratio: 7 } } }, 400],
  ["PUT pool region with a slash and a newline", { method: "PUT", path: "/admin/pools/bad-config", body: { region: "eu/west\n" } }, 400, { param: "region" }],
  ["PUT pool truncated JSON", { method: "PUT", path: "/admin/pools/bad-config", body: '{"policy":' }, 400],
  ["PUT pool 10,000 nested arrays", { method: "PUT", path: "/admin/pools/bad-config", body: `{"policy":"round_robin","x":${nestedArrays(10000)}}` }, 400],
  ["PUT pool invalid UTF-8", { method: "PUT", path: "/admin/pools/bad-config", body: bytes('{"region":"', [0xc3, 0x28], '"}') }, 400],
  ["PATCH weight: \"x\"", { method: "PATCH", path: "/admin/backends/bi-1", body: { weight: "x" } }, 400],
  ["PATCH url ftp://", { method: "PATCH", path: "/admin/backends/bi-1", body: { url: "ftp://127.0.0.1" } }, 400, { param: "url" }],
  ["PATCH truncated JSON", { method: "PATCH", path: "/admin/backends/bi-1", body: '{"weight":' }, 400],
  ["PATCH 10,000 nested objects", { method: "PATCH", path: "/admin/backends/bi-1", body: nestedObjects(10000) }, 400],
  ["POST key name 200 chars", { path: "/admin/keys", body: { name: "n".repeat(200) } }, 400, { param: "name" }],
  ["POST key 10,000 nested arrays", { path: "/admin/keys", body: nestedArrays(10000) }, 400],
  ["POST key unknown field", { path: "/admin/keys", body: { name: "k", scope: "admin" } }, 400],
  ["DELETE /admin/pools/bi (no such method)", { method: "DELETE", path: "/admin/pools/bi" }, 405, { code: "method_not_allowed" }],
  ["unknown admin route", { method: "GET", path: "/admin/secrets" }, 404],
];

for (const [name, req, status, expect = {}] of adminCases) {
  test(`admin API: ${name} -> ${status}`, async () => {
    const r = await send({ ...req, admin: true });
    assertOpenAIError(r, status, expect, `${req.method ?? "POST"} ${req.path.slice(0, 80)} (${name})`);
  });
}

test("admin API: a wrong, missing or oversized token is 401, never a 500", async () => {
  for (const authorization of [undefined, "Bearer wrong", "Basic abc", `Bearer ${ADMIN_TOKEN}x`, `Bearer ${"t".repeat(10000)}`, "Bearer"]) {
    const headers = authorization ? { authorization } : {};
    const r = await send({ method: "GET", path: "/admin/backends", headers, contentType: null });
    assertOpenAIError(r, 401, { code: "invalid_api_key" }, `authorization ${String(authorization).slice(0, 30)}`);
  }
});

test("admin API: form-encoded content type (what `curl -d` sends) is accepted for a JSON body", async () => {
  const r = await send({ path: "/admin/pools/form-pool", method: "PUT", body: { policy: "least_load" }, admin: true, contentType: "application/x-www-form-urlencoded" });
  assert.equal(r.status, 200, r.text);
});

// ---- Afterwards --------------------------------------------------------------------------------

test("after the corpus the gateway still serves and its state is intact", async () => {
  // The registered backends are still there and healthy (whether a bad registration slipped
  // through is each case's own assertion).
  const list = (await (await gw.admin("/admin/backends")).json()).data;
  const ours = list.filter((b) => b.pool === "bi");
  assert.deepEqual(ours.map((b) => b.id).sort(), ["bi-0", "bi-1"], "the registry changed");
  for (const b of ours) assert.equal(b.health, "healthy");
  const state = await (await gw.admin("/admin/pools/bi")).json();
  assert.equal(state.policy, "round_robin");
  // The pool's in-memory state was not reset by a panic (its probe counter only grows).
  assert.ok(state.probe_rounds >= probeRoundsBefore, `probe_rounds ${state.probe_rounds} < ${probeRoundsBefore}`);
  // Valid requests of every kind are still served.
  const plain = await send({ path: CHAT, body: chatBody() });
  assert.equal(plain.status, 200, plain.text);
  const streamed = await send({ path: CHAT, body: chatBody({ stream: true }) });
  assert.equal(streamed.status, 200);
  assert.ok(streamed.text.trimEnd().endsWith("data: [DONE]"));
  const completion = await send({ path: COMPLETIONS, body: { model: MODEL, prompt: "once upon", max_tokens: 2 } });
  assert.equal(completion.status, 200, completion.text);
  // A chat model's vLLM has no embeddings route: the client's clear 404, no backend blamed.
  const emb = await send({ path: EMBEDDINGS, body: { model: MODEL, input: "x" } });
  assert.equal(emb.status, 404, emb.text);
  assert.equal(JSON.parse(emb.text).error.code, "model_does_not_support_endpoint");
  const models = JSON.parse((await send({ method: "GET", path: "/v1/models", contentType: null })).text);
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
  await waitFor(async () => (await (await gw.admin("/admin/pools/bi")).json()).in_flight === 0, { timeoutMs: 5000, what: "leases back to zero" });
});
