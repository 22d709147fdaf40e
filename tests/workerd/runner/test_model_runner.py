"""ModelRunner: SchedulerOutput diffs -> per-request state -> model inputs ->
sampled tokens.

The first half drives _update_states/prepare_inputs/execute_model with
hand-written diffs and a fake model whose logits name the input token, so
every expectation is visible in the test. The second half runs the tiny Llama
checkpoint under the real controlplane Scheduler, each step through
kvloom_testing.inprocess.InProcessExecutor (both wire modules, bytes, a real Worker):
chunked prefill, preemption resumed into other blocks and recomputed from 0 in
chunks, prefix-cache hits on another request's KV, seeded sampling; every
output is checked against transformers on the same weights.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from safetensors import safe_open

from kvloom_testing.checkpoints import TOKENIZER_VOCAB_SIZE
from kvloom_testing.inprocess import (
    BLOCK_SIZE,
    InProcessExecutor,
    ScheduleWatch,
    output_tokens,
    run_to_completion,
    runner_limits,
)
from kvloom_testing.replay import replay_layout, replayed_outputs
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request
from tests.factories import layout_state
from tests.integration.reference import hf_greedy
from workerd.distributed import parallel_state as distributed
from workerd.distributed.parallel_state import (
    IntermediateTensors,
    ParallelState,
    single_process_state,
)
from workerd.runner import kv_cache
from workerd.runner.model_runner import ModelRunner
from workerd.runner.sampled_tokens import PLACEHOLDER
from workerd.runner.sched_output import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

torch.set_num_threads(1)

BS = 4  # block size of the hand-written diffs


# ---- diff builders ------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0)


def new_req(req_id, prompt, block_ids, computed=0, outputs=(), params=GREEDY):
    return NewRequestData(req_id, list(prompt), list(outputs), params, list(block_ids), computed)


def cached(*entries):
    """entries: (req_id, new_block_ids, num_computed_tokens, resumed)."""
    data = CachedRequestData()
    for req_id, blocks, computed, resumed in entries:
        data.req_ids.append(req_id)
        data.new_block_ids.append(list(blocks))
        data.num_computed_tokens.append(computed)
        data.resumed_from_preemption.append(resumed)
    return data


def step(step_id, sched, new=(), cached_reqs=None, finished=(), preempted=()):
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached_reqs or CachedRequestData(),
        num_scheduled_tokens=dict(sched),
        total_num_scheduled_tokens=sum(sched.values()),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


# ---- fake model -----------------------------------------------------------------

VOCAB = 1000


class FakeModel:
    """Hidden state = (token id, position); logits pick token id + 1."""

    hidden_size = 2
    num_local_layers = 1

    def __init__(self):
        self.calls = []

    def kv_cache_shape(self, num_blocks, block_size):
        return (2, num_blocks, block_size, 1, 1)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate):
        self.calls.append((input_ids, positions, attn_metadata, intermediate))
        if input_ids is None:
            hidden = intermediate.hidden_states
        else:
            hidden = torch.stack([input_ids, positions], dim=-1).float()
        return hidden

    def compute_logits(self, hidden):
        return torch.nn.functional.one_hot(hidden[:, 0].long() + 1, VOCAB).float()


def fake_runner(ps: ParallelState | None = None) -> ModelRunner:
    runner = ModelRunner(ps or single_process_state(), "unused", torch.float32, seed=0,
                         limits=runner_limits())
    runner.model = FakeModel()
    runner.init_kv_cache(num_blocks=64, block_size=BS)
    return runner


def batch_blocks(runner: ModelRunner) -> dict[str, list[int]]:
    batch = runner.input_batch
    table = batch.block_table
    return {
        rid: table.table[row, : table.num_blocks[row]].tolist()
        for rid, row in batch.req_id_to_index.items()
    }


# ---- state updates ------------------------------------------------------------


def test_update_states_follows_hand_written_diffs():
    r = fake_runner()
    s1 = step(1, {"a": 5, "b": 3}, new=[new_req("a", range(5), [3, 7]), new_req("b", [9] * 3, [1])])
    r._update_states(s1)
    assert set(r.requests) == {"a", "b"} and r.input_batch.req_ids == ["a", "b"]
    assert batch_blocks(r) == {"a": [3, 7], "b": [1]}

    # Cached deltas: blocks extended, progress set; tokens are the worker's
    # own business (execute_model appends what it samples).
    r.requests["a"].all_token_ids.append(100)
    r.requests["b"].all_token_ids.append(200)
    r._update_states(
        step(
            2,
            {"a": 1, "b": 1},
            cached_reqs=cached(("a", [], 5, False), ("b", [9], 3, False)),
        )
    )
    a, b = r.requests["a"], r.requests["b"]
    assert a.all_token_ids == [0, 1, 2, 3, 4, 100] and a.num_computed_tokens == 5
    assert b.all_token_ids == [9, 9, 9, 200] and b.block_ids == [1, 9]
    assert batch_blocks(r) == {"a": [3, 7], "b": [1, 9]}

    # b preempted: out of the batch, state (tokens included) kept; a alone.
    r._update_states(
        step(3, {"a": 1}, cached_reqs=cached(("a", [], 6, False)), preempted=["b"])
    )
    assert r.input_batch.req_ids == ["a"] and "b" in r.requests
    assert r.requests["b"].all_token_ids == [9, 9, 9, 200]

    # a finished; b resumed: the block list is replaced, recompute from 0.
    r._update_states(
        step(4, {"b": 4}, cached_reqs=cached(("b", [8, 2], 0, True)), finished=["a"])
    )
    assert set(r.requests) == {"b"} and r.input_batch.req_ids == ["b"]
    b = r.requests["b"]
    assert b.block_ids == [8, 2] and b.num_computed_tokens == 0
    assert b.all_token_ids == [9, 9, 9, 200]
    assert batch_blocks(r) == {"b": [8, 2]}


def test_running_request_not_scheduled_leaves_batch_and_returns():
    r = fake_runner()
    r._update_states(
        step(1, {"a": 2, "b": 2}, new=[new_req("a", [1, 2], [0]), new_req("b", [3, 4], [1])])
    )
    r.requests["b"].all_token_ids.append(5)
    r._update_states(step(2, {"b": 1}, cached_reqs=cached(("b", [], 2, False))))
    assert r.input_batch.req_ids == ["b"]
    r._update_states(
        step(
            3,
            {"a": 1, "b": 1},
            cached_reqs=cached(("a", [], 2, False), ("b", [2], 3, False)),
        )
    )
    assert sorted(r.input_batch.req_ids) == ["a", "b"]
    assert batch_blocks(r) == {"a": [0], "b": [1, 2]}
    with pytest.raises(KeyError, match="unknown"):
        r._update_states(step(4, {"zz": 1}, cached_reqs=cached(("zz", [], 0, False))))


def test_prepare_inputs_layout_slots_and_sampling_rows():
    r = fake_runner()
    # a: 6-token prompt in blocks [5, 2], chunk 1 of 2 (4 tokens).
    # b: recomputed request (prompt + 2 outputs) with a prefix-cache hit of 4.
    # c: 1-token prompt.
    so = step(
        1,
        {"a": 4, "b": 3, "c": 1},
        new=[
            new_req("a", [10, 11, 12, 13, 14, 15], [5, 2]),
            new_req("b", [20, 21, 22, 23, 24], [9, 3], computed=4, outputs=[25, 26]),
            new_req("c", [30], [7]),
        ],
    )
    r._update_states(so)
    inp = r.prepare_inputs(so)
    md = inp.attn_metadata
    assert inp.input_ids.tolist() == [10, 11, 12, 13, 24, 25, 26, 30]
    assert inp.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 0]
    assert md.slot_mapping.tolist() == [20, 21, 22, 23, 12, 13, 14, 28]
    assert md.query_start_loc.tolist() == [0, 4, 7, 8]
    assert md.seq_lens.tolist() == [4, 7, 1] and md.seq_lens_cpu == [4, 7, 1]
    assert md.query_lens_cpu == [4, 3, 1]
    assert md.block_table.tolist() == [[5, 2], [9, 3], [7, 0]]
    assert (md.num_reqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (3, 8, 4, 7)
    # a's chunk is partial: only b and c sample.
    assert inp.logits_indices.tolist() == [6, 7]
    assert [s.req_id for s in inp.sample_states] == ["b", "c"]


def test_prepare_inputs_rejects_inconsistent_diffs():
    r = fake_runner()
    so = step(1, {"a": 5}, new=[new_req("a", [1, 2, 3, 4, 5], [0])])  # 5 tokens, 1 block
    r._update_states(so)
    with pytest.raises(ValueError, match="no KV block"):
        r.prepare_inputs(so)
    r = fake_runner()
    so = step(1, {"a": 3}, new=[new_req("a", [1, 2], [0])])
    r._update_states(so)
    with pytest.raises(ValueError, match="holds 2 and 0 draft"):
        r.prepare_inputs(so)
    # Drafts must end the request's window exactly: 2 known + 2 drafts, 3 scheduled.
    r = fake_runner()
    so = step(1, {"a": 3}, new=[new_req("a", [1, 2], [0])])
    so.scheduled_spec_decode_tokens = {"a": [7, 8]}
    r._update_states(so)
    with pytest.raises(ValueError, match="holds 2 and 2 draft"):
        r.prepare_inputs(so)


# ---- execute_model with the fake model ------------------------------------------


def test_execute_model_samples_only_complete_contexts():
    r = fake_runner()
    called = time.perf_counter()
    out = r.execute_model(
        step(
            1,
            {"a": 3, "b": 2},
            new=[new_req("a", [10, 11, 12, 13, 14], [0, 1]), new_req("b", [20, 21], [2])],
        )
    )
    wall_s = time.perf_counter() - called
    assert out.req_ids == ["b"] and out.sampled_token_ids == [22]
    # The forward is timed, and within the call (not a timestamp, not left at 0).
    assert 0 < out.forward_time_s <= wall_s
    # The sampled token is appended here (protocol 3: the diff carries none).
    assert r.requests["b"].all_token_ids == [20, 21, 22]
    assert r.requests["a"].all_token_ids == [10, 11, 12, 13, 14]
    out = r.execute_model(
        step(
            2,
            {"a": 2, "b": 1},
            cached_reqs=cached(("a", [], 3, False), ("b", [], 2, False)),
        )
    )
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [15, 23]
    # Only finished ids: state updated, no forward, empty output.
    calls = len(r.model.calls)
    out = r.execute_model(step(3, {}, finished=["a", "b"]))
    assert out.req_ids == [] and out.sampled_token_ids == [] and r.requests == {}
    assert len(r.model.calls) == calls


def test_partial_prefill_only_step_returns_empty_output():
    r = fake_runner()
    out = r.execute_model(step(1, {"a": 2}, new=[new_req("a", [1, 2, 3], [0])]))
    assert out.req_ids == [] and out.sampled_token_ids == []


def fake_p2p(monkeypatch):
    """torch.distributed's isend/irecv for ranks that live in one process:
    a send lands in its destination's mailbox; a receive (every one in these
    tests is rank 0's) takes the oldest when waited on."""
    from collections import defaultdict, deque

    from workerd.runner import sampled_tokens

    boxes: dict = defaultdict(deque)

    class Done:
        def __init__(self, fill=None):
            self.fill = fill

        def wait(self):
            if self.fill is not None:
                self.fill()

    def isend(t, dst, tag):
        boxes[dst].append(t.clone())
        return Done()

    def irecv(t, src, tag):
        return Done(lambda: t.copy_(boxes[0].popleft()))

    monkeypatch.setattr(sampled_tokens.dist, "isend", isend)
    monkeypatch.setattr(sampled_tokens.dist, "irecv", irecv)
    return boxes


