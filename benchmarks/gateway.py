"""Through the SMG gateway vs kvloom.v1 directly: the same requests, side by side.

    python benchmarks/gateway.py --out gateway.json
    python benchmarks/gateway.py --quick
    python benchmarks/gateway.py --model DIR --num-requests 32 -- --max-model-len 512

Starts one local cluster (kvloom_cli.launcher, as serving.py --launch does;
default model the embedded SmolLM2-135M, --model DIR or a name for another)
and the real SMG gateway in front of its VllmEngine service (`smg launch
--worker-urls grpc://<api port>`, HF_HUB_OFFLINE=1: the gateway reads the
tokenizer from the model directory the engine reports). Then the same seeded
N requests (greedy, ignore_eos, --max-tokens each, --concurrency at a time)
go, round after round, (a) as kvloom.v1 Generate over gRPC with token ids
and (b) as streaming OpenAI /v1/completions through the gateway: a, b, a, b,
so the box's noise hits both. The controlplane runs with
--no-enable-prefix-caching unless --prefix-caching is given: every round
sends the same prompts, so with the cache on every round after the first
(and the gateway's first, right after kvloom.v1's) would skip its prefills.

smg 1.13 refuses token ids as a completions `prompt` ("data did not match any
variant of untagged enum StringOrArray"), so each prompt is made as text:
seeded random ids (special tokens excluded) of a seeded length, detokenized,
and the text tokenized again by the server; path (a) sends those ids, path
(b) the text. The table shows whether the gateway's prompt token counts
(usage.prompt_tokens) and the greedy outputs' text match path (a)'s.

Reported per path, pooled over its rounds: output tokens/s (output tokens
over the rounds' wall time), TTFT (median, p90), TPOT (per output token after
the first, median and p90) and ITL (gaps between streamed messages: kvloom.v1
sends one per token; the gateway sends an SSE event per decodable piece of
text, so a token it holds back for a split UTF-8 character joins the next),
the CPU each process spent per output token (the controlplane, the ranks, the
gateway, this client: on a box with fewer cores than busy processes they
compete), and the gateway's figure over kvloom.v1's; then each round's
throughput ratio and their median.

Needs the `smg` gateway and the `openai` client (not dependencies of kvloom:
`pip install smg openai`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script

from benchmarks.proc_cpu import process_cpu_s  # noqa: E402
from benchmarks.serving import (  # noqa: E402
    RequestRecord,
    parse_range,
    parse_rounds,
    percentile,
    random_prompts,
    summarize,
)
from kvloom.client import AsyncKvloomClient, KvloomError  # noqa: E402
from kvloom.common.ports import free_port  # noqa: E402
from kvloom.common.procs import reap, stop_pids, with_parent_death_signal  # noqa: E402
from kvloom_cli import launcher  # noqa: E402

PATHS = ("kvloom.v1", "gateway")
GATEWAY_READY_S = 120.0
REQUEST_TIMEOUT_S = 600.0


# ---- the requests -------------------------------------------------------------


async def make_prompts(client, args) -> list[tuple[str, list[int]]]:
    """(text, ids) per request: seeded random ids below the vocab size with
    every special token left out, detokenized, and the text tokenized again
    by the server, so the gateway (text) and kvloom.v1 (ids) get one prompt."""
    info = await client.model_info()
    excluded = {*info.eos_token_ids, *info.special_tokens.values()}
    prompts = []
    for ids in random_prompts(info.vocab_size, excluded, args):
        text = await client.detokenize(ids, skip_special_tokens=True)
        prompts.append((text, (await client.tokenize(text)).token_ids))
    return prompts


async def kvloom_request(client, prompt: tuple[str, list[int]], args,
                         record: RequestRecord) -> str:
    """One kvloom.v1 Generate with token ids; the output text."""
    text = []
    record.start = last = time.perf_counter()
    try:
        async for chunk in client.stream(prompt[1], max_tokens=args.max_tokens, temperature=0.0,
                                         ignore_eos=True, timeout=REQUEST_TIMEOUT_S):
            if chunk.token_ids:
                last = record.tokens_arrived(time.perf_counter(), last, len(chunk.token_ids))
            text.append(chunk.text)
    except KvloomError as exc:
        record.error = str(exc)
    record.end = time.perf_counter()
    return "".join(text)


async def gateway_request(openai_client, model: str, prompt: tuple[str, list[int]], args,
                          record: RequestRecord) -> tuple[str, int]:
    """One streaming /v1/completions through the gateway; (the output text,
    the prompt tokens the gateway counted). Output tokens are its usage
    figure: an SSE event may carry more than one token."""
    text, prompt_tokens = [], -1
    record.start = last = time.perf_counter()
    try:
        stream = await openai_client.completions.create(
            model=model, prompt=prompt[0], max_tokens=args.max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}, timeout=REQUEST_TIMEOUT_S)
        async for event in stream:
            if event.choices and event.choices[0].text:
                # Counted from usage below: an event may carry several tokens.
                last = record.tokens_arrived(time.perf_counter(), last, 0)
                text.append(event.choices[0].text)
            if event.usage is not None:
                record.output_tokens = event.usage.completion_tokens
                prompt_tokens = event.usage.prompt_tokens
    except Exception as exc:  # noqa: BLE001 - the openai client's errors, reported per request
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    return "".join(text), prompt_tokens


# ---- one round of one path ------------------------------------------------------


class Target:
    """Both paths to one cluster, and the processes whose CPU is counted."""

    def __init__(self, cluster, gateway: subprocess.Popen, base_url: str, model: str):
        self.cluster = cluster
        self.gateway = gateway
        self.base_url = base_url
        self.model = model

    def cpu_s(self) -> dict[str, float]:
        out = {"controlplane": 0.0, "ranks": 0.0}
        for proc in self.cluster.processes:
            out["ranks" if proc.rank is not None else "controlplane"] += process_cpu_s(
                proc.popen.pid)
        out["gateway"] = process_cpu_s(self.gateway.pid)
        out["client"] = time.process_time()
        return out


async def run_path(path: str, target: Target, kv_client, openai_client,
                   prompts: list[tuple[str, list[int]]], args) -> dict:
    """The N requests over one path, --concurrency at a time: records, the
    output texts, the gateway's prompt counts, wall seconds and CPU seconds."""
    limit = asyncio.Semaphore(args.concurrency)
    records = [RequestRecord(len(ids)) for _, ids in prompts]

    async def one(prompt, record):
        async with limit:
            if path == "gateway":
                return await gateway_request(openai_client, target.model, prompt, args, record)
            return await kvloom_request(kv_client, prompt, args, record), len(prompt[1])

    cpu_before = target.cpu_s()
    started = time.perf_counter()
    outs = await asyncio.gather(*(one(p, r) for p, r in zip(prompts, records, strict=True)))
    duration = time.perf_counter() - started
    cpu_after = target.cpu_s()
    return {"path": path, "records": records, "texts": [t for t, _ in outs],
            "prompt_tokens": [n for _, n in outs], "duration_s": duration,
            "cpu_s": {k: cpu_after[k] - cpu_before[k] for k in cpu_after}}


