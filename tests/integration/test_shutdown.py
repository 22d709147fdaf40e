"""Shutdown fits orchestrators, with real daemons on loopback.

A workerd SIGTERMed mid-generation finishes its current step, closes its
stream cleanly and exits 0; the controlplane reports the group failure (the
stream in flight ends UNAVAILABLE naming the clean close, readiness turns
NOT_SERVING) and stays up. A controlplane SIGTERMed while a step can never
finish (its worker frozen, step and heartbeat deadlines far away) still exits
with code 0: the drain is cut at --shutdown-timeout, the step in flight is
failed, and the stream ends UNAVAILABLE. (Nothing else could end it: the
step and heartbeat deadlines are 600 s away.)

The worker is frozen (SIGSTOP) before it is signalled, so the generation is
provably mid-way when the signal lands; no timing is asserted, and every wait
only bounds a hang.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from kvloom.client import KvloomClient
from tests.integration.api_helpers import greedy_request, stub_for
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

READY = "kvloom.v1.Generation"
PROMPT = [5, 6]
MAX_TOKENS = 500  # the tiny model's context is 512: far more than a few steps
WAIT_S = 60.0


def _health(address: str, service: str = READY) -> str:
    with KvloomClient(address) as client:
        return client.health(service, timeout=5)


def _process(cluster, name: str):
    return next(p.popen for p in cluster.processes if p.name == name)


async def _generate_until_signalled(address: str, before_signal) -> tuple[list[int], object]:
    """Start a long greedy generation, call before_signal() once its first
    tokens arrived, then read the rest; (tokens, the error that ended it)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = stub_for(channel).Generate(
            greedy_request(PROMPT, max_tokens=MAX_TOKENS), timeout=WAIT_S
        )
        first = await call.read()
        await asyncio.to_thread(before_signal)
        tokens = list(first.token_ids)
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                tokens.extend(msg.token_ids)
        except grpc.aio.AioRpcError as exc:
            return tokens, exc
        pytest.fail(f"the generation finished ({len(tokens)} tokens) instead of failing")


def test_sigterm_lets_a_worker_finish_its_step_and_exit_0(tiny_model_dir):
    # Fail-fast, so the client's status shows how the worker left (with
    # recovery on, test_recovery.py, the request would wait for a new rank).
    with running_cluster(tiny_model_dir, args=("--engine-recovery-timeout", "0")) as cluster:
        controlplane, worker = _process(cluster, "controlplane"), _process(cluster, "rank 0")

        def sigterm_the_frozen_worker() -> None:
            worker.send_signal(signal.SIGSTOP)
            try:
                worker.send_signal(signal.SIGTERM)
            finally:
                worker.send_signal(signal.SIGCONT)

        tokens, error = asyncio.run(
            _generate_until_signalled(cluster.api_address, sigterm_the_frozen_worker)
        )
        assert worker.wait(timeout=WAIT_S) == 0
        # The group failure, fail-fast: UNAVAILABLE, and the worker left
        # cleanly: its stream was closed, not broken, and no step deadline passed.
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "closed its stream" in error.details(), error.details()
        assert 0 < len(tokens) < MAX_TOKENS
        # What streamed before is exact: the last step's reply was whole.
        assert tokens == hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)[: len(tokens)]
        assert controlplane.poll() is None
        assert _health(cluster.api_address, "") == "SERVING"
        assert _health(cluster.api_address) == "NOT_SERVING"
        log = "".join(cluster.log_sink.lines)
        assert "SIGTERM: finishing the current command" in log
        assert "stopped on SIGTERM" in log


def test_controlplane_exits_within_the_shutdown_timeout_even_if_a_step_never_ends(
    tiny_model_dir,
):
    args = ("--shutdown-timeout", "4", "--step-timeout", "600", "--heartbeat-timeout", "600")
    with running_cluster(tiny_model_dir, args=args) as cluster:
        controlplane, worker = _process(cluster, "controlplane"), _process(cluster, "rank 0")

        def freeze_worker_then_sigterm_controlplane() -> None:
            worker.send_signal(signal.SIGSTOP)
            controlplane.send_signal(signal.SIGTERM)

        try:
            tokens, error = asyncio.run(
                _generate_until_signalled(
                    cluster.api_address, freeze_worker_then_sigterm_controlplane
                )
            )
            # Nothing else ends it: the step and heartbeat deadlines are 600 s.
            assert controlplane.wait(timeout=WAIT_S) == 0
        finally:
            worker.send_signal(signal.SIGCONT)
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "shutting down" in error.details(), error.details()
        assert 0 < len(tokens) < MAX_TOKENS
        # The drain was cut by the timeout, not ended by the request.
        log = "".join(cluster.log_sink.lines)
        assert "--shutdown-timeout: stopping with 1 request(s) still in flight" in log