def _ps(tp_rank, pp_rank, tp_size=2, pp_size=2):
    return layout_state(tp_size, pp_size, tp_rank, pp_rank)


def test_pipeline_stages_send_receive_and_only_output_rank_answers(monkeypatch):
    sent, received = [], []
    fake_p2p(monkeypatch)

    def fake_send(t, ps):
        sent.append(t.hidden_states.clone())

    def fake_recv(num_tokens, hidden_size, dtype, ps):
        received.append((num_tokens, hidden_size, dtype))
        h = torch.tensor([[41.0, 0.0], [42.0, 1.0]])
        return IntermediateTensors(h, torch.zeros_like(h))

    monkeypatch.setattr(distributed, "send_intermediate", fake_send)
    monkeypatch.setattr(distributed, "recv_intermediate", fake_recv)
    so = step(1, {"a": 2}, new=[new_req("a", [7, 8], [0])])

    first = fake_runner(_ps(tp_rank=0, pp_rank=0))
    first.model.forward = lambda ids, pos, kv, md, inter: IntermediateTensors(
        torch.stack([ids, pos], -1).float(), torch.zeros(2, 2)
    )
    assert first.execute_model(so) is None
    assert sent[0].tolist() == [[7.0, 0.0], [8.0, 1.0]] and not received

    last_tp1 = fake_runner(_ps(tp_rank=1, pp_rank=1))
    assert last_tp1.execute_model(so) is None
    output_rank = fake_runner(_ps(tp_rank=0, pp_rank=1))
    out = output_rank.execute_model(so)
    assert received == [(2, 2, torch.float32)] * 2
    # The last stage ran on the received hidden states, not on input ids.
    assert output_rank.model.calls[0][0] is None
    assert out.req_ids == ["a"] and out.sampled_token_ids == [43]
    # Every rank appended a token for "a": the output rank the one it
    # sampled, the first stage a placeholder that the output rank's message
    # fills in before "a" runs again, the rest a placeholder for good.
    assert output_rank.requests["a"].all_token_ids == [7, 8, 43]
    assert last_tp1.requests["a"].all_token_ids == [7, 8, PLACEHOLDER]
    assert first.requests["a"].all_token_ids == [7, 8, PLACEHOLDER]
    first.sampled_tokens.resolve({"a"})
    assert first.requests["a"].all_token_ids == [7, 8, 43]
    # Empty steps: only the output rank answers, nobody communicates.
    assert first.execute_model(step(2, {}, finished=["a"])) is None
    assert output_rank.execute_model(step(2, {}, finished=["a"])).req_ids == []
    assert len(sent) == 1 and len(received) == 2


