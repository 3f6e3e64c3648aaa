#!/usr/bin/env bash
# `make bench` / `make bench-quick` / `make bench-traces` / `make bench-goodput`: the routing
# benchmark of bench/README.md (`scripts/bench.sh full|quick|traces|classic|goodput [loadgen
# flags]`; the mode names bench/config/<mode>.json). `goodput` hands over to `loadgen goodput`
# instead of `loadgen bench` (its smoke mode, `--quick`, writes under bench/tmp/goodput-quick).
#
# Builds the Worker once and runs it in one workerd process through Miniflare
# (bench/gateway-server.mjs: loaded once, so edits to src/ during a run cannot reload it), or with
# BENCH_GATEWAY=wrangler a snapshot of it under `wrangler dev`; either way with its own persist dir
# and admin token in bench/tmp, so the user's .dev.vars and .wrangler/state are untouched. Then it
# hands over to `loadgen bench`, which manages the
# fleet of vllm-sim backends, runs every policy on every workload and writes bench/results/.
# Every process this script starts is stopped on exit. Extra arguments go to `loadgen bench`
# (e.g. `--only chat --policies round_robin,cache_aware --levels 0.9`); BENCH_OUT changes the output
# dir.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT_DIR"

MODE="${1:-full}"
CONFIG="bench/config/$MODE.json"
[ -f "$CONFIG" ] || { echo "bench: no config $CONFIG" >&2; exit 2; }
shift || true
PORT="${BENCH_PORT:-8799}"
GATEWAY="http://127.0.0.1:$PORT"
TMP="bench/tmp"
mkdir -p "$TMP"
LOADGEN="${LOADGEN_BIN:-target/release/loadgen}"
# Bounds of the whole run (the quick one is meant to take under 8 minutes, the full one under 30,
# the trace replays under 15).
# The goodput search is bounded by its config's probes (bench/README.md gives its durations).
SUBCOMMAND=bench
OUT="${BENCH_OUT:-bench/results}"
case "$MODE" in
  quick) LIMIT=600 ;;
  traces) LIMIT=1500 ;;
  goodput)
    SUBCOMMAND=goodput
    LIMIT="${GOODPUT_LIMIT_S:-21600}"
    case " $* " in *" --quick "*) LIMIT=600; OUT="${BENCH_OUT:-$TMP/goodput-quick}" ;; esac ;;
  *) LIMIT=2700 ;;
esac

if curl -fsS "$GATEWAY/healthz" >/dev/null 2>&1; then
  echo "bench: port $PORT is already serving; set BENCH_PORT to a free port" >&2
  exit 1
fi

WRANGLER_PID=""
stop_all() {
  trap - EXIT INT TERM
  if [ -n "$WRANGLER_PID" ]; then
    kill -TERM -- "-$WRANGLER_PID" 2>/dev/null || kill -TERM "$WRANGLER_PID" 2>/dev/null || true
    wait "$WRANGLER_PID" 2>/dev/null || true
  fi
}
trap stop_all EXIT INT TERM

echo "bench: building the Worker (make build)"
make --no-print-directory build >/dev/null

rm -rf "$TMP/worker" "$TMP/state"
TOKEN="bench-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"

# The gateway: the built Worker in one workerd through Miniflare (bench/gateway-server.mjs), or with
# BENCH_GATEWAY=wrangler under `wrangler dev` (which adds its proxy worker's hop to every request).
if [ "${BENCH_GATEWAY:-workerd}" = wrangler ]; then
  # A snapshot of the built Worker with a config that has no build step.
  mkdir -p "$TMP/worker"
  cp -r build "$TMP/worker/build"
  awk '/^\[build\]/ { skip = 1; next } /^\[/ { skip = 0 } !skip' wrangler.toml >"$TMP/worker/wrangler.toml"
  setsid npx wrangler dev --config "$TMP/worker/wrangler.toml" --ip 127.0.0.1 --port "$PORT" \
    --persist-to "$TMP/state" --test-scheduled --show-interactive-dev-session=false \
    --var "ADMIN_TOKEN:$TOKEN" --var PROBE_INTERVAL_MS:1000 --var ALLOW_IP_BACKENDS:true --var REQUIRE_CLIENT_KEYS:false >"$TMP/wrangler.log" 2>&1 &
  WRANGLER_PID=$!
  echo "bench: starting the gateway under wrangler dev on $GATEWAY (log: $TMP/wrangler.log)"
  export BENCH_GATEWAY_RUNTIME="wrangler dev"
else
  ADMIN_TOKEN="$TOKEN" setsid node bench/gateway-server.mjs "$PORT" "$TMP/state" >"$TMP/wrangler.log" 2>&1 &
  WRANGLER_PID=$!
  echo "bench: starting the gateway (the built Worker in workerd) on $GATEWAY (log: $TMP/wrangler.log)"
  export BENCH_GATEWAY_RUNTIME="workerd (Miniflare, no wrangler dev proxy)"
fi
for _ in $(seq 1 240); do
  curl -fsS "$GATEWAY/healthz" >/dev/null 2>&1 && break
  if ! kill -0 "$WRANGLER_PID" 2>/dev/null; then
    echo "bench: wrangler dev exited; last lines of $TMP/wrangler.log:" >&2
    tail -n 30 "$TMP/wrangler.log" >&2
    exit 1
  fi
  sleep 0.5
done
curl -fsS "$GATEWAY/healthz" >/dev/null || { echo "bench: the gateway did not come up" >&2; exit 1; }

echo "bench: machine: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -1)"
ADMIN_TOKEN="$TOKEN" timeout "$LIMIT" "$LOADGEN" "$SUBCOMMAND" --config "$CONFIG" --gateway "$GATEWAY" \
  --sim-bin "$VLLM_SIM_BIN" --out-dir "$OUT" --tmp-dir "$TMP" "$@"
