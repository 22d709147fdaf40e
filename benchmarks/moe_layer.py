"""One MoE layer's experts: transformers' loop vs kvloom's grouped forms.

    python benchmarks/moe_layer.py [--tokens 1,16,256] [--experts 8:2,64:8] \\
        [--hidden 256 --intermediate 128] [--dtype float32] [--iters 50] \\
        [--repeats 5] [--threads 1] [--json benchmarks/results/moe_layer.json]

For each (tokens, experts:top_k) it draws x, a router and stacked expert
weights, routes once (select_experts, shared by all methods), then times
workerd.layers.moe.fused_experts per method, the methods interleaved within
each repeat so they see the same machine noise:

  * reference:  transformers' loop (per hit expert: find its tokens with a
                one-hot mask, gather, two matmuls, index_add);
  * sorted:     tokens sorted by expert once, per hit expert one matmul on
                its contiguous rows (gate/up), one silu-and-mul, then one
                matmul per hit expert (down);
  * grouped_mm: the sorted rows through torch's grouped GEMM, two calls;
  * auto:       the default on plain stacks: grouped_mm at >= 1 row per
                expert, else sorted;
  * packed:     sorted on every expert's w13 and w2 slices packed for oneDNN
                (pack_stack, batch hint = the tokens), what "auto" runs on a
                layer packed whole (float32 only);
  * rank:       what a CPU float32 rank runs when it packs at a batch hint
                of the tokens: the stacks pack_linear_weights' rule packs
                (expert_floor) packed, the others plain, by "auto".

It checks every method's output against the reference, and reports each
method's median ms and the reference's time divided by it (above 1: faster
than the loop), side by side, then rows/expert (tokens * k / E) and which
stacks the rule packs ("w13+w2", "w13", "w2" or "-"). The activation runs
torch's code (the C silu-and-mul kernel is not bound), the same for all.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from workerd.layers.activation import SiluAndMul  # noqa: E402
from workerd.layers.moe import DEFAULT_MOE_METHOD, fused_experts, select_experts  # noqa: E402
from workerd.layers.packed_linear import (  # noqa: E402
    MIN_PACKED_ELEMENTS,
    expert_floor,
    pack_stack,
    packing_unavailable,
)

METHODS = ("reference", "sorted", "grouped_mm", "auto", "packed", "rank")


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        e, k = item.split(":")
        out.append((int(e), int(k)))
    return out


def _timed(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def packs(tokens: int, experts: int, top_k: int, hidden: int, inter: int) -> list[str]:
    """The stacks pack_linear_weights packs at a batch hint of `tokens`."""
    floor = expert_floor(MIN_PACKED_ELEMENTS, tokens * top_k / experts)
    if floor is None:
        return []
    return [name for name, n in (("w13", 2 * inter * hidden), ("w2", hidden * inter))
            if n >= floor]


def run_case(tokens: int, experts: int, top_k: int, args) -> dict:
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed)
    h, inter = args.hidden, args.intermediate
    x = torch.randn(tokens, h, generator=g).to(dtype)
    router = torch.randn(experts, h, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, h, generator=g) * h**-0.5).to(dtype)
    w2 = (torch.randn(experts, h, inter, generator=g) * inter**-0.5).to(dtype)
    weights, ids = select_experts(x @ router.T, top_k, renormalize=True)
    act = SiluAndMul()
    methods = METHODS if packing_unavailable(x.device, dtype) is None else METHODS[:-2]
    rule = packs(tokens, experts, top_k, h, inter)
    if "packed" in methods:
        p13, p2 = pack_stack(w13, tokens), pack_stack(w2, tokens)
        r13, r2 = (p13 if "w13" in rule else None), (p2 if "w2" in rule else None)

    def call(method):
        if method == "packed":
            return lambda: fused_experts(x, w13, w2, weights, ids, act, "sorted", p13, p2)
        if method == "rank":
            return lambda: fused_experts(x, w13, w2, weights, ids, act, "auto", r13, r2)
        return lambda: fused_experts(x, w13, w2, weights, ids, act, method)

    with torch.inference_mode():
        ref = call("reference")()
        diffs = {m: (call(m)() - ref).abs().max().item() for m in methods}
        samples = {m: [] for m in methods}
        for _ in range(args.repeats):
            for m in methods:
                samples[m].append(_timed(call(m), args.iters))
    ms = {m: statistics.median(v) for m, v in samples.items()}
    return {
        "tokens": tokens, "experts": experts, "top_k": top_k,
        "experts_hit": int(ids.unique().numel()), "rows_per_expert": tokens * top_k / experts,
        "packs": "+".join(rule) or "-",
        "ms": ms, "samples_ms": samples, "max_abs_diff": diffs,
        "speedup_vs_reference": {m: ms["reference"] / ms[m] for m in methods},
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=_ints, default=[1, 16, 256], metavar="N[,...]")
    p.add_argument("--experts", type=_pairs, default=[(8, 2), (64, 8)], metavar="E:K[,...]")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("hidden", "intermediate", "iters", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    if any(not 1 <= k <= e for e, k in args.experts) or any(t < 1 for t in args.tokens):
        raise SystemExit("--experts E:K needs 1 <= K <= E; --tokens >= 1")
    if args.hidden % 8 or args.intermediate % 8:
        raise SystemExit("--hidden and --intermediate: multiples of 8 (grouped_mm's strides)")
    torch.set_num_threads(args.threads)
    cases = [run_case(t, e, k, args) for e, k in args.experts for t in args.tokens]
    print(f"hidden {args.hidden}, intermediate {args.intermediate}, {args.dtype}, "
          f"{args.threads} thread(s); ms = median of {args.repeats} x {args.iters} calls; "
          f"x = reference ms / method ms; default method: {DEFAULT_MOE_METHOD}")
    methods = list(cases[0]["ms"])
    fast = methods[1:]
    head = "".join(f"{m + ' ms':>15}" for m in methods) + "".join(f"{m + ' x':>14}" for m in fast)
    print(f"{'E:k':>6} {'tokens':>6} {'hit':>4}{head} {'max|diff|':>10} {'rows/e':>7} "
          f"{'packs':>7}")
    for c in cases:
        cols = "".join(f"{c['ms'][m]:>15.3f}" for m in methods)
        cols += "".join(f"{c['speedup_vs_reference'][m]:>14.2f}" for m in fast)
        print(f"{c['experts']:>3}:{c['top_k']:<2} {c['tokens']:>6} {c['experts_hit']:>4}{cols} "
              f"{max(c['max_abs_diff'].values()):>10.1e} {c['rows_per_expert']:>7.2f} "
              f"{c['packs']:>7}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        machine = {"torch": torch.__version__, "processor": platform.processor(),
                   "python": platform.python_version()}
        args.json.write_text(json.dumps({"config": config, "machine": machine, "cases": cases},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
