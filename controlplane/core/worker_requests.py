"""Which requests the worker group holds state for: the one record of it.

A request is held from the step that sends it in full (NewRequestData) until
the step that sends its id as finished has gone out; a preempted request stays
held (the workers keep its state, and a resume sends only its block list).
The scheduler asks holds() to choose between the full data and the diff, and
tells step_scheduled() what each step sends. A group that fails or is
replaced holds nothing (forget()).

ids() is every id the workers may hold. EngineCore reads it when it replaces
a scheduler it cannot trust any more (an internal error): its successor sends
them all as finished (failover.inherit_worker_ids). An id sent as finished
counts until the next step is scheduled, which the engine does only once the
step carrying it went out: a step that never reached the workers (its
submission raised) leaves no state behind on them.
"""

from __future__ import annotations

from collections.abc import Iterable

from controlplane.core.outputs import CachedRequestData, NewRequestData
from controlplane.core.request import Request, min_tokens_stop_ids


class WorkerRequests:
    def __init__(self) -> None:
        # By id, the Request object: a client may reuse the id of a request
        # that finished, and the new one is not held until it is sent.
        self._held: dict[str, Request] = {}
        # Sent as finished by the latest step, or inherited and not sent yet.
        self._leaving: set[str] = set()

    def holds(self, request: Request) -> bool:
        return self._held.get(request.request_id) is request

    def emit_admitted(self, request: Request, block_ids: list[int], num_computed: int,
                      new_reqs: list[NewRequestData], cached: CachedRequestData) -> None:
        """An admitted request in the step's diff: in full for workers that do
        not hold it; for one back from preemption (the workers kept its
        state, tokens included) the replacement block list."""
        req_id = request.request_id
        if not self.holds(request):
            new_reqs.append(NewRequestData(
                req_id, request.prompt_token_ids, list(request.output_token_ids),
                request.sampling_params, block_ids, num_computed,
                min_tokens_stop_ids(request),
                request.lora.lora_id if request.lora is not None else 0))
        else:
            cached.req_ids.append(req_id)
            cached.resumed_from_preemption.append(True)
            cached.new_block_ids.append(block_ids)
            cached.num_computed_tokens.append(num_computed)

    def step_scheduled(self, new: Iterable[Request], finished: set[str]) -> None:
        """A step sends `new` in full and `finished` as finished. Workers drop
        finished ids before they add new ones, so an id both finished and new
        (reused) is held again."""
        held = self._held
        for req_id in finished:
            held.pop(req_id, None)
        for request in new:
            held[request.request_id] = request
        self._leaving = {r for r in finished if r not in held}

    def inherit(self, req_ids: set[str]) -> None:
        """Ids a replaced scheduler's workers may hold, to be sent as finished."""
        self._leaving |= req_ids

    def ids(self) -> set[str]:
        return set(self._held) | self._leaving

    def forget(self) -> None:
        """The group failed or was replaced: it holds no request state."""
        self._held.clear()
        self._leaving.clear()
