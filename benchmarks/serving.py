"""Serving benchmark: N concurrent Generate streams through the public gRPC API.

Against a running cluster:
    python benchmarks/serving.py --server 127.0.0.1:50051 --num-requests 64 \\
        --concurrency 8 --prompt-len 128 --max-tokens 64 --json out.json

Or launching local clusters one layout (TPxPP) after another and printing one
combined table (TP must divide the model's heads: the default SmolLM2's 9):
    python benchmarks/serving.py --launch --layouts 1x1,3x1,1x2 --num-requests 32
--scheduling async,serial runs every layout twice, with async scheduling (the
default) and with --no-async-scheduling, side by side. Served tokens/s next to
transformers' generate on an embedded model chosen by name:
    python benchmarks/serving.py --launch --model gemma-3-270m --worker-threads 2 \\
        --hf-baseline --json out.json

Prompts are random token ids below the served vocab size (from GetModelInfo),
seeded, EOS ids excluded, or the lines of --dataset sent as text. Requests
use ignore_eos by default so every one produces exactly --max-tokens tokens
and layouts are compared on equal work. Reported: duration, request and
output-token throughput, TTFT, TPOT (per output token after the first) and
inter-token latency (gaps between streamed messages), median and p99; for
launched clusters also, over the timed requests only (from /metrics): steps,
wall ms per step, the output rank's forward ms per step, the broadcast ->
reply round trip per step, the output rank's busy share (forward time over
the wall time), for serial runs the unhidden control overhead per step
(round trip - forward), and the CPU each process spent per step: the
controlplane, all ranks together and this client (on a machine with fewer
cores than processes a step cannot be shorter than their sum over the cores).

--hf-baseline adds transformers' generate on the same requests, with the
same torch threads (--worker-threads, 1 if unset) and dtype, and its
static-batch padding (the most continuous batching can gain at an equal cost
per token row); --rounds N repeats engine and baseline back to back N times
and reports the median ratio, since one round on a shared box is noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvloom_cli import launcher

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from benchmarks.proc_cpu import process_cpu_s  # noqa: E402
from kvloom.client import AsyncKvloomClient, KvloomError, default_server
from kvloom.common.cpu_cores import available_cores, pin_process  # noqa: E402

MAX_ROUNDS = 20


@dataclass
class RequestRecord:
    prompt_len: int
    start: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    def tokens_arrived(self, now: float, last: float, num_tokens: int) -> float:
        """Record output arriving at `now` (the previous arrival was at
        `last`): the first token's time, else an inter-token latency; returns
        `now`, the next call's `last`."""
        if self.first_token is None:
            self.first_token = now
        else:
            self.itl.append(now - last)
        self.output_tokens += num_tokens
        return now


async def run_request(client, prompt, max_tokens: int, args, record: RequestRecord) -> None:
    record.start = last = time.perf_counter()
    try:
        async for chunk in client.generate(
            prompt,
            max_tokens=max_tokens,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            # Left unset at the defaults (one message per token), so a run
            # against an older server sends the same request as before.
            stream=None if args.stream else False,
            stream_interval=args.stream_interval if args.stream_interval > 1 else None,
        ):
            if chunk.token_ids:
                last = record.tokens_arrived(time.perf_counter(), last, len(chunk.token_ids))
    except KvloomError as exc:
        record.error = str(exc)
    record.end = time.perf_counter()


async def benchmark(server: str, args, before_timed=None) -> dict:
    """before_timed(): called after the warm-up, right before the timed requests."""
    async with AsyncKvloomClient(server) as client:
        prompts = await make_prompts(client, args)
        max_tokens = output_lengths(args)
        for prompt, n in list(zip(prompts, max_tokens, strict=True))[: args.warmup]:
            await run_request(client, prompt, n, args, RequestRecord(len(prompt)))
        limit = asyncio.Semaphore(args.concurrency)
        records = [RequestRecord(len(p)) for p in prompts]

        async def one(prompt, n, record):
            async with limit:
                await run_request(client, prompt, n, args, record)

        if before_timed is not None:
            before_timed()
        started = time.perf_counter()
        await asyncio.gather(*(one(p, n, r) for p, n, r in
                               zip(prompts, max_tokens, records, strict=True)))
        duration = time.perf_counter() - started
        server_info = asdict(await client.server_info())
    # The requests themselves, for --hf-baseline (not printed or saved).
    return {"metrics": summarize(records, duration, args.stream), "server_info": server_info,
            "requests": list(zip(prompts, max_tokens, strict=True))}


