// The operators' dashboard in a real browser: Debian's headless Chromium, driven by puppeteer-core,
// against the built Worker (Miniflare on a 127.0.0.1 port) with real vllm-sim backends. The page
// signs in with the admin token, shows the pools and backends, draws the last hour after traffic,
// and drains / undrains a backend and probes a pool through its buttons (checked through the
// admin API). A screenshot lands in tests/artifacts/dashboard.png (UPDATE_SCREENSHOT=1 also
// refreshes docs/src/images/dashboard.png, the book's copy).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdirSync, mkdtempSync, rmSync, copyFileSync, existsSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import puppeteer from "puppeteer-core";
import { startGatewayServer, startSim, waitFor, waitReady, ADMIN_TOKEN, ROOT } from "./lib/harness.mjs";

const CHROMIUM = process.env.CHROMIUM_BIN ?? "/usr/bin/chromium";
const MODEL = "dash-model";
// A model name that is markup: the page must show it as text, never run it.
const HOSTILE = `<img src=x onerror="window.__xss=1">`;
const ARTIFACTS = path.join(ROOT, "tests/artifacts");

let gw, browser, page, profile;
const sims = [];
const problems = []; // uncaught page errors and CSP violations
const actions = []; // admin calls the page made, as "METHOD path status"

before(async () => {
  assert.ok(existsSync(CHROMIUM), `${CHROMIUM} is missing: run make setup (it installs Debian's chromium)`);
  gw = await startGatewayServer({ bindings: { PROBE_INTERVAL_MS: "500", ALLOW_REGION_HEADER: "true" } });
  const setups = [
    { id: "dash-1", pool: "gpu-east", region: "us-east", models: [MODEL, HOSTILE] },
    { id: "dash-2", pool: "gpu-east", region: "us-east", models: [MODEL] },
    { id: "dash-3", pool: "gpu-west", region: "eu-west", models: [MODEL] },
  ];
  for (const [i, s] of setups.entries()) {
    const sim = await startSim([...s.models.flatMap((m) => ["--model", m]), "--time-scale", "50", "--seed", String(90 + i)]);
    sims.push(sim);
    const r = await gw.admin("/admin/backends", {
      method: "POST",
      body: { id: s.id, url: sim.url, pool: s.pool, region: s.region, models: s.models },
    });
    assert.equal(r.status, 201, await r.text());
  }
  for (const s of setups) await waitReady(gw, s.id, 20000);

  profile = mkdtempSync(path.join(tmpdir(), "gw-chromium-"));
  browser = await puppeteer.launch({
    executablePath: CHROMIUM,
    headless: true,
    userDataDir: profile,
    args: [
      "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
    ],
    protocolTimeout: 120000,
    timeout: 60000,
  });
  page = await browser.newPage();
  await page.setViewport({ width: 1400, height: 1000 });
  page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
  page.on("console", (m) => {
    if (/Content.Security.Policy|Refused to/i.test(m.text())) problems.push(`console: ${m.text()}`);
  });
  page.on("response", (r) => {
    const u = new URL(r.url());
    if (u.pathname.startsWith("/admin/") && r.request().method() !== "GET") {
      actions.push(`${r.request().method()} ${u.pathname} ${r.status()}`);
    }
  });
});

after(async () => {
  await browser?.close();
  if (profile) rmSync(profile, { recursive: true, force: true });
  await gw?.close();
  await Promise.all(sims.map((s) => s.close()));
});

/**
 * Sends `n` chat requests through the gateway, sharing a long prefix so caches come into play;
 * every third comes from eu-west (so the gpu-west pool serves it), the rest from us-east.
 */
