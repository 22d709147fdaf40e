#!/usr/bin/env bash
# The first thing to run on a CUDA machine: does kvloom's CUDA/NCCL path work,
# and how fast is it? Writes a results folder (default results/gpu_check):
#   env.txt                     nvidia-smi, torch/CUDA versions, GPUs
#   parity_1x1_bfloat16_torch.json       TP=1 greedy parity vs transformers in bf16
#   parity_1x1_bfloat16_flashinfer.json  the same through FlashInfer's kernels
#                               (when flashinfer-python installs and imports),
#                               decode steps as CUDA graphs (workerd/cuda_graphs.py)
#   parity_1x1_bfloat16_flashinfer_eager.json  the same with --enforce-eager
#   parity_2x1_/1x2_*.json      TP=2 and PP=2 over NCCL (when >= 2 GPUs)
#   serving_*.json              benchmarks/serving.py on SmolLM2 (and --big-model);
#                               serving_*_flashinfer{,_eager}.json: CUDA graphs vs eager
#   summary.txt                 one line per step, ok/FAILED
# Every step but the flashinfer one runs the plain-PyTorch attention (the
# reference, comparable with earlier runs) whatever auto would pick.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--out DIR] [--big-model DIR]
#   --dry-run   CPU only, float32, the tiny test model, tiny benchmark: checks
#               that the script itself works (CI runs it). No install.
# Without --dry-run it needs a CUDA GPU; if the torch in .venv is the CPU
# wheel it installs the CUDA build (needs PyPI access) first.
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
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME COMMAND...: run, record ok/FAILED, keep going
  local name=$1; shift
  echo "== $name"
  if "$@"; then echo "ok      $name" >> "$summary"
  else echo "FAILED  $name" >> "$summary"; fi
}

{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not found"
  python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), "gpus", torch.cuda.device_count())'
} > "$out/env.txt" 2>&1 || true
cat "$out/env.txt"

if [[ $dry_run == 1 ]]; then
  device=cpu; dtype=float32; gpus=0
  model=$(python -c 'import sys, tempfile, pathlib
from tests.factories import make_tiny_llama
d = pathlib.Path(tempfile.mkdtemp(prefix="kvloom-gpu-check-")) / "tiny"
make_tiny_llama(d); print(d)')
  bench_args=(--num-requests 4 --concurrency 2 --prompt-len 8 --max-tokens 4)
else
  if ! python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "== installing the CUDA build of torch 2.13.0"
    python -m pip install --quiet "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu128
  fi
  # Best effort: without it the FlashInfer parity step is skipped, not failed.
  python -m pip install --quiet flashinfer-python || echo "flashinfer-python: not installed"
  python -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' >> "$out/env.txt" 2>&1 \
    || echo "flashinfer: does not import" >> "$out/env.txt"
  device=cuda; dtype=bfloat16
  gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
  model=$(python -c 'from kvloom.server.default_model import default_model_dir; print(default_model_dir())')
  bench_args=(--num-requests 64 --concurrency 16 --prompt-len 128 --max-tokens 64)
fi

step "TP=1 parity ($dtype)" python scripts/gpu_parity.py --model "$model" --dtype "$dtype" \
  --device "$device" --layout 1x1 --out "$out" --attention-backend torch
if [[ $dry_run == 0 ]]; then
  if python -c 'import flashinfer' 2>/dev/null; then
    step "TP=1 parity ($dtype, flashinfer attention, CUDA graphs)" python scripts/gpu_parity.py \
      --model "$model" --dtype "$dtype" --device "$device" --layout 1x1 --out "$out" \
      --attention-backend flashinfer
    step "TP=1 parity ($dtype, flashinfer attention, eager)" python scripts/gpu_parity.py \
      --model "$model" --dtype "$dtype" --device "$device" --layout 1x1 --out "$out" \
      --attention-backend flashinfer --enforce-eager
    step "decode CUDA graphs vs eager, token by token (pytest -m gpu)" python -m pytest -q \
      -m gpu tests/workerd/test_cuda_graphs.py tests/workerd/test_flashinfer_backend.py
    for eager in "" --enforce-eager; do
      step "serving benchmark ($(basename "$model"), flashinfer${eager:+, eager})" \
        python benchmarks/serving.py --launch --model "$model" --layouts 1x1 "${bench_args[@]}" \
        --json "$out/serving_$(basename "$model")_flashinfer${eager:+_eager}.json" \
        -- --dtype "$dtype" --attention-backend flashinfer $eager
    done
  else
    echo "skipped TP=1 parity ($dtype, flashinfer attention): flashinfer does not import" \
      >> "$summary"
  fi
fi
if [[ $gpus -ge 2 ]]; then
  step "TP=2 parity over NCCL" python scripts/gpu_parity.py --model "$model" --dtype "$dtype" \
    --device "$device" --layout 2x1 --out "$out" --attention-backend torch
  step "PP=2 parity over NCCL" python scripts/gpu_parity.py --model "$model" --dtype "$dtype" \
    --device "$device" --layout 1x2 --out "$out" --attention-backend torch
fi
step "serving benchmark ($(basename "$model"))" python benchmarks/serving.py --launch \
  --model "$model" --layouts 1x1 "${bench_args[@]}" --json "$out/serving_$(basename "$model").json" \
  -- --dtype "$dtype" --attention-backend torch
if [[ -n $big_model ]]; then
  step "serving benchmark ($(basename "$big_model"))" python benchmarks/serving.py --launch \
    --model "$big_model" --layouts 1x1 "${bench_args[@]}" \
    --json "$out/serving_$(basename "$big_model").json" -- --dtype "$dtype" --attention-backend torch
fi

echo "== summary ($summary)"
cat "$summary"
! grep -q FAILED "$summary"
