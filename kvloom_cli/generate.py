"""Generation flags and output of the `kvloom` command (generate, chat, run).

Turns the sampling/output flags into kvloom.client keywords and prints one
Generate call: with one sample, text goes to stdout as it streams in; with
-n > 1, each sample is printed after the call, under a "--- sample I ---"
header, in index order (samples stream interleaved, so printing them live
would mix their text); --json prints every response message as one JSON line
instead (for scripts). Logprob tables, token counts and failures go to
stderr so stdout stays pipeable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time

from kvloom.client import Collector, Finish, GenerateChunk, GenerateResult, KvloomClient, Logprob

EXIT_FAILURE = 1
TOKEN_WIDTH = 16  # columns of a token's repr in logprob tables


class AppendOverridingDefault(argparse.Action):
    """Like action="append", but the first flag replaces the default (which may
    come from a KVLOOM_* variable as one string) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, [*items, values])


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    r"""--stop "\n\n" means two newlines: a shell passes the backslashes through."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m[1], m[0]), text)


def add_generation_args(parser: argparse.ArgumentParser, *, lora: bool = True) -> None:
    """The flags of one generation; lora=False leaves out --lora (`run`
    starts a cluster with no adapter loaded, so there is none to name)."""
    if lora:
        parser.add_argument("--lora", default=None, metavar="NAME",
                            help="the LoRA adapter to generate with; default: the base model")
    else:
        parser.set_defaults(lora=None)
    s = parser.add_argument_group("sampling (unset = the server's default)")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--seed", type=int, default=None, help="sample i of -n uses seed + i")
    s.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages")
    s.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]")
    s.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2]")
    s.add_argument("--min-tokens", type=int, default=None, help="no EOS/stop before this")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--stop", action=AppendOverridingDefault, type=unescape, default=None,
                   metavar="STR", help=r"stop at this string (repeatable); \n, \t, \r and "
                   r"\\ are read as newline, tab, carriage return and backslash")
    s.add_argument("--stop-token-id", action=AppendOverridingDefault, type=int, default=None,
                   metavar="ID", help="stop at this token id (repeatable)")
    s.add_argument("--include-stop-str", action="store_true",
                   help="keep the matched stop string in the output")
    s.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each output token's logprob, rank and top N (stderr)")
    s.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="likewise for the prompt tokens")
    s.add_argument("-n", "--n", type=int, default=None, help="number of samples")
    _add_constraint_args(parser)
    q = parser.add_argument_group("scheduling")
    q.add_argument("--priority", type=int, default=None, metavar="N",
                   help="lower is served first (server default 0); a non-zero value needs "
                        "a server run with --scheduling-policy priority")
    o = parser.add_argument_group("output")
    o.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    o.add_argument("--stream-interval", type=int, default=None, metavar="TOKENS",
                   help="tokens per streamed message after the first (sent at once)")
    o.add_argument("--cache-salt", default="", help="share cached prefixes only within a salt")
    o.add_argument("--json", action="store_true",
                   help="print each response message as a JSON line instead of text")
    o.add_argument("--timeout", type=float, default=None, help="seconds for the request")
    o.add_argument("-v", "--verbose", action="store_true", help="print token counts")


# A spec read from @FILE larger than this is no constraint any server takes
# (--max-grammar-bytes is at most 16 MiB).
MAX_SPEC_FILE_BYTES = 16 * 1024 * 1024


def text_or_file(value: str) -> str:
    """A spec given inline, or @FILE for the file's text (UTF-8)."""
    if not value.startswith("@"):
        return value
    path = value[1:]
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_FILE_BYTES + 1)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SPEC_FILE_BYTES:
        raise argparse.ArgumentTypeError(f"{path} is over {MAX_SPEC_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{path} is not UTF-8 text: {exc}") from None


def json_text_or_file(value: str) -> str:
    """text_or_file, and it must parse as JSON (sent as written)."""
    text = text_or_file(value)
    try:
        json.loads(text)
    except ValueError as exc:
        what = value[1:] if value.startswith("@") else "the text"
        raise argparse.ArgumentTypeError(f"{what} is not JSON: {exc}") from None
    return text


def _add_constraint_args(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group(
        "structured output (at most one constraint; the server checks and compiles it)")
    one = c.add_mutually_exclusive_group()
    one.add_argument("--json-schema", type=json_text_or_file, default=None, metavar="SCHEMA",
                     help="the output is JSON valid under this JSON Schema (JSON text, or "
                          "@FILE)")
    one.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    one.add_argument("--regex", default=None, metavar="PATTERN",
                     help="the output matches this regular expression")
    one.add_argument("--grammar", type=text_or_file, default=None, metavar="GRAMMAR",
                     help='the output follows this grammar: EBNF with a "root ::= ..." rule, '
                          "or Lark (text, or @FILE)")
    one.add_argument("--choice", action=AppendOverridingDefault, default=None, metavar="STR",
                     help="the output is exactly one of these strings (repeatable)")
    one.add_argument("--structural-tag", type=json_text_or_file, default=None, metavar="TAG",
                     help="an xgrammar structural tag (JSON text, or @FILE)")
    c.add_argument("--json-any-whitespace", action=argparse.BooleanOptionalAction,
                   default=None, help="with --json-schema/--json-object: any whitespace "
                   "between JSON tokens (server default); --no-json-any-whitespace asks for "
                   "compact JSON, which small models need")


def generation_kwargs(args: argparse.Namespace) -> dict:
    """kvloom.client generate() keywords; absent flags stay None (server default)."""
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "min_tokens": args.min_tokens,
        "ignore_eos": args.ignore_eos,
        "stop": _as_list(args.stop),
        "stop_token_ids": _as_list(args.stop_token_id),
        "include_stop_str_in_output": args.include_stop_str,
        "logprobs": args.logprobs,
        "prompt_logprobs": args.prompt_logprobs,
        "n": args.n,
        "stream": args.stream,
        "stream_interval": args.stream_interval,
        "cache_salt": args.cache_salt,
        "priority": args.priority,
        "lora_name": args.lora,
        "timeout": args.timeout,
        **constraint_kwargs(args),
    }


