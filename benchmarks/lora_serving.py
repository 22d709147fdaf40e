"""Multi-LoRA serving against the base model alone, same requests, same run.

    python benchmarks/lora_serving.py [--model DIR] --ranks 8,16,64 \\
        --num-adapters 8 --streams 8 --num-prompts 16 --prompt-tokens 64 \\
        --max-tokens 64 --rounds 2 --json out.json

Issue 46's figures. Per round two fresh clusters alternate: "base" (no
--enable-lora) runs the batch with no adapter, then "lora" (--enable-lora,
--max-loras = --num-adapters) loads --num-adapters random adapters of each
rank in --ranks (all seven linear layers of every decoder layer, written
here in PEFT's format from a fixed seed: their tokens are nonsense, their
cost is real) and runs the same batch again: once with no adapter named
("lora-off": what --enable-lora costs a base request) and once per rank with
request i naming adapter i mod --num-adapters of that rank ("r16" etc.: the
adapters spread over the requests, so every step runs all of them).

Reported: output tokens/s per config (the batch's output tokens over its
wall time; the median over the rounds) and its ratio to the same round's
base (the median of the per-round ratios), and the LoadLoRAAdapter time of
each adapter (every worker reads and hashes its files; median and max by
rank). Prefix caching is off, every request generates --max-tokens
(ignore_eos), greedy. The client runs beside the daemons: name the CPU (cpu
and isa in the JSON) beside any figure you quote.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
from benchmarks.arg_types import bounded  # noqa: E402
from kvloom.v1 import generation_pb2 as pb  # noqa: E402
from kvloom.v1 import generation_pb2_grpc  # noqa: E402
from kvloom_cli import launcher  # noqa: E402

MAX_ROUNDS = 20
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, config: dict, rank: int, seed: int, std: float = 0.02) -> None:
    """A PEFT LoRA adapter for a Llama-shaped config.json, every linear layer."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads",
                                                          config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
              "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS),
        "bias": "none", "use_dora": False, "use_rslora": False, "modules_to_save": None,
        "task_type": "CAUSAL_LM"}))


def build_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


async def run_batch(stub, prompts, loras: list[str], streams: int, max_tokens: int,
                    tag: str) -> dict:
    limit = asyncio.Semaphore(streams)

    async def one(i: int, prompt: list[int]) -> int:
        request = pb.GenerateRequest(
            request_id=f"{tag}-{i}", token_ids=pb.TokenIds(ids=prompt),
            lora_name=loras[i % len(loras)] if loras else "",
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                       ignore_eos=True))
        async with limit:
            return sum([len(m.token_ids) async for m in stub.Generate(request, timeout=1800)])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": sum(counts), "tok_s": sum(counts) / wall}


def controlplane_flags(args, config: str) -> tuple[str, ...]:
    flags = ("--dtype", args.dtype, "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
             "--no-enable-prefix-caching")
    if config == "lora":
        flags += ("--enable-lora", "--max-loras", str(args.num_adapters),
                  "--max-lora-rank", str(max(args.ranks)),
                  "--max-cpu-loras", str(args.num_adapters * len(args.ranks)),
                  "--allow-runtime-lora-updating")
    return flags


def run_cluster(args, config: str, round_no: int, prompts, adapters: dict) -> list[dict]:
    spec = launcher.ClusterSpec(model=args.model, worker_threads=args.worker_threads,
                                controlplane_args=controlplane_flags(args, config))
    sink = sys.stderr if args.logs else open(os.devnull, "w")  # noqa: SIM115
    cluster = launcher.Cluster(spec, log_sink=sink)
    print(f"== round {round_no} {config}: starting", file=sys.stderr)
    try:
        cluster.start()
        cluster.wait_ready(args.ready_timeout)
        return asyncio.run(_on_cluster(cluster, args, config, round_no, prompts, adapters))
    finally:
        cluster.stop()


async def _on_cluster(cluster, args, config, round_no, prompts, adapters) -> list[dict]:
    results = []
    async with grpc.aio.insecure_channel(cluster.api_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        batches = [("base", [])] if config == "base" else [("lora-off", [])]
        if config == "lora":
            for rank in args.ranks:
                names = []
                for name, path in adapters[rank]:
                    t0 = time.perf_counter()
                    await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=name,
                                                                         lora_path=str(path)))
                    results.append({"kind": "load", "round": round_no, "rank": rank,
                                    "seconds": time.perf_counter() - t0})
                    names.append(name)
                batches.append((f"r{rank}", names))
        await run_batch(stub, prompts[:1], batches[-1][1], 1, 8, f"warmup-{config}")
        for label, loras in batches:
            batch = await run_batch(stub, prompts, loras, args.streams, args.max_tokens,
                                    f"{label}-{round_no}")
            print(f"   {label}: {batch['tok_s']:.1f} tok/s", file=sys.stderr)
            results.append({"kind": "batch", "config": label, "round": round_no, **batch})
    return results


