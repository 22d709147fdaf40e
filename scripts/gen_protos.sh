#!/usr/bin/env bash
# Regenerates the Python stubs of every protos/**/*.proto next to its package:
# protos/kvloom/v1 (the public client API) -> kvloom/v1/, protos/kvloom/worker/v1
# (the controlplane <-> workerd protocol) -> kvloom/worker/v1/, protos/kvloom/kvtransfer/v1
# (controlplane <-> controlplane, prefill/decode disaggregation) -> kvloom/kvtransfer/v1/.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: the repository root)
# CI runs it into a temporary directory and fails when the result differs
# from the checked-in stubs (scripts/check_protos.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
mkdir -p "$out"
cd "$root/protos"
# Paths relative to -I, so the descriptors name kvloom/... and not this machine's paths.
mapfile -t protos < <(find kvloom -name '*.proto' | sort)
python -m grpc_tools.protoc -I . \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "${protos[@]}"
