"""reply_check on its own: every way a step reply can fail to match its step
raises ProtocolViolation naming the rank and the mismatch, well-formed replies
pass (boundaries included), and Hypothesis finds no reply that is accepted
malformed or that raises anything but ProtocolViolation.

The check reads only the step's ExpectedReply, the scheduler's record of who
samples; that record is checked against real workers in
tests/inprocess/test_reply_check_real_worker.py.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from controlplane.core.outputs import (
    ExpectedReply,
    ModelRunnerOutput,
    PromptLogprobs,
    PromptLogprobsWindow,
    TokenLogprobs,
)
from controlplane.executor.reply_check import (
    ProtocolViolation,
    check_model_runner_output,
    check_step_reply,
    reply_payload_problem,
)
from controlplane.executor.worker_calls import WorkerGroupFailed
from kvloom.worker.v1 import worker_pb2

VOCAB = 100
RANK = 3


def _step(
    sampling: dict[str, int | None],
    partial: tuple[str, ...] = (),
    windows: dict[str, PromptLogprobsWindow] | None = None,
    step_id: int = 9,
) -> ExpectedReply:
    """The reply a step expects whose `sampling` requests sample and `partial`
    ones prefill a chunk (which samples nothing, so it is in no record: the
    check never sees the step itself)."""
    del partial
    return ExpectedReply(step_id, dict(sampling), dict(windows or {}))


def _entry(num_top: int, first: int = 0) -> TokenLogprobs:
    ids = [(first + i) % VOCAB for i in range(num_top)]
    return TokenLogprobs(-0.5, 1, ids, [-0.5 - i for i in range(num_top)])


# a asks 2 logprobs, b none, c 0 (its own logprob and rank only); p prefills a
# partial chunk with prompt logprobs of positions [1, 6), top 3.
STEP = _step(
    {"a": 2, "b": None, "c": 0},
    partial=("p",),
    windows={"p": PromptLogprobsWindow(3, 1, 6), "a": PromptLogprobsWindow(1, 4, 8)},
)


def _good() -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=["c", "a", "b"],  # any order: the worker's batch order
        sampled_token_ids=[5, VOCAB - 1, 0],
        logprobs=[_entry(0), _entry(2), None],
        prompt_logprobs=[
            PromptLogprobs("p", 1, [_entry(3, i) for i in range(5)]),
            PromptLogprobs("a", 5, [_entry(1, 4)]),
        ],
    )


def _violation(out: ModelRunnerOutput, so: ExpectedReply = STEP) -> str:
    with pytest.raises(ProtocolViolation) as info:
        check_model_runner_output(out, so, VOCAB, RANK)
    assert info.value.rank == RANK
    assert isinstance(info.value, WorkerGroupFailed)  # the executor's one failure type
    prefix = f"protocol violation: rank {RANK} answered step {so.step_id}: "
    message = str(info.value)
    assert message.startswith(prefix)
    return message[len(prefix):]


def test_well_formed_replies_pass():
    check_model_runner_output(_good(), STEP, VOCAB, RANK)
    # A step that samples nothing (finished ids only, or partial chunks) is an
    # empty reply.
    check_model_runner_output(ModelRunnerOutput([], []), _step({}), VOCAB, RANK)
    check_model_runner_output(ModelRunnerOutput([], []), _step({}, partial=("p",)), VOCAB, RANK)
    # Nobody asked for logprobs: the list stays empty.
    check_model_runner_output(ModelRunnerOutput(["x"], [1]), _step({"x": None}), VOCAB, RANK)
    # Asking for more candidates than the vocabulary has gets the vocabulary.
    out = ModelRunnerOutput(["x"], [1], logprobs=[_entry(VOCAB)])
    check_model_runner_output(out, _step({"x": VOCAB + 50}), VOCAB, RANK)
    # A probability of zero, and the worst rank, are log-probabilities too.
    entry = TokenLogprobs(-math.inf, VOCAB, [3], [-math.inf])
    check_model_runner_output(
        ModelRunnerOutput(["x"], [1], logprobs=[entry]), _step({"x": 1}), VOCAB, RANK
    )


def _with(**changes) -> ModelRunnerOutput:
    out = _good()
    for name, value in changes.items():
        setattr(out, name, value)
    return out


def _bad_entry(**changes) -> ModelRunnerOutput:
    """_good() with the logprobs entry of a (asked for 2) changed."""
    out = _good()
    for name, value in changes.items():
        setattr(out.logprobs[1], name, value)
    return out


def _bad_prompt(**changes) -> ModelRunnerOutput:
    out = _good()
    for name, value in changes.items():
        setattr(out.prompt_logprobs[0].positions[1], name, value)
    return out


@pytest.mark.parametrize(
    ("out", "what"),
    [
        # Reproduction 4 of issue 10: fewer sampled tokens than requests.
        (_with(sampled_token_ids=[5, 6]), "2 sampled token(s) for 3 request id(s)"),
        (_with(sampled_token_ids=[5, 6, 7, 8]), "4 sampled token(s) for 3 request id(s)"),
        (
            _with(req_ids=["c", "a"], sampled_token_ids=[5, 6], logprobs=[]),
            "no token for request(s) 'b'",
        ),
        (
            _with(req_ids=["c", "a", "zz"]),
            "a token for request 'zz', which samples nothing this step",
        ),
        # p is scheduled, but its chunk ends before its context: it samples nothing.
        (
            _with(req_ids=["c", "a", "p"]),
            "a token for request 'p', which samples nothing this step",
        ),
        (_with(req_ids=["c", "a", "a"]), "request 'a' sampled twice"),
        # Reproduction 4 of issue 10: a token id far outside the vocabulary.
        (
            _with(sampled_token_ids=[5, 4_000_000_000, 0]),
            "token id 4000000000 for request 'a' is outside the vocabulary (size 100)",
        ),
        (
            _with(sampled_token_ids=[5, VOCAB, 0]),
            "token id 100 for request 'a' is outside the vocabulary (size 100)",
        ),
        (
            _with(sampled_token_ids=[5, -1, 0]),
            "token id -1 for request 'a' is outside the vocabulary (size 100)",
        ),
        (_with(logprobs=[]), "no logprobs for request(s) 'a', 'c', which asked"),
        (_with(logprobs=[_entry(0), _entry(2)]), "2 logprobs entries for 3 sampled token(s)"),
        (
            _with(logprobs=[_entry(0), _entry(2), _entry(0)]),
            "logprobs for request 'b', which did not ask",
        ),
        (
            _with(logprobs=[_entry(0), None, None]),
            "no logprobs for request 'a', which asked for 2",
        ),
        (
            _bad_entry(top_token_ids=[1]),
            "logprobs of request 'a': 1 top token id(s) and 2 logprob(s), asked for 2",
        ),
        (
            _bad_entry(top_logprobs=[-1.0, -2.0, -3.0]),
            "logprobs of request 'a': 2 top token id(s) and 3 logprob(s), asked for 2",
        ),
        (
            _bad_entry(top_token_ids=[1, 4_000_000_000]),
            "logprobs of request 'a': token id 4000000000 is outside the vocabulary (size 100)",
        ),
        (_bad_entry(top_token_ids=[7, 7]), "logprobs of request 'a': a top token id repeats"),
        (_bad_entry(rank=0), "logprobs of request 'a': rank 0 is outside [1, 100]"),
        (_bad_entry(rank=VOCAB + 1), "logprobs of request 'a': rank 101 is outside [1, 100]"),
        (_bad_entry(logprob=math.nan), "logprobs of request 'a': nan is not a log-probability"),
        (_bad_entry(logprob=0.5), "logprobs of request 'a': 0.5 is not a log-probability"),
        (
            _bad_entry(top_logprobs=[-1.0, math.inf]),
            "logprobs of request 'a': inf is not a log-probability",
        ),
        (
            _with(prompt_logprobs=[PromptLogprobs("b", 1, [_entry(3)])]),
            "prompt logprobs for request 'b', which did not ask for them or computes no "
            "prompt position this step",
        ),
        (
            _with(prompt_logprobs=[PromptLogprobs("p", 1, [_entry(3, i) for i in range(6)])]),
            "prompt logprobs of request 'p' cover positions [1, 7), this step computes [1, 6)",
        ),
        (
            _with(prompt_logprobs=[PromptLogprobs("a", 3, [_entry(1)])]),
            "prompt logprobs of request 'a' cover positions [3, 4), this step computes [4, 8)",
        ),
        (
            _with(prompt_logprobs=[PromptLogprobs("p", 2, [])]),
            "prompt logprobs of request 'p' cover positions [2, 2), this step computes [1, 6)",
        ),
        (
            _with(prompt_logprobs=[PromptLogprobs("p", 1, [_entry(3)])] * 2),
            "prompt logprobs for request 'p' twice",
        ),
        (
            _bad_prompt(top_token_ids=[1, 2]),
            "prompt logprobs of request 'p' at position 2: 2 top token id(s) and 3 logprob(s), "
            "asked for 3",
        ),
        (
            _bad_prompt(top_token_ids=[1, 2, VOCAB]),
            "prompt logprobs of request 'p' at position 2: token id 100 is outside the "
            "vocabulary (size 100)",
        ),
    ],
)
def test_each_mismatch_is_a_protocol_violation_naming_it(out, what):
    assert _violation(out) == what


def test_long_lists_of_missing_ids_are_cut_short():
    so = _step(dict.fromkeys([f"r{i}" for i in range(9)]))
    assert _violation(ModelRunnerOutput([], []), so) == (
        "no token for request(s) 'r0', 'r1', 'r2', 'r3', 'r4' and 4 more"
    )


# ---- the proto reply, as the executor receives it ---------------------------


def _proto(out: ModelRunnerOutput) -> worker_pb2.ModelRunnerOutput:
    msg = worker_pb2.ModelRunnerOutput(req_ids=out.req_ids, sampled_token_ids=out.sampled_token_ids)
    for entry in out.logprobs:
        _fill(msg.logprobs.add(), entry)
    for chunk in out.prompt_logprobs:
        pb = msg.prompt_logprobs.add(req_id=chunk.req_id, start_position=chunk.start_position)
        for entry in chunk.positions:
            _fill(pb.positions.add(), entry)
    return msg


def _fill(pb: worker_pb2.TokenLogprobs, entry: TokenLogprobs | None) -> None:
    if entry is not None:
        pb.logprob, pb.rank = entry.logprob, entry.rank
        pb.top_token_ids.extend(entry.top_token_ids)
        pb.top_logprobs.extend(entry.top_logprobs)


def test_proto_replies_are_converted_then_checked():
    out = check_step_reply(_proto(_good()), STEP, VOCAB, RANK)
    assert out.req_ids == ["c", "a", "b"] and out.sampled_token_ids == [5, VOCAB - 1, 0]
    assert out.logprobs[2] is None and out.logprobs[1].top_token_ids == [0, 1]

    bad = _proto(_good())
    bad.sampled_token_ids[1] = 4_000_000_000
    with pytest.raises(ProtocolViolation, match="token id 4000000000 for request 'a'"):
        check_step_reply(bad, STEP, VOCAB, RANK)
    # What the wire module refuses while converting is a violation too.
    bad = _proto(_good())
    del bad.logprobs[2]
    with pytest.raises(ProtocolViolation) as info:
        check_step_reply(bad, STEP, VOCAB, RANK)
    assert str(info.value) == (
        "protocol violation: rank 3 answered step 9: 2 logprobs entries for 3 sampled tokens"
    )
    bad = _proto(_good())
    bad.prompt_logprobs[0].positions[2].rank = 0
    with pytest.raises(ProtocolViolation, match="prompt logprobs of 'p' have an empty position"):
        check_step_reply(bad, STEP, VOCAB, RANK)


# ---- the envelope: which call, which rank, which payload ---------------------


def test_reply_payload_problems():
    ok = reply_payload_problem("execute_model", {1}, {}, 1, "model_runner_output")
    assert ok is None
    assert reply_payload_problem("profile_memory", {0, 1}, {0: 1}, 1, "memory_profile") is None
    assert reply_payload_problem("ping", {0, 1}, {}, 0, "ack") is None
    assert reply_payload_problem("execute_model", {1}, {}, 0, "model_runner_output") == (
        "answered execute_model, which only rank(s) [1] answer"
    )
    assert reply_payload_problem("ping", {0, 1}, {0: 1}, 0, "ack") == "answered ping twice"
    assert reply_payload_problem("execute_model", {0}, {}, 0, "memory_profile") == (
        "answered execute_model with memory_profile instead of model_runner_output"
    )
    assert reply_payload_problem("profile_memory", {0}, {}, 0, "ack") == (
        "answered profile_memory with ack instead of memory_profile"
    )
    assert reply_payload_problem("load_model", {0}, {}, 0, None) == (
        "answered load_model with an empty message instead of model_loaded"
    )
    assert reply_payload_problem("ping", {0}, {}, 0, "register") == (
        "answered ping with register instead of ack"
    )


# ---- fuzz ---------------------------------------------------------------------

_IDS = ["a", "b", "c", "d", "e"]


@st.composite
def steps(draw) -> ExpectedReply:
    """A step: some of _IDS sample (each maybe asking logprobs), some prefill."""
    roles = draw(st.lists(st.sampled_from(["sample", "partial", "off"]), min_size=5, max_size=5))
    sampling = {
        r: draw(st.one_of(st.none(), st.integers(0, 4)))
        for r, role in zip(_IDS, roles, strict=True) if role == "sample"
    }
    partial = tuple(r for r, role in zip(_IDS, roles, strict=True) if role == "partial")
    windows = {}
    for r in draw(st.sets(st.sampled_from([*sampling, *partial]))) if sampling or partial else ():
        start = draw(st.integers(1, 6))
        windows[r] = PromptLogprobsWindow(draw(st.integers(0, 3)), start, start + draw(
            st.integers(1, 4)))
    return _step(sampling, partial, windows, step_id=draw(st.integers(1, 10**6)))


_logprob = st.one_of(st.floats(max_value=0.0, allow_nan=False), st.just(-math.inf))


@st.composite
def entries(draw, num_top: int) -> TokenLogprobs:
    k = min(num_top, VOCAB)
    return TokenLogprobs(
        draw(_logprob),
        draw(st.integers(1, VOCAB)),
        draw(st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k, unique=True)),
        draw(st.lists(_logprob, min_size=k, max_size=k)),
    )


@st.composite
def well_formed(draw, so: ExpectedReply) -> ModelRunnerOutput:
    req_ids = draw(st.permutations(list(so.sampling_reqs)))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(req_ids),
                           max_size=len(req_ids)))
    out = ModelRunnerOutput(req_ids, tokens)
    asked = [so.sampling_reqs[r] for r in req_ids]
    if any(k is not None for k in asked):
        out.logprobs = [None if k is None else draw(entries(k)) for k in asked]
    for req_id, w in so.prompt_logprobs_windows.items():
        if draw(st.booleans()):  # a worker need not return every position it may
            start = draw(st.integers(w.start, w.stop - 1))
            n = draw(st.integers(1, w.stop - start))
            positions = [draw(entries(w.num_top)) for _ in range(n)]
            out.prompt_logprobs.append(PromptLogprobs(req_id, start, positions))
    return out


def _drop_token(out, so, draw):
    if not out.req_ids:
        return False
    i = draw(st.integers(0, len(out.req_ids) - 1))
    del out.sampled_token_ids[i]
    return True


def _drop_request(out, so, draw):
    if not out.req_ids:
        return False
    del out.req_ids[-1], out.sampled_token_ids[-1]
    if out.logprobs:
        del out.logprobs[-1]
    return True


def _extra_request(out, so, draw):
    req_id = draw(st.sampled_from([*(r for r in _IDS if r not in so.sampling_reqs), "zz"]))
    out.req_ids.append(req_id)
    out.sampled_token_ids.append(1)
    if out.logprobs:
        out.logprobs.append(None)
    return True


def _duplicate(out, so, draw):
    if not out.req_ids:
        return False
    out.req_ids.append(out.req_ids[0])
    out.sampled_token_ids.append(1)
    if out.logprobs:
        out.logprobs.append(out.logprobs[0])
    return True


def _out_of_vocab(out, so, draw):
    if not out.req_ids:
        return False
    out.sampled_token_ids[draw(st.integers(0, len(out.req_ids) - 1))] = draw(
        st.integers(VOCAB, 2**32 - 1))
    return True


def _bad_logprob_value(out, so, draw):
    rows = [e for e in out.logprobs if e is not None]
    if not rows:
        return False
    draw(st.sampled_from(rows)).logprob = draw(
        st.one_of(st.just(math.nan), st.floats(min_value=0.01, allow_nan=False)))
    return True


def _wrong_top_count(out, so, draw):
    rows = [e for e in out.logprobs if e is not None]
    if not rows:
        return False
    entry = draw(st.sampled_from(rows))
    entry.top_token_ids = [*entry.top_token_ids, VOCAB - 1]
    entry.top_logprobs = [*entry.top_logprobs, -1.0]
    return True


def _prompt_logprobs_unasked(out, so, draw):
    unasked = [r for r in _IDS if r not in so.prompt_logprobs_windows]
    if not unasked:
        return False
    out.prompt_logprobs.append(PromptLogprobs(draw(st.sampled_from(unasked)), 1, [_entry(0)]))
    return True


def _prompt_logprobs_past_window(out, so, draw):
    if not out.prompt_logprobs:
        return False
    chunk = out.prompt_logprobs[0]
    w = so.prompt_logprobs_windows[chunk.req_id]
    chunk.positions = [_entry(w.num_top)] * (w.stop - chunk.start_position + 1)
    return True


MUTATIONS = [
    _drop_token, _drop_request, _extra_request, _duplicate, _out_of_vocab, _bad_logprob_value,
    _wrong_top_count, _prompt_logprobs_unasked, _prompt_logprobs_past_window,
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), so=steps(), mutation=st.one_of(st.none(), st.sampled_from(MUTATIONS)))
def test_fuzz_accepts_exactly_the_well_formed_replies(data, so, mutation):
    out = data.draw(well_formed(so))
    mutated = mutation is not None and mutation(out, so, data.draw)
    event("mutated" if mutated else "well-formed")
    if not mutated:
        check_model_runner_output(out, so, VOCAB, RANK)
        return
    with pytest.raises(ProtocolViolation, match=rf"^protocol violation: rank {RANK} "):
        check_model_runner_output(out, so, VOCAB, RANK)


# Arbitrary proto replies: values anywhere in their wire types, ids from a pool
# that mixes the step's requests with strangers.
_u32 = st.one_of(st.integers(0, VOCAB + 1), st.integers(0, 2**32 - 1))
_f32 = st.floats(width=32)
_pb_entries = st.builds(
    worker_pb2.TokenLogprobs,
    logprob=_f32,
    rank=_u32,
    top_token_ids=st.lists(_u32, max_size=6),
    top_logprobs=st.lists(_f32, max_size=6),
)
_pb_ids = st.lists(st.sampled_from([*_IDS, "zz", ""]), max_size=7)


@st.composite
def arbitrary_replies(draw) -> worker_pb2.ModelRunnerOutput:
    req_ids = draw(_pb_ids)
    n = len(req_ids) + draw(st.sampled_from([0, 0, 0, -1, 1]))
    msg = worker_pb2.ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=draw(st.lists(_u32, min_size=max(n, 0), max_size=max(n, 0))),
        logprobs=draw(st.lists(_pb_entries, max_size=7)),
    )
    for _ in range(draw(st.integers(0, 2))):
        msg.prompt_logprobs.add(
            req_id=draw(st.sampled_from([*_IDS, "zz"])),
            start_position=draw(_u32),
            positions=draw(st.lists(_pb_entries, max_size=4)),
        )
    return msg


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(so=steps(), msg=arbitrary_replies())
def test_fuzz_arbitrary_replies_raise_only_protocol_violations(so, msg):
    try:
        out = check_step_reply(msg, so, VOCAB, RANK)
    except ProtocolViolation as exc:
        event("refused")
        assert str(exc).startswith(f"protocol violation: rank {RANK} answered step {so.step_id}: ")
        return
    event("accepted")
    # Accepted: every promise the scheduler relies on holds.
    assert sorted(out.req_ids) == sorted(so.sampling_reqs)
    assert len(out.sampled_token_ids) == len(out.req_ids)
    assert all(0 <= t < VOCAB for t in out.sampled_token_ids)
    assert out.logprobs == [] or len(out.logprobs) == len(out.req_ids)
    for req_id, entry in zip(out.req_ids, out.logprobs, strict=False):
        asked = so.sampling_reqs[req_id]
        assert (entry is None) == (asked is None)
        if entry is not None:
            assert len(entry.top_token_ids) == min(asked, VOCAB)
            assert all(0 <= t < VOCAB for t in entry.top_token_ids)
    for chunk in out.prompt_logprobs:
        w = so.prompt_logprobs_windows[chunk.req_id]
        assert w.start <= chunk.start_position < chunk.start_position + len(chunk.positions)
        assert chunk.start_position + len(chunk.positions) <= w.stop


# Speculative decoding: "d" verifies 3 drafts (emits 1 to 4 tokens) and asks
# for 1 logprob per token, "e" samples one as usual.
DRAFT_STEP = ExpectedReply(9, {"d": 1, "e": None}, {}, {"d": 3})


def _drafted(tokens_d: list[int], logprobs=None) -> ModelRunnerOutput:
    out = ModelRunnerOutput(["d", "e"], [*tokens_d, 5], num_sampled_tokens=[len(tokens_d), 1])
    out.logprobs = logprobs if logprobs is not None else [_entry(1) for _ in tokens_d] + [None]
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_verified_run_of_one_to_drafts_plus_one_tokens_passes(n):
    check_model_runner_output(_drafted(list(range(n))), DRAFT_STEP, VOCAB, RANK)


@pytest.mark.parametrize("out,what", [
    (_drafted([1, 2, 3, 4, 5]), "5 token(s) for request 'd', which emits 1 to 4 this step"),
    (_drafted([]), "0 token(s) for request 'd', which emits 1 to 4 this step"),
    # Drafts were only d's: e emits exactly one.
    (ModelRunnerOutput(["d", "e"], [1, 5, 6], num_sampled_tokens=[1, 2],
                       logprobs=[_entry(1), None, None]),
     "2 token(s) for request 'e', which emits 1 to 1 this step"),
    (_drafted([1, 2], logprobs=[_entry(1), None, None]),
     "no logprobs for request 'd', which asked for 1"),
    (_drafted([1, VOCAB]), "token id 100 for request 'd' is outside the vocabulary (size 100)"),
])
def test_a_verified_run_that_breaks_its_bounds_is_a_violation(out, what):
    with pytest.raises(ProtocolViolation) as info:
        check_model_runner_output(out, DRAFT_STEP, VOCAB, RANK)
    assert info.value.what == f"answered step 9: {what}"


def test_token_counts_that_do_not_add_up_are_refused_on_the_wire():
    msg = worker_pb2.ModelRunnerOutput(req_ids=["d", "e"], sampled_token_ids=[1, 2, 5],
                                       num_sampled_tokens=[3, 1])
    with pytest.raises(ProtocolViolation, match="token counts sum to 4, but 3 tokens"):
        check_step_reply(msg, DRAFT_STEP, VOCAB, RANK)


def test_a_draft_models_proposals_are_bounded_ids():
    ok = _drafted([1, 2])
    ok.num_draft_tokens, ok.draft_token_ids = [2, 0], [7, 8]
    check_model_runner_output(ok, DRAFT_STEP, VOCAB, RANK)
    for counts, drafts, what in [
        ([17, 0], list(range(17)), "17 proposed drafts for request 'd', at most 16"),
        ([1, 1], [7, VOCAB], f"proposed draft {VOCAB} for request 'e' is outside the "
                             f"vocabulary (size {VOCAB})"),
    ]:
        bad = _drafted([1, 2])
        bad.num_draft_tokens, bad.draft_token_ids = counts, drafts
        with pytest.raises(ProtocolViolation) as info:
            check_model_runner_output(bad, DRAFT_STEP, VOCAB, RANK)
        assert info.value.what == f"answered step 9: {what}"
    msg = worker_pb2.ModelRunnerOutput(req_ids=["d", "e"], sampled_token_ids=[1, 5],
                                       draft_token_ids=[3], num_draft_tokens=[2, 0])
    with pytest.raises(ProtocolViolation, match="draft counts sum to 2, but 1 drafts"):
        check_step_reply(msg, DRAFT_STEP, VOCAB, RANK)
