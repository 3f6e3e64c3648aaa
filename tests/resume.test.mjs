// A stream survives its backend (issue 16): the built Worker in workerd (Miniflare, on a real
// 127.0.0.1 port) in front of real vllm-sim processes that drop streams after N tokens, stall, or
// are killed outright, read by the real OpenAI Node client. A resumable stream must deliver exactly
// the tokens asked for (`ignore_eos`), one role chunk, one finish, the same id/created/model on
// every chunk, no error, and one usage total; an unresumable one (or one past
// MAX_STREAM_RESUMES) must end with the error event; every lease ends on every backend.
import { test, before, after, afterEach } from "node:test";
import assert from "node:assert/strict";
import { isDeepStrictEqual } from "node:util";
import OpenAI from "openai";
import { startGatewayServer, startSim, waitFor, waitReady, parseMetrics, setFaults } from "./lib/harness.mjs";

const BINDINGS = {
  PROBE_INTERVAL_MS: "500",
  FIRST_BYTE_TIMEOUT_MS: "3000",
  STREAM_IDLE_TIMEOUT_MS: "1000",
};
// Enough retry budget that no resume is refused by it.
const ROOMY_BUDGET = { retry_budget: { ratio: 1.0, min_per_window: 1000, window_ms: 10000 } };

let gw;
let client;
const logs = [];
const closers = [];
let seq = 0;

before(async () => {
  gw = await startGatewayServer({ bindings: BINDINGS, onLog: (line) => logs.push(line) });
  client = new OpenAI({ baseURL: `${gw.url}/v1`, apiKey: "unused", maxRetries: 0 });
});

after(async () => {
  for (const close of closers.reverse()) await close();
  await gw?.close();
});

afterEach(async () => {
  // Every lease ends, on every backend the stream touched.
  await waitFor(async () => {
    const backends = (await (await gw.admin("/admin/backends")).json()).data;
    const pools = (await (await gw.admin("/admin/pools")).json()).data;
    const idle = backends.every((b) => b.leases_in_flight === 0) && pools.every((p) => p.in_flight === 0 && p.in_flight_tokens === 0);
    return idle ? backends : null;
  }, { timeoutMs: 5000, what: "every backend's leases back to zero" });
});

async function sim(model, args = []) {
  const scale = args.includes("--time-scale") ? [] : ["--time-scale", "20"];
  const s = await startSim(["--model", model, ...scale, ...args]);
  closers.push(s.close);
  return s;
}

/** A fresh pool serving a fresh model on `count` vllm-sim processes (with `args`), all ready. */
async function freshPool(count, args = []) {
  seq += 1;
  const name = `resume${seq}`;
  const model = `resume-model-${seq}`;
  const put = await gw.admin(`/admin/pools/${name}`, { method: "PUT", body: { policy: "round_robin", ...ROOMY_BUDGET } });
  assert.equal(put.status, 200, await put.text());
  const sims = [];
  const ids = [];
  for (let i = 0; i < count; i++) {
    const s = await sim(model, args);
    const id = `${name}-b${i}`;
    const r = await gw.admin("/admin/backends", { method: "POST", body: { url: s.url, pool: name, models: [model], id } });
    assert.equal(r.status, 201, await r.text());
    sims.push(s);
    ids.push(id);
  }
  for (const id of ids) await waitReady(gw, id);
  return { name, model, sims, ids };
}

const MESSAGES = [{ role: "system", content: "You are terse." }, { role: "user", content: "Tell me a story about a cat." }];

/** Streams a chat answer with the Node client; returns its chunks, the error it raised, headers. */
async function streamChat(model, { max_tokens, extra = {}, onChunk } = {}) {
  const { data: stream, response } = await client.chat.completions
    .create({ model, messages: MESSAGES, stream: true, max_tokens, ignore_eos: true, stream_options: { include_usage: true }, ...extra })
    .withResponse();
  const chunks = [];
  let error = null;
  try {
    for await (const c of stream) {
      chunks.push(c);
      if (onChunk) await onChunk(c, chunks.length, response);
    }
  } catch (e) {
    error = e;
  }
  return { chunks, error, backend: response.headers.get("x-gateway-backend") };
}

