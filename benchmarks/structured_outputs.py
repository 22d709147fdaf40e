"""Structured outputs: the step with 16 constrained requests beside 16 unconstrained ones.

    python benchmarks/structured_outputs.py --out structured.json
    python benchmarks/structured_outputs.py --models tiny --repeats 6
    python benchmarks/structured_outputs.py --quick

For each model of --models (`tiny`: the tests' seeded random Llama, built
by kvloom.testing.checkpoints.make_tiny_llama into a temporary dir;
`smollm2`: the embedded SmolLM2-135M; or a checkpoint dir / embedded name)
and each mode of --scheduling (async, the default, and serial:
--no-async-scheduling), one local cluster (kvloom.cli.launcher, TP=1, free
ports, prefix caching off since every repeat sends the same prompts) runs
two workloads of 32 concurrent greedy requests, interleaved --repeats times
in the same process (a b b a a b ...: the order alternates, so a drift of
the shared box hits both):

  (a) plain: all 32 unconstrained;
  (b) mixed: 16 constrained to one JSON schema (PERSON below; no free whitespace,
      json_any_whitespace=False) beside the same 16 unconstrained ones.

The schema bounds every string and number, so its longest output is
LONGEST_TOKENS tokens (EOS included) and each constrained request ends when
its JSON does, well within --max-tokens. An untimed warm-up (which also
compiles the schema) records each constrained request's output length; in
both workloads the other requests run exactly those lengths with
ignore_eos (unconstrained request j takes constrained request j's, and in
(a) each constrained request's unconstrained twin takes its own). So (a) and
(b) do the same tokens in the same batches, and only the grammar differs.
A model with a chat template is asked for the JSON in a chat turn (so
SmolLM2's output is a sensible person); the tiny model gets text prompts.

Reported per workload, pooled over the repeats: output tokens/s; from the
controlplane's /metrics (benchmarks/serving.py's step series) steps, output
tokens per step, wall ms per step, the output rank's forward ms per step
(its wait for masks left out; the mask apply is in), the broadcast -> reply
round trip and the CPU per step of the controlplane, the rank and this
client; TTFT, TPOT and ITL (median, p90; for (b) also split constrained /
unconstrained); from the output rank's /metrics the grammar wait per
constrained step (kvloom_workerd_grammar_wait_seconds: forward end -> masks
in) and the share of those steps that waited over 1 ms; the constrained
outputs that parse as JSON with PERSON's keys; and (b)/(a) of each figure,
with each repeat's ratio of wall ms per step and tokens/s and their median.
The requests arrive together but are admitted as the engine's loop turns,
so the first few may be prefilled alone and then wait out the others'
prefill: their TPOT (and the p90) carries that wait, ITL shows the steps.

Then, one request at a time on the idle cluster, --ttft-repeats times: TTFT
of an unconstrained request (the floor), of a never-seen schema (PERSON with
a property renamed by a counter: a compile), and of that schema again (a
cache hit); medians, checked against kvloom_grammar_compiles_total and
kvloom_grammar_cache_hits_total.
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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script

from benchmarks.gateway import path_metrics  # noqa: E402
from benchmarks.loop_isolation import metric_values, scrape  # noqa: E402
from benchmarks.serving import (  # noqa: E402
    RequestRecord,
    parse_modes,
    step_breakdown,
    step_series,
    summarize,
)
from kvloom.cli import launcher  # noqa: E402
from kvloom.client import AsyncKvloomClient, KvloomError  # noqa: E402

NUM_CONSTRAINED = 16
NUM_UNCONSTRAINED = 16
REQUEST_TIMEOUT_S = 600.0
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                   "age": {"type": "integer", "minimum": 18, "maximum": 99},
                   "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                   "bio": {"type": "string", "pattern": "^[A-Za-z0-9 ,.'-]{10,50}$"}},
    "required": ["name", "age", "city", "bio"],
    "additionalProperties": False,
}
# Every character is ASCII, so a token holds at least one: the longest
# instance's characters (xgrammar's separators without free whitespace are
# json.dumps' ", " and ": "), plus EOS, bound the tokens.
_LONGEST = {"name": "N" + "a" * 11, "age": 99, "city": "C" + "a" * 11, "bio": "b" * 50}
LONGEST_TOKENS = len(json.dumps(_LONGEST)) + 1
ROLES = ("baker", "pilot", "teacher", "farmer", "doctor", "painter", "sailor", "miner",
         "chef", "nurse", "judge", "poet", "tailor", "guard", "hunter", "monk")
QUESTION = ("Invent a {role} (character {i}) for a short story. Reply with JSON only, with the "
            "keys name, age, city and bio (one short sentence).")
TEXT_PROMPT = "Person {i} as JSON:"
TTFT_MAX_TOKENS = 8
SETTLE_S = 0.2
WORKLOADS = ("plain", "mixed")


# ---- the requests ----------------------------------------------------------------


@dataclass
class Job:
    """One request of a workload: prompt i, constrained or not, max tokens."""

    index: int
    constrained: bool
    max_tokens: int
    schema: dict | None = None


@dataclass
class Outcome:
    record: RequestRecord
    constrained: bool
    text: str = ""
    finish_reason: str = ""
    finish_tokens: int = 0


async def run_job(client, chat: bool, job: Job) -> Outcome:
    """One streamed Generate: greedy; a constrained request stops where its
    JSON ends, an unconstrained one runs exactly max_tokens (ignore_eos)."""
    options = {"max_tokens": job.max_tokens, "temperature": 0.0,
               "ignore_eos": not job.constrained, "timeout": REQUEST_TIMEOUT_S}
    if job.constrained:
        options.update(json_schema=job.schema or PERSON, json_any_whitespace=False)
    if chat:
        question = QUESTION.format(role=ROLES[job.index % len(ROLES)], i=job.index)
        options["messages"] = [{"role": "user", "content": question}]
        prompt = None
    else:
        prompt = TEXT_PROMPT.format(i=job.index)
    out = Outcome(RequestRecord(0), job.constrained)
    record, texts = out.record, []
    record.start = last = time.perf_counter()
    try:
        async for chunk in client.stream(prompt, **options):
            if chunk.token_ids:
                last = record.tokens_arrived(time.perf_counter(), last, len(chunk.token_ids))
            texts.append(chunk.text)
            if chunk.finish is not None:
                out.finish_reason = chunk.finish.reason
                out.finish_tokens = chunk.finish.output_tokens
                record.prompt_len = chunk.finish.prompt_tokens
    except KvloomError as exc:
        record.error = str(exc)
    record.end = time.perf_counter()
    out.text = "".join(texts)
    return out


def workload_jobs(kind: str, lengths: list[int], max_tokens: int) -> list[Job]:
    """The 32 requests of `kind`: prompts 0-15 constrained (mixed) or their
    unconstrained twins (plain), prompts 16-31 unconstrained in both, each
    unconstrained one running the calibrated length of its constrained pair."""
    jobs = [Job(i, True, max_tokens) if kind == "mixed" else Job(i, False, lengths[i])
            for i in range(NUM_CONSTRAINED)]
    jobs += [Job(NUM_CONSTRAINED + j, False, lengths[j % NUM_CONSTRAINED])
             for j in range(NUM_UNCONSTRAINED)]
    return jobs


def json_ok(text: str) -> bool:
    """The output is one JSON object with PERSON's keys."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(PERSON["properties"])


