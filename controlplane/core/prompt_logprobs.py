"""Prompt logprobs on their way from the output rank to the client.

They arrive per prefill chunk (also for chunks that sampled nothing), and a
prefill that is recomputed (a preemption, a worker group failure) computes
positions the client already has; Request.prompt_logprobs_next remembers how
far the client got, so every position reaches it exactly once, in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from controlplane.core.outputs import EngineCoreOutput, PromptLogprobs
from controlplane.core.request import Request


def unsent_prompt_logprobs(
    chunks: Iterable[PromptLogprobs] | None, requests: Mapping[str, Request]
) -> list[PromptLogprobs]:
    """The parts of chunks the client has not had. Call it before finished
    requests leave `requests`: their last chunk may repeat positions too."""
    unsent = []
    for chunk in chunks or ():
        request = requests.get(chunk.req_id)
        if request is None:
            continue  # aborted since: nobody to send it to
        skip = request.prompt_logprobs_next - chunk.start_position
        end = chunk.start_position + len(chunk.positions)
        request.prompt_logprobs_next = max(request.prompt_logprobs_next, end)
        if skip <= 0:
            unsent.append(chunk)
        elif skip < len(chunk.positions):
            unsent.append(PromptLogprobs(chunk.req_id, chunk.start_position + skip,
                                         chunk.positions[skip:]))
    return unsent


def attach_prompt_logprobs(
    chunks: list[PromptLogprobs], outputs: list[EngineCoreOutput],
    requests: Mapping[str, Request],
) -> None:
    """Put each chunk on its request's output of this step; a chunk of a
    request that sampled nothing gets an output of its own with no tokens."""
    by_id = {out.request_id: out for out in outputs}
    for chunk in chunks:
        out = by_id.get(chunk.req_id)
        if out is None:
            request = requests.get(chunk.req_id)
            if request is None:
                continue
            out = EngineCoreOutput(
                chunk.req_id, [], num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
            outputs.append(out)
            by_id[chunk.req_id] = out
        out.prompt_logprobs = chunk
