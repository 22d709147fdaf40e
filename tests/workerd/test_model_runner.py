"""ModelRunner: SchedulerOutput diffs -> per-request state -> model inputs ->
sampled tokens.

The first half drives _update_states/_prepare_inputs/execute_model with
hand-written diffs and a fake model whose logits name the input token, so
every expectation is visible in the test. The second half runs the tiny Llama
checkpoint through hand-built step sequences (chunked prefill, decodes, a
preemption resumed into new blocks and recomputed from 0) and checks the
greedy tokens against transformers' generate on the same weights.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from tests.factories import layout_state
from tests.workerd.runner_harness import (
    E2E_BLOCK_SIZE,
    MAX_NEW_TOKENS,
    Controlplane,
    cached,
    free_port,
    make_prompts,
    make_runner,
    new_req,
    replay_rank,
    step,
)
from workerd import distributed, kv_cache
from workerd.distributed import IntermediateTensors, ParallelState, single_process_state
from workerd.model_runner import ModelRunner
from workerd.sched_output import (
    SamplingParams,
)

torch.set_num_threads(1)

BS = 4  # block size of the hand-written diffs


# ---- diff builders ------------------------------------------------------------


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
    runner = ModelRunner(ps or single_process_state(), "unused", torch.float32, seed=0)
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

    # Cached deltas: sampled tokens appended, blocks extended, progress set.
    r._update_states(
        step(
            2,
            {"a": 1, "b": 1},
            cached_reqs=cached(("a", [100], [], 5, False), ("b", [200], [9], 3, False)),
        )
    )
    a, b = r.requests["a"], r.requests["b"]
    assert a.all_token_ids == [0, 1, 2, 3, 4, 100] and a.num_computed_tokens == 5
    assert b.all_token_ids == [9, 9, 9, 200] and b.block_ids == [1, 9]
    assert batch_blocks(r) == {"a": [3, 7], "b": [1, 9]}

    # b preempted: out of the batch, state kept; a scheduled alone.
    r._update_states(
        step(3, {"a": 1}, cached_reqs=cached(("a", [101], [], 6, False)), preempted=["b"])
    )
    assert r.input_batch.req_ids == ["a"] and "b" in r.requests
    assert r.requests["b"].all_token_ids == [9, 9, 9, 200]

    # a finished; b resumed: the block list is replaced, recompute from 0,
    # and the token sampled before preemption arrives now.
    r._update_states(
        step(4, {"b": 5}, cached_reqs=cached(("b", [201], [8, 2], 0, True)), finished=["a"])
    )
    assert set(r.requests) == {"b"} and r.input_batch.req_ids == ["b"]
    b = r.requests["b"]
    assert b.block_ids == [8, 2] and b.num_computed_tokens == 0
    assert b.all_token_ids == [9, 9, 9, 200, 201]
    assert batch_blocks(r) == {"b": [8, 2]}


def test_running_request_not_scheduled_leaves_batch_and_returns():
    r = fake_runner()
    r._update_states(
        step(1, {"a": 2, "b": 2}, new=[new_req("a", [1, 2], [0]), new_req("b", [3, 4], [1])])
    )
    r._update_states(step(2, {"b": 1}, cached_reqs=cached(("b", [5], [], 2, False))))
    assert r.input_batch.req_ids == ["b"]
    r._update_states(
        step(
            3,
            {"a": 1, "b": 1},
            cached_reqs=cached(("a", [6], [], 2, False), ("b", [7], [2], 3, False)),
        )
    )
    assert sorted(r.input_batch.req_ids) == ["a", "b"]
    assert batch_blocks(r) == {"a": [0], "b": [1, 2]}
    with pytest.raises(KeyError, match="unknown"):
        r._update_states(step(4, {"zz": 1}, cached_reqs=cached(("zz", [], [], 0, False))))


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
    inp = r._prepare_inputs(so)
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
        r._prepare_inputs(so)
    r = fake_runner()
    so = step(1, {"a": 3}, new=[new_req("a", [1, 2], [0])])
    r._update_states(so)
    with pytest.raises(ValueError, match="holds only 2"):
        r._prepare_inputs(so)


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
    # Sampled tokens are not appended locally: they come back in the diff.
    assert r.requests["b"].all_token_ids == [20, 21]
    out = r.execute_model(
        step(
            2,
            {"a": 2, "b": 1},
            cached_reqs=cached(("a", [], [], 3, False), ("b", [22], [], 2, False)),
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


def _ps(tp_rank, pp_rank, tp_size=2, pp_size=2):
    return layout_state(tp_size, pp_size, tp_rank, pp_rank)


def test_pipeline_stages_send_receive_and_only_output_rank_answers(monkeypatch):
    sent, received = [], []

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
    # Empty steps: only the output rank answers, nobody communicates.
    assert first.execute_model(step(2, {}, finished=["a"])) is None
    assert output_rank.execute_model(step(2, {}, finished=["a"])).req_ids == []
    assert len(sent) == 1 and len(received) == 2


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


# ---- end to end with the tiny Llama ---------------------------------------------

@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _run_mixed_schedule(cp: Controlplane, prompts: dict[str, list[int]]) -> None:
    """Five requests to MAX_NEW_TOKENS outputs: chunked prefill, a preemption
    resumed into new blocks and recomputed from 0 in two chunks, finishes."""
    runner = cp.runner
    r0, r1, r2, r3, r4 = prompts
    # r1's prefill is split 8 + 5: the first chunk must sample nothing.
    out = cp.step({r0: -1, r1: 8, r2: -1}, new={k: prompts[k] for k in (r0, r1, r2)})
    assert out.req_ids == [r0, r2]
    cp.step({r0: 1, r1: -1, r2: 1})
    cp.step({r0: 1, r1: 1, r2: 1, r3: -1}, new={r3: prompts[r3]})
    # r2 is preempted; r4 arrives and takes r2's freed blocks (overwriting its KV).
    freed = list(cp.blocks[r2])
    cp.step({r0: 1, r1: 1, r3: 1, r4: -1}, new={r4: prompts[r4]}, preempted=[r2])
    assert set(freed) & set(cp.blocks[r4])
    assert r2 in runner.requests and r2 not in runner.input_batch
    cp.decode(r0, r1, r3, r4)
    # r2 comes back into a new, non-contiguous block list and recomputes its
    # prompt and outputs from 0, in two chunks; the token it sampled just
    # before preemption reaches the workers only now.
    cp.step({r0: 1, r1: 1, r3: 1, r4: 1, r2: 6}, resumed=[r2])
    blocks = cp.blocks[r2]
    assert runner.requests[r2].block_ids == blocks != freed
    assert any(b - a != 1 for a, b in zip(blocks, blocks[1:], strict=False))
    assert cp.computed[r2] < len(cp.tokens[r2])
    cp.step({r0: 1, r1: 1, r2: -1, r3: 1, r4: 1})
    for _ in range(2 * MAX_NEW_TOKENS):
        live = [r for r in cp.tokens if r not in cp.finished]
        done = [r for r in live if len(cp.outputs(r)) >= MAX_NEW_TOKENS]
        running = [r for r in live if r not in done]
        # Finished requests are reported in the next step's finished_req_ids.
        out = cp.step(dict.fromkeys(running, 1), finished=done)
        assert not set(done) & set(runner.requests)
        if not running:
            assert out.req_ids == [] and runner.input_batch.num_reqs == 0
            break
    else:
        pytest.fail("requests did not finish")
    assert runner.requests == {}


def test_greedy_matches_transformers_through_chunks_preemption_and_recompute(
    tiny_model_dir, hf_model
):
    runner = make_runner(tiny_model_dir)
    prompts = make_prompts(runner.model.vocab_size, [7, 13, 3, 10, 5])
    cp = Controlplane(runner, num_blocks=48)
    _run_mixed_schedule(cp, prompts)
    for req_id, prompt in prompts.items():
        expected = _hf_greedy(hf_model, prompt)
        # generate stops early at EOS; the runner never stops by itself.
        assert len(expected) >= 3
        assert cp.outputs(req_id)[: len(expected)] == expected, req_id


def test_seeded_request_reproducible_across_batches_and_preemption(tiny_model_dir):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    prompts = make_prompts(500, [6, 9, 4])
    n = 6

    def alone(params, worker_seed):
        cp = Controlplane(make_runner(tiny_model_dir, seed=worker_seed), 48, {"s": params})
        cp.step({"s": -1}, new={"s": prompts["r0"]})
        while len(cp.outputs("s")) < n:
            cp.decode("s")
        return cp.outputs("s")

    reference = alone(seeded, worker_seed=0)
    assert alone(seeded, worker_seed=7) == reference  # the worker's generator is not used
    assert alone(SamplingParams(temperature=1.0, top_p=0.95, seed=43), 0) != reference

    # Same request among an unseeded sampler and a greedy one, prefilled in two
    # chunks, preempted and recomputed from 0 into new blocks.
    params = {"s": seeded, "u": SamplingParams(temperature=1.0)}
    cp = Controlplane(make_runner(tiny_model_dir, seed=3), 48, params)
    cp.step({"u": -1, "g": -1}, new={"u": prompts["r1"], "g": prompts["r2"]})
    cp.step({"u": 1, "g": 1, "s": 4}, new={"s": prompts["r0"]})
    cp.step({"s": -1, "u": 1, "g": 1})
    cp.decode("g", "s", "u")
    cp.step({"u": 1, "g": 1}, preempted=["s"])
    cp.step({"g": 1, "s": -1, "u": 1}, resumed=["s"])
    while len(cp.outputs("s")) < n:
        cp.decode("u", "s", "g")
    assert cp.outputs("s")[:n] == reference


def test_real_model_kv_cache_geometry(tiny_model_dir):
    runner = make_runner(tiny_model_dir, num_blocks=6)
    m = runner.model
    # K and V, every local layer, block_size tokens of num_kv_heads x head_dim floats.
    per_block = 2 * m.num_local_layers * E2E_BLOCK_SIZE * m.num_kv_heads * m.head_dim * 4
    assert runner.profile_num_blocks(E2E_BLOCK_SIZE, 10 * per_block + 1, 0.9) == (10, per_block)
    assert len(runner.kv_caches) == m.num_local_layers
    assert all(c.shape == m.kv_cache_shape(6, E2E_BLOCK_SIZE) for c in runner.kv_caches)
    # One process holds the whole checkpoint: every tensor in it, nothing more.
    with safe_open(f"{tiny_model_dir}/model.safetensors", framework="pt") as f:
        checkpoint_bytes = sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # noqa: SIM118
    assert runner.weights_bytes() == checkpoint_bytes


@pytest.mark.slow
def test_tp2_pp2_ranks_replaying_the_broadcast_match_single_process(tiny_model_dir, tmp_path):
    runner = make_runner(tiny_model_dir)
    cp = Controlplane(runner, num_blocks=48)
    _run_mixed_schedule(cp, make_prompts(runner.model.vocab_size, [7, 13, 3, 10, 5]))
    tp, pp = 2, 2
    mp.spawn(
        replay_rank,
        args=(tp, pp, free_port(), tiny_model_dir, cp.history, str(tmp_path)),
        nprocs=tp * pp,
        join=True,
    )
    output_rank = (pp - 1) * tp
    for rank in range(tp * pp):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        if rank != output_rank:
            assert all(o is None for o in got), rank
            continue
        for (_, want), have in zip(cp.history, got, strict=True):
            assert (have.req_ids, have.sampled_token_ids) == (want.req_ids, want.sampled_token_ids)
