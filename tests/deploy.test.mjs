// Deploying for real: the checks behind the README's deploy walkthrough.
//
// 1. Registration refuses a backend named by IP address (a deployed Worker cannot fetch one)
//    unless ALLOW_IP_BACKENDS is "true", for POST and for a PATCH of the URL.
// 2. The recipes under deploy/ (KEDA ScaledObjects, the HPA and its prometheus-adapter rule, the
//    Prometheus scrape jobs, the Grafana dashboard) query only metrics and labels that exist: the
//    built Worker's /metrics after real traffic through real vllm-sim backends, scraped the way the
//    scrape job says (bearer METRICS_TOKEN), and a vllm-sim's own /metrics for the vLLM panels.
// 3. The documented deploy configuration is closed: the built Worker started with exactly
//    wrangler.toml's [vars] (what `wrangler deploy` uploads) and the ADMIN_TOKEN secret answers
//    no client route without a key, the admin API without the token, /metrics without a token;
//    /healthz answers; a key minted through the admin API then passes.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import path from "node:path";
import { parseAllDocuments } from "yaml";
import { startGateway, startSim, waitReady, errorBody, parseMetrics, ROOT, ADMIN_TOKEN } from "./lib/harness.mjs";

const DEPLOY = path.join(ROOT, "deploy");
const METRICS_TOKEN = "test-metrics-token-81c3";
const MODEL = "deploy-model";

// ---- 1. Bare-IP backends ----

test("registration refuses IP-addressed backends unless ALLOW_IP_BACKENDS is true", async () => {
  const sim = await startSim(["--model", MODEL, "--time-scale", "50"]);
  const strict = await startGateway({ bindings: { ALLOW_IP_BACKENDS: "false" } });
  try {
    for (const url of [sim.url, "http://10.0.0.5:8000", "https://[2001:db8::1]:8443", "http://2130706433:8000"]) {
      const r = await strict.admin("/admin/backends", { method: "POST", body: { url, models: [MODEL] } });
      assert.equal(r.status, 400, url);
      const e = await errorBody(r);
      assert.equal(e.code, "ip_backend_not_allowed");
      assert.equal(e.param, "url");
      assert.match(e.message, /IP address/);
      assert.match(e.message, /ALLOW_IP_BACKENDS/);
      assert.match(e.message, /DNS name .*Cloudflare Tunnel/);
    }
    // A hostname is fine (localhost is one, and reaches the same simulated server).
    const byName = sim.url.replace("127.0.0.1", "localhost");
    const ok = await strict.admin("/admin/backends", { method: "POST", body: { id: "named", url: byName, models: [MODEL] } });
    assert.equal(ok.status, 201, await ok.text());
    await waitReady(strict, "named", 20000);
    // Changing its URL to an IP is refused the same way; to another hostname, allowed.
    const bad = await strict.admin("/admin/backends/named", { method: "PATCH", body: { url: sim.url } });
    assert.equal(bad.status, 400);
    assert.equal((await errorBody(bad)).code, "ip_backend_not_allowed");
    assert.equal((await (await strict.admin("/admin/backends/named")).json()).url, byName);
    const renamed = await strict.admin("/admin/backends/named", { method: "PATCH", body: { url: `${byName}/` } });
    assert.equal(renamed.status, 200, await renamed.text());
  } finally {
    await strict.close();
  }

  const local = await startGateway({ bindings: { ALLOW_IP_BACKENDS: "true" } });
  try {
    const r = await local.admin("/admin/backends", { method: "POST", body: { id: "by-ip", url: sim.url, models: [MODEL] } });
    assert.equal(r.status, 201, await r.text());
    await waitReady(local, "by-ip", 20000);
  } finally {
    await local.close();
    await sim.close();
  }
});

// ---- 2. The recipes against real expositions ----

