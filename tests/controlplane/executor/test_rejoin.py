"""A rank that is alive but was cut off rejoins with its weights: over real
gRPC streams to fake workers (fake_worker.ScriptedWorker), recovery on.

A rank that goes silent (a partition: its stream stays open, nothing
arrives) fails the group at the heartbeat timeout and is released, its
stream ended without a Shutdown, so workerd re-registers instead of exiting;
when the same process (its instance id, from the same address) registers
for a rank still attached, the old stream is known dead at once and the
group re-forms with it, without waiting for the heartbeat timeout. Another
process cannot take a live rank over. A controlplane that stops with
--keep-workers-on-exit releases its workers rather than stopping them.
"""

from __future__ import annotations

import asyncio

from controlplane.executor.status import FailureKind, GroupState
from tests.controlplane.executor.fake_worker import ScriptedWorker
from tests.controlplane.executor.test_malformed_steps import WAIT_S, Harness
from tests.controlplane.executor.test_survivors import OUTPUT_RANK, _group, _serves, _until


def _worker(h: Harness, rank: int, instance: str) -> ScriptedWorker:
    return ScriptedWorker(h.address, rank=rank, output_rank=OUTPUT_RANK, instance_id=instance)


def test_a_silent_rank_is_released_and_rejoins_with_its_weights():
    async def scenario():
        async with Harness(pp=2, recovery_timeout_s=120.0, heartbeat_timeout_s=1.5) as h:
            survivor, cut = _worker(h, 0, "aaaa"), _worker(h, 1, "bbbb")
            await _group(h, survivor, cut)
            await _serves(h)
            cut.muted = True  # partitioned: alive, its stream open, nothing arrives
            reason = await asyncio.wait_for(h.failed.get(), WAIT_S)
            assert "rank 1" in reason and "heartbeat timeout 1.5 s" in reason
            await asyncio.wait_for(cut.ended.wait(), WAIT_S)
            assert cut.shutdown_reason is None  # released: it may come back
            await _until(lambda: survivor.num_resets == 1, "the survivor got Reset")
            # The link returns: the same process registers again.
            back = _worker(h, 1, "bbbb")
            back.num_loads = cut.num_loads  # the same process: its weights are loaded
            await _group(h, back)
            assert survivor.num_loads == 2 and back.num_loads == 2
            assert h.executor.status().failure_counts == {FailureKind.HEARTBEAT_TIMEOUT: 1}
            await _serves(h)

    asyncio.run(scenario())


def test_the_same_process_registering_again_proves_its_old_stream_dead():
    async def scenario():
        # The heartbeat timeout is far away: only the re-registration tells.
        async with Harness(pp=2, recovery_timeout_s=120.0) as h:
            survivor, cut = _worker(h, 0, "aaaa"), _worker(h, 1, "bbbb")
            await _group(h, survivor, cut)
            cut.muted = True
            await _group(h, _worker(h, 1, "bbbb"))
            reason = await asyncio.wait_for(h.failed.get(), WAIT_S)
            assert "rank 1" in reason and "registered again" in reason
            await asyncio.wait_for(cut.ended.wait(), WAIT_S)
            assert cut.shutdown_reason is None
            status = h.executor.status()
            assert status.state is GroupState.READY
            assert status.failure_counts == {FailureKind.DISCONNECTED: 1}
            assert survivor.num_resets == 1 and survivor.num_loads == 2
            await _serves(h)

    asyncio.run(scenario())


def test_another_process_takes_no_attached_rank_over():
    async def scenario():
        async with Harness(pp=2, recovery_timeout_s=120.0) as h:
            await _group(h, _worker(h, 0, "aaaa"), _worker(h, 1, "bbbb"))
            other = _worker(h, 1, "cccc")  # another process
            h.tasks.append(asyncio.create_task(other.run()))
            try:
                await asyncio.wait_for(other.registered, WAIT_S)
                raise AssertionError("a second process took rank 1")
            except Exception as exc:  # noqa: BLE001 - the refusal is a gRPC error
                assert "already attached" in str(exc), exc
            assert h.executor.status().state is GroupState.READY

    asyncio.run(scenario())


def test_keep_workers_on_exit_releases_them_and_the_default_stops_them():
    async def run(keep: bool) -> ScriptedWorker:
        async with Harness(keep_workers_on_exit=keep) as h:
            worker = ScriptedWorker(h.address, rank=0)
            await _group(h, worker)
        await asyncio.wait_for(worker.ended.wait(), WAIT_S)
        return worker

    released = asyncio.run(run(True))
    stopped = asyncio.run(run(False))
    assert released.shutdown_reason is None
    assert stopped.shutdown_reason == "controlplane is shutting down"
