"""One linear layer's multi-LoRA delta: the C kernel against two torch ways (issue 46).

    python benchmarks/lora_kernel.py [--layers qkv,o,gate_up,down] [--ranks 8,16,64] \\
        [--phases decode,prefill] [--dtypes float32,bfloat16] [--threads 1,2] \\
        [--decode-rows 16] [--adapters 4] \\
        [--prefill-rows 512] [--min-time 0.02] [--repeats 3] [--seed 0] \\
        [--json benchmarks/results/lora_kernel.json]

SmolLM2-135M's layers (hidden 576, intermediate 1536): qkv (3 parts: 576,
192, 192 columns of 576 inputs), o (576 of 576), gate_up (2 x 1536 of 576),
down (576 of 1536), each with one adapter part per projection, in two steps:

  * decode:  --decode-rows rows, one segment each, the adapters taking turns
             (row i on adapter i % --adapters), so every adapter's segments
             are scattered through the step;
  * prefill: --prefill-rows rows in one segment on one adapter.

Timed (the kernel and torch interleaved per repeat, so both see the same
machine noise; the gathered way after all of them, see main):

  * kernel:   workerd/kernels/lora.py's lora_add (one C call);
  * torch:    per (adapter, segment), per part, two matmuls and an add into
              y's columns: y[s:e, cols] += (x[s:e] @ A.T) @ B.T;
  * gathered: vLLM's CPU path (its torch bgmv ops): each token's A and B
              gathered (weights[index]), an einsum into a float32 buffer, an
              einsum back in y's dtype, added into y's columns.

Each figure is the median over --repeats of a sample of at least --min-time
seconds. The kernel's result is checked against a float64 reference. The
CPU and its instruction set are printed beside the numbers: bf16 speed
depends on it (AVX-512 BF16 or not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from workerd.cpu_features import cpu_model_name, isa_summary  # noqa: E402
from workerd.kernels.lora import lora_add, lora_kernels, lora_table  # noqa: E402

# SmolLM2-135M: (input features, the parts' output columns).
LAYERS = {"qkv": (576, (576, 192, 192)), "o": (576, (576,)),
          "gate_up": (576, (1536, 1536)), "down": (1536, (576,))}
METHODS = ("kernel", "torch", "gathered")


def _list(kind):
    def parse(text: str):
        return [kind(v) for v in text.split(",") if v]
    return parse




class Case:
    """One layer, one step, one rank and dtype: x, y, the adapters' weights,
    the segments and the kernel's table."""

    def __init__(self, layer: str, phase: str, rank: int, dtype: torch.dtype, args,
                 gen: torch.Generator):
        self.n_in, outs = LAYERS[layer]
        self.n_y = sum(outs)
        if phase == "decode":
            rows, adapters = args.decode_rows, args.adapters
            segs = [(i, i + 1, i % adapters) for i in range(rows)]
        else:
            rows, adapters = args.prefill_rows, 1
            segs = [(0, rows, 0)]
        self.rows, self.adapters = rows, adapters
        self.segments = torch.tensor(segs, dtype=torch.int64)
        self.seg_list = segs
        self.x = (torch.randn(rows, self.n_in, generator=gen)).to(dtype)
        self.y0 = torch.randn(rows, self.n_y, generator=gen).to(dtype)
        self.parts = []  # per adapter: [(A, B, col_off)]
        for _ in range(adapters):
            off, parts = 0, []
            for n_out in outs:
                A = (torch.randn(rank, self.n_in, generator=gen) / self.n_in**0.5).to(dtype)
                B = (torch.randn(n_out, rank, generator=gen) / rank**0.5).to(dtype)
                parts.append((A, B, off))
                off += n_out
            self.parts.append(parts)
        # The caller keeps A and B alive while the table is used: self.parts does.
        self.table = lora_table(self.parts, self.n_in, self.n_y, dtype)
        # The gathered path's per-part stacks ([adapters, n_out, rank], ...) and
        # per-token adapter index.
        self.stacks = [(torch.stack([p[i][0] for p in self.parts]),
                        torch.stack([p[i][1] for p in self.parts]), self.parts[0][i][2])
                       for i in range(len(outs))]
        index = torch.empty(rows, dtype=torch.int64)
        for s, e, a in segs:
            index[s:e] = a
        self.index = index

    def reference(self) -> torch.Tensor:
        y = self.y0.double()
        for s, e, a in self.seg_list:
            for A, B, off in self.parts[a]:
                y[s:e, off:off + B.shape[0]] += (self.x[s:e].double() @ A.double().T) @ B.double().T
        return y

    def run_kernel(self, kernels, y):
        if not lora_add(kernels, self.x, y, self.segments, self.table):
            raise RuntimeError("lora_add did not take the call")

    def run_torch(self, y):
        for s, e, a in self.seg_list:
            xs = self.x[s:e]
            for A, B, off in self.parts[a]:
                y[s:e, off:off + B.shape[0]] += (xs @ A.T) @ B.T

    def run_gathered(self, y):
        x32 = self.x.float()
        for A_stack, B_stack, off in self.stacks:
            a_t = A_stack[self.index].float()                         # [T, rank, n_in]
            buf = torch.einsum("bi,boi->bo", x32, a_t)                # float32
            b_t = B_stack[self.index]                                 # [T, n_out, rank]
            out = torch.einsum("bi,boi->bo", buf.to(y.dtype), b_t)
            y[:, off:off + B_stack.shape[1]] += out


