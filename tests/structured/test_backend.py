"""The controlplane's grammar backend: compiles off the caller's thread, one
compile per spec, an LRU bounded by bytes, and failures as errors."""

from __future__ import annotations

import threading

import pytest

from controlplane.core.request import RequestStatus, grammar_status_after
from controlplane.structured.backend import GrammarCompileError
from controlplane.structured.mask_codec import unconstrained_mask
from controlplane.structured.params import StructuredOutputKind as Kind
from controlplane.structured.params import StructuredOutputsParams
from kvloom_testing.structured import EXAMPLES, backend_for, choice, grammar, regex


def test_equal_specs_share_one_compile_and_a_hit_is_done_at_once(backend):
    params = regex(r"[a-c]{4}")
    first = backend.compile(params)
    first.result(timeout=60)
    compiles = backend.num_compiles
    again = backend.compile(regex(r"[a-c]{4}"))
    assert again is first and again.done()
    assert backend.num_compiles == compiles
    other = backend.compile(regex(r"[a-c]{5}"))
    other.result(timeout=60)
    assert backend.num_compiles == compiles + 1


def test_a_spec_that_does_not_compile_fails_and_is_not_cached(backend):
    # Passes xgrammar's parse but names a rule that does not exist.
    bad = grammar('root ::= item\nitem ::= missing')
    failed = backend.compile(bad)
    with pytest.raises(GrammarCompileError, match="sampling.grammar is not a valid grammar"):
        failed.result(timeout=60)
    retry = backend.compile(bad)
    assert retry is not failed  # a failure is forgotten, never served from the cache
    with pytest.raises(GrammarCompileError):
        retry.result(timeout=60)


def test_the_cache_is_bounded_by_bytes(tiny_model_dir):
    small = backend_for(tiny_model_dir, cache_bytes=1)
    try:
        first = small.compile(regex("a+"))
        first.result(timeout=60)
        assert small.cached_bytes == 0  # over the budget: not kept
        assert small.compile(regex("a+")) is not first
    finally:
        small.shutdown()


def test_compiles_run_off_the_calling_thread(backend):
    started = threading.Event()
    release = threading.Event()
    original = backend._compile

    def slow(params):
        started.set()
        assert threading.current_thread() is not threading.main_thread()
        release.wait(10)
        return original(params)

    backend._compile = slow
    try:
        future = backend.compile(choice("x", "y", "zed"))
        assert started.wait(10) and not future.done()  # compile() returned while it runs
        release.set()
        future.result(timeout=60)
    finally:
        backend._compile = original


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_the_matcher_fills_masks_and_refuses_a_forbidden_token(backend, kind, tiny_model_dir):
    import xgrammar as xgr

    grammar_state = backend.new_request_grammar(backend.compile(EXAMPLES[kind]).result(timeout=60))
    scratch = xgr.allocate_token_bitmask(1, backend.vocab_size)
    mask = grammar_state.fill(scratch)
    assert mask.kind in ("allowed", "disallowed", "bitmask")
    assert mask != unconstrained_mask()
    allowed = set(mask.data) if mask.kind == "allowed" else None
    if allowed is not None:
        forbidden = next(t for t in range(backend.vocab_size) if t not in allowed)
        assert grammar_status_after(grammar_state, forbidden, ignore_eos=False) is \
            RequestStatus.FINISHED_ERROR


def test_a_stuck_compile_does_not_hold_up_another_spec(tiny_model_dir):
    b = backend_for(tiny_model_dir)
    release = threading.Event()
    original = b._compile

    def stuck_on_one(params):
        if params.spec == "z{3}":
            release.wait(30)
        return original(params)

    b._compile = stuck_on_one
    try:
        stuck = b.compile(regex("z{3}"))
        others = [b.compile(regex(f"y{{{n}}}")) for n in range(2, 5)]
        for future in others:
            future.result(timeout=30)  # done while the first one still runs
        assert not stuck.done()
    finally:
        release.set()
        b.shutdown()
    stuck.result(timeout=30)
    assert b._num_threads <= b.max_compile_threads


@pytest.mark.parametrize(("params", "reason"), [
    (StructuredOutputsParams(Kind.JSON_SCHEMA, '{"type": "frobnicate"}'),
     'sampling.json_schema is not a valid JSON Schema: Unsupported type "frobnicate"'),
    (regex("(ab"), "sampling.regex is not a valid regular expression: Regex parsing error"),
    (regex("[z-a]"), "sampling.regex is not a valid regular expression: "),
    (grammar('root ::= "a'),
     "sampling.grammar is not a valid grammar (EBNF or Lark): EBNF lexer error"),
    (grammar("start: ("), "sampling.grammar is not a valid grammar (EBNF or Lark): "),
    (grammar("just some words"), "sampling.grammar is not a valid grammar (EBNF or Lark): "),
    (StructuredOutputsParams(Kind.STRUCTURAL_TAG, "{}"),
     "sampling.structural_tag is not a valid structural tag (JSON): "),
    (StructuredOutputsParams(Kind.STRUCTURAL_TAG, "[]"),
     "sampling.structural_tag is not a valid structural tag (JSON): "),
])
def test_specs_xgrammar_refuses_fail_their_compile_with_its_reason(backend, params, reason):
    """xgrammar parses in the compile, off the API's threads (validate.py
    leaves it there): its refusal becomes the request's INVALID_ARGUMENT."""
    with pytest.raises(GrammarCompileError) as info:
        backend.compile(params).result(timeout=60)
    message = str(info.value)
    assert message.startswith(reason), message
    assert "\n" not in message and "/project/cpp" not in message and len(message) < 700
