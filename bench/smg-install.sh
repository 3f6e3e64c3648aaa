#!/usr/bin/env bash
# Installs the SGLang/Shepherd model gateway (PyPI `smg`, the version below) into a venv under
# bench/tmp/smg-venv, for bench/compare-smg.sh and `make bench-goodput` (bench/config/goodput.json
# runs it as the smg router's set-up). Idempotent: an existing venv with this version is kept.
# Needs python3 with venv and access to PyPI (or a pip configured with a local index); prints the
# smg binary's path.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT_DIR"

SMG_VERSION="${SMG_VERSION:-1.9.0}"
VENV="bench/tmp/smg-venv"
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('smg') == '$SMG_VERSION'" 2>/dev/null; then
  echo "smg-install: installing smg==$SMG_VERSION into $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "smg==$SMG_VERSION" >&2
fi
echo "$VENV/bin/smg"
