"""Greedy parity of a local kvloom cluster against transformers on the same
weights, device and dtype; part of scripts/gpu_check.sh.

    python scripts/gpu_parity.py --model DIR --dtype bfloat16 --layout 1x1 --out DIR \
        [--attention-backend flashinfer]

Launches the layout (TPxPP) with `kvloom up`'s launcher, generates greedy
tokens for a few prompts through the gRPC API, runs transformers' `generate`
on the same prompts, and writes parity_<layout>_<dtype>.json: per prompt the
number of leading tokens that match and the first divergence. In float32 the
outputs must match exactly; in reduced precision kernels round differently,
so the check requires the first --min-prefix tokens of every prompt to match
and reports the rest. Exit status 1 when the check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvloom.client import KvloomClient
from kvloom_cli import launcher

# Ids below 500: valid for the tiny test model (vocab 511) and real vocabularies alike.
PROMPTS = [[1, 450, 496, 310], [1, 20, 21, 22, 23, 24, 25], [1, 306, 163, 338, 263, 243]]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_greedy(model_dir: str, dtype: str, device: str, max_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device)
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def kvloom_greedy(model_dir: str, dtype: str, tp: int, pp: int, max_tokens: int,
                  kv_cache_mib: int, attention_backend: str,
                  enforce_eager: bool = False) -> list[list[int]]:
    spec = launcher.ClusterSpec(
        model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, worker_threads=1,
        controlplane_args=("--dtype", dtype, "--kv-cache-memory-bytes", str(kv_cache_mib << 20),
                           "--attention-backend", attention_backend)
        + (("--enforce-eager",) if enforce_eager else ()),
    )
    with launcher.Cluster(spec) as cluster:
        cluster.wait_ready(900)
        with KvloomClient(cluster.api_address) as client:
            return [client.generate_text(p, max_tokens=max_tokens, temperature=0.0,
                                         ignore_eos=True).token_ids for p in PROMPTS]


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda", help="transformers' device for the reference")
    p.add_argument("--layout", default="1x1", help="TPxPP")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-prefix", type=int, default=8,
                   help="leading tokens that must match in reduced precision")
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "flashinfer"),
                   help="the workers' attention kernels (controlplane --attention-backend)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (they apply with flashinfer at TP=1, PP=1)")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    tp, pp = (int(x) for x in args.layout.lower().split("x"))
    ours = kvloom_greedy(args.model, args.dtype, tp, pp, args.max_tokens, args.kv_cache_mib,
                         args.attention_backend, args.enforce_eager)
    ref = hf_greedy(args.model, args.dtype, args.device, args.max_tokens)
    need = args.max_tokens if args.dtype == "float32" else min(args.min_prefix, args.max_tokens)
    rows = [{"prompt": pr, "kvloom": a, "transformers": b, "matching_prefix": matching_prefix(a, b)}
            for pr, a, b in zip(PROMPTS, ours, ref, strict=True)]
    ok = all(r["matching_prefix"] >= need for r in rows)
    result = {"model": args.model, "dtype": args.dtype, "layout": args.layout,
              "attention_backend": args.attention_backend, "enforce_eager": args.enforce_eager,
              "max_tokens": args.max_tokens, "required_prefix": need, "ok": ok, "prompts": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    # auto keeps the file name gpu_check.sh's earlier runs used.
    suffix = "" if args.attention_backend == "auto" else f"_{args.attention_backend}"
    suffix += "_eager" if args.enforce_eager else ""
    path = args.out / f"parity_{args.layout}_{args.dtype}{suffix}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    mode = " eager" if args.enforce_eager else ""
    print(f"parity {args.layout} {args.dtype} {args.attention_backend}{mode}: matching prefixes "
          f"{[r['matching_prefix'] for r in rows]} of {args.max_tokens} (need {need}) -> "
          f"{'ok' if ok else 'FAILED'}; {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
