"""Soak: N mixed Generate requests against one cluster while the controlplane's
resources are sampled; are they flat?

    python benchmarks/soak.py --launch --model DIR --num-requests 10000 \\
        --json soak.json -- --kv-cache-memory-bytes 67108864
    python benchmarks/soak.py --server 127.0.0.1:50051 --pid PID \\
        --metrics-url http://127.0.0.1:9400/metrics

The mix (seeded): prompts drawn from a pool of token-id and text prompts of
mixed lengths (so repeats hit the prefix cache), mixed max_tokens, greedy and
sampled, some n > 1; ~30 % of requests are cancelled by the client mid-stream
(the stream is closed after a random number of token messages) and some are
ended by an Abort RPC after their first token. Every greedy completion of the
same prompt must agree with the others (one is a prefix of the other).

A warm-up of the same mix runs first. The controlplane's RSS, open file
descriptors (/proc/PID/fd), threads (/proc/PID/status) and the number of
series on its /metrics are sampled every --sample-interval seconds and at
four points: launch, after warm-up (the baseline), when half the requests are
done, and at the end once every request finished and every KV block is free.
A resource is "flat" when end minus baseline is within its tolerance (flags).
With --launch the workers' RSS is sampled too (JSON only).

Exit status 0 only if every resource is flat, no request failed, every block
is free at the end and readiness is SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvloom.client import READY_SERVICE, AsyncKvloomClient, KvloomError, default_server
from kvloom_cli import launcher

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wizards", "quietly", "hex", "twelve", "jovial", "boxers", "near", "old", "river", "bank",
)
MAX_OUTPUT = 64  # the largest max_tokens in the mix


# --- the request mix -----------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    index: int
    prompt_key: int
    kind: str  # "complete", "cancel" (client closes the stream) or "abort" (Abort RPC)
    n: int
    max_tokens: int
    temperature: float
    seed: int
    cancel_after: int  # token messages read before a "cancel" closes its stream


def make_prompt_pool(rng: random.Random, size: int, vocab: int, eos: set[int], longest: int):
    """Token-id prompts (80 %) and text prompts; 60 % short, 30 % medium, 10 % long."""
    pool = []
    for _ in range(size):
        roll = rng.random()
        low, high = (4, 32) if roll < 0.6 else (33, 128) if roll < 0.9 else (129, longest)
        length = min(rng.randint(low, max(low, high)), longest)
        if rng.random() < 0.8:
            ids = []
            while len(ids) < length:
                token = rng.randrange(vocab)
                if token not in eos:
                    ids.append(token)
            pool.append(ids)
        else:
            pool.append([rng.choice(WORDS) for _ in range(length)])  # words: fit_text trims
    return pool


async def fit_text(client, words: list[str], longest: int) -> str:
    """The longest prefix (by a few tries) of the words that tokenizes to <= longest tokens."""
    while True:
        text = " ".join(words)
        count = len((await client.tokenize(text)).token_ids)
        if count <= longest or len(words) == 1:
            return text
        words = words[: max(1, len(words) * longest // count - 1)]


def make_plans(rng: random.Random, count: int, pool_size: int, start: int = 0) -> list[Plan]:
    plans = []
    for i in range(start, start + count):
        roll = rng.random()
        kind = "cancel" if roll < 0.30 else "abort" if roll < 0.35 else "complete"
        roll = rng.random()
        max_tokens = rng.randint(1, 16) if roll < 0.7 else rng.randint(17, MAX_OUTPUT)
        if kind != "complete":
            max_tokens = max(max_tokens, 4)  # leave room to stop mid-stream
        n = rng.choice((2, 3)) if rng.random() < 0.10 else 1
        greedy = n == 1 and rng.random() < 0.7
        plans.append(Plan(
            index=i,
            prompt_key=rng.randrange(pool_size),
            kind=kind,
            n=n,
            max_tokens=max_tokens,
            temperature=0.0 if greedy else 0.8,
            seed=rng.randrange(1 << 32),
            cancel_after=rng.randint(1, max_tokens - 1) if kind == "cancel" else 0,
        ))
    return plans


# --- running one request -------------------------------------------------------


@dataclass
class Outcome:
    outcome: str = ""  # ok | cancelled | aborted | abort-too-late | error:<STATUS or what>
    latency: float | None = None  # start -> end of stream, completed requests only
    ttft: float | None = None
    detail: str = ""


@dataclass
class GreedyBook:
    """Greedy completions per prompt: any two must agree on their common length."""

    seen: dict[int, list[int]] = field(default_factory=dict)
    compared: int = 0
    mismatches: int = 0

    def check(self, key: int, tokens: list[int]) -> None:
        known = self.seen.get(key)
        self.compared += known is not None
        if known is None or len(tokens) > len(known):
            if known is not None and tokens[: len(known)] != known:
                self.mismatches += 1
            self.seen[key] = tokens
        elif known[: len(tokens)] != tokens:
            self.mismatches += 1


@dataclass(frozen=True)
class Context:
    tag: str  # makes Abort ids unique per run
    vocab_size: int
    book: GreedyBook
    concurrency: int


async def run_one(client, plan: Plan, prompt, ctx: Context) -> Outcome:
    request_id = f"soak-{ctx.tag}-{plan.index}" if plan.kind == "abort" else ""
    out = Outcome()
    start = time.perf_counter()
    tokens: dict[int, list[int]] = {}
    finishes: dict[int, object] = {}
    token_messages = 0
    try:
        stream = client.generate(
            prompt, max_tokens=plan.max_tokens, temperature=plan.temperature,
            seed=plan.seed if plan.temperature else None, n=plan.n, ignore_eos=True,
            request_id=request_id, timeout=600,
        )
        async with contextlib.aclosing(stream):  # closing cancels the call at once
            async for chunk in stream:
                if chunk.token_ids:
                    token_messages += 1
                    if out.ttft is None:
                        out.ttft = time.perf_counter() - start
                    tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
                if chunk.finish is not None:
                    finishes[chunk.index] = chunk.finish
                if plan.kind == "cancel" and token_messages >= plan.cancel_after:
                    out.outcome = "cancelled"
                    return out
                if plan.kind == "abort" and token_messages == 1 and chunk.token_ids:
                    await client.abort(request_id)
    except KvloomError as exc:
        code = exc.code.name if exc.code is not None else "NO_STATUS"
        out.outcome, out.detail = f"error:{code}", exc.details
        return out
    out.latency = time.perf_counter() - start
    out.outcome, out.detail = judge(plan, tokens, finishes, ctx.vocab_size)
    if out.outcome == "ok" and plan.temperature == 0.0:
        ctx.book.check(plan.prompt_key, tokens[0])
    return out


def judge(plan: Plan, tokens: dict, finishes: dict, vocab: int) -> tuple[str, str]:
    """What a stream that ended without an error status amounted to."""
    if sorted(finishes) != list(range(plan.n)):
        return "error:missing-finish", f"finished samples {sorted(finishes)} of n={plan.n}"
    reasons = {f.reason for f in finishes.values()}
    if "error" in reasons:
        return "error:finish-error", next(f.error for f in finishes.values() if f.error)
    if any(t >= vocab or t < 0 for ids in tokens.values() for t in ids):
        return "error:out-of-vocab", "a token id outside the vocabulary"
    if "abort" in reasons:
        return ("aborted", "") if plan.kind == "abort" else ("error:unexpected-abort", "")
    for i, f in finishes.items():
        if f.reason != "length" or len(tokens.get(i, [])) != plan.max_tokens:
            return "error:wrong-length", f"sample {i}: {f.reason}, {len(tokens.get(i, []))} tokens"
    return ("abort-too-late" if plan.kind == "abort" else "ok"), ""


# --- sampling resources --------------------------------------------------------


def proc_stats(pid: int) -> dict:
    """RSS (MiB), threads, open fds and CPU seconds used of a live process, from /proc."""
    stats = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "VmRSS":
                stats["rss_mib"] = int(value.split()[0]) / 1024
            elif key == "Threads":
                stats["threads"] = int(value)
    stats["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/stat") as f:
        # utime and stime (fields 14, 15) follow the parenthesised command name.
        fields = f.read().rsplit(")", 1)[1].split()
    stats["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return stats


# Engine counters kept in each sample (JSON only) to tell a slow phase's cause.
ENGINE_COUNTERS = (
    "kvloom_step_round_trip_seconds_count", "kvloom_step_round_trip_seconds_sum",
    "kvloom_output_rank_forward_time_seconds_sum", "kvloom_num_preemptions_total",
    "kvloom_prompt_tokens_total", "kvloom_generation_tokens_total",
    "kvloom_prefix_cache_hits_total", "kvloom_num_requests_running",
    "kvloom_num_requests_waiting",
)


def scrape(url: str) -> tuple[set[str], dict[str, float]]:
    """Every series (name + labels) on a Prometheus text page, and the
    ENGINE_COUNTERS summed over their labels."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    series, counters = set(), {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        series.add(name)
        base = name.split("{", 1)[0]
        if base in ENGINE_COUNTERS:
            counters[base] = counters.get(base, 0.0) + float(value)
    return series, counters


