"""Prefill/decode disaggregation against one colocated cluster, same requests.

    python benchmarks/pd_disaggregation.py [--model DIR] --decoders 4 \\
        --decode-len 96 --long-prompts 6 --long-len 1024 --interval 1.0 \\
        --json out.json

Issue 44's figures. `--decoders` streams (short prompts, --decode-len
greedy tokens each) decode while `--long-prompts` prompts of --long-len
tokens arrive every --interval seconds (each then generates --long-max-tokens).
The decode streams' inter-token latency (the gaps between their streamed
tokens after the first) is what a long prefill disturbs. Three runs, each on
fresh clusters driven through the VllmEngine protocol (the SMG gateway's):

* idle: the decode streams alone on one cluster over every core;
* pd-idle: the decode streams alone through the pd pair below (their
  prefill legs on the producer, their decoding on the consumer's cores);
* colocated: the same cluster, with the long prompts arriving;
* pd: a producer cluster pinned to the first half of the cores and a
  consumer pinned to the other half, each long prompt and each decode
  stream sent as the gateway's two legs (a 1-token prefill on the producer
  with {"do_remote_decode": true}, then the decode leg on the consumer with
  the producer's parameters): the consumer reads the KV with NIXL.

Reported per run: the decode ITL median and p99, the long prompts' TTFT
(the first leg sent to the first token; median), and for pd the consumer's
read milliseconds per 1000 prompt tokens read (its
kvloom_kv_transfer_read_seconds over the tokens it read) and the prompt
tokens it computed itself (one per request when every read succeeded).
Then each run's p99 over idle's, and pd's over pd-idle's: what the arriving
prompts cost the decode streams on the same cores (issue 44's goal: pd
within 1.3x of idle decode).
The client runs beside the daemons: on a 2-core box its share is part of
every figure. Name the CPU (isa in the JSON) beside any figure you quote.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
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
from kvloom.common.cpu_cores import available_cores, pin_process  # noqa: E402
from kvloom_cli import launcher  # noqa: E402

PRODUCER = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
CONSUMER = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
KV_CACHE = ("--kv-cache-memory-bytes", str(512 << 20))


def _request(prompt, max_tokens, request_id, params=None) -> vpb.GenerateRequest:
    req = vpb.GenerateRequest(
        request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True), stream=True)
    if params is not None:
        req.kv_transfer_params_json = params
    return req


async def _stream(stub, request) -> tuple[list[float], str]:
    """Arrival times of each streamed chunk, and the complete's transfer
    parameters (a prefill leg's)."""
    times, params = [], ""
    async for msg in stub.Generate(request, timeout=600):
        if msg.HasField("chunk") and msg.chunk.token_ids:
            times.append(time.perf_counter())
        elif msg.HasField("complete"):
            params = msg.complete.kv_transfer_params_json
    return times, params


class Run:
    """One mode's clients: `decode` on one address, `prefill` (pd) on another."""

    def __init__(self, decode: str, prefill: str | None) -> None:
        self.decode_channel = grpc.aio.insecure_channel(decode)
        self.decode = vllm_engine_pb2_grpc.VllmEngineStub(self.decode_channel)
        self.prefill_channel = grpc.aio.insecure_channel(prefill) if prefill else None
        self.prefill = (vllm_engine_pb2_grpc.VllmEngineStub(self.prefill_channel)
                        if prefill else None)

    async def generate(self, prompt, max_tokens, request_id) -> tuple[float, list[float]]:
        """(send time, chunk arrival times) of one request, in two legs under pd."""
        start = time.perf_counter()
        params = None
        if self.prefill is not None:
            _, params = await _stream(self.prefill, _request(
                prompt, 1, request_id, json.dumps({"do_remote_decode": True})))
        times, _ = await _stream(self.decode, _request(prompt, max_tokens, request_id, params))
        return start, times

    async def close(self) -> None:
        await self.decode_channel.close()
        if self.prefill_channel is not None:
            await self.prefill_channel.close()


async def workload(run: Run, args, with_long: bool, vocab: int) -> dict:
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    decoders = [asyncio.ensure_future(run.generate(prompt(args.decoder_len), args.decode_len,
                                                   f"d{i}")) for i in range(args.decoders)]
    longs = []
    if with_long:
        await asyncio.sleep(args.warmup)  # the decode streams are running
        for i in range(args.long_prompts):
            longs.append(asyncio.ensure_future(run.generate(prompt(args.long_len),
                                                            args.long_max_tokens, f"l{i}")))
            await asyncio.sleep(args.interval)
    decoded = await asyncio.gather(*decoders)
    long_done = await asyncio.gather(*longs)
    gaps = [(b - a) * 1e3 for _, times in decoded for a, b in itertools.pairwise(times)]
    ttfts = [(times[0] - start) * 1e3 for start, times in long_done if times]
    return {"itl_ms_p50": _pct(gaps, 50), "itl_ms_p99": _pct(gaps, 99), "gaps": len(gaps),
            "long_ttft_ms_p50": statistics.median(ttfts) if ttfts else None}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _metric(cluster, name: str, label: str = "") -> float:
    text = urllib.request.urlopen(cluster.metrics_address, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line and not line.startswith("#"))


def _cluster(args, cores, extra: tuple[str, ...]) -> launcher.Cluster:
    """A TP=1 cluster whose processes run on `cores` (inherited affinity)."""
    pin_process(cores)
    spec = launcher.ClusterSpec(
        model=args.model, worker_threads=len(cores),
        controlplane_args=("--dtype", args.dtype, *KV_CACHE, *extra))
    sink = sys.stderr if args.logs else open(os.devnull, "w")  # noqa: SIM115
    cluster = launcher.Cluster(spec, log_sink=sink)
    cluster.start()
    cluster.wait_ready(args.ready_timeout)
    return cluster


def run_mode(mode: str, args, all_cores: list[int], vocab: int) -> dict:
    clusters = []
    try:
        if mode in ("pd", "pd-idle"):
            half = len(all_cores) // 2
            prod = _cluster(args, all_cores[:half], ("--kv-transfer-config", PRODUCER))
            clusters.append(prod)
            cons = _cluster(args, all_cores[half:], ("--kv-transfer-config", CONSUMER))
            clusters.append(cons)
            addresses = (cons.api_address, prod.api_address)
        else:
            colo = _cluster(args, all_cores, ())
            clusters.append(colo)
            addresses = (colo.api_address, None)
        pin_process(all_cores)

        async def go() -> dict:
            run = Run(*addresses)  # its channels belong to this loop
            try:
                return await workload(run, args, not mode.endswith("idle"), vocab)
            finally:
                await run.close()

        print(f"== {mode}: running", file=sys.stderr)
        result = {"mode": mode, **asyncio.run(go())}
        if mode in ("pd", "pd-idle"):
            read_s = _metric(cons, "kvloom_kv_transfer_read_seconds_total")
            read_tokens = _metric(cons, "kvloom_prompt_tokens_by_source_total",
                                  'source="external_kv_transfer"')
            result["read_ms_per_1k_tokens"] = read_s * 1e6 / read_tokens if read_tokens else None
            result["tokens_read"] = read_tokens
            result["tokens_computed_on_consumer"] = _metric(
                cons, "kvloom_prompt_tokens_by_source_total", 'source="local_compute"')
        return result
    finally:
        for cluster in clusters:
            cluster.stop()
        pin_process(all_cores)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'mode':<10} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'long TTFT ms':>12} "
             f"{'read ms/1k tok':>14} {'prompt tok computed on D':>24}"]
    for r in rows:
        read = r.get("read_ms_per_1k_tokens")
        ttft = r["long_ttft_ms_p50"]
        lines.append(f"{r['mode']:<10} {r['itl_ms_p50']:>10.1f} {r['itl_ms_p99']:>10.1f} "
                     f"{'-' if ttft is None else f'{ttft:.0f}':>12} "
                     f"{'-' if read is None else f'{read:.1f}':>14} "
                     f"{r.get('tokens_computed_on_consumer', '-'):>24}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir; default: the embedded SmolLM2-135M")
    p.add_argument("--decoders", type=bounded(1, 256), default=4)
    p.add_argument("--decoder-len", type=bounded(1, 4096), default=32,
                   help="prompt tokens of each decode stream")
    p.add_argument("--decode-len", type=bounded(2, 4096), default=96)
    p.add_argument("--long-prompts", type=bounded(1, 256), default=6)
    p.add_argument("--long-len", type=bounded(1, 8192), default=1024)
    p.add_argument("--long-max-tokens", type=bounded(1, 1024), default=4)
    p.add_argument("--interval", type=bounded(0.0, 60.0, float), default=1.0)
    p.add_argument("--warmup", type=bounded(0.0, 60.0, float), default=1.0,
                   help="seconds of decoding before the first long prompt")
    p.add_argument("--modes", default="idle,colocated,pd-idle,pd")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=bounded(1, 3600, float), default=600.0)
    p.add_argument("--logs", action="store_true", help="the daemons' logs to stderr")
    p.add_argument("--json", help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"idle", "colocated", "pd-idle", "pd"}:
        build_parser().error(f"--modes: choose from idle, colocated, pd-idle, pd; got "
                             f"{args.modes!r}")
    if args.model is None:
        from kvloom.common.default_model import default_model_dir

        args.model = str(default_model_dir())
    cores = sorted(available_cores())
    if {"pd", "pd-idle"} & set(modes) and len(cores) < 2:
        build_parser().error("--modes pd needs two cores (one per cluster)")
    from controlplane.model_info import read_model_info
    from workerd.cpu_features import isa_summary

    vocab = read_model_info(args.model).vocab_size
    rows = [run_mode(mode, args, cores, vocab) for mode in modes]
    by_mode = {r["mode"]: r for r in rows}
    ratios = {f"{r['mode']} / idle": r["itl_ms_p99"] / by_mode["idle"]["itl_ms_p99"]
              for r in rows if "idle" in by_mode and r["mode"] != "idle"}
    if "pd" in by_mode and "pd-idle" in by_mode:
        ratios["pd / pd-idle"] = by_mode["pd"]["itl_ms_p99"] / by_mode["pd-idle"]["itl_ms_p99"]
    print(format_table(rows))
    for what, ratio in ratios.items():
        print(f"decode ITL p99, {what}: {ratio:.2f}x")
    payload = {"config": {k: v for k, v in vars(args).items() if k != "json"},
               "isa": isa_summary(), "cores": cores, "results": rows,
               "p99_over_idle": ratios}
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
