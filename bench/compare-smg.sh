#!/usr/bin/env bash
# `make bench-compare-smg`: the production-trace replays of `make bench-traces` through the SGLang /
# Shepherd model gateway (PyPI `smg` 1.9.0, policy `cache_aware`) instead of ours, for the
# side-by-side figures issue 26 asks for (bench/README.md, "Against the SGLang/Shepherd gateway").
#
#   bench/compare-smg.sh [--with-gateway] [--requests N] [--only NAME[:SPEEDUP],...]
#
# Installs smg into a venv under bench/tmp/smg-venv on first use. Then, for every trace window and
# speed-up of bench/config/traces.json (COMPARE_CONFIG changes the file): starts the config's fleet
# of vllm-sim backends on 127.0.0.1 with the arguments `loadgen bench` gives them (fresh caches every
# cell), starts smg in front of them on a free 127.0.0.1 port (a fresh smg too: its prefix tree is
# empty), replays the window with `loadgen run` and stops both. With --with-gateway each cell also
# runs through our gateway's default policy in the same run: the built Worker in workerd
# (bench/gateway-server.mjs, as scripts/bench.sh starts it) and `loadgen bench --only ... --speedups
# ... --policies <default>`, which manages its own fleet exactly as `make bench-traces` does
# (BENCH_PORT: its port, 8799; COMPARE_GATEWAY_URL with ADMIN_TOKEN: a gateway already running on
# 127.0.0.1 instead). Writes bench/results/<date>-compare-smg.{md,json} (BENCH_OUT changes the
# directory). --requests N cuts every window to N requests (a smoke test; the table says so).
# Every process this script starts is stopped on exit; it talks only to 127.0.0.1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT_DIR"

SMG_VERSION="1.9.0"
CONFIG="${COMPARE_CONFIG:-bench/config/traces.json}"
WITH_GATEWAY=0
REQUESTS=""
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --with-gateway) WITH_GATEWAY=1 ;;
    --requests) REQUESTS="${2:?--requests N}"; shift ;;
    --only) ONLY="${2:?--only NAME[:SPEEDUP],...}"; shift ;;
    -h | --help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "compare-smg: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -f "$CONFIG" ] || { echo "compare-smg: no config $CONFIG" >&2; exit 2; }
[ -z "$REQUESTS" ] || [[ "$REQUESTS" =~ ^[1-9][0-9]*$ ]] || { echo "compare-smg: --requests $REQUESTS: a positive integer" >&2; exit 2; }

TMP="bench/tmp/compare-smg"
OUT_DIR="${BENCH_OUT:-bench/results}"
LOADGEN="${LOADGEN_BIN:-target/release/loadgen}"
VENV="bench/tmp/smg-venv"
SMG="$VENV/bin/smg"
GATEWAY_PORT="${BENCH_PORT:-8799}"
GATEWAY="http://127.0.0.1:$GATEWAY_PORT"
GATEWAY_TOKEN=""
for bin in "$LOADGEN" "$VLLM_SIM_BIN"; do
  [ -x "$bin" ] || { echo "compare-smg: $bin is missing: cargo build --release -p loadgen -p vllm-sim" >&2; exit 1; }
done
rm -rf "$TMP"
mkdir -p "$TMP" "$OUT_DIR"

# smg, installed on demand (bench/smg-install.sh: an existing venv with this version is kept).
SMG_VERSION="$SMG_VERSION" bench/smg-install.sh >/dev/null

# The run's config: the given one, every window cut to --requests if given (loadgen run and loadgen
# bench both read it, so seed, fleet, timeouts and windows are the same for both gateways).
python3 - "$CONFIG" "$TMP/config.json" "$REQUESTS" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
if sys.argv[3]:
    for w in cfg["workloads"]:
        w["workload"]["requests"] = int(sys.argv[3])
json.dump(cfg, open(sys.argv[2], "w"), indent=2)
EOF
RUN_CONFIG="$TMP/config.json"