/** The prompt tokens of MESSAGES as the sim counts them (a short request no fault reaches). */
async function promptTokens(model) {
  const r = await client.chat.completions.create({ model, messages: MESSAGES, max_tokens: 1 });
  return r.usage.prompt_tokens;
}

/** Asserts a whole, seamless chat stream of `max_tokens` tokens with one usage total. */
function assertSeamless({ chunks, error }, { max_tokens, prompt_tokens }) {
  assert.equal(error, null, `the stream raised ${error}`);
  const ids = new Set(chunks.map((c) => c.id));
  const created = new Set(chunks.map((c) => c.created));
  const models = new Set(chunks.map((c) => c.model));
  assert.deepEqual([ids.size, created.size, models.size], [1, 1, 1], `one id/created/model: ${[...ids]} ${[...created]} ${[...models]}`);
  const choices = chunks.flatMap((c) => c.choices);
  assert.ok(choices.every((ch) => ch.index === 0));
  assert.equal(choices.filter((ch) => ch.delta?.role !== undefined).length, 1, "one role chunk");
  const content = choices.filter((ch) => ch.delta?.content);
  assert.equal(content.length, max_tokens, "every token asked for, once");
  // vllm-sim's tokens are 4 bytes each.
  assert.equal(content.map((ch) => ch.delta.content).join("").length, 4 * max_tokens);
  const finishes = choices.filter((ch) => ch.finish_reason);
  assert.deepEqual(finishes.map((ch) => ch.finish_reason), ["length"], "one final chunk");
  const usage = chunks.filter((c) => c.usage);
  assert.equal(usage.length, 1, "one usage total");
  const u = usage[0].usage;
  assert.equal(u.prompt_tokens, prompt_tokens, "the prompt counted once");
  assert.equal(u.completion_tokens, max_tokens);
  assert.equal(u.total_tokens, prompt_tokens + max_tokens);
  assert.ok(u.prompt_tokens_details.cached_tokens <= prompt_tokens);
}

async function resumeCounts(pool) {
  const samples = parseMetrics(await (await gw.admin("/metrics")).text());
  const out = {};
  for (const s of samples) {
    if (s.name === "llm_gateway_stream_resumes_total" && s.labels.pool === pool && s.value > 0) {
      out[s.labels.outcome] = (out[s.labels.outcome] ?? 0) + s.value;
    }
  }
  return out;
}

