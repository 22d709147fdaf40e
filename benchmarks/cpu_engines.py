"""kvloom against the CPU engines people already run: the same requests, side by side.

    python benchmarks/cpu_engines.py --bf16-model DIR --vllm-bin VENV/bin/vllm \\
        --llama-server-bin BIN/llama-server --gguf BF16.gguf --rounds 2 --json cpu.json

Issue 42's figure. Each engine is started here, serves the same seeded
requests on its OpenAI API (streaming /v1/completions, greedy) and is stopped
(SIGTERM, then SIGKILL) before the next starts: kvloom-bfloat16 and -float32
(`kvloom up --openai-port P --dtype D`, the SMG gateway in front),
vllm-bfloat16 (`vllm serve --dtype bfloat16`, vLLM's CPU build) and
llamacpp-bf16 (`llama-server -np --concurrency`), each with --threads compute
threads; one whose binary or weights are not given is skipped, with a line
saying so. Prompts are words of the model's vocabulary (one token each); the
EOS is ignored (`ignore_eos`, vLLM also `min_tokens`) and the table checks,
from each response's usage, that every engine produced the max_tokens asked.
Per engine and round: start-up seconds, output tokens/s (over the wall time of
all requests, after --warmup untimed ones), TTFT and per-request latency
(median, p90), TPOT; then per engine the median tokens/s over --rounds (each
round starts every engine afresh, in turn) and the median of each round's
ratio to kvloom-float32 and to vLLM. The CPU's instruction set
(workerd.cpu_features) heads the table and the JSON.

Arguments: --engines (comma list, default all four); --model (float32 dir or
embedded name, default smollm2-135m); --bf16-model (kvloom-bfloat16, vLLM;
default --model); --gguf; --vllm-bin; --llama-server-bin; --threads (default
the CPU count); --num-requests 64; --concurrency 16; --prompt-len-range 64,128
(words); --max-tokens-range 64,128; --seed 0; --warmup (default
--concurrency); --rounds 1; --ready-timeout 900; --vllm-kv-gib 2; --logs DIR
(the engines' logs, else kept only on failure); --json OUT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script

from benchmarks.serving import parse_range, parse_rounds, percentile  # noqa: E402
from kvloom.common.ports import free_port  # noqa: E402
from kvloom.common.procs import Terminated, alive, send_signal, termination_as_exception  # noqa: E402
from workerd.cpu_features import cpu_flags, isa_summary, native_bf16  # noqa: E402

ENGINES = ("kvloom-bfloat16", "kvloom-float32", "vllm-bfloat16", "llamacpp-bf16")
BASELINES = ("kvloom-float32", "vllm-bfloat16")
WARMUP_TOKENS = 16
STOP_GRACE_S = 20.0
REQUEST_TIMEOUT_S = 900.0


# ---- the requests -------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int


def word_pool(model_dir: str) -> list[str]:
    """Vocabulary entries that are a space and a lowercase word (byte-level
    BPE's 'Ġword'): a prompt of N of them is N tokens in any tokenizer of this
    vocabulary, HF's or the GGUF's."""
    vocab = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    for pattern in (r"Ġ[a-z]{3,12}", r"Ġ[a-z]+", r"Ġ?[a-z]+"):
        words = sorted({t.lstrip("Ġ") for t in vocab if re.fullmatch(pattern, t)})
        if len(words) >= 64:
            return words
    raise SystemExit(f"cpu_engines: too few word tokens in {model_dir}/tokenizer.json")


def make_requests(words: list[str], n: int, prompt_range: tuple[int, int],
                  max_range: tuple[int, int], seed: int) -> list[Request]:
    """n prompts of seeded words; words, lengths and max_tokens each from a stream of its own."""
    pick, lengths, outs = random.Random(seed), random.Random(seed + 2), random.Random(seed + 3)
    return [Request("".join(" " + pick.choice(words)
                            for _ in range(lengths.randint(*prompt_range))),
                    outs.randint(*max_range)) for _ in range(n)]


@dataclass
class Record:
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    prompt_tokens: int = -1
    output_tokens: int = 0
    error: str = ""


async def one_request(client, model: str, engine: str, req: Request, record: Record) -> None:
    record.start, events = time.perf_counter(), 0
    # Each engine's way to ignore the EOS; vLLM also takes min_tokens.
    extra = {"ignore_eos": True, **({"min_tokens": req.max_tokens} if engine.startswith("vllm")
                                    else {})}
    try:
        stream = await client.completions.create(
            model=model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body=extra, timeout=REQUEST_TIMEOUT_S)
        async for event in stream:
            if event.choices and event.choices[0].text:
                events += 1
                if record.first is None:
                    record.first = time.perf_counter()
            if event.usage is not None:
                record.output_tokens = event.usage.completion_tokens
                record.prompt_tokens = event.usage.prompt_tokens
        if record.prompt_tokens < 0:  # no usage event: count the streamed pieces
            record.output_tokens = events
    except Exception as exc:  # noqa: BLE001 - the openai client's errors, reported per request
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.end = time.perf_counter()


async def run_requests(base_url: str, model: str, engine: str, requests: list[Request],
                       concurrency: int) -> tuple[list[Record], float]:
    import openai
    # A connection per request: llama-server closes some kept-alive connections
    # as the client reuses them ("Server disconnected without sending a response").
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                default_headers={"Connection": "close"})
    limit, records = asyncio.Semaphore(concurrency), [Record() for _ in requests]

    async def bounded(req, record):
        async with limit:
            await one_request(client, model, engine, req, record)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(bounded(q, r) for q, r in zip(requests, records, strict=True)))
        return records, time.perf_counter() - started
    finally:
        await client.close()


def metrics(records: list[Record], requests: list[Request], duration: float) -> dict:
    ok = [r for r in records if not r.error and r.first is not None]
    tokens = sum(r.output_tokens for r in ok)
    ttft = [r.first - r.start for r in ok]
    e2e = [r.end - r.start for r in ok]
    tpot = [(r.end - r.first) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3], "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": tokens,
        "expected_output_tokens": sum(q.max_tokens for q in requests),
        "requests_with_max_tokens": sum(r.output_tokens == q.max_tokens
                                        for r, q in zip(records, requests, strict=True)),
        "output_throughput": tokens / duration if duration else 0.0,
        # percentile() at 50 is the median; each in ms.
        **{f"{name}_ms_{'median' if q == 50 else f'p{q}'}": percentile(values, q) * 1000.0
           for name, values in (("ttft", ttft), ("latency", e2e), ("tpot", tpot))
           for q in (50, 90)},
    }


# ---- the engines ----------------------------------------------------------------


@dataclass
class Engine:
    """How to start one engine on a port; argv and env hold the placeholder {port}."""

    name: str
    weights: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    version: str = ""


# Loopback only: no engine may look for weights online or report usage.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
               "VLLM_NO_USAGE_STATS": "1"}


def engines(args) -> tuple[list[Engine], dict[str, str]]:
    """The engines to run, in --engines order, and those skipped with why."""
    threads, out, skipped = str(args.threads), [], {}
    for name in args.engines:
        if name.startswith("kvloom"):
            dtype = name.split("-")[1]
            model = args.bf16_model if dtype == "bfloat16" else args.model
            state = Path(tempfile.gettempdir()) / f"kvloom-cpu-engines-{os.getpid()}-{dtype}.json"
            out.append(Engine(name, model, [
                sys.executable, "-m", "kvloom_cli", "up", "--model", model, "--host", "127.0.0.1",
                "--openai-port", "{port}", "--worker-threads", threads, "--state-file",
                str(state), "--ready-timeout", str(args.ready_timeout), "--dtype", dtype],
                version=_version(["git", "-C", str(REPO), "describe", "--always", "--dirty"])))
        elif name.startswith("vllm"):
            if not args.vllm_bin:
                skipped[name] = "not run: no --vllm-bin"
                continue
            out.append(Engine(name, args.bf16_model, [
                args.vllm_bin, "serve", args.bf16_model, "--dtype", "bfloat16",
                "--host", "127.0.0.1", "--port", "{port}", "--seed", "0"],
                env={"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
                     "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"},
                version=_version([args.vllm_bin, "--version"])))
        else:
            if not args.llama_server_bin or not args.gguf:
                skipped[name] = "not run: no " + (
                    "--llama-server-bin" if not args.llama_server_bin else "--gguf")
                continue
            # A slot holds the longest prompt (twice over, should words split) and output.
            per_slot = 2 * args.prompt_len_range[1] + args.max_tokens_range[1] + 64
            out.append(Engine(name, args.gguf, [
                args.llama_server_bin, "-m", args.gguf, "--host", "127.0.0.1",
                "--port", "{port}", "-t", threads, "-tb", threads, "-np",
                str(args.concurrency), "-c", str(per_slot * args.concurrency), "--seed", "0"],
                version=_version([args.llama_server_bin, "--version"])))
    return out, skipped


def _version(argv: list[str]) -> str:
    """The lines of `argv`'s output that name a version, else its last line."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL, env={**os.environ, **OFFLINE_ENV})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
    named = [ln for ln in lines if "version" in ln.lower() or ln.startswith("commit")]
    return " | ".join(named or lines[-1:])[:300]  # stdout's last line, if it printed one


class Running:
    """One started engine: its process group, its base URL and log."""

    def __init__(self, engine: Engine, log: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        argv = [a.replace("{port}", str(self.port)) for a in engine.argv]
        env = {**os.environ, **OFFLINE_ENV, **engine.env}
        with open(log, "ab", buffering=0) as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            self.popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, engine: str, timeout: float) -> str:
        """Until the engine lists a model and serves a one-token completion; its id."""
        deadline, model = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{engine} exited ({self.popen.returncode}):\n{_tail(self.log)}")
            try:
                if model is None:
                    with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as resp:
                        listed = json.load(resp).get("data") or []
                    model = listed[0]["id"] if listed else None
                body = json.dumps({"model": model, "prompt": " hello", "max_tokens": 1})
                req = urllib.request.Request(f"{self.base_url}/completions", body.encode(),
                                             {"Content-Type": "application/json"})
                if model is not None and urllib.request.urlopen(req, timeout=60).status == 200:
                    return model
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{engine} not ready after {timeout:g} s:\n{_tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM to the engine's first process (each stops its own children:
        `kvloom up` would restart a rank killed under it), then SIGKILL to what
        is left of its process group and descendants after the grace."""
        procs = _family(self.popen.pid)
        for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            for pid in procs if sig == signal.SIGKILL else [self.popen.pid]:
                send_signal(pid, sig)
            deadline = time.monotonic() + grace
            while (procs := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not procs:
                break
        self.popen.poll()


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _family(leader: int) -> list[int]:
    """The processes of `leader`'s group and its descendants, from /proc."""
    parent, group = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            pid = int(stat.parent.name)
            parent[pid], group[pid] = int(fields[1]), int(fields[2])
    family = {leader} | {pid for pid, g in group.items() if g == leader}
    while grown := {pid for pid, pp in parent.items() if pp in family} - family:
        family |= grown
    return sorted(family)


def run_engine(engine: Engine, args, requests: list[Request], warmup: list[Request],
               log: Path) -> dict:
    started = time.perf_counter()
    running = Running(engine, log)
    try:
        model = running.wait_ready(engine.name, args.ready_timeout)
        start_s = time.perf_counter() - started
        asyncio.run(run_requests(running.base_url, model, engine.name, warmup, args.concurrency))
        records, duration = asyncio.run(run_requests(running.base_url, model, engine.name,
                                                     requests, args.concurrency))
        return {"start_s": start_s, "model_id": model,
                "metrics": metrics(records, requests, duration)}
    finally:
        running.stop()


# ---- the report -----------------------------------------------------------------


def summary(runs: list[dict], names: list[str]) -> dict:
    """Per engine: the median tokens/s over its rounds and the median of each
    round's ratio to the baselines run in the same round."""
    by_round: dict[int, dict[str, float]] = {run["round"]: {} for run in runs}
    for run in (r for r in runs if "metrics" in r and not r["metrics"]["failed"]):
        by_round[run["round"]][run["engine"]] = run["metrics"]["output_throughput"]
    out = {}
    for name in names:
        if tps := [r[name] for r in by_round.values() if name in r]:
            out[name] = {"output_throughput_median": statistics.median(tps), "rounds": tps}
            for base in BASELINES:
                if ratios := [r[name] / r[base] for r in by_round.values() if name in r
                              and r.get(base)]:
                    out[name][f"vs_{base}"] = {"median": statistics.median(ratios),
                                               "rounds": ratios}
    return out


def format_table(payload: dict) -> str:
    cpu = payload["cpu"]
    lines = [f"CPU: {cpu['model']}, {cpu['cpus']} CPUs, ISA {cpu['isa']} (native bf16: "
             f"{'yes' if cpu['native_bf16'] else 'no'}); {payload['workload']}"]
    rows = [["engine", "round", "start s", "tok/s", "TTFT med/p90 ms", "latency med/p90 ms",
             "TPOT ms", "prompt tok", "output tok (expected)"]]
    for run in payload["runs"]:
        if "error" in run:
            rows.append([run["engine"], str(run["round"]), "failed: " + run["error"][:60],
                         *[""] * 6])
            continue
        m = run["metrics"]
        ok = "" if m["output_tokens"] == m["expected_output_tokens"] else " MISMATCH"
        rows.append([run["engine"], str(run["round"]), f"{run['start_s']:.1f}",
                     f"{m['output_throughput']:.1f}",
                     f"{m['ttft_ms_median']:.0f} / {m['ttft_ms_p90']:.0f}",
                     f"{m['latency_ms_median']:.0f} / {m['latency_ms_p90']:.0f}",
                     f"{m['tpot_ms_median']:.1f}", str(m["prompt_tokens"]),
                     f"{m['output_tokens']} ({m['expected_output_tokens']}){ok}"
                     + (f" {m['failed']} failed" if m["failed"] else "")])
    lines += _aligned(rows)
    lines.append("")
    rows = [["engine", "tok/s median", "rounds", "vs kvloom-float32", "vs vllm-bfloat16"]]
    for name, s in payload["summary"].items():
        rows.append([name, f"{s['output_throughput_median']:.1f}",
                     ", ".join(f"{x:.1f}" for x in s["rounds"]),
                     *(_ratio(s.get(f"vs_{b}")) for b in BASELINES)])
    lines += _aligned(rows)
    lines += [f"skipped {name}: {why}" for name, why in payload["skipped"].items()]
    return "\n".join(lines)


def _ratio(r: dict | None) -> str:
    return f"{r['median']:.2f} ({', '.join(f'{x:.2f}' for x in r['rounds'])})" if r else "-"


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w)
                     for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
           for row in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def cpu_info() -> dict:
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    return {"model": found.group(1).strip() if found else "unknown", "cpus": os.cpu_count(),
            "isa": isa_summary(), "native_bf16": native_bf16(),
            "bf16_flags": sorted(f for f in cpu_flags() if "bf16" in f)}