# The fleet as `loadgen bench` starts it (tools/loadgen/src/bench/fleet.rs), and the cells.
eval "$(python3 - "$RUN_CONFIG" <<'EOF'
import json, shlex, sys
cfg = json.load(open(sys.argv[1]))
f = cfg["fleet"]
q = lambda v: shlex.quote(str(v))
print(f"MODEL={q(cfg['model'])}")
print(f"DEFAULT_POLICY={q(cfg['default_policy'])}")
print(f"BACKENDS={q(f['backends'])}")
print(f"BASE_PORT={q(f['base_port'])}")
print(f"KV_BLOCKS={q(f['kv_blocks'])}")
print(f"TIME_SCALE={q(f['time_scale'])}")
print("EXTRA_ARGS=(" + " ".join(q(a) for a in f.get("extra_args", [])) + ")")
print(f"REQUEST_TIMEOUT={q(cfg['request_timeout_s'])}")
EOF
)"
mapfile -t CELLS < <(python3 - "$RUN_CONFIG" "$ONLY" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
only = [o for o in sys.argv[2].split(",") if o]
for w in cfg["workloads"]:
    t = w["workload"]
    if t.get("kind") != "trace":
        continue
    for x in w.get("replay_speedups", []):
        name = w.get("name", "trace")
        if only and not any(o in (name, f"{name}:{x:g}") for o in only):
            continue
        fields = [name, t["path"], t.get("scale", 16), t.get("output_scale") or "", t.get("start", 0),
                  t.get("requests", 0), t.get("duration_s", 0), t.get("block_tokens", 512),
                  t.get("max_input_tokens", 0), f"{x:g}", w["max_duration_s"]]
        print("|".join(str(v) for v in fields))
EOF
)
[ "${#CELLS[@]}" -gt 0 ] || { echo "compare-smg: no trace cell in $CONFIG matches --only $ONLY" >&2; exit 2; }

