"""`kvloom-controlplane` / `python -m controlplane`: flags -> frozen config -> serve.

The flags are the config dataclasses' fields (controlplane/config.py declares
each one's default, help and bounds). Every flag is also read from a KVLOOM_*
environment variable (e.g. --max-num-seqs from KVLOOM_MAX_NUM_SEQS).

A wrong value argparse cannot see (a model path that does not exist, a layout
the model cannot be split into, a port another process holds) ends start-up
with one line, "kvloom-controlplane: error: ...", and exit code 2; --check
stops after those checks without serving (`kvloom up` runs it before it
spawns any worker).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from controlplane.config import (
    ApiLimitsConfig,
    ApiSecurityConfig,
    CacheConfig,
    ControlPlaneConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    StructuredOutputConfig,
    WorkerGroupConfig,
)
from controlplane.model_info import ModelInfo, read_model_info
from kvloom.common.config_args import add_config_group, config_from_args
from kvloom.common.logs import setup_logging
from kvloom.common.ports import PortInUse, port_in_use
from kvloom.common.secret_files import read_token_file
from kvloom.envargs import EnvArgumentParser
from kvloom.helpformat import DefaultsHelpFormatter

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
    ("structured outputs", StructuredOutputConfig),
    ("client api security", ApiSecurityConfig),
    ("lora adapters", LoRAConfig),
)


def build_parser() -> argparse.ArgumentParser:
    p = EnvArgumentParser(
        prog="kvloom-controlplane",
        description=__doc__.splitlines()[0],
        formatter_class=DefaultsHelpFormatter,
    )
    groups = {title: add_config_group(p, cls, title) for title, cls in CONFIG_GROUPS}
    # Not config fields. --max-model-len is checked against the checkpoint and
    # becomes SchedulerConfig.max_model_len in build_config.
    groups["model"].add_argument(
        "--max-model-len", type=int, default=0,
        help="longest prompt + output; 0 = the model's max_position_embeddings")
    groups["lora adapters"].add_argument(
        "--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
        help="LoRA adapters loaded at start-up (PEFT directories as the workers see them); "
             "needs --enable-lora")
    p.add_argument("--log-level", default="INFO", help="logging level of the controlplane")
    p.add_argument("--cpu-cores", default="",
                   help="CPU cores every controlplane thread runs on, e.g. 1-3 (Linux); keep "
                        "them apart from the workers' --cpu-cores on a shared host; empty = "
                        "the OS places them")
    p.add_argument("--check", action="store_true",
                   help="check the model, the layout and the ports, then exit without serving")
    return p


def fail(message: str) -> NoReturn:
    """A start-up error argparse could not see: one line, no usage text, exit 2."""
    print(f"kvloom-controlplane: error: {message}", file=sys.stderr)
    sys.exit(2)


def pin_cpu_cores(spec: str) -> None:
    """--cpu-cores, before any thread starts (later ones inherit the set)."""
    from kvloom.common.cpu_cores import parse_cores, pin_process

    try:
        pin_process(parse_cores(spec, "--cpu-cores"))
    except ValueError as exc:
        fail(str(exc))


def build_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> tuple[ControlPlaneConfig, ModelInfo]:
    """parser: unused, kept for callers that pass it."""
    from kvloom.common.embedded_model_spec import EmbeddedModelError
    from kvloom.common.embedded_models import resolve_model

    try:
        # A path, or an embedded model's name (converted here on first use).
        model_path = resolve_model(args.model)
    except EmbeddedModelError as exc:
        fail(str(exc))
    try:
        info = read_model_info(model_path)
    except (OSError, ValueError, KeyError) as exc:
        fail(f"--model {model_path}: {exc}")
    kv_transfer = kv_transfer_config(args, info)
    served_name = args.served_model_name or os.path.basename(model_path.rstrip("/"))
    lora = lora_config(args, served_name)
    max_model_len = args.max_model_len or info.max_position_embeddings
    if not 0 < max_model_len <= info.max_position_embeddings:
        fail(f"--max-model-len {max_model_len} must be in 1..{info.max_position_embeddings}, "
                f"the model's max_position_embeddings")
    config = ControlPlaneConfig(
        model=config_from_args(
            ModelConfig, args,
            model=model_path,
            served_model_name=served_name,
            worker_model_path=args.worker_model_path or model_path,
            checkpoint_dtype=info.checkpoint_dtype,
        ),
        cache=config_from_args(CacheConfig, args,
                               sliding_window=info.sliding_window_all_layers),
        scheduler=config_from_args(SchedulerConfig, args, max_model_len=max_model_len,
                                   speculative=speculative_config(args, info, model_path),
                                   max_loras=lora.max_loras if lora.enable_lora else 0),
        parallel=config_from_args(ParallelConfig, args),
        workers=config_from_args(WorkerGroupConfig, args, auth_token=worker_auth_token(args)),
        server=config_from_args(ServerConfig, args),
        api_limits=config_from_args(ApiLimitsConfig, args),
        structured_output=config_from_args(StructuredOutputConfig, args),
        api_security=config_from_args(ApiSecurityConfig, args),
        kv_transfer=kv_transfer,
        lora=lora,
    )
    return config, info


def lora_config(args: argparse.Namespace, served_model_name: str) -> LoRAConfig:
    """The LoRA flags, --lora-modules parsed; a start-up error names the flag."""
    from controlplane.lora.names import parse_lora_modules

    if args.lora_modules and not args.enable_lora:
        fail("--lora-modules needs --enable-lora")
    if args.enable_lora and args.kv_transfer_config:
        fail("--enable-lora with --kv-transfer-config: a disaggregated consumer cannot know "
             "which adapter a producer's KV was computed with (not built yet)")
    if args.max_cpu_loras and args.max_cpu_loras < args.max_loras:
        fail(f"--max-cpu-loras {args.max_cpu_loras} must be at least --max-loras "
             f"{args.max_loras} (every adapter of a step must be loaded), or 0")
    from controlplane.api.lora_endpoints import parse_port_range

    try:
        parse_port_range(args.lora_engine_ports)
    except ValueError as exc:
        fail(str(exc))
    slots = args.max_cpu_loras or max(args.max_loras, len(args.lora_modules))
    try:
        modules = parse_lora_modules(args.lora_modules, served_model_name, slots)
    except ValueError as exc:
        fail(str(exc))
    return config_from_args(LoRAConfig, args, lora_modules=modules)


def speculative_config(args: argparse.Namespace, info: ModelInfo, model_path: str):
    """--speculative-config parsed, or a start-up error naming the key at fault
    (a draft model must share the target's vocabulary and tokenizer)."""
    from controlplane.spec_decode.config import DRAFT_MODEL, parse_speculative_config
    from controlplane.spec_decode.draft_check import draft_model_problem

    if not args.speculative_config:
        return None
    try:
        parsed = parse_speculative_config(args.speculative_config)
    except ValueError as exc:
        fail(str(exc))
    if parsed.method == DRAFT_MODEL:
        problem = draft_model_problem(parsed.model, model_path, info.vocab_size)
        if problem is not None:
            fail(f"--speculative-config: model {parsed.model!r}: {problem}")
    return parsed


def kv_transfer_config(args: argparse.Namespace, info: ModelInfo):
    """--kv-transfer-config parsed, or a start-up error naming the key at fault."""
    from controlplane.core.kv_transfer_config import parse_kv_transfer_config

    try:
        parsed = parse_kv_transfer_config(args.kv_transfer_config)
    except ValueError as exc:
        fail(str(exc))
    if parsed is None:
        return None
    if args.kv_offloading_size:
        fail("--kv-transfer-config with --kv-offloading-size: one KV connector at a time "
             "(vLLM's MultiConnector is not built)")
    if info.sliding_window_all_layers is not None:
        # Such a pool frees the blocks that left the window: a producer would
        # hand out placeholders (the host tier does not load them either).
        fail("--kv-transfer-config: a model whose every layer slides "
             f"(window {info.sliding_window_all_layers}) is not disaggregated")
    return parsed




def worker_auth_token(args: argparse.Namespace) -> str:
    """The workers' shared secret: --auth-token (KVLOOM_AUTH_TOKEN), or the
    stripped content of --auth-token-file, never both."""
    path = args.auth_token_file
    if not path:
        return args.auth_token
    if args.auth_token:
        fail("--auth-token-file and --auth-token (or KVLOOM_AUTH_TOKEN) both give the "
             "worker auth token: pass one")
    try:
        token = read_token_file(path)
    except ValueError as exc:
        fail(f"--auth-token-file {path}: {exc}")
    return token


def worker_tls_problem(config: ControlPlaneConfig) -> str | None:
    """A --worker-ssl-* file the worker port cannot serve with."""
    from controlplane.executor.worker_plane import WorkerTlsError, worker_server_credentials

    try:
        worker_server_credentials(config.workers)
    except WorkerTlsError as exc:
        return str(exc)
    return None


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


# AutoTokenizer needs one of these (fast, SentencePiece, or BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def missing_tokenizer(model_path: str) -> str | None:
    if any(os.path.isfile(os.path.join(model_path, name)) for name in TOKENIZER_FILES):
        return None
    return (f"--model {model_path}: no tokenizer ({', '.join(TOKENIZER_FILES)}); copy the "
            f"checkpoint's tokenizer files into that directory")


def busy_port(config: ControlPlaneConfig) -> PortInUse | None:
    """The first configured port another process holds (the bind re-checks)."""
    cfg = config.server
    for port, what in ((cfg.port, "--port, the API"), (cfg.worker_port, "--worker-port"),
                       (cfg.metrics_port, "--metrics-port")):
        if port and port_in_use(cfg.host, port):
            return PortInUse(port, what)
    return None


def api_keys(config: ControlPlaneConfig):
    """The client API's keys (--api-key-file, KVLOOM_API_KEY); None = no keys."""
    from controlplane.api.auth import ENV_VAR, ApiKeys, KeyFileError

    try:
        keys = ApiKeys(config.api_security.api_key_file, os.environ.get(ENV_VAR, ""))
    except KeyFileError as exc:
        fail(str(exc))
    return keys if len(keys) else None


def api_tls_problem(config: ControlPlaneConfig) -> str | None:
    from controlplane.api.tls import check_api_tls

    return check_api_tls(config.api_security)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cpu_cores:
        pin_cpu_cores(args.cpu_cores)
    setup_logging(args.log_level, "controlplane")
    config, info = build_config(args)
    problem = (missing_tokenizer(config.model.model) or check_layout(config, info)
               or worker_tls_problem(config) or api_tls_problem(config) or busy_port(config))
    if problem:
        fail(str(problem))
    keys = api_keys(config)
    if args.check:
        par = config.parallel
        print(f"kvloom-controlplane: {config.model.model}: TP={par.tensor_parallel_size} "
              f"PP={par.pipeline_parallel_size} and the ports are usable")
        return
    from controlplane.server import run
    from kvloom.common.gil import shorten_gil_switch_interval

    shorten_gil_switch_interval()
    try:
        run(config, info, api_keys=keys)
    except PortInUse as exc:  # taken between the check and the bind
        fail(str(exc))


if __name__ == "__main__":
    main()
