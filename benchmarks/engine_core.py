"""The engine core without its process boundaries: how fast could serving be?

    python benchmarks/engine_core.py --model DIR --num-requests 128 \\
        --concurrency 16 --prompt-len-range 16,128 --max-tokens-range 16,128 \\
        --threads 1 --hf-baseline [--json out.json]

The same requests as benchmarks/serving.py (same seeds and flags) run
through the real Scheduler and a real Worker in this one process
(kvloom_testing/inprocess.py: every step still goes through the protobuf wire, both
ways, but no gRPC, no threads and no second process). A new request is added
the moment one finishes, so `concurrency` are always in flight. Steps are
synchronous: scheduling and the worker's step do not overlap.

Set beside serving.py's figures (same flags), it splits the distance to a
goal into what the engine itself costs (worker ms/step: state update, input
preparation, forward, sampling, both wire conversions; scheduler ms/step:
schedule + update_from_output) and what the process boundaries cost on the
machine at hand (the daemons' gRPC threads, hand-offs and, on a box with
fewer cores than processes, their competition for cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from benchmarks import hf_baseline, serving  # noqa: E402
from controlplane.core.request import Request, SamplingParams  # noqa: E402
from controlplane.model_info import read_model_info  # noqa: E402
from kvloom_testing.inprocess import InProcessExecutor  # noqa: E402
from kvloom_testing.scheduler import make_scheduler  # noqa: E402

BLOCK_SIZE = 16


def run_engine(model: str, requests: list[tuple[list[int], int]], concurrency: int,
               dtype: str, max_num_batched_tokens: int, attention_backend: str = "") -> dict:
    """Steps the scheduler over one in-process worker until every request is
    done. attention_backend: the LoadModel field ("" = auto)."""
    longest = max(len(p) + n for p, n in requests)
    # Every in-flight request's whole context fits: no preemption skews the figures.
    blocks = concurrency * (-(-longest // BLOCK_SIZE) + 1) + 1
    executor = InProcessExecutor(model, block_size=BLOCK_SIZE, num_gpu_blocks=blocks,
                                 dtype=dtype, attention_backend=attention_backend)
    try:
        scheduler = make_scheduler(executor, max_num_seqs=concurrency,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=longest)
        queued = [Request(f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=n,
                                                           ignore_eos=True))
                  for i, (p, n) in enumerate(requests)]
        queued.reverse()
        in_flight = finished = output_tokens = steps = 0
        worker_s = scheduler_s = 0.0
        started = time.perf_counter()
        while finished < len(requests):
            while in_flight < concurrency and queued:
                scheduler.add_request(queued.pop())
                in_flight += 1
            t0 = time.perf_counter()
            step = scheduler.schedule_step()
            so = step.scheduler_output
            t1 = time.perf_counter()
            out = executor.execute_model(so, step.expected)
            t2 = time.perf_counter()
            for o in scheduler.update_from_output(so, out):
                output_tokens += len(o.new_token_ids)
                if o.finished:
                    finished += 1
                    in_flight -= 1
            scheduler_s += (t1 - t0) + (time.perf_counter() - t2)
            worker_s += t2 - t1
            steps += 1
        duration = time.perf_counter() - started
    finally:
        executor.close()
    ms = 1000.0 / steps
    return {
        "requests": len(requests), "completed": finished, "failed": 0,
        "duration_s": duration, "output_tokens": output_tokens,
        "output_throughput": output_tokens / duration, "steps": steps,
        "tokens_per_step": output_tokens / steps, "wall_ms_per_step": duration * ms,
        "worker_ms_per_step": worker_s * ms, "scheduler_ms_per_step": scheduler_s * ms,
    }


ROWS = [
    ("duration (s)", "duration_s", "{:.2f}"),
    ("output tokens/s", "output_throughput", "{:.1f}"),
    ("steps", "steps", "{}"),
    ("output tokens/step", "tokens_per_step", "{:.2f}"),
    ("wall ms/step", "wall_ms_per_step", "{:.3f}"),
    ("worker ms/step", "worker_ms_per_step", "{:.3f}"),
    ("scheduler ms/step", "scheduler_ms_per_step", "{:.3f}"),
    ("static batches: output rows x", "output_padding", "{:.2f}"),
    ("static batches: prompt tokens x", "prompt_padding", "{:.2f}"),
]


def format_table(runs: dict[str, dict]) -> str:
    names = list(runs)
    rows = [["metric", *names]] + [
        [label, *(fmt.format(runs[n][key]) if key in runs[n] else "-" for n in names)]
        for label, key, fmt in ROWS
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir; default: the embedded SmolLM2-135M")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len-range", type=serving.parse_range, metavar="LO,HI")
    p.add_argument("--max-tokens-range", type=serving.parse_range, metavar="LO,HI")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--dtype", choices=sorted(hf_baseline.DTYPES), default="float32")
    p.add_argument("--hf-baseline", action="store_true",
                   help="also run transformers' generate on the same requests")
    p.add_argument("--rounds", type=serving.parse_rounds, default=1,
                   help="with --hf-baseline: engine and baseline back to back this many "
                        f"times (1-{serving.MAX_ROUNDS}); the median ratio is reported")
    p.add_argument("--attention-backends", type=_backends, default=[""],
                   metavar="NAME[,NAME]",
                   help="run the engine with each of these attention backends (auto, torch, "
                        "cpu), alternated within every round; default: auto")
    p.add_argument("--json", type=Path, help="write results here")
    return p


def _backends(text: str) -> list[str]:
    names = text.split(",")
    for name in names:
        if name not in ("auto", "torch", "cpu"):
            raise argparse.ArgumentTypeError(
                f"bad --attention-backends {text!r}: each of auto, torch or cpu")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"bad --attention-backends {text!r}: a name twice")
    return names


def _engine_name(backend: str, backends: list[str]) -> str:
    return "engine core" if len(backends) == 1 else f"engine core ({backend})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("num_requests", "concurrency", "max_num_batched_tokens", "threads",
                 "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.rounds > 1 and not args.hf_baseline:
        raise SystemExit("--rounds needs --hf-baseline (a ratio per round)")
    if args.model is None:
        from kvloom.common.default_model import default_model_dir

        args.model = str(default_model_dir())
    torch.set_num_threads(args.threads)
    info = read_model_info(args.model)
    prompts = serving.random_prompts(info.vocab_size, info.eos_token_ids, args)
    requests = list(zip(prompts, serving.output_lengths(args), strict=True))
    backends = args.attention_backends
    for backend in backends:  # one untimed warm-up request each, as serving.py's
        run_engine(args.model, requests[:1], 1, args.dtype, args.max_num_batched_tokens,
                   backend)
    rounds, per_round = [], []
    for i in range(args.rounds):
        # Alternated: odd rounds run the backends in reverse, so neither
        # always goes first on a box whose speed drifts.
        order = backends if i % 2 == 0 else backends[::-1]
        by_backend = {b: run_engine(args.model, requests, args.concurrency, args.dtype,
                                    args.max_num_batched_tokens, b) for b in order}
        runs = {_engine_name(b, backends): by_backend[b] for b in backends}  # table order
        if args.hf_baseline:
            runs["transformers"] = hf_baseline.run(args.model, requests, args.concurrency,
                                                   args.dtype, args.threads)
        if args.rounds > 1:
            print(f"== round {i + 1} of {args.rounds}")
        print(format_table(runs))
        if args.hf_baseline:
            base = runs["transformers"]["output_throughput"]
            per_round.append({name: run["output_throughput"] / base
                              for name, run in runs.items() if name != "transformers"})
            print("\n".join(serving.ratio_lines(per_round[-1])))
        rounds.append(runs)
    if args.rounds > 1:
        print("\n".join(serving.ratio_summary(per_round)))
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        payload = {"config": config, "runs": rounds[-1]}
        if args.rounds > 1:
            payload.update(rounds=rounds, ratios=per_round)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