def _lengths(fixed: int, span: tuple[int, int] | None, n: int, rng: random.Random) -> list[int]:
    return [rng.randint(*span) if span else fixed for _ in range(n)]


def output_lengths(args) -> list[int]:
    """max_tokens per request: --max-tokens, or seeded draws from --max-tokens-range."""
    return _lengths(args.max_tokens, args.max_tokens_range, args.num_requests,
                    random.Random(args.seed + 1))


async def make_prompts(client, args) -> list:
    if args.dataset:
        lines = [ln.strip() for ln in Path(args.dataset).read_text().splitlines() if ln.strip()]
        if not lines:
            raise SystemExit(f"{args.dataset}: no prompts")
        return [lines[i % len(lines)] for i in range(args.num_requests)]
    info = await client.model_info()
    return random_prompts(info.vocab_size, info.eos_token_ids, args)


def random_prompts(vocab_size: int, eos_token_ids, args) -> list[list[int]]:
    """Seeded random token ids below vocab_size, EOS ids excluded, lengths
    from --prompt-len / --prompt-len-range (benchmarks/engine_core.py builds
    the same requests from the checkpoint's config)."""
    excluded = set(eos_token_ids)
    rng = random.Random(args.seed)
    prompts = []
    for length in _lengths(args.prompt_len, args.prompt_len_range, args.num_requests,
                           random.Random(args.seed + 2)):
        ids = []
        while len(ids) < length:
            token = rng.randrange(vocab_size)
            if token not in excluded:
                ids.append(token)
        prompts.append(ids)
    return prompts


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); 0.0 for no data."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(records: list[RequestRecord], duration: float, streamed: bool = True) -> dict:
    """streamed=False (one message per request): no token timings exist, the
    TTFT/TPOT/ITL figures are left at 0 and only end-to-end latency counts."""
    ok = [r for r in records if not r.error and r.first_token is not None]
    timed = ok if streamed else []
    ttft = [r.first_token - r.start for r in timed]
    tpot = [(r.end - r.first_token) / (r.output_tokens - 1) for r in timed if r.output_tokens > 1]
    itl = [gap for r in timed for gap in r.itl]
    e2e = [r.end - r.start for r in ok]
    output_tokens = sum(r.output_tokens for r in ok)
    ms = 1000.0
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "input_tokens": sum(r.prompt_len for r in ok),
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "e2e_ms_median": statistics.median(e2e) * ms if e2e else 0.0,
        "e2e_ms_p99": percentile(e2e, 99) * ms,
        "ttft_ms_median": statistics.median(ttft) * ms if ttft else 0.0,
        "ttft_ms_p99": percentile(ttft, 99) * ms,
        "tpot_ms_median": statistics.median(tpot) * ms if tpot else 0.0,
        "tpot_ms_p99": percentile(tpot, 99) * ms,
        "itl_ms_median": statistics.median(itl) * ms if itl else 0.0,
        "itl_ms_p99": percentile(itl, 99) * ms,
    }


TABLE_ROWS = [
    ("requests (ok/total)", lambda m: f"{m['completed']}/{m['requests']}"),
    ("duration (s)", lambda m: f"{m['duration_s']:.2f}"),
    ("output tokens/s", lambda m: f"{m['output_throughput']:.1f}"),
    ("requests/s", lambda m: f"{m['request_throughput']:.2f}"),
    ("latency median (ms)", lambda m: f"{m.get('e2e_ms_median', 0):.1f}"),
    ("TTFT median (ms)", lambda m: f"{m['ttft_ms_median']:.1f}"),
    ("TTFT p99 (ms)", lambda m: f"{m['ttft_ms_p99']:.1f}"),
    ("TPOT median (ms)", lambda m: f"{m['tpot_ms_median']:.1f}"),
    ("TPOT p99 (ms)", lambda m: f"{m['tpot_ms_p99']:.1f}"),
    ("ITL median (ms)", lambda m: f"{m['itl_ms_median']:.1f}"),
    ("ITL p99 (ms)", lambda m: f"{m['itl_ms_p99']:.1f}"),
    ("steps", lambda m: str(m.get("steps", "-"))),
    ("bytes/step/rank", lambda m: f"{m.get('bytes_per_step_per_rank', 0):.0f}"),
    ("wall ms/step", lambda m: f"{m.get('wall_ms_per_step', 0):.2f}"),
    ("forward ms/step", lambda m: f"{m.get('forward_ms_per_step', 0):.2f}"),
    ("round trip ms/step", lambda m: f"{m.get('round_trip_ms_per_step', 0):.2f}"),
    ("output rank busy %", lambda m: f"{100 * m.get('output_rank_busy', 0):.0f}"),
    ("control ms/step (serial)", lambda m: f"{m['control_ms_per_step']:.2f}"
     if "control_ms_per_step" in m else "-"),
    ("CPU ms/step controlplane", lambda m: _cpu_cell(m, "controlplane")),
    ("CPU ms/step ranks (sum)", lambda m: _cpu_cell(m, "ranks")),
    ("CPU ms/step busiest rank", lambda m: _cpu_cell(m, "busiest rank")),
    ("CPU ms/step client", lambda m: _cpu_cell(m, "client")),
    # transformers only (hf_baseline.static_batch_work): the continuous-batching ceiling.
    ("static batches: output rows x", lambda m: f"{m['output_padding']:.2f}"
     if "output_padding" in m else "-"),
    ("static batches: prompt tokens x", lambda m: f"{m['prompt_padding']:.2f}"
     if "prompt_padding" in m else "-"),
]