def renamed_schema(n: int) -> dict:
    """PERSON with its `name` property called name_<n>: a schema never seen before."""
    props = dict(PERSON["properties"])
    props[f"name_{n}"] = props.pop("name")
    required = [f"name_{n}" if k == "name" else k for k in PERSON["required"]]
    return {**PERSON, "properties": props, "required": required}


# ---- /metrics ----------------------------------------------------------------------

_WAIT = "kvloom_workerd_grammar_wait_seconds"
_GRAMMAR_COUNTERS = ("kvloom_grammar_compiles_total", "kvloom_grammar_cache_hits_total",
                     "kvloom_grammar_mask_bytes_total")


def _bucket(text: str, le: str) -> float:
    return sum(v for labels, v in metric_values(text, f"{_WAIT}_bucket").items()
               if f'le="{le}"' in labels)


class Probe:
    """Cumulative series of one cluster: the controlplane's step series and
    CPU (serving.step_series), its grammar counters, and the ranks' grammar
    wait histogram summed over the ranks (only the output rank observes it)."""

    def __init__(self, cluster):
        self.cluster = cluster

    def snapshot(self) -> dict[str, float]:
        values = step_series(self.cluster.metrics_address, self.cluster)
        text = scrape(self.cluster.metrics_address)
        for name in _GRAMMAR_COUNTERS:
            values[name] = sum(metric_values(text, name).values())
        for url in self.cluster.worker_metrics_addresses:
            text = scrape(url)
            for suffix in ("sum", "count"):
                key = f"{_WAIT}_{suffix}"
                values[key] = values.get(key, 0.0) + sum(metric_values(text, key).values())
            values["wait_le_1ms"] = values.get("wait_le_1ms", 0.0) + _bucket(text, "0.001")
        return values


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