class Sampler:
    """Periodic and named samples of the processes' resources and the metric series."""

    def __init__(self, pids: dict[str, int], metrics_url: str | None, interval: float):
        self.pids = pids
        self.metrics_url = metrics_url
        self.interval = interval
        self.samples: list[dict] = []
        self.named: dict[str, dict] = {}
        self.series_at: dict[str, set[str]] = {}
        self.outcomes: list = []  # the measured requests finished so far


    def take(self, name: str = "") -> dict:
        sample = {"t": time.monotonic(), "done": len(self.outcomes)}
        for proc, pid in self.pids.items():
            with contextlib.suppress(OSError):
                sample[proc] = proc_stats(pid)
        if self.metrics_url:
            with contextlib.suppress(OSError):  # a failed scrape leaves a gap, not a crash
                series, sample["engine"] = scrape(self.metrics_url)
                sample["series"] = len(series)
                if name:
                    self.series_at[name] = series
        self.samples.append(sample)
        if name:
            self.named[name] = sample
        return sample

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.to_thread(self.take)


# --- the soak ------------------------------------------------------------------


async def settle(client, timeout: float = 60.0) -> dict:
    """Wait (bounded) until nothing runs or waits and every block is free."""
    deadline = time.monotonic() + timeout
    while True:
        info = await client.server_info()
        idle = not info.num_requests_running and not info.num_requests_waiting
        if (idle and info.num_free_blocks == info.num_total_blocks) or time.monotonic() > deadline:
            return asdict(info)
        await asyncio.sleep(0.2)


