#!/usr/bin/env bash
# The first thing to run on a CUDA machine: does kvloom's CUDA/NCCL path work,
# and how fast is it? Writes a results folder (default results/gpu_check):
#   env.txt                     nvidia-smi, torch/CUDA/flashinfer versions, GPUs
#   parity_1x1_bfloat16_torch.json       TP=1 greedy parity vs transformers in bf16
#   parity_1x1_bfloat16_flashinfer.json  the same through FlashInfer's kernels
#                               (when flashinfer imports), decode steps as CUDA
#                               graphs (workerd/runner/cuda_graphs.py)
#   parity_1x1_bfloat16_flashinfer_eager.json  the same with --enforce-eager
#   parity_2x1_/1x2_*.json      TP=2 and PP=2 over NCCL (when >= 2 GPUs)
#   serving_*.json              benchmarks/serving.py (and --big-model);
#                               serving_*_flashinfer{,_eager}.json: CUDA graphs vs eager
#   summary.txt                 one line per step: ok, FAILED or skipped
# Every step but the flashinfer ones runs the plain-PyTorch attention (the
# reference, comparable with earlier runs) whatever auto would pick. Each step
# is bounded by STEP_TIMEOUT_S (default 240) and the whole run by
# TOTAL_BUDGET_S (default 540), so one hang cannot eat the run.
#
# Models: parity runs on a 4-layer random Llama with head_dim 64 (FlashInfer's
# kernels need 64/128/256) generated from a fixed seed; the benchmark on the
# default SmolLM2 where it can be loaded, else on a random model of SmolLM2's
# shape (30 layers, hidden 576, 9 heads / 3 KV heads) with the test tokenizer.
#
# Offline machines (the device machine this workplace lends cannot reach
# PyPI): run scripts/gpu_wheels.sh where pip works first; it fills .whl/,
# which this script installs (no index, no dependencies) into a private
# folder on PYTHONPATH before anything else. See docs/deployment.md.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--out DIR] [--big-model DIR]
#   --dry-run   CPU only, float32, the tiny test model, tiny benchmark: checks
#               that the script itself works (CI runs it). No install.
# Without --dry-run it needs a CUDA GPU; if the torch found is the CPU wheel
# it tries to install the CUDA build (needs PyPI access) first.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dry_run=0
out=results/gpu_check
big_model=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --out) out=$2; shift ;;
    --big-model) big_model=$2; shift ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
