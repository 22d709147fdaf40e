"""OutputRouter on its own: each engine output reaches the queue of its request
id (the n samples of one call may share one), a taken id is refused, and
outputs for ids nobody waits on (finished, cancelled, never seen) are dropped
without disturbing the others."""

from __future__ import annotations

import asyncio
import threading

import pytest

from controlplane.api.output_router import DuplicateRequestId, OutputRouter
from controlplane.core.outputs import EngineCoreOutput
from controlplane.core.request import FinishReason


def _out(req_id: str, *tokens: int, finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=req_id, new_token_ids=list(tokens), finish_reason=finish)


def _drain(q: asyncio.Queue) -> list[EngineCoreOutput]:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def test_dispatch_routes_each_output_to_its_request_in_order():
    router = OutputRouter()
    qa, qb = router.register("a"), router.register("b")
    assert qa is not qb
    router.dispatch([_out("a", 1), _out("b", 2), _out("a", 3, finish=FinishReason.LENGTH)])
    assert [o.new_token_ids for o in _drain(qa)] == [[1], [3]]
    assert [o.new_token_ids for o in _drain(qb)] == [[2]]


def test_samples_of_one_call_share_a_queue():
    router = OutputRouter()
    shared = router.register("p/0")
    assert router.register("p/1", shared) is shared
    router.dispatch([_out("p/1", 5), _out("p/0", 4)])
    assert [o.request_id for o in _drain(shared)] == ["p/1", "p/0"]


def test_duplicate_id_is_refused_and_keeps_the_first_route():
    router = OutputRouter()
    first = router.register("x")
    with pytest.raises(DuplicateRequestId) as info:
        router.register("x")
    assert isinstance(info.value, KeyError) and "x" in str(info.value)
    other: asyncio.Queue = asyncio.Queue()
    with pytest.raises(DuplicateRequestId):
        router.register("x", other)
    router.dispatch([_out("x", 9)])
    assert [o.new_token_ids for o in _drain(first)] == [[9]]
    assert other.empty()
    assert len(router) == 1


def test_outputs_for_unknown_or_unregistered_ids_are_dropped():
    router = OutputRouter()
    live = router.register("live")
    gone = router.register("gone")
    router.unregister("gone")
    # Engine outputs can trail a cancelled stream, or name an id never seen.
    router.dispatch([_out("gone", 1), _out("never", 2), _out("live", 3)])
    assert [o.new_token_ids for o in _drain(live)] == [[3]]
    assert gone.empty()
    assert "gone" not in router and "never" not in router and "live" in router


def test_unregister_is_idempotent_and_frees_the_id():
    router = OutputRouter()
    router.register("r")
    assert len(router) == 1 and "r" in router
    router.unregister("r")
    router.unregister("r")
    router.unregister("not-there")
    assert len(router) == 0 and "r" not in router
    again = router.register("r")  # an id may be reused once its call ended
    router.dispatch([_out("r", 7)])
    assert [o.new_token_ids for o in _drain(again)] == [[7]]


def test_dispatch_from_the_engine_thread_wakes_the_waiting_stream():
    """The server hands each step's outputs over with call_soon_threadsafe."""

    async def scenario():
        loop = asyncio.get_running_loop()
        router = OutputRouter()
        q = router.register("r")
        engine = threading.Thread(
            target=lambda: loop.call_soon_threadsafe(
                router.dispatch, [_out("r", 1), _out("r", 2, finish=FinishReason.STOP)]
            )
        )
        engine.start()
        try:
            first = await asyncio.wait_for(q.get(), 10)
            second = await asyncio.wait_for(q.get(), 10)
        finally:
            engine.join()
        assert (first.new_token_ids, second.finish_reason) == ([1], FinishReason.STOP)

    asyncio.run(scenario())
