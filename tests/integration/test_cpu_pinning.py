"""A pinned local cluster (ClusterSpec.pin_cpus, serving.py --pin-cpus): the
rank's step thread computes alone on its core, every other thread of the
rank and the whole controlplane run on the rest, and it still answers
exactly as transformers does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvloom.client import KvloomClient
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "sched_getaffinity")
                       or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 cores"),
]


def _affinities(pid: int) -> dict[int, str]:
    """Thread id -> its Cpus_allowed_list, for every thread of pid."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split(":", 1)[1].strip()
    return out


def test_pinned_cluster_keeps_the_compute_core_to_the_step_thread(tiny_model_dir):
    cores = sorted(os.sched_getaffinity(0))
    compute = str(cores[0])
    rest = f"{cores[1]}-{cores[-1]}" if len(cores) > 2 else str(cores[1])
    prompt = [5, 9, 13, 17]
    with running_cluster(tiny_model_dir, pin_cpus=True) as cluster:
        with KvloomClient(cluster.api_address) as client:
            result = client.generate_text(prompt, max_tokens=6, temperature=0.0,
                                          ignore_eos=True)
        rank = next(p for p in cluster.processes if p.rank is not None).popen.pid
        control = next(p for p in cluster.processes if p.rank is None).popen.pid
        rank_threads = _affinities(rank)
        control_threads = _affinities(control)
    assert result.token_ids == hf_greedy(tiny_model_dir, prompt, 6)
    # The step thread is the process's main thread (its tid is the pid).
    assert rank_threads.pop(rank) == compute
    assert rank_threads and set(rank_threads.values()) == {rest}, rank_threads
    assert set(control_threads.values()) == {rest}, control_threads
