// The operators' view: reads the admin API with the admin token and draws pools, backends and
// the last hour's charts. Every string from the API reaches the DOM through textContent or
// setAttribute, never as markup. Served by the Worker (src/operator/dashboard.rs) with a strict
// CSP.
"use strict";

const TOKEN_KEY = "llm-gateway.admin-token";
const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777", "#0891b2", "#4b5563"];
// ?refresh=<ms> overrides the refresh period (tests use a short one); never below half a second.
const REFRESH_MS = Math.max(500, Number(new URLSearchParams(location.search).get("refresh")) || 5000);

const $ = (id) => document.getElementById(id);
let timer = null;
let busy = false;

// ---- DOM helpers: text only ----

/** An element with attributes and children; strings become text nodes. */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

/** An SVG element with attributes and children. */
function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function setAttrs(node, attrs) {
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) throw new Error("event handlers are attached with addEventListener");
    node.setAttribute(k, String(v));
  }
}

function append(node, children) {
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

// ---- Formatting ----

const fmt = {
  num(v, digits = 0) {
    return typeof v === "number" && Number.isFinite(v) ? v.toFixed(digits) : "—";
  },
  pct(v) {
    return typeof v === "number" && Number.isFinite(v) ? `${(v * 100).toFixed(v < 0.1 && v > 0 ? 1 : 0)}%` : "—";
  },
  age(ms) {
    if (typeof ms !== "number" || !ms) return "never";
    const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
    if (s < 90) return `${s} s ago`;
    if (s < 5400) return `${Math.round(s / 60)} min ago`;
    return `${Math.round(s / 3600)} h ago`;
  },
  clock(ms) {
    return new Date(ms).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  },
};

/** A small coloured label for a state: good, warn or bad. */
function badge(text, tone) {
  return el("span", { class: `badge ${tone}` }, text ?? "—");
}

const TONES = {
  lifecycle: { ready: "good", pending: "warn", draining: "warn", drained: "bad" },
  health: { healthy: "good", loading: "warn", unknown: "warn", unhealthy: "bad" },
  breaker: { closed: "good", half_open: "warn", open: "bad" },
};

// ---- The admin API ----

class Unauthorized extends Error {}

/** Calls the admin API with the token; answers the JSON body or throws its error message. */
async function api(path, { method = "GET", body } = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) throw new Unauthorized("No admin token.");
  const resp = await fetch(path, {
    method,
    headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: "no-store",
    credentials: "omit",
  });
  let data = null;
  try {
    data = await resp.json();
  } catch {
    data = null;
  }
  if (resp.status === 401) throw new Unauthorized(data?.error?.message ?? "The admin token was refused.");
  if (!resp.ok) throw new Error(data?.error?.message ?? `${method} ${path} answered ${resp.status}`);
  return data;
}

// ---- Sign in / out ----

function showLogin(message = "") {
  clearTimeout(timer);
  $("main").hidden = true;
  $("forget").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message;
  $("status").textContent = "Signed out.";
  $("token").focus();
}

function signIn(event) {
  event.preventDefault();
  const token = $("token").value.trim();
  if (!token) return;
  sessionStorage.setItem(TOKEN_KEY, token);
  $("token").value = "";
  $("login").hidden = true;
  refresh();
}

function forget() {
  sessionStorage.removeItem(TOKEN_KEY);
  showLogin();
}

// ---- Refresh ----

async function refresh() {
  clearTimeout(timer);
  if (busy) return;
  busy = true;
  try {
    const [pools, backends] = await Promise.all([api("/admin/pools"), api("/admin/backends")]);
    const poolList = Array.isArray(pools?.data) ? pools.data : [];
    const histories = await Promise.all(
      poolList.map((p) =>
        api(`/admin/pools/${encodeURIComponent(p.pool)}/history`).catch((e) => ({ pool: p.pool, error: e.message })),
      ),
    );
    const backendList = Array.isArray(backends?.data) ? backends.data : [];
    render(poolList, backendList, histories);
    $("main").hidden = false;
    $("forget").hidden = false;
    $("status").textContent =
      `Updated ${new Date().toLocaleTimeString()} · ${poolList.length} pools · ${backendList.length} backends · every ${REFRESH_MS / 1000} s`;
    $("status").className = "";
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes ?? 0) + 1);
  } catch (e) {
    if (e instanceof Unauthorized) {
      sessionStorage.removeItem(TOKEN_KEY);
      busy = false;
      showLogin(e.message);
      return;
    }
    $("status").textContent = `Refresh failed: ${e.message}`;
    $("status").className = "error";
  }
  busy = false;
  timer = setTimeout(refresh, REFRESH_MS);
}