def _cpu_cell(m: dict, who: str) -> str:
    cpu = m.get("cpu_ms_per_step")
    return f"{cpu[who]:.2f}" if cpu else "-"


def cluster_cpu_s(cluster) -> dict[str, float]:
    """CPU seconds so far of the controlplane, of all ranks together, and of
    this process (the client). On a box with fewer cores than processes they
    compete: a step cannot be shorter than their sum over the core count."""
    ranks = {f"rank {p.rank}": process_cpu_s(p.popen.pid)
             for p in cluster.processes if p.rank is not None}
    control = [p for p in cluster.processes if p.rank is None]
    return {
        "controlplane": sum(process_cpu_s(p.popen.pid) for p in control),
        "ranks": sum(ranks.values()),
        **ranks,
        "client": time.process_time(),
    }


def format_table(runs: list[dict]) -> str:
    """One column per run, one row per metric."""
    header = ["metric", *(run["name"] for run in runs)]
    rows = [header] + [[label, *(fmt(run["metrics"]) for run in runs)] for label, fmt in TABLE_ROWS]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


_STEP_SERIES = (
    "kvloom_step_broadcast_bytes_sum", "kvloom_step_broadcast_bytes_count",
    "kvloom_output_rank_forward_time_seconds_sum", "kvloom_step_round_trip_seconds_sum",
)


def step_series(metrics_url: str, cluster=None) -> dict[str, float]:
    """The controlplane's cumulative step series, from its /metrics."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    values = dict.fromkeys(_STEP_SERIES, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        base = name.split("{", 1)[0]
        if base in values:
            values[base] = float(value)
    if cluster is not None:
        values.update({f"cpu:{k}": v for k, v in cluster_cpu_s(cluster).items()})
    return values


def step_breakdown(before: dict[str, float], after: dict[str, float], duration_s: float,
                   serial: bool) -> dict:
    """Per-step figures of the timed window. Every rank receives the same
    bytes: the step is serialized once and written to each worker stream.
    The round trip of a pipelined step includes its wait behind the step
    before it, so the control overhead (round trip - forward) is reported
    for serial runs only."""
    d = {k: after[k] - before[k] for k in _STEP_SERIES}
    steps = d["kvloom_step_broadcast_bytes_count"]
    if not steps:
        return {"steps": 0}
    forward = d["kvloom_output_rank_forward_time_seconds_sum"]
    round_trip = d["kvloom_step_round_trip_seconds_sum"]
    out = {
        "steps": int(steps),
        "bytes_per_step_per_rank": d["kvloom_step_broadcast_bytes_sum"] / steps,
        "wall_ms_per_step": 1000 * duration_s / steps,
        "forward_ms_per_step": 1000 * forward / steps,
        "round_trip_ms_per_step": 1000 * round_trip / steps,
        "output_rank_busy": forward / duration_s if duration_s else 0.0,
    }
    if serial:
        out["control_ms_per_step"] = 1000 * (round_trip - forward) / steps
    cpu = {k[4:]: 1000 * (after[k] - before[k]) / steps for k in after
           if k.startswith("cpu:") and k in before}
    if cpu:
        ranks = [v for k, v in cpu.items() if k.startswith("rank ")]
        cpu["busiest rank"] = max(ranks, default=0.0)
        out["cpu_ms_per_step"] = cpu
    return out


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("async", "serial")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"bad --scheduling {text!r}: use async, serial or both")
    return modes


def parse_interval(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 1024:
        raise argparse.ArgumentTypeError(f"bad --stream-interval {text!r}: a whole number 1-1024")
    return int(text)


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    if not (lo.isdigit() and hi.isdigit()) or not 1 <= int(lo) <= int(hi):
        raise argparse.ArgumentTypeError(f"bad range {text!r}: expected LO,HI with 1 <= LO <= HI")
    return int(lo), int(hi)


def parse_rounds(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_ROUNDS:
        raise argparse.ArgumentTypeError(f"bad --rounds {text!r}: a whole number 1-{MAX_ROUNDS}")
    return int(text)


def baseline_ratios(runs: list[dict]) -> dict[str, float]:
    """Each run's output tokens/s over the transformers run's (the last one)."""
    if len(runs) < 2 or runs[-1]["name"] != "transformers":
        return {}
    base = runs[-1]["metrics"]["output_throughput"]
    return {run["name"]: run["metrics"]["output_throughput"] / base if base else 0.0
            for run in runs[:-1]}


def ratio_lines(ratios: dict[str, float]) -> list[str]:
    """One round's ratios, a line per run."""
    return [f"{name}: {ratio:.2f}x transformers generate (output tokens/s)"
            for name, ratio in ratios.items()]


