"""CPU KV cache sizing: MemAvailable, cgroup v1/v2 limits (fake files under a
tmp cgroup root) and the number of workers sharing the host."""

from __future__ import annotations

import pytest

from workerd.runner import kv_cache

GiB = 1 << 30
MiB = 1 << 20


def _meminfo(tmp_path, available: int):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available // 1024} kB\n")
    return path


def _cgroup_v2(root, limit: str, current: int, inactive_file: int = 0):
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(limit + "\n")
    (root / "memory.current").write_text(f"{current}\n")
    (root / "memory.stat").write_text(f"anon 1\ninactive_file {inactive_file}\nactive_file 7\n")
    return root


def _cgroup_v1(root, limit: int, usage: int, inactive_file: int = 0):
    mem = root / "memory"
    mem.mkdir(parents=True, exist_ok=True)
    (mem / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (mem / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (mem / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {inactive_file}\n")
    return root


def test_no_cgroup_files_means_meminfo_alone(tmp_path):
    meminfo = _meminfo(tmp_path, 8 * GiB)
    assert kv_cache.cgroup_memory_room(tmp_path / "none") is None
    assert kv_cache.available_system_memory(meminfo, tmp_path / "none") == 8 * GiB


def test_cgroup_v2_limit_lowers_available_memory(tmp_path):
    meminfo = _meminfo(tmp_path, 64 * GiB)
    root = _cgroup_v2(tmp_path / "cg", str(2 * GiB), current=512 * MiB, inactive_file=128 * MiB)
    assert kv_cache.cgroup_memory_room(root) == 2 * GiB - 512 * MiB + 128 * MiB
    assert kv_cache.available_system_memory(meminfo, root) == 2 * GiB - 384 * MiB


def test_cgroup_v2_max_is_unlimited(tmp_path):
    meminfo = _meminfo(tmp_path, 3 * GiB)
    root = _cgroup_v2(tmp_path / "cg", "max", current=GiB)
    assert kv_cache.cgroup_memory_room(root) is None
    assert kv_cache.available_system_memory(meminfo, root) == 3 * GiB


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path):
    root = _cgroup_v1(tmp_path / "v1", limit=GiB, usage=256 * MiB, inactive_file=64 * MiB)
    assert kv_cache.cgroup_memory_room(root) == GiB - 192 * MiB
    unlimited = _cgroup_v1(tmp_path / "v1u", limit=9223372036854771712, usage=GiB)
    assert kv_cache.cgroup_memory_room(unlimited) is None


def test_cgroup_over_its_limit_has_no_room(tmp_path):
    root = _cgroup_v2(tmp_path / "cg", str(GiB), current=2 * GiB)
    assert kv_cache.cgroup_memory_room(root) == 0


def test_meminfo_is_smaller_than_the_cgroup_room(tmp_path):
    meminfo = _meminfo(tmp_path, GiB)
    root = _cgroup_v2(tmp_path / "cg", str(16 * GiB), current=0)
    assert kv_cache.available_system_memory(meminfo, root) == GiB


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, 1),
        ({"LOCAL_WORLD_SIZE": "4"}, 4),
        ({"KVLOOM_NUM_LOCAL_WORKERS": "3", "LOCAL_WORLD_SIZE": "8"}, 3),
        ({"KVLOOM_NUM_LOCAL_WORKERS": "", "LOCAL_WORLD_SIZE": "2"}, 2),
        ({"KVLOOM_NUM_LOCAL_WORKERS": "0"}, 1),
    ],
)
def test_num_local_workers_from_the_environment(environ, expected):
    assert kv_cache.num_local_workers(environ) == expected


def test_num_local_workers_rejects_garbage():
    with pytest.raises(ValueError, match="KVLOOM_NUM_LOCAL_WORKERS='two'"):
        kv_cache.num_local_workers({"KVLOOM_NUM_LOCAL_WORKERS": "two"})


def test_cpu_budget_is_shared_among_local_workers(monkeypatch):
    monkeypatch.setattr(kv_cache, "available_system_memory", lambda: 8 * GiB)
    assert kv_cache.cpu_kv_cache_budget(local_workers=1) == 2 * GiB
    assert kv_cache.cpu_kv_cache_budget(local_workers=4) == GiB // 2
    monkeypatch.setenv("KVLOOM_NUM_LOCAL_WORKERS", "8")
    assert kv_cache.cpu_kv_cache_budget() == GiB // 4


def test_cpu_budget_in_a_small_container(monkeypatch, tmp_path):
    """A 1 GiB container on a 64 GiB host with 2 workers: an eighth of the
    container's room each, not a quarter of the host."""
    meminfo = _meminfo(tmp_path, 64 * GiB)
    root = _cgroup_v2(tmp_path / "cg", str(GiB), current=0)
    real = kv_cache.available_system_memory
    monkeypatch.setattr(kv_cache, "available_system_memory", lambda: real(meminfo, root))
    assert kv_cache.cpu_kv_cache_budget(local_workers=2) == GiB // 8


def test_launcher_tells_each_rank_how_many_share_the_host(monkeypatch):
    from kvloom_cli import launcher

    monkeypatch.setenv("KVLOOM_NUM_LOCAL_WORKERS", "99")  # a stale value is replaced
    spec = launcher.ClusterSpec(tensor_parallel_size=2, pipeline_parallel_size=3)
    env = launcher.child_env(spec)
    assert env["KVLOOM_NUM_LOCAL_WORKERS"] == "6"
    assert kv_cache.num_local_workers(env) == 6


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cpu_kv_cache_is_zeros_that_commit_memory_only_when_written(dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    shape = (2, 4096, 16, 8, 64)  # 128 MiB in float32: far above RSS noise
    nbytes = 2 * 4096 * 16 * 8 * 64 * dtype.itemsize
    before = _rss_bytes()
    cache = kv_cache.zeroed_cpu_tensor(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    # Nothing written yet: no page of it is resident (torch.zeros wrote all).
    assert _rss_bytes() - before < nbytes // 4
    assert not cache.any()  # reads every page: zeros, as the kernel hands them out
    view = cache[1, 7]
    del cache  # a view keeps the mapping alive
    view.fill_(2.5)
    assert float(view.sum()) == 2.5 * view.numel()
    assert kv_cache.zeroed_cpu_tensor((0, 16), dtype).numel() == 0
