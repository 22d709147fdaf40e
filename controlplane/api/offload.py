"""Heavy client work runs off the API event loop, on a bounded thread pool.

Tokenizing a long prompt, rendering a chat template, checking a long
structured-output constraint, detokenizing a long id list, and turning a
large batch of engine outputs into response messages (incremental
detokenizing, stop-string matching, logprobs) take milliseconds to seconds
of CPU. On the event loop that time is a stall for every other
client; so above a size threshold the work goes to the server's pool
(ThreadPoolExecutor, a few threads) and the loop awaits it.

Small work stays inline, where it is cheapest. A hop to the pool and back
has a round-trip cost of its own, and most of a short call is Python that
holds the GIL anyway; a thread buys nothing until the work is long enough to
stall the loop noticeably. Each threshold below is about INLINE_MAX_OUTPUT_US
of work with a byte-level BPE tokenizer, from the costs timed on the tests'
tokenizer (encoding per character, decoding per id, an output token through a
SampleStream with and without stop strings, each logprob entry); they are in
docs/benchmarks.md, "Client API costs", and OUTPUT_TOKEN_US and
LOGPROB_ENTRY_US are that cost model. Streaming one token per step per sample
stays inline; a prompt-logprobs chunk, or a backlog a slow reader let pile
up, goes to the pool.

What a thread does not buy: Hugging Face fast tokenizers release the GIL
while encoding in Rust (transformers encodes through encode_batch), but not
while they convert the result to Python lists, and `decode` holds it
throughout; those parts still pause every thread, in proportion to the ids
(docs/benchmarks.md, "Client API costs"). The per-request limits (prompt
characters, MAX_TOKENIZE_CHARS, MAX_DETOKENIZE_IDS) bound them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
from collections.abc import Callable
from typing import TypeVar

from controlplane.api.validation import Limits
from controlplane.core.outputs import EngineCoreOutput
from kvloom.v1 import generation_pb2 as pb

T = TypeVar("T")

# About INLINE_MAX_OUTPUT_US of work each (see the module docstring).
INLINE_MAX_CHARS = 4096
INLINE_MAX_IDS = 4096
INLINE_MAX_TURNS = 64
INLINE_MAX_CHOICES = 8192
INLINE_MAX_OUTPUT_US = 1000
OUTPUT_TOKEN_US = 10.0
LOGPROB_ENTRY_US = 1.2

# Encoding is Rust (GIL released), so threads beyond the cores only queue on
# them; a few keep one huge prompt from delaying every other prompt.
DEFAULT_THREADS = min(4, os.cpu_count() or 1)


def new_pool(threads: int = DEFAULT_THREADS) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=threads, thread_name_prefix="kvloom-tokenize"
    )


class Offload:
    """Runs a function inline or on the pool; no pool means always inline (unit tests)."""

    def __init__(self, pool: concurrent.futures.Executor | None = None):
        self.pool = pool

    async def run(self, heavy: bool, fn: Callable[..., T], *args) -> T:
        """fn(*args), on the pool when `heavy`. A cancelled caller drops work
        not yet started; work already running finishes unobserved."""
        if not heavy or self.pool is None:
            return fn(*args)
        return await asyncio.wrap_future(self.pool.submit(fn, *args))

    async def run_settled(self, heavy: bool, fn: Callable[..., T], *args) -> T:
        """Like run(), but a cancelled caller waits for work already running:
        it may be changing state (SampleStreams) the caller's clean-up reads."""
        if not heavy or self.pool is None:
            return fn(*args)
        work = self.pool.submit(fn, *args)
        done = asyncio.wrap_future(work)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            if not work.cancel():  # already running (or done): let it settle
                await asyncio.wait([done])
            raise


def heavy_generate(request: pb.GenerateRequest, limits: Limits) -> bool:
    """Does validating this request (tokenizing its prompt, parsing its
    constraint) belong on the pool? Not when its size alone gets it refused:
    validate() says so at once, and a refusal must not queue behind other
    prompts' tokenizing."""
    return heavy_constraint(request.sampling, limits) or _heavy_prompt(request, limits)


def heavy_constraint(sp, limits: Limits) -> bool:
    """Does checking this SamplingParams.constraint belong on the pool? The
    edge's checks (controlplane/structured/validate.py) read JSON and walk
    strings, in time that follows the spec's size: a long spec goes to the
    pool, unless its size alone gets it refused (over --max-grammar-bytes),
    and a short one is checked inline. xgrammar's own parse, whose cost does
    not follow the size, is the compile's, never the edge's. kvloom.v1's
    and the gateway's SamplingParams alike: their oneofs have the same
    branch names."""
    branch = sp.WhichOneof("constraint")
    if branch is None or branch == "json_object" or not limits.grammar_backend:
        return False
    if branch == "choice":
        return INLINE_MAX_CHOICES < len(sp.choice.choices) <= limits.max_grammar_choices
    # Characters <= UTF-8 bytes: a longer string is over the limit for sure.
    return INLINE_MAX_CHARS < len(getattr(sp, branch)) <= limits.max_grammar_bytes


def _heavy_prompt(request: pb.GenerateRequest, limits: Limits) -> bool:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return INLINE_MAX_CHARS < len(request.text) <= limits.max_prompt_chars
    if kind == "token_ids":
        return INLINE_MAX_IDS < len(request.token_ids.ids) < limits.max_model_len
    if kind == "messages":
        # A short chat renders in less time than a hop to the pool costs
        # (docs/benchmarks.md, "Client API costs").
        turns = request.messages.messages
        if len(turns) > limits.max_chat_messages:
            return False
        chars = sum(len(m.content) for m in turns)
        return chars <= limits.max_prompt_chars and (
            len(turns) > INLINE_MAX_TURNS or chars > INLINE_MAX_CHARS
        )
    return False


def heavy_outputs(batch: list[EngineCoreOutput]) -> bool:
    """Does turning this batch into messages belong on the pool? (Stops counting
    as soon as it does: the count must stay cheaper than the work.)"""
    cost = 0.0
    for out in batch:
        cost += len(out.new_token_ids) * OUTPUT_TOKEN_US
        prompt = out.prompt_logprobs.positions if out.prompt_logprobs is not None else ()
        for lp in itertools.chain(out.new_logprobs or (), prompt):
            cost += (1 + len(lp.top_token_ids)) * LOGPROB_ENTRY_US
            if cost > INLINE_MAX_OUTPUT_US:
                return True
        if cost > INLINE_MAX_OUTPUT_US:
            return True
    return False
