#!/usr/bin/env bash
# Fails when the checked-in stubs (kvloom/v1/, kvloom/worker/v1/) are not what
# scripts/gen_protos.sh produces from protos/ today.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$root/scripts/gen_protos.sh" "$tmp"
status=0
while IFS= read -r f; do
  rel=${f#"$tmp"/}
  if ! cmp -s "$f" "$root/$rel"; then
    echo "stale generated stub: $rel (run scripts/gen_protos.sh)" >&2
    status=1
  fi
done < <(find "$tmp" -type f -name '*_pb2*')
while IFS= read -r f; do
  rel=${f#"$root"/}
  [ -e "$tmp/$rel" ] || { echo "orphan stub: $rel" >&2; status=1; }
done < <(find "$root/kvloom" -type f -name '*_pb2*' -not -path '*/__pycache__/*')
exit $status
