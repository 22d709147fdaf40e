"""Structured outputs: the step with 16 constrained requests beside 16 unconstrained ones.

    python benchmarks/structured_outputs.py --out structured.json
    python benchmarks/structured_outputs.py --models tiny --repeats 6
    python benchmarks/structured_outputs.py --quick

For each model of --models (`tiny`: the tests' seeded random Llama, built
by kvloom_testing.checkpoints.make_tiny_llama into a temporary dir;
`smollm2`: the embedded SmolLM2-135M; or a checkpoint dir / embedded name)
and each mode of --scheduling (async, the default, and serial:
--no-async-scheduling), one local cluster (kvloom_cli.launcher, TP=1, free
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

from benchmarks.serving import (  # noqa: E402
    RequestRecord,
    parse_modes,
)
from benchmarks.structured_report import (  # noqa: E402
    PERSON,
    WORKLOADS,
    Probe,
    cluster_report,
    delta,
    format_cluster,
    format_summary,
)
from kvloom.client import AsyncKvloomClient, KvloomError  # noqa: E402
from kvloom_cli import launcher  # noqa: E402

NUM_CONSTRAINED = 16
NUM_UNCONSTRAINED = 16
REQUEST_TIMEOUT_S = 600.0
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


def renamed_schema(n: int) -> dict:
    """PERSON with its `name` property called name_<n>: a schema never seen before."""
    props = dict(PERSON["properties"])
    props[f"name_{n}"] = props.pop("name")
    required = [f"name_{n}" if k == "name" else k for k in PERSON["required"]]
    return {**PERSON, "properties": props, "required": required}


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
        from kvloom_testing.checkpoints import make_tiny_llama

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
