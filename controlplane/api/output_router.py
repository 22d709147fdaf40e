"""Routes engine outputs to the client streams waiting for them.

The engine thread hands each step's outputs over in one call_soon_threadsafe;
dispatch() then runs on the event loop and feeds one asyncio.Queue per
in-flight request id.
"""

from __future__ import annotations

import asyncio

from controlplane.core.outputs import EngineCoreOutput


class DuplicateRequestId(KeyError):
    pass


class OutputRouter:
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        # Every token dispatched so far (GetLoads' gen_throughput reads it).
        self.num_tokens = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queues

    def __len__(self) -> int:
        return len(self._queues)

    def register(
        self, request_id: str, queue: asyncio.Queue[EngineCoreOutput] | None = None
    ) -> asyncio.Queue[EngineCoreOutput]:
        """Route request_id's outputs to `queue` (a new one when None); the n
        samples of one Generate call share a queue."""
        if request_id in self._queues:
            raise DuplicateRequestId(request_id)
        q: asyncio.Queue[EngineCoreOutput] = asyncio.Queue() if queue is None else queue
        self._queues[request_id] = q
        return q

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        queues = self._queues
        num_tokens = 0
        for out in outputs:
            num_tokens += len(out.new_token_ids)
            q = queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
        self.num_tokens += num_tokens
