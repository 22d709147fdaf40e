"""What the output rank must answer to a step, worked out when it is scheduled.

The executor checks every reply against it (executor/reply_check.py): workers
are authenticated but not trusted, and a reply with one token too few or one
for a request that samples nothing must never reach the scheduler. The
record is the scheduler's, kept with the step (ScheduledStep.expected), never
sent: a request samples when the step completes its context (as the worker
decides), and prompt logprobs come only from the positions the step computes.
"""

from __future__ import annotations

from controlplane.core.outputs import ExpectedReply, PromptLogprobsWindow, SchedulerOutput
from controlplane.core.request import Request


def expected_reply(so: SchedulerOutput, requests: dict[str, Request]) -> ExpectedReply:
    """The reply step `so` expects, right after it was scheduled: num_computed_tokens
    already covers the step, placeholders do not yet."""
    expected = ExpectedReply(so.step_id)
    sampling = expected.sampling_reqs
    spec = so.scheduled_spec_decode_tokens
    for req_id, num_new in so.num_scheduled_tokens.items():
        request = requests[req_id]
        params = request.sampling_params
        num_computed = request.num_computed_tokens  # already advanced by num_new
        num_drafts = len(spec[req_id]) if spec and req_id in spec else 0
        if num_computed == (len(request.all_token_ids) + request.num_output_placeholders
                            + num_drafts):
            sampling[req_id] = params.logprobs
            if num_drafts:
                expected.num_draft_tokens[req_id] = num_drafts
        # A request that sampled once has had its whole prompt's logprobs.
        if params.prompt_logprobs is not None and not request.output_token_ids:
            start = num_computed - num_new + 1
            stop = min(num_computed + 1, len(request.prompt_token_ids))
            if start < stop:
                expected.prompt_logprobs_windows[req_id] = PromptLogprobsWindow(
                    params.prompt_logprobs, start, stop
                )
    return expected
