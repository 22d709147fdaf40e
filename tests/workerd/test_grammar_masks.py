"""Grammar masks on the output rank (structured outputs): decoding, the mailbox,
and the sampler's use of them.

* What the controlplane encodes (controlplane/structured/mask_codec.py, any
  of its four encodings, through bytes) decodes to exactly the allowed set it
  started from, whatever the vocabulary size and the junk past it; the four
  encodings of one set decode alike; every malformed mask raises (fail
  closed: never an all-allowed row).
* GrammarMaskBox: take waits for its step, times out or is aborted with an
  error naming the step, drops stale masks and holds a bounded number.
* Sampler: a constrained row samples only allowed tokens and the raw logits
  stay intact (logprobs); when min_tokens forbids all the grammar allows the
  grammar wins (penalties still apply); unconstrained rows beside constrained
  ones sample exactly what they sample alone.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.executor.wire import grammar_masks_to_proto
from controlplane.structured.mask_codec import encode_mask_row
from kvloom.worker.v1 import worker_pb2
from tests.imports import modules_imported
from workerd.runner.sched_output import SamplingParams
from workerd.sample.grammar_masks import (
    GrammarMaskBox,
    GrammarMasksMissing,
    decode_token_masks,
)
from workerd.sample.sampler import GrammarMetadata, Sampler, SamplingMetadata

torch.set_num_threads(1)


def test_the_worker_needs_neither_the_controlplane_nor_a_grammar_library():
    code = "import workerd.worker, workerd.runner.model_runner, workerd.sample.grammar_masks"
    assert modules_imported(code, "controlplane") == []
    assert modules_imported(code, "xgrammar") == []


# ---- encoding helpers ----------------------------------------------------------


def words_of(allowed: np.ndarray, rng: np.random.Generator, extra_words: int = 0) -> np.ndarray:
    """xgrammar's row for `allowed`: ceil(V / 32) int32 words (plus extra_words),
    with random junk in every bit past the vocabulary."""
    vocab = len(allowed)
    num_words = -(-vocab // 32) + extra_words
    bits = rng.random(num_words * 32) < 0.5
    bits[:vocab] = allowed
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


def on_the_wire(masks) -> list[worker_pb2.TokenMask]:
    """Controlplane TokenMasks as the output rank parses them."""
    cmd = grammar_masks_to_proto(5, list(masks))
    parsed = worker_pb2.ControlMessage.FromString(cmd.SerializeToString())
    return list(parsed.grammar_masks.masks)


def allowed_set(vocab: int, density: float, rng: np.random.Generator) -> np.ndarray:
    allowed = rng.random(vocab) < density
    if not allowed.any():
        allowed[rng.integers(vocab)] = True  # a grammar always allows something
    return allowed


def every_encoding(allowed: np.ndarray, rng: np.random.Generator) -> list[worker_pb2.TokenMask]:
    ids = np.flatnonzero(allowed).tolist()
    forbidden = np.flatnonzero(~allowed).tolist()
    out = [
        worker_pb2.TokenMask(bitmask=words_of(allowed, rng).astype("<i4").tobytes()),
        worker_pb2.TokenMask(allowed=worker_pb2.TokenIdList(ids=ids)),
        worker_pb2.TokenMask(disallowed=worker_pb2.TokenIdList(ids=forbidden)),
    ]
    if allowed.all():
        out.append(worker_pb2.TokenMask(unconstrained=True))
    return out


VOCABS = st.one_of(st.integers(1, 200), st.sampled_from([31, 32, 33, 63, 64, 65, 511, 49152]))
DENSITIES = st.sampled_from([0.0, 0.002, 0.03, 0.5, 0.97, 0.998, 1.0])


# ---- decode ----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(vocab=VOCABS, densities=st.lists(DENSITIES, min_size=1, max_size=4),
       seed=st.integers(0, 2**32 - 1), extra_words=st.integers(0, 2),
       small=st.sampled_from([0, 64]))
def test_what_the_controlplane_encodes_decodes_to_the_same_allowed_set(
        vocab, densities, seed, extra_words, small):
    rng = np.random.default_rng(seed)
    rows = [allowed_set(vocab, d, rng) for d in densities]
    masks = [encode_mask_row(words_of(a, rng, extra_words), vocab, small_row_words=small)
             for a in rows]
    decoded = decode_token_masks(on_the_wire(masks), vocab, "cpu")
    assert decoded.dtype == torch.bool and decoded.shape == (len(rows), vocab)
    assert np.array_equal(decoded.numpy(), np.stack(rows))


@settings(max_examples=100, deadline=None)
@given(vocab=VOCABS, density=DENSITIES, seed=st.integers(0, 2**32 - 1))
def test_every_encoding_of_one_set_decodes_alike(vocab, density, seed):
    rng = np.random.default_rng(seed)
    allowed = allowed_set(vocab, density, rng)
    encodings = every_encoding(allowed, rng)
    decoded = decode_token_masks(encodings, vocab, "cpu")
    for row in decoded:
        assert np.array_equal(row.numpy(), allowed)


def test_the_round_trip_reaches_all_four_encodings():
    rng = np.random.default_rng(0)
    vocab = 49152
    kinds = set()
    for density in (0.0, 0.5, 0.9999, 1.0):
        kinds.add(encode_mask_row(words_of(allowed_set(vocab, density, rng), rng), vocab).kind)
    assert kinds == {"allowed", "bitmask", "disallowed", "unconstrained"}


def test_a_bitmask_unpacks_bit_j_of_word_i_as_token_32i_plus_j():
    # Word 0 = 0x80000001 (bits 0 and 31), word 1 = 0x4 (bit 2): tokens 0, 31, 34.
    raw = np.array([-(2**31) + 1, 4], dtype="<i4").tobytes()
    decoded = decode_token_masks([worker_pb2.TokenMask(bitmask=raw)], 40, "cpu")
    assert torch.nonzero(decoded[0]).flatten().tolist() == [0, 31, 34]


VOCAB = 40
GOOD = worker_pb2.TokenMask(allowed=worker_pb2.TokenIdList(ids=[1, 2]))
MALFORMED = {
    "empty": worker_pb2.TokenMask(),
    "short bitmask": worker_pb2.TokenMask(bitmask=b"\xff" * 4),
    "long bitmask": worker_pb2.TokenMask(bitmask=b"\xff" * 12),
    "empty bitmask": worker_pb2.TokenMask(bitmask=b""),
    "allowed id at vocab": worker_pb2.TokenMask(allowed=worker_pb2.TokenIdList(ids=[3, VOCAB])),
    "disallowed id past vocab": worker_pb2.TokenMask(
        disallowed=worker_pb2.TokenIdList(ids=[2**32 - 1])),
    "unconstrained false": worker_pb2.TokenMask(unconstrained=False),
    "allows nothing (empty list)": worker_pb2.TokenMask(allowed=worker_pb2.TokenIdList()),
    "allows nothing (all disallowed)": worker_pb2.TokenMask(
        disallowed=worker_pb2.TokenIdList(ids=list(range(VOCAB)))),
    # Only the bits past the vocabulary are set: they never count.
    "allows nothing (bitmask junk only)": worker_pb2.TokenMask(
        bitmask=np.array([0, -256], dtype="<i4").tobytes()),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_mask_raises_and_takes_the_good_ones_down_with_it(name):
    bad = MALFORMED[name]
    if name == "unconstrained false":
        assert bad.WhichOneof("mask") == "unconstrained"  # set, but to false
    with pytest.raises(ValueError, match="grammar mask 1"):
        decode_token_masks([GOOD, bad, GOOD], VOCAB, "cpu")


# ---- the box --------------------------------------------------------------------


def masks_msg(step_id: int, n: int = 1) -> worker_pb2.GrammarMasks:
    return worker_pb2.GrammarMasks(
        step_id=step_id, masks=[worker_pb2.TokenMask(unconstrained=True)] * n)


def later(delay_s: float, fn, *args) -> threading.Thread:
    t = threading.Timer(delay_s, fn, args)
    t.start()
    return t


def test_take_returns_masks_already_in_and_waits_for_later_ones():
    box = GrammarMaskBox()
    box.put(masks_msg(3, n=2))
    assert len(box.take(3, timeout_s=1.0).masks) == 2
    t = later(0.1, box.put, masks_msg(4))
    t0 = time.monotonic()
    assert box.take(4, timeout_s=10.0).step_id == 4
    assert 0.05 < time.monotonic() - t0 < 5.0
    t.join()
    assert len(box) == 0


def test_take_times_out_naming_the_step():
    box = GrammarMaskBox()
    box.put(masks_msg(8))  # another step's masks do not count
    with pytest.raises(GrammarMasksMissing, match=r"step 7: .* within 0.05 s"):
        box.take(7, timeout_s=0.05)


def test_abort_ends_a_wait_at_once_and_every_wait_until_clear():
    box = GrammarMaskBox()
    t = later(0.1, box.abort, "Reset")
    t0 = time.monotonic()
    with pytest.raises(GrammarMasksMissing, match=r"step 1: .*aborted.*Reset"):
        box.take(1, timeout_s=30.0)
    assert time.monotonic() - t0 < 5.0
    t.join()
    with pytest.raises(GrammarMasksMissing, match="aborted"):
        box.take(2, timeout_s=30.0)
    box.clear()
    box.put(masks_msg(2))
    assert box.take(2, timeout_s=1.0).step_id == 2


def test_clear_drops_the_masks_and_lets_step_ids_start_again():
    box = GrammarMaskBox()
    box.put(masks_msg(10))
    assert box.take(10, timeout_s=1.0)
    box.put(masks_msg(11))
    box.clear()
    assert len(box) == 0
    with pytest.raises(GrammarMasksMissing):
        box.take(11, timeout_s=0.01)
    box.put(masks_msg(1))  # a new group numbers its steps from the start
    assert box.take(1, timeout_s=1.0).step_id == 1


def test_stale_masks_are_dropped_and_what_it_holds_is_bounded():
    box = GrammarMaskBox(max_steps=4)
    for step_id in (1, 2, 3):
        box.put(masks_msg(step_id))
    box.take(2, timeout_s=1.0)
    assert len(box) == 1  # step 1 will never be taken
    box.put(masks_msg(1))  # older than a step taken: dropped
    box.put(masks_msg(2))
    assert len(box) == 1
    for step_id in range(4, 10):
        box.put(masks_msg(step_id))
    assert len(box) == 4  # 6..9: the oldest went first
    with pytest.raises(GrammarMasksMissing):
        box.take(5, timeout_s=0.01)
    assert box.take(9, timeout_s=1.0).step_id == 9


# ---- the sampler ------------------------------------------------------------------

V = 50


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def grammar(rows: list[int], allowed_ids: list[list[int]], vocab: int = V) -> GrammarMetadata:
    allowed = torch.zeros((len(rows), vocab), dtype=torch.bool)
    for i, ids in enumerate(allowed_ids):
        allowed[i, ids] = True
    return GrammarMetadata(torch.tensor(rows), allowed)


def sample(logits, params, gram=None, generators=None, output_token_ids=None, default_seed=0):
    generators = generators or [None] * len(params)
    md = SamplingMetadata.from_params(params, generators, output_token_ids=output_token_ids)
    md.grammar = gram
    return Sampler(_gen(default_seed))(logits, md)


def test_a_grammar_row_takes_the_best_allowed_token_and_leaves_raw_logits_alone():
    logits = torch.randn(3, V, generator=_gen(1))
    raw = logits.clone()
    allowed = [int(logits[1].argsort()[3]), int(logits[1].argsort()[7])]  # two poor tokens
    greedy = SamplingParams(temperature=0.0)
    out = sample(logits, [greedy] * 3, grammar([1], [allowed]))
    assert out[1].item() == max(allowed, key=lambda t: logits[1, t].item())
    assert out[0].item() == logits[0].argmax().item()
    assert out[2].item() == logits[2].argmax().item()
    assert torch.equal(logits, raw)


def test_a_sampled_grammar_row_draws_only_allowed_tokens():
    logits = torch.zeros(400, V)  # uniform: every token equally likely
    params = [SamplingParams(temperature=1.0, top_k=40, top_p=0.9)] * 400
    allowed = [[3, 17, 44]] * 400
    out = sample(logits, params, grammar(list(range(400)), allowed))
    assert set(out.tolist()) == {3, 17, 44}


def test_when_min_tokens_forbids_all_the_grammar_allows_the_grammar_wins():
    eos = [5, 6]
    logits = torch.zeros(2, V)
    logits[:, 9] = 9.0  # the model's favourite, which the grammar forbids
    logits[:, 5] = 3.0
    logits[:, 6] = 2.0
    raw = logits.clone()
    params = [SamplingParams(temperature=0.0, min_tokens=4, min_tokens_stop_ids=tuple(eos),
                             repetition_penalty=2.0)] * 2
    # Row 0 produced 5 before (penalized: 3 / 2 < 2); row 1 has nothing to penalize.
    outputs = [[5], [0]]
    # Both grammars ended: only the stop tokens may come.
    out = sample(logits, params, grammar([0, 1], [eos, eos]), output_token_ids=outputs)
    assert out.tolist() == [6, 5]
    assert torch.equal(logits, raw)
    # With a token the grammar allows beside the stop ones, min_tokens holds.
    out = sample(logits, params, grammar([0, 1], [[*eos, 30], [*eos, 31]]),
                 output_token_ids=outputs)
    assert out.tolist() == [30, 31]


def test_unconstrained_rows_beside_constrained_ones_sample_what_they_sample_alone():
    logits = torch.randn(4, V, generator=_gen(3))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=11, top_p=0.95),
        SamplingParams(temperature=0.8, seed=12, top_k=10),
    ]

    def gens():
        return [None, None, _gen(11), _gen(12)]

    constrained = grammar([0, 2], [[1, 2, 3], [4, 5]])
    for _ in range(3):
        mixed = sample(logits, params, constrained, gens())
        assert mixed[0].item() in (1, 2, 3) and mixed[2].item() in (4, 5)
        for row in (1, 3):
            alone = sample(logits[row:row + 1], [params[row]], None, [gens()[row]])
            assert mixed[row].item() == alone.item(), row
        plain = sample(logits, params, None, gens())
        assert mixed[[1, 3]].tolist() == plain[[1, 3]].tolist()