/** Metric sample name -> { labels: Set, values: Map(label -> Set) }. */
function index(text) {
  const out = new Map();
  for (const s of parseMetrics(text)) {
    if (!out.has(s.name)) out.set(s.name, { labels: new Set(), values: new Map() });
    const m = out.get(s.name);
    for (const [k, v] of Object.entries(s.labels)) {
      m.labels.add(k);
      if (!m.values.has(k)) m.values.set(k, new Set());
      m.values.get(k).add(v);
    }
  }
  return out;
}

const KEYWORDS = new Set(["by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "inf", "nan"]);

/**
 * The selectors and grouping labels of a PromQL expression: [{ name, matchers: [{label, op, value}] }]
 * and [label]. Enough PromQL for dashboards and autoscaler queries: functions, aggregations with
 * by/without, binary operators with on/ignoring, ranges, strings, numbers.
 */
function analyzePromql(expr) {
  const selectors = [];
  const grouping = [];
  let i = 0;
  const ident = /[a-zA-Z_:][a-zA-Z0-9_:]*/y;
  const skipSpace = () => { while (i < expr.length && /\s/.test(expr[i])) i++; };
  const readString = () => {
    const q = expr[i++];
    let s = "";
    while (i < expr.length && expr[i] !== q) {
      if (expr[i] === "\\") i++;
      s += expr[i++];
    }
    i++;
    return s;
  };
  const readMatchers = () => {
    const matchers = [];
    i++; // {
    for (;;) {
      skipSpace();
      if (expr[i] === "}") { i++; return matchers; }
      if (expr[i] === ",") { i++; continue; }
      ident.lastIndex = i;
      const m = ident.exec(expr);
      if (!m) throw new Error(`bad matcher at ${i} in ${expr}`);
      i += m[0].length;
      skipSpace();
      const op = /^(=~|!~|!=|=)/.exec(expr.slice(i))[1];
      i += op.length;
      skipSpace();
      matchers.push({ label: m[0], op, value: readString() });
    }
  };
  const readLabelList = () => {
    skipSpace();
    if (expr[i] !== "(") return;
    i++;
    const end = expr.indexOf(")", i);
    for (const l of expr.slice(i, end).split(",").map((s) => s.trim()).filter(Boolean)) grouping.push(l);
    i = end + 1;
  };
  while (i < expr.length) {
    const c = expr[i];
    if (c === '"' || c === "'") { readString(); continue; }
    if (c === "[") { i = expr.indexOf("]", i) + 1; continue; }
    if (c === "{") { selectors.push({ name: null, matchers: readMatchers() }); continue; }
    if (/[0-9.]/.test(c)) { while (i < expr.length && /[0-9.eE]/.test(expr[i])) i++; continue; }
    ident.lastIndex = i;
    const m = ident.exec(expr);
    if (!m) { i++; continue; }
    i += m[0].length;
    const word = m[0];
    if (["by", "without", "on", "ignoring", "group_left", "group_right"].includes(word)) { readLabelList(); continue; }
    if (KEYWORDS.has(word.toLowerCase())) continue;
    skipSpace();
    if (expr[i] === "(") continue; // a function or aggregation
    if (/^(by|without)\b/.test(expr.slice(i))) continue; // an aggregation: `sum by (pool) (...)`
    const matchers = expr[i] === "{" ? readMatchers() : [];
    selectors.push({ name: word, matchers });
  }
  return { selectors, grouping };
}

/**
 * Problems with a query: metrics not emitted, labels they do not carry, label values never seen
 * (deployment-specific labels and template variables excepted). `lookup` finds a metric's index
 * entry and the labels its scrape job adds.
 */
function checkQuery(expr, lookup) {
  const problems = [];
  const { selectors, grouping } = analyzePromql(expr);
  const available = new Set(["le"]);
  if (!selectors.some((s) => s.name)) problems.push(`no metric in ${expr}`);
  for (const s of selectors) {
    const found = s.name && lookup(s.name);
    if (!found) { problems.push(`metric ${s.name} is not emitted`); continue; }
    const labels = new Set([...found.metric.labels, ...found.extra]);
    labels.forEach((l) => available.add(l));
    for (const m of s.matchers) {
      if (!labels.has(m.label)) { problems.push(`${s.name} has no label ${m.label}`); continue; }
      if (found.extra.has(m.label) || ["pool", "backend"].includes(m.label) || m.value.includes("$")) continue;
      if (m.op === "!=" || m.op === "!~" || m.value === ".*") continue;
      const seen = found.metric.values.get(m.label) ?? new Set();
      const wanted = m.op === "=" ? [m.value] : m.value.split("|");
      for (const v of wanted) if (!seen.has(v)) problems.push(`${s.name}{${m.label}} never has the value ${v}`);
    }
  }
  for (const l of grouping) if (!available.has(l)) problems.push(`grouping by ${l}, which no metric in the query carries`);
  return problems;
}

/** Every query in deploy/, with where it comes from. */
function recipeQueries() {
  const queries = [];
  const docs = (file) => parseAllDocuments(readFileSync(path.join(DEPLOY, file), "utf8")).map((d) => {
    assert.deepEqual(d.errors, [], `${file} parses`);
    return d.toJS();
  }).filter(Boolean);

  const scaled = docs("keda/scaledobject.yaml");
  assert.ok(scaled.length >= 2, "one ScaledObject per pool");
  for (const so of scaled) {
    assert.equal(so.apiVersion, "keda.sh/v1alpha1");
    assert.equal(so.kind, "ScaledObject");
    const [trigger] = so.spec.triggers;
    assert.equal(trigger.type, "prometheus");
    assert.equal(trigger.metricType, "AverageValue");
    assert.equal(Number(trigger.metadata.threshold), 1);
    assert.match(trigger.metadata.query, /llm_gateway_pool_desired_replicas\{pool="[^"]+"\}/);
    queries.push({ where: `keda ${so.metadata.name}`, expr: trigger.metadata.query });
  }

  const [hpa] = docs("hpa/external-metric-hpa.yaml");
  assert.equal(hpa.apiVersion, "autoscaling/v2");
  for (const m of hpa.spec.metrics) {
    assert.equal(m.type, "External");
    const matchers = Object.entries(m.external.metric.selector.matchLabels).map(([k, v]) => `${k}="${v}"`).join(",");
    queries.push({ where: "hpa", expr: `${m.external.metric.name}{${matchers}}` });
    assert.deepEqual(m.external.target, { type: "AverageValue", averageValue: "1" });
  }
  const [adapter] = docs("hpa/prometheus-adapter-values.yaml");
  for (const rule of adapter.rules.external) {
    queries.push({ where: "prometheus-adapter seriesQuery", expr: rule.seriesQuery });
    const series = analyzePromql(rule.seriesQuery).selectors[0].name;
    assert.equal(rule.name.as, series, "the HPA asks for the series by its own name");
    assert.ok(hpa.spec.metrics.some((m) => m.external.metric.name === rule.name.as), "the HPA uses the adapter's metric");
    const expr = rule.metricsQuery.replaceAll("<<.Series>>", series).replaceAll("<<.LabelMatchers>>", "").replaceAll("<<.GroupBy>>", "pool");
    queries.push({ where: "prometheus-adapter metricsQuery", expr });
  }

  const dashboard = JSON.parse(readFileSync(path.join(DEPLOY, "grafana/llm-gateway.json"), "utf8"));
  const panels = dashboard.panels.flatMap((p) => [p, ...(p.panels ?? [])]);
  const exprs = panels.flatMap((p) => (p.targets ?? []).map((t) => ({ where: `grafana "${p.title}"`, expr: t.expr })));
  assert.ok(exprs.length >= 15, "the dashboard has its panels");
  assert.ok(exprs.some((q) => q.expr.includes("vllm:")), "and uses the vLLM families");
  queries.push(...exprs);
  for (const v of dashboard.templating.list.filter((v) => v.type === "query")) {
    const m = /^label_values\(([^,]+),\s*([^)]+)\)$/.exec(v.definition);
    assert.ok(m, v.definition);
    queries.push({ where: `grafana variable ${v.name}`, expr: `sum by (${m[2]}) (${m[1]})` });
  }
  return queries;
}

let gw;
const sims = [];
let gatewayIndex, vllmIndex, scrapeJobs;

before(async () => {
  gw = await startGateway({ bindings: { METRICS_TOKEN, PROBE_INTERVAL_MS: "500" } });
  for (const [i, pool] of ["deploy-a", "deploy-b"].entries()) {
    const sim = await startSim(["--model", MODEL, "--time-scale", "50", "--seed", String(40 + i)]);
    sims.push(sim);
    const r = await gw.admin("/admin/backends", { method: "POST", body: { id: `d-${i}`, url: sim.url, pool, models: [MODEL] } });
    assert.equal(r.status, 201);
    await waitReady(gw, `d-${i}`, 20000);
  }
  for (let i = 0; i < 8; i++) {
    const r = await gw.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ model: MODEL, max_tokens: 4, messages: [{ role: "user", content: `hello number ${i % 2}` }] }),
    });
    assert.equal(r.status, 200);
    await r.text();
  }
  [scrapeJobs] = parseAllDocuments(readFileSync(path.join(DEPLOY, "prometheus/scrape-config.yaml"), "utf8")).map((d) => d.toJS());
  const job = scrapeJobs.scrape_configs.find((j) => j.job_name === "llm-gateway");
  // Scrape the way the job says: its path, its bearer scheme, the metrics token.
  assert.equal(job.authorization.type, "Bearer");
  assert.equal((await gw.fetch(job.metrics_path)).status, 401, "the gateway's /metrics needs the token");
  const scraped = await gw.fetch(job.metrics_path, { headers: { authorization: `Bearer ${METRICS_TOKEN}` } });
  assert.equal(scraped.status, 200);
  gatewayIndex = index(await scraped.text());
  vllmIndex = index(await (await fetch(`${sims[0].url}/metrics`)).text());
});