def test_output_rank_forward_time_leaves_out_the_wait_for_the_previous_stage(monkeypatch):
    # A later stage blocked receiving hidden states is a pipeline bubble: the
    # output rank's forward_time_s (the busy-share metric) must not count it,
    # last_recv_wait_s reports it instead, and a step without a receive resets it.
    fake_p2p(monkeypatch)
    wait_s = 0.2

    def slow_recv(num_tokens, hidden_size, dtype, ps):
        time.sleep(wait_s)
        h = torch.tensor([[41.0, 0.0], [42.0, 1.0]])
        return IntermediateTensors(h, torch.zeros_like(h))

    monkeypatch.setattr(distributed, "recv_intermediate", slow_recv)
    output_rank = fake_runner(_ps(tp_rank=0, pp_rank=1))
    out = output_rank.execute_model(step(1, {"a": 2}, new=[new_req("a", [7, 8], [0])]))
    assert output_rank.last_recv_wait_s >= wait_s
    assert 0 <= out.forward_time_s < wait_s / 2
    output_rank.execute_model(step(2, {}, finished=["a"]))
    assert output_rank.last_recv_wait_s == 0.0


def test_cpu_kv_budget_is_a_capped_share_of_available_memory(monkeypatch):
    monkeypatch.setattr(kv_cache, "available_system_memory", lambda: 8 << 30)
    assert kv_cache.cpu_kv_cache_budget() == 2 << 30
    monkeypatch.setattr(kv_cache, "available_system_memory", lambda: 512 << 30)
    assert kv_cache.cpu_kv_cache_budget() == kv_cache.CPU_KV_CACHE_MAX_BYTES