def summarize(results: list[dict]) -> tuple[list[dict], list[dict]]:
    batches = [r for r in results if r["kind"] == "batch"]
    base = {r["round"]: r["tok_s"] for r in batches if r["config"] == "base"}
    rows = []
    for config in dict.fromkeys(r["config"] for r in batches):
        mine = [r for r in batches if r["config"] == config]
        ratios = [r["tok_s"] / base[r["round"]] for r in mine if base.get(r["round"])]
        rows.append({"config": config, "tok_s": statistics.median(r["tok_s"] for r in mine),
                     "tok_s_by_round": [round(r["tok_s"], 2) for r in mine],
                     "vs_base": statistics.median(ratios) if ratios else None,
                     "vs_base_by_round": [round(x, 3) for x in ratios]})
    loads = []
    for rank in sorted({r["rank"] for r in results if r["kind"] == "load"}):
        times = [r["seconds"] for r in results if r["kind"] == "load" and r["rank"] == rank]
        loads.append({"rank": rank, "load_s_median": statistics.median(times),
                      "load_s_max": max(times), "loads": len(times)})
    return rows, loads


def format_table(rows: list[dict], loads: list[dict]) -> str:
    lines = [f"{'config':<10} {'tok/s':>9} {'vs base':>8}  by round"]
    for r in rows:
        ratio = f"{r['vs_base']:.3f}" if r["vs_base"] is not None else "-"
        lines.append(f"{r['config']:<10} {r['tok_s']:>9.1f} {ratio:>8}  {r['tok_s_by_round']}")
    lines.append("")
    lines.append(f"{'rank':<6} {'load s (median)':>16} {'max':>8}")
    for r in loads:
        lines.append(f"{r['rank']:<6} {r['load_s_median']:>16.3f} {r['load_s_max']:>8.3f}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(not 1 <= v <= 512 for v in values):
        raise argparse.ArgumentTypeError(f"comma-separated ranks in [1, 512], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir or an embedded model's name; default: "
                   "the embedded SmolLM2-135M-Instruct")
    p.add_argument("--ranks", type=_int_list, default=[8, 16, 64])
    p.add_argument("--num-adapters", type=bounded(1, 64), default=8,
                   help="adapters per rank, and --max-loras")
    p.add_argument("--streams", type=bounded(1, 256), default=8)
    p.add_argument("--num-prompts", type=bounded(1, 1024), default=16)
    p.add_argument("--prompt-tokens", type=bounded(1, 4096), default=64)
    p.add_argument("--max-tokens", type=bounded(1, 4096), default=64)
    p.add_argument("--rounds", type=bounded(1, MAX_ROUNDS), default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--worker-threads", type=bounded(1, 1024), default=1)
    p.add_argument("--kv-cache-memory-bytes", type=bounded(1 << 20, 1 << 40),
                   default=256 << 20)
    p.add_argument("--ready-timeout", type=bounded(1, 3600, float), default=600.0)
    p.add_argument("--seed", type=bounded(0, 2**31), default=0)
    p.add_argument("--logs", action="store_true", help="the daemons' logs to stderr")
    p.add_argument("--json", help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from kvloom.common.embedded_model_spec import EmbeddedModelError
    from kvloom.common.embedded_models import is_model_name, resolve_model

    try:
        args.model = resolve_model(args.model) if is_model_name(args.model) else args.model
    except EmbeddedModelError as exc:
        parser.error(str(exc))
    if not Path(args.model).is_dir():
        parser.error(f"--model {args.model}: no such checkpoint directory")
    from workerd.cpu_features import cpu_model_name, isa_summary

    config = json.loads((Path(args.model) / "config.json").read_text())
    prompts = build_prompts(config["vocab_size"], args.num_prompts, args.prompt_tokens,
                            args.seed)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        adapters = {rank: [(f"r{rank}-{i}", Path(tmp) / f"r{rank}-{i}")
                           for i in range(args.num_adapters)] for rank in args.ranks}
        for rank, entries in adapters.items():
            for i, (_, path) in enumerate(entries):
                write_adapter(path, config, rank, seed=args.seed * 1000 + rank * 64 + i)
        try:
            for round_no in range(1, args.rounds + 1):
                for cluster_config in ("base", "lora"):
                    results += run_cluster(args, cluster_config, round_no, prompts, adapters)
        except (launcher.ClusterError, grpc.RpcError, RuntimeError) as exc:
            print(f"lora_serving benchmark: error: {exc}", file=sys.stderr)
            return 1
    rows, loads = summarize(results)
    print(format_table(rows, loads))
    if args.json:
        payload = {"config": {k: v for k, v in vars(args).items() if k != "json"},
                   "isa": isa_summary(), "cpu": cpu_model_name(), "results": rows, "loads": loads,
                   "controlplane_flags": {c: list(controlplane_flags(args, c))
                                          for c in ("base", "lora")},
                   "raw": results}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