def ratio_summary(per_round: list[dict[str, float]]) -> list[str]:
    """One line per run: the median ratio over the rounds and its range. The
    box is shared and noisy, so each round runs the engine and transformers
    back to back and only ratios within a round are compared."""
    lines = []
    for name in per_round[0] if per_round else ():
        values = [r[name] for r in per_round]
        lines.append(f"{name}: {statistics.median(values):.2f}x transformers generate, median "
                     f"of {len(values)} rounds ({min(values):.2f}-{max(values):.2f}; "
                     + ", ".join(f"{v:.2f}" for v in values) + ")")
    return lines


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """ "1x1,2x1,1x2" -> [(tp, pp), ...]."""
    layouts = []
    for item in text.split(","):
        tp, _, pp = item.strip().lower().partition("x")
        if not (tp.isdigit() and pp.isdigit()) or int(tp) < 1 or int(pp) < 1:
            raise argparse.ArgumentTypeError(f"bad layout {item!r}: expected TPxPP like 2x1")
        layouts.append((int(tp), int(pp)))
    return layouts


def run_launched(args) -> list[dict]:
    runs = []
    # This client's own cores, restored after each pinned run (the next
    # layout's plan and the transformers baseline start from all of them).
    own_cores = available_cores() if args.pin_cpus else None
    for (tp, pp), mode in [(layout, m) for layout in args.layouts for m in args.scheduling]:
        serial = mode == "serial"
        spec = launcher.ClusterSpec(
            model=args.model,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            worker_threads=args.worker_threads,
            pin_cpus=args.pin_cpus,
            # The same dtype as the --hf-baseline run; flags after -- still win.
            controlplane_args=("--dtype", args.dtype, *args.controlplane_args)
            + (("--no-async-scheduling",) if serial else ()),
        )
        sink = sys.stderr if args.logs else open(os.devnull, "w")  # noqa: SIM115
        cluster = launcher.Cluster(spec, log_sink=sink)
        print(f"== layout tp={tp} pp={pp} {mode}: starting", file=sys.stderr)
        try:
            cluster.start()
            cluster.wait_ready(args.ready_timeout)
            plan = launcher.cpu_plan(spec)
            if plan is not None:  # this client shares the controlplane's cores
                pin_process(plan.rest)
            before: dict[str, float] = {}
            result = asyncio.run(benchmark(
                cluster.api_address, args,
                before_timed=lambda c=cluster, b=before: b.update(
                    step_series(c.metrics_address, c))))
            result["metrics"].update(step_breakdown(
                before, step_series(cluster.metrics_address, cluster),
                result["metrics"]["duration_s"], serial))
        finally:
            cluster.stop()
            if own_cores is not None:
                pin_process(own_cores)
        name = f"tp{tp} pp{pp}" + (" serial" if serial else "") + (" pinned" if args.pin_cpus
                                                                     else "")
        runs.append({"name": name, "tp": tp, "pp": pp, "scheduling": mode, **result})
    if args.hf_baseline:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # a script, not a package
        import hf_baseline

        print("== transformers generate (static batches)", file=sys.stderr)
        metrics = hf_baseline.run(args.model, runs[0]["requests"], args.concurrency,
                                  args.dtype, args.worker_threads or 1)
        runs.append({"name": "transformers", "metrics": metrics})
    return runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default=default_server())
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--dataset", help="text file, one prompt per line (sent as text)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len-range", type=parse_range, metavar="LO,HI",
                        help="per-request prompt lengths drawn from [LO, HI] (seeded)")
    parser.add_argument("--max-tokens-range", type=parse_range, metavar="LO,HI",
                        help="per-request max_tokens drawn from [LO, HI] (seeded)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-stream: one message per request (stream=false), as an "
                             "offline batch client; TTFT/TPOT/ITL are then not measured")
    parser.add_argument("--stream-interval", type=parse_interval, default=1, metavar="N",
                        help="streamed message every N tokens (the request field)")
    parser.add_argument("--warmup", type=int, default=1, help="requests run before timing")
    parser.add_argument("--json", type=Path, help="write results here")
    launch = parser.add_argument_group("launch local clusters (kvloom_cli.launcher)")
    launch.add_argument("--launch", action="store_true")
    launch.add_argument("--model", help="checkpoint dir, or an embedded model's name "
                        "(smollm2-135m, gemma-3-270m); default: smollm2-135m")
    launch.add_argument("--tp", type=int, default=1)
    launch.add_argument("--pp", type=int, default=1)
    launch.add_argument("--layouts", type=parse_layouts, help="e.g. 1x1,2x1,1x2 (TPxPP)")
    launch.add_argument("--scheduling", type=parse_modes, default=["async"],
                        help="async, serial (--no-async-scheduling) or both: async,serial")
    launch.add_argument("--ready-timeout", type=float, default=600.0)
    launch.add_argument("--logs", action="store_true", help="show the daemons' logs")
    launch.add_argument("--worker-threads", type=int, default=None,
                        help="torch threads per worker and for --hf-baseline; unset: a "
                             "share of the cores, or 1 for both with --hf-baseline")
    launch.add_argument("--pin-cpus", action="store_true",
                        help="each rank computes on a core of its own; the controlplane, the "
                             "ranks' other threads and this client share the rest "
                             "(needs TPxPP + 1 cores; Linux)")
    launch.add_argument("--hf-baseline", action="store_true",
                        help="also run transformers' generate on the same requests "
                             "(benchmarks/hf_baseline.py) and report the ratio")
    launch.add_argument("--rounds", type=parse_rounds, default=1,
                        help="with --hf-baseline: repeat the launched runs and the baseline "
                             f"this many times (1-{MAX_ROUNDS}), each round back to back, and "
                             "report the median ratio")
    launch.add_argument("--dtype", default="float32",
                        help="dtype of the launched clusters and the --hf-baseline model")
    launch.add_argument("controlplane_args", nargs="*", help="after --: controlplane flags")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds > 1 and not (args.launch and args.hf_baseline):
        parser.error("--rounds needs --launch and --hf-baseline (a ratio per round)")
    rounds: list[list[dict]] = []
    per_round: list[dict[str, float]] = []
    if args.launch:
        args.layouts = args.layouts or [(args.tp, args.pp)]
        from kvloom.common.embedded_model_spec import EmbeddedModelError
        from kvloom.common.embedded_models import is_model_name, resolve_model

        try:  # a name is converted once, before any cluster starts
            args.model = resolve_model(args.model) if is_model_name(args.model) else args.model
        except EmbeddedModelError as exc:
            parser.error(str(exc))
        if args.hf_baseline and args.worker_threads is None:
            # One count for both sides: unset, a launched rank would take a
            # share of every core while generate ran on one.
            args.worker_threads = 1
    try:
        for i in range(args.rounds):
            if args.launch:
                runs = run_launched(args)
            else:
                runs = [{"name": args.server, **asyncio.run(benchmark(args.server, args))}]
            if args.rounds > 1:
                print(f"== round {i + 1} of {args.rounds}")
            print(format_table(runs))
            per_round.append(baseline_ratios(runs))
            for line in ratio_lines(per_round[-1]):
                print(line)
            for run in runs:
                run.pop("requests", None)
            rounds.append(runs)
    except (KvloomError, launcher.ClusterError) as exc:
        print(f"serving benchmark: error: {exc}", file=sys.stderr)
        return 1
    if args.rounds > 1:
        print("\n".join(ratio_summary(per_round)))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json",)}
        payload = {"config": json.loads(json.dumps(config, default=str)), "runs": rounds[-1]}
        if args.rounds > 1:
            payload["rounds"] = rounds
            payload["ratios"] = per_round
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(run["metrics"]["failed"] == 0 for runs in rounds for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
