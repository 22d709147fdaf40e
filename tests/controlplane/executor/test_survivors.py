"""The executor keeps the survivors of a failed group (recovery on): over real
gRPC streams to fake workers (fake_worker.ScriptedWorker) with a real
Scheduler deciding the steps.

When one rank of a PP=2 group is lost the other is not told to shut down: it
gets Reset, stays attached, and when a worker registers as the lost rank the
handshake runs again and the survivor answers LoadModel from the weights it
kept. Late answers to the failed group's calls change nothing; a survivor
that cannot answer Reset is let go; a second loss while re-forming only frees
that rank's slot; a worker error (nobody died) re-forms the group from the
survivors alone; a protocol violator is let go, the others kept.
"""

from __future__ import annotations

import asyncio

from controlplane.executor.status import FailureKind, GroupState
from controlplane.executor.worker_calls import WorkerGroupFailed
from kvloom.worker.v1 import worker_pb2
from tests.controlplane.executor.fake_worker import GOOD_TOKEN, Fault, ScriptedWorker
from tests.controlplane.executor.test_malformed_steps import (
    WAIT_S,
    Harness,
    _scheduler,
    _serve,
)

OUTPUT_RANK = 1  # TP=1 x PP=2


def _harness(**kwargs) -> Harness:
    return Harness(pp=2, recovery_timeout_s=120.0, **kwargs)


def _worker(h: Harness, rank: int, **kwargs) -> ScriptedWorker:
    return ScriptedWorker(h.address, rank=rank, output_rank=OUTPUT_RANK, **kwargs)


async def _until(cond, what: str) -> None:
    async def poll():
        while not cond():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), WAIT_S)
    except TimeoutError:
        raise AssertionError(f"never happened: {what}") from None


async def _serves(h: Harness) -> None:
    tokens, failure = await _serve(h, _scheduler(h.executor.status().num_gpu_blocks))
    assert failure is None
    assert tokens == {"a": [GOOD_TOKEN] * 4, "b": [GOOD_TOKEN] * 4}


def _kill(h: Harness, worker: ScriptedWorker) -> None:
    """The worker's process dies: its stream breaks without a goodbye."""
    h.tasks[h.workers.index(worker)].cancel()


async def _group(h: Harness, *workers: ScriptedWorker) -> int:
    h.workers = [*getattr(h, "workers", []), *workers]
    return await h.group(*workers)


def test_a_lost_rank_is_replaced_and_the_survivor_keeps_its_weights():
    async def scenario():
        async with _harness() as h:
            survivor, victim = _worker(h, 0), _worker(h, 1)
            await _group(h, survivor, victim)
            await _serves(h)

            _kill(h, victim)
            reason = await asyncio.wait_for(h.failed.get(), WAIT_S)
            assert "rank 1" in reason and "disconnected" in reason
            await _until(lambda: survivor.num_resets == 1, "the survivor got Reset")
            status = h.executor.status()
            assert status.state is GroupState.FORMING
            assert [r.rank for r in status.ranks] == [0]
            assert survivor.shutdown_reason is None and not survivor.ended.is_set()

            # Its replacement registers under the same rank; the group re-forms.
            await _group(h, _worker(h, 1))
            assert h.executor.status().ready
            assert survivor.num_loads == 2  # answered reused=True the second time
            await _serves(h)

    asyncio.run(scenario())


def test_answers_to_the_failed_groups_calls_are_dropped():
    async def scenario():
        async with _harness() as h:
            survivor, victim = _worker(h, 0), _worker(h, 1)
            await _group(h, survivor, victim)
            last_call = h.executor._calls.last_id  # init_kv_cache of that group
            _kill(h, victim)
            await asyncio.wait_for(h.failed.get(), WAIT_S)
            await _until(lambda: survivor.num_resets == 1, "the survivor got Reset")
            # The survivor's step failed when its peer died; the error arrives late.
            handle = h.executor._handles[0]
            late = worker_pb2.WorkerMessage(
                call_id=last_call, error=worker_pb2.WorkerError(kind="execute_model",
                                                               message="peer closed"))
            h.executor.on_message(handle, late)
            status = h.executor.status()
            assert status.num_attached == 1 and survivor.shutdown_reason is None
            assert status.failure_counts == {FailureKind.DISCONNECTED: 1}

    asyncio.run(scenario())