if [[ -f .venv/bin/activate ]]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
# Some images have only python3.
PY=$(command -v python || command -v python3)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
step_timeout=${STEP_TIMEOUT_S:-240}
budget=${TOTAL_BUDGET_S:-540}
for pair in "STEP_TIMEOUT_S=$step_timeout" "TOTAL_BUDGET_S=$budget"; do
  if ! [[ ${pair#*=} =~ ^[0-9]{1,5}$ ]] || (( ${pair#*=} < 1 )); then
    echo "gpu_check.sh: $pair: expected whole seconds, 1 to 99999" >&2
    exit 2
  fi
done
# The whole run's budget (a device call is cut at 600 s): a step gets what is
# left of it, and none starts with under 20 s left.
deadline=$(( $(date +%s) + budget ))

step() {  # step NAME COMMAND...: run (bounded), record ok/FAILED, keep going
  local name=$1; shift
  local left=$(( deadline - $(date +%s) ))
  if (( left < 20 )); then
    echo "skipped $name: out of time (TOTAL_BUDGET_S)" >> "$summary"
    return
  fi
  (( left > step_timeout )) && left=$step_timeout
  echo "== $name (at most ${left} s)"
  if timeout "$left" "$@"; then echo "ok      $name" >> "$summary"
  else echo "FAILED  $name (exit $?)" >> "$summary"; fi
}

if [[ $dry_run == 0 ]] && compgen -G ".whl/*.whl" > /dev/null; then
  echo "== installing the carried wheels (.whl/) into /tmp/kvloom-site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvloom-site .whl/*.whl
  export PYTHONPATH="/tmp/kvloom-site:$PYTHONPATH"
fi

{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not found"
  "$PY" -c 'import sys, torch, grpc, google.protobuf as pb, transformers as t
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "gpus", torch.cuda.device_count())
print("grpcio", grpc.__version__, "protobuf", pb.__version__, "transformers", t.__version__)'
} > "$out/env.txt" 2>&1 || true
cat "$out/env.txt"

# A random Llama from kvloom_testing/checkpoints.py, printed path. $1: where; the rest:
# make_tiny_llama keyword arguments as name=value.
make_model() {
  "$PY" - "$@" <<'PY'
import sys
from kvloom_testing.checkpoints import make_tiny_llama
kwargs = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
print(make_tiny_llama(sys.argv[1], **kwargs))
PY
}

if [[ $dry_run == 1 ]]; then
  device=cpu; dtype=float32; gpus=0
  parity_model=$(make_model "$(mktemp -d)/tiny")
  bench_model=$parity_model
  bench_args=(--num-requests 4 --concurrency 2 --prompt-len 8 --max-tokens 4)
else
  if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "== installing the CUDA build of torch 2.13.0"
    "$PY" -m pip install --quiet --retries 0 --timeout 20 "torch==2.13.0" \
      --index-url https://download.pytorch.org/whl/cu128
  fi
  if ! "$PY" -c 'import flashinfer' 2>/dev/null; then
    # Best effort (fails fast offline): without it the FlashInfer steps are skipped.
    "$PY" -m pip install --quiet --retries 0 --timeout 20 flashinfer-python \
      || echo "flashinfer-python: not installed"
  fi
  "$PY" -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' >> "$out/env.txt" 2>&1 \
    || echo "flashinfer: does not import" >> "$out/env.txt"
  device=cuda; dtype=bfloat16
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  models=$(mktemp -d)
  parity_model=$(make_model "$models/parity" hidden_size=256 num_heads=4 num_kv_heads=2 \
    intermediate_size=512 num_layers=4)
  if ! bench_model=$("$PY" -c 'from kvloom.common.default_model import default_model_dir
print(default_model_dir())' 2>> "$out/env.txt"); then
    echo "default model unavailable: benchmarking a random SmolLM2-shaped model" >> "$out/env.txt"
    bench_model=$(make_model "$models/smollm2-shaped" num_layers=30 hidden_size=576 \
      num_heads=9 num_kv_heads=3 intermediate_size=1536 max_position_embeddings=2048)
  fi
  bench_args=(--num-requests 64 --concurrency 16 --prompt-len 128 --max-tokens 64)
fi
bench_name=$(basename "$bench_model")

step "TP=1 parity ($dtype)" "$PY" scripts/gpu_parity.py --model "$parity_model" \
  --dtype "$dtype" --device "$device" --layout 1x1 --out "$out" --attention-backend torch
if [[ $dry_run == 0 ]]; then
  if "$PY" -c 'import flashinfer' 2>/dev/null; then
    step "TP=1 parity ($dtype, flashinfer attention, CUDA graphs)" "$PY" scripts/gpu_parity.py \
      --model "$parity_model" --dtype "$dtype" --device "$device" --layout 1x1 --out "$out" \
      --attention-backend flashinfer
    step "TP=1 parity ($dtype, flashinfer attention, eager)" "$PY" scripts/gpu_parity.py \
      --model "$parity_model" --dtype "$dtype" --device "$device" --layout 1x1 --out "$out" \
      --attention-backend flashinfer --enforce-eager
    step "decode CUDA graphs vs eager, token by token (pytest -m gpu)" "$PY" -m pytest -q \
      -p no:cacheprovider -m gpu tests/workerd/runner/test_cuda_graphs.py \
      tests/workerd/layers/test_flashinfer_backend.py
  else
    echo "skipped flashinfer parity, graphs and benchmarks: flashinfer does not import" \
      >> "$summary"
  fi
fi
if [[ $gpus -ge 2 ]]; then
  step "TP=2 parity over NCCL" "$PY" scripts/gpu_parity.py --model "$parity_model" \
    --dtype "$dtype" --device "$device" --layout 2x1 --out "$out" --attention-backend torch
  step "PP=2 parity over NCCL" "$PY" scripts/gpu_parity.py --model "$parity_model" \
    --dtype "$dtype" --device "$device" --layout 1x2 --out "$out" --attention-backend torch
fi
step "serving benchmark ($bench_name)" "$PY" benchmarks/serving.py --launch \
  --model "$bench_model" --layouts 1x1 "${bench_args[@]}" --json "$out/serving_$bench_name.json" \
  -- --dtype "$dtype" --attention-backend torch
if [[ $dry_run == 0 ]] && "$PY" -c 'import flashinfer' 2>/dev/null; then
  for eager in "" --enforce-eager; do
    step "serving benchmark ($bench_name, flashinfer${eager:+, eager})" \
      "$PY" benchmarks/serving.py --launch --model "$bench_model" --layouts 1x1 \
      "${bench_args[@]}" --json "$out/serving_${bench_name}_flashinfer${eager:+_eager}.json" \
      -- --dtype "$dtype" --attention-backend flashinfer $eager
  done
fi
if [[ -n $big_model ]]; then
  step "serving benchmark ($(basename "$big_model"))" "$PY" benchmarks/serving.py --launch \
    --model "$big_model" --layouts 1x1 "${bench_args[@]}" \
    --json "$out/serving_$(basename "$big_model").json" -- --dtype "$dtype" --attention-backend torch
fi

echo "== summary ($summary)"
cat "$summary"
! grep -q FAILED "$summary"
