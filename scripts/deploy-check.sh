#!/usr/bin/env bash
# `make deploy-check`: builds what `wrangler deploy` would upload, offline and without a login
# (`wrangler deploy --dry-run --outdir`), and checks its size against Cloudflare's Worker size limit.
#
# The limit checked is the platform's current one, 64 MiB uncompressed on every plan (Cloudflare
# replaced the compressed 3 MB Free / 10 MB Paid limits with it in September 2026; wrangler 4.164's
# own bundle reporter measures against 64 MiB too). The gzip size is also held to 3 MiB, the former
# Free-plan limit, as this project's budget: a bigger Worker starts more slowly on a cold isolate.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT_DIR"

LIMIT_KIB=$((64 * 1024))
GZIP_BUDGET_KIB=$((3 * 1024))
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# wrangler runs the [build] command (make build) itself, as a real deploy would.
if ! npx wrangler deploy --dry-run --outdir "$OUT/bundle" >"$OUT/log" 2>&1; then
  echo "deploy-check: wrangler deploy --dry-run failed:" >&2
  tail -n 40 "$OUT/log" >&2
  exit 1
fi
# "Total Upload: 2345.67 KiB / gzip: 789.01 KiB" (colour codes stripped).
line=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/log" | grep -m1 '^Total Upload:' || true)
if [[ ! "$line" =~ Total\ Upload:\ ([0-9.]+)\ KiB\ /\ gzip:\ ([0-9.]+)\ KiB ]]; then
  echo "deploy-check: no 'Total Upload' line in wrangler's output:" >&2
  cat "$OUT/log" >&2
  exit 1
fi
size=${BASH_REMATCH[1]}
gzip=${BASH_REMATCH[2]}
for binding in POOL DIRECTORY RATE_LIMITER; do
  grep -q "$binding" "$OUT/log" || { echo "deploy-check: the dry run lists no $binding binding" >&2; cat "$OUT/log" >&2; exit 1; }
done
files=$(cd "$OUT/bundle" && find . -type f -printf '%P (%s bytes) ' | sed 's/ $//')

verdict=$(awk -v s="$size" -v g="$gzip" -v l="$LIMIT_KIB" -v b="$GZIP_BUDGET_KIB" 'BEGIN {
  printf "deploy-check: bundle %.0f KiB uncompressed, %.1f%% of the 64 MiB Worker size limit; gzip %.0f KiB, %.1f%% of the 3 MiB budget\n", s, 100 * s / l, g, 100 * g / b
  exit (s > l || g > b) ? 1 : 0
}') && ok=1 || ok=0
echo "$verdict"
echo "deploy-check: files: $files"
if [ "$ok" -ne 1 ]; then
  echo "deploy-check: FAILED: the Worker is over the limit or the budget" >&2
  exit 1
fi
