"""Waiting queues of the scheduler, one per scheduling policy.

"fcfs" serves arrival order; "priority" serves the smallest Request.priority
first, ties by arrival. Either way a preempted request re-enters ahead of
requests that never ran, so recompute is not starved by new arrivals.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from controlplane.core.request import Request


class FCFSRequestQueue:
    """Waiting requests in arrival order; preempted ones re-enter at the head."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_many(self, requests: list[Request]) -> None:
        self._queue.extendleft(reversed(requests))

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_ids(self, req_ids: set[str]) -> None:
        self._queue = deque(r for r in self._queue if r.request_id not in req_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Waiting requests by (priority, arrival_time); a preempted request simply
    re-enters at its rank, which puts it ahead of later equal-priority ones."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        # Tie-breaker so the heap never compares Request objects.
        self._seq = itertools.count()

    def push(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._seq), request)
        heapq.heappush(self._heap, entry)

    prepend = push

    def prepend_many(self, requests: list[Request]) -> None:
        for request in requests:
            self.push(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_ids(self, req_ids: set[str]) -> None:
        self._heap = [e for e in self._heap if e[3].request_id not in req_ids]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: str) -> RequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