// The counts are taken when the lease is released, which for a stream that ended without usage
// comes after the count of what its client received (one /tokenize call): wait for them a little.
async function expectResumeCounts(pool, expected) {
  let counts;
  for (let i = 0; i < 50; i++) {
    counts = await resumeCounts(pool);
    if (isDeepStrictEqual(counts, expected)) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.deepEqual(counts, expected);
}

function accessLines(pool) {
  return logs.filter((l) => l.includes('"event":"request"') && l.includes(`"pool":"${pool}"`)).map((l) => JSON.parse(l.slice(l.indexOf("{"))));
}

test("streams dropped after N tokens are resumed on the other backend, seamlessly", async () => {
  // Both backends drop every stream after 4 tokens: whichever serves first, the continuation
  // (3 tokens left) finishes on the other.
  const pool = await freshPool(2, ["--fault-disconnect-after-tokens", "4"]);
  const prompt_tokens = await promptTokens(pool.model);
  for (let i = 0; i < 4; i++) {
    assertSeamless(await streamChat(pool.model, { max_tokens: 7 }), { max_tokens: 7, prompt_tokens });
  }
  await expectResumeCounts(pool.name, { success: 4 });
  await waitFor(() => accessLines(pool.name).filter((l) => l.stream_resume).length === 4, { what: "4 access log lines" });
  for (const line of accessLines(pool.name).filter((l) => l.stream_resume)) {
    assert.equal(line.stream_resume, "continuation");
    assert.equal(line.resumed_from.length, 1);
    assert.notEqual(line.resumed_from[0], line.backend, "both backends are named");
    assert.equal(line.outcome, "success");
    assert.equal(line.attempts, 2);
  }
});

test("usage is left out when the client did not ask for it, and max_completion_tokens shrinks", async () => {
  const pool = await freshPool(2, ["--fault-disconnect-after-tokens", "3"]);
  const { data: stream } = await client.chat.completions
    .create({ model: pool.model, messages: MESSAGES, stream: true, max_completion_tokens: 5, ignore_eos: true })
    .withResponse();
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  assert.equal(chunks.filter((c) => c.usage).length, 0);
  assert.equal(chunks.flatMap((c) => c.choices).filter((ch) => ch.delta?.content).length, 5);
  await expectResumeCounts(pool.name, { success: 1 });
});

test("a stream cut in the middle of an event resumes after the last whole event", async () => {
  const pool = await freshPool(2, ["--fault-disconnect-mid-event-after-tokens", "3"]);
  const prompt_tokens = await promptTokens(pool.model);
  assertSeamless(await streamChat(pool.model, { max_tokens: 5 }), { max_tokens: 5, prompt_tokens });
  await expectResumeCounts(pool.name, { success: 1 });
});

test("continuous usage stays one running total across the splice", async () => {
  const pool = await freshPool(2, ["--fault-disconnect-after-tokens", "4"]);
  const prompt_tokens = await promptTokens(pool.model);
  const r = await streamChat(pool.model, { max_tokens: 7, extra: { stream_options: { include_usage: true, continuous_usage_stats: true } } });
  assert.equal(r.error, null);
  const usages = r.chunks.filter((c) => c.usage).map((c) => c.usage);
  assert.ok(usages.length >= 7, `usage in every chunk: ${usages.length}`);
  assert.ok(usages.every((u) => u.prompt_tokens === prompt_tokens), JSON.stringify(usages));
  const completion = usages.map((u) => u.completion_tokens);
  assert.ok(completion.every((n, i) => i === 0 || n >= completion[i - 1]), `never counts back: ${completion}`);
  assert.equal(completion.at(-1), 7);
  assert.equal(r.chunks.flatMap((c) => c.choices).filter((ch) => ch.delta?.content).length, 7);
  await expectResumeCounts(pool.name, { success: 1 });
});

test("completions streams are resumed with the prompt extended by the partial text", async () => {
  const pool = await freshPool(2, ["--fault-disconnect-after-tokens", "4"]);
  const plain = await client.completions.create({ model: pool.model, prompt: "Once upon a time", max_tokens: 1 });
  const stream = await client.completions.create({
    model: pool.model, prompt: "Once upon a time", max_tokens: 6, ignore_eos: true, stream: true, stream_options: { include_usage: true },
  });
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  assert.equal(new Set(chunks.map((c) => c.id)).size, 1);
  const texts = chunks.flatMap((c) => c.choices).filter((ch) => ch.text);
  assert.equal(texts.length, 6);
  assert.deepEqual(chunks.flatMap((c) => c.choices).filter((ch) => ch.finish_reason).map((ch) => ch.finish_reason), ["length"]);
  const usage = chunks.filter((c) => c.usage).map((c) => c.usage);
  assert.equal(usage.length, 1);
  assert.equal(usage[0].prompt_tokens, plain.usage.prompt_tokens);
  assert.equal(usage[0].completion_tokens, 6);
});

test("a stalled stream is resumed after the idle timeout", async () => {
  const pool = await freshPool(2, ["--fault-stall-after-tokens", "3"]);
  const prompt_tokens = await promptTokens(pool.model);
  assertSeamless(await streamChat(pool.model, { max_tokens: 5 }), { max_tokens: 5, prompt_tokens });
  await expectResumeCounts(pool.name, { success: 1 });
  const line = await waitFor(() => accessLines(pool.name).find((l) => l.stream_resume));
  assert.equal(line.resumed_from.length, 1);
});

test("a backend killed mid-stream: the stream goes on on the survivor", async () => {
  // Slow enough (50 ms a token) that the kill lands in the middle of the answer.
  const pool = await freshPool(2, ["--time-scale", "1", "--decode-ms-per-step", "50", "--prefill-us-per-token", "0"]);
  const prompt_tokens = await promptTokens(pool.model);
  let killed = null;
  const result = await streamChat(pool.model, {
    max_tokens: 20,
    onChunk: async (_c, n, response) => {
      if (n === 4) {
        const i = pool.ids.indexOf(response.headers.get("x-gateway-backend"));
        killed = pool.ids[i];
        await pool.sims[i].close();
      }
    },
  });
  assert.ok(killed, "a backend was killed mid-stream");
  assertSeamless(result, { max_tokens: 20, prompt_tokens });
  const line = await waitFor(() => accessLines(pool.name).find((l) => l.stream_resume));
  assert.deepEqual(line.resumed_from, [killed]);
  assert.notEqual(line.backend, killed);
  await expectResumeCounts(pool.name, { success: 1 });
});

test("unresumable requests end with the error event, as before", async () => {
  const pool = await freshPool(2, ["--fault-disconnect-after-tokens", "3"]);
  const schema = { type: "json_schema", json_schema: { name: "s", schema: { type: "object" } } };
  const r = await streamChat(pool.model, { max_tokens: 8, extra: { response_format: schema } });
  assert.ok(r.error instanceof OpenAI.APIError, `expected APIError, got ${r.error}`);
  assert.match(String(r.error.message), /ended the stream early|failed while streaming/);
  assert.equal(r.chunks.flatMap((c) => c.choices).filter((ch) => ch.delta?.content).length, 3);
  await expectResumeCounts(pool.name, { not_resumable: 1 });
});

test("a stream fails again after MAX_STREAM_RESUMES (1): the error event", async () => {
  // Both drop after 3 tokens and 10 are asked: the continuation drops too, and no second resume.
  const pool = await freshPool(2, ["--fault-disconnect-after-tokens", "3"]);
  const r = await streamChat(pool.model, { max_tokens: 10 });
  assert.ok(r.error instanceof OpenAI.APIError, `expected APIError, got ${r.error}`);
  const choices = r.chunks.flatMap((c) => c.choices);
  assert.equal(choices.filter((ch) => ch.delta?.content).length, 6, "3 tokens from each backend");
  assert.equal(choices.filter((ch) => ch.delta?.role !== undefined).length, 1);
  assert.equal(new Set(r.chunks.map((c) => c.id)).size, 1);
  // The continuation's share ended with the failure; counted as a continuation, by its kind.
  await expectResumeCounts(pool.name, { transport: 1 });
});

test("a pool with one backend left cannot resume: the error event", async () => {
  const pool = await freshPool(1, ["--fault-disconnect-after-tokens", "2"]);
  const r = await streamChat(pool.model, { max_tokens: 6 });
  assert.ok(r.error instanceof OpenAI.APIError);
  await expectResumeCounts(pool.name, { not_resumed: 1 });
});

// Issue 42 (still open from the last round): resumption counted one token per content event. A
// vLLM with speculative decoding (`--spec-tokens 2`: events of 1, 3, 2, 1, ... tokens) sends 7
// tokens in 4 events before it drops the stream: the continuation must ask for 12 - 7 tokens, not
// 12 - 4, so the client gets exactly `max_tokens`, and the usage it is told and the usage it is
// charged (the lease's outcome, which the reservation settles with) count those tokens.
test("a stream from a speculative-decoding backend resumes with the tokens sent counted exactly, not one per event", async () => {
  // Both backends drop a stream after the event that reaches 7 tokens: a continuation that asks
  // for the 5 left finishes; one that asks for 8 is dropped again (MAX_STREAM_RESUMES is 1).
  const pool = await freshPool(2, ["--spec-tokens", "2", "--fault-disconnect-after-tokens", "7"]);
  const prompt_tokens = await promptTokens(pool.model);
  const max_tokens = 12;
  const r = await streamChat(pool.model, { max_tokens });
  const choices = r.chunks.flatMap((c) => c.choices);
  // vllm-sim's tokens are 4 bytes each, however many an event carries.
  const text = choices.map((ch) => ch.delta?.content ?? "").join("");
  assert.equal(text.length / 4, max_tokens, `the client received ${text.length / 4} tokens for max_tokens ${max_tokens} (error: ${r.error})`);
  assert.equal(r.error, null, `the stream raised ${r.error}`);
  assert.ok(choices.some((ch) => (ch.delta?.content ?? "").length > 4), "several tokens in one event");
  assert.equal(new Set(r.chunks.map((c) => c.id)).size, 1);
  assert.equal(choices.filter((ch) => ch.delta?.role !== undefined).length, 1, "one role chunk");
  assert.deepEqual(choices.filter((ch) => ch.finish_reason).map((ch) => ch.finish_reason), ["length"]);
  const usage = r.chunks.filter((c) => c.usage).map((c) => c.usage);
  assert.equal(usage.length, 1, "one usage total");
  assert.deepEqual(
    [usage[0].prompt_tokens, usage[0].completion_tokens, usage[0].total_tokens],
    [prompt_tokens, max_tokens, prompt_tokens + max_tokens],
    "the usage the client is told: the prompt once, every token it received",
  );
  await expectResumeCounts(pool.name, { success: 1 });
  // What the request is charged, and its access log line says: the client's totals (the prompt
  // once, every token it received), not the continuation's own usage (whose prompt holds the
  // partial answer).
  const line = await waitFor(() => accessLines(pool.name).find((l) => l.stream_resume));
  assert.equal(line.outcome, "success");
  assert.deepEqual([line.prompt_tokens, line.completion_tokens], [prompt_tokens, max_tokens], JSON.stringify(line));
  assert.ok(line.cached_tokens === null || line.cached_tokens <= prompt_tokens, JSON.stringify(line));

  // Completions: the prompt extended by the partial text, the same count.
  const plain = await client.completions.create({ model: pool.model, prompt: "Once upon a time", max_tokens: 1 });
  const stream = await client.completions.create({
    model: pool.model, prompt: "Once upon a time", max_tokens, ignore_eos: true, stream: true, stream_options: { include_usage: true },
  });
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  const completed = chunks.flatMap((c) => c.choices).map((ch) => ch.text ?? "").join("");
  assert.equal(completed.length / 4, max_tokens, "completions: every token asked for, once");
  const u = chunks.filter((c) => c.usage).map((c) => c.usage);
  assert.deepEqual([u.length, u[0].prompt_tokens, u[0].completion_tokens], [1, plain.usage.prompt_tokens, max_tokens]);
  await expectResumeCounts(pool.name, { success: 2 });
});

test("without the next backend's /tokenize, a resumption still goes on, counting one token per event, and says so in the log", async () => {
  const pool = await freshPool(2, ["--spec-tokens", "2"]);
  for (const s of pool.sims) await setFaults(s, { disconnect_after_tokens: 7, tokenize_not_found: true });
  const before = logs.length;
  // 7 tokens in 4 events, then the drop: counted as 4, the continuation asks for 5 of the 9 and
  // finishes (the client gets 12: the count is too low without a tokenizer, never too high).
  const r = await streamChat(pool.model, { max_tokens: 9 });
  assert.equal(r.error, null, `the stream raised ${r.error}`);
  const text = r.chunks.flatMap((c) => c.choices).map((ch) => ch.delta?.content ?? "").join("");
  assert.equal(text.length / 4, 12);
  await expectResumeCounts(pool.name, { success: 1 });
  const line = await waitFor(() => logs.slice(before).find((l) => l.includes("counted one per event")), { what: "the fallback's log line" });
  assert.match(line, /one per event \(4\): backend \S+'s \/tokenize answered 404/);
});