async def run_batch(client, plans, pool, ctx, outcomes: list, halfway=None) -> None:
    """Run plans at most ctx.concurrency at a time; await halfway() when half are done."""
    limit = asyncio.Semaphore(ctx.concurrency)

    async def one(plan):
        async with limit:
            result = await run_one(client, plan, pool[plan.prompt_key], ctx)
        outcomes.append(result)
        if halfway is not None and len(outcomes) == len(plans) // 2:
            await halfway()

    await asyncio.gather(*(one(p) for p in plans))


async def soak(server: str, pids: dict[str, int], metrics_url: str | None, args) -> dict:
    sampler = Sampler(pids, metrics_url, args.sample_interval)
    await asyncio.to_thread(sampler.take, "launch")
    rng = random.Random(args.seed)
    tag = uuid.uuid4().hex[:8]
    async with AsyncKvloomClient(server) as client:
        info = await client.model_info()
        longest = min(args.max_prompt_len, info.max_model_len - MAX_OUTPUT)
        pool = make_prompt_pool(rng, args.prompt_pool, info.vocab_size,
                                set(info.eos_token_ids), longest)
        for i, prompt in enumerate(pool):
            if isinstance(prompt[0], str):
                pool[i] = await fit_text(client, prompt, longest)
        ctx = Context(tag, info.vocab_size, GreedyBook(), args.concurrency)
        warm = make_plans(rng, args.warmup, len(pool))
        plans = make_plans(rng, args.num_requests, len(pool), start=args.warmup)
        outcomes = sampler.outcomes
        ticker = asyncio.create_task(sampler.run())
        try:
            await run_batch(client, warm, pool, ctx, [])
            await settle(client)
            await asyncio.sleep(args.settle)
            await asyncio.to_thread(sampler.take, "warm")
            started = time.perf_counter()
            try:
                await asyncio.wait_for(
                    run_batch(client, plans, pool, ctx, outcomes,
                              halfway=lambda: asyncio.to_thread(sampler.take, "middle")),
                    args.time_limit,
                )
                timed_out = False
            except TimeoutError:
                timed_out = True
            duration = time.perf_counter() - started
            end_info = await settle(client)
            await asyncio.sleep(args.settle)
            await asyncio.to_thread(sampler.take, "end")
            readiness = await client.health(READY_SERVICE)
        finally:
            ticker.cancel()
    return summarize(args, sampler, outcomes, ctx.book, end_info, readiness, duration, timed_out)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); 0.0 for no data."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


