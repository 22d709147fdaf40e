#!/usr/bin/env bash
# Installs kvloom into .venv, then starts a local cluster on the embedded
# default model (SmolLM2-135M-Instruct; a controlplane and two pipeline-stage
# workers), streams the answer to a chat prompt, and shuts the cluster down.
#   scripts/quickstart.sh ["your prompt"]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
echo "== installing kvloom into .venv (no root; about two minutes on a first run, seconds after)"
scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
prompt=${1:-"What is the capital of France? Answer in one sentence."}
exec kvloom run --pp 2 "$prompt"