def constraint_kwargs(args: argparse.Namespace) -> dict:
    """The structured-output keywords; unset ones None (json_object False)."""
    choice = _as_list(args.choice)
    return {
        "json_schema": args.json_schema,
        "json_object": args.json_object,
        "regex": args.regex,
        "grammar": args.grammar,
        "choice": choice or None,
        "structural_tag": args.structural_tag,
        "json_any_whitespace": args.json_any_whitespace,
    }


def _as_list(value) -> list:
    # A KVLOOM_STOP / KVLOOM_STOP_TOKEN_ID default arrives as one bare value.
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def chat_turns(message: str, system: str | None = None) -> list[tuple[str, str]]:
    """The conversation `kvloom chat/run` sends; the server applies the template."""
    return [*([("system", system)] if system else []), ("user", message)]


def chunk_json(chunk: GenerateChunk) -> str:
    """One response message as a JSON object on one line (API field names)."""
    return json.dumps(dataclasses.asdict(chunk), ensure_ascii=False)


def format_finish(finish: Finish | None, seconds: float) -> str:
    if finish is None:
        return "[no finish info]"
    rate = finish.output_tokens / seconds if seconds > 0 else 0.0
    extra = f", {finish.cached_tokens} cached" if finish.cached_tokens else ""
    if finish.stop_str is not None:
        extra += f", stop string {finish.stop_str!r}"
    elif finish.stop_token_id is not None and finish.reason == "stop":
        extra += f", stop token {finish.stop_token_id}"
    error = f": {finish.error}" if finish.error else ""
    return (
        f"[{finish.reason}{error}: {finish.prompt_tokens} prompt + {finish.output_tokens} "
        f"output tokens{extra} in {seconds:.2f}s, {rate:.1f} tok/s]"
    )


def _token(text: str) -> str:
    shown = repr(text)
    return shown if len(shown) <= TOKEN_WIDTH else shown[: TOKEN_WIDTH - 1] + "…"


def format_logprobs(entries: list[Logprob], title: str, first_position: int = 0) -> str:
    """A compact table: position, id, token, logprob, rank, then the top candidates."""
    header = f"{'pos':>5} {'id':>7} {'token':<{TOKEN_WIDTH}} {'logprob':>9} {'rank':>5}  top"
    lines = [title, header]
    for pos, lp in enumerate(entries, first_position):
        top = "  ".join(f"{_token(t.token)} {t.logprob:.3f}" for t in lp.top)
        lines.append(
            f"{pos:>5} {lp.token_id:>7} {_token(lp.token):<{TOKEN_WIDTH}} "
            f"{lp.logprob:>9.4f} {lp.rank:>5}  {top}".rstrip()
        )
    return "\n".join(lines)


def complete(client: KvloomClient, prompt, args: argparse.Namespace) -> int:
    """Generate, print, and report; shared by generate, chat and run."""
    started = time.monotonic()
    collector = Collector(client.server, args.n)
    chunks = client.generate(prompt, **generation_kwargs(args))
    many = (args.n or 1) > 1
    try:
        for chunk in chunks:
            collector.add(chunk)
            if args.json:
                print(chunk_json(chunk), flush=True)
            elif not many:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    finally:
        if not args.json and not many:
            print(flush=True)  # end the streamed line even when the stream failed
    results = collector.results()
    seconds = time.monotonic() - started
    for result in results:
        report_sample(result, args, seconds, many)
    failed = [r for r in results if r.finish.reason in ("abort", "error")]
    return EXIT_FAILURE if failed else 0


def report_sample(result: GenerateResult, args, seconds: float, many: bool) -> None:
    label = f"[sample {result.index}] " if many else ""
    if many and not args.json:
        print(f"--- sample {result.index} ---\n{result.text}", flush=True)
    if not args.json:
        info = result.prompt_info
        if args.prompt_logprobs is not None and info is not None:
            title = f"{label}prompt logprobs"
            print(format_logprobs(info.prompt_logprobs, title, 1), file=sys.stderr)
        if args.logprobs is not None:
            print(format_logprobs(result.logprobs, f"{label}logprobs"), file=sys.stderr)
    if args.verbose or result.finish.reason in ("abort", "error"):
        print(f"{label}{format_finish(result.finish, seconds)}", file=sys.stderr)