RESOURCES = (  # (row label, process, key, tolerance flag)
    ("controlplane RSS (MiB)", "controlplane", "rss_mib", "rss_tolerance_mib"),
    ("controlplane open fds", "controlplane", "fds", "fd_tolerance"),
    ("controlplane threads", "controlplane", "threads", "thread_tolerance"),
    ("metric series", None, "series", "series_tolerance"),
)
POINTS = ("launch", "warm", "middle", "end")


def value_at(sample: dict | None, proc: str | None, key: str):
    if sample is None:
        return None
    return sample.get(key) if proc is None else sample.get(proc, {}).get(key)


def summarize(args, sampler, outcomes, book, end_info, readiness, duration, timed_out) -> dict:
    resources = {}
    for label, proc, key, tol_flag in RESOURCES:
        values = {p: value_at(sampler.named.get(p), proc, key) for p in POINTS}
        tolerance = getattr(args, tol_flag)
        if values["warm"] is None or values["end"] is None:
            verdict, growth = "not sampled", None
        else:
            growth = values["end"] - values["warm"]
            verdict = "flat" if growth <= tolerance else "GROWING"
        resources[label] = {**values, "growth": growth, "tolerance": tolerance,
                            "verdict": verdict}
    new_series = sorted(sampler.series_at.get("end", set()) - sampler.series_at.get("warm", set()))
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.outcome] = counts.get(o.outcome, 0) + 1
    errors = {k: v for k, v in counts.items() if k.startswith("error:")}
    error_examples = sorted({f"{o.outcome}: {o.detail}" for o in outcomes
                             if o.outcome.startswith("error:")})[:10]
    latency = [o.latency for o in outcomes if o.outcome == "ok" and o.latency is not None]
    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    blocks_free = end_info["num_free_blocks"] == end_info["num_total_blocks"]
    ok = (
        not timed_out and not errors and blocks_free and readiness == "SERVING"
        and book.mismatches == 0 and len(outcomes) == args.num_requests
        and all(r["verdict"] in ("flat", "not sampled") for r in resources.values())
    )
    return {
        "passed": ok,
        "requests": args.num_requests,
        "finished": len(outcomes),
        "timed_out": timed_out,
        "duration_s": duration,
        "outcomes": dict(sorted(counts.items())),
        "errors": errors,
        "error_examples": error_examples,
        "greedy_mismatches": book.mismatches,
        "greedy_compared": book.compared,
        "latency_ms_p50": percentile(latency, 50) * 1000,
        "latency_ms_p99": percentile(latency, 99) * 1000,
        "ttft_ms_p50": percentile(ttft, 50) * 1000,
        "ttft_ms_p99": percentile(ttft, 99) * 1000,
        "resources": resources,
        "new_series_after_warmup": new_series[:50],
        "blocks_free_at_end": f"{end_info['num_free_blocks']}/{end_info['num_total_blocks']}",
        "running_at_end": end_info["num_requests_running"],
        "waiting_at_end": end_info["num_requests_waiting"],
        "readiness_at_end": readiness,
        "samples": sampler.samples,
    }


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def format_table(result: dict) -> str:
    rows = [["resource", *POINTS, "end-warm", "tolerance", "verdict"]]
    for label, r in result["resources"].items():
        growth = r["growth"]
        rows.append([label, *(_fmt(r[p]) for p in POINTS),
                     "-" if growth is None else f"{growth:+.1f}", _fmt(r["tolerance"]),
                     r["verdict"]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    outcomes = ", ".join(f"{k} {v}" for k, v in result["outcomes"].items())
    errors = ", ".join(f"{k[6:]} {v}" for k, v in result["errors"].items()) or "none"
    facts = [
        ("requests (finished/planned)", f"{result['finished']}/{result['requests']}"
         + (" (time limit hit)" if result["timed_out"] else "")),
        ("duration (s)", f"{result['duration_s']:.1f}"),
        ("outcomes", outcomes),
        ("errors by status", errors),
        ("greedy mismatches / compared", f"{result['greedy_mismatches']} / "
         f"{result['greedy_compared']}"),
        ("latency p50 / p99 (ms, completed)",
         f"{result['latency_ms_p50']:.1f} / {result['latency_ms_p99']:.1f}"),
        ("TTFT p50 / p99 (ms)", f"{result['ttft_ms_p50']:.1f} / {result['ttft_ms_p99']:.1f}"),
        ("blocks free at end", result["blocks_free_at_end"]
         + f" (running {result['running_at_end']}, waiting {result['waiting_at_end']})"),
        ("readiness at end", result["readiness_at_end"]),
        ("verdict", "PASS" if result["passed"] else "FAIL"),
    ]
    width = max(len(k) for k, _ in facts)
    lines += [""] + [f"{k.ljust(width)}  {v}" for k, v in facts]
    if result["new_series_after_warmup"]:
        lines += ["", "series new since warm-up:"] + [
            f"  {s}" for s in result["new_series_after_warmup"][:10]]
    if result["error_examples"]:
        lines += ["", "errors:"] + [f"  {e}" for e in result["error_examples"]]
    return "\n".join(lines)


# --- entry point ---------------------------------------------------------------


def run_launched(args) -> dict:
    if args.model is None:
        from kvloom.common.default_model import default_model_dir

        args.model = default_model_dir()
    spec = launcher.ClusterSpec(
        model=args.model,
        worker_threads=args.worker_threads,
        controlplane_args=(
            "--max-num-seqs", str(args.max_num_seqs), *args.controlplane_args
        ),
    )
    sink = sys.stderr if args.logs else open(os.devnull, "w")  # noqa: SIM115
    cluster = launcher.Cluster(spec, log_sink=sink)
    print("soak: starting a TP=1 cluster", file=sys.stderr)
    try:
        cluster.start()
        cluster.wait_ready(args.ready_timeout)
        pids = {p.name.replace(" ", ""): p.popen.pid for p in cluster.processes}
        return asyncio.run(soak(cluster.api_address, pids, cluster.metrics_address, args))
    finally:
        cluster.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default=default_server())
    parser.add_argument("--pid", type=int, help="the controlplane's pid (without --launch)")
    parser.add_argument("--metrics-url", help="the controlplane's /metrics (without --launch)")
    parser.add_argument("--num-requests", "-n", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=500, help="requests before the baseline")
    parser.add_argument("--prompt-pool", type=int, default=256, help="distinct prompts")
    parser.add_argument("--max-prompt-len", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-interval", type=float, default=5.0, help="seconds")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds idle before the warm-up and end samples")
    parser.add_argument("--time-limit", type=float, default=3 * 3600.0,
                        help="seconds for the measured requests; the rest are cancelled")
    tol = parser.add_argument_group("flat = end - after-warm-up within")
    tol.add_argument("--rss-tolerance-mib", type=float, default=16.0)
    tol.add_argument("--fd-tolerance", type=int, default=2)
    tol.add_argument("--thread-tolerance", type=int, default=2)
    tol.add_argument("--series-tolerance", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write results here")
    launch = parser.add_argument_group("launch a local TP=1 cluster (kvloom_cli.launcher)")
    launch.add_argument("--launch", action="store_true")
    launch.add_argument("--model", help="checkpoint dir; default: the embedded SmolLM2-135M")
    launch.add_argument("--max-num-seqs", type=int, default=256)
    launch.add_argument("--worker-threads", type=int,
                        help="torch threads per worker; default: the launcher's (one per "
                        "core); 1 on a shared box, where more stall each other")
    launch.add_argument("--ready-timeout", type=float, default=600.0)
    launch.add_argument("--logs", action="store_true", help="show the daemons' logs")
    launch.add_argument("controlplane_args", nargs="*", help="after --: controlplane flags")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    try:
        if args.launch:
            result = run_launched(args)
        else:
            pids = {"controlplane": args.pid} if args.pid else {}
            result = asyncio.run(soak(args.server, pids, args.metrics_url, args))
    except (KvloomError, launcher.ClusterError) as exc:
        print(f"soak: error: {exc}", file=sys.stderr)
        return 1
    result["wall_s"] = time.perf_counter() - started
    print(format_table(result))
    print(f"\nwall time including launch and warm-up: {result['wall_s']:.1f} s")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        payload = {"config": json.loads(json.dumps(config, default=str)), **result}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
