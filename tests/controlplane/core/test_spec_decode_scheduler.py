"""The scheduler's half of speculative decoding, with a model stand-in that
accepts exactly as many drafts as each test says: drafts in the budget and
the step, the rollback of rejected positions, nothing unverified in the
prefix cache, no request scheduled again while its drafts are verified, the
per-request back-off, and the counts behind the metrics."""

from __future__ import annotations

from controlplane.core.outputs import ModelRunnerOutput, SchedulerOutput
from controlplane.core.request import RequestStatus
from controlplane.core.spec_decode import MAX_COOLDOWN_STEPS
from controlplane.spec_decode.config import SpeculativeConfig
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request

K = 4
NGRAM = SpeculativeConfig("ngram", K, 1, 3)
# A prompt whose suffix recurs: the n-gram proposer drafts 20, 21, 22, 23.
PROMPT = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 20]


def _scheduler(**overrides):
    return make_scheduler(num_blocks=64, block_size=4, speculative=NGRAM, **overrides)


def _reply(so: SchedulerOutput, sched, accepted: dict[str, int], bonus: int = 99
           ) -> ModelRunnerOutput:
    """Each request that samples emits its first accepted[req] drafts (all
    when unnamed) and one more token."""
    req_ids, tokens, counts = [], [], []
    for req_id in so.num_scheduled_tokens:
        request = sched.get_request(req_id)
        drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
        if request.num_computed_tokens < request.num_tokens + len(drafts):
            continue  # a partial prefill chunk
        n = accepted.get(req_id, len(drafts))
        req_ids.append(req_id)
        tokens.extend([*drafts[:n], bonus])
        counts.append(n + 1)
    return ModelRunnerOutput(req_ids, tokens, num_sampled_tokens=counts)


def _prefilled(sched, max_tokens=30, **params):
    request = make_request(list(PROMPT), max_tokens=max_tokens, req_id="a", temperature=0.0,
                           ignore_eos=True, **params)
    sched.add_request(request)
    while not request.output_token_ids:  # (in chunks under a small budget)
        so = sched.schedule()
        sched.update_from_output(so, _reply(so, sched, {}, bonus=21))  # suffix [20, 21] recurs
    return request


def test_drafts_count_in_the_budget_and_travel_in_the_step():
    sched = _scheduler()
    request = _prefilled(sched)
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [22, 23, 24, 25]}
    assert so.num_scheduled_tokens["a"] == 1 + K
    assert request.num_computed_tokens == request.num_tokens + K


def test_rejected_positions_roll_back_and_never_reach_the_prefix_cache():
    sched = _scheduler()
    request = _prefilled(sched)
    kv = sched.kv_cache_manager
    so = sched.schedule()
    # Only blocks of known tokens are hashed, never one holding a draft.
    assert kv.num_cached_blocks["a"] == request.num_tokens // 4
    outs = sched.update_from_output(so, _reply(so, sched, {"a": 1}, bonus=7))
    assert outs[0].new_token_ids == [22, 7]
    assert request.output_token_ids == [21, 22, 7]
    # The token just emitted is the only one not computed.
    assert request.num_computed_tokens == request.num_tokens - 1
    assert request.spec_num_draft_tokens == K and request.spec_num_accepted_tokens == 1
    stats = sched.spec.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, K, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0, 0]
    assert outs[0].spec_num_draft_tokens == K and outs[0].spec_num_accepted_tokens == 1


def test_drafts_stop_at_max_tokens_and_the_budget():
    sched = _scheduler(max_num_batched_tokens=3)
    _prefilled(sched, max_tokens=30)
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [22, 23]}
    sched = _scheduler()
    _prefilled(sched, max_tokens=3)  # one output so far: two more, so one draft
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [22]}
    outs = sched.update_from_output(so, _reply(so, sched, {}))
    assert outs[0].finish_reason is not None and len(outs[0].new_token_ids) == 2


def test_a_stop_token_inside_the_run_drops_what_follows():
    sched = _scheduler()
    request = _prefilled(sched, stop_token_ids=[23])
    so = sched.schedule()
    outs = sched.update_from_output(so, _reply(so, sched, {}))
    assert outs[0].new_token_ids == [22, 23] and outs[0].stop_token_id == 23
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert sched.kv_cache_manager.get_num_free_blocks() == 64


def test_a_request_is_not_scheduled_again_while_its_drafts_are_verified():
    sched = _scheduler(async_scheduling=True)
    sched.placeholders = True
    request = _prefilled(sched)
    first = sched.schedule()
    assert first.scheduled_spec_decode_tokens
    assert "a" not in sched.schedule().num_scheduled_tokens
    sched.update_from_output(first, _reply(first, sched, {"a": 2}))
    assert request.num_output_placeholders == 0
    assert request.num_computed_tokens == request.num_tokens - 1
    assert "a" in sched.schedule().num_scheduled_tokens


