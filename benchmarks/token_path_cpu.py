"""Controlplane CPU per streamed token: kvloom.v1 Generate vs VllmEngine Generate.

    python benchmarks/token_path_cpu.py --out token_path_cpu.json
    python benchmarks/token_path_cpu.py --quick

One real controlplane process (benchmarks/control_plane.py's: `python -m
controlplane` with its threads named) over one null rank (benchmarks/
null_worker.py's NullRank: no model, it samples a fixed token), so the
controlplane's per-token work is all there is. The rank replies to a step no
sooner than --step-ms after its previous reply, as a model's forward would:
a null rank that answers at once lets the engine outrun the API loop, which
then merges queued tokens into one kvloom.v1 message (and admits new streams
only between its turns: 256 never all start) and so measures a different
regime. With the pace every message carries one token on both paths (the
table's tokens/msg shows it). For each running count R
(default 256 and 64) this process drives R concurrent streams over one gRPC
channel, alternating the two client APIs for --rounds rounds each:

  * kvloom.v1: `kvloom.v1.Generation/Generate` with token ids (8 of them),
    greedy, ignore_eos (the server detokenizes every token for its text);
  * vllm: `vllm.grpc.engine.VllmEngine/Generate` with the same ids in
    `tokenized.input_ids`, stream=true: what the SMG gateway sends, without
    the gateway (ids only, no text).

As in control_plane.py a window opens once every request has streamed
--warmup tokens and closes once every one has streamed --warmup + --steps;
then the streams are cancelled. The controlplane's CPU over the window (user
+ system, /proc/<pid>/stat, all its threads) over the tokens this client
received in it is the figure: µs per streamed token, the same split by
thread group (the API loop, which runs both edges, the engine thread, the
worker plane's loop, gRPC's threads, the rest), this client's own CPU per
token (it shares the 2 cores), and the tokens per streamed message. The
table shows each path's median over its rounds and each round's value; the
ratio is vllm over kvloom.v1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script

from benchmarks.control_plane import (  # noqa: E402
    PROMPT_LEN,
    Layout,
    Proc,
    machine_busy_s,
    max_tokens_for,
    parse_running,
    spawn,
    start_controlplane,
    wait_serving,
)
from benchmarks.null_checkpoint import write_null_checkpoint  # noqa: E402
from benchmarks.null_worker import parse_step_ms  # noqa: E402
from kvloom.v1 import generation_pb2 as pb  # noqa: E402
from kvloom.v1 import generation_pb2_grpc  # noqa: E402
from kvloom_cli.launcher import Ports, pick_free_ports  # noqa: E402

PATHS = ("kvloom.v1", "vllm")
GOAL_US = 10.0  # the target for the VllmEngine path


def start_paced_rank(worker_address: str, step_ms: float, log: Path) -> Proc:
    """The one null rank, in a process of its own, replying at most every `step_ms`."""
    return spawn("null rank", [sys.executable, "-m", "benchmarks.null_worker", "--controlplane",
                               worker_address, "--world-size", "1", "--step-ms", str(step_ms)],
                 log)


def prompt_ids(i: int) -> list[int]:
    """Request i's prompt: control_plane.py's ids."""
    return [3 + (i * 7 + j) % 200 for j in range(PROMPT_LEN)]


class Api:
    """Generate on one of the two client APIs, as an async iterator of the
    token counts each streamed message carries."""

    def __init__(self, path: str, channel: grpc.aio.Channel, tag: str):
        self.path = path
        self.tag = tag
        if path == "kvloom.v1":
            self.stub = generation_pb2_grpc.GenerationStub(channel)
        else:
            self.stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

    async def tokens(self, i: int, ids: list[int], max_tokens: int):
        if self.path == "kvloom.v1":
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids),
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True))
            async for msg in self.stub.Generate(req, timeout=600):
                yield len(msg.token_ids)
        else:
            req = vpb.GenerateRequest(
                request_id=f"bench-{self.tag}-{i}", tokenized=vpb.TokenizedInput(input_ids=ids),
                sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True),
                stream=True)
            async for msg in self.stub.Generate(req, timeout=600):
                if msg.HasField("chunk"):
                    yield len(msg.chunk.token_ids)


def snapshot(cp: Proc) -> dict[str, float]:
    return {"controlplane": cp.cpu_s(),
            **{f"thread {k}": v for k, v in cp.thread_cpu_s().items()},
            "client": time.process_time(), "machine": machine_busy_s(),
            "t": time.monotonic()}


async def drive(api_address: str, path: str, tag: str, running: int, warmup: int, steps: int,
                cp: Proc) -> dict:
    """`running` concurrent streams on `path` until the steady window closes;
    the CPU and token deltas over the window."""
    max_tokens = max_tokens_for(running, warmup, steps)
    counts = [0] * running
    messages = [0]
    reached = {warmup: 0, warmup + steps: 0}
    opened, closed = asyncio.Event(), asyncio.Event()
    marks = {warmup: opened, warmup + steps: closed}
    snaps: dict[str, tuple[dict, int]] = {}

    async def one(api: Api, i: int) -> None:
        async for n in api.tokens(i, prompt_ids(i), max_tokens):
            before = counts[i]
            counts[i] = after = before + n
            messages[0] += 1
            for mark, event in marks.items():
                if before < mark <= after:
                    reached[mark] += 1
                    if reached[mark] == running:
                        # Taken here, before any other stream advances, so
                        # the token count and the CPU read are one instant.
                        name = "open" if event is opened else "close"
                        snaps[name] = (snapshot(cp), sum(counts), messages[0])
                        event.set()
        raise RuntimeError(f"{path} request {i} ended after {counts[i]} tokens, in the window")

    async with grpc.aio.insecure_channel(api_address) as channel:
        api = Api(path, channel, tag)
        async for _ in Api(path, channel, f"{tag}-warm").tokens(0, prompt_ids(0), 4):
            pass  # one request alone first, so every code path is warm
        tasks = [asyncio.create_task(one(api, i)) for i in range(running)]
        waiter = asyncio.create_task(closed.wait())
        try:
            done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a request that failed or ended early ends the run
        finally:
            for task in [*tasks, waiter]:
                task.cancel()
            await asyncio.gather(*tasks, waiter, return_exceptions=True)
    (a, tokens_a, msgs_a), (b, tokens_b, msgs_b) = snaps["open"], snaps["close"]
    tokens = tokens_b - tokens_a
    seconds = b["t"] - a["t"]
    us = {k: 1e6 * (b[k] - a[k]) / tokens for k in a if k not in ("t", "machine")}
    return {"path": path, "running": running, "tokens": tokens, "window_s": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "tokens_per_message": tokens / (msgs_b - msgs_a) if msgs_b > msgs_a else 0.0,
            "machine_busy_cores": (b["machine"] - a["machine"]) / seconds if seconds else 0.0,
            "us_per_token": us}


def run(args) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="kvloom-token-path-"))
    layout = Layout(1, 1)
    results: list[dict] = []
    try:
        model = write_null_checkpoint(tmp / "model", args.tokenizer_from)
        ports = Ports(*pick_free_ports(3))
        api = f"127.0.0.1:{ports.api}"
        blocks = max(r * ((PROMPT_LEN + max_tokens_for(r, args.warmup, args.steps)) // 16 + 2)
                     for r in args.running) + 1024
        with ExitStack() as stack:
            cp = start_controlplane(model, layout, ports, max(args.running), blocks,
                                    tmp / "controlplane.log", tuple(args.controlplane_args))
            stack.callback(cp.stop)
            rank = start_paced_rank(f"127.0.0.1:{ports.worker}", args.step_ms,
                                    tmp / "null-rank.log")
            stack.callback(rank.stop)
            asyncio.run(wait_serving(api, [cp, rank]))
            for running in args.running:
                for i in range(args.rounds):
                    for path in PATHS:
                        print(f"== {running} running, round {i + 1} of {args.rounds}: {path}",
                              file=sys.stderr)
                        tag = f"{running}-{i}"
                        result = asyncio.run(drive(api, path, tag, running, args.warmup,
                                                   args.steps, cp))
                        results.append({"round": i + 1, **result})
    finally:
        if args.keep:
            print(f"logs: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return results


# ---- the report ---------------------------------------------------------------------


def summary(results: list[dict]) -> list[dict]:
    """Per running count and path: the median of each figure over the rounds."""
    out = []
    for running in dict.fromkeys(r["running"] for r in results):
        for path in PATHS:
            rounds = [r for r in results if r["running"] == running and r["path"] == path]
            if not rounds:
                continue
            keys = rounds[0]["us_per_token"]
            out.append({
                "running": running, "path": path, "rounds": len(rounds),
                "us_per_token": {k: statistics.median(r["us_per_token"][k] for r in rounds)
                                 for k in keys},
                "controlplane_us_rounds": [r["us_per_token"]["controlplane"] for r in rounds],
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds),
                "tokens_per_message": statistics.median(r["tokens_per_message"]
                                                        for r in rounds),
                "tokens": sum(r["tokens"] for r in rounds),
            })
    return out


THREAD_ROWS = (("api loop", "thread api loop"), ("engine", "thread engine"),
               ("worker plane", "thread worker plane"), ("grpc threads", "thread grpc threads"),
               ("other threads", None))


def _other_threads(us: dict) -> float:
    named = sum(us[key] for _, key in THREAD_ROWS if key)
    return us["controlplane"] - named


def format_table(rows: list[dict]) -> str:
    header = ["running", "path", "cp us/token", "rounds", *(n for n, _ in THREAD_ROWS),
              "client us/token", "tokens/s", "tokens/msg"]
    table = [header]
    for row in rows:
        us = row["us_per_token"]
        table.append([
            str(row["running"]), row["path"], f"{us['controlplane']:.1f}",
            " ".join(f"{v:.1f}" for v in row["controlplane_us_rounds"]),
            *(f"{us[key]:.1f}" if key else f"{_other_threads(us):.1f}" for _, key in THREAD_ROWS),
            f"{us['client']:.1f}", f"{row['tokens_per_s']:.0f}",
            f"{row['tokens_per_message']:.2f}",
        ])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for running in dict.fromkeys(r["running"] for r in rows):
        by = {r["path"]: r["us_per_token"]["controlplane"] for r in rows
              if r["running"] == running}
        if len(by) == 2 and by["kvloom.v1"]:
            verdict = "meets" if by["vllm"] <= GOAL_US else "misses"
            lines.append(f"{running} running: vllm / kvloom.v1 = {by['vllm'] / by['kvloom.v1']:.2f}"
                         f" ({by['vllm']:.1f} vs {by['kvloom.v1']:.1f} us/token; "
                         f"{verdict} the {GOAL_US:g} us goal)")
    return "\n".join(lines)


# ---- the command line ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--running", type=parse_running, default=[256, 64],
                   help="running requests, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each path, alternating")
    p.add_argument("--warmup", type=int, default=30,
                   help="tokens each request streams before the window opens")
    p.add_argument("--steps", type=int, default=300, help="decode steps in the window")
    p.add_argument("--quick", action="store_true", help="--warmup 10 --steps 80")
    p.add_argument("--step-ms", type=parse_step_ms, default=30.0,
                   help="the null rank's least time between two replies (a forward pass)")
    p.add_argument("--model", dest="tokenizer_from",
                   help="checkpoint whose config and tokenizer to use; default: the embedded "
                        "SmolLM2-135M (the kvloom.v1 path detokenizes with it)")
    p.add_argument("--keep", action="store_true", help="keep the temporary dir (logs)")
    p.add_argument("--out", "--json", type=Path, help="write the results here (JSON)")
    p.add_argument("controlplane_args", nargs="*", help="after --: controlplane flags")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.warmup, args.steps = 10, 80
    if args.rounds < 1:
        build_parser().error("--rounds must be at least 1")
    if args.tokenizer_from is None:
        from kvloom.common.default_model import default_model_dir

        args.tokenizer_from = str(default_model_dir())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    rows = summary(results)
    print(format_table(rows))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        payload = {"command": " ".join(["python benchmarks/token_path_cpu.py",
                                        *(sys.argv[1:] if argv is None else argv)]),
                   "config": json.loads(json.dumps(config, default=str)),
                   "cpus": os.cpu_count(), "summary": rows, "results": results}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
