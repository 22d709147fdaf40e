"""OpenAI HTTP through the SMG gateway with the standard library only (the CLI
does not depend on the openai package): list the served models, and stream
one chat completion as server-sent events for `kvloom run --openai-port`,
its text to stdout as it arrives.

The sampling flags map to the OpenAI request (plus the vLLM extensions the
gateway forwards: top_k, min_p, repetition_penalty, stop_token_ids,
ignore_eos). A constraint maps to `response_format` (--json-schema,
--json-object) or to the gateway's own `regex` and `ebnf` fields (--regex,
--grammar), which it turns into the engine's constraint. Flags the gateway
cannot honour (logprob tables, several samples, kvloom's own scheduling
fields, --choice, --structural-tag, compact JSON) are refused before
anything starts, never silently dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator

from kvloom_cli.generate import generation_kwargs

EXIT_FAILURE = 1
# A server-sent event line longer than this is not a chat chunk.
MAX_LINE = 1 << 20
# Seconds without a byte from the gateway before `run` gives up (no --timeout).
DEFAULT_TIMEOUT = 300.0


class OpenAIError(RuntimeError):
    """The gateway could not be reached (status None) or answered with an error."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _error_text(body: bytes) -> str:
    """The message of an OpenAI error body, or the body itself."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text[:500] or "(empty body)"
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or text)[:500]


def _open(request: urllib.request.Request | str, timeout: float):
    url = request.full_url if isinstance(request, urllib.request.Request) else request
    try:
        return urllib.request.urlopen(request, timeout=timeout)  # noqa: S310 (http only)
    except urllib.error.HTTPError as exc:
        raise OpenAIError(f"{url}: HTTP {exc.code}: {_error_text(exc.read())}", exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OpenAIError(f"cannot reach {url}: {reason}") from None


def _names(url: str, key: str, field: str, timeout: float) -> list[str]:
    with _open(url, timeout) as response:
        try:
            doc = json.loads(response.read(MAX_LINE))
            return [str(entry[field]) for entry in doc[key]]
        except (ValueError, KeyError, TypeError) as exc:
            raise OpenAIError(f"{url}: not a {key} list ({exc})") from None


def list_models(base_url: str, timeout: float = 5.0) -> list[str]:
    """The model ids GET /v1/models lists."""
    return _names(f"{base_url}/models", "data", "id", timeout)


def list_tokenizers(base_url: str, timeout: float = 5.0) -> list[str] | None:
    """The models whose tokenizer the gateway has registered (GET
    /v1/tokenizers, an SMG route); None where the route does not exist. A
    model is listed a moment before its tokenizer is loaded, and requests in
    between fail with 503."""
    try:
        return _names(f"{base_url}/tokenizers", "tokenizers", "name", timeout)
    except OpenAIError as exc:
        if exc.status == 404:
            return None
        raise


def list_worker_types(root_url: str, timeout: float = 5.0) -> list[str]:
    """The type of each healthy worker GET /workers (an SMG route, beside
    /v1) lists: "regular", or "prefill" and "decode" in PD mode."""
    url = f"{root_url}/workers"
    with _open(url, timeout) as response:
        try:
            doc = json.loads(response.read(MAX_LINE))
            return [str(w["worker_type"]) for w in doc["workers"] if w.get("is_healthy")]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise OpenAIError(f"{url}: not a workers list ({exc})") from None


def register_worker(root_url: str, worker_url: str, timeout: float = 10.0) -> None:
    """POST /workers (an SMG control-plane route): the gateway adds a
    worker by URL and discovers the model it serves (its GetModelInfo)."""
    body = json.dumps({"url": worker_url}).encode()
    request = urllib.request.Request(f"{root_url}/workers", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with _open(request, timeout):
        pass


# The generation flags (dest -> as shown) a chat through the gateway cannot take.
_UNSUPPORTED = {
    "logprobs": "--logprobs",
    "prompt_logprobs": "--prompt-logprobs",
    "min_tokens": "--min-tokens (the gateway drops it from chat requests)",
    "priority": "--priority",
    "stream_interval": "--stream-interval",
    "include_stop_str": "--include-stop-str",
    "json": "--json",
    # The gateway's chat request has no field for these (its structural tags
    # are its own, built for tool calls and reasoning).
    "choice": "--choice",
    "structural_tag": "--structural-tag",
}


def unsupported_flags(args: argparse.Namespace) -> list[str]:
    """The generation flags set in args that a chat through the gateway cannot honour."""
    refused = [flag for dest, flag in _UNSUPPORTED.items() if getattr(args, dest, None)]
    if (args.n or 1) > 1:
        refused.append("-n > 1")
    if not args.stream:
        refused.append("--no-stream")
    if args.cache_salt:
        refused.append("--cache-salt")
    if args.json_any_whitespace is False:
        refused.append("--no-json-any-whitespace")
    return refused


_CHAT_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
              "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
              "stop_token_ids", "ignore_eos")


def chat_body(model: str, messages: list[tuple[str, str]], args: argparse.Namespace) -> dict:
    """The POST /v1/chat/completions body; unset flags are left out (gateway defaults)."""
    body: dict = {
        "model": model,
        "messages": [{"role": role, "content": content} for role, content in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # The sampling knobs of `kvloom generate`, those the gateway forwards
    # (unsupported_flags refuses the rest); unset ones are left out.
    shared = generation_kwargs(args)
    for key in _CHAT_KEYS:
        value = shared[key]
        if value is not None and value != [] and value is not False:
            body[key] = value
    body.update(_constraint_fields(shared))
    return body


# The name OpenAI's json_schema response format requires; the gateway only
# passes the schema on.
SCHEMA_NAME = "output"


def _constraint_fields(kwargs: dict) -> dict:
    """The chat request's fields for the constraint in kwargs (at most one:
    the flags exclude each other); those with none are refused before."""
    if kwargs["json_schema"] is not None:
        schema = json.loads(kwargs["json_schema"])  # checked when parsed
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": SCHEMA_NAME, "schema": schema}}}
    if kwargs["json_object"]:
        return {"response_format": {"type": "json_object"}}
    if kwargs["regex"] is not None:
        return {"regex": kwargs["regex"]}
    if kwargs["grammar"] is not None:
        return {"ebnf": kwargs["grammar"]}
    return {}


def sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The data of each server-sent event (multi-line data joined by newlines)."""
    data: list[str] = []
    for raw in lines:
        if len(raw) >= MAX_LINE and not raw.endswith(b"\n"):
            raise OpenAIError(f"an event line longer than {MAX_LINE} bytes")
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        name, _, value = line.partition(":")
        if name == "data":  # ":" lines are comments; other fields are unused here
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def stream_chat(base_url: str, body: dict, timeout: float) -> Iterator[dict]:
    """POST a streamed chat completion; yields each chunk until [DONE]."""
    request = urllib.request.Request(
        f"{base_url}/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
    )
    with _open(request, timeout) as response:
        for data in sse_data(iter(lambda: response.readline(MAX_LINE), b"")):
            if data.strip() == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except ValueError:
                raise OpenAIError(f"not a JSON chunk: {data[:200]!r}") from None
            if isinstance(chunk, dict) and "error" in chunk:
                raise OpenAIError(f"the gateway ended the stream: {_error_text(data.encode())}")
            if isinstance(chunk, dict):
                yield chunk
    raise OpenAIError("the stream ended without [DONE]")


def print_chat(base_url: str, model: str, messages: list[tuple[str, str]],
               args: argparse.Namespace) -> int:
    """Stream one chat answer to stdout; token counts to stderr with -v."""
    started = time.monotonic()
    finish, usage = None, None
    try:
        for chunk in stream_chat(base_url, chat_body(model, messages, args),
                                 args.timeout or DEFAULT_TIMEOUT):
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    sys.stdout.write(text)
                    sys.stdout.flush()
                finish = choice.get("finish_reason") or finish
    finally:
        print(flush=True)  # end the streamed line even when the stream failed
    if args.verbose or finish not in ("stop", "length"):
        print(format_usage(finish, usage, time.monotonic() - started), file=sys.stderr)
    return 0 if finish in ("stop", "length") else EXIT_FAILURE


def format_usage(finish: str | None, usage: dict | None, seconds: float) -> str:
    usage = usage or {}
    prompt, output = usage.get("prompt_tokens", "?"), usage.get("completion_tokens", "?")
    return (f"[{finish or 'no finish reason'}: {prompt} prompt + {output} output tokens "
            f"in {seconds:.2f}s, through the gateway]")