/** Runs an admin action from a button, then refreshes; errors go to the status line. */
async function act(button, label, fn) {
  button.disabled = true;
  $("status").textContent = `${label}…`;
  try {
    await fn();
    $("status").textContent = `${label}: done.`;
  } catch (e) {
    if (e instanceof Unauthorized) return showLogin(e.message);
    $("status").textContent = `${label} failed: ${e.message}`;
    $("status").className = "error";
  }
  await refresh();
}

// ---- Rendering ----

function render(pools, backends, histories) {
  renderPools(pools);
  const shares = new Map();
  for (const h of histories) {
    for (const b of h?.backends ?? []) shares.set(`${h.pool}\u0000${b.id}`, b.share);
  }
  renderBackends(backends, shares);
  renderCharts(histories);
}

/** A pool's time card: predicted TTFT (ms) with nothing, 1,024 and 8,192 tokens to prefill, plus its queue. */
function timeCard(card) {
  if (!card) return "—";
  if (card.cached_ms == null) return "full";
  const queue = card.queued ? ` · ${card.queued} queued (+${card.queue_wait_ms} ms)` : "";
  return `${card.cached_ms} / ${card.short_ms} / ${card.long_ms} ms${queue}`;
}

function renderPools(pools) {
  const body = $("pools").tBodies[0];
  const byRegion = new Map();
  for (const p of pools) {
    const region = p.region || "(no region)";
    if (!byRegion.has(region)) byRegion.set(region, []);
    byRegion.get(region).push(p);
  }
  const rows = [];
  for (const [region, list] of [...byRegion.entries()].sort(([a], [b]) => a.localeCompare(b))) {
    const sum = (f) => list.reduce((s, p) => s + (Number(f(p)) || 0), 0);
    rows.push(
      el("tr", { class: "region", "data-region": region },
        el("th", { scope: "rowgroup" }, region),
        el("td", {}, `${list.length} pool${list.length === 1 ? "" : "s"}`),
        el("td", {}, `${sum((p) => p.ready_backends)} / ${sum((p) => p.backends)}`),
        el("td", {}, fmt.num(sum((p) => p.in_flight))),
        el("td", {}, fmt.num(sum((p) => p.waiting))),
        el("td", {}, fmt.num(sum((p) => p.running))),
        el("td", {}, fmt.num(sum((p) => p.autoscaling?.desired_replicas))),
        el("td", { colspan: 3 }),
      ),
    );
    for (const p of list.sort((a, b) => String(a.pool).localeCompare(String(b.pool)))) {
      const probe = el("button", { type: "button", "data-action": "probe", "data-pool": p.pool }, "Probe now");
      probe.addEventListener("click", () =>
        act(probe, `Probing ${p.pool}`, () => api(`/admin/pools/${encodeURIComponent(p.pool)}/probe`, { method: "POST" })),
      );
      rows.push(
        el("tr", { "data-pool": p.pool },
          el("td", { class: "name" }, p.pool, p.saturated ? badge("saturated", "bad") : null),
          el("td", {}, p.policy ?? "—"),
          el("td", {}, `${p.ready_backends ?? 0} / ${p.backends ?? 0}`),
          el("td", {}, fmt.num(p.in_flight)),
          el("td", {}, fmt.num(p.waiting)),
          el("td", {}, fmt.num(p.running)),
          el("td", { "data-field": "desired" }, fmt.num(p.autoscaling?.desired_replicas)),
          el("td", { "data-field": "card" }, timeCard(p.time_card), p.jurisdiction ? badge(p.jurisdiction, "") : null),
          el("td", {}, fmt.age(p.last_probe_ms)),
          el("td", {}, probe),
        ),
      );
    }
  }
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 10, class: "empty" }, "No pools yet: register a backend.")));
  body.replaceChildren(...rows);
}

