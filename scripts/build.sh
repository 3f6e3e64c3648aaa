#!/usr/bin/env bash
# Builds the Worker to build/ (worker-build --release) with the toolchain chosen by scripts/env.sh.
# wrangler runs this too (wrangler.toml [build] command), so it must work from wrangler's environment.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT_DIR"
for tool in "$WASM_BINDGEN_BIN" "$CARGO_BIN_DIR/worker-build" "$ESBUILD_BIN"; do
  [ -x "$tool" ] || { echo "build: $tool is missing; run 'make setup'" >&2; exit 1; }
done
PATH="$WASM_PATH" worker-build --release
