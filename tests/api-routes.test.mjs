// The pass-through routes by model (issue 43) through the built Worker in workerd, against real
// vllm-sim processes serving vLLM 0.34's routes by task: tokenize/detokenize, rerank (three paths),
// score (two), classify, pooling, audio transcriptions (multipart, whole and streamed); a chat-only
// pool asked to rerank answers a clear 400 without opening a breaker; a LoRA adapter is listed in
// /v1/models with its parent and root and served only by the backend that has it loaded.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { startGateway, startSim, waitReady } from "./lib/harness.mjs";

let gw;
const sims = [];
const ids = {};

async function sim(args) {
  const s = await startSim(["--time-scale", "50", ...args]);
  sims.push(s);
  return s;
}

async function register(s, pool, models, id) {
  const r = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool, models, id } });
  assert.equal(r.status, 201, await r.text());
  await waitReady(gw, id);
  ids[id] = true;
}

before(async () => {
  gw = await startGateway({ bindings: { PROBE_INTERVAL_MS: "300" } });
  await gw.admin("/admin/pools/api-chat", { method: "PUT", body: { policy: "round_robin" } });
  const [chatA, chatB, rr, emb, whisper] = await Promise.all([
    sim(["--model", "chat-m", "--lora-modules", "sql-lora=/loras/sql", "--seed", "1"]),
    sim(["--model", "chat-m", "--seed", "2"]),
    sim(["--model", "rr-m", "--task", "classify"]),
    sim(["--model", "emb-m", "--task", "embed"]),
    sim(["--model", "whisper-m", "--task", "transcription"]),
  ]);
  await register(chatA, "api-chat", ["chat-m"], "chat-a");
  await register(chatB, "api-chat", ["chat-m"], "chat-b");
  await register(rr, "api-rr", ["rr-m"], "rr-a");
  await register(emb, "api-emb", ["emb-m"], "emb-a");
  await register(whisper, "api-audio", ["whisper-m"], "whisper-a");
});

after(async () => {
  await Promise.all(sims.map((s) => s.close()));
  await gw?.close();
});

async function post(path, body) {
  const r = await gw.fetch(path, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) });
  const text = await r.text();
  let json;
  try { json = JSON.parse(text); } catch { json = null; }
  return { status: r.status, backend: r.headers.get("x-gateway-backend"), text, json };
}

function wav(seconds) {
  const rate = 16000, data = 32000 * seconds;
  const b = Buffer.alloc(44 + data);
  b.write("RIFF", 0); b.writeUInt32LE(36 + data, 4); b.write("WAVEfmt ", 8);
  b.writeUInt32LE(16, 16); b.writeUInt16LE(1, 20); b.writeUInt16LE(1, 22);
  b.writeUInt32LE(rate, 24); b.writeUInt32LE(rate * 2, 28); b.writeUInt16LE(2, 32); b.writeUInt16LE(16, 34);
  b.write("data", 36); b.writeUInt32LE(data, 40);
  return b;
}

test("tokenize and detokenize go to a backend serving the model", async () => {
  const t = await post("/tokenize", { model: "chat-m", prompt: "hello gateway!" });
  assert.equal(t.status, 200, t.text);
  assert.equal(t.json.count, 4);
  assert.ok(["chat-a", "chat-b"].includes(t.backend));
  const d = await post("/detokenize", { model: "chat-m", tokens: t.json.tokens });
  assert.equal(d.status, 200, d.text);
  assert.equal(d.json.prompt, "hello gateway!");
  const missing = await post("/tokenize", { prompt: "x" });
  assert.equal(missing.status, 400);
  assert.equal(missing.json.error.param, "model");
  const unknown = await post("/tokenize", { model: "no-such-model", prompt: "x" });
  assert.equal(unknown.status, 404, unknown.text);
});

test("rerank on its three paths, score on its two, classify and pooling, with usage", async () => {
  const docs = ["bananas are yellow", "Paris is the capital of France", "the sky is blue"];
  for (const path of ["/v1/rerank", "/rerank", "/v2/rerank"]) {
    const r = await post(path, { model: "rr-m", query: "capital of France", documents: docs, top_n: 2 });
    assert.equal(r.status, 200, `${path}: ${r.text}`);
    assert.equal(r.backend, "rr-a");
    assert.equal(r.json.results.length, 2);
    assert.equal(r.json.results[0].index, 1);
    assert.ok(r.json.usage.prompt_tokens > 0);
  }
  for (const path of ["/v1/score", "/score"]) {
    const s = await post(path, { model: "rr-m", queries: "q", documents: ["a", "b"] });
    assert.equal(s.status, 200, s.text);
    assert.equal(s.json.data.length, 2);
    assert.equal(s.json.usage.prompt_tokens, 4);
  }
  const c = await post("/classify", { model: "rr-m", input: ["good", "bad"] });
  assert.equal(c.status, 200, c.text);
  assert.equal(c.json.data.length, 2);
  const p = await post("/pooling", { model: "emb-m", input: "pool me" });
  assert.equal(p.status, 200, p.text);
  assert.equal(p.backend, "emb-a");
  assert.equal(p.json.data[0].object, "pooling");
  const bad = await post("/v1/rerank", { model: "rr-m", query: "q" });
  assert.equal(bad.status, 400);
  assert.equal(bad.json.error.param, "documents");
});

