"""The decode-step diff grows with the number of requests, never their length."""

from __future__ import annotations

from controlplane.executor.wire import scheduler_output_to_proto
from tests.controlplane.core.helpers import make_request, make_scheduler, step

NUM_REQS = 8


def decode_diff_bytes(prompt_len: int, num_decode_steps: int = 40) -> list[int]:
    sched = make_scheduler(
        num_blocks=4000,
        block_size=16,
        max_num_seqs=NUM_REQS,
        max_num_batched_tokens=8192,
        max_model_len=4096,
    )
    for i in range(NUM_REQS):
        sched.add_request(make_request(prompt_len, max_tokens=200, req_id=f"req-{i}"))
    reqs = [sched.get_request(f"req-{i}") for i in range(NUM_REQS)]
    while any(r.num_output_tokens == 0 for r in reqs):  # chunked prefill
        step(sched)
    sizes = []
    for _ in range(num_decode_steps):
        so, _ = step(sched)
        assert so.total_num_scheduled_tokens == NUM_REQS and not so.scheduled_new_reqs
        sizes.append(scheduler_output_to_proto(so).ByteSize())
    return sizes


def test_decode_diff_does_not_grow_with_sequence_length():
    short = decode_diff_bytes(prompt_len=20)
    long = decode_diff_bytes(prompt_len=3000)
    # Only varint widths may differ (num_computed_tokens 20 -> 3000 is 1 more byte).
    assert max(long) - max(short) <= 3 * NUM_REQS
    # And within one run it stays flat as the sequences grow by 40 tokens.
    assert max(long) - min(long) <= 2 * NUM_REQS
    assert max(long) / NUM_REQS < 40  # a handful of bytes per running request