def window_figures(d: dict[str, float], duration: float, serial: bool) -> dict:
    """Per-step figures of a window from its series deltas `d`."""
    out = step_breakdown(dict.fromkeys(d, 0.0), d, duration, serial)
    waits = d.get(f"{_WAIT}_count", 0.0)
    out["constrained_steps"] = int(waits)
    out["grammar_wait_ms_mean"] = 1000 * d[f"{_WAIT}_sum"] / waits if waits else 0.0
    out["grammar_waits_over_1ms"] = 1 - d["wait_le_1ms"] / waits if waits else 0.0
    out["grammar_compiles"] = int(d["kvloom_grammar_compiles_total"])
    out["grammar_cache_hits"] = int(d["kvloom_grammar_cache_hits_total"])
    out["grammar_mask_bytes"] = int(d["kvloom_grammar_mask_bytes_total"])
    return out


# ---- one cluster --------------------------------------------------------------------


async def run_workload(client, chat: bool, jobs: list[Job], probe: Probe) -> dict:
    before = probe.snapshot()
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(run_job(client, chat, job) for job in jobs))
    duration = time.perf_counter() - started
    # The controlplane observes a step's histograms on its loop just after
    # sending the step's tokens: let the last one land before reading.
    await asyncio.sleep(SETTLE_S)
    return {"outcomes": outcomes, "duration_s": duration,
            "series": delta(before, probe.snapshot())}


async def calibrate(client, chat: bool, args) -> list[int]:
    """The constrained requests' output lengths (untimed; compiles PERSON),
    run beside short unconstrained ones."""
    jobs = workload_jobs("mixed", [min(16, args.max_tokens)] * NUM_CONSTRAINED, args.max_tokens)
    outcomes = await asyncio.gather(*(run_job(client, chat, job) for job in jobs))
    await asyncio.sleep(SETTLE_S)
    failed = [o.record.error for o in outcomes if o.record.error]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed[:3]}")
    return [o.finish_tokens for o in outcomes[:NUM_CONSTRAINED]]


async def ttft_alone(client, chat: bool, probe: Probe, rounds: int) -> dict:
    """Alone on the cluster: unconstrained, a first-seen schema, the same again."""
    times: dict[str, list[float]] = {"unconstrained": [], "cold": [], "cached": []}
    before = probe.snapshot()
    nonce = int(time.time())
    for i in range(rounds):
        schema = renamed_schema(nonce + i)
        for kind, job in (("unconstrained", Job(0, False, TTFT_MAX_TOKENS)),
                          ("cold", Job(0, True, TTFT_MAX_TOKENS, schema)),
                          ("cached", Job(0, True, TTFT_MAX_TOKENS, schema))):
            out = await run_job(client, chat, job)
            if out.record.error or out.record.first_token is None:
                raise RuntimeError(f"TTFT {kind} request failed: {out.record.error}")
            times[kind].append(out.record.first_token - out.record.start)
    await asyncio.sleep(SETTLE_S)
    d = delta(before, probe.snapshot())
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return {"ttft_ms_median": ms, "ttft_ms": {k: [1000 * t for t in v] for k, v in times.items()},
            "compiles": int(d["kvloom_grammar_compiles_total"]),
            "cache_hits": int(d["kvloom_grammar_cache_hits_total"]), "rounds": rounds}


async def drive(cluster, serial: bool, lengths: list[int] | None, args) -> dict:
    probe = Probe(cluster)
    async with AsyncKvloomClient(cluster.api_address) as client:
        info = await client.model_info()
        chat = info.has_chat_template
        found = await calibrate(client, chat, args)
        lengths = lengths or found
        runs: list[dict] = []
        for r in range(args.repeats):
            order = WORKLOADS if r % 2 == 0 else WORKLOADS[::-1]
            for kind in order:
                print(f"== repeat {r + 1} of {args.repeats}: {kind}", file=sys.stderr)
                run = await run_workload(client, chat, workload_jobs(kind, lengths,
                                                                     args.max_tokens), probe)
                runs.append({"repeat": r + 1, "workload": kind, **run})
        ttft = await ttft_alone(client, chat, probe, args.ttft_repeats)
    return {"chat": chat, "lengths": lengths, "calibrated": found, "runs": runs, "ttft": ttft,
            "serial": serial}


