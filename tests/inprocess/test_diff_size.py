"""The decode-step diff grows with the number of requests, never their length:
measured on the bytes the executor hands a real worker (InProcessExecutor),
which must keep accepting them as its requests grow."""

from __future__ import annotations

from kvloom_testing.inprocess import InProcessExecutor
from kvloom_testing.scheduler import make_scheduler
from kvloom_testing.slot_probe import SlotProbeModel
from tests.controlplane.core.helpers import make_request

NUM_REQS = 8


def decode_step_bytes(prompt_len: int, num_decode_steps: int = 40) -> list[int]:
    sched = make_scheduler(
        num_blocks=4000,
        block_size=16,
        max_num_seqs=NUM_REQS,
        max_num_batched_tokens=8192,
        max_model_len=4096,
    )
    executor = InProcessExecutor(SlotProbeModel(), block_size=16, num_gpu_blocks=4000)

    sizes = []

    def step():
        scheduled = sched.schedule_step()
        so = scheduled.scheduler_output
        pending = executor.submit(so, scheduled.expected)
        sched.update_from_output(so, pending.wait())
        sizes.append(pending.step_bytes)
        return so

    for i in range(NUM_REQS):
        sched.add_request(make_request(prompt_len, max_tokens=200, req_id=f"req-{i}"))
    reqs = [sched.get_request(f"req-{i}") for i in range(NUM_REQS)]
    while any(r.num_output_tokens == 0 for r in reqs):  # chunked prefill
        step()
    del sizes[:]
    for _ in range(num_decode_steps):
        so = step()
        assert so.total_num_scheduled_tokens == NUM_REQS and not so.scheduled_new_reqs
    # The worker followed: it appended every sampled token itself.
    assert all(
        executor.runner.requests[r.request_id].all_token_ids == r.all_token_ids
        for r in reqs
    )
    return sizes


def test_decode_diff_does_not_grow_with_sequence_length():
    short = decode_step_bytes(prompt_len=20)
    long = decode_step_bytes(prompt_len=3000)
    # Only varint widths may differ (num_computed_tokens 20 -> 3000 is 1 more byte).
    assert max(long) - max(short) <= 3 * NUM_REQS
    # And within one run it stays flat as the sequences grow by 40 tokens.
    assert max(long) - min(long) <= 2 * NUM_REQS
    assert max(long) / NUM_REQS < 40  # a handful of bytes per running request
