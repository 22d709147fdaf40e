"""The prefix cache's host tier against recompute, on multi-turn conversations.

    python benchmarks/kv_offload.py [--model DIR] --conversations 8 --turns 4 \\
        --system-len 512 --turn-len 32 --max-tokens 16 --pool-blocks 96 \\
        --tier-gib 1 --dtype float32 --threads 2 --json out.json

Issue 43's figure. `conversations` conversations take turns, one request at a
time: each turn's prompt is the conversation so far (a system prompt of
--system-len tokens, then every earlier turn's --turn-len user tokens and
--max-tokens answer) plus --turn-len new tokens. The pool (--pool-blocks
blocks of 16 tokens) holds one or two conversations, so by the time a
conversation returns the pool has evicted it: without a tier its history is
prefilled again; with --tier-gib of host tier it is loaded back.

Both modes run the same seeded requests through the real scheduler and one
in-process worker (kvloom_testing/inprocess.py: every step through the
protobuf wire, no gRPC), alternated over --rounds. Per mode: the TTFT of
returning turns (a turn's first step to its first token; median, p90), the
prompt tokens by source (computed, pool hit, tier hit) and the tier's block
copies. Then the median of the rounds' TTFT ratios (tier / recompute).

--idle-steps N also measures the connector's cost when nothing moves: N
decode steps of --conversations requests in a pool that holds them all,
with a tier and without (alternated three times; ms/step each, and the ratio
of their best).
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
from controlplane.core.request import Request, SamplingParams  # noqa: E402
from controlplane.executor.group_startup import offload_slots  # noqa: E402
from controlplane.model_info import read_model_info  # noqa: E402
from kvloom_testing.inprocess import InProcessExecutor  # noqa: E402
from kvloom_testing.scheduler import make_scheduler  # noqa: E402
from workerd.cpu_features import isa_summary  # noqa: E402

BLOCK_SIZE = 16
MAX_ROUNDS = 20


def conversations(vocab: int, eos: set[int], args) -> list[list[list[int]]]:
    """[conversation][turn] -> the tokens the user adds that turn (the
    system prompt first), from --seed."""
    rng = random.Random(args.seed)

    def words(n: int) -> list[int]:
        out = []
        while len(out) < n:
            t = rng.randrange(vocab)
            if t not in eos:
                out.append(t)
        return out

    return [[words(args.system_len) + words(args.turn_len)]
            + [words(args.turn_len) for _ in range(args.turns - 1)]
            for _ in range(args.conversations)]


def run_mode(model: str, convs, args, tier_blocks: int) -> dict:
    """Every turn of every conversation, round-robin, one request at a time."""
    longest = args.system_len + args.turns * (args.turn_len + args.max_tokens)
    executor = InProcessExecutor(model, block_size=BLOCK_SIZE, num_gpu_blocks=args.pool_blocks,
                                 dtype=args.dtype, num_offload_slots=tier_blocks)
    try:
        sched = make_scheduler(executor, max_num_seqs=1, max_num_batched_tokens=longest,
                               max_model_len=longest)
        history = [[] for _ in convs]
        ttft_first, ttft_returning, n = [], [], 0
        for turn in range(args.turns):
            for c, conv in enumerate(convs):
                prompt = history[c] + conv[turn]
                req = Request(f"c{c}t{turn}", prompt, SamplingParams(
                    temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
                sched.add_request(req)
                start, first, answer = time.perf_counter(), None, []
                while sched.has_unfinished_requests():
                    if not sched.has_requests_to_schedule():
                        # Waiting for its KV, as EngineCore waits on its input
                        # queue: the load job's report moves it on.
                        sched.update_from_kv_loads(executor.take_kv_loads_done(wait_s=10.0))
                        continue
                    step = sched.schedule_step()
                    out = executor.execute_model(step.scheduler_output, step.expected)
                    for o in sched.update_from_output(step.scheduler_output, out):
                        if first is None and o.new_token_ids:
                            first = time.perf_counter()
                        answer.extend(o.new_token_ids)
                    sched.update_from_kv_loads(executor.take_kv_loads_done())
                n += 1
                (ttft_first if turn == 0 else ttft_returning).append(1000 * (first - start))
                history[c] = prompt + answer
        stats = sched.make_stats()
    finally:
        executor.close()
    computed = stats.prefix_cache_queries - stats.prefix_cache_hits \
        - stats.external_prefix_cache_hits
    return {
        "requests": n, "tier_blocks": tier_blocks,
        "ttft_returning_ms": ttft_returning, "ttft_first_ms": ttft_first,
        "ttft_returning_median_ms": statistics.median(ttft_returning),
        "ttft_returning_p90_ms": _p90(ttft_returning),
        "prompt_tokens": stats.prefix_cache_queries,
        "tokens_computed": computed, "tokens_pool_hit": stats.prefix_cache_hits,
        "tokens_tier_hit": stats.external_prefix_cache_hits,
        "tier_stores": stats.kv_offload_stores, "tier_loads": stats.kv_offload_loads,
    }


def idle_steps(model: str, args, tier_blocks: int, vocab: int) -> float:
    """ms per decode step of --conversations requests that all fit the pool
    (nothing is evicted, nothing moves), after one warm-up step."""
    per_req = args.system_len + args.turn_len + args.idle_steps + 2
    blocks = args.conversations * (-(-per_req // BLOCK_SIZE) + 1)
    executor = InProcessExecutor(model, block_size=BLOCK_SIZE, num_gpu_blocks=blocks,
                                 dtype=args.dtype, num_offload_slots=tier_blocks)
    try:
        sched = make_scheduler(executor, max_num_seqs=args.conversations,
                               max_num_batched_tokens=args.conversations * per_req,
                               max_model_len=per_req)
        rng = random.Random(args.seed + 1)
        for c in range(args.conversations):
            prompt = [rng.randrange(vocab) for _ in range(args.system_len + args.turn_len)]
            sched.add_request(Request(f"idle{c}", prompt, SamplingParams(
                temperature=0.0, max_tokens=args.idle_steps + 2, ignore_eos=True)))
        timed = 0.0
        for i in range(args.idle_steps + 1):  # the prefill step first, untimed
            t0 = time.perf_counter()
            step = sched.schedule_step()
            assert step.scheduler_output.kv_connector_metadata is None
            out = executor.execute_model(step.scheduler_output, step.expected)
            sched.update_from_output(step.scheduler_output, out)
            if i:
                timed += time.perf_counter() - t0
    finally:
        executor.close()
    return 1000 * timed / args.idle_steps


def _p90(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir; default: the embedded SmolLM2-135M")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--turn-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=96)
    p.add_argument("--tier-gib", type=float, default=1.0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--idle-steps", type=int, default=0)
    p.add_argument("--idle-repeats", type=int, default=3,
                   help="alternations of the --idle-steps runs, with a tier and without")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write results here")
    return p


BOUNDS = {"conversations": (1, 256), "turns": (2, 64), "system_len": (1, 1 << 16),
          "turn_len": (1, 1 << 14), "max_tokens": (1, 1 << 14), "pool_blocks": (1, 1 << 20),
          "threads": (1, 1024), "rounds": (1, MAX_ROUNDS), "idle_steps": (0, 10_000),
          "idle_repeats": (1, MAX_ROUNDS)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name, (lo, hi) in BOUNDS.items():
        if not lo <= getattr(args, name) <= hi:
            raise SystemExit(f"--{name.replace('_', '-')} must be in [{lo}, {hi}]")
    if not 0 < args.tier_gib <= 4096:
        raise SystemExit("--tier-gib must be in (0, 4096]")
    if args.model is None:
        from kvloom.common.default_model import default_model_dir

        args.model = str(default_model_dir())
    torch.set_num_threads(args.threads)
    info = read_model_info(args.model)
    convs = conversations(info.vocab_size, set(info.eos_token_ids), args)
    probe = InProcessExecutor(args.model, block_size=BLOCK_SIZE, num_gpu_blocks=1,
                              dtype=args.dtype)
    try:
        from workerd.runner.kv_cache import bytes_per_block

        runner = probe.runner
        per_block = bytes_per_block(runner.model, BLOCK_SIZE, runner.dtype)
    finally:
        probe.close()
    tier_blocks = offload_slots(args.tier_gib, per_block)
    rounds = []
    for i in range(args.rounds):
        order = ("tier", "recompute") if i % 2 == 0 else ("recompute", "tier")
        runs = {mode: run_mode(args.model, convs, args, tier_blocks if mode == "tier" else 0)
                for mode in order}
        runs["ratio"] = (runs["tier"]["ttft_returning_median_ms"]
                         / runs["recompute"]["ttft_returning_median_ms"])
        rounds.append(runs)
        print(f"== round {i + 1} of {args.rounds}: {isa_summary()}, tier {tier_blocks} blocks")
        for mode in ("recompute", "tier"):
            r = runs[mode]
            print(f"{mode:9s}  TTFT returning median {r['ttft_returning_median_ms']:8.1f} ms  "
                  f"p90 {r['ttft_returning_p90_ms']:8.1f} ms  prompt tokens computed "
                  f"{r['tokens_computed']:6d} pool {r['tokens_pool_hit']:6d} tier "
                  f"{r['tokens_tier_hit']:6d}  stores {r['tier_stores']} loads "
                  f"{r['tier_loads']}")
        print(f"returning TTFT, tier / recompute: {runs['ratio']:.3f}")
    result = {"isa": isa_summary(), "tier_blocks": tier_blocks, "bytes_per_block": per_block,
              "args": {k: v for k, v in vars(args).items() if k != "json"}, "rounds": rounds,
              "median_ratio": statistics.median(r["ratio"] for r in rounds)}
    if args.idle_steps:
        idle = {}
        for mode in ("tier", "none") * args.idle_repeats:
            idle.setdefault(mode, []).append(
                idle_steps(args.model, args, tier_blocks if mode == "tier" else 0,
                           info.vocab_size))
        result["idle_ms_per_step"] = idle
        # Best and median: one quiet (or noisy) run moves the best alone.
        ratio = min(idle["tier"]) / min(idle["none"])
        median_ratio = statistics.median(idle["tier"]) / statistics.median(idle["none"])
        result["idle_ratio"], result["idle_median_ratio"] = ratio, median_ratio
        print(f"nothing moving, ms/step (best of {args.idle_repeats}; all): tier "
              f"{min(idle['tier']):.3f} {[round(v, 2) for v in idle['tier']]}, no tier "
              f"{min(idle['none']):.3f} {[round(v, 2) for v in idle['none']]} "
              f"(best {ratio:.3f}x, median {median_ratio:.3f}x)")
    print(f"median returning-TTFT ratio over {args.rounds} round(s): {result['median_ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
