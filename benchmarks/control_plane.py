"""Control-plane cost per step with null workers: 1, 4 and 16 ranks, 64 and 256 running.

    python benchmarks/control_plane.py --out results.json
    python benchmarks/control_plane.py --quick
    python benchmarks/control_plane.py --quick --layouts 1x1 --running 8   # smallest
    python benchmarks/control_plane.py --running 64 --step-ms 0   # unpaced

For each layout (default 1x1, 2x2, 8x2 as TPxPP) it starts a real controlplane
process (`python -m controlplane --tensor-parallel-size T
--pipeline-parallel-size P --max-num-seqs R --num-gpu-blocks-override ...`)
and T*P null ranks (benchmarks/null_worker.py: they speak worker.proto, have
no model, and the output rank answers each step with a fixed token, no
sooner than --step-ms after its previous reply): the output rank in a process
of its own, the others in a second process.
Then, for each running count R (default 64, 256), this process sends R
concurrent Generate requests (8 prompt token ids, ignore_eos, max_tokens long
enough to outlast the window) over one gRPC channel. The steady window opens
when every request has streamed --warmup tokens and closes when every one has
streamed --warmup + --steps; then the requests are cancelled. Only steps
inside the window that schedule all R requests (pure decode) count. One full
run (3 layouts x 2) takes about two minutes on 2 cores; --quick about 40 s.

The pace (--step-ms, default 20, as a forward pass would space the steps)
keeps the engine from outrunning the controlplane's API loop: a rank that
answers at once lets the engine step faster than the loop delivers R
streams, the loop then admits new streams only between its turns, and the
first requests run so far ahead of the last that they end inside the window
("request ... ended ... in the window"; 256 running on 2 cores). Paced, a
step takes --step-ms while the control path keeps up (ms/step near it) and
longer where it does not; what a step costs is its CPU (below). --step-ms 0
answers at once, as before (64 running then fits on 2 cores).

The controlplane loads only config.json and the tokenizer, so the model is a
config-only directory (benchmarks/null_checkpoint.py): --model's config with
the attention heads set so TP up to 8 divides them (32 heads, 8 KV heads),
and --model's tokenizer files (default: the embedded SmolLM2-135M's, so
detokenizing costs what it does in serving); --synthetic-tokenizer uses a
1,024-word word-level tokenizer instead.

Reported per layout and R, over the steady window:
  * ms/step: the output rank's step arrivals (median, mean), at least --step-ms;
  * bytes/step: the serialized ControlMessage each rank receives (every rank
    gets the same bytes), and that times the world size;
  * the breakdown: from the controlplane's /metrics (deltas of its histogram
    sums over the window) schedule()+update_from_output() per step, and the
    executor's round trip (broadcast -> output rank's reply arrives); the rest
    of a step is what the engine thread does outside both (SchedulerOutput ->
    proto, checking the reply, handing outputs to the API loop) plus waiting
    for the GIL its own API and worker loops hold. From the null output rank:
    its reply latency (step arrival -> reply written, the pace's wait
    included) and the gap from its reply to the next step's arrival
    (everything the controlplane does between two steps, transport
    included); the spread of one step's arrival over the ranks (fan-out; the
    output rank runs in a process of its own, the other null ranks share a
    second one and its loop);
  * CPU per step of the controlplane process, the null workers and this
    client process (/proc), to show how much of the 2 cores each one takes;
    and of the controlplane's threads: its API loop (main thread), the engine
    thread, the worker plane's loop, the tokenize pool, the loops' default
    executors, gRPC's own threads and the rest (the /metrics server). The
    controlplane is started through a wrapper that only names its Python
    threads for the kernel (NAMED_THREADS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.control_plane_report import (  # noqa: E402
    THREAD_GROUPS,
    Window,
    analyze,
    format_table,
)
from benchmarks.null_checkpoint import write_null_checkpoint  # noqa: E402
from benchmarks.null_worker import parse_step_ms  # noqa: E402
from benchmarks.proc_cpu import CLOCK_TICKS, process_cpu_s, stat_cpu_s  # noqa: E402
from kvloom.client import READY_SERVICE  # noqa: E402
from kvloom.common.procs import reap, stop_pids, with_parent_death_signal  # noqa: E402
from kvloom.v1 import generation_pb2 as pb  # noqa: E402
from kvloom.v1 import generation_pb2_grpc  # noqa: E402
from kvloom_cli.launcher import (  # noqa: E402
    ClusterSpec,
    Ports,
    controlplane_command,
    pick_free_ports,
)

PROMPT_LEN = 8
READY_TIMEOUT_S = 120.0
DEFAULT_STEP_MS = 20.0
MAX_RUNNING = 4096  # --running: one client process, one channel


# Runs `python -m controlplane` unchanged, except that every Python thread
# gives the kernel its name (PR_SET_NAME, 15 characters), so /proc shows
# which thread spends the CPU: the main thread (the client API's loop),
# engine-core, worker-plane, the tokenize pool; gRPC's own threads name
# themselves. Measurement only: nothing else of the controlplane changes.
NAMED_THREADS = (
    "import ctypes, runpy, sys, threading\n"
    "prctl = ctypes.CDLL(None).prctl\n"
    "prctl(15, b'api-loop', 0, 0, 0)\n"
    "_run = threading.Thread.run\n"
    "def run(self):\n"
    "    prctl(15, self.name.encode()[:15], 0, 0, 0)\n"
    "    _run(self)\n"
    "threading.Thread.run = run\n"
    "sys.argv[0] = 'controlplane'\n"
    "runpy.run_module('controlplane', run_name='__main__', alter_sys=True)\n"
)


# ---- processes ----------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        lines = self.log.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(f"  [{self.name}] {line}" for line in lines)

    def cpu_s(self) -> float:
        """User + system CPU seconds so far (its threads included)."""
        return process_cpu_s(self.popen.pid)

    def thread_cpu_s(self) -> dict[str, float]:
        """CPU seconds so far by THREAD_GROUPS (the rest under "other"); threads
        that have exited are not counted."""
        out = dict.fromkeys([name for name, _ in THREAD_GROUPS] + ["other"], 0.0)
        try:
            tasks = list(Path(f"/proc/{self.popen.pid}/task").iterdir())
        except OSError:
            return out
        for task in tasks:
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            cpu = stat_cpu_s(stat)
            group = next((name for name, parts in THREAD_GROUPS
                          if any(part in comm for part in parts)), "other")
            out[group] += cpu
        return out

    def stop(self, grace: float = 15.0) -> None:
        if self.alive():
            stop_pids([(self.name, self.popen.pid)], grace=grace)
        reap(self.popen)


def spawn(name: str, argv: list[str], log: Path, cwd: Path = REPO) -> Proc:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            with_parent_death_signal(argv), env=env, cwd=cwd,
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )
    return Proc(name, popen, log)


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLOCK_TICKS


@dataclass
class Layout:
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        return f"TP{self.tp}xPP{self.pp}"


def start_controlplane(
    model: str, layout: Layout, ports: Ports, max_num_seqs: int, num_blocks: int, log: Path,
    extra: tuple[str, ...] = (),
) -> Proc:
    spec = ClusterSpec(
        model=model, tensor_parallel_size=layout.tp, pipeline_parallel_size=layout.pp,
        controlplane_args=("--max-num-seqs", str(max_num_seqs),
                           "--num-gpu-blocks-override", str(num_blocks),
                           "--log-level", "WARNING", *extra),
    )
    argv = controlplane_command(spec, model, ports)
    assert argv[1:3] == ["-m", "controlplane"], argv
    return spawn("controlplane", [argv[0], "-c", NAMED_THREADS, *argv[3:]], log)


def start_null_workers(
    worker_address: str, layout: Layout, logs: Path, step_ms: float = 0.0
) -> list[tuple[Proc, Path]]:
    """The output rank in a process of its own, so the other ranks' reads never
    delay its reply, replying at most every `step_ms`; the other ranks together
    in a second one. Each process with the file its step records go to."""
    output = (layout.pp - 1) * layout.tp
    others = [r for r in range(layout.world_size) if r != output]
    groups = [("null output rank", [output])] + ([("null other ranks", others)] if others else [])
    out = []
    for name, ranks in groups:
        slug = name.replace(" ", "-")
        steps_log = logs / f"steps-{layout.name}-{slug}.json"
        argv = [sys.executable, "-m", "benchmarks.null_worker", "--controlplane",
                worker_address, "--world-size", str(layout.world_size),
                "--ranks", ",".join(map(str, ranks)), "--log", str(steps_log),
                "--step-ms", str(step_ms if ranks == [output] else 0.0)]
        out.append((spawn(name, argv, logs / f"{slug}-{layout.name}.log"), steps_log))
    return out


async def health(api: str, service: str = READY_SERVICE) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(api) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_serving(api: str, procs: list[Proc], timeout: float = READY_TIMEOUT_S) -> None:
    """Until the controlplane says the worker group is ready; fails fast when a
    process exits first."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        for proc in procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        try:
            last = await health(api)
            if last == "SERVING":
                return
        except grpc.aio.AioRpcError as exc:
            last = exc.code().name
        await asyncio.sleep(0.1)
    raise RuntimeError(f"not ready after {timeout:g} s (health: {last}):\n"
                       + "\n".join(p.tail() for p in procs))