async def run_rounds(target: Target, args) -> dict:
    import openai

    async with AsyncKvloomClient(target.cluster.api_address) as kv_client:
        openai_client = openai.AsyncOpenAI(base_url=target.base_url, api_key="unused",
                                           max_retries=0)
        try:
            prompts = await make_prompts(kv_client, args)
            # Untimed: the first requests warm both paths (the gateway loads
            # its tokenizer on its first one) and, --concurrency at a time,
            # the ranks' batch shapes.
            warm = prompts[: args.concurrency if args.warmup is None else args.warmup]
            for path in PATHS:
                await run_path(path, target, kv_client, openai_client, warm, args)
            rounds = []
            for i in range(args.rounds):
                for path in PATHS:
                    print(f"== round {i + 1} of {args.rounds}: {path}", file=sys.stderr)
                    rounds.append(await run_path(path, target, kv_client, openai_client,
                                                 prompts, args))
        finally:
            await openai_client.close()
    return {"prompts": prompts, "rounds": rounds}


# ---- the report -----------------------------------------------------------------


def path_metrics(runs: list[dict]) -> dict:
    """One path's figures pooled over its rounds."""
    records = [r for run in runs for r in run["records"]]
    duration = sum(run["duration_s"] for run in runs)
    m = summarize(records, duration)
    ok = [r for r in records if not r.error and r.first_token is not None]
    ms = 1000.0
    m["ttft_ms_p90"] = percentile([r.first_token - r.start for r in ok], 90) * ms
    m["tpot_ms_p90"] = percentile([(r.end - r.first_token) / (r.output_tokens - 1)
                                   for r in ok if r.output_tokens > 1], 90) * ms
    m["itl_ms_p90"] = percentile([g for r in ok for g in r.itl], 90) * ms
    tokens = m["output_tokens"]
    cpu = {k: sum(run["cpu_s"][k] for run in runs) for k in runs[0]["cpu_s"]}
    m["cpu_us_per_token"] = {k: 1e6 * v / tokens if tokens else 0.0 for k, v in cpu.items()}
    m["rounds"] = len(runs)
    return m


