"""Prefill/decode disaggregation when something dies or nobody comes (real
clusters over loopback, as test_pd_disaggregation.py): nothing is lost.

* The producer's rank, or its whole cluster, SIGKILLed between the legs:
  the consumer finds the lease gone (or the producer unreachable) and
  prefills the prompt itself (the recompute policy): transformers' tokens.
  Under kv_load_failure_policy fail the decode leg ends UNAVAILABLE.
* The producer's rank SIGKILLed while the consumer reads (stopped first, so
  the read is surely in flight): the read fails, its blocks are recomputed,
  the tokens are exact.
* No decode leg ever comes (a client gone between the legs), or the consumer
  dies before it reads: the producer frees the blocks when the lease runs
  out, and counts it; a client that cancels its decode leg frees them at once.
* A producer of another block size is refused naming the field."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import grpc
import pytest

from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy
from tests.integration.test_pd_disaggregation import (
    MAX_TOKENS,
    _complete,
    _no_leaks,
    _request,
    _transfer_config,
)

pytestmark = pytest.mark.slow

PROMPT = [5, 9, 40, 41, 77, 12, 3, 8, 99, 100, 31, 7, 2, 60, 61, 62, 63]


def _prefill(address: str, prompt=PROMPT, request_id="r0") -> str:
    done = asyncio.run(_complete(address, _request(prompt, 1, request_id,
                                                   {"do_remote_decode": True})))
    return done.kv_transfer_params_json


def _decode(address: str, params: str, prompt=PROMPT, request_id="r0"):
    return asyncio.run(_complete(address, _request(prompt, MAX_TOKENS, request_id, params)))


def _kill(cluster, name: str, sig=signal.SIGKILL) -> None:
    proc = next(p for p in cluster.processes if p.name == name)
    proc.popen.send_signal(sig)
    if sig == signal.SIGKILL:
        proc.popen.wait(10)


def _metric(cluster, name: str) -> float:
    text = urllib.request.urlopen(cluster.metrics_address, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.mark.parametrize("victim", ["rank 0", "controlplane"])
def test_a_producer_killed_between_the_legs_costs_a_prefill_not_the_request(tiny_model_dir,
                                                                             victim):
    with running_cluster(tiny_model_dir, args=_transfer_config("kv_producer")) as prod, \
            running_cluster(tiny_model_dir, args=_transfer_config("kv_consumer")) as cons:
        params = _prefill(prod.api_address)
        _kill(prod, victim)
        done = _decode(cons.api_address, params)
        assert list(done.output_ids) == hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)
        assert done.cached_tokens == 0  # prefilled here
        asyncio.run(_no_leaks(cons.api_address))


def test_under_the_fail_policy_a_lost_producer_ends_the_decode_leg(tiny_model_dir):
    with running_cluster(tiny_model_dir, args=_transfer_config("kv_producer")) as prod, \
            running_cluster(tiny_model_dir, args=_transfer_config(
                "kv_consumer", kv_load_failure_policy="fail")) as cons:
        params = _prefill(prod.api_address)
        _kill(prod, "rank 0")
        with pytest.raises(grpc.RpcError) as err:
            _decode(cons.api_address, params)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "no longer holds" in err.value.details()


def test_a_producer_killed_mid_read_is_recomputed_exactly(tiny_model_dir):
    with running_cluster(tiny_model_dir, args=_transfer_config("kv_producer")) as prod, \
            running_cluster(tiny_model_dir, args=_transfer_config("kv_consumer")) as cons:
        params = _prefill(prod.api_address)
        _kill(prod, "rank 0", signal.SIGSTOP)  # its memory stops answering reads

        async def decode_while_killing():
            call = asyncio.ensure_future(_complete(cons.api_address,
                                                   _request(PROMPT, MAX_TOKENS, "r0", params)))
            await asyncio.sleep(1.5)  # the leg is admitted and its read is out
            assert not call.done()
            _kill(prod, "rank 0")
            return await call

        done = asyncio.run(decode_while_killing())
        assert list(done.output_ids) == hf_greedy(tiny_model_dir, PROMPT, MAX_TOKENS)
        assert _metric(cons, "kvloom_kv_transfer_failed_blocks_total") > 0
        asyncio.run(_no_leaks(cons.api_address))


def test_held_blocks_nobody_reads_are_freed_when_the_lease_runs_out(tiny_model_dir):
    with running_cluster(tiny_model_dir, args=_transfer_config(
            "kv_producer", kv_connector_extra_config={"kv_lease_duration": 2})) as prod:
        params = json.loads(_prefill(prod.api_address))
        assert params["remote_block_ids"][0]
        assert _metric(prod, "kvloom_kv_transfer_leases") == 1
        time.sleep(3.5)  # the lease (2 s) runs out at the engine's next tick
        asyncio.run(_no_leaks(prod.api_address))
        assert _metric(prod, "kvloom_kv_transfer_lease_expiries_total") == 1


def test_a_producer_of_another_block_size_is_refused_naming_the_field(tiny_model_dir):
    with running_cluster(tiny_model_dir, args=(*_transfer_config("kv_producer"),
                                               "--block-size", "8")) as prod, \
            running_cluster(tiny_model_dir, args=_transfer_config("kv_consumer")) as cons:
        params = _prefill(prod.api_address)
        with pytest.raises(grpc.RpcError) as err:
            _decode(cons.api_address, params)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "block_size" in err.value.details()


def test_a_consumer_killed_before_its_read_leaves_nothing_held_past_the_lease(tiny_model_dir):
    """The consumer admits the leg (and renews its lease) but its rank never
    reads (stopped), then the whole consumer dies: the renewals stop and the
    producer frees the blocks when the lease runs out."""
    with running_cluster(tiny_model_dir, args=_transfer_config(
            "kv_producer", kv_connector_extra_config={"kv_lease_duration": 3})) as prod, \
            running_cluster(tiny_model_dir, args=_transfer_config("kv_consumer")) as cons:
        params = _prefill(prod.api_address)
        _kill(cons, "rank 0", signal.SIGSTOP)

        async def admit_then_die():
            call = asyncio.ensure_future(_complete(cons.api_address,
                                                   _request(PROMPT, MAX_TOKENS, "r0", params)))
            await asyncio.sleep(4)  # admitted, renewed past the first lease
            assert _metric(prod, "kvloom_kv_transfer_leases") == 1
            _kill(cons, "controlplane")
            _kill(cons, "rank 0")
            with pytest.raises(grpc.RpcError):
                await call

        asyncio.run(admit_then_die())
        time.sleep(4.5)
        asyncio.run(_no_leaks(prod.api_address))
        assert _metric(prod, "kvloom_kv_transfer_lease_expiries_total") == 1


def test_a_decode_leg_cancelled_by_its_client_frees_the_producer_at_once(tiny_model_dir):
    """Whether the consumer had read or not when the client left, the lease
    is released, not left to run out."""
    with running_cluster(tiny_model_dir, args=_transfer_config("kv_producer")) as prod, \
            running_cluster(tiny_model_dir, args=_transfer_config("kv_consumer")) as cons:
        params = _prefill(prod.api_address)

        async def cancel():
            call = asyncio.ensure_future(_complete(cons.api_address,
                                                   _request(PROMPT, 64, "r0", params)))
            await asyncio.sleep(0.3)
            call.cancel()

        asyncio.run(cancel())
        asyncio.run(_no_leaks(prod.api_address))  # 5 s at most: the lease is 30 s
        asyncio.run(_no_leaks(cons.api_address))
        assert _metric(prod, "kvloom_kv_transfer_leases_released_total") == 1
        assert _metric(prod, "kvloom_kv_transfer_lease_expiries_total") == 0