def test_kv_cache_sizing_with_explicit_budget():
    r = fake_runner()
    # kv_cache_shape(1, 4) = 2*1*4*1*1 floats = 32 bytes per layer-block.
    assert r.profile_num_blocks(BS, 3200, 0.9) == (100, 32)
    assert r.kv_caches[0].shape == (2, 64, BS, 1, 1)
    with pytest.raises(RuntimeError, match="no room"):
        r.profile_num_blocks(BS, 16, 0.9)
    num_blocks, _ = r.profile_num_blocks(BS, 0, 0.9)  # CPU: share of free memory
    assert 1 <= num_blocks <= (4 << 30) // 32


# ---- end to end: the real scheduler, the tiny Llama ------------------------------

MAX_NEW_TOKENS = 8


def _prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, TOKENIZER_VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def _greedy(req_id: str, prompt: list[int], **kwargs):
    """Greedy and never stopping at EOS, like the reference's generate."""
    kwargs.setdefault("max_tokens", MAX_NEW_TOKENS)
    return make_request(prompt, req_id=req_id, temperature=0.0, ignore_eos=True, **kwargs)


def _run_mixed_schedule(model_dir: str):
    """Five greedy requests, two arriving later, on 8 KV blocks with a 10-token
    budget and no prefix cache, so the real scheduler chunks prefills, preempts,
    hands the freed blocks to others and recomputes the victims from 0, in
    chunks, into other blocks. Returns (executor, prompts, steps, events)."""
    executor = InProcessExecutor(model_dir, num_gpu_blocks=8)
    sched = make_scheduler(executor, max_num_batched_tokens=10, enable_prefix_caching=False)
    prompts = dict(zip(["r0", "r1", "r2", "r3", "r4"], _prompts([7, 13, 3, 10, 5]), strict=True))
    r = {req_id: _greedy(req_id, prompt) for req_id, prompt in prompts.items()}
    watch = ScheduleWatch(sched, executor)
    arrivals = {0: [r["r0"], r["r1"], r["r2"]], 2: [r["r3"]], 3: [r["r4"]]}
    steps = run_to_completion(sched, executor, arrivals, on_step=watch)
    return executor, prompts, steps, watch.events


