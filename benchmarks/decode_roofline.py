"""How close is a decode step to its matmul roofline? (issue 14)

    python benchmarks/decode_roofline.py [--model DIR] [--batch-sizes 1,8,16] \\
        [--context 64] [--steps 20] [--threads 1] [--dtype float32] \\
        [--linear-kernels onednn,aten] [--out benchmarks/results/decode_roofline.json]

Builds one single-process ModelRunner on CPU (default model: the embedded
SmolLM2-135M), prefills `batch` greedy requests of --context random prompt
tokens each, then runs decode steps. Each iteration, interleaved so that both
see the same machine noise:

  * step:    one whole ModelRunner.execute_model decode step (state update,
             input preparation, forward, logits, sampling);
  * prepare: ModelRunner.prepare_inputs for that step alone;
  * forward: model.forward + compute_logits + sampling on prepared inputs;
  * matmul:  only that step's weight matmuls: qkv, o, gate_up and down of
             every layer on [batch, in] random inputs, plus the LM head on the
             batch's sampled rows, with the model's own weights and kernels
             (packed oneDNN weights on CPU float32, F.linear otherwise).

With --linear-kernels onednn,aten it builds one runner per kernel (aten keeps
F.linear on plain weights) and alternates them per batch size, so the packed
weights' gain is measured side by side.

matmul is the floor the step cannot beat (on CPU, reading the weights once);
everything else in `step` is overhead: attention, norms, rotary, Python. The
issue's goal is step <= 1.5x matmul. Medians over --steps iterations.

`dispatches` counts the torch ops one whole decode step calls from Python
(counted once, outside the timings, with a TorchDispatchMode). On a small
model each costs more than its arithmetic (docs/benchmarks.md), so this is
the overhead's machine-independent measure; it must not grow with the batch:
no per-request torch op in the hot path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from workerd.distributed.parallel_state import single_process_state
from workerd.layers.attention.backend import resolve_attention_backend
from workerd.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from workerd.layers.packed_linear import linear
from workerd.limits import WorkerLimits
from workerd.runner.model_runner import ModelRunner
from workerd.runner.sched_output import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)
DEFAULT_OUT = Path(__file__).parent / "results" / "decode_roofline.json"
LINEAR_KERNELS = ("onednn", "aten")


def matmul_layers(model) -> list[tuple[str, nn.Module]]:
    """(name, module) of every weight matmul one forward runs, in model order:
    the fused projections of each decoder layer, then the LM head (applied to
    sampled rows only). Norm weights and the embedding are lookups or
    elementwise, not matmuls."""
    out = [(name, module) for name, module in model.named_modules()
           if isinstance(module, (MergedColumnParallelLinear, ColumnParallelLinear,
                                  RowParallelLinear))]
    if getattr(model, "lm_head", None) is not None:
        out.append(("lm_head", model.lm_head))
    return out


def matmul_shape(module: nn.Module) -> tuple[int, int]:
    """(out, in) features of the module's weight, packed or plain."""
    w = module.packed_weight if module.packed_weight is not None else module.weight
    return tuple(w.shape)


def run_matmuls(calls: list[tuple[torch.Tensor, nn.Module]]):
    """One pass over the step's matmuls, each [batch, in] input through the
    kernel its module itself uses (packed or F.linear)."""
    for x, m in calls:
        linear(x, m.weight, None, m.packed_weight)


def _cached_has_token_ids() -> bool:
    # Older diffs carried each step's sampled token back to the worker; newer
    # runners append their own samples. Feed whichever this checkout expects.
    return "new_token_ids" in {f.name for f in dataclasses.fields(CachedRequestData)}


