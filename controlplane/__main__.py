"""`kvloom-controlplane` / `python -m controlplane`: flags -> frozen config -> serve.

Every flag is also read from a KVLOOM_* environment variable (e.g.
--max-num-seqs from KVLOOM_MAX_NUM_SEQS).
"""

from __future__ import annotations

import argparse
import logging
import os

from controlplane.config import (
    CacheConfig,
    ControlPlaneConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    WorkerGroupConfig,
)
from controlplane.model_info import ModelInfo, read_model_info
from kvloom.envargs import EnvArgumentParser
from kvloom.server.logs import setup_logging

logger = logging.getLogger("controlplane")


def build_parser() -> argparse.ArgumentParser:
    p = EnvArgumentParser(prog="kvloom-controlplane", description=__doc__.splitlines()[0])
    m = p.add_argument_group("model")
    m.add_argument("--model", default="", help="checkpoint dir; empty = the embedded default model")
    m.add_argument("--served-model-name", default="", help="name reported to clients")
    m.add_argument("--worker-model-path", default="",
                   help="the checkpoint path as the workers see it (default: --model)")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    m.add_argument("--max-model-len", type=int, default=0,
                   help="longest prompt+output; 0 = the model's max_position_embeddings")
    m.add_argument("--seed", type=int, default=0, help="seed of the workers' default generator")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    par.add_argument("--pp-layer-partition", default="",
                     help="comma-separated layers per pipeline stage, e.g. 16,14")
    c = p.add_argument_group("cache")
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    c.add_argument("--num-gpu-blocks-override", type=int, default=0)
    c.add_argument("--kv-cache-memory-bytes", type=int, default=0,
                   help="KV cache bytes per rank; 0 = derived from device memory")
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192)
    s.add_argument("--long-prefill-token-threshold", type=int, default=0)
    s.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=50051, help="client API port")
    srv.add_argument("--worker-port", type=int, default=50052, help="port workers dial")
    srv.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics; 0 = off")
    srv.add_argument("--auth-token", default="", help="shared secret workers must present")
    srv.add_argument("--max-waiting-requests", type=int, default=1024,
                     help="requests allowed to wait beyond --max-num-seqs before new ones "
                          "get RESOURCE_EXHAUSTED")
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish after SIGTERM")
    srv.add_argument("--max-message-bytes", type=int, default=64 * 1024 * 1024,
                     help="largest gRPC message accepted or sent")
    srv.add_argument("--step-timeout", type=float, default=60.0,
                     help="seconds before a step with no reply fails the worker group")
    srv.add_argument("--heartbeat-timeout", type=float, default=30.0)
    srv.add_argument("--startup-timeout", type=float, default=600.0)
    srv.add_argument("--log-level", default="INFO")
    return p


def _positive(p: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def build_config(args: argparse.Namespace, p: argparse.ArgumentParser):
    _positive(p, args, "tensor_parallel_size", "pipeline_parallel_size", "block_size",
              "max_num_seqs", "max_num_batched_tokens")
    model_path = args.model
    if not model_path:
        from kvloom.server.default_model import default_model_dir

        model_path = default_model_dir()
    try:
        info = read_model_info(model_path)
    except (OSError, ValueError, KeyError) as exc:
        p.error(f"--model {model_path!r}: {exc}")
    max_model_len = args.max_model_len or info.max_position_embeddings
    if max_model_len > info.max_position_embeddings:
        p.error(f"--max-model-len {max_model_len} exceeds the model's "
                f"max_position_embeddings {info.max_position_embeddings}")
    partition = tuple(int(x) for x in args.pp_layer_partition.split(",") if x.strip())
    config = ControlPlaneConfig(
        model=ModelConfig(
            model=model_path,
            served_model_name=args.served_model_name or os.path.basename(model_path.rstrip("/")),
            worker_model_path=args.worker_model_path or model_path,
            dtype=args.dtype,
            max_model_len=max_model_len,
            seed=args.seed,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            num_gpu_blocks_override=args.num_gpu_blocks_override or None,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            pp_layer_partition=partition,
        ),
        workers=WorkerGroupConfig(
            auth_token=args.auth_token,
            step_timeout_s=args.step_timeout,
            startup_timeout_s=args.startup_timeout,
            heartbeat_timeout_s=args.heartbeat_timeout,
        ),
        server=ServerConfig(
            host=args.host, port=args.port, worker_port=args.worker_port,
            metrics_port=args.metrics_port, max_message_bytes=args.max_message_bytes,
            max_waiting_requests=args.max_waiting_requests,
            drain_timeout_s=args.drain_timeout,
        ),
    )
    return config, info


def check_layout(config: ControlPlaneConfig, info: ModelInfo) -> str | None:
    """Refuse at start-up a parallel layout the model cannot be split into."""
    tp = config.parallel.tensor_parallel_size
    pp = config.parallel.pipeline_parallel_size
    heads, kv = info.num_attention_heads, info.num_key_value_heads
    if heads % tp:
        return f"--tensor-parallel-size {tp} does not divide the model's {heads} attention heads"
    if kv % tp and tp % kv:
        return (f"--tensor-parallel-size {tp} and the model's {kv} KV heads: one must divide "
                f"the other")
    if pp > info.num_hidden_layers:
        return (f"--pipeline-parallel-size {pp} exceeds the model's "
                f"{info.num_hidden_layers} layers")
    partition = config.parallel.pp_layer_partition
    if partition and (len(partition) != pp or sum(partition) != info.num_hidden_layers):
        return (f"--pp-layer-partition {partition} must have {pp} entries summing to "
                f"{info.num_hidden_layers}")
    return None


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, "controlplane")
    config, info = build_config(args, parser)
    problem = check_layout(config, info)
    if problem:
        parser.error(problem)
    from controlplane.server import run

    run(config, info)


if __name__ == "__main__":
    main()
