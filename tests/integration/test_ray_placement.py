"""Ray places the ranks, kvloom drives the steps: `kvloom up --placement ray`
against a local Ray cluster (a head of the test's own, CPU bundles).

TP=2 and PP=2 clusters placed by Ray serve transformers' greedy tokens
exactly, and GetServerInfo names each rank's Ray node and the pid Ray runs
it in. A rank's actor SIGKILLed mid-generation is restarted by Ray with the
same rank and every stream finishes token-exact (the survivor kept its
weights). A placement the cluster cannot hold fails in seconds, naming what
is missing, before any process starts; `kvloom down` leaves no actor or
placement group behind, and no rank process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import time

import grpc
import pytest

# Found, not imported: the drivers are the kvloom processes the tests start, and
# Ray in this process would fix its authentication settings at import.
if importlib.util.find_spec("ray") is None:
    pytest.skip("needs kvloom[ray]", allow_module_level=True)

from kvloom.client import KvloomClient  # noqa: E402
from kvloom_testing.ray_head import RayHead  # noqa: E402
from tests.integration.api_helpers import assert_no_leaked_blocks, greedy_request, stub_for  # noqa: E402
from tests.integration.ray_helpers import (  # noqa: E402
    KVLOOM,
    RayUp,
    kvloom_env,
    live_kvloom_groups,
    ray_holds,
    wait_gone,
)
from tests.integration.reference import hf_greedy  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(3)]
MAX_TOKENS = 64
KILL_AFTER = 8
WAIT_S = 120.0


@pytest.fixture(scope="module")
def ray_head():
    # Three CPUs: two single-CPU ranks and the controlplane's actor fit,
    # four ranks do not.
    with RayHead(num_cpus=3) as head:
        yield head


def _ranks(api: str):
    with KvloomClient(api) as client:
        return list(client.server_info().ranks)


async def _stream_all(api: str, kill_pid: int | None = None) -> list[list[int]]:
    """Stream PROMPTS; with kill_pid, SIGKILL it once every stream has
    KILL_AFTER tokens. Any error status fails the test."""
    async with grpc.aio.insecure_channel(api) as channel:
        stub = stub_for(channel)
        tokens: list[list[int]] = [[] for _ in PROMPTS]

        async def one(i: int) -> None:
            request = greedy_request(PROMPTS[i], MAX_TOKENS, request_id=f"r{i}")
            async for msg in stub.Generate(request, timeout=WAIT_S):
                tokens[i].extend(msg.token_ids)

        streams = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
        if kill_pid is not None:
            deadline = time.monotonic() + WAIT_S
            while min(len(t) for t in tokens) < KILL_AFTER:
                assert not any(s.done() for s in streams), "a stream ended before the kill"
                assert time.monotonic() < deadline, "no progress before the kill"
                await asyncio.sleep(0.005)
            os.kill(kill_pid, signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*streams), WAIT_S)
        await assert_no_leaked_blocks(stub)
        return tokens


def _assert_exact(model: str, tokens: list[list[int]]) -> None:
    for prompt, got in zip(PROMPTS, tokens, strict=True):
        assert got == hf_greedy(model, prompt, MAX_TOKENS)


def test_tp2_placed_by_ray_is_exact_and_survives_a_killed_actor(ray_head, tiny_model_dir,
                                                                tmp_path):
    with RayUp(ray_head, tiny_model_dir, tmp_path, tp=2) as up:
        ranks = _ranks(up.api)
        holds = ray_holds(ray_head)
        assert [r.rank for r in ranks] == [0, 1]
        assert {r.node_id for r in ranks} == set(holds["nodes"])  # Ray's node, by id
        assert all(r.device == "cpu" and r.pid for r in ranks)
        for r in ranks:
            assert f"rank {r.rank} on Ray node {r.node_id[:12]}" in up.text()
        assert len([a for a in holds["actors"] if a.startswith("kvloom-")]) == 2
        _assert_exact(tiny_model_dir, asyncio.run(_stream_all(up.api)))

        # Rank 1's process dies mid-generation: Ray restarts its actor.
        killed = ranks[1].pid
        _assert_exact(tiny_model_dir, asyncio.run(_stream_all(up.api, kill_pid=killed)))
        after = _ranks(up.api)
        assert after[1].pid != killed and after[0].pid == ranks[0].pid
        text = up.text()
        assert "rank 1's actor died" in text and "Ray restarts it (restart 1 of at most 3" \
            in text
        assert "rank 1 restarted by Ray" in text
        assert text.count("reusing the weights") >= 1  # the survivor kept its weights
        assert up.stop() == 0
    assert live_kvloom_groups(ray_holds(ray_head)) == []
    assert wait_gone([r.pid for r in after]) == []


def test_pp2_with_the_controlplane_in_its_own_actor_is_exact(ray_head, tiny_model_dir,
                                                             tmp_path):
    with RayUp(ray_head, tiny_model_dir, tmp_path, pp=2,
               args=("--ray-placement-strategy", "SPREAD", "--ray-controlplane")) as up:
        # The API is on the actor's node, not this process's loopback.
        assert up.api.startswith(f"{ray_head.node_ip}:")
        assert "kvloom: controlplane on Ray node" in up.text()
        assert "[controlplane]" not in up.text()  # not a child of `kvloom up`
        assert len([a for a in ray_holds(ray_head)["actors"] if a.startswith("kvloom-")]) == 3
        assert [r.rank for r in _ranks(up.api)] == [0, 1]
        _assert_exact(tiny_model_dir, asyncio.run(_stream_all(up.api)))
        assert up.stop() == 0
    holds = ray_holds(ray_head)
    assert [a for a in holds["actors"] if a.startswith("kvloom-")] == []
    assert live_kvloom_groups(holds) == []


@pytest.mark.parametrize("args, message", [
    (("--tp", "2", "--pp", "2"), "Ray cannot place 4 rank(s) of 1 CPU each: the cluster "
                                 "holds 3, 1 CPU (for 1 rank(s)) missing"),
    (("--tp", "2", "--ray-cpus-per-rank", "1.5", "--ray-controlplane"),
     "and the controlplane's actor (1 CPU): 1 CPU missing"),
    (("--tp", "2", "--ray-placement-strategy", "STRICT_SPREAD"),
     "2 nodes with 1 CPU needed, 1 exist, 1 missing"),
    (("--ray-cpus-per-rank", "4"), "no node has 4 CPU"),
])
def test_an_unsatisfiable_placement_fails_fast_before_any_process(ray_head, tiny_model_dir,
                                                                  tmp_path, args, message):
    argv = [KVLOOM, "up", "--placement", "ray", "--ray-address", ray_head.address,
            "--model", tiny_model_dir, "--state-file", str(tmp_path / "s.json"), *args]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env=kvloom_env(ray_head), check=False)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert "[controlplane]" not in done.stderr and "RankActor" not in done.stderr
    assert live_kvloom_groups(ray_holds(ray_head)) == []


def test_detached_up_then_down_leaves_nothing_on_ray(ray_head, tiny_model_dir, tmp_path):
    state = tmp_path / "cluster.json"
    argv = [KVLOOM, "up", "--detach", "--placement", "ray", "--ray-address", ray_head.address,
            "--model", tiny_model_dir, "--tp", "2", "--worker-threads", "1",
            "--state-file", str(state), "--", "--kv-cache-memory-bytes", str(64 << 20)]
    env = kvloom_env(ray_head)
    try:
        up = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env,
                            check=False)
        assert up.returncode == 0, up.stderr[-3000:]
        api = up.stderr.split("API (gRPC) at ")[1].split()[0]
        pids = [r.pid for r in _ranks(api)]
        holds = ray_holds(ray_head)
        assert len([a for a in holds["actors"] if a.startswith("kvloom-")]) == 2
        assert len(live_kvloom_groups(holds)) == 1
        # The cluster holds 2 of the head's 3 CPUs: a second one of 2 ranks
        # exists on paper but waits, bounded, and leaves nothing behind.
        busy = subprocess.run(
            [KVLOOM, "up", "--placement", "ray", "--ray-address", ray_head.address, "--model",
             tiny_model_dir, "--tp", "2", "--ray-placement-timeout", "3", "--state-file",
             str(tmp_path / "busy.json")],
            capture_output=True, text=True, timeout=120, env=env, check=False)
        assert busy.returncode != 0
        assert "did not place 2 rank(s) of 1 CPU each (PACK) within 3 s " \
            "(--ray-placement-timeout): the cluster has the resources, but other work holds " \
            "them" in busy.stderr, busy.stderr[-3000:]
        assert len(live_kvloom_groups(ray_holds(ray_head))) == 1
    finally:
        down = subprocess.run([KVLOOM, "down", "--state-file", str(state)], capture_output=True,
                              text=True, timeout=120, env=env, check=False)
    assert down.returncode == 0, down.stderr[-3000:]
    assert "removed from Ray" in down.stderr
    holds = ray_holds(ray_head)
    assert [a for a in holds["actors"] if a.startswith("kvloom-")] == []
    assert live_kvloom_groups(holds) == []
    assert wait_gone(pids) == []


def test_run_without_an_address_starts_and_stops_a_local_ray(tmp_path):
    from kvloom_testing.ray_head import session_pids

    # The default model: `run` chats, and the tiny checkpoint has no template.
    argv = [KVLOOM, "run", "--placement", "ray", "--pp", "2", "--worker-threads", "1",
            "--logs", "--max-tokens", "8", "--temperature", "0", "What is the capital of France?",
            "--", "--kv-cache-memory-bytes", str(64 << 20)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**env, "RAY_DEDUP_LOGS": "0"}, start_new_session=True)
    try:
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(10)
    assert run.returncode == 0, err[-3000:]
    assert "Paris" in out, err[-3000:]
    assert "rank 1 on Ray node" in err
    # The local Ray (GCS, raylet, the actors) went with it.
    deadline = time.monotonic() + 30
    while session_pids(run.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_pids(run.pid) == []