def test_greedy_matches_transformers_through_chunks_preemption_and_recompute(tiny_model_dir):
    executor, prompts, steps, events = _run_mixed_schedule(tiny_model_dir)
    # The scenario happened (the watch checked the worker at each event).
    for event in (
        "chunked_prefill",
        "preempted",
        "reused_freed_blocks",
        "recomputed_in_chunks",
        "resumed_into_other_blocks",
    ):
        assert events[event], event
    tokens = output_tokens(steps)
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == hf_greedy(tiny_model_dir, prompt, MAX_NEW_TOKENS), req_id
    # The last step told the worker about the last finishes.
    assert executor.runner.requests == {} and executor.runner.input_batch.num_reqs == 0


def test_prefix_cache_hit_reads_another_requests_kv(tiny_model_dir):
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=16)
    sched = make_scheduler(executor)
    shared, tail_a, tail_b = _prompts([12, 3, 2])
    a, b = _greedy("a", shared + tail_a), _greedy("b", shared + tail_b)
    steps = run_to_completion(sched, executor, {0: [a], 2: [b]})
    (new_b,) = [n for so, _, _ in steps for n in so.scheduled_new_reqs if n.req_id == "b"]
    # b's first three blocks are a's: the worker must read a's KV for them.
    a_blocks = steps[0][0].scheduled_new_reqs[0].block_ids
    assert new_b.num_computed_tokens == 12 and new_b.block_ids[:3] == a_blocks[:3]
    tokens = output_tokens(steps)
    for req in (a, b):
        assert tokens[req.request_id] == hf_greedy(
            tiny_model_dir, req.prompt_token_ids, MAX_NEW_TOKENS
        ), req.request_id


def _sample_alone(model_dir: str, prompt: list[int], worker_seed: int, n: int, **params):
    executor = InProcessExecutor(model_dir, num_gpu_blocks=16, seed=worker_seed)
    sched = make_scheduler(executor)
    req = make_request(prompt, max_tokens=n, req_id="s", ignore_eos=True, **params)
    return output_tokens(run_to_completion(sched, executor, {0: [req]}))["s"]