def agreement(result: dict) -> dict:
    """Whether the gateway saw the prompts kvloom.v1 got (its prompt token
    counts) and produced the same greedy text."""
    ids = [ids for _, ids in result["prompts"]]
    v1 = [r for r in result["rounds"] if r["path"] == "kvloom.v1"]
    gw = [r for r in result["rounds"] if r["path"] == "gateway"]
    same_prompt = sum(n == len(p) for run in gw for n, p in zip(run["prompt_tokens"], ids,
                                                                strict=True))
    same_text = sum(_visible(a) == _visible(b) for x, y in zip(v1, gw, strict=True)
                    for a, b in zip(x["texts"], y["texts"], strict=True))
    checked = sum(len(run["texts"]) for run in gw)
    return {"checked": checked, "same_prompt_tokens": same_prompt, "same_output_text": same_text}


def _visible(text: str) -> str:
    """Text without U+FFFD: for bytes that never form a character kvloom.v1
    streams a replacement character and the gateway streams nothing."""
    return text.replace("\ufffd", "")


def report(result: dict) -> dict:
    by_path = {p: [r for r in result["rounds"] if r["path"] == p] for p in PATHS}
    metrics = {p: path_metrics(runs) for p, runs in by_path.items()}
    ratios = [_throughput(gw) / _throughput(v1) if _throughput(v1) else 0.0
              for v1, gw in zip(by_path["kvloom.v1"], by_path["gateway"], strict=True)]
    return {"metrics": metrics, "round_ratios": ratios, "agreement": agreement(result),
            "rounds": [{"path": r["path"], "duration_s": r["duration_s"], "cpu_s": r["cpu_s"],
                        "output_throughput": _throughput(r)} for r in result["rounds"]]}


def _throughput(run: dict) -> float:
    tokens = sum(r.output_tokens for r in run["records"] if not r.error)
    return tokens / run["duration_s"] if run["duration_s"] else 0.0


CPU_ROWS = ("controlplane", "ranks", "gateway", "client")
TABLE_ROWS = [
    ("requests (ok/total)", lambda m: f"{m['completed']}/{m['requests']}", None),
    ("output tokens", lambda m: str(m["output_tokens"]), None),
    ("output tokens/s", lambda m: f"{m['output_throughput']:.1f}", "output_throughput"),
    ("TTFT median (ms)", lambda m: f"{m['ttft_ms_median']:.1f}", "ttft_ms_median"),
    ("TTFT p90 (ms)", lambda m: f"{m['ttft_ms_p90']:.1f}", "ttft_ms_p90"),
    ("TPOT median (ms)", lambda m: f"{m['tpot_ms_median']:.2f}", "tpot_ms_median"),
    ("TPOT p90 (ms)", lambda m: f"{m['tpot_ms_p90']:.2f}", "tpot_ms_p90"),
    ("ITL median (ms)", lambda m: f"{m['itl_ms_median']:.2f}", "itl_ms_median"),
    ("ITL p90 (ms)", lambda m: f"{m['itl_ms_p90']:.2f}", "itl_ms_p90"),
    *[(f"CPU us/token {who}", lambda m, w=who: f"{m['cpu_us_per_token'][w]:.0f}", who)
      for who in CPU_ROWS],
]


def _ratio(metrics: dict, key: str | None) -> str:
    if key is None:
        return ""
    pick = (lambda m: m["cpu_us_per_token"][key]) if key in CPU_ROWS else (lambda m: m[key])
    base = pick(metrics["kvloom.v1"])
    return f"{pick(metrics['gateway']) / base:.2f}" if base else "-"


def format_table(rep: dict) -> str:
    metrics = rep["metrics"]
    header = ["metric", *PATHS, "gateway / v1"]
    rows = [header] + [[label, *(fmt(metrics[p]) for p in PATHS), _ratio(metrics, key)]
                       for label, fmt, key in TABLE_ROWS]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    ratios = rep["round_ratios"]
    if ratios:
        lines.append("gateway / kvloom.v1 output tokens/s per round: "
                     + ", ".join(f"{r:.2f}" for r in ratios)
                     + f" (median {statistics.median(ratios):.2f})")
    a = rep["agreement"]
    lines.append(f"gateway prompt tokens equal to kvloom.v1's: {a['same_prompt_tokens']}/"
                 f"{a['checked']}; same greedy output text (U+FFFD aside): "
                 f"{a['same_output_text']}/{a['checked']}")
    return "\n".join(lines)


# ---- the processes ----------------------------------------------------------------


