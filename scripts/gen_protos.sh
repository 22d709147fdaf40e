#!/usr/bin/env bash
# Regenerates the Python stubs of protos/kvloom/v1/*.proto into kvloom/v1/.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: the repository root)
# CI runs it into a temporary directory and fails when the result differs
# from the checked-in stubs (scripts/check_protos.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
mkdir -p "$out"
python -m grpc_tools.protoc -I "$root/protos" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$root"/protos/kvloom/v1/*.proto