def test_seeded_request_reproducible_across_batches_and_preemption(tiny_model_dir):
    seeded = dict(temperature=1.0, top_p=0.95, seed=42)
    s_prompt, u_prompt, g_prompt = _prompts([6, 9, 4])
    n = 6
    reference = _sample_alone(tiny_model_dir, s_prompt, 0, n, **seeded)
    # The worker's generator (LoadModel.seed) is not used; the request's seed is.
    assert _sample_alone(tiny_model_dir, s_prompt, 7, n, **seeded) == reference
    assert _sample_alone(tiny_model_dir, s_prompt, 0, n, **{**seeded, "seed": 43}) != reference

    # The same request among an unseeded sampler and a greedy one: prefilled
    # in two chunks, preempted after sampling (lowest priority) and recomputed
    # from 0 into other blocks.
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=7, seed=3)
    sched = make_scheduler(
        executor, max_num_batched_tokens=8, enable_prefix_caching=False, policy="priority"
    )

    def req(req_id, prompt, arrival, priority=0, **params):
        return make_request(
            prompt, max_tokens=n, req_id=req_id, priority=priority, arrival_time=arrival,
            ignore_eos=True, **params,
        )

    arrivals = {
        0: [req("u", u_prompt, 0.0, temperature=1.0), req("g", g_prompt, 0.0, temperature=0.0)],
        1: [req("s", s_prompt, 1.0, priority=9, **seeded)],
    }
    watch = ScheduleWatch(sched, executor)
    tokens = output_tokens(run_to_completion(sched, executor, arrivals, on_step=watch))
    for event in ("chunked_prefill", "preempted_after_sampling", "recomputed_in_chunks"):
        assert "s" in watch.events[event], event
    assert tokens["s"] == reference
    assert tokens["g"] == hf_greedy(tiny_model_dir, g_prompt, n)


def make_runner(model_dir: str, num_blocks: int) -> ModelRunner:
    runner = ModelRunner(single_process_state(), model_dir, torch.float32, seed=0,
                         limits=runner_limits())
    runner.load_model()
    runner.init_kv_cache(num_blocks, BLOCK_SIZE)
    return runner


def test_real_model_kv_cache_geometry(tiny_model_dir):
    runner = make_runner(tiny_model_dir, num_blocks=6)
    m = runner.model
    # K and V, every local layer, block_size tokens of num_kv_heads x head_dim floats.
    per_block = 2 * m.num_local_layers * BLOCK_SIZE * m.num_kv_heads * m.head_dim * 4
    assert runner.profile_num_blocks(BLOCK_SIZE, 10 * per_block + 1, 0.9) == (10, per_block)
    assert len(runner.kv_caches) == m.num_local_layers
    assert all(c.shape == m.kv_cache_shape(6, BLOCK_SIZE) for c in runner.kv_caches)
    # One process holds the whole checkpoint: every tensor in it, nothing more.
    with safe_open(f"{tiny_model_dir}/model.safetensors", framework="pt") as f:
        checkpoint_bytes = sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # noqa: SIM118
    assert runner.weights_bytes() == checkpoint_bytes


@pytest.mark.slow
def test_tp2_pp2_ranks_replaying_the_broadcast_match_single_process(tiny_model_dir, tmp_path):
    executor, _, _, _ = _run_mixed_schedule(tiny_model_dir)
    tp, pp = 2, 2
    replay_layout(executor, tiny_model_dir, str(tmp_path), tp, pp)
    output_rank = (pp - 1) * tp
    for rank in range(tp * pp):
        got = replayed_outputs(tmp_path / f"rank{rank}.pt")
        if rank != output_rank:
            assert all(o is None for o in got), rank
            continue
        for want, have in zip(executor.replies, got, strict=True):
            assert (have.req_ids, have.sampled_token_ids) == (want.req_ids, want.sampled_token_ids)


def test_the_profile_run_is_the_schedulers_worst_case():
    """The forward covers max_num_batched_tokens tokens and the logits a full
    batch of sampled rows (max_num_seqs), from the limits LoadModel carried."""

    class Recording(FakeModel):
        def __init__(self):
            super().__init__()
            self.forward_tokens, self.logit_rows = [], []

        def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate):
            self.forward_tokens.append(positions.numel())
            return super().forward(input_ids, positions, kv_caches, attn_metadata, intermediate)

        def compute_logits(self, hidden):
            self.logit_rows.append(hidden.shape[0])
            return super().compute_logits(hidden)

    from controlplane.config import SchedulerConfig

    runner = ModelRunner(single_process_state(), "unused", torch.float32, seed=0,
                         limits=runner_limits(SchedulerConfig(max_num_batched_tokens=300,
                                                              max_num_seqs=40)))
    runner.model = Recording()
    runner._profile_run(BS)
    assert runner.model.forward_tokens == [300] and runner.model.logit_rows == [40]