function renderBackends(backends, shares) {
  const body = $("backends").tBodies[0];
  const rows = [...backends]
    .sort((a, b) => `${a.pool}/${a.id}`.localeCompare(`${b.pool}/${b.id}`))
    .map((b) => {
      const draining = b.lifecycle === "draining" || b.lifecycle === "drained";
      const action = el("button", { type: "button", "data-action": draining ? "undrain" : "drain" }, draining ? "Undrain" : "Drain");
      action.addEventListener("click", () =>
        act(action, `${draining ? "Undraining" : "Draining"} ${b.id}`, () =>
          api(`/admin/backends/${encodeURIComponent(b.id)}?pool=${encodeURIComponent(b.pool)}`, {
            method: "PATCH",
            body: { drain: !draining },
          }),
        ),
      );
      const probe = b.last_probe;
      const probeCell = probe
        ? el("td", { title: probe.error ?? `ok in ${probe.duration_ms} ms` },
            badge(probe.error ? "failed" : "ok", probe.error ? "bad" : "good"), " ", fmt.age(probe.at_ms))
        : el("td", {}, "never");
      const share = shares.get(`${b.pool}\u0000${b.id}`);
      return el("tr", { "data-backend": b.id },
        el("td", { class: "name" }, b.id, b.delete_pending ? badge("deleting", "warn") : null),
        el("td", {}, b.pool),
        el("td", { class: "models" }, (b.served_models?.length ? b.served_models : b.models ?? []).join(", ")),
        el("td", { "data-field": "lifecycle" }, badge(b.lifecycle, TONES.lifecycle[b.lifecycle] ?? "warn")),
        el("td", { "data-field": "health" }, badge(b.health, TONES.health[b.health] ?? "warn")),
        el("td", { "data-field": "breaker" }, badge(b.breaker, TONES.breaker[b.breaker] ?? "warn")),
        el("td", {}, fmt.num(b.leases_in_flight)),
        el("td", {}, fmt.pct(b.load)),
        // A scrape without vllm:* series (--disable-log-stats): the load is unknown, not zero.
        b.load_unknown
          ? el("td", { "data-field": "load-unknown", title: "its /metrics has no vllm:* series: priced as the most loaded known backend" }, badge("load unknown", "warn"))
          : el("td", {}, fmt.pct(b.scraped?.kv_usage)),
        b.load_unknown ? el("td", {}, "?") : el("td", {}, fmt.num(b.scraped?.waiting)),
        probeCell,
        el("td", { "data-field": "share" }, share === undefined ? "—" : fmt.pct(share)),
        el("td", {}, action),
      );
    });
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 13, class: "empty" }, "No backends registered.")));
  body.replaceChildren(...rows);
}

// ---- Charts: hand-written SVG, one line per pool ----

const CHARTS = [
  { id: "rate", title: "Requests per second", series: [{ key: "requests_per_s" }], format: (v) => fmt.num(v, v < 10 ? 2 : 0) },
  { id: "errors", title: "Error rate (5xx, timeouts, connection errors, 429)", series: [{ key: "error_rate" }], format: fmt.pct, max: 1 },
  {
    id: "ttfb",
    title: "Time to first byte, ms (p50 solid, p99 dashed)",
    series: [{ key: "ttfb_p50_ms" }, { key: "ttfb_p99_ms", dashed: true }],
    format: (v) => fmt.num(v),
  },
  {
    id: "cache",
    title: "Prefix-cache hit rate (vLLM solid, router's estimate dashed)",
    series: [{ key: "prefix_cache_hit_rate" }, { key: "routed_cache_hit_rate", dashed: true }],
    format: fmt.pct,
    max: 1,
  },
];

const W = 520, H = 190, PAD = { left: 52, right: 12, top: 10, bottom: 26 };