def run_cluster(model: str, serial: bool, lengths: list[int] | None, args) -> dict:
    spec = launcher.ClusterSpec(
        model=model, worker_threads=args.worker_threads,
        controlplane_args=("--no-enable-prefix-caching",
                           *(("--no-async-scheduling",) if serial else ()),
                           *args.controlplane_args))
    sink = sys.stderr if args.logs else open(os.devnull, "w")  # noqa: SIM115
    cluster = launcher.Cluster(spec, log_sink=sink)
    try:
        cluster.start()
        cluster.wait_ready(args.ready_timeout)
        return asyncio.run(drive(cluster, serial, lengths, args))
    finally:
        cluster.stop()


# ---- the report ----------------------------------------------------------------------


def _pooled(runs: list[dict], which=None) -> dict:
    """gateway.path_metrics (TTFT/TPOT/ITL median and p90, tokens/s) over
    the runs' outcomes, all or those `which` picks."""
    picked = [{"records": [o.record for o in run["outcomes"] if which is None or which(o)],
               "duration_s": run["duration_s"], "cpu_s": {}} for run in runs]
    return path_metrics(picked)


def workload_report(runs: list[dict], serial: bool) -> dict:
    duration = sum(run["duration_s"] for run in runs)
    series: dict[str, float] = {}
    for run in runs:
        for k, v in run["series"].items():
            series[k] = series.get(k, 0.0) + v
    m = _pooled(runs)
    m.update(window_figures(series, duration, serial))
    constrained = [o for run in runs for o in run["outcomes"] if o.constrained]
    m["json_ok"] = sum(json_ok(o.text) for o in constrained)
    m["constrained_requests"] = len(constrained)
    m["stopped_by_grammar"] = sum(o.finish_reason == "stop" for o in constrained)
    if constrained:
        m["example_output"] = constrained[0].text
        m["constrained"] = _pooled(runs, lambda o: o.constrained)
        m["unconstrained"] = _pooled(runs, lambda o: not o.constrained)
    return m


def cluster_report(result: dict) -> dict:
    serial = result["serial"]
    by = {w: [r for r in result["runs"] if r["workload"] == w] for w in WORKLOADS}
    metrics = {w: workload_report(runs, serial) for w, runs in by.items()}
    repeats = [{"repeat": run["repeat"], "workload": run["workload"], **_run_figures(run, serial)}
               for run in result["runs"]]
    plain, mixed = ([r for r in repeats if r["workload"] == w] for w in WORKLOADS)
    per_repeat = [{key: _div(b.get(key, 0.0), a.get(key, 0.0))
                   for key in ("wall_ms_per_step", "output_throughput")}
                  for a, b in zip(plain, mixed, strict=True)]
    return {"metrics": metrics, "per_repeat_ratios": per_repeat, "repeats": repeats,
            "ttft": result["ttft"], "lengths": result["lengths"],
            "calibrated": result["calibrated"], "chat": result["chat"]}


def _run_figures(run: dict, serial: bool) -> dict:
    """One timed run's own figures (the JSON keeps them beside the pooled ones)."""
    m = summarize([o.record for o in run["outcomes"]], run["duration_s"])
    return {**{k: m[k] for k in ("duration_s", "output_tokens", "output_throughput",
                                 "ttft_ms_median", "tpot_ms_median", "itl_ms_median")},
            **window_figures(run["series"], run["duration_s"], serial)}


def _div(a: float, b: float) -> float:
    return a / b if b else 0.0


def _ms(key: str, digits: int = 1):
    return lambda m: f"{m[key]:.{digits}f}" if key in m else "-"


