"""The `kvloom` command: talk to a running cluster, or launch one locally.

    kvloom generate "prompt"      stream a raw completion from --server
    kvloom chat "message"         the same with the model's chat template applied
    kvloom info | health          describe / probe the server
    kvloom up [--detach]          start controlplane + T*P workers here (kvloom.launcher)
    kvloom down                   stop a cluster started with `up --detach`
    kvloom run "prompt"           up, chat once, down: the one-command demo

This module only parses arguments and prints; process management lives in
kvloom.launcher and the RPCs in kvloom.client. Generated text goes to stdout,
everything else (daemon logs, progress, errors) to stderr, so output pipes cleanly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from kvloom import launcher
from kvloom.client import (
    READY_SERVICE,
    Finish,
    GenerateChunk,
    KvloomClient,
    KvloomError,
    default_server,
)
from kvloom.envargs import EnvArgumentParser

EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = EnvArgumentParser(prog="kvloom", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="stream a completion of a raw prompt")
    gen.add_argument("prompt")
    _add_server_arg(gen)
    _add_sampling_args(gen)

    chat = sub.add_parser("chat", help="send one chat message (chat template applied)")
    chat.add_argument("message")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--model", help="model dir whose tokenizer/chat template to use")
    _add_server_arg(chat)
    _add_sampling_args(chat)

    info = sub.add_parser("info", help="show the served model and cluster layout")
    _add_server_arg(info)

    health = sub.add_parser("health", help="grpc health check; exit 0 when SERVING")
    health.add_argument("--service", default=None, help=f"default: both '' and {READY_SERVICE}")
    _add_server_arg(health)

    up = sub.add_parser("up", help="start a local cluster (extra args go to the controlplane)")
    _add_cluster_args(up, default_pp=1)
    up.add_argument("--detach", action="store_true", help="start in the background and return")
    up.add_argument("--state-file", type=Path, default=None, help="where pids/ports are kept")

    down = sub.add_parser("down", help="stop a cluster started with `kvloom up --detach`")
    down.add_argument("--state-file", type=Path, default=None)
    down.add_argument("--grace", type=float, default=10.0, help="seconds before SIGKILL")

    run = sub.add_parser("run", help="start a local cluster, chat once, stop it")
    run.add_argument("message")
    run.add_argument("--system", help="system prompt")
    run.add_argument("--logs", action="store_true", help="show the daemons' logs")
    _add_cluster_args(run, default_pp=2)
    _add_sampling_args(run)
    return parser


def _add_server_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=default_server(), help="controlplane HOST:PORT")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the request")
    parser.add_argument("-v", "--verbose", action="store_true", help="print token counts")


def _add_cluster_args(parser: argparse.ArgumentParser, default_pp: int) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir; default: SmolLM2-135M")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "--pp", type=int, default=default_pp)
    parser.add_argument("--host", default="127.0.0.1", help="address the API binds to")
    parser.add_argument("--port", type=int, default=0, help="client API port; 0 = free port")
    parser.add_argument("--worker-port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--worker-threads", type=int, default=None, help="torch threads/rank")
    parser.add_argument("--ready-timeout", type=float, default=600.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse argv; for `up` and `run`, unknown options are forwarded to the controlplane."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if extra and args.command not in ("up", "run"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.controlplane_args = tuple(extra)
    return args


def cluster_spec(args: argparse.Namespace) -> launcher.ClusterSpec:
    return launcher.ClusterSpec(
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        host=args.host,
        port=args.port,
        worker_port=args.worker_port,
        metrics_port=args.metrics_port,
        worker_threads=args.worker_threads,
        controlplane_args=args.controlplane_args,
    )


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "timeout": args.timeout,
    }


def print_stream(chunks: Iterable[GenerateChunk], out=None) -> Finish | None:
    """Write each chunk's text as it arrives; returns the finish info."""
    out = out if out is not None else sys.stdout
    finish = None
    for chunk in chunks:
        out.write(chunk.text)
        out.flush()
        finish = chunk.finish or finish
    out.write("\n")
    out.flush()
    return finish


def format_finish(finish: Finish | None, seconds: float) -> str:
    if finish is None:
        return "[no finish info]"
    rate = finish.output_tokens / seconds if seconds > 0 else 0.0
    return (
        f"[{finish.reason}: {finish.prompt_tokens} prompt + {finish.output_tokens} output "
        f"tokens in {seconds:.2f}s, {rate:.1f} tok/s]"
    )


def complete(client: KvloomClient, prompt: str | list[int], args: argparse.Namespace) -> int:
    """Generate, print, and report; shared by generate, chat and run."""
    started = time.monotonic()
    if args.stream:
        finish = print_stream(client.generate(prompt, **sampling_kwargs(args)))
    else:
        result = client.generate_text(prompt, **sampling_kwargs(args))
        print(result.text)
        finish = result.finish
    if args.verbose or (finish is not None and finish.reason in ("abort", "error")):
        print(format_finish(finish, time.monotonic() - started), file=sys.stderr)
    return 0 if finish is None or finish.reason not in ("abort", "error") else EXIT_FAILURE


def chat_prompt(model_dir: str, message: str, system: str | None = None) -> list[int]:
    """Token ids of the chat-templated conversation, ending with the assistant's turn.

    Ids rather than templated text: the server would re-tokenize text, and
    whether it then adds a BOS or splits special tokens is the model's business.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": message})
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def chat_model_dir(args: argparse.Namespace, client: KvloomClient) -> str:
    """The tokenizer source: --model, else the server's model dir if visible here."""
    if args.model:
        return args.model
    served = client.model_info().model_path
    if served and Path(served, "config.json").is_file():
        return served
    from kvloom.default_model import default_model_dir

    return default_model_dir()


