"""N-gram speculative decoding against plain decoding, same requests, same run.

    python benchmarks/spec_decode.py [--model DIR] --layouts 1x1,1x2 \\
        --workloads grounded,chat --streams 1,4 --max-tokens 160 --rounds 2 \\
        --num-speculative-tokens 4 --prompt-lookup-min 2 --prompt-lookup-max 5 \\
        --json out.json

Issue 45's figures: what `--speculative-config '{"method": "ngram", ...}'`
(drafts proposed by prompt lookup in the controlplane, verified by the
workers) does to output tokens/s. Two workloads of fixed prompts written
here, sent through the model's chat template, greedy:

* grounded: answers that repeat or edit the prompt (copy a paragraph,
  rename a variable in a function, extract sentences, fix typos): the answer's
  next tokens are often in the prompt already, where n-gram drafts can hit;
* chat: open-ended questions, whose answers the prompt seldom contains: the
  drafts there are mostly wasted verification work, unless the answer
  repeats itself (a small model's long greedy answers often loop, and the
  drafts catch the loop: read chat's acceptance length before taking its
  speedup for open chat's).

Every (layout, round) runs a fresh cluster without drafts ("base"), then a
fresh one with them ("spec"), so the two alternate within the run (--rounds
2: base, spec, base, spec per layout). On each cluster every workload runs at
every --streams value: all its prompts, at most that many at once (1: one
after another), after one untimed warm-up request. Prefix caching is off so
each batch does the same work whatever ran before it on the cluster.

Reported per (layout, workload, streams, config): output tokens/s (the
batch's output tokens over its wall time; the median over the rounds, each
round's beside it), the mean acceptance length (1 + accepted / drafts, from
the controlplane's kvloom_spec_decode_* counters over the batch: the tokens a
verifying step emits per request on average; 1.0 means no draft ever hit),
the draft acceptance rate (accepted / draft tokens, summed over the
requests' GenerateComplete spec_* fields) and, on the spec rows, the speedup:
the median over the rounds of spec tokens/s over the same round's base.
A speedup below 1 means verification cost more than the accepted drafts
saved. Greedy outputs with and without drafts should be identical token for
token; `outputs_equal` (and `mismatches`: round, prompt, first differing
position) report it, a correctness signal, not a failure of the run.

The client runs beside the daemons: on a 2-core box its share is part of
every figure. Name the CPU (cpu and isa in the JSON) beside any figure you
quote. A checkpoint without a chat template (the tests' tiny model) gets the
prompts as plain text (--raw-prompts forces that).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from benchmarks.arg_types import bounded  # noqa: E402
from kvloom.common.cpu_cores import available_cores  # noqa: E402
from kvloom_cli import launcher  # noqa: E402

CONFIGS = ("base", "spec")
MAX_ROUNDS = 20
SPEC_COUNTERS = ("kvloom_spec_decode_num_drafts_total",
                 "kvloom_spec_decode_num_draft_tokens_total",
                 "kvloom_spec_decode_num_accepted_tokens_total")
ISA_FLAGS = ("avx512_bf16", "avx512f", "avx2")
# How long the counters may lag the last GenerateComplete of a batch.
METRICS_SETTLE_S = 5.0

GROUNDED = [
    "Repeat the following paragraph exactly, word for word, with nothing added.\n\n"
    "The lighthouse on the northern cape was built from grey stone carried up the cliff "
    "by hand. Every evening the keeper climbed one hundred and twelve steps to light the "
    "lamp, and every morning he wrote the weather, the ships he had seen and the hours "
    "the lamp had burned into a thick green logbook. When the lamp was finally "
    "automated, the logbooks were sent to the town library, where they still fill three "
    "long shelves.",

    "Rewrite this Python function, renaming the variable x to count everywhere. Change "
    "nothing else.\n\n"
    "def tally_words(lines):\n"
    "    x = 0\n"
    "    for line in lines:\n"
    "        for word in line.split():\n"
    "            if word.isalpha():\n"
    "                x += 1\n"
    "    if x == 0:\n"
    "        print(\"no words found\")\n"
    "    return x\n",

    "Extract every sentence that mentions the river from this text. Copy each one "
    "exactly.\n\n"
    "The village sits at the bottom of a wide valley. In spring the river rises and "
    "covers the lower fields. Most families keep goats and a few chickens. The old mill "
    "was built where the river bends to the east. A market is held on the square every "
    "Saturday. Children are told never to swim in the river after heavy rain. The "
    "church bell rings at noon. Fishermen sell trout caught in the river at the market.",

    "Correct the spelling mistakes in the following text and write out the corrected "
    "text in full.\n\n"
    "Yesterday we went to the musem in the center of the citty. The first room was full "
    "of old maps and the secund room had paintings of ships. My brother liked the "
    "dinosour bones the most, but I prefered the small room with the clocks. We stayed "
    "untill the museum closed and then walked home along the canal.",

    "Rewrite the following email, replacing the name Maria with Elena everywhere. Keep "
    "every other word the same.\n\n"
    "Hi team,\n\n"
    "Maria will lead the planning meeting on Thursday at ten. Please send Maria your "
    "updates by Wednesday evening so she can prepare the agenda. If you cannot attend, "
    "tell Maria in advance and she will share the notes afterwards.\n\n"
    "Thanks,\nDaniel",

    "Add a docstring to this Python function. Keep the code itself exactly as it is.\n\n"
    "def average_temperature(readings):\n"
    "    valid = [r for r in readings if r is not None]\n"
    "    if not valid:\n"
    "        return None\n"
    "    total = sum(valid)\n"
    "    return total / len(valid)\n",
]

CHAT = [
    "Write a short story about a robot who learns to bake bread.",
    "Explain why the sky is blue.",
    "What are three good habits for staying focused while studying?",
    "Describe how a bicycle works to a ten-year-old.",
    "Write a poem about autumn in a small town.",
    "What is the difference between weather and climate?",
]

WORKLOADS = {"grounded": GROUNDED, "chat": CHAT}


def build_prompts(tokenizer, names: list[str], count: int | None,
                  raw: bool) -> tuple[dict[str, list[list[int]]], str]:
    """{workload: its first `count` prompts as token ids}, and how they were
    made: "chat" (the tokenizer's chat template, one user turn) or "raw"
    (the text tokenized as is: --raw-prompts, or no chat template)."""
    chat = not raw and bool(getattr(tokenizer, "chat_template", None))
    out = {}
    for name in names:
        prompts = []
        for text in WORKLOADS[name][:count]:
            if chat:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True,
                    tokenize=False)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(text)["input_ids"]
            prompts.append(list(ids))
        out[name] = prompts
    return out, "chat" if chat else "raw"


def _request(prompt: list[int], args, request_id: str, max_tokens: int,
             seed: int = 0) -> vpb.GenerateRequest:
    params = vpb.SamplingParams(temperature=args.temperature, max_tokens=max_tokens,
                                ignore_eos=args.ignore_eos)
    if args.temperature > 0:
        params.seed = seed
    return vpb.GenerateRequest(request_id=request_id,
                               tokenized=vpb.TokenizedInput(input_ids=prompt),
                               sampling_params=params, stream=True)


async def _generate(stub, request) -> dict:
    """One streamed request: its output ids (from the chunks; a streamed
    complete repeats the last chunk's) and its GenerateComplete fields."""
    ids: list[int] = []
    done = None
    async for msg in stub.Generate(request, timeout=1800):
        if msg.HasField("chunk"):
            ids.extend(msg.chunk.token_ids)
        elif msg.HasField("complete"):
            done = msg.complete
    if done is None:
        raise RuntimeError(f"{request.request_id}: the stream ended without a complete")
    return {"ids": ids, "finish_reason": done.finish_reason,
            "completion_tokens": done.completion_tokens,
            "draft_tokens": done.spec_draft_tokens, "accepted_tokens": done.spec_accepted_tokens}


async def run_batch(stub, prompts: list[list[int]], streams: int, args, tag: str) -> dict:
    """Every prompt, at most `streams` at once; wall time of the whole batch."""
    limit = asyncio.Semaphore(streams)

    async def one(i: int, prompt: list[int]) -> dict:
        async with limit:
            return await _generate(stub, _request(prompt, args, f"{tag}-{i}", args.max_tokens,
                                                  seed=1000 + i))

    start = time.perf_counter()
    outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    tokens = sum(len(o["ids"]) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
            "draft_tokens": sum(o["draft_tokens"] for o in outs),
            "accepted_tokens": sum(o["accepted_tokens"] for o in outs),
            "finish_reasons": [o["finish_reason"] for o in outs],
            "outputs": [o["ids"] for o in outs]}


def spec_counters(metrics_url: str) -> dict[str, float]:
    """The controlplane's kvloom_spec_decode_* counters (0 when absent)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base in values:
            values[base] += float(value)
    return values


def counters_over(metrics_url: str, before: dict[str, float], draft_tokens: int) -> dict:
    """The counters' growth since `before`, once they have caught up with
    the `draft_tokens` the batch's completes reported (or METRICS_SETTLE_S)."""
    deadline = time.monotonic() + METRICS_SETTLE_S
    while True:
        now = spec_counters(metrics_url)
        delta = {k: now[k] - before[k] for k in SPEC_COUNTERS}
        if (delta["kvloom_spec_decode_num_draft_tokens_total"] >= draft_tokens
                or time.monotonic() > deadline):
            return {"drafts": int(delta["kvloom_spec_decode_num_drafts_total"]),
                    "metric_draft_tokens": int(delta["kvloom_spec_decode_num_draft_tokens_total"]),
                    "metric_accepted_tokens":
                        int(delta["kvloom_spec_decode_num_accepted_tokens_total"])}
        time.sleep(0.05)


def speculative_config(args) -> dict:
    return {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max}


def controlplane_flags(args, config: str) -> tuple[str, ...]:
    flags = ("--dtype", args.dtype, "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
             "--no-enable-prefix-caching")
    if config == "spec":
        flags += ("--speculative-config", json.dumps(speculative_config(args)))
    return flags


def run_cluster(args, layout: tuple[int, int], config: str, round_no: int,
                prompts: dict[str, list[list[int]]]) -> list[dict]:
    """A fresh cluster of `config`: every workload at every --streams value.
    One result per batch."""
    tp, pp = layout
    spec = launcher.ClusterSpec(
        model=args.model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        worker_threads=args.worker_threads, controlplane_args=controlplane_flags(args, config))
    sink = sys.stderr if args.logs else open(os.devnull, "w")  # noqa: SIM115
    cluster = launcher.Cluster(spec, log_sink=sink)
    print(f"== {tp}x{pp} round {round_no} {config}: starting", file=sys.stderr)
    try:
        cluster.start()
        cluster.wait_ready(args.ready_timeout)

        async def go() -> list[dict]:
            channel = grpc.aio.insecure_channel(cluster.api_address)
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            results = []
            try:
                first = prompts[args.workloads[0]][0]
                await _generate(stub, _request(first, args, f"warmup-{config}", 8))
                for workload in args.workloads:
                    for streams in args.streams:
                        before = spec_counters(cluster.metrics_address)
                        tag = f"{config}-r{round_no}-{workload}-s{streams}"
                        batch = await run_batch(stub, prompts[workload], streams, args, tag)
                        batch.update(counters_over(cluster.metrics_address, before,
                                                   batch["draft_tokens"]))
                        print(f"   {workload} streams={streams}: {batch['tok_s']:.1f} tok/s",
                              file=sys.stderr)
                        results.append({"layout": f"{tp}x{pp}", "workload": workload,
                                        "streams": streams, "config": config,
                                        "round": round_no, **batch})
            finally:
                await channel.close()
            return results

        return asyncio.run(go())
    finally:
        cluster.stop()


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def summarize(batches: list[dict], greedy: bool = True) -> list[dict]:
    """One row per (layout, workload, streams, config), rounds folded in;
    the spec rows carry the speedup over base, both rows (greedy) the
    comparison of their outputs."""
    groups: dict[tuple, list[dict]] = {}
    for b in batches:
        groups.setdefault((b["layout"], b["workload"], b["streams"], b["config"]), []).append(b)
    rows = []
    for (layout, workload, streams, config), runs in groups.items():
        runs.sort(key=lambda b: b["round"])
        drafts = sum(b["drafts"] for b in runs)
        accepted_m = sum(b["metric_accepted_tokens"] for b in runs)
        draft_tokens = sum(b["draft_tokens"] for b in runs)
        accepted = sum(b["accepted_tokens"] for b in runs)
        rows.append({
            "layout": layout, "workload": workload, "streams": streams, "config": config,
            "tok_s": statistics.median(b["tok_s"] for b in runs),
            "tok_s_by_round": [b["tok_s"] for b in runs],
            "output_tokens_by_round": [b["output_tokens"] for b in runs],
            "wall_s_by_round": [b["wall_s"] for b in runs],
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "metric_draft_tokens": sum(b["metric_draft_tokens"] for b in runs),
            "metric_accepted_tokens": accepted_m,
            "mean_acceptance_length": 1 + accepted_m / drafts if drafts else None,
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "finish_reasons": sorted({r for b in runs for r in b["finish_reasons"]}),
        })
    by_key = {(r["layout"], r["workload"], r["streams"], r["config"]): r for r in rows}
    for row in rows:
        key = (row["layout"], row["workload"], row["streams"])
        base, spec = by_key.get((*key, "base")), by_key.get((*key, "spec"))
        if base is None or spec is None:
            row["speedup"] = None
            row["outputs_equal"] = None
            continue
        if row is base:
            row["speedup"] = 1.0
        else:
            ratios = [s / b for s, b in zip(spec["tok_s_by_round"], base["tok_s_by_round"],
                                            strict=False)]
            row["speedup_by_round"] = ratios
            row["speedup"] = statistics.median(ratios)
        mismatches = []
        base_runs = {b["round"]: b for b in groups[(*key, "base")]}
        for s in groups[(*key, "spec")]:
            b = base_runs.get(s["round"])
            if b is None:
                continue
            for i, (x, y) in enumerate(zip(b["outputs"], s["outputs"], strict=True)):
                if x != y:
                    mismatches.append({"round": s["round"], "prompt": i,
                                       "first_difference": _first_difference(x, y),
                                       "base_tokens": len(x), "spec_tokens": len(y)})
        row["outputs_equal"] = not mismatches if greedy else None
        if row is spec:
            row["mismatches"] = mismatches
    return rows


def sample_outputs(batches: list[dict], tokenizer) -> dict[str, list[str]]:
    """{workload: the decoded answers of its first base batch}."""
    out: dict[str, list[str]] = {}
    for b in batches:
        if b["config"] == "base" and b["workload"] not in out:
            out[b["workload"]] = [tokenizer.decode(ids, skip_special_tokens=True)
                                  for ids in b["outputs"]]
    return out


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'layout':<6} {'workload':<9} {'streams':>7} {'config':<6} {'tok/s':>7} "
             f"{'by round':<17} {'accept len':>10} {'accept %':>8} {'speedup':>7} "
             f"{'equal':>5}"]
    for r in rows:
        rounds = ",".join(f"{v:.1f}" for v in r["tok_s_by_round"])
        rate = r["draft_acceptance_rate"]
        lines.append(
            f"{r['layout']:<6} {r['workload']:<9} {r['streams']:>7} {r['config']:<6} "
            f"{r['tok_s']:>7.1f} {rounds:<17} {_cell(r['mean_acceptance_length'], '.2f'):>10} "
            f"{_cell(None if rate is None else 100 * rate, '.0f'):>8} "
            f"{_cell(r['speedup'], '.2f'):>7} "
            f"{'-' if r['outputs_equal'] is None else str(r['outputs_equal']).lower():>5}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4, got {text!r}") from None
    if not values or any(not 1 <= v <= 256 for v in values):
        raise argparse.ArgumentTypeError(f"each must be in [1, 256], got {text!r}")
    return values


