"""Heavy client work vs the worker group: does a huge prompt stall serving?

    python benchmarks/loop_isolation.py [--model DIR] [--step-timeout 3] \\
        [--prompt-mib 8] [--tokenize-calls 4] [--tokenize-mib 1] \\
        [--detokenize-calls 4] [--detokenize-ids 1048576] \\
        [--huge-detokenize-ids 16777216] [--json out.json]

Launches a TP=1 cluster (default: the tests' tiny random Llama, built into a
temporary directory) with a short --step-timeout, keeps greedy streams
generating back to back, and meanwhile sends, all at once: one Generate with
a text prompt of --prompt-mib MiB (issue 10's reproduction 3; a server with
the prompt-character limit refuses it before tokenizing), --tokenize-calls
Tokenize calls of --tokenize-mib MiB of random CJK text (the costliest text we
found for a byte-level BPE: three tokens a character), --detokenize-calls
Detokenize calls of --detokenize-ids ids, and one Detokenize of
--huge-detokenize-ids ids (over the server's limit, where it has one). A
thread probes grpc health every 20 ms; its slowest answer is how long the
API loop stalled.

Reported: each heavy call's status and duration, the streams that finished
OK / failed during the heavy phase, the slowest health answer, worker group
failures (kvloom_worker_failures, by reason) and, where the controlplane
exports it, the event-loop lag per loop during the heavy phase (from the
kvloom_event_loop_wakeup_lag_seconds buckets that gained wake-ups).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from kvloom.client import KvloomClient
from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc
from kvloom_cli import launcher

WORDS = "the quick brown fox jumps over the lazy dog and keeps running through a field "


def text_of(mib: float) -> str:
    size = int(mib * (1 << 20))
    return (WORDS * (size // len(WORDS) + 1))[:size]


def cjk_of(mib: float, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(int(mib * (1 << 20))))


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def metric_values(text: str, name: str) -> dict[str, float]:
    """{label string: value} of every sample of `name` (no suffix)."""
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def _bucket_counts(text: str) -> dict[str, dict[float, float]]:
    out: dict[str, dict[float, float]] = {}
    for labels, count in metric_values(text, "kvloom_event_loop_wakeup_lag_seconds_bucket").items():
        loop = re.search(r'loop="([^"]+)"', labels).group(1)
        le = float(re.search(r'le="([^"]+)"', labels).group(1))
        out.setdefault(loop, {})[le] = count
    return out


def lag_summary(before: str, after: str) -> dict[str, dict[str, float]]:
    """Per loop, over the heavy phase only (start-up excluded): the upper bound
    of the largest histogram bucket that gained wake-ups, and how many wake-ups
    were later than 50 ms; plus the gauge at the end."""
    out: dict[str, dict[str, float]] = {}
    for labels, value in metric_values(after, "kvloom_event_loop_lag_seconds").items():
        loop = re.search(r'loop="([^"]+)"', labels).group(1)
        out.setdefault(loop, {})["gauge_s"] = value
    old = _bucket_counts(before)
    for loop, counts in _bucket_counts(after).items():
        gained = {le: c - old.get(loop, {}).get(le, 0.0) for le, c in counts.items()}
        bounds = sorted(gained.items())
        worst, prev = 0.0, 0.0
        for bound, count in bounds:
            if count > prev:
                worst = bound
            prev = count
        entry = out.setdefault(loop, {})
        entry["max_lag_bucket_le_s"] = worst
        entry["wakeups"] = gained.get(float("inf"), 0.0)
        entry["wakeups_over_50ms"] = entry["wakeups"] - gained.get(0.05, 0.0)
    return out


class HealthProbe(threading.Thread):
    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address = address
        self.worst_s = 0.0
        self.statuses: set[str] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        with KvloomClient(self.address) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    self.statuses.add(client.health("kvloom.v1.Generation", timeout=60))
                except Exception as exc:  # noqa: BLE001 - reported, not raised
                    self.statuses.add(f"error: {exc}")
                self.worst_s = max(self.worst_s, time.perf_counter() - t0)
                time.sleep(0.02)


async def streams_until(stub, done: asyncio.Event, max_tokens: int) -> dict[str, int]:
    outcome: dict[str, int] = {}
    i = 0
    while not done.is_set() or not outcome:
        i += 1
        req = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5 + i % 50, 6, 7, 8]),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        )
        try:
            n = sum([len(m.token_ids) async for m in stub.Generate(req, timeout=120)], 0)
            key = "OK" if n == max_tokens else f"OK but {n} tokens"
        except grpc.aio.AioRpcError as exc:
            key = exc.code().name
        outcome[key] = outcome.get(key, 0) + 1
    return outcome


async def timed(coro) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        await coro
        code = "OK"
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
    return code, time.perf_counter() - t0


async def heavy_phase(address: str, args) -> dict:
    big = text_of(args.prompt_mib)
    tok_text = cjk_of(args.tokenize_mib)
    ids = [i % 200 + 3 for i in range(args.detokenize_ids)]
    huge = [5] * args.huge_detokenize_ids
    opts = [("grpc.max_send_message_length", 256 << 20),
            ("grpc.max_receive_message_length", 256 << 20)]
    async with grpc.aio.insecure_channel(address, options=opts) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        done = asyncio.Event()
        # The first stream is running before the heavy calls arrive.
        first = stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[3, 4, 5]),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                       ignore_eos=True)), timeout=120)
        await first.read()
        background = asyncio.ensure_future(streams_until(stub, done, args.max_tokens))
        calls = []
        if args.prompt_mib:
            calls.append((f"Generate {args.prompt_mib:g} MiB text", stub.Generate(
                pb.GenerateRequest(text=big, sampling=pb.SamplingParams(max_tokens=1)),
                timeout=120).read()))
        for _ in range(args.tokenize_calls):
            calls.append((f"Tokenize {args.tokenize_mib:g} MiB CJK", stub.Tokenize(
                pb.TokenizeRequest(text=tok_text, add_special_tokens=False), timeout=120)))
        for _ in range(args.detokenize_calls):
            calls.append((f"Detokenize {len(ids)} ids", stub.Detokenize(
                pb.DetokenizeRequest(token_ids=ids), timeout=120)))
        if huge:
            calls.append((f"Detokenize {len(huge)} ids", stub.Detokenize(
                pb.DetokenizeRequest(token_ids=huge), timeout=120)))
        results = await asyncio.gather(*(timed(c) for _, c in calls))
        first_code = "OK"
        try:
            while await first.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as exc:
            first_code = exc.code().name
        done.set()
        streams = await background
    heavy: dict[str, dict[str, list[float]]] = {}
    for (name, _), (code, seconds) in zip(calls, results, strict=True):
        heavy.setdefault(name, {}).setdefault(code, []).append(round(seconds, 2))
    return {"heavy_calls": heavy, "first_stream": first_code, "streams": streams}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint dir; default: the tests' tiny random Llama")
    p.add_argument("--prompt-mib", type=float, default=8.0)
    p.add_argument("--tokenize-calls", type=int, default=4)
    p.add_argument("--tokenize-mib", type=float, default=1.0)
    p.add_argument("--detokenize-calls", type=int, default=4)
    p.add_argument("--detokenize-ids", type=int, default=1 << 20)
    p.add_argument("--huge-detokenize-ids", type=int, default=1 << 24)
    p.add_argument("--step-timeout", type=float, default=3.0)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from kvloom_testing.checkpoints import make_tiny_llama

        model = str(make_tiny_llama(Path(tempfile.mkdtemp(prefix="kvloom-tiny-"))))
    spec = launcher.ClusterSpec(
        model=model, worker_threads=1,
        controlplane_args=("--kv-cache-memory-bytes", str(64 << 20),
                           "--step-timeout", str(args.step_timeout)),
    )
    with launcher.Cluster(spec, log_sink=open("/dev/null", "w")) as cluster:  # noqa: SIM115
        cluster.wait_ready(timeout=300)
        probe = HealthProbe(cluster.api_address)
        probe.start()
        text_before = scrape(cluster.metrics_address)
        result = asyncio.run(heavy_phase(cluster.api_address, args))
        probe.stop.set()
        probe.join()
        text = scrape(cluster.metrics_address)
    failures = {re.search(r'reason="([^"]+)"', k).group(1): v
                for k, v in metric_values(text, "kvloom_worker_failures_total").items() if v}
    result.update({
        "slowest_health_answer_s": round(probe.worst_s, 3),
        "health_statuses": sorted(probe.statuses),
        "worker_group_failures": failures,
        "event_loop_lag": lag_summary(text_before, text),
        "args": vars(args),
    })
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not failures and result["first_stream"] == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