ROWS = [
    ("requests (ok/total)", lambda m: f"{m['completed']}/{m['requests']}", None),
    ("output tokens", lambda m: str(m["output_tokens"]), "output_tokens"),
    ("output tokens/s", _ms("output_throughput"), "output_throughput"),
    ("steps", lambda m: str(m.get("steps", "-")), "steps"),
    ("output tokens/step", lambda m: f"{_div(m['output_tokens'], m.get('steps', 0)):.1f}", None),
    ("wall ms/step", _ms("wall_ms_per_step", 2), "wall_ms_per_step"),
    ("forward ms/step", _ms("forward_ms_per_step", 2), "forward_ms_per_step"),
    ("round trip ms/step", _ms("round_trip_ms_per_step", 2), "round_trip_ms_per_step"),
    ("TTFT median (ms)", _ms("ttft_ms_median"), "ttft_ms_median"),
    ("TTFT p90 (ms)", _ms("ttft_ms_p90"), "ttft_ms_p90"),
    ("TPOT median (ms)", _ms("tpot_ms_median", 2), "tpot_ms_median"),
    ("TPOT p90 (ms)", _ms("tpot_ms_p90", 2), "tpot_ms_p90"),
    ("ITL median (ms)", _ms("itl_ms_median", 2), "itl_ms_median"),
    ("ITL p90 (ms)", _ms("itl_ms_p90", 2), "itl_ms_p90"),
    ("constrained steps", lambda m: str(m.get("constrained_steps", "-")), None),
    ("grammar wait ms/constrained step", _ms("grammar_wait_ms_mean", 3), None),
    ("mask bytes/constrained step",
     lambda m: f"{_div(m['grammar_mask_bytes'], m['constrained_steps']):.0f}"
     if m.get("constrained_steps") else "-", None),
    ("constrained steps waiting > 1 ms (%)",
     lambda m: f"{100 * m['grammar_waits_over_1ms']:.0f}" if m.get("constrained_steps") else "-",
     None),
    ("CPU ms/step controlplane", lambda m: _cpu(m, "controlplane"), "cpu:controlplane"),
    ("CPU ms/step rank", lambda m: _cpu(m, "ranks"), "cpu:ranks"),
    ("CPU ms/step client", lambda m: _cpu(m, "client"), "cpu:client"),
    ("valid JSON / stopped by grammar",
     lambda m: f"{m['json_ok']}/{m['stopped_by_grammar']} of {m['constrained_requests']}"
     if m.get("constrained_requests") else "-", None),
]


# The rows shown for (b)'s constrained and unconstrained requests apart.
SPLIT = ("output_tokens", "ttft_ms_median", "ttft_ms_p90", "tpot_ms_median", "tpot_ms_p90",
         "itl_ms_median", "itl_ms_p90")


def _cpu(m: dict, who: str) -> str:
    cpu = m.get("cpu_ms_per_step")
    return f"{cpu[who]:.2f}" if cpu else "-"


def _value(m: dict, key: str) -> float:
    if key.startswith("cpu:"):
        return m.get("cpu_ms_per_step", {}).get(key[4:], 0.0)
    return m.get(key, 0.0)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_cluster(name: str, rep: dict) -> str:
    plain, mixed = rep["metrics"]["plain"], rep["metrics"]["mixed"]
    parts = [mixed.get("constrained", {}), mixed.get("unconstrained", {})]
    rows = [["metric", "(a) 32 plain", "(b) 16+16", "(b)/(a)", "(b) constrained",
             "(b) unconstrained"]]
    for label, fmt, key in ROWS:
        ratio = f"{_div(_value(mixed, key), _value(plain, key)):.3f}" if key else ""
        split = [fmt(p) if p and key in SPLIT else "" for p in parts]
        rows.append([label, fmt(plain), fmt(mixed), ratio, *split])
    lines = [f"== {name}", *_table(rows)]
    for key, label in (("wall_ms_per_step", "wall ms/step"), ("output_throughput",
                                                              "output tokens/s")):
        values = [r[key] for r in rep["per_repeat_ratios"]]
        lines.append(f"(b)/(a) {label} per repeat: " + ", ".join(f"{v:.3f}" for v in values)
                     + f" (median {statistics.median(values):.3f})")
    t = rep["ttft"]
    ms = t["ttft_ms_median"]
    lines.append(f"TTFT alone, median of {t['rounds']}: unconstrained {ms['unconstrained']:.1f} ms,"
                 f" cached schema {ms['cached']:.1f} ms, first-seen schema {ms['cold']:.1f} ms "
                 f"(compiles {t['compiles']}, cache hits {t['cache_hits']})")
    return "\n".join(lines)


