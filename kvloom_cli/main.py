"""The `kvloom` command: talk to a running cluster, or launch one locally.

    kvloom generate "prompt"      stream a raw completion from --server
    kvloom chat "message"         the same as a chat turn (server-side chat template)
    kvloom tokenize "text"        token ids of text (--chat: of a chat turn)
    kvloom detokenize 1 2 3       text of token ids
    kvloom info | health          describe / probe the server
    kvloom lora load NAME PATH    load a LoRA adapter (also: lora unload NAME, lora list);
                                  generate and chat take --lora NAME
    kvloom up [--detach]          start controlplane + T*P workers here (kvloom_cli.launcher)
    kvloom down                   stop a cluster started with `up --detach`
    kvloom run "prompt"           up, chat once, down: the one-command demo
    (up and run take --openai-port PORT: an OpenAI API through the SMG gateway)

This module parses arguments and dispatches; printing a generation lives in
kvloom_cli.generate, local clusters in kvloom_cli.cluster, the RPCs in
kvloom.client. Generated text goes to stdout, everything else (daemon logs,
progress, logprobs, errors) to stderr, so output pipes cleanly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvloom.client import (
    LOAD_LORA_TIMEOUT,
    READY_SERVICE,
    KvloomClient,
    KvloomError,
    LoRAAdapter,
    default_server,
)
from kvloom.envargs import EnvArgumentParser
from kvloom.helpformat import DefaultsHelpFormatter
from kvloom_cli import launcher
from kvloom_cli.cluster import GatewayMissing, add_cluster_args, cmd_down, cmd_run, cmd_up
from kvloom_cli.generate import EXIT_FAILURE, add_generation_args, chat_turns, complete
from kvloom_cli.openai_http import OpenAIError

EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = EnvArgumentParser(prog="kvloom", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="stream a completion of a raw prompt")
    gen.add_argument("prompt")
    _add_server_arg(gen)
    add_generation_args(gen)

    chat = sub.add_parser("chat", help="send one chat message (the server applies the template)")
    chat.add_argument("message")
    chat.add_argument("--system", help="system prompt")
    _add_server_arg(chat)
    add_generation_args(chat)

    tok = sub.add_parser("tokenize", help="print the token ids of text")
    tok.add_argument("text")
    tok.add_argument("--chat", action="store_true", help="tokenize TEXT as a user chat turn")
    tok.add_argument("--system", help="a system turn first (implies --chat)")
    tok.add_argument("--special-tokens", action=argparse.BooleanOptionalAction, default=None,
                     help="add BOS etc. to plain text (server default: yes)")
    tok.add_argument("--generation-prompt", action=argparse.BooleanOptionalAction,
                     default=None, help="with --chat: end with the assistant prompt (default)")
    tok.add_argument("--json", action="store_true", help='print {"token_ids", "text"}')
    tok.add_argument("-v", "--verbose", action="store_true", help="show the tokenized text")
    _add_server_arg(tok)

    detok = sub.add_parser("detokenize", help="print the text of token ids")
    detok.add_argument("ids", nargs="+", type=_token_ids, metavar="IDS",
                       help="token ids, space or comma separated")
    detok.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction,
                       default=None, help="leave out special tokens (server default: yes)")
    _add_server_arg(detok)

    info = sub.add_parser("info", help="show the served model and cluster layout")
    info.add_argument("--json", action="store_true")
    _add_server_arg(info)

    health = sub.add_parser("health", help="grpc health check; exit 0 when SERVING")
    health.add_argument("--service", default=None, help=f"default: both '' and {READY_SERVICE}")
    _add_server_arg(health)

    _add_lora_parser(sub)

    up = sub.add_parser("up", help="start a local cluster (extra args go to the controlplane)")
    add_cluster_args(up)
    up.add_argument("--detach", action="store_true",
                    help="start in the background and return; nothing then restarts a dead "
                         "worker (in the foreground `up` restarts it, with back-off)")
    up.add_argument("--state-file", type=Path, default=None,
                    help="where pids/ports are kept; default: ~/.cache/kvloom/cluster.json")

    down = sub.add_parser("down", help="stop a cluster started with `kvloom up --detach`")
    down.add_argument("--state-file", type=Path, default=None,
                      help="the cluster's state file; default: ~/.cache/kvloom/cluster.json")
    down.add_argument("--grace", type=float, default=10.0, help="seconds before SIGKILL")

    run = sub.add_parser("run", help="start a local cluster, chat once, stop it")
    run.add_argument("message")
    run.add_argument("--system", help="system prompt")
    run.add_argument("--logs", action="store_true", help="show the daemons' logs")
    add_cluster_args(run)
    add_generation_args(run, lora=False)
    for subparser in sub.choices.values():  # every --help shows every default
        subparser.formatter_class = DefaultsHelpFormatter
    return parser


def _add_lora_parser(sub) -> None:
    """`kvloom lora load|unload|list`: the adapters of a server run with
    --enable-lora (load and unload also need --allow-runtime-lora-updating)."""
    lora = sub.add_parser("lora", help="load, unload or list the server's LoRA adapters")
    actions = lora.add_subparsers(dest="lora_command", required=True, metavar="ACTION")

    def action(name: str, **kwargs) -> argparse.ArgumentParser:
        # `build_parser` gives the top-level commands the formatter; these nest one deeper.
        return actions.add_parser(name, formatter_class=DefaultsHelpFormatter, **kwargs)

    load = action("load", help="load a PEFT LoRA adapter on every worker")
    load.add_argument("name", metavar="NAME",
                      help="the name requests give it (generate/chat --lora NAME)")
    load.add_argument("path", metavar="PATH",
                      help="its directory (adapter_config.json + adapter_model.safetensors), "
                           "absolute, as every worker host sees it")
    load.add_argument("--timeout", type=float, default=LOAD_LORA_TIMEOUT, metavar="SECONDS",
                      help="how long every worker may take to read the adapter")
    load.add_argument("--json", action="store_true", help="print the loaded adapter as JSON")
    load.add_argument("--gateway", default="", metavar="URL",
                      help="also register the adapter's listener with this SMG gateway "
                           "(its root URL, e.g. http://127.0.0.1:8000), so OpenAI clients can "
                           "name it as their model")
    _add_server_arg(load)

    unload = action("unload", help="free an adapter on every worker (once no unfinished "
                                   "request names it)")
    unload.add_argument("name", metavar="NAME")
    _add_server_arg(unload)

    listing = action("list", help="the adapters requests may name: name, rank, version, "
                                  "path, unfinished requests")
    listing.add_argument("--json", action="store_true", help="print them as a JSON list")
    _add_server_arg(listing)


def _add_server_arg(parser: argparse.ArgumentParser) -> None:
    """--server and how to reach it: TLS files and the API key (docs/security.md)."""
    parser.add_argument("--server", default=default_server(), help="controlplane HOST:PORT")
    sec = parser.add_argument_group("connection security")
    sec.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                     help="CA that signed the server's certificate; implies TLS")
    sec.add_argument("--ssl-certfile", default=None, metavar="PEM",
                     help="client certificate, for a server with --ssl-ca-certs (mTLS)")
    sec.add_argument("--ssl-keyfile", default=None, metavar="PEM",
                     help="private key of --ssl-certfile")
    sec.add_argument("--tls", action="store_true",
                     help="TLS, trusting the system's CAs (implied by the --ssl-* flags)")
    sec.add_argument("--api-key", default=None, metavar="KEY",
                     help="sent as 'authorization: Bearer KEY' (prefer the variable: a "
                          "flag's value shows in ps)")


def connect(args: argparse.Namespace) -> KvloomClient:
    """The client of a command that talks to --server."""
    return KvloomClient(
        args.server, ssl_ca_certs=args.ssl_ca_certs, ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile, tls=args.tls,
        # None still reads KVLOOM_API_KEY (EnvArgumentParser already did, for the flag).
        api_key=args.api_key,
    )


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token id list: {text!r}") from None


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


def cmd_generate(args: argparse.Namespace) -> int:
    with connect(args) as client:
        return complete(client, args.prompt, args)


def cmd_chat(args: argparse.Namespace) -> int:
    with connect(args) as client:
        return complete(client, chat_turns(args.message, args.system), args)


def cmd_tokenize(args: argparse.Namespace) -> int:
    chat = args.chat or args.system is not None
    prompt = chat_turns(args.text, args.system) if chat else args.text
    with connect(args) as client:
        ids, text = client.tokenize(
            prompt, add_special_tokens=args.special_tokens,
            add_generation_prompt=args.generation_prompt,
        )
    if args.json:
        print(json.dumps({"token_ids": ids, "text": text}, ensure_ascii=False))
    else:
        print(" ".join(map(str, ids)))
    if args.verbose:
        print(f"[{len(ids)} tokens of {text!r}]", file=sys.stderr)
    return 0


def cmd_detokenize(args: argparse.Namespace) -> int:
    ids = [i for group in args.ids for i in group]
    with connect(args) as client:
        print(client.detokenize(ids, skip_special_tokens=args.skip_special_tokens))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with connect(args) as client:
        model, server = client.model_info(), client.server_info()
    if args.json:
        doc = {"server": args.server, "model": dataclasses.asdict(model),
               "server_info": dataclasses.asdict(server)}
        print(json.dumps(doc, ensure_ascii=False, indent=2))
        return 0
    print(f"{'server':<24} {args.server}")
    for name, value in {**vars(model), **vars(server)}.items():
        if name == "special_tokens":
            value = ", ".join(f"{text}={tid}" for text, tid in value.items()) or "(none)"
        elif name == "ranks":
            for rank in value:
                print(f"{f'rank {rank.rank}':<24} {rank.describe()}")
            continue
        elif name == "lora_adapters":
            for adapter in value:  # none: no line (most servers run without --enable-lora)
                print(f"{f'lora {adapter.name}':<24} {adapter.describe()}")
            continue
        elif value is None:
            value = "(none)"
        print(f"{name:<24} {value}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    services = [args.service] if args.service is not None else ["", READY_SERVICE]
    healthy = True
    with connect(args) as client:
        for service in services:
            status = client.health(service)
            healthy = healthy and status == "SERVING"
            print(f"{service or '(server)':<24} {status}")
    return 0 if healthy else EXIT_FAILURE


def _adapter_line(adapter: LoRAAdapter) -> str:
    return f"{adapter.name:<24} {adapter.describe()}"


def cmd_lora(args: argparse.Namespace) -> int:
    return LORA_HANDLERS[args.lora_command](args)


def cmd_lora_load(args: argparse.Namespace) -> int:
    with connect(args) as client:
        adapter = client.load_lora_adapter(args.name, args.path, timeout=args.timeout)
    if args.gateway:
        from kvloom_cli.gateway import worker_url
        from kvloom_cli.openai_http import register_worker

        host = args.server.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
        register_worker(args.gateway.rstrip("/"), worker_url(host, adapter.vllm_engine_port))
    if args.json:
        print(json.dumps(dataclasses.asdict(adapter), ensure_ascii=False, indent=2))
    else:
        print(_adapter_line(adapter))
    return 0


def cmd_lora_unload(args: argparse.Namespace) -> int:
    with connect(args) as client:
        client.unload_lora_adapter(args.name)
    print(f"unloaded {args.name}", file=sys.stderr)
    return 0


def cmd_lora_list(args: argparse.Namespace) -> int:
    with connect(args) as client:
        adapters = client.list_lora_adapters()
    if args.json:
        doc = [dataclasses.asdict(adapter) for adapter in adapters]
        print(json.dumps(doc, ensure_ascii=False, indent=2))
        return 0
    for adapter in adapters:
        print(_adapter_line(adapter))
    if not adapters:
        # stderr: stdout stays one line per adapter, for scripts.
        print("(no LoRA adapters loaded)", file=sys.stderr)
    return 0


LORA_HANDLERS = {
    "load": cmd_lora_load,
    "unload": cmd_lora_unload,
    "list": cmd_lora_list,
}

HANDLERS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "tokenize": cmd_tokenize,
    "detokenize": cmd_detokenize,
    "info": cmd_info,
    "health": cmd_health,
    "lora": cmd_lora,
    "up": cmd_up,
    "down": cmd_down,
    "run": cmd_run,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with launcher.termination_as_exception():
            return HANDLERS[args.command](args)
    except GatewayMissing as exc:
        print(exc, file=sys.stderr)  # the whole line, with the command that fixes it
        return EXIT_FAILURE
    except (KvloomError, launcher.ClusterError, OpenAIError) as exc:
        print(f"kvloom: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except (KeyboardInterrupt, launcher.Terminated):
        print("kvloom: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