class DecodeDriver:
    """Feeds one runner a batch of requests: a prefill step, then decode steps
    exactly as the controlplane would schedule them (all blocks handed out up
    front, so decode diffs carry no new blocks)."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, max_steps: int,
                 vocab: int, seed: int):
        self.runner = runner
        self.step_id = 0
        rng = random.Random(seed)
        blocks_per_req = -(-(context + max_steps + 1) // BLOCK_SIZE)
        self.req_ids = [f"b{batch}-r{i}" for i in range(batch)]
        self.computed = {r: 0 for r in self.req_ids}
        self.last_token: dict[str, int] = {}
        self.new = [
            NewRequestData(r, [rng.randrange(vocab) for _ in range(context)], [], GREEDY,
                           list(range(i * blocks_per_req, (i + 1) * blocks_per_req)), 0)
            for i, r in enumerate(self.req_ids)
        ]
        self.num_blocks = batch * blocks_per_req

    def _so(self, new, cached, sched, finished=()) -> SchedulerOutput:
        self.step_id += 1
        return SchedulerOutput(self.step_id, new, cached, sched, sum(sched.values()),
                               set(finished), set())

    def prefill(self) -> None:
        sched = {n.req_id: len(n.prompt_token_ids) for n in self.new}
        self.advance(self._so(self.new, CachedRequestData(), sched))

    def decode_diff(self) -> SchedulerOutput:
        cached = CachedRequestData()
        with_tokens = _cached_has_token_ids()
        for r in self.req_ids:
            cached.req_ids.append(r)
            cached.resumed_from_preemption.append(False)
            cached.new_block_ids.append([])
            cached.num_computed_tokens.append(self.computed[r])
            if with_tokens:
                cached.new_token_ids.append([self.last_token[r]])
        return self._so([], cached, dict.fromkeys(self.req_ids, 1))

    def advance(self, so: SchedulerOutput) -> None:
        out = self.runner.execute_model(so)
        for r, tok in zip(out.req_ids, out.sampled_token_ids, strict=True):
            self.last_token[r] = tok
        for r, n in so.num_scheduled_tokens.items():
            self.computed[r] += n

    def decode(self) -> SchedulerOutput:
        so = self.decode_diff()
        self.advance(so)
        return so

    def finish(self) -> None:
        self.runner.execute_model(self._so([], CachedRequestData(), {}, self.req_ids))


class _CountDispatches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_dispatches(fn) -> int:
    """Torch ops fn calls from Python (composite ops count once)."""
    with _CountDispatches() as mode:
        fn()
    return mode.count


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def forward_only(runner: ModelRunner, inputs) -> None:
    """model.forward + logits + sampling of prepared inputs (the part of
    execute_model that depends on neither the diff nor the persistent batch).
    Every request's last token is sampled: re-preparing a step the runner has
    already appended a token to would otherwise count it as a partial chunk."""
    md = inputs.attn_metadata
    states = runner.input_batch.states()
    with torch.inference_mode():
        hidden = runner.model.forward(inputs.input_ids, inputs.positions, runner.kv_caches,
                                      md, None)
        logits = runner.model.compute_logits(hidden[md.query_start_loc[1:] - 1])
        runner.sample(logits, states)


def bench_batch(runner: ModelRunner, layers, batch: int, context: int, steps: int,
                warmup: int, seed: int) -> dict:
    vocab = runner.model.vocab_size
    driver = DecodeDriver(runner, batch, context, steps + warmup, vocab, seed)
    dtype = runner.dtype
    inputs = {matmul_shape(m)[1]: torch.randn(batch, matmul_shape(m)[1], dtype=dtype)
              for _, m in layers}
    # Paired up front: the timed floor is the matmuls and nothing else.
    calls = [(inputs[matmul_shape(m)[1]], m) for _, m in layers]
    driver.prefill()
    times: dict[str, list[float]] = {"step": [], "prepare": [], "forward": [], "matmul": []}
    for i in range(warmup + steps):
        so = driver.decode_diff()
        t_step = _timed(lambda so=so: driver.advance(so))
        # The state now holds the token this step scheduled, so the same diff
        # lays out the same step again (rewriting identical K/V into its slots).
        prepared = runner.prepare_inputs(so)
        t_prep = _timed(lambda so=so: runner.prepare_inputs(so))
        t_fwd = _timed(lambda p=prepared: forward_only(runner, p))
        with torch.inference_mode():
            t_mm = _timed(lambda: run_matmuls(calls))
        if i >= warmup:
            for key, t in zip(times, (t_step, t_prep, t_fwd, t_mm), strict=True):
                times[key].append(t)
    dispatches = count_dispatches(driver.decode)
    driver.finish()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "linear": "onednn" if runner.pack_weights else "aten",
        "packed_layers": sum(m.packed_weight is not None for _, m in layers),
        "batch": batch,
        "context": context,
        "steps": steps,
        "step_ms": med["step"],
        "prepare_ms": med["prepare"],
        "forward_ms": med["forward"],
        "matmul_ms": med["matmul"],
        "ratio": med["step"] / med["matmul"],
        "forward_ratio": med["forward"] / med["matmul"],
        "dispatches": dispatches,
        "step_ms_all": [t * 1e3 for t in times["step"]],
        "matmul_ms_all": [t * 1e3 for t in times["matmul"]],
    }


def format_table(rows: list[dict]) -> str:
    lines = [f"{'linear':>7} {'packed':>6} {'batch':>5} {'step ms':>9} {'prepare':>8} "
             f"{'forward':>9} {'matmul ms':>10} {'ratio':>6} {'fwd/mm':>7} {'dispatches':>10}"]
    for r in rows:
        lines.append(f"{r['linear']:>7} {r['packed_layers']:>6} {r['batch']:>5} "
                     f"{r['step_ms']:>9.2f} {r['prepare_ms']:>8.2f} {r['forward_ms']:>9.2f} "
                     f"{r['matmul_ms']:>10.2f} {r['ratio']:>6.2f} {r['forward_ratio']:>7.2f} "
                     f"{r['dispatches']:>10}")
    return "\n".join(lines)


def parse_kernels(text: str) -> list[str]:
    kernels = [k.strip() for k in text.split(",")]
    bad = [k for k in kernels if k not in LINEAR_KERNELS]
    if bad or len(set(kernels)) != len(kernels):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct kernels from {', '.join(LINEAR_KERNELS)}, comma-separated")
    return kernels


def build_runner(args, kernel: str, max_batch: int, max_len: int) -> ModelRunner:
    # Resolved as a worker resolves it (auto: the cpu kernels where they build).
    backend = resolve_attention_backend(args.attention_backend, torch.device("cpu"),
                                        DTYPES[args.dtype])
    runner = ModelRunner(single_process_state(), args.model, DTYPES[args.dtype], seed=args.seed,
                         limits=WorkerLimits(max(max_batch * args.context, 1), max_batch,
                                             max_len),
                         pack_weights=kernel == "onednn", attention_backend=backend)
    runner.load_model()
    runner.init_kv_cache(max_batch * -(-max_len // BLOCK_SIZE), BLOCK_SIZE)
    return runner


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir; default: the embedded SmolLM2-135M")
    p.add_argument("--batch-sizes", default="1,8,16")
    p.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--linear-kernels", type=parse_kernels, default=["onednn"],
                   help="onednn (weights packed at load, the worker's default on CPU in "
                        "float32, and in bf16 where it is native), aten (F.linear), or both: "
                        "one runner each, alternated")
    p.add_argument("--attention-backend", choices=("auto", "torch", "cpu"), default="auto",
                   help="as the workers' flag; auto: the cpu kernels where they build")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "--json", type=Path, default=DEFAULT_OUT,
                   help="write the results here (JSON)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from kvloom.common.default_model import default_model_dir

        args.model = str(default_model_dir())
    batches = [int(b) for b in args.batch_sizes.split(",")]
    max_batch = max(batches)
    max_len = args.context + args.steps + args.warmup + 1
    runners = {k: build_runner(args, k, max_batch, max_len) for k in args.linear_kernels}
    layers = {k: matmul_layers(r.model) for k, r in runners.items()}
    # Kernels alternate within each batch size, so both see the same noise.
    rows = [bench_batch(runners[k], layers[k], b, args.context, args.steps, args.warmup,
                        args.seed)
            for b in batches for k in args.linear_kernels]
    print(format_table(rows))
    payload = {
        "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                   "torch": torch.__version__, "python": platform.python_version(),
                   "cpus": os.cpu_count(), "num_matmuls": len(next(iter(layers.values())))},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