def summary_rows(reports: dict[str, dict]) -> list[list[str]]:
    rows = [["cluster", "wall ms/step a", "b", "b/a", "tok/s a", "b", "b/a", "TPOT ms a", "b",
             "cp CPU ms/step a", "b", "grammar wait ms", "TTFT ms plain", "cached", "cold"]]
    for name, rep in reports.items():
        a, b = rep["metrics"]["plain"], rep["metrics"]["mixed"]
        ratios = rep["per_repeat_ratios"]
        ms = rep["ttft"]["ttft_ms_median"]
        rows.append([
            name, f"{a.get('wall_ms_per_step', 0):.2f}", f"{b.get('wall_ms_per_step', 0):.2f}",
            f"{statistics.median(r['wall_ms_per_step'] for r in ratios):.3f}",
            f"{a['output_throughput']:.0f}", f"{b['output_throughput']:.0f}",
            f"{statistics.median(r['output_throughput'] for r in ratios):.3f}",
            f"{a['tpot_ms_median']:.2f}", f"{b['tpot_ms_median']:.2f}",
            _cpu(a, "controlplane"), _cpu(b, "controlplane"),
            f"{b['grammar_wait_ms_mean']:.3f}", f"{ms['unconstrained']:.1f}",
            f"{ms['cached']:.1f}", f"{ms['cold']:.1f}"])
    return rows


def format_summary(reports: dict[str, dict]) -> str:
    return "\n".join(["== summary (b/a: median of the repeats' ratios)",
                      *_table(summary_rows(reports))])


# ---- the command line ------------------------------------------------------------------


def parse_models(text: str) -> list[str]:
    models = [m.strip() for m in text.split(",") if m.strip()]
    if not models:
        raise argparse.ArgumentTypeError(f"bad --models {text!r}: e.g. tiny,smollm2")
    return models


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=parse_models, default=["tiny", "smollm2"],
                   help="tiny, smollm2, an embedded model's name or a checkpoint dir; "
                        "comma-separated")
    p.add_argument("--scheduling", type=parse_modes, default=["async", "serial"],
                   help="async, serial (--no-async-scheduling) or both: async,serial")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each workload, interleaved")
    p.add_argument("--max-tokens", type=int, default=128,
                   help=f"the constrained requests' max_tokens (at least {LONGEST_TOKENS}, "
                        "the schema's longest output)")
    p.add_argument("--ttft-repeats", type=int, default=5,
                   help="unconstrained / first-seen / cached schema TTFT triples")
    p.add_argument("--quick", action="store_true", help="--repeats 1 --ttft-repeats 2")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--logs", action="store_true", help="show the daemons' logs")
    p.add_argument("--out", "--json", type=Path, help="write the results here (JSON)")
    p.add_argument("controlplane_args", nargs="*", help="after --: controlplane flags")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.ttft_repeats = 1, 2
    if args.repeats < 1 or args.ttft_repeats < 1:
        parser.error("--repeats and --ttft-repeats must be at least 1")
    if args.max_tokens < LONGEST_TOKENS:
        parser.error(f"--max-tokens {args.max_tokens} would cut the schema's longest output "
                     f"({LONGEST_TOKENS} tokens): the constrained requests must end by grammar")
    return args


def resolve(name: str, tmp: Path) -> str:
    if name == "tiny":
        from kvloom.testing.checkpoints import make_tiny_llama

        return str(make_tiny_llama(tmp / "tiny"))
    from kvloom.common.embedded_models import resolve_model

    return resolve_model("smollm2-135m" if name == "smollm2" else name)


def run(args) -> dict[str, dict]:
    reports: dict[str, dict] = {}
    tmp = Path(tempfile.mkdtemp(prefix="kvloom-structured-bench-"))
    try:
        for name in args.models:
            model = resolve(name, tmp)
            lengths = None  # calibrated on the first cluster, kept for the others
            for mode in args.scheduling:
                print(f"== {name} {mode}: starting", file=sys.stderr)
                result = run_cluster(model, mode == "serial", lengths, args)
                lengths = result["lengths"]
                reports[f"{name} {mode}"] = cluster_report(result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return reports


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        reports = run(args)
    except (KvloomError, launcher.ClusterError, RuntimeError) as exc:
        print(f"structured outputs benchmark: error: {exc}", file=sys.stderr)
        return 1
    for name, rep in reports.items():
        print(format_cluster(name, rep) + "\n")
    print(format_summary(reports))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        payload = {"command": " ".join(["python benchmarks/structured_outputs.py",
                                        *(sys.argv[1:] if argv is None else argv)]),
                   "config": json.loads(json.dumps(config, default=str)),
                   "cpus": os.cpu_count(), "schema": PERSON, "any_whitespace": False,
                   "wall_s": time.perf_counter() - started, "clusters": reports}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    failed = sum(m["failed"] for rep in reports.values() for m in rep["metrics"].values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