def start_gateway(api: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`smg launch` in front of the cluster's API port; (process, base URL)."""
    port = free_port()
    argv = [shutil.which("smg") or "smg", "launch", "--worker-urls", f"grpc://{api}",
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
            "--log-level", "warn"]
    with open(log, "ab") as out:
        popen = subprocess.Popen(with_parent_death_signal(argv),
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    return popen, f"http://127.0.0.1:{port}/v1"


def wait_gateway(popen: subprocess.Popen, base_url: str, log: Path,
                 timeout: float = GATEWAY_READY_S) -> str:
    """Until the gateway lists the engine's model; its id."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"smg exited ({popen.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base_url}/models", timeout=2) as resp:
                models = json.load(resp).get("data") or []
            if models:
                return models[0]["id"]
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the gateway listed no model after {timeout:g} s:\n"
                       f"{log.read_text()[-3000:]}")


def run(args) -> dict:
    cache = () if args.prefix_caching else ("--no-enable-prefix-caching",)
    spec = launcher.ClusterSpec(model=args.model, worker_threads=args.worker_threads,
                                controlplane_args=(*cache, *args.controlplane_args))
    sink = sys.stderr if args.logs else open(os.devnull, "w")  # noqa: SIM115
    cluster = launcher.Cluster(spec, log_sink=sink)
    tmp = Path(tempfile.mkdtemp(prefix="kvloom-gateway-bench-"))
    gateway = None
    try:
        print("== starting the cluster", file=sys.stderr)
        cluster.start()
        cluster.wait_ready(args.ready_timeout)
        log = tmp / "smg.log"
        gateway, base_url = start_gateway(cluster.api_address, log)
        model = wait_gateway(gateway, base_url, log)
        print(f"== gateway {base_url} serves {model!r}", file=sys.stderr)
        return asyncio.run(run_rounds(Target(cluster, gateway, base_url, model), args))
    finally:
        if gateway is not None:
            if gateway.poll() is None:
                stop_pids([("smg", gateway.pid)], grace=10.0)
            reap(gateway)
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# ---- the command line -------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir, or an embedded model's name "
                   "(smollm2-135m, gemma-3-270m); default: smollm2-135m")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len-range", type=parse_range, default=(16, 128), metavar="LO,HI",
                   help="per-request prompt lengths drawn from [LO, HI] (seeded; the text's "
                        "tokens again may differ by a few)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=parse_rounds, default=2,
                   help="rounds of both paths, alternating (a, b, a, b, ...)")
    p.add_argument("--warmup", type=int, help="requests per path run before timing; "
                   "default: --concurrency")
    p.add_argument("--quick", action="store_true",
                   help="--num-requests 16 --concurrency 8 --max-tokens 32 --prompt-len-range "
                        "16,64 (about a minute on 2 cores)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="leave the prefix cache on (later rounds then reuse the prompts' KV)")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--logs", action="store_true", help="show the daemons' logs")
    p.add_argument("--out", "--json", type=Path, help="write the results here (JSON)")
    p.add_argument("controlplane_args", nargs="*", help="after --: controlplane flags")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.num_requests, args.concurrency, args.max_tokens = 16, 8, 32
        args.prompt_len_range = (16, 64)
    # serving.random_prompts reads these.
    args.prompt_len = args.prompt_len_range[0]
    return args


def missing_tools() -> list[str]:
    """What this benchmark needs beyond kvloom: the gateway and its client."""
    import importlib.util

    return ([] if shutil.which("smg") else ["smg (the `smg` command)"]) + (
        [] if importlib.util.find_spec("openai") else ["openai"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if missing := missing_tools():
        print(f"gateway benchmark: not installed: {', '.join(missing)} (pip install smg openai)",
              file=sys.stderr)
        return 2
    from kvloom.common.embedded_model_spec import EmbeddedModelError
    from kvloom.common.embedded_models import is_model_name, resolve_model

    try:
        args.model = resolve_model(args.model) if is_model_name(args.model) else args.model
    except EmbeddedModelError as exc:
        print(f"gateway benchmark: {exc}", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except (KvloomError, launcher.ClusterError, RuntimeError) as exc:
        print(f"gateway benchmark: error: {exc}", file=sys.stderr)
        return 1
    rep = report(result)
    print(format_table(rep))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        payload = {"command": " ".join(["python benchmarks/gateway.py",
                                        *(sys.argv[1:] if argv is None else argv)]),
                   "config": json.loads(json.dumps(config, default=str)),
                   "cpus": os.cpu_count(), **rep}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    failed = sum(m["failed"] for m in rep["metrics"].values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