async function traffic(n) {
  const system = "You are a careful assistant for the operators of a GPU fleet. ".repeat(12);
  for (let i = 0; i < n; i++) {
    const r = await fetch(`${gw.url}/v1/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", "x-gateway-region": i % 3 === 0 ? "eu-west" : "us-east" },
      body: JSON.stringify({
        model: MODEL,
        max_tokens: 8,
        stream: i % 2 === 0,
        messages: [{ role: "system", content: system }, { role: "user", content: `question ${i % 4}` }],
      }),
    });
    assert.equal(r.status, 200);
    await r.text();
  }
}

/** The admin API's view of a backend. */
async function backend(id) {
  const r = await gw.admin(`/admin/backends/${id}`);
  assert.equal(r.status, 200);
  return r.json();
}

test("the dashboard's assets are self-contained, carry a strict CSP and hold no data", async () => {
  const html = await gw.fetch("/dashboard");
  assert.equal(html.status, 200);
  assert.match(html.headers.get("content-type"), /^text\/html/);
  const csp = html.headers.get("content-security-policy");
  assert.match(csp, /default-src 'none'/);
  assert.match(csp, /script-src 'self'/);
  assert.match(csp, /frame-ancestors 'none'/);
  const bodies = [await html.text()];
  for (const [asset, type] of [["app.js", /javascript/], ["app.css", /css/]]) {
    const r = await gw.fetch(`/dashboard/${asset}`);
    assert.equal(r.status, 200);
    assert.match(r.headers.get("content-type"), type);
    assert.ok(r.headers.get("content-security-policy"));
    bodies.push(await r.text());
  }
  for (const body of bodies) {
    // Nothing loads from elsewhere (the SVG namespace is a name, not a fetch).
    const external = body.replaceAll("http://www.w3.org/2000/svg", "").match(/https?:\/\/\S+/g);
    assert.equal(external, null, `external reference: ${external}`);
    for (const id of ["dash-1", "gpu-east", ADMIN_TOKEN]) assert.ok(!body.includes(id), `the page embeds ${id}`);
  }
  assert.ok(!bodies[1].includes("innerHTML"), "strings reach the DOM as text only");
  assert.equal((await gw.fetch("/dashboard/nope.js")).status, 404);
  assert.equal((await gw.fetch("/dashboard", { method: "POST" })).status, 405);
});

test("the page asks for the token, refuses a wrong one, then shows regions, pools and backends", async () => {
  await page.goto(`${gw.url}/dashboard?refresh=1000`, { waitUntil: "domcontentloaded" });
  await page.waitForSelector("#login:not([hidden])");
  assert.equal(await page.$eval("#main", (m) => m.hidden), true);

  await page.type("#token", "not-the-token");
  await page.click("#login button[type=submit]");
  await page.waitForFunction(() => document.querySelector("#login-error").textContent.length > 0);
  assert.match(await page.$eval("#login-error", (e) => e.textContent), /Invalid admin token/);
  assert.equal(await page.evaluate(() => sessionStorage.length), 0, "a refused token is not kept");

  await page.type("#token", ADMIN_TOKEN);
  await page.click("#login button[type=submit]");
  await page.waitForSelector('tr[data-backend="dash-3"]');
  assert.equal(await page.$eval("#main", (m) => m.hidden), false);

  const rows = await page.$$eval("#backends tbody tr", (trs) =>
    trs.map((tr) => ({
      id: tr.dataset.backend,
      lifecycle: tr.querySelector('[data-field="lifecycle"]').textContent,
      health: tr.querySelector('[data-field="health"]').textContent,
      breaker: tr.querySelector('[data-field="breaker"]').textContent,
      models: tr.querySelector(".models").textContent,
    })),
  );
  assert.deepEqual(rows.map((r) => r.id), ["dash-1", "dash-2", "dash-3"]);
  for (const r of rows) assert.deepEqual([r.lifecycle, r.health, r.breaker], ["ready", "healthy", "closed"]);
  // The markup-shaped model name is shown as text and never ran.
  assert.ok(rows[0].models.includes(HOSTILE), rows[0].models);
  assert.equal(await page.evaluate(() => window.__xss), undefined);
  assert.equal(await page.$$eval("main img", (imgs) => imgs.length), 0);

  const regions = await page.$$eval("#pools tr.region", (trs) => trs.map((tr) => tr.dataset.region));
  assert.deepEqual(regions, ["eu-west", "us-east"]);
  const east = await page.$eval('#pools tr[data-pool="gpu-east"]', (tr) => [...tr.cells].map((c) => c.textContent));
  assert.equal(east[0], "gpu-east");
  assert.equal(east[1], "predicted_latency");
  assert.equal(east[2], "2 / 2");
  assert.match(east[6], /^\d+$/, "desired replicas");
  // Each pool's time card: predicted TTFT with 0, 1,024 and 8,192 tokens to prefill.
  await page.waitForFunction(
    () => /^\d+ \/ \d+ \/ \d+ ms/.test(document.querySelector('#pools tr[data-pool="gpu-east"] [data-field="card"]')?.textContent ?? ""),
    { timeout: 30000 },
  );
});

test("after traffic the charts and traffic shares have data", async () => {
  await traffic(16);
  await page.waitForFunction(
    () => [...document.querySelectorAll("#chart-rate circle")].some((c) => Number(c.dataset.value) > 0),
    { timeout: 30000 },
  );
  for (const chart of ["rate", "errors", "ttfb", "cache"]) {
    const points = await page.$eval(`#chart-${chart}`, (f) => Number(f.dataset.points));
    assert.ok(points > 0, `chart ${chart} has no points`);
  }
  const ttfb = await page.$$eval('#chart-ttfb g[data-key="ttfb_p50_ms"] circle', (cs) => cs.map((c) => Number(c.dataset.value)));
  assert.ok(ttfb.some((v) => v > 0), `p50 TTFB points: ${ttfb}`);
  // Both pools' requests landed somewhere; the shares within a pool add up to all of it.
  await page.waitForFunction(() => document.querySelector('tr[data-backend="dash-3"] [data-field="share"]').textContent === "100%");
  const shares = await page.$$eval('#backends tbody tr', (trs) =>
    Object.fromEntries(trs.map((tr) => [tr.dataset.backend, tr.querySelector('[data-field="share"]').textContent])));
  const east = ["dash-1", "dash-2"].map((id) => (shares[id] === "—" ? 0 : parseFloat(shares[id])));
  assert.ok(Math.abs(east[0] + east[1] - 100) <= 1, JSON.stringify(shares));

  mkdirSync(ARTIFACTS, { recursive: true });
  const shot = path.join(ARTIFACTS, "dashboard.png");
  await page.screenshot({ path: shot, fullPage: true });
  if (process.env.UPDATE_SCREENSHOT === "1") copyFileSync(shot, path.join(ROOT, "docs/src/images/dashboard.png"));
});