# ---- /metrics -------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """{metric name (no labels): value} of the step series we read."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(kvloom_\w+?)(\{[^}]*\})? (\S+)$", text, re.M):
        name = m.group(1)
        if name.startswith("kvloom_event_loop_wakeup_lag_seconds"):
            loop = re.search(r'loop="([^"]+)"', m.group(2) or "")
            name = f"{name}:{loop.group(1) if loop else ''}"
        if name.endswith(("_sum", "_count")) or name == "kvloom_generation_tokens_total" or (
                ":" in name and not name.startswith("kvloom_event_loop_wakeup_lag_seconds_b")):
            out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


# ---- the client -----------------------------------------------------------------


def max_tokens_for(running: int, warmup: int, steps: int) -> int:
    """Long enough that no request ends before the window closes: the window
    opens only when the last request admitted has streamed `warmup` tokens, and
    the first ones admitted are ahead by up to one token per step of the ramp."""
    return warmup + steps + 4 * running + 200


async def drive(api: str, metrics_url: str, running: int, warmup: int, steps: int,
                procs: list[Proc]) -> tuple[Window, list[int], float]:
    """`running` concurrent requests until the steady window closes, then they
    are cancelled; the window, tokens streamed per request, seconds."""
    max_tokens = max_tokens_for(running, warmup, steps)
    counts = [0] * running
    reached = {warmup: 0, warmup + steps: 0}
    opened, closed = asyncio.Event(), asyncio.Event()
    marks = {warmup: opened, warmup + steps: closed}

    def cpu() -> dict[str, float]:
        threads = {f"controlplane {k}": v for k, v in procs[0].thread_cpu_s().items()}
        return {"client": time.process_time(), **{p.name: p.cpu_s() for p in procs}, **threads,
                "machine": machine_busy_s()}

    async def one(stub, i: int) -> None:
        ids = [3 + (i * 7 + j) % 200 for j in range(PROMPT_LEN)]
        req = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        async for msg in stub.Generate(req, timeout=600):
            before = counts[i]
            counts[i] = after = before + len(msg.token_ids)
            for mark, event in marks.items():
                if before < mark <= after:
                    reached[mark] += 1
                    if reached[mark] == running:
                        event.set()
        raise RuntimeError(f"request {i} ended after {counts[i]} tokens, in the window")

    window = Window()
    loop = asyncio.get_running_loop()

    async def observe() -> None:
        await opened.wait()
        window.t_open, window.cpu_open = time.monotonic(), cpu()
        window.metrics_open = await loop.run_in_executor(None, scrape, metrics_url)
        await closed.wait()
        window.t_close, window.cpu_close = time.monotonic(), cpu()
        window.metrics_close = await loop.run_in_executor(None, scrape, metrics_url)

    async with grpc.aio.insecure_channel(api) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # One request alone first, so every code path is warm.
        async for _ in stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[3] * PROMPT_LEN),
                sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True)), timeout=600):
            pass
        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(stub, i)) for i in range(running)]
        observer = asyncio.create_task(observe())
        try:
            # A request that fails (or ends early) ends the run at once.
            done, _ = await asyncio.wait([*tasks, observer], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in [*tasks, observer]:
                task.cancel()
            await asyncio.gather(*tasks, observer, return_exceptions=True)
        seconds = time.monotonic() - t0
    return window, counts, seconds


# ---- one layout -----------------------------------------------------------------


def run_layout(layout: Layout, args, model: str, tmp: Path) -> list[dict]:
    ports = Ports(*pick_free_ports(3))
    api = f"127.0.0.1:{ports.api}"
    metrics_url = f"http://127.0.0.1:{ports.metrics}/metrics"
    blocks = max(r * ((PROMPT_LEN + max_tokens_for(r, args.warmup, args.steps)) // 16 + 2)
                 for r in args.running) + 1024
    results: list[dict] = []
    with ExitStack() as stack:
        cp = start_controlplane(model, layout, ports, max(args.running), blocks,
                                tmp / f"controlplane-{layout.name}.log",
                                () if args.async_scheduling else ("--no-async-scheduling",))
        stack.callback(cp.stop)
        nulls = start_null_workers(f"127.0.0.1:{ports.worker}", layout, tmp, args.step_ms)
        for proc, _ in nulls:
            stack.callback(proc.stop)
        procs = [cp, *(proc for proc, _ in nulls)]
        asyncio.run(wait_serving(api, procs))
        runs = []
        for running in args.running:
            print(f"== {layout.name}: {running} running", file=sys.stderr)
            window, counts, seconds = asyncio.run(drive(
                api, metrics_url, running, args.warmup, args.steps, procs))
            runs.append((running, window, seconds))
        # The controlplane tells the workers to shut down; they write their log.
        cp.stop()
        deadline = time.monotonic() + 15
        while any(proc.alive() for proc, _ in nulls) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc, _ in nulls:
            proc.stop()
    ranks = [r for _, steps_log in nulls for r in json.loads(steps_log.read_text())["ranks"]]
    for running, window, seconds in runs:
        result = analyze(ranks, window, running, layout.world_size)
        results.append({"layout": layout.name, "tp": layout.tp, "pp": layout.pp,
                        "ranks": layout.world_size, "run_s": seconds, **result})
    return results


def parse_running(text: str) -> list[int]:
    """--running: comma-separated counts of concurrent requests, 1..MAX_RUNNING."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not 1 <= v <= MAX_RUNNING for v in values):
        raise argparse.ArgumentTypeError(
            f"bad --running {text!r}: counts in 1..{MAX_RUNNING}, e.g. 256,64")
    return values


def parse_layouts(text: str) -> list[Layout]:
    out = []
    for item in text.split(","):
        tp, _, pp = item.strip().lower().partition("x")
        if not (tp.isdigit() and pp.isdigit()) or int(tp) < 1 or int(pp) < 1:
            raise argparse.ArgumentTypeError(f"bad layout {item!r}: expected TPxPP like 2x2")
        out.append(Layout(int(tp), int(pp)))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", type=parse_layouts, default=parse_layouts("1x1,2x2,8x2"),
                   help="TPxPP, comma-separated")
    p.add_argument("--running", type=parse_running, default=[64, 256],
                   help="running requests, comma-separated")
    p.add_argument("--warmup", type=int, default=30, help="tokens each request streams before "
                   "the window opens")
    p.add_argument("--steps", type=int, default=500, help="decode steps in the window")
    p.add_argument("--quick", action="store_true", help="--warmup 10 --steps 60")
    p.add_argument("--step-ms", type=parse_step_ms, default=DEFAULT_STEP_MS,
                   help="the null output rank's least time between two replies, so the "
                        "engine cannot outrun this client (0: at once)")
    p.add_argument("--model", help="checkpoint whose config and tokenizer to use; default: "
                   "the embedded SmolLM2-135M")
    p.add_argument("--synthetic-tokenizer", action="store_true",
                   help="a word-level tokenizer instead of --model's")
    p.add_argument("--keep", action="store_true", help="keep the temporary dir (logs)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="the controlplane's --async-scheduling (PP>1: one micro-batch of "
                        "running/PP requests per step)")
    p.add_argument("--out", "--json", type=Path, help="write the results here (JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.steps = 10, 60
    if not (1 <= args.warmup <= 100_000 and 1 <= args.steps <= 100_000):
        parser.error("--warmup and --steps must be in 1..100000")
    tmp = Path(tempfile.mkdtemp(prefix="kvloom-cp-bench-"))
    try:
        source = None
        if not args.synthetic_tokenizer:
            if args.model:
                source = args.model
            else:
                from kvloom.common.default_model import default_model_dir

                source = default_model_dir()
        model = write_null_checkpoint(tmp / "model", source)
        results = []
        for layout in args.layouts:
            results += run_layout(layout, args, model, tmp)
    finally:
        if args.keep:
            print(f"logs: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(format_table(results))
    if args.out:
        config = {k: (v if not isinstance(v, list) or not v or not isinstance(v[0], Layout)
                      else [x.name for x in v]) for k, v in vars(args).items() if k != "out"}
        payload = {"command": " ".join(["python benchmarks/control_plane.py",
                                        *(sys.argv[1:] if argv is None else argv)]),
                   "config": json.loads(json.dumps(config, default=str)),
                   "cpus": os.cpu_count(), "results": results}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