def test_a_survivor_that_cannot_answer_reset_is_let_go(caplog):
    async def scenario():
        # The Reset round is bounded by the heartbeat timeout.
        async with _harness(heartbeat_timeout_s=1.5) as h:
            stuck, victim = _worker(h, 0, ignore_reset=True), _worker(h, 1)
            await _group(h, stuck, victim)
            _kill(h, victim)
            await asyncio.wait_for(h.failed.get(), WAIT_S)
            await asyncio.wait_for(stuck.ended.wait(), WAIT_S)
            # Released, not shut down: a live worker comes back with its weights.
            assert stuck.shutdown_reason is None
            assert "rank 0 let go while the group re-forms: did not answer Reset within " \
                   "1.5 s" in caplog.text
            assert h.executor.status().num_attached == 0
            # Both come back (their supervisor restarted them) and serve.
            await _group(h, _worker(h, 0), _worker(h, 1))
            await _serves(h)

    asyncio.run(scenario())


def test_a_second_loss_while_re_forming_frees_only_that_slot():
    async def scenario():
        async with _harness() as h:
            survivor, victim = _worker(h, 0), _worker(h, 1)
            await _group(h, survivor, victim)
            _kill(h, victim)
            await asyncio.wait_for(h.failed.get(), WAIT_S)
            await _until(lambda: survivor.num_resets == 1, "the survivor got Reset")
            _kill(h, survivor)
            await _until(lambda: h.executor.status().num_attached == 0, "rank 0 let go")
            # No second group failure: there was no group.
            assert h.failed.empty()
            assert h.executor.status().state is GroupState.FORMING
            await _group(h, _worker(h, 1), _worker(h, 0))
            await _serves(h)

    asyncio.run(scenario())


def test_a_worker_error_re_forms_the_group_from_the_survivors_alone():
    async def scenario():
        async with _harness() as h:
            ranks = [_worker(h, 0), _worker(h, 1)]
            await _group(h, *ranks)
            # The step fails on the output rank (an exception in its step).
            ranks[1].fault = Fault("error", at_step=1)
            tokens, failure = await _serve(h, _scheduler(h.executor.status().num_gpu_blocks))
            assert isinstance(failure, WorkerGroupFailed) and "boom" in str(failure)
            await asyncio.wait_for(h.failed.get(), WAIT_S)
            ranks[1].fault = None
            # Nobody registers: both ranks were kept and the group re-forms.
            await asyncio.wait_for(h.ready.get(), WAIT_S)
            assert [w.num_resets for w in ranks] == [1, 1]
            assert [w.num_loads for w in ranks] == [2, 2]
            assert all(w.shutdown_reason is None for w in ranks)
            await _serves(h)

    asyncio.run(scenario())


def test_a_protocol_violator_is_let_go_and_the_others_kept():
    async def scenario():
        async with _harness() as h:
            survivor, bad = _worker(h, 0), _worker(h, 1, fault=Fault("out_of_vocab"))
            await _group(h, survivor, bad)
            tokens, failure = await _serve(h, _scheduler(h.executor.status().num_gpu_blocks))
            assert "protocol violation: rank 1" in str(failure)
            await asyncio.wait_for(bad.ended.wait(), WAIT_S)
            assert "protocol violation" in bad.shutdown_reason
            await _until(lambda: survivor.num_resets == 1, "the survivor got Reset")
            assert survivor.shutdown_reason is None
            await _group(h, _worker(h, 1))
            await _serves(h)

    asyncio.run(scenario())


def test_a_survivor_naming_an_impossible_rendezvous_port_is_let_go():
    class BadPort(ScriptedWorker):
        async def _on(self, msg):
            if msg.WhichOneof("command") == "reset":
                self.num_resets += 1
                reply = worker_pb2.WorkerMessage(call_id=msg.call_id)
                reply.reset_done.dist_port = 70000
                await self._outbox.put(reply)
                return
            await super()._on(msg)

    async def scenario():
        async with _harness() as h:
            liar, victim = BadPort(h.address, rank=0, output_rank=OUTPUT_RANK), _worker(h, 1)
            await _group(h, liar, victim)
            _kill(h, victim)
            await asyncio.wait_for(h.failed.get(), WAIT_S)
            await asyncio.wait_for(liar.ended.wait(), WAIT_S)
            assert "rendezvous port 70000" in liar.shutdown_reason
            assert h.executor.status().failure_counts[FailureKind.PROTOCOL_VIOLATION] == 1
            await _group(h, _worker(h, 0), _worker(h, 1))
            await _serves(h)

    asyncio.run(scenario())