test("drain and undrain a backend, and probe a pool, from the page", async () => {
  await page.click('tr[data-backend="dash-2"] button[data-action="drain"]');
  await waitFor(async () => ["draining", "drained"].includes((await backend("dash-2")).lifecycle), { what: "dash-2 draining" });
  await page.waitForSelector('tr[data-backend="dash-2"] button[data-action="undrain"]');
  assert.match(await page.$eval('tr[data-backend="dash-2"] [data-field="lifecycle"]', (td) => td.textContent), /drain/);

  await page.click('tr[data-backend="dash-2"] button[data-action="undrain"]');
  await waitFor(async () => (await backend("dash-2")).lifecycle === "ready", { what: "dash-2 ready again" });
  await page.waitForSelector('tr[data-backend="dash-2"] button[data-action="drain"]');

  await page.click('#pools tr[data-pool="gpu-west"] button[data-action="probe"]');
  await waitFor(() => actions.includes("POST /admin/pools/gpu-west/probe 200"), { what: "the page's probe call" });
  assert.deepEqual(
    actions.filter((a) => a.startsWith("PATCH")),
    ["PATCH /admin/backends/dash-2 200", "PATCH /admin/backends/dash-2 200"],
  );
});

test("forgetting the token signs out, and the page raised no errors or CSP violations", async () => {
  await page.click("#forget");
  await page.waitForSelector("#login:not([hidden])");
  assert.equal(await page.evaluate(() => sessionStorage.length), 0);
  assert.deepEqual(problems, []);
});
