"""workerd.distributed.devices: `--device cuda` follows LOCAL_RANK when set (else the
global rank modulo the visible GPUs), a LOCAL_RANK past the visible GPUs is
refused naming both, and two processes that resolve to the same GPU cannot
both claim it (the second is refused naming the first; a dead holder's claim
is released). No GPU is needed: device_count is patched and the GPU id given."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from workerd.distributed import devices
from workerd.distributed.devices import claim_device, resolve_device


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_cuda_follows_local_rank_then_the_global_rank(four_gpus):
    assert resolve_device("cuda", 6, env={"LOCAL_RANK": "1"}) == torch.device("cuda", 1)
    assert resolve_device("cuda", 6, env={}) == torch.device("cuda", 2)
    assert resolve_device("auto", 3, env={}) == torch.device("cuda", 3)
    assert resolve_device("cuda:3", 0, env={"LOCAL_RANK": "1"}) == torch.device("cuda", 3)
    assert resolve_device("cpu", 5, env={"LOCAL_RANK": "1"}) == torch.device("cpu")


def test_a_local_rank_past_the_visible_gpus_is_refused(four_gpus):
    with pytest.raises(ValueError, match=r"LOCAL_RANK=4 but only 4 GPU\(s\) are visible"):
        resolve_device("cuda", 0, env={"LOCAL_RANK": "4"})


def _claim_in_child(lock_dir: str, rank: int, queue) -> None:
    try:
        claim_device(torch.device("cuda", 0), rank, lock_dir=__import__("pathlib").Path(lock_dir),
                     gpu_id="GPU-test")
        queue.put("claimed")
    except ValueError as exc:
        queue.put(str(exc))


def test_two_processes_cannot_claim_one_gpu(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    # This process holds it (as a running rank would)...
    claim_device(torch.device("cuda", 0), 0, lock_dir=tmp_path, gpu_id="GPU-test")
    try:
        child = ctx.Process(target=_claim_in_child, args=(str(tmp_path), 1, queue))
        child.start()
        child.join(30)
        message = queue.get(timeout=5)
        assert "rank 1: cuda:0 (GPU GPU-test) is already used by rank 0" in message
        assert f"pid {os.getpid()}" in message
    finally:
        os.close(devices._held.pop("GPU-test"))
    # ...and once its holder is gone the GPU can be claimed again.
    child = ctx.Process(target=_claim_in_child, args=(str(tmp_path), 1, queue))
    child.start()
    child.join(30)
    assert queue.get(timeout=5) == "claimed"


def test_cpu_devices_are_not_claimed(tmp_path):
    claim_device(torch.device("cpu"), 0, lock_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
