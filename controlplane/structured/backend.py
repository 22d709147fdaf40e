"""xgrammar in the controlplane: one tokenizer description, compiles off the
engine thread, and a cache of compiled grammars (design note §4, §8).

A compile takes from a fraction of a millisecond (a regex) to seconds (a
deep schema) and JSON compiles have no timeout of their own, so compiles run
on a small pool and the request waits (engine/grammar_gate.py holds it and
enforces --grammar-compile-timeout). Equal specs share one compile: a spec
being compiled is joined, a compiled one is served from an LRU bounded by
xgrammar's own size of each grammar (--grammar-cache-bytes), so a cache hit
never waits behind a slow compile in the pool.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future

from controlplane.structured.json_schema import bounded_strings_as_patterns
from controlplane.structured.params import (
    StructuredOutputKind,
    StructuredOutputsParams,
    choice_as_ebnf,
    grammar_is_lark,
)
from controlplane.structured.request_grammar import RequestGrammar
from controlplane.structured.validate import MAX_JSON_SCHEMA_DEPTH, xgrammar_message
from controlplane.structured.validate import WHAT as _WHAT

logger = logging.getLogger(__name__)

# Compiles that may run at once. Most finish in milliseconds; this bounds how
# many threads hostile specs (compiling past their timeout) can hold.
MAX_COMPILE_THREADS = 8
# Added to the compile threads' nice value (Linux schedules threads apart).
COMPILE_NICENESS = 10


# The engine knows no API: a compile error names kvloom.v1's field, and the
# VllmEngine edge renames the prefix (sampling_params.) for its clients.
KVLOOM_FIELD_PREFIX = "sampling."


class GrammarCompileError(ValueError):
    """The spec passed the edge's checks but does not compile (the message says why)."""


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], *,
                 cache_bytes: int, compile_threads: int | None = None) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        # Stop tokens = the model's EOS set: a grammar ends with one of them,
        # as transformers + xgrammar's logits processor on the same info do.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids) or None)
        # One thread per compile: two on two loaded cores was slower (§4).
        # Caching is ours (below), sized by the same measure xgrammar uses.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1,
                                             cache_enabled=False)
        # Compile threads: daemons, not a ThreadPoolExecutor (whose threads
        # the interpreter joins at exit): a compile cannot be interrupted, and
        # a hostile one must not keep a stopping controlplane alive. A thread
        # is added whenever a compile would otherwise queue, up to
        # max_compile_threads: a slow compile (past its request's timeout, it
        # still runs) holds one thread, never every new spec behind it.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.max_compile_threads = compile_threads or MAX_COMPILE_THREADS
        self._num_threads = 0
        self._num_idle = 0
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        # key -> future, compiling or done; done ones are the LRU cache.
        self._futures: OrderedDict[tuple, Future] = OrderedDict()
        self._cached_bytes = 0
        self._sizes: dict[tuple, int] = {}
        self.num_compiles = 0
        self.num_cache_hits = 0

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The CompiledGrammar of `params`, done at once on a cache hit; a
        failed compile raises GrammarCompileError from result()."""
        key = params.key
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = Future()
            if self._num_idle == 0 and self._num_threads < self.max_compile_threads:
                self._num_threads += 1
                self._num_idle += 1
                threading.Thread(target=self._work, daemon=True,
                                 name=f"grammar-compile-{self._num_threads}").start()
            self._num_idle -= 1  # the thread that takes it (the count may dip below 0)
            self._queue.put((future, params))
            self._futures[key] = future
            self.num_compiles += 1
        future.add_done_callback(lambda f: self._settle(key, f))
        return future

    def new_request_grammar(self, compiled) -> RequestGrammar:
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(compiled), self.vocab_size)

    def shutdown(self) -> None:
        """Stop the compile threads once the queued compiles are done."""
        for _ in range(self._num_threads):
            self._queue.put(None)

    def _work(self) -> None:
        # Below the engine and the API: compiles past their request's timeout
        # run on, and they must not take the cores serving steps.
        with contextlib.suppress(OSError):  # a platform without per-thread nice
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid)
                                                     + COMPILE_NICENESS))
        while (item := self._queue.get()) is not None:
            future, params = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._compile(params))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                    future.set_exception(exc)
            with self._lock:
                self._num_idle += 1

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._compiler
        kind = params.kind
        try:
            if kind is StructuredOutputKind.JSON_SCHEMA:
                spec = bounded_strings_as_patterns(params.spec, MAX_JSON_SCHEMA_DEPTH)
                return compiler.compile_json_schema(spec, any_whitespace=params.any_whitespace)
            if kind is StructuredOutputKind.JSON_OBJECT:
                return compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=params.any_whitespace)
            if kind is StructuredOutputKind.REGEX:
                return compiler.compile_regex(params.spec)
            if kind is StructuredOutputKind.GRAMMAR:
                if grammar_is_lark(params.spec):
                    return compiler.compile_lark(params.spec)
                return compiler.compile_grammar(params.spec)
            if kind is StructuredOutputKind.CHOICE:
                return compiler.compile_grammar(choice_as_ebnf(params.choices))
            if kind is StructuredOutputKind.STRUCTURAL_TAG:
                return compiler.compile_structural_tag(params.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarCompileError(
                f"{KVLOOM_FIELD_PREFIX}{kind.value} is not a valid {_WHAT[kind]}: "
                f"{xgrammar_message(exc)}") from None
        raise AssertionError(f"unknown structured output kind {kind!r}")

    def _settle(self, key: tuple, future: Future) -> None:
        """A compile ended: keep a success in the LRU (evicting the oldest
        done grammars past the byte budget), forget a failure."""
        with self._lock:
            if self._futures.get(key) is not future:
                return
            if future.cancelled() or future.exception() is not None:
                del self._futures[key]
                return
            size = future.result().memory_size_bytes
            self._sizes[key] = size
            self._cached_bytes += size
            self._evict()

    def _evict(self) -> None:
        futures = self._futures
        for key in list(futures):
            if self._cached_bytes <= self._cache_bytes:
                return
            if key in self._sizes:  # only done ones; compiling ones stay joinable
                del futures[key]
                self._cached_bytes -= self._sizes.pop(key)

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes


def new_grammar_backend(tokenizer, model_info, config) -> GrammarBackend:
    """The server's backend (model_info: ModelInfo; config: StructuredOutputConfig)."""
    backend = GrammarBackend(tokenizer, model_info.vocab_size, model_info.eos_token_ids,
                             cache_bytes=config.grammar_cache_bytes)
    logger.info("structured outputs: xgrammar over a %d-token vocabulary, stop tokens %s",
                model_info.vocab_size, sorted(model_info.eos_token_ids))
    return backend