def _sample(fn, y0: torch.Tensor, min_time: float) -> float:
    """ms per call over at least min_time seconds (y reset outside the clock
    only once: every call adds into the same y, as a layer's would)."""
    y = y0.clone()
    fn(y)  # warm
    iters, elapsed = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(y)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time:
            return elapsed / iters * 1e3
        iters = max(iters * 2, int(iters * min_time / max(elapsed, 1e-9) * 1.2))


def _case(spec, args) -> Case:
    layer, phase, rank, dtype, threads = spec
    torch.set_num_threads(threads)
    return Case(layer, phase, rank, getattr(torch, dtype), args,
                torch.Generator().manual_seed(args.seed))


def run_case(spec, args, kernels) -> dict:
    """The kernel and the per-segment torch way on one case, interleaved."""
    layer, phase, rank, dtype, threads = spec
    case = _case(spec, args)
    ref = case.reference()
    y = case.y0.clone()
    case.run_kernel(kernels, y)
    max_diff = (y.double() - ref).abs().max().item()
    fns = {"kernel": lambda y: case.run_kernel(kernels, y), "torch": case.run_torch}
    samples = {m: [] for m in fns}
    for _ in range(args.repeats):
        for m, fn in fns.items():
            samples[m].append(_sample(fn, case.y0, args.min_time))
    return {"layer": layer, "phase": phase, "rank": rank, "dtype": dtype, "threads": threads,
            "rows": case.rows, "adapters": case.adapters, "segments": len(case.seg_list),
            "n_in": case.n_in, "n_y": case.n_y, "samples_ms": samples, "max_abs_diff": max_diff}


def add_gathered(result: dict, spec, args) -> None:
    """The gathered way's timing on the same case, and the medians."""
    case = _case(spec, args)
    samples = result["samples_ms"]
    samples["gathered"] = [_sample(case.run_gathered, case.y0, args.min_time)
                           for _ in range(args.repeats)]
    ms = result["ms"] = {m: statistics.median(samples[m]) for m in METHODS}
    result["speedup_vs_torch"] = ms["torch"] / ms["kernel"]
    result["speedup_vs_gathered"] = ms["gathered"] / ms["kernel"]


def table_lines(results: list[dict]) -> list[str]:
    head = ["layer", "phase", "rows", "ad", "rank", "dtype", "thr", "kernel ms", "torch ms",
            "gathered ms", "vs torch", "vs gathered", "max|diff|"]
    rows = [head] + [[r["layer"], r["phase"], str(r["rows"]), str(r["adapters"]), str(r["rank"]),
                      r["dtype"], str(r["threads"]), f"{r['ms']['kernel']:.4f}",
                      f"{r['ms']['torch']:.4f}", f"{r['ms']['gathered']:.4f}",
                      f"{r['speedup_vs_torch']:.2f}x", f"{r['speedup_vs_gathered']:.2f}x",
                      f"{r['max_abs_diff']:.1e}"] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                     for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
           for row in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=_list(str), default=list(LAYERS))
    p.add_argument("--phases", type=_list(str), default=["decode", "prefill"])
    p.add_argument("--ranks", type=_list(int), default=[8, 16, 64])
    p.add_argument("--dtypes", type=_list(str), default=["float32", "bfloat16"])
    p.add_argument("--threads", type=_list(int), default=[1, 2])
    p.add_argument("--decode-rows", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4, help="adapters of a decode step")
    p.add_argument("--prefill-rows", type=int, default=512)
    p.add_argument("--min-time", type=float, default=0.02,
                   help="seconds each timing sample runs at least")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if bad := [name for name in args.layers if name not in LAYERS]:
        raise SystemExit(f"--layers: unknown {bad} (of {', '.join(LAYERS)})")
    if bad := [name for name in args.phases if name not in ("decode", "prefill")]:
        raise SystemExit(f"--phases: unknown {bad} (decode, prefill)")
    if bad := [name for name in args.dtypes if name not in ("float32", "bfloat16")]:
        raise SystemExit(f"--dtypes: unknown {bad} (float32, bfloat16)")
    if not args.layers or not args.phases or not args.ranks or not args.dtypes:
        raise SystemExit("--layers, --phases, --ranks, --dtypes: at least one each")
    if not args.threads or min(args.threads) < 1:
        raise SystemExit("--threads must be >= 1")
    if min(args.ranks) < 1 or max(args.ranks) > 512:
        raise SystemExit("--ranks must be within [1, 512]")
    for name in ("decode_rows", "adapters", "prefill_rows", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not args.min_time > 0:
        raise SystemExit("--min-time must be > 0")
    kernels = lora_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels cannot be built here (no C compiler?)")
    cpu = {"model": cpu_model_name() or "unknown", "cpus": os.cpu_count(), "isa": isa_summary()}
    print(f"{cpu['model']}, {cpu['cpus']} CPUs, {cpu['isa']}; torch {torch.__version__}")
    specs = [(layer, phase, rank, dtype, threads) for phase in args.phases
             for layer in args.layers for rank in args.ranks for dtype in args.dtypes
             for threads in args.threads]
    results = [run_case(spec, args, kernels) for spec in specs]
    # The gathered way last, case by case: its gathers (hundreds of MB a call
    # at prefill) left this VM's second CPU stalling for a while after, and
    # the two-thread timings that followed (the kernel's and torch's alike)
    # at 16 ms a call.
    for result, spec in zip(results, specs, strict=True):
        add_gathered(result, spec, args)
    print("\n".join(table_lines(results)))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"config": config, "cpu": cpu, "isa": cpu["isa"],
                                         "torch": torch.__version__, "results": results},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
