"""Replay a request trace through the Scheduler alone, with a fabricated model.

Each step: schedule() -> a ModelRunnerOutput with one token for every
scheduled request whose prompt is fully computed after the step (none for a
partial prefill chunk) -> update_from_output(), until every request finishes.
Reports the scheduler's own cost per step (schedule + update; the fake model
and the protobuf serialization of the diff are timed apart), preemptions, the
prefix-cache hit rate and the diff size on the wire.

  python benchmarks/gen_trace.py --num-requests 1024 --out /tmp/t.json
  python benchmarks/scheduler_replay.py --trace /tmp/t.json --num-blocks 0 \\
      --max-num-seqs 1024 --json /tmp/r.json

--num-blocks 0 sizes the pool to half of peak demand, where peak demand is
sum over requests of ceil((prompt + max_tokens) / block_size).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controlplane.config import CacheConfig, SchedulerConfig  # noqa: E402
from controlplane.core.outputs import ModelRunnerOutput  # noqa: E402
from controlplane.core.request import Request, SamplingParams  # noqa: E402
from controlplane.core.scheduler import Scheduler  # noqa: E402
from controlplane.executor.wire import scheduler_output_to_proto  # noqa: E402

EOS_TOKEN_ID = 2  # below the trace's token range: only sampled if ignore_eos=False


def peak_demand_blocks(requests: list[dict], block_size: int) -> int:
    return sum(-(-(len(r["prompt_token_ids"]) + r["max_tokens"]) // block_size) for r in requests)


def _make_request(spec: dict) -> Request:
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"])
    return Request(
        spec["request_id"],
        spec["prompt_token_ids"],  # never mutated: no copy
        params,
        eos_token_ids=frozenset({EOS_TOKEN_ID}),
    )


def _fake_model_output(sched: Scheduler, so, rng: random.Random) -> ModelRunnerOutput:
    # The scheduler advances num_computed_tokens in schedule(), so "prompt
    # fully computed after this step" is num_computed_tokens >= num_tokens.
    req_ids = []
    get = sched.requests.get
    for req_id in so.num_scheduled_tokens:
        req = get(req_id)
        if req is not None and req.num_computed_tokens >= len(req.all_token_ids):
            req_ids.append(req_id)
    sampled = [rng.randrange(100, 50000) for _ in req_ids]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


class _GCClock:
    """Wall time spent in cyclic GC collections (whole loop, any phase)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._start

    def stop(self) -> float:
        gc.callbacks.remove(self._on_gc)
        return self.total_s * 1e3


def replay(trace: dict, args: argparse.Namespace) -> dict:
    specs = sorted(trace["requests"], key=lambda r: r["arrival_step"])
    block_size = args.block_size
    num_blocks = args.num_blocks or max(1, peak_demand_blocks(specs, block_size) // 2)
    max_model_len = args.max_model_len or max(
        len(r["prompt_token_ids"]) + r["max_tokens"] for r in specs
    )
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=args.enable_prefix_caching,
                    enable_kv_cache_events=False),
        num_blocks,
    )
    if args.gc_freeze:
        # As vLLM's EngineCore does after start-up: move the long-lived pool
        # (tens of thousands of KVCacheBlocks) out of the cyclic GC's sight.
        gc.collect()
        gc.freeze()
    gc_clock = _GCClock()
    rng = random.Random(0)
    sched_ms, update_ms, ser_ms, diff_bytes = [], [], [], []
    new_prompt_tokens = new_hit_tokens = num_output_tokens = 0
    next_spec = step = 0
    clock = time.perf_counter
    # Thread CPU time too: on a shared box wall time also counts other tenants.
    cpu_clock = time.thread_time
    step_cpu_ms: list[float] = []
    wall0 = clock()
    while next_spec < len(specs) or sched.has_unfinished_requests():
        while next_spec < len(specs) and specs[next_spec]["arrival_step"] <= step:
            sched.add_request(_make_request(specs[next_spec]))
            next_spec += 1
        step += 1
        c0 = cpu_clock()
        t0 = clock()
        so = sched.schedule()
        t1 = clock()
        c1 = cpu_clock()
        mro = _fake_model_output(sched, so, rng)
        c2 = cpu_clock()
        t2 = clock()
        outputs = sched.update_from_output(so, mro)
        t3 = clock()
        c3 = cpu_clock()
        step_cpu_ms.append((c1 - c0 + c3 - c2) * 1e3)
        data = scheduler_output_to_proto(so).SerializeToString()
        t4 = clock()
        sched_ms.append((t1 - t0) * 1e3)
        update_ms.append((t3 - t2) * 1e3)
        ser_ms.append((t4 - t3) * 1e3)
        diff_bytes.append(len(data))
        num_output_tokens += len(outputs)
        for new_req in so.scheduled_new_reqs:
            new_prompt_tokens += len(new_req.prompt_token_ids)
            new_hit_tokens += new_req.num_computed_tokens
    wall_s = clock() - wall0
    step_ms = sorted(s + u for s, u in zip(sched_ms, update_ms, strict=True))
    return {
        "trace": trace.get("meta", {}),
        "num_requests": len(specs),
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "gc_freeze": args.gc_freeze,
        "steps": step,
        "wall_s": wall_s,
        "step_ms_mean": statistics.fmean(step_ms),
        "step_ms_p50": step_ms[len(step_ms) // 2],
        "step_ms_p99": step_ms[min(len(step_ms) - 1, int(len(step_ms) * 0.99))],
        "step_cpu_ms_mean": statistics.fmean(step_cpu_ms),
        "schedule_ms_mean": statistics.fmean(sched_ms),
        "update_ms_mean": statistics.fmean(update_ms),
        "serialize_ms_mean": statistics.fmean(ser_ms),
        "gc_ms_per_step": gc_clock.stop() / step,
        "output_tokens": num_output_tokens,
        "preemptions": sched.num_preemptions,
        "prefix_cache_hit_rate": new_hit_tokens / new_prompt_tokens if new_prompt_tokens else 0.0,
        "diff_bytes_mean": statistics.fmean(diff_bytes),
        "diff_bytes_max": max(diff_bytes),
    }


def _print_table(result: dict) -> None:
    keys = [k for k in result if k != "trace"]
    width = max(len(k) for k in keys)
    print(f"trace: {result['trace']}")
    for k in keys:
        v = result[k]
        print(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--num-blocks", type=int, default=0, help="0 = half of peak demand")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=0, help="0 = longest request")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--gc-freeze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.freeze() after building the scheduler (vLLM does so after start-up)",
    )
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    result = replay(trace, args)
    _print_table(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