after(async () => {
  await gw?.close();
  await Promise.all(sims.map((s) => s.close()));
});

/** Finds a metric in the exposition its scrape job collects, with the labels that job adds. */
function lookup(name) {
  const jobName = name.startsWith("vllm:") ? "vllm" : "llm-gateway";
  const job = scrapeJobs.scrape_configs.find((j) => j.job_name === jobName);
  const metric = (jobName === "vllm" ? vllmIndex : gatewayIndex).get(name);
  if (!metric || !job) return null;
  // Prometheus adds job and instance; static_configs may add more.
  const extra = new Set(["job", "instance", ...job.static_configs.flatMap((s) => Object.keys(s.labels ?? {}))]);
  return { metric, extra };
}

test("every metric and label the recipes query is one the gateway (or vLLM) emits", () => {
  const queries = recipeQueries();
  const problems = queries.flatMap((q) => checkQuery(q.expr, lookup).map((p) => `${q.where}: ${p}`));
  assert.deepEqual(problems, []);
  // The autoscaling signal is there for each pool that has backends.
  const desired = gatewayIndex.get("llm_gateway_pool_desired_replicas");
  assert.deepEqual([...desired.values.get("pool")].sort(), ["deploy-a", "deploy-b"]);
});

test("the recipe check itself catches a wrong metric, label or value", () => {
  assert.deepEqual(checkQuery('sum by (pool) (rate(llm_gateway_requests_total{pool="x"}[5m]))', lookup), []);
  assert.deepEqual(checkQuery("llm_gateway_pool_desired_replica", lookup), ["metric llm_gateway_pool_desired_replica is not emitted"]);
  assert.deepEqual(checkQuery('llm_gateway_pool_desired_replicas{region="x"}', lookup), ["llm_gateway_pool_desired_replicas has no label region"]);
  assert.deepEqual(checkQuery('llm_gateway_request_outcomes_total{outcome=~"success|boom"}', lookup), [
    "llm_gateway_request_outcomes_total{outcome} never has the value boom",
  ]);
  assert.deepEqual(checkQuery("sum by (model) (vllm:num_requests_waiting)", lookup), ["grouping by model, which no metric in the query carries"]);
  assert.deepEqual(checkQuery('vllm:num_requests_waiting{pool="us-east-a100"}', lookup), [], "scrape-job labels count");
});