SIM_PIDS=()
SMG_PID=""
GATEWAY_PID=""
stop_fleet() {
  local p
  for p in "${SIM_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${SIM_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  SIM_PIDS=()
}
# smg drains for a few seconds on SIGTERM (its load-balancer settle window); after a cell nothing is
# in flight, so it gets 10 s and then SIGKILL.
stop_group() {
  local pid="$1" _
  [ -n "$pid" ] || return 0
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
# A command under `timeout` (its own process group: on the limit, or from stop_all, the whole group
# is signalled, `loadgen bench`'s own fleet included), waited for so that a signal to this script
# is handled at once.
BOUNDED_PID=""
run_bounded() {
  local limit="$1" rc=0
  shift
  timeout "$limit" "$@" &
  BOUNDED_PID=$!
  wait "$BOUNDED_PID" || rc=$?
  BOUNDED_PID=""
  return "$rc"
}
stop_all() {
  trap - EXIT INT TERM
  if [ -n "$BOUNDED_PID" ]; then
    kill -TERM -- "-$BOUNDED_PID" 2>/dev/null || kill -TERM "$BOUNDED_PID" 2>/dev/null || true
    wait "$BOUNDED_PID" 2>/dev/null || true
  fi
  stop_group "$SMG_PID"
  SMG_PID=""
  stop_fleet
  stop_group "$GATEWAY_PID"
  GATEWAY_PID=""
}
trap stop_all EXIT
trap 'exit 130' INT TERM

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

members() {
  local i
  for i in $(seq 0 $((BACKENDS - 1))); do echo "http://127.0.0.1:$((BASE_PORT + i))"; done
}

# (Re)starts the fleet with empty caches: the flags of tools/loadgen/src/bench/fleet.rs.
start_fleet() {
  local i port _
  stop_fleet
  for i in $(seq 0 $((BACKENDS - 1))); do
    port=$((BASE_PORT + i))
    if curl -fsS -m 1 "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
      echo "compare-smg: port $port is already serving; the fleet needs ports $BASE_PORT-$((BASE_PORT + BACKENDS - 1))" >&2
      exit 1
    fi
    "$VLLM_SIM_BIN" --port "$port" --model "$MODEL" --kv-blocks "$KV_BLOCKS" --time-scale "$TIME_SCALE" \
      --seed "$port" --report-engine-timing "${EXTRA_ARGS[@]}" >/dev/null 2>>"$TMP/sim-$port.log" &
    SIM_PIDS+=($!)
    for _ in $(seq 1 400); do
      curl -fsS -m 1 "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
      sleep 0.025
    done
    curl -fsS -m 1 "http://127.0.0.1:$port/health" >/dev/null || { echo "compare-smg: vllm-sim on port $port did not come up" >&2; exit 1; }
  done
}

# smg in front of the fleet (`smg launch --help`). Its cache_aware defaults (cache threshold 0.3,
# balance thresholds 64 / 1.5, eviction every 60 s, tree of 2^26, KV-usage thresholds off) are kept;
# --block-size is the fleet's (vllm-sim's 64-token blocks, vLLM 0.34's; with HTTP workers smg
# matches on its approximate tree of the request text, the block size only counts in its
# event-driven mode). Its Prometheus listener would bind 0.0.0.0:29000 by default, so it gets a
# free loopback port too.
SMG_CMD=()
start_smg() {
  local port="$1" prom _
  prom=$(free_port)
  mapfile -t urls < <(members)
  SMG_CMD=("$SMG" launch --host 127.0.0.1 --port "$port" --worker-urls "${urls[@]}" --policy cache_aware
    --block-size 64 --prometheus-host 127.0.0.1 --prometheus-port "$prom")
  setsid "${SMG_CMD[@]}" >>"$TMP/smg.log" 2>&1 &
  SMG_PID=$!
  # Up when /readiness counts every worker healthy (its /health answers before they are registered).
  for _ in $(seq 1 240); do
    if curl -fsS -m 1 "http://127.0.0.1:$port/readiness" 2>/dev/null |
      python3 -c "import json, sys; sys.exit(0 if json.load(sys.stdin).get('healthy_workers') == $BACKENDS else 1)" 2>/dev/null; then
      return 0
    fi
    kill -0 "$SMG_PID" 2>/dev/null || { echo "compare-smg: smg exited; last lines of $TMP/smg.log:" >&2; tail -n 30 "$TMP/smg.log" >&2; exit 1; }
    sleep 0.25
  done
  echo "compare-smg: smg did not report $BACKENDS healthy workers in 60 s; last lines of $TMP/smg.log:" >&2
  tail -n 30 "$TMP/smg.log" >&2
  exit 1
}

# Our gateway, as scripts/bench.sh starts it: the built Worker in one workerd (Miniflare), its own
# persist dir and admin token.
# COMPARE_GATEWAY_URL (a 127.0.0.1 URL) with ADMIN_TOKEN: a gateway that is already running instead.
start_gateway() {
  local _
  if [ -n "${COMPARE_GATEWAY_URL:-}" ]; then
    [[ "$COMPARE_GATEWAY_URL" =~ ^http://(127\.0\.0\.1|localhost|\[::1\]):[0-9]+/?$ ]] ||
      { echo "compare-smg: COMPARE_GATEWAY_URL must be a loopback http://HOST:PORT" >&2; exit 2; }
    [ -n "${ADMIN_TOKEN:-}" ] || { echo "compare-smg: COMPARE_GATEWAY_URL needs ADMIN_TOKEN" >&2; exit 2; }
    GATEWAY="${COMPARE_GATEWAY_URL%/}"
    GATEWAY_TOKEN="$ADMIN_TOKEN"
    curl -fsS -m 2 "$GATEWAY/healthz" >/dev/null || { echo "compare-smg: $GATEWAY does not answer /healthz" >&2; exit 1; }
    return 0
  fi
  if curl -fsS -m 1 "http://127.0.0.1:$GATEWAY_PORT/healthz" >/dev/null 2>&1; then
    echo "compare-smg: port $GATEWAY_PORT is already serving; set BENCH_PORT to a free port" >&2
    exit 1
  fi
  if [ ! -f build/index.js ]; then
    echo "compare-smg: building the Worker (make build)"
    make --no-print-directory build >/dev/null
  fi
  GATEWAY_TOKEN="bench-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  ADMIN_TOKEN="$GATEWAY_TOKEN" setsid node bench/gateway-server.mjs "$GATEWAY_PORT" "$TMP/state" >"$TMP/gateway.log" 2>&1 &
  GATEWAY_PID=$!
  for _ in $(seq 1 240); do
    curl -fsS -m 1 "http://127.0.0.1:$GATEWAY_PORT/healthz" >/dev/null 2>&1 && return 0
    kill -0 "$GATEWAY_PID" 2>/dev/null || { echo "compare-smg: the gateway exited; last lines of $TMP/gateway.log:" >&2; tail -n 30 "$TMP/gateway.log" >&2; exit 1; }
    sleep 0.5
  done
  echo "compare-smg: the gateway did not come up" >&2
  exit 1
}

# One line per cell on the terminal: a `loadgen run` report or a `loadgen bench` result's one run.
summary() {
  python3 - "$1" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
runs = doc["runs"] if "runs" in doc else [doc]
if not runs:
    sys.exit(f"compare-smg: {sys.argv[1]} has no run (skipped: {doc.get('skipped')})")
r = runs[0]
t = r["trace"]
f = lambda v: "failed" if v is None else f"{v:.0f} ms"
print(f"    TTFT p50 {f(t['ttft_ms']['p50'])} p99 {f(t['ttft_ms']['p99'])}, E2E p99 {f(t['e2e_ms']['p99'])}, "
      f"hit rate {r['hit_rate'] * 100:.1f}%, {t['failed']} of {t['sent']} failed")
EOF
}

echo "compare-smg: machine: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -1), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "compare-smg: ${#CELLS[@]} cells from $CONFIG${REQUESTS:+ (every window cut to $REQUESTS requests)}; smg $SMG_VERSION cache_aware$([ "$WITH_GATEWAY" = 0 ] || echo " and our gateway's $DEFAULT_POLICY")"
[ "$WITH_GATEWAY" = 0 ] || start_gateway

MANIFEST="$TMP/manifest.tsv"
: >"$MANIFEST"
STARTED="$(date -u '+%Y-%m-%d %H:%M:%S') UTC"
SECONDS=0
for cell in "${CELLS[@]}"; do
  IFS='|' read -r name path scale oscale start requests duration block maxin speedup maxdur <<<"$cell"
  label="$name-replay-x$speedup"
  # A cell is bounded by the config's max_duration_s plus one request timeout and a margin.
  limit=$(python3 -c "import math; print(math.ceil($maxdur + $REQUEST_TIMEOUT + 30))")

  echo "[${SECONDS}s] $label: smg cache_aware (fresh fleet, fresh smg)"
  start_fleet
  smg_port=$(free_port)
  start_smg "$smg_port"
  metrics=()
  while read -r u; do metrics+=(--metrics "$u"); done < <(members)
  trace_args=(--trace "$path" --trace-scale "$scale" --trace-start "$start" --trace-requests "$requests"
    --trace-duration-s "$duration" --trace-block-tokens "$block" --trace-max-input-tokens "$maxin")
  [ -z "$oscale" ] || trace_args+=(--trace-output-scale "$oscale")
  if ! run_bounded "$limit" "$LOADGEN" run --config "$RUN_CONFIG" "${trace_args[@]}" --trace-speedup "$speedup" \
    --url "http://127.0.0.1:$smg_port" "${metrics[@]}" --time-scale "$TIME_SCALE" --max-duration "$maxdur" \
    --policy smg-cache_aware --records "$TMP/records-$label-smg.jsonl" >"$TMP/report-$label-smg.json"; then
    echo "compare-smg: loadgen run failed for $label through smg" >&2
    exit 1
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$speedup" "smg $SMG_VERSION (cache_aware)" "$TMP/report-$label-smg.json" >>"$MANIFEST"
  stop_group "$SMG_PID"
  SMG_PID=""
  stop_fleet
  summary "$TMP/report-$label-smg.json"

  if [ "$WITH_GATEWAY" = 1 ]; then
    echo "[${SECONDS}s] $label: our gateway, $DEFAULT_POLICY (loadgen bench: fresh fleet, re-registered pool)"
    gw_dir="$TMP/gateway-$label"
    ADMIN_TOKEN="$GATEWAY_TOKEN" run_bounded "$((limit + 90))" "$LOADGEN" bench --config "$RUN_CONFIG" \
      --gateway "$GATEWAY" --sim-bin "$VLLM_SIM_BIN" --out-dir "$gw_dir" --tmp-dir "$gw_dir" \
      --only "$name" --speedups "$speedup" --policies "$DEFAULT_POLICY" >"$gw_dir.path" 2>"$gw_dir.log" ||
      { echo "compare-smg: loadgen bench failed for $label; last lines of $gw_dir.log:" >&2; tail -n 20 "$gw_dir.log" >&2; exit 1; }
    summary "$(cat "$gw_dir.path")"
    printf '%s\t%s\t%s\t%s\n' "$name" "$speedup" "ours ($DEFAULT_POLICY)" "$(cat "$gw_dir.path")" >>"$MANIFEST"
  fi
done
stop_all

# The table: loadgen's trace figures (failed requests count as infinitely slow in the percentiles).
STEM="$(date -u +%F)-compare-smg"
for suffix in "" -b -c -d -e -f -g -h; do
  [ -e "$OUT_DIR/$STEM$suffix.md" ] || { STEM="$STEM$suffix"; break; }
done
python3 - "$MANIFEST" "$OUT_DIR/$STEM" "$STARTED" "$SECONDS" "$CONFIG" "$REQUESTS" "$WITH_GATEWAY" \
  "$DEFAULT_POLICY" "${SMG_CMD[*]}" "$ONLY" <<'EOF'
import glob, json, os, subprocess, sys
manifest, stem, started, seconds, config, requests, with_gateway, default_policy, smg_cmd, only = sys.argv[1:]
rows = []
for line in open(manifest):
    trace, speedup, gateway, path = line.rstrip("\n").split("\t")
    doc = json.load(open(path))
    r = doc["runs"][0] if "runs" in doc else doc
    rows.append({"trace": trace, "speedup": float(speedup), "gateway": gateway, "report": path, "run": r})

def ms(v):
    return "*failed*" if v is None else f"{v:,.0f} ms" if v >= 10 else f"{v:.1f} ms"

def line(row, source=""):
    r, t = row["run"], row["run"]["trace"]
    return (f"| {row['trace']} | x{row['speedup']:g} | {row['gateway']}{source} | {ms(t['ttft_ms']['p50'])} | "
            f"{ms(t['ttft_ms']['p90'])} | {ms(t['ttft_ms']['p99'])} | {ms(t['e2e_ms']['p99'])} | "
            f"{t['failed']} / {t['sent']} | {r['hit_rate'] * 100:.1f}% | {r['requests_per_s']:.1f} |")

# Without --with-gateway (and with the config's full windows): our default policy's figures from the
# newest traces result, for reference only (another run, another machine state).
reference, ref_name, ref_started = [], None, None
if with_gateway != "1" and not requests:
    docs = []
    for p in glob.glob("bench/results/*-traces*.json"):
        try:
            d = json.load(open(p))
            docs.append((d.get("started", ""), p, d))
        except (OSError, ValueError):
            pass
    if docs:
        ref_started, ref_name, d = max(docs, key=lambda x: (x[0], x[1]))
        for row in rows:
            for r in d.get("runs", []):
                if (r.get("workload") == row["trace"] and r.get("mode") == f"replay-x{row['speedup']:g}"
                        and r.get("policy") == d.get("default_policy", default_policy) and r.get("trace")):
                    reference.append({"trace": row["trace"], "speedup": row["speedup"],
                                      "gateway": f"ours ({r['policy']})", "report": ref_name, "run": r})

machine = f"{os.cpu_count()} cores, " + subprocess.run(
    "lscpu | sed -n 's/^Model name: *//p' | head -1", shell=True, capture_output=True, text=True).stdout.strip()
out = [f"# Production traces: our gateway against the SGLang/Shepherd gateway (smg), {started}", ""]
if requests:
    out += [f"**Smoke run: every window cut to {requests} requests; these figures are not comparable "
            "with the full windows.**", ""]
out += [
    f"`bench/compare-smg.sh{' --with-gateway' if with_gateway == '1' else ''}{' --requests ' + requests if requests else ''}"
    f"{' --only ' + only if only else ''}` "
    f"on {machine}; {int(seconds)} s. Windows, speed-ups, fleet and seed: `{config}`. Every cell on a fresh fleet "
    "(and a fresh smg, or a re-registered pool). Failed requests count as infinitely slow in every percentile "
    "(*failed*: the percentile falls among them). Hit rate: the fleet's prefix-cache hits over prompt tokens "
    "(the backends' `/metrics`).", "",
    f"smg: `{smg_cmd}`" if smg_cmd else "", "",
    "| trace | speed-up | gateway (policy) | TTFT p50 | TTFT p90 | TTFT p99 | E2E p99 | failed / sent | hit rate | req/s |",
    "|---|---|---|---|---|---|---|---|---|---|",
]
for row in rows:
    out.append(line(row))
for row in reference:
    out.append(line(row, " †"))
if reference:
    out += ["", f"† Not measured in this run: our default policy's figures from `{ref_name}` (another run, "
            f"started {ref_started}), for reference only; `--with-gateway` measures both in the same run."]
ratios = []
for row in rows:
    if not row["gateway"].startswith("smg"):
        continue
    ours = [x for x in rows + reference if x["trace"] == row["trace"] and x["speedup"] == row["speedup"]
            and x["gateway"].startswith("ours")]
    a, b = (ours[0]["run"]["trace"]["ttft_ms"]["p99"] if ours else None), row["run"]["trace"]["ttft_ms"]["p99"]
    if ours and a is not None and b is not None:
        ratios.append(f"{row['trace']} x{row['speedup']:g}: {a / b:.2f}")
if ratios:
    out += ["", "TTFT p99, ours over smg's (below 1: ours is ahead)" + (" †" if reference else "") + ": "
            + "; ".join(ratios) + "."]
open(stem + ".md", "w").write("\n".join(out) + "\n")
json.dump({"started": started, "seconds": int(seconds), "config": config, "requests_override": requests or None,
           "only": only or None,
           "smg_command": smg_cmd, "machine": machine,
           "cells": [{"trace": x["trace"], "speedup": x["speedup"], "gateway": x["gateway"], "report": x["report"],
                      "ttft_ms": x["run"]["trace"]["ttft_ms"], "e2e_ms": x["run"]["trace"]["e2e_ms"],
                      "failed": x["run"]["trace"]["failed"], "sent": x["run"]["trace"]["sent"],
                      "hit_rate": x["run"]["hit_rate"], "requests_per_s": x["run"]["requests_per_s"]}
                     for x in rows + reference]},
          open(stem + ".json", "w"), indent=2)
print("\n".join(out))
EOF
echo "compare-smg: wrote $OUT_DIR/$STEM.md and .json (raw reports and logs: $TMP)"
