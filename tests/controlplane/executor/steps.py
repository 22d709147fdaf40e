"""A one-token decode step for executor tests that play the workers by hand."""

from __future__ import annotations

from controlplane.core.outputs import CachedRequestData, ExpectedReply, SchedulerOutput


def decode_step(req_ids: list[str]) -> tuple[SchedulerOutput, ExpectedReply]:
    """Every request decodes one token past 5 computed ones, and samples: the
    step and the reply it expects (submit's two arguments)."""
    n = len(req_ids)
    so = SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=list(req_ids),
            resumed_from_preemption=[False] * n,
            new_block_ids=[[]] * n,
            num_computed_tokens=[5] * n,
        ),
        num_scheduled_tokens=dict.fromkeys(req_ids, 1),
        total_num_scheduled_tokens=n,
        finished_req_ids=set(),
        preempted_req_ids=set(),
    )
    return so, ExpectedReply(so.step_id, sampling_reqs=dict.fromkeys(req_ids))