def test_a_plain_step_in_flight_shifts_the_drafts_past_its_token():
    sched = _scheduler()
    sched.placeholders = True
    request = make_request(list(PROMPT), max_tokens=30, req_id="a", temperature=0.0,
                           ignore_eos=True)
    sched.add_request(request)
    prefill = sched.schedule()  # samples the first output token, in flight
    so = sched.schedule()
    # From the known tokens [.., 32, 20] the proposal is 21, 22, 23, 24, 25:
    # 21 guesses the token in flight, the drafts follow it.
    assert so.scheduled_spec_decode_tokens == {"a": [22, 23, 24, 25]}
    sched.update_from_output(prefill, _reply(prefill, sched, {}, bonus=21))
    sched.update_from_output(so, _reply(so, sched, {}, bonus=26))
    assert request.output_token_ids == [21, 22, 23, 24, 25, 26]
    assert request.num_computed_tokens == request.num_tokens - 1


def test_fruitless_drafts_back_off_then_drafting_resumes():
    sched = _scheduler()
    _prefilled(sched, max_tokens=240)
    sched.spec.proposer = lambda ids, k: [5] * k
    sched.spec.strong_proposer = lambda ids, k: []  # no long match: the pause holds

    def run_until_drafts(accepted: int) -> tuple[int, int]:
        """(plain steps before the next step with drafts, its drafts)."""
        plain = 0
        while True:
            so = sched.schedule()
            drafts = so.scheduled_spec_decode_tokens.get("a")
            sched.update_from_output(so, _reply(so, sched, {"a": accepted}))
            if drafts:
                return plain, len(drafts)
            plain += 1

    assert run_until_drafts(0) == (0, K)
    # Nothing accepted: one draft at a time, after pauses that grow up to the cap.
    pauses = [run_until_drafts(0) for _ in range(5)]
    assert pauses == [(1, 1), (4, 1), (16, 1), (64, 1), (64, 1)]
    assert MAX_COOLDOWN_STEPS == 64
    # One accepted: the pause resets and the run grows again.
    assert run_until_drafts(1) == (64, 1)
    assert run_until_drafts(1) == (0, 2)
    assert run_until_drafts(2) == (0, 2)
    assert run_until_drafts(2) == (0, 4)


def test_preemption_clears_the_rollback_of_drafts_in_flight():
    sched = _scheduler()
    request = _prefilled(sched)
    so = sched.schedule()
    request.spec_token_ids = [1, 2]  # as a draft model's proposals would be
    sched._preempt(sched.running.pop(), set())
    assert request.spec_step == 0 and request.num_computed_tokens == 0
    assert request.spec_token_ids == []
    sched.update_from_output(so, _reply(so, sched, {"a": 1}))
    # Recomputed from scratch: no rollback below zero.
    assert request.num_computed_tokens == 0


def test_with_async_scheduling_the_batch_waits_for_drafts_out():
    sched = _scheduler()
    a = _prefilled(sched)
    other = make_request([40, 41, 42, 43, 44], max_tokens=30, req_id="b", temperature=0.0,
                         ignore_eos=True)
    sched.add_request(other)
    sched.placeholders = True
    first = sched.schedule()
    assert first.scheduled_spec_decode_tokens.keys() == {"a"} and "b" in first.num_scheduled_tokens
    # a's drafts are out: nothing else is scheduled either (b would run ahead
    # and its steps would be applied before a could go on).
    assert sched.schedule().num_scheduled_tokens == {}
    sched.update_from_output(first, _reply(first, sched, {"a": 1}))
    assert a.spec_step == 0
    assert sched.schedule().num_scheduled_tokens.keys() == {"a", "b"}
    # PP > 1: micro-batches of disjoint requests, no placeholders: nothing is held.
    sched = _scheduler()
    _prefilled(sched)
    sched.add_request(make_request([40, 41, 42], max_tokens=30, req_id="b", ignore_eos=True))
    sched.num_micro_batches = 2
    first = sched.schedule()
    assert first.num_scheduled_tokens.keys() == {"a"} and first.scheduled_spec_decode_tokens
    assert sched.schedule().num_scheduled_tokens.keys() == {"b"}


def test_a_long_match_drafts_even_while_the_request_pauses():
    sched = _scheduler()  # lookup 1..3: "long" is 3 tokens
    request = _prefilled(sched, max_tokens=100)
    so = sched.schedule()
    sched.update_from_output(so, _reply(so, sched, {"a": 0}, bonus=50))  # fruitless: pause
    state = sched.spec.states["a"]
    assert state.cooldown == 1
    # Its last three tokens, 20 21 22, occur in the prompt: drafts despite the pause.
    request.append_output_token_ids([20, 21, 22])
    request.num_computed_tokens = request.num_tokens - 1
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [23]}
    assert state.cooldown == 0


def test_the_proposers_numpy_copy_follows_the_requests_tokens():
    sched = _scheduler()
    request = _prefilled(sched, max_tokens=120)
    seen = []
    sched.spec.proposer = lambda ids, k: seen.append(list(ids)) or []
    for bonus in (7, 8, 9):
        so = sched.schedule()
        sched.update_from_output(so, _reply(so, sched, {}, bonus=bonus))
    # Each proposal saw exactly the tokens the request held then.
    assert seen == [PROMPT + [21], PROMPT + [21, 7], PROMPT + [21, 7, 8]]
    state = sched.spec.states["a"]
    request.append_output_token_ids(list(range(100, 190)))  # past its capacity
    assert list(state.token_array(request.all_token_ids)) == request.all_token_ids