test("deploy/ holds only the recipes this test checks", () => {
  const files = readdirSync(DEPLOY, { recursive: true }).filter((f) => /\.(ya?ml|json)$/.test(f)).sort();
  assert.deepEqual(files, [
    "grafana/llm-gateway.json",
    "hpa/external-metric-hpa.yaml",
    "hpa/prometheus-adapter-values.yaml",
    "keda/scaledobject.yaml",
    "prometheus/scrape-config.yaml",
  ]);
});

// ---- 3. Closed by default ----

/** wrangler.toml's top-level [vars] (flat `KEY = "value"` lines): what `wrangler deploy` uploads. */
function deployVars() {
  const toml = readFileSync(path.join(ROOT, "wrangler.toml"), "utf8");
  const section = toml.split(/^\[vars\]\s*$/m)[1]?.split(/^\[/m)[0] ?? "";
  return Object.fromEntries([...section.matchAll(/^([A-Z0-9_]+)\s*=\s*"([^"]*)"/gm)].map((m) => [m[1], m[2]]));
}

/**
 * The client routes of the Worker's route table (`route` in src/lib.rs): every match arm of string
 * segments, alternatives (`"a" | "b"`) expanded, except the operators' (`healthz`, `metrics`,
 * `dashboard`, `admin`).
 */
function clientRoutes() {
  const text = readFileSync(path.join(ROOT, "src", "lib.rs"), "utf8");
  const routes = new Set();
  const pattern = /\[((?:\s*"[a-z0-9_]+"(?:\s*\|\s*"[a-z0-9_]+")*\s*,?)+)\]\s*(?=\||=>)/g;
  for (const m of text.matchAll(pattern)) {
    const segments = m[1].split(",").map((seg) => [...seg.matchAll(/"([a-z0-9_]+)"/g)].map((x) => x[1])).filter((alts) => alts.length);
    let paths = [""];
    for (const alts of segments) paths = paths.flatMap((p) => alts.map((a) => `${p}/${a}`));
    for (const p of paths) if (!/^\/(healthz|metrics|dashboard|admin)(\/|$)/.test(p)) routes.add(p);
  }
  return [...routes].sort();
}

test("the deploy configuration answers no client route without a key", async () => {
  const vars = deployVars();
  assert.equal(vars.REQUIRE_CLIENT_KEYS, "true", "wrangler.toml's [vars] must set REQUIRE_CLIENT_KEYS = \"true\" (closed by default)");
  assert.equal(vars.ALLOW_IP_BACKENDS, "false", "wrangler.toml's [vars] must keep ALLOW_IP_BACKENDS = \"false\"");
  const routes = clientRoutes();
  assert.deepEqual(
    routes,
    [
      "/classify", "/detokenize", "/pooling", "/rerank", "/score", "/tokenize",
      "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/chat/completions", "/v1/completions",
      "/v1/embeddings", "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/v1/rerank",
      "/v1/responses", "/v1/score", "/v2/rerank",
    ],
    "the route table's client routes",
  );
  // Exactly the deploy configuration: no test defaults merged in, the admin token as the secret.
  const g = await startGateway({ defaults: false, bindings: { ...vars, ADMIN_TOKEN } });
  const bodies = {
    "/v1/chat/completions": { model: "m", messages: [{ role: "user", content: "hi" }] },
    "/v1/completions": { model: "m", prompt: "hi" },
    "/v1/embeddings": { model: "m", input: "hi" },
  };
  // Every other client route is called with a body of its shape (a missing key is refused before
  // the body is read; the shape matters once the key passes).
  Object.assign(bodies, {
    "/tokenize": { model: "m", prompt: "hi" },
    "/detokenize": { model: "m", tokens: [1, 2] },
    "/v1/score": { model: "m", text_1: "a", text_2: "b" },
    "/v1/responses": { model: "m", input: "hi" },
    "/v1/messages": { model: "m", max_tokens: 4, messages: [{ role: "user", content: "hi" }] },
  });
  for (const r of ["/rerank", "/v1/rerank", "/v2/rerank"]) bodies[r] = { model: "m", query: "q", documents: ["d"] };
  bodies["/score"] = bodies["/v1/score"];
  bodies["/v1/messages/count_tokens"] = bodies["/v1/messages"];
  const bodyOf = (route) => bodies[route] ?? { model: "m", input: "hi" };
  const boundary = "----deploycheck";
  const form = `--${boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--${boundary}--\r\n`;
  const call = (route, headers = {}) => {
    if (route === "/v1/models") return g.fetch(route, { headers });
    if (route.startsWith("/v1/audio/")) {
      return g.fetch(route, { method: "POST", headers: { "content-type": `multipart/form-data; boundary=${boundary}`, ...headers }, body: form });
    }
    return g.fetch(route, { method: "POST", headers: { "content-type": "application/json", ...headers }, body: JSON.stringify(bodyOf(route)) });
  };
  try {
    for (const route of routes) {
      for (const headers of [{}, { authorization: "Bearer sk-not-a-key" }, { "x-api-key": "sk-not-a-key" }]) {
        const r = await call(route, headers);
        assert.equal(r.status, 401, `${route} ${JSON.stringify(headers)}`);
        if (route.startsWith("/v1/messages")) {
          // Anthropic's shape, so its SDK raises AuthenticationError.
          const body = await r.json();
          assert.equal(body.type, "error");
          assert.equal(body.error.type, "authentication_error");
        } else {
          assert.equal((await errorBody(r)).code, "invalid_api_key");
        }
      }
    }
    for (const p of ["/admin/pools", "/admin/backends", "/admin/keys"]) {
      assert.equal((await g.admin(p, { token: "" })).status, 401, p);
      assert.equal((await g.admin(p, { token: "wrong-token" })).status, 401, p);
    }
    const minted = await g.admin("/admin/keys", { method: "POST", body: { name: "deploy-check" } });
    assert.equal((await g.admin("/admin/keys", { method: "POST", body: {}, token: "wrong" })).status, 401);
    assert.equal((await g.fetch("/metrics")).status, 401, "/metrics needs METRICS_TOKEN or the admin token");
    assert.equal((await g.fetch("/metrics", { headers: { authorization: `Bearer ${ADMIN_TOKEN}` } })).status, 200);
    const health = await g.fetch("/healthz");
    assert.equal(health.status, 200);
    assert.equal((await health.json()).status, "ok");

    // A key minted through the admin API passes: the models list answers, and a completion gets
    // past the key check (no backend is registered, so the model is not found).
    assert.equal(minted.status, 201);
    const { key } = await minted.json();
    assert.match(key, /^sk-gw-/);
    const auth = { authorization: `Bearer ${key}` };
    const models = await call("/v1/models", auth);
    assert.equal(models.status, 200, await models.clone().text());
    assert.deepEqual((await models.json()).data, []);
    for (const route of routes.filter((r) => r !== "/v1/models")) {
      const r = await call(route, auth);
      assert.equal(r.status, 404, route);
      if (route.startsWith("/v1/messages")) assert.equal((await r.json()).error.type, "not_found_error", route);
      else assert.equal((await errorBody(r)).code, "model_not_found", route);
    }
  } finally {
    await g.close();
  }
});

test("the Worker is closed when REQUIRE_CLIENT_KEYS is unset, open only with \"false\"", async () => {
  const { REQUIRE_CLIENT_KEYS: _, ...vars } = deployVars();
  for (const [value, status] of [[undefined, 401], ["false", 200]]) {
    const bindings = value === undefined ? { ...vars, ADMIN_TOKEN } : { ...vars, ADMIN_TOKEN, REQUIRE_CLIENT_KEYS: value };
    const g = await startGateway({ defaults: false, bindings });
    try {
      assert.equal((await g.fetch("/v1/models")).status, status, `REQUIRE_CLIENT_KEYS=${value}`);
    } finally {
      await g.close();
    }
  }
});
