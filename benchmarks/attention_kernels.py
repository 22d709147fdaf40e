"""One layer's paged attention, torch backend vs the cpu kernel (issue 14).

    python benchmarks/attention_kernels.py [--heads 9 --kv-heads 3 --head-dim 64] \\
        [--decodes 12 --context-range 20,240] [--chunks 60:0,20:100] \\
        [--block-size 16] [--iters 100] [--repeats 3] [--threads 1] \\
        [--sliding-window 0] [--soft-cap 0] [--dtype float32] \\
        [--json benchmarks/results/attention_kernels.json]

Builds one step the way a served SmolLM2 step looks (default: 12 decodes at
random contexts, a 60-token prompt chunk with no context and a 20-token chunk
over 100 cached tokens) on a cache of scattered blocks, then times, each
repeat interleaved so both see the same machine noise:

  * torch plan:  the torch backend's per-step plan (once per step, not layer);
  * torch:       its per-layer attention (K/V write, gathers, SDPA);
  * cpu:         the cpu backend's per-layer call (K/V write and attention in
                 one C call), plan included.

and checks the two outputs agree. Medians over --repeats of --iters calls.
--sliding-window W and --soft-cap C (0: none) time a layer of that kind
(Mistral's window, Gemma 2's cap): both backends plan for it, and the
query-key pairs count only the keys inside the window.
--dtype bfloat16 times both on a bf16 cache and bf16 q/k/v (the torch
backend is what a bf16 CPU rank ran before the kernel's bf16 entry point);
the CPU's instruction set is printed beside the numbers, since bf16 speed
depends on it (AVX-512 BF16 or not).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from kvloom_testing.attention import build_attn_metadata  # noqa: E402
from workerd.cpu_features import isa_summary  # noqa: E402
from workerd.layers.attention.cpu import CpuAttentionBackend  # noqa: E402
from workerd.layers.attention.interface import AttentionLayerKind  # noqa: E402
from workerd.layers.attention.torch_sdpa import build_plan, paged_attention  # noqa: E402


def _pair(text: str) -> tuple[int, int]:
    a, b = text.split(":" if ":" in text else ",")
    return int(a), int(b)


def build_step(args, rng: random.Random):
    """(metadata, q, k, v, cache): decodes then chunks, scattered blocks."""
    bs = args.block_size
    lo, hi = args.context_range
    reqs = [(rng.randint(lo, hi), 1) for _ in range(args.decodes)]
    reqs += [(context, n) for n, context in args.chunks]
    need = [-(-(c + n) // bs) for c, n in reqs]
    blocks = list(range(sum(need) + 8))
    rng.shuffle(blocks)
    tables, at = [], 0
    for n in need:
        tables.append(blocks[at:at + n])
        at += n
    md, _ = build_attn_metadata([c for c, _ in reqs], [n for _, n in reqs], tables, bs)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    fused = torch.randn(md.num_actual_tokens, h + 2 * kvh, d, generator=gen).to(dtype)
    q, k, v = fused.split([h, kvh, kvh], dim=1)
    cache = torch.randn(2, len(blocks), bs, kvh, d, generator=gen).to(dtype)
    return md, q, k, v, cache


def _timed(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def run(args) -> dict:
    md, q, k, v, cache = build_step(args, random.Random(args.seed))
    scale = args.head_dim**-0.5
    width = args.kv_heads * args.head_dim
    n = md.num_actual_tokens
    window = args.sliding_window or None
    kind = AttentionLayerKind(window, args.soft_cap or None)
    cpu = CpuAttentionBackend(width)
    torch_plan = build_plan(md, n, width, kind)
    ref = paged_attention(q, k, v, cache.clone(), md, scale, torch_plan)
    out = cpu.forward(q, k, v, cache.clone(), md, scale, cpu.build_plan(md, n, kind))
    max_diff = (out.float() - ref.float()).abs().max().item()
    samples = {"torch plan": [], "torch": [], "cpu": []}
    for _ in range(args.repeats):
        samples["torch plan"].append(_timed(lambda: build_plan(md, n, width, kind), args.iters))
        samples["torch"].append(_timed(
            lambda: paged_attention(q, k, v, cache, md, scale, torch_plan), args.iters))
        samples["cpu"].append(_timed(
            lambda: cpu.forward(q, k, v, cache, md, scale, cpu.build_plan(md, n, kind)),
            args.iters))
    ms = {name: statistics.median(vals) for name, vals in samples.items()}
    return {
        "tokens": n, "requests": md.num_reqs, "dtype": args.dtype, "isa": isa_summary(),
        # Keys each query attends: its position + 1, at most the window.
        "query_key_pairs": sum(min(p, window or p) for ql, s in zip(
            md.query_lens_cpu, md.seq_lens_cpu, strict=True) for p in range(s - ql + 1, s + 1)),
        "ms": ms, "samples_ms": samples, "max_abs_diff": max_diff,
        "speedup_layer": ms["torch"] / ms["cpu"],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--decodes", type=int, default=12)
    p.add_argument("--context-range", type=_pair, default=(20, 240), metavar="LO,HI")
    p.add_argument("--chunks", type=lambda t: [_pair(c) for c in t.split(",") if c],
                   default=[(60, 0), (20, 100)], metavar="TOKENS:CONTEXT[,...]")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sliding-window", type=int, default=0, metavar="W",
                   help="attend within a window of W tokens (0: the whole context)")
    p.add_argument("--soft-cap", type=float, default=0.0, metavar="C",
                   help="soft-cap the logits at C (0: none)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="q, k, v and the KV cache (both backends)")
    p.add_argument("--json", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("heads", "kv_heads", "head_dim", "block_size", "iters", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.decodes < 0 or args.decodes + len(args.chunks) == 0:
        raise SystemExit("--decodes and --chunks: at least one request")
    if args.sliding_window < 0 or not args.soft_cap >= 0:
        raise SystemExit("--sliding-window and --soft-cap must be >= 0 (0: none)")
    torch.set_num_threads(args.threads)
    result = run(args)
    print(f"{result['requests']} requests, {result['tokens']} tokens, "
          f"{result['query_key_pairs']} query-key pairs per KV head; {args.dtype} on a CPU "
          f"with {result['isa']}")
    print(f"{'what':<12} {'ms (median)':>12}")
    for name, value in result["ms"].items():
        print(f"{name:<12} {value:>12.3f}")
    print(f"cpu kernel: {result['speedup_layer']:.2f}x the torch backend's attention per layer "
          f"(max |diff| {result['max_abs_diff']:.2e})")
    if args.json:
        args.json.write_text(json.dumps({"config": {k: v for k, v in vars(args).items()
                                                    if k != "json"}, **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
