#!/usr/bin/env bash
# Wheels the GPU check needs on a machine that cannot reach PyPI (the device
# machine this workplace lends: Python 3.12, x86-64, with torch, transformers,
# tokenizers, safetensors and prometheus-client already there, nothing
# fetchable). Run here, where pip works; it fills .whl/ (git-ignored), which a
# device run carries and scripts/gpu_check.sh installs from first.
#   protobuf, grpcio   the versions this checkout's generated stubs were
#                      built with (older runtimes refuse to load them)
#   flashinfer-python  0.6.18, the API the FlashInfer backend is written
#                      against (JIT: kernels compile on the device with its
#                      nvcc), and apache-tvm-ffi, its one import-time
#                      dependency the device image lacks
# Usage: scripts/gpu_wheels.sh [--python-version 3.12] [--dest .whl]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
pyver=3.12
dest=.whl
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) pyver=$2; shift ;;
    --dest) dest=$2; shift ;;
    *) echo "gpu_wheels.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
py=python3
[[ -x .venv/bin/python ]] && py=.venv/bin/python
# The runtime versions of this checkout's stubs: the ones installed here.
protobuf=$("$py" -c 'import google.protobuf as p; print(p.__version__)')
grpcio=$("$py" -c 'import grpc; print(grpc.__version__)')
mkdir -p "$dest"
rm -f "$dest"/*.whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp "${platforms[@]}" -d "$dest" \
  "protobuf==$protobuf" "grpcio==$grpcio" "flashinfer-python==0.6.18" \
  "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0"
ls -l "$dest"
du -sh "$dest"
