"""`kvloom-controlplane` / `python -m controlplane`: flags -> frozen config -> serve.

The flags are the config dataclasses' fields (controlplane/config.py declares
each one's default, help and bounds). Every flag is also read from a KVLOOM_*
environment variable (e.g. --max-num-seqs from KVLOOM_MAX_NUM_SEQS).
"""

from __future__ import annotations

import argparse
import logging
import os

from controlplane.config import (
    ApiLimitsConfig,
    CacheConfig,
    ControlPlaneConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    WorkerGroupConfig,
)
from controlplane.config_args import add_config_group, config_from_args
from controlplane.model_info import ModelInfo, read_model_info
from kvloom.envargs import EnvArgumentParser
from kvloom.server.logs import setup_logging

logger = logging.getLogger("controlplane")


# Argument groups in --help order; their option() fields are the flags.
CONFIG_GROUPS = (
    ("model", ModelConfig),
    ("parallelism", ParallelConfig),
    ("cache", CacheConfig),
    ("scheduler", SchedulerConfig),
    ("worker group", WorkerGroupConfig),
    ("server", ServerConfig),
    ("api limits", ApiLimitsConfig),
)


def build_parser() -> argparse.ArgumentParser:
    p = EnvArgumentParser(
        prog="kvloom-controlplane",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    groups = {title: add_config_group(p, cls, title) for title, cls in CONFIG_GROUPS}
    # Not config fields. --max-model-len is checked against the checkpoint and
    # becomes SchedulerConfig.max_model_len in build_config.
    groups["model"].add_argument(
        "--max-model-len", type=int, default=0,
        help="longest prompt + output; 0 = the model's max_position_embeddings")
    p.add_argument("--log-level", default="INFO", help="logging level of the controlplane")
    return p


def build_config(
    args: argparse.Namespace, p: argparse.ArgumentParser
) -> tuple[ControlPlaneConfig, ModelInfo]:
    model_path = args.model
    if not model_path:
        from kvloom.server.default_model import default_model_dir

        model_path = default_model_dir()
    try:
        info = read_model_info(model_path)
    except (OSError, ValueError, KeyError) as exc:
        p.error(f"--model {model_path!r}: {exc}")
    max_model_len = args.max_model_len or info.max_position_embeddings
    if not 0 < max_model_len <= info.max_position_embeddings:
        p.error(f"--max-model-len {max_model_len} must be in 1..{info.max_position_embeddings}, "
                f"the model's max_position_embeddings")
    config = ControlPlaneConfig(
        model=config_from_args(
            ModelConfig, args,
            model=model_path,
            served_model_name=args.served_model_name or os.path.basename(model_path.rstrip("/")),
            worker_model_path=args.worker_model_path or model_path,
        ),
        cache=config_from_args(CacheConfig, args),
        scheduler=config_from_args(SchedulerConfig, args, max_model_len=max_model_len),
        parallel=config_from_args(ParallelConfig, args),
        workers=config_from_args(WorkerGroupConfig, args),
        server=config_from_args(ServerConfig, args),
        api_limits=config_from_args(ApiLimitsConfig, args),
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
