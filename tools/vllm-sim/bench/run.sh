#!/usr/bin/env bash
# Benchmarks vllm-sim on this machine: builds the sim and the bench client (bench.rs), then for each
# measurement starts a fresh vllm-sim on a loopback port, runs the client against it and stops it.
# Everything stays on 127.0.0.1 and every loop is bounded in time. Figures go to stdout; README.md
# records the ones measured on the project's 2-core machine.
#
# Usage: tools/vllm-sim/bench/run.sh [SECONDS]   (default 10 s per measurement)
set -euo pipefail

ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT_DIR/target}"
SECONDS_PER_RUN="${1:-10}"
PORT="${VLLM_SIM_BENCH_PORT:-18999}"
ADDR="127.0.0.1:$PORT"

cd "$ROOT_DIR"
cargo build --release -p vllm-sim --bin vllm-sim --example bench >/dev/null
SIM="$TARGET_DIR/release/vllm-sim"
BENCH="$TARGET_DIR/release/examples/bench"
SIM_PID=""

stop_sim() {
  if [ -n "$SIM_PID" ] && kill -0 "$SIM_PID" 2>/dev/null; then
    kill "$SIM_PID" && wait "$SIM_PID" 2>/dev/null || true
  fi
  SIM_PID=""
}
trap stop_sim EXIT

start_sim() {
  "$SIM" --host 127.0.0.1 --port "$PORT" "$@" >/dev/null 2>&1 &
  SIM_PID=$!
  for _ in $(seq 1 100); do
    if curl -fs "http://$ADDR/health" >/dev/null 2>&1; then
      echo "# vllm-sim $*  (pid $SIM_PID, idle RSS $(awk '/VmRSS/ {print $2/1024 " MiB"}' /proc/$SIM_PID/status))"
      return 0
    fi
    sleep 0.05
  done
  echo "vllm-sim did not start" >&2
  exit 1
}

# 1. Short non-streamed requests: 256-byte prompts (64 tokens), 4 output tokens each.
start_sim --time-scale 1000 --max-num-seqs 256
"$BENCH" --mode rps --addr "$ADDR" --connections 64 --seconds "$SECONDS_PER_RUN" --server-pid "$SIM_PID"
stop_sim

# 2. Thousands of concurrent streams, all running (max-num-seqs above the stream count).
start_sim --time-scale 10 --max-num-seqs 4096 --kv-blocks 65536
"$BENCH" --mode streams --addr "$ADDR" --streams 3000 --seconds "$SECONDS_PER_RUN" --server-pid "$SIM_PID"
stop_sim

# 3. The same streams against --max-num-seqs 64 (the sim's default before it took vLLM 0.34's 256):
#    most wait in the queue, all stay open.
start_sim --time-scale 100 --max-num-seqs 64
"$BENCH" --mode streams --addr "$ADDR" --streams 3000 --seconds "$SECONDS_PER_RUN" --server-pid "$SIM_PID"
stop_sim

# 4. Memory with a full cache: 100k blocks (1.6M tokens), each round of 400 x 16 KB prompts fills it.
start_sim --time-scale 1000 --kv-blocks 100000 --max-num-batched-tokens 65536 --max-model-len 8192
"$BENCH" --mode fill --addr "$ADDR" --rounds 5 --per-round 400 --prompt-bytes 16000 --server-pid "$SIM_PID"
stop_sim
