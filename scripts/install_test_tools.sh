#!/usr/bin/env bash
# Installs what only the tests need and a plain install does not: Debian's
# prometheus (promtool and a server the metrics tests start on loopback; its
# service is not used), which needs root or sudo, which is why
# scripts/install.sh (and so the quickstart) does not do it; and the npm
# packages of docs/api.md's Node example. scripts/test.sh calls this. Safe to
# re-run: each step is skipped when its tool is already there.
set -euo pipefail
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null; then
  echo "== installing prometheus (apt; for the metrics tests)"
  sudo_=""
  [ "$(id -u)" = 0 ] || sudo_="sudo"  # CI runs as root; a developer may not
  $sudo_ apt-get update -qq
  $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi

# @grpc/grpc-js + @grpc/proto-loader (npm, pinned) for the Node example in
# docs/api.md, which tests/docs/test_api_examples.py runs; into .tools/node
# (git-ignored), no root needed. grpcurl has no Debian/PyPI/npm package; its
# example runs only where a grpcurl binary is already on PATH.
root=$(cd "$(dirname "$0")/.." && pwd)
node_dir="$root/.tools/node"
if command -v npm >/dev/null 2>&1 && [ ! -d "$node_dir/node_modules/@grpc/proto-loader" ]; then
  echo "== installing @grpc/grpc-js and @grpc/proto-loader (npm) into .tools/node"
  mkdir -p "$node_dir"
  npm install --silent --no-audit --no-fund --prefix "$node_dir" \
    @grpc/grpc-js@1.14.7 @grpc/proto-loader@0.8.1 >/dev/null
fi
