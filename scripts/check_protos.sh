#!/usr/bin/env bash
# Fails when the checked-in stubs under kvloom/v1/ are not what
# scripts/gen_protos.sh produces from protos/ today.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$root/scripts/gen_protos.sh" "$tmp"
status=0
for f in "$tmp"/kvloom/v1/*; do
  name=$(basename "$f")
  if ! cmp -s "$f" "$root/kvloom/v1/$name"; then
    echo "stale generated stub: kvloom/v1/$name (run scripts/gen_protos.sh)" >&2
    status=1
  fi
done
for f in "$root"/kvloom/v1/*_pb2*.py*; do
  [ -e "$tmp/kvloom/v1/$(basename "$f")" ] || { echo "orphan stub: $f" >&2; status=1; }
done
exit $status