/** A round number at or above `v`, so the y axis reads well. */
function niceCeil(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function renderCharts(histories) {
  const box = $("charts");
  const ok = histories.filter((h) => Array.isArray(h?.minutes));
  const now = Math.max(Date.now(), ...ok.map((h) => h.now_ms ?? 0));
  const windowMs = Math.max(...ok.map((h) => (h.window_minutes ?? 60) * (h.minute_ms ?? 60000)), 3600000);
  const start = now - windowMs;
  const x = (t) => PAD.left + ((t - start) / windowMs) * (W - PAD.left - PAD.right);

  const figures = CHARTS.map((chart) => {
    const lines = [];
    let maxValue = 0;
    ok.forEach((h, i) => {
      for (const s of chart.series) {
        const points = h.minutes
          .map((m) => ({ t: m.start_ms + Math.min(m.span_ms ?? 60000, 60000) / 2, v: m[s.key] }))
          .filter((p) => typeof p.v === "number" && Number.isFinite(p.v) && p.t >= start);
        for (const p of points) maxValue = Math.max(maxValue, p.v);
        lines.push({ pool: h.pool, color: COLORS[i % COLORS.length], dashed: s.dashed, key: s.key, points });
      }
    });
    const top = chart.max ?? niceCeil(maxValue * 1.1);
    const y = (v) => H - PAD.bottom - (Math.min(v, top) / top) * (H - PAD.top - PAD.bottom);
    const grid = [0, 0.5, 1].map((f) =>
      svg("g", { class: "grid" },
        svg("line", { x1: PAD.left, x2: W - PAD.right, y1: y(top * f), y2: y(top * f) }),
        svg("text", { x: PAD.left - 6, y: y(top * f) + 4, "text-anchor": "end" }, chart.format(top * f)),
      ),
    );
    const ticks = [0, 15, 30, 45, 60].map((m) =>
      svg("text", { class: "tick", x: x(now - (60 - m) * 60000), y: H - 8, "text-anchor": "middle" }, m === 60 ? "now" : `-${60 - m} min`),
    );
    const drawn = lines
      .filter((l) => l.points.length)
      .map((l) =>
        svg("g", { class: "series", "data-pool": l.pool, "data-key": l.key },
          svg("polyline", {
            points: l.points.map((p) => `${x(p.t).toFixed(1)},${y(p.v).toFixed(1)}`).join(" "),
            stroke: l.color,
            "stroke-dasharray": l.dashed ? "5 4" : null,
          }),
          l.points.map((p) =>
            svg("circle", { cx: x(p.t).toFixed(1), cy: y(p.v).toFixed(1), r: 2.5, fill: l.color, "data-value": p.v },
              svg("title", {}, `${l.pool} · ${fmt.clock(p.t)} · ${chart.format(p.v)}`)),
          ),
        ),
      );
    const empty = drawn.length ? null : svg("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet");
    const legend = el("ul", { class: "legend" },
      ok.map((h, i) => el("li", {}, el("span", { class: "swatch", "data-color": i % COLORS.length }), h.pool)),
    );
    return el("figure", { id: `chart-${chart.id}`, "data-points": lines.reduce((n, l) => n + l.points.length, 0) },
      el("figcaption", {}, chart.title),
      svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": chart.title }, grid, ticks, drawn, empty),
      legend,
    );
  });
  box.replaceChildren(...figures);

  const failed = histories.filter((h) => h?.error).map((h) => `${h.pool}: ${h.error}`);
  const bytes = ok.reduce((s, h) => s + (h.memory_bytes ?? 0), 0);
  $("history-note").textContent =
    `Per-minute aggregates kept by each pool's Durable Object (the current minute so far included); ` +
    `${ok.length} pools hold ${(bytes / 1024).toFixed(1)} KiB of history.` +
    (failed.length ? ` No history from ${failed.join("; ")}.` : "");
}

// ---- Start ----

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", signIn);
  $("forget").addEventListener("click", forget);
  if (sessionStorage.getItem(TOKEN_KEY)) refresh();
  else showLogin();
});