test("a chat-only pool asked to rerank answers a clear 404 and opens no breaker", async () => {
  for (let i = 0; i < 8; i++) {
    const r = await post("/v1/rerank", { model: "chat-m", query: `q${i}`, documents: ["d"] });
    assert.equal(r.status, 404, r.text);
    assert.equal(r.json.error.code, "model_does_not_support_endpoint");
    assert.match(r.json.error.message, /chat-m/);
    assert.match(r.json.error.message, /\/v1\/rerank/);
  }
  for (const id of ["chat-a", "chat-b"]) {
    const b = await (await gw.admin(`/admin/backends/${id}`)).json();
    assert.equal(b.health, "healthy", JSON.stringify(b));
    assert.equal(b.breaker, "closed", JSON.stringify(b));
    assert.equal(b.leases_in_flight, 0);
  }
  // The same backends still serve chat.
  const chat = await post("/v1/chat/completions", { model: "chat-m", max_tokens: 2, messages: [{ role: "user", content: "hi" }] });
  assert.equal(chat.status, 200, chat.text);
});

// A multipart/form-data request as an SDK builds it (Miniflare's dispatchFetch does not encode
// Node's FormData, so the body is built here).
function form(fields, file) {
  const boundary = "----gatewaytest7MA4YWxk";
  const parts = Object.entries(fields).map(([k, v]) => Buffer.from(`--${boundary}\r\nContent-Disposition: form-data; name="${k}"\r\n\r\n${v}\r\n`));
  if (file) {
    parts.push(Buffer.from(`--${boundary}\r\nContent-Disposition: form-data; name="file"; filename="clip.wav"\r\nContent-Type: audio/wav\r\n\r\n`), file, Buffer.from("\r\n"));
  }
  parts.push(Buffer.from(`--${boundary}--\r\n`));
  return { method: "POST", headers: { "content-type": `multipart/form-data; boundary=${boundary}` }, body: Buffer.concat(parts) };
}

test("audio transcriptions: a multipart WAV routed by its model field, whole and streamed", async () => {
  const r = await gw.fetch("/v1/audio/transcriptions", form({ model: "whisper-m" }, wav(2)));
  const text = await r.text();
  assert.equal(r.status, 200, text);
  assert.equal(r.headers.get("x-gateway-backend"), "whisper-a");
  const v = JSON.parse(text);
  assert.ok(v.text.length > 0);
  assert.deepEqual(v.usage, { type: "duration", seconds: 2 });
  const t = await gw.fetch("/v1/audio/translations", form({ model: "whisper-m" }, wav(2)));
  assert.equal(t.status, 200, await t.text());
  const s = await gw.fetch("/v1/audio/transcriptions", form({ model: "whisper-m", stream: "true", stream_include_usage: "true" }, wav(2)));
  assert.equal(s.status, 200);
  assert.match(s.headers.get("content-type"), /text\/event-stream/);
  const events = await s.text();
  assert.match(events, /transcription\.chunk/);
  assert.match(events, /"choices":\[\],/);
  assert.match(events, /data: \[DONE\]/);
  // No model field: the gateway's 400; a chat model: the route is not served.
  const missing = await gw.fetch("/v1/audio/transcriptions", form({}, wav(1)));
  assert.equal(missing.status, 400);
  assert.equal((await missing.json()).error.param, "model");
  const chat = await gw.fetch("/v1/audio/transcriptions", form({ model: "chat-m" }, wav(1)));
  assert.equal(chat.status, 404);
  assert.equal((await chat.json()).error.code, "model_does_not_support_endpoint");
  // Not a form at all.
  const json = await post("/v1/audio/transcriptions", { model: "whisper-m" });
  assert.equal(json.status, 400);
  assert.equal(json.json.error.param, "content-type");
});

test("a LoRA adapter is listed with parent and root and lands only on the backend that has it", async () => {
  const list = await (await gw.fetch("/v1/models")).json();
  const card = list.data.find((m) => m.id === "sql-lora");
  assert.ok(card, JSON.stringify(list));
  assert.equal(card.parent, "chat-m");
  assert.equal(card.root, "/loras/sql");
  assert.equal(list.data.find((m) => m.id === "chat-m").parent, undefined);
  for (let i = 0; i < 6; i++) {
    const r = await post("/v1/chat/completions", { model: "sql-lora", max_tokens: 2, messages: [{ role: "user", content: `sql ${i}` }] });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.backend, "chat-a");
  }
  const seen = new Set();
  for (let i = 0; i < 6; i++) seen.add((await post("/v1/chat/completions", { model: "chat-m", max_tokens: 2, messages: [{ role: "user", content: `base ${i}` }] })).backend);
  assert.equal(seen.size, 2, "the base model is served by both");
});