# ---- the command line -------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=lambda s: [e for e in s.split(",") if e],
                   default=list(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--model", help="float32 checkpoint (kvloom-float32); default smollm2-135m")
    p.add_argument("--bf16-model", help="bf16 checkpoint (kvloom, vLLM); default --model")
    p.add_argument("--gguf", help="the same weights as a BF16 GGUF (llama.cpp)")
    p.add_argument("--vllm-bin", help="the `vllm` command of vLLM's CPU build")
    p.add_argument("--llama-server-bin", help="llama.cpp's `llama-server`")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="per engine")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len-range", type=parse_range, default=(64, 128), metavar="LO,HI")
    p.add_argument("--max-tokens-range", type=parse_range, default=(64, 128), metavar="LO,HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, help="untimed requests first; default --concurrency")
    p.add_argument("--rounds", type=parse_rounds, default=1)
    p.add_argument("--ready-timeout", type=float, default=900.0, help="start-up limit (s)")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--logs", type=Path, help="keep the engines' logs in this directory")
    p.add_argument("--json", "--out", dest="json", type=Path, help="write the results here")
    return p


# The numeric flags' bounds: a value that would hang the run or swamp the
# machine is refused before any engine starts.
BOUNDS = {"threads": (1, 256), "num_requests": (1, 4096), "concurrency": (1, 256),
          "warmup": (0, 4096), "ready_timeout": (1, 3600), "vllm_kv_gib": (1, 1024)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for name, (lo, hi) in BOUNDS.items():
        value = vars(args)[name]
        if value is not None and not lo <= value <= hi:  # NaN fails both
            raise SystemExit(f"cpu_engines: --{name.replace('_', '-')} {value} is outside "
                             f"{lo}..{hi}")
    if unknown := [e for e in args.engines if e not in ENGINES]:
        raise SystemExit(f"cpu_engines: unknown engines {unknown}; known: {', '.join(ENGINES)}")
    from kvloom.common.embedded_models import is_model_name, resolve_model

    args.model = resolve_model(args.model) if is_model_name(args.model) else args.model
    args.bf16_model = args.bf16_model or args.model
    args.warmup = args.concurrency if args.warmup is None else args.warmup
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    words = word_pool(args.model)
    requests = make_requests(words, args.num_requests, args.prompt_len_range,
                             args.max_tokens_range, args.seed)
    warmup = [Request(q.prompt, WARMUP_TOKENS) for q in make_requests(
        words, args.warmup, args.prompt_len_range, args.max_tokens_range, args.seed + 1)]
    todo, skipped = engines(args)
    print("".join(f"== {name}: {why}\n" for name, why in skipped.items()), end="", file=sys.stderr)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvloom-cpu-engines-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    with termination_as_exception():
        try:
            for rnd in range(1, args.rounds + 1):
                for engine in todo:
                    print(f"== round {rnd} of {args.rounds}: {engine.name}", file=sys.stderr)
                    try:
                        result = run_engine(engine, args, requests, warmup,
                                            logs / f"{engine.name}.log")
                    except (RuntimeError, OSError) as exc:
                        print(f"== {engine.name} failed: {exc}", file=sys.stderr)
                        result = {"error": str(exc).splitlines()[0]}
                    runs.append({"round": rnd, "engine": engine.name, **result})
        except (KeyboardInterrupt, Terminated):
            print("== interrupted: reporting the runs so far", file=sys.stderr)
    expected = sum(q.max_tokens for q in requests)
    payload = {
        "command": " ".join(["python benchmarks/cpu_engines.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "config": json.loads(json.dumps(vars(args), default=str)),
        "cpu": cpu_info(),
        "workload": (f"{args.num_requests} requests, {args.concurrency} in flight, prompts "
                     f"{args.prompt_len_range[0]}-{args.prompt_len_range[1]} words, max_tokens "
                     f"{args.max_tokens_range[0]}-{args.max_tokens_range[1]} "
                     f"({expected} output tokens a run), {args.threads} threads per engine"),
        "engines": {e.name: {"weights": e.weights, "argv": e.argv, "env": e.env,
                             "version": e.version} for e in todo},
        "skipped": skipped,
        "runs": runs,
        "summary": summary(runs, [e.name for e in todo]),
        "logs": str(logs),
    }
    print(format_table(payload))
    bad = [r for r in runs if "error" in r or r["metrics"]["failed"]
           or r["metrics"]["output_tokens"] != r["metrics"]["expected_output_tokens"]]
    if not (args.logs or bad):
        shutil.rmtree(logs, ignore_errors=True)
        payload["logs"] = None
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if runs and not bad and len(runs) == args.rounds * len(todo) else 1


if __name__ == "__main__":
    sys.exit(main())