def _workloads(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or set(names) - set(WORKLOADS):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(WORKLOADS)}; got {text!r}")
    return names


def _layouts(text: str) -> list[tuple[int, int]]:
    """ "1x1,1x2" -> [(tp, pp), ...]."""
    layouts = []
    for item in text.split(","):
        tp, _, pp = item.strip().lower().partition("x")
        if not (tp.isdigit() and pp.isdigit()) or not (1 <= int(tp) <= 64 and 1 <= int(pp) <= 64):
            raise argparse.ArgumentTypeError(f"bad layout {item!r}: expected TPxPP like 1x2")
        layouts.append((int(tp), int(pp)))
    return layouts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir or an embedded model's name; default: "
                   "the embedded SmolLM2-135M-Instruct")
    p.add_argument("--layouts", type=_layouts, default=[(1, 1), (1, 2)],
                   help="TPxPP, comma-separated (default 1x1,1x2)")
    p.add_argument("--workloads", type=_workloads, default=list(WORKLOADS),
                   help="grounded, chat or both (default grounded,chat)")
    p.add_argument("--streams", type=_int_list, default=[1, 4],
                   help="concurrent requests, comma-separated (default 1,4)")
    p.add_argument("--num-prompts", type=bounded(1, 64), default=None,
                   help="the first N prompts of each workload (default: all)")
    p.add_argument("--max-tokens", type=bounded(1, 4096), default=160)
    p.add_argument("--temperature", type=bounded(0, 2, float), default=0.0,
                   help="sample (seeded per prompt) instead of greedy: drafts are then "
                        "accepted with the target's probability, and the outputs with and "
                        "without drafts differ (same distribution), so outputs_equal is "
                        "not checked")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request generates --max-tokens (default: stop at EOS)")
    p.add_argument("--rounds", type=bounded(1, MAX_ROUNDS), default=2,
                   help="base and spec clusters alternate this many times per layout")
    p.add_argument("--num-speculative-tokens", type=bounded(1, 16), default=4)
    p.add_argument("--prompt-lookup-min", type=bounded(1, 32), default=2)
    p.add_argument("--prompt-lookup-max", type=bounded(1, 32), default=5)
    p.add_argument("--raw-prompts", action="store_true",
                   help="tokenize the prompts as plain text, without the chat template")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--worker-threads", type=bounded(1, 1024), default=1,
                   help="torch threads per worker (default 1)")
    p.add_argument("--kv-cache-memory-bytes", type=bounded(1 << 20, 1 << 40),
                   default=256 << 20)
    p.add_argument("--ready-timeout", type=bounded(1, 3600, float), default=600.0)
    p.add_argument("--logs", action="store_true", help="the daemons' logs to stderr")
    p.add_argument("--json", help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt_lookup_min > args.prompt_lookup_max:
        parser.error(f"--prompt-lookup-min ({args.prompt_lookup_min}) must be at most "
                     f"--prompt-lookup-max ({args.prompt_lookup_max})")
    from kvloom.common.embedded_model_spec import EmbeddedModelError
    from kvloom.common.embedded_models import is_model_name, resolve_model

    try:  # a name is converted once, before any cluster starts
        args.model = resolve_model(args.model) if is_model_name(args.model) else args.model
    except EmbeddedModelError as exc:
        parser.error(str(exc))
    if not Path(args.model).is_dir():
        parser.error(f"--model {args.model}: no such checkpoint directory")
    from transformers import AutoTokenizer

    from workerd.cpu_features import cpu_flags, cpu_model_name, isa_summary

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts, prompt_format = build_prompts(tokenizer, args.workloads, args.num_prompts,
                                           args.raw_prompts)
    batches: list[dict] = []
    try:
        for layout in args.layouts:
            for round_no in range(1, args.rounds + 1):
                for config in CONFIGS:
                    batches += run_cluster(args, layout, config, round_no, prompts)
    except (launcher.ClusterError, grpc.RpcError, RuntimeError) as exc:
        print(f"spec_decode benchmark: error: {exc}", file=sys.stderr)
        return 1
    rows = summarize(batches, greedy=args.temperature == 0)
    print(format_table(rows))
    slower = [r for r in rows if r["config"] == "spec" and r["speedup"] is not None
              and r["speedup"] < 1]
    for r in slower:
        print(f"spec slower than base: {r['layout']} {r['workload']} streams={r['streams']} "
              f"({r['speedup']:.2f}x, mean acceptance length "
              f"{_cell(r['mean_acceptance_length'], '.2f')})")
    mismatched = [r for r in rows if r["outputs_equal"] is False and r["config"] == "spec"]
    for r in mismatched:
        print(f"outputs differ with drafts: {r['layout']} {r['workload']} "
              f"streams={r['streams']}: {len(r['mismatches'])} request(s)")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        config["layouts"] = [f"{tp}x{pp}" for tp, pp in args.layouts]
        payload = {
            "config": config, "cpu": cpu_model_name(), "isa": isa_summary(),
            "cpu_flags": [f for f in ISA_FLAGS if f in cpu_flags()],
            "cores": sorted(available_cores()), "prompt_format": prompt_format,
            "prompt_tokens": {w: [len(p) for p in ps] for w, ps in prompts.items()},
            "speculative_config": speculative_config(args),
            "controlplane_flags": {c: list(controlplane_flags(args, c)) for c in CONFIGS},
            "clusters": "fresh per (layout, round, config); per layout: " + ", ".join(
                f"{c} (round {r})" for r in range(1, args.rounds + 1) for c in CONFIGS),
            "outputs_equal": all(r["outputs_equal"] is not False for r in rows),
            "results": rows,
            # What the model answered: the first base batch of each workload.
            "sample_outputs": sample_outputs(batches, tokenizer),
            "batches": [{k: v for k, v in b.items() if k != "outputs"} for b in batches],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
