#!/usr/bin/env bash
# `make dev`: the gateway on 127.0.0.1:8787 under `wrangler dev`, with three simulated vLLM backends
# registered through the admin API. Ctrl-C stops every process this script started.
#
# State persists in .wrangler/state, so registered backends survive a restart (re-registering then
# answers 409, which is fine). The admin token is generated into .dev.vars on first run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT_DIR"

PORT="${PORT:-8787}"
MODEL="${MODEL:-meta-llama/Llama-3.1-8B-Instruct}"
SIM_PORTS=(8101 8102 8103)
GATEWAY="http://127.0.0.1:$PORT"
PIDS=()

stop_all() {
  trap - EXIT INT TERM
  echo
  echo "dev: stopping ${#PIDS[@]} processes"
  # Each child leads its own process group (setsid), so the group takes wrangler's workerd too.
  for pid in "${PIDS[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}
trap stop_all EXIT INT TERM

if [ ! -f .dev.vars ] || ! grep -q '^ADMIN_TOKEN=' .dev.vars; then
  echo "ADMIN_TOKEN=dev-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')" >>.dev.vars
  echo "dev: generated a local admin token in .dev.vars"
fi
ADMIN_TOKEN=$(grep '^ADMIN_TOKEN=' .dev.vars | head -1 | cut -d= -f2-)

mkdir -p .wrangler
for port in "${SIM_PORTS[@]}"; do
  if curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
    echo "dev: port $port is already serving; reusing it"
    continue
  fi
  setsid "$VLLM_SIM_BIN" --port "$port" --model "$MODEL" --time-scale 1 --seed "$port" >".wrangler/sim-$port.log" 2>&1 &
  PIDS+=($!)
done

# The simulated backends listen on 127.0.0.1: allow IP-addressed backends locally. wrangler.toml's
# deploy configuration is closed (REQUIRE_CLIENT_KEYS = "true"); locally the OpenAI surface stays
# open until a key is minted, so the examples below work without one.
setsid npx wrangler dev --ip 127.0.0.1 --port "$PORT" --persist-to .wrangler/state --test-scheduled \
  --var ALLOW_IP_BACKENDS:true --var REQUIRE_CLIENT_KEYS:false \
  >.wrangler/dev.log 2>&1 &
PIDS+=($!)
echo "dev: starting wrangler dev (build + workerd); log in .wrangler/dev.log"

for _ in $(seq 1 600); do
  curl -fsS "$GATEWAY/healthz" >/dev/null 2>&1 && break
  if ! kill -0 "${PIDS[-1]}" 2>/dev/null; then
    echo "dev: wrangler dev exited; last lines of .wrangler/dev.log:" >&2
    tail -n 30 .wrangler/dev.log >&2
    exit 1
  fi
  sleep 0.5
done
curl -fsS "$GATEWAY/healthz" >/dev/null || { echo "dev: gateway did not come up" >&2; exit 1; }

for i in "${!SIM_PORTS[@]}"; do
  port=${SIM_PORTS[$i]}
  code=$(curl -sS -o /dev/null -w '%{http_code}' -X POST "$GATEWAY/admin/backends" \
    -H "authorization: Bearer $ADMIN_TOKEN" -H 'content-type: application/json' \
    -d "{\"id\":\"sim-$((i + 1))\",\"url\":\"http://127.0.0.1:$port\",\"models\":[\"$MODEL\"],\"region\":\"local\"}")
  case "$code" in
    201) echo "dev: registered sim-$((i + 1)) -> http://127.0.0.1:$port" ;;
    409) echo "dev: sim-$((i + 1)) already registered (persisted state)" ;;
    *) echo "dev: registering sim-$((i + 1)) failed with HTTP $code" >&2 ;;
  esac
done
# Fire the cron trigger once so the pools probe their backends now rather than within a minute,
# and wait until each is ready (probed healthy, models listed): a request sent before that gets
# 404 model_not_found, so the instructions below would fail if printed earlier.
curl -fsS "$GATEWAY/__scheduled?cron=*+*+*+*+*" >/dev/null || true
for i in "${!SIM_PORTS[@]}"; do
  ready=""
  for _ in $(seq 1 60); do
    if curl -fsS "$GATEWAY/admin/backends/sim-$((i + 1))" -H "authorization: Bearer $ADMIN_TOKEN" 2>/dev/null |
      grep -q '"lifecycle":"ready"'; then
      ready=1
      break
    fi
    sleep 0.5
  done
  [ -n "$ready" ] || echo "dev: sim-$((i + 1)) is not ready yet (see .wrangler/sim-${SIM_PORTS[$i]}.log)" >&2
done

cat <<EOF

  Gateway:     $GATEWAY   (admin token: $ADMIN_TOKEN, in .dev.vars)
  Backends:    3 x vllm-sim on ports ${SIM_PORTS[*]} serving $MODEL

  curl $GATEWAY/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "$MODEL", "stream": true, "messages": [{"role": "user", "content": "Hello!"}]}'

  curl $GATEWAY/admin/backends -H 'authorization: Bearer $ADMIN_TOKEN'

  .venv/bin/python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="$GATEWAY/v1", api_key="unused-locally")
stream = client.chat.completions.create(model="$MODEL", stream=True,
    messages=[{"role": "user", "content": "Hello!"}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY

  Ctrl-C stops the gateway and the simulated backends.
EOF
wait "${PIDS[-1]}"
