"""CachedRequestState and the persistent InputBatch: rows stay put while a
request runs, holes are filled, condense() leaves a dense prefix and the block
table follows every move."""

from __future__ import annotations

import torch

from workerd.runner.input_batch import BlockTable, CachedRequestState, InputBatch
from workerd.runner.sched_output import NewRequestData, SamplingParams

torch.set_num_threads(1)


def _state(req_id: str, block_ids: list[int], prompt_len: int = 3) -> CachedRequestState:
    new = NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        output_token_ids=[],
        sampling_params=SamplingParams(temperature=0.0),
        block_ids=block_ids,
        num_computed_tokens=0,
    )
    return CachedRequestState.from_new_request(new, torch.device("cpu"))


def _rows(batch: InputBatch) -> dict[str, list[int]]:
    """req_id -> block ids as the block table holds them for its row."""
    table = batch.block_table
    return {
        rid: table.table[row, : table.num_blocks[row]].tolist()
        for rid, row in batch.req_id_to_index.items()
    }


def test_state_from_new_request_with_outputs_keeps_prompt_and_outputs():
    new = NewRequestData(
        req_id="r",
        prompt_token_ids=[5, 6, 7],
        output_token_ids=[8, 9],
        sampling_params=SamplingParams(seed=3),
        block_ids=[4, 1],
        num_computed_tokens=0,
    )
    s = CachedRequestState.from_new_request(new, torch.device("cpu"))
    assert s.all_token_ids == [5, 6, 7, 8, 9]
    assert s.num_prompt_tokens == 3 and s.num_output_tokens == 2
    assert s.output_token_ids == [8, 9]
    assert s.generator is not None
    s.append_token_ids([10])
    assert s.num_tokens == 6 and s.output_token_ids == [8, 9, 10]
    # The state must own its lists: the diff's lists are not ours to mutate.
    s.block_ids.append(99)
    assert new.block_ids == [4, 1] and new.prompt_token_ids == [5, 6, 7]


def test_seeded_generator_depends_on_seed_and_output_index_only():
    def draw(state):
        return torch.rand(4, generator=state.generator_for_next_token()).tolist()

    a = _state("a", [])
    a.sampling_params = SamplingParams(seed=7)
    a.generator = torch.Generator()
    b = _state("b", [], prompt_len=9)
    b.sampling_params = SamplingParams(seed=7)
    b.generator = torch.Generator()
    first = draw(a)
    assert draw(a) == first  # same output index -> same stream
    assert draw(b) == first  # prompt length does not matter, only the output index
    a.append_token_ids([1])
    assert draw(a) != first
    unseeded = _state("u", [])
    assert unseeded.generator_for_next_token() is None


def test_only_a_seeded_request_that_samples_gets_a_generator():
    def state(**params):
        new = NewRequestData(req_id="r", prompt_token_ids=[1, 2], output_token_ids=[],
                             sampling_params=SamplingParams(**params), block_ids=[0],
                             num_computed_tokens=0)
        return CachedRequestState.from_new_request(new, torch.device("cpu"))

    assert state(seed=7, temperature=0.8).generator is not None
    # Greedy never draws: no generator to reseed each step, seed or not.
    assert state(seed=7, temperature=0.0).generator is None
    assert state(seed=7, temperature=1e-6).generator is None
    assert state(temperature=0.8).generator is None


def test_add_remove_fill_holes_and_condense():
    batch = InputBatch(max_num_reqs=2, max_num_blocks=2)
    rows = [batch.add_request(_state(f"r{i}", [10 * i, 10 * i + 1])) for i in range(5)]
    assert rows == [0, 1, 2, 3, 4]  # grew past the initial capacity
    assert batch.remove_request("r1") == 1
    assert batch.remove_request("r3") == 3
    assert batch.remove_request("nope") is None
    # A new request takes the lowest hole.
    assert batch.add_request(_state("n", [77])) == 1
    batch.condense()
    assert batch.num_reqs == 4
    assert sorted(batch.req_id_to_index.values()) == [0, 1, 2, 3]
    assert [s.req_id for s in batch.states()] == batch.req_ids
    # r4 moved from row 4 into the hole at row 3, with its blocks.
    assert batch.req_id_to_index["r4"] == 3
    assert _rows(batch) == {"r0": [0, 1], "n": [77], "r2": [20, 21], "r4": [40, 41]}
    # Vacated rows hold no stale block ids.
    assert batch.block_table.num_blocks[4] == 0
    assert batch.block_table.table[4].abs().sum().item() == 0


def test_condense_removes_trailing_and_leading_holes():
    batch = InputBatch()
    for i in range(4):
        batch.add_request(_state(f"r{i}", [i]))
    for rid in ("r0", "r3", "r2"):
        batch.remove_request(rid)
    batch.condense()
    assert batch.req_ids == ["r1"] and batch.req_id_to_index == {"r1": 0}
    assert _rows(batch) == {"r1": [1]}
    batch.remove_request("r1")
    batch.condense()
    assert batch.num_reqs == 0 and batch.requests == []


def test_block_table_append_set_and_view():
    batch = InputBatch(max_num_reqs=1, max_num_blocks=1)
    batch.add_request(_state("a", [3]))
    batch.add_request(_state("b", [5, 6]))
    batch.append_block_ids("a", [8, 9, 2])
    assert _rows(batch) == {"a": [3, 8, 9, 2], "b": [5, 6]}
    # Replacing with a shorter list (resume after preemption) clears the tail.
    batch.set_block_ids("a", [1])
    assert _rows(batch) == {"a": [1], "b": [5, 6]}
    assert batch.block_table.view(2).tolist() == [[1, 0], [5, 6]]


def test_block_table_growth_preserves_contents():
    table = BlockTable(max_num_reqs=1, max_num_blocks=1)
    table.set_row(0, [1])
    for i in range(2, 40):
        table.append_row(0, [i])
    table.set_row(3, [7, 7])
    assert table.table[0, :39].tolist() == list(range(1, 40))
    assert table.num_blocks[:4] == [39, 0, 0, 2]
    assert table.view(1).shape == (1, 39)