def cmd_generate(args: argparse.Namespace) -> int:
    with KvloomClient(args.server) as client:
        return complete(client, args.prompt, args)


def cmd_chat(args: argparse.Namespace) -> int:
    with KvloomClient(args.server) as client:
        ids = chat_prompt(chat_model_dir(args, client), args.message, args.system)
        return complete(client, ids, args)


def cmd_info(args: argparse.Namespace) -> int:
    with KvloomClient(args.server) as client:
        model, server = client.model_info(), client.server_info()
    print(f"server           {args.server}")
    for name, value in {**vars(model), **vars(server)}.items():
        print(f"{name:<24} {value}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    services = [args.service] if args.service is not None else ["", READY_SERVICE]
    healthy = True
    with KvloomClient(args.server) as client:
        for service in services:
            status = client.health(service)
            healthy = healthy and status == "SERVING"
            print(f"{service or '(server)':<24} {status}")
    return 0 if healthy else EXIT_FAILURE


def cmd_up(args: argparse.Namespace) -> int:
    state_file = args.state_file or launcher.default_state_file()
    refuse_if_running(state_file)
    log_dir = state_file.parent / "logs" if args.detach else None
    cluster = launcher.Cluster(cluster_spec_for_launch(args), log_dir=log_dir)
    start_and_wait(cluster, args.ready_timeout)
    if not args.detach:
        return serve_foreground(cluster, state_file)
    cluster.state().save(state_file)
    print_endpoints(cluster)
    print(f"kvloom: logs in {log_dir}; stop with `kvloom down`", file=sys.stderr)
    return 0


def serve_foreground(cluster: launcher.Cluster, state_file: Path) -> int:
    """Run until Ctrl-C/SIGTERM (exit 0) or until a daemon dies (ClusterError)."""
    try:
        cluster.state().save(state_file)  # lets `kvloom down` stop us from elsewhere
        print_endpoints(cluster)
        print("kvloom: press Ctrl-C to stop", file=sys.stderr)
        cluster.monitor()
    except (KeyboardInterrupt, launcher.Terminated):
        print("kvloom: stopping", file=sys.stderr)
        return 0  # the normal way to end `up`
    finally:
        cluster.stop()
        state_file.unlink(missing_ok=True)
    return EXIT_FAILURE  # unreachable: monitor() only returns by raising


def print_endpoints(cluster: launcher.Cluster) -> None:
    print(f"kvloom: API (gRPC) at {cluster.api_address}", file=sys.stderr)
    print(f"kvloom: metrics at {cluster.metrics_address}", file=sys.stderr)


def refuse_if_running(state_file: Path) -> None:
    if not state_file.exists():
        return
    state = launcher.ClusterState.load(state_file)
    if launcher.running_processes(state):
        raise launcher.ClusterError(
            f"a cluster is already running (API {state.api}, state {state_file}); "
            "stop it with `kvloom down` or pass another --state-file"
        )


def cmd_down(args: argparse.Namespace) -> int:
    state_file = args.state_file or launcher.default_state_file()
    if not state_file.exists():
        print(f"kvloom: no cluster recorded in {state_file}", file=sys.stderr)
        return EXIT_FAILURE
    state = launcher.ClusterState.load(state_file)
    killed = launcher.stop_detached(state, grace=args.grace)
    state_file.unlink(missing_ok=True)
    note = f" (SIGKILLed: {', '.join(killed)})" if killed else ""
    print(f"kvloom: stopped the cluster at {state.api}{note}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    sink = sys.stderr if args.logs else open(os.devnull, "w")  # noqa: SIM115
    cluster = launcher.Cluster(cluster_spec_for_launch(args), log_sink=sink)
    try:
        start_and_wait(cluster, args.ready_timeout)
        ids = chat_prompt(cluster.model, args.message, args.system)
        with KvloomClient(cluster.api_address) as client:
            try:
                return complete(client, ids, args)
            except KvloomError:
                # A dead daemon explains a failed stream better than the RPC status.
                cluster.check_alive(phase="while generating")
                raise
    finally:
        cluster.stop()
        if sink is not sys.stderr:
            sink.close()


def cluster_spec_for_launch(args: argparse.Namespace) -> launcher.ClusterSpec:
    if args.model is None:
        # Converted here (first run only) so the daemons start from a ready dir.
        print("kvloom: preparing the default model (SmolLM2-135M-Instruct)", file=sys.stderr)
        from kvloom.default_model import default_model_dir

        args.model = default_model_dir()
    return cluster_spec(args)


def start_and_wait(cluster: launcher.Cluster, timeout: float) -> None:
    spec = cluster.spec
    print(
        f"kvloom: starting controlplane + {spec.world_size} worker(s) "
        f"(tp={spec.tensor_parallel_size}, pp={spec.pipeline_parallel_size}) "
        f"for {spec.model}",
        file=sys.stderr,
    )
    started = time.monotonic()
    try:
        cluster.start()
        cluster.wait_ready(timeout)
    except BaseException:
        cluster.stop()
        raise
    print(f"kvloom: ready after {time.monotonic() - started:.1f}s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    handlers = {
        "generate": cmd_generate,
        "chat": cmd_chat,
        "info": cmd_info,
        "health": cmd_health,
        "up": cmd_up,
        "down": cmd_down,
        "run": cmd_run,
    }
    try:
        with launcher.termination_as_exception():
            return handlers[args.command](args)
    except (KvloomError, launcher.ClusterError) as exc:
        print(f"kvloom: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except (KeyboardInterrupt, launcher.Terminated):
        print("kvloom: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
