"""The LoRA registry against a fake backend: what reaches the workers, what
a request may name and when, the refusals and their status codes, LRU
eviction of idle adapters, and a re-forming group's loads."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.config import LoRAConfig
from controlplane.lora.names import LoRANameError, check_lora_path, parse_lora_modules
from controlplane.lora.registry import LoRAError, LoRARegistry
from kvloom.worker.v1 import worker_pb2

DIGEST = "ab" * 32


class FakeBackend:
    """Two ranks; what each load answers is the test's to say."""

    def __init__(self):
        self.loads: list[worker_pb2.LoadLoRA] = []
        self.removed: list[int] = []
        self.requests: dict[int, int] = {}  # lora_id -> unfinished requests
        self.error_for: dict[str, str] = {}
        self.digests: dict[str, list[str]] = {}
        self.unavailable = False

    async def load_on_workers(self, load, on_loaded):
        if self.unavailable:
            raise LoRAError("UNAVAILABLE", "the worker group is forming")
        self.loads.append(load)
        digests = self.digests.get(load.lora_name, [DIGEST, DIGEST])
        error = self.error_for.get(load.lora_name, "")
        on_loaded({rank: worker_pb2.LoRALoaded(digest=d, num_bytes=10, num_modules=4, rank=8,
                                               error=error if rank == 1 else "")
                   for rank, d in enumerate(digests)})

    async def remove_on_workers(self, lora_id):
        self.removed.append(lora_id)

    async def count_requests(self, lora_id):
        return self.requests.get(lora_id, 0)


def _registry(**config) -> tuple[LoRARegistry, FakeBackend]:
    cfg = LoRAConfig(enable_lora=True, allow_runtime_lora_updating=True, **config)
    registry = LoRARegistry(cfg, "base")
    registry.backend = FakeBackend()
    return registry, registry.backend


def _code(coro) -> str:
    with pytest.raises(LoRAError) as info:
        asyncio.run(coro)
    return info.value.code


def test_load_then_requests_resolve_to_the_version():
    registry, backend = _registry(max_loras=2)
    adapter = asyncio.run(registry.load("sql", "/adapters/sql"))
    assert (adapter.version, adapter.rank, adapter.num_bytes) == (DIGEST, 8, 20)
    lora = registry.resolve("sql")
    assert (lora.lora_name, lora.lora_id, lora.version) == ("sql", 1, DIGEST)
    assert [ld.lora_path for ld in backend.loads] == ["/adapters/sql"]


def test_refusals_and_their_codes():
    registry, backend = _registry()
    asyncio.run(registry.load("sql", "/a/sql"))
    assert _code(registry.load("sql", "/a/other")) == "ALREADY_EXISTS"
    assert _code(registry.load("base", "/a/x")) == "INVALID_ARGUMENT"  # the model's own name
    assert _code(registry.load("bad name", "/a/x")) == "INVALID_ARGUMENT"
    assert _code(registry.load("x", "relative/path")) == "INVALID_ARGUMENT"
    assert _code(registry.load("x" * 65, "/a/x")) == "INVALID_ARGUMENT"
    assert _code(registry.unload("nope")) == "NOT_FOUND"
    with pytest.raises(LoRAError) as info:
        registry.resolve("nope")
    assert info.value.code == "NOT_FOUND" and "ListLoRAAdapters" in str(info.value)


def test_a_rank_refusing_the_adapter_refuses_the_load_and_frees_the_others():
    registry, backend = _registry()
    backend.error_for["dora"] = "LoRAAdapterError: use_dora is not supported"
    with pytest.raises(LoRAError) as info:
        asyncio.run(registry.load("dora", "/a/dora"))
    assert info.value.code == "INVALID_ARGUMENT" and "use_dora" in str(info.value)
    assert backend.removed == [backend.loads[0].lora_id]
    assert registry.names() == []


def test_ranks_that_read_different_files_are_refused():
    registry, backend = _registry()
    backend.digests["x"] = [DIGEST, "cd" * 32]
    with pytest.raises(LoRAError, match="same adapter files"):
        asyncio.run(registry.load("x", "/a/x"))
    assert registry.names() == []


def test_unload_in_use_is_refused_and_the_adapter_stays_usable():
    registry, backend = _registry()
    asyncio.run(registry.load("sql", "/a/sql"))
    backend.requests[1] = 3
    with pytest.raises(LoRAError) as info:
        asyncio.run(registry.unload("sql"))
    assert info.value.code == "FAILED_PRECONDITION" and "3 unfinished" in str(info.value)
    assert registry.resolve("sql") is not None and backend.removed == []
    backend.requests[1] = 0
    asyncio.run(registry.unload("sql"))
    assert backend.removed == [1] and registry.names() == []


def test_reload_under_the_same_name_gets_a_new_id_and_version():
    registry, backend = _registry()
    asyncio.run(registry.load("a", "/a/v1"))
    asyncio.run(registry.unload("a"))
    backend.digests["a"] = ["ee" * 32, "ee" * 32]
    asyncio.run(registry.load("a", "/a/v2"))
    lora = registry.resolve("a")
    assert lora.lora_id == 2 and lora.version == "ee" * 32


def test_full_slots_let_the_least_recently_used_idle_adapter_go():
    registry, backend = _registry(max_loras=1, max_cpu_loras=2)
    asyncio.run(registry.load("a", "/a/a"))
    asyncio.run(registry.load("b", "/a/b"))
    registry.resolve("a")  # b is now the least recently used
    asyncio.run(registry.load("c", "/a/c"))
    assert backend.removed == [2]
    assert registry.resolve("b") is None  # known, not resident
    backend.requests[1] = 1  # a busy, c idle: c goes for b
    asyncio.run(registry.ensure_resident("b"))
    assert backend.removed == [2, 3] and registry.resolve("b").lora_id == 4


def test_slots_all_busy_is_resource_exhausted():
    registry, backend = _registry(max_loras=1, max_cpu_loras=1)
    asyncio.run(registry.load("a", "/a/a"))
    backend.requests[1] = 2
    assert _code(registry.load("b", "/a/b")) == "RESOURCE_EXHAUSTED"
    assert registry.names() == ["a"]


def test_runtime_updating_off_refuses_load_and_unload():
    cfg = LoRAConfig(enable_lora=True, lora_modules=(("s", "/a/s"),))
    registry = LoRARegistry(cfg, "base")
    registry.backend = FakeBackend()
    assert _code(registry.load("x", "/a/x")) == "FAILED_PRECONDITION"
    assert _code(registry.unload("s")) == "FAILED_PRECONDITION"


def test_startup_loads_the_modules_and_drops_one_no_rank_can_serve():
    cfg = LoRAConfig(enable_lora=True, lora_modules=(("s", "/a/s"), ("t", "/a/t")))
    registry = LoRARegistry(cfg, "base")
    loads = registry.resident_loads()
    assert [(ld.lora_name, ld.lora_id) for ld in loads] == [("s", 1), ("t", 2)]
    ok = worker_pb2.LoRALoaded(digest=DIGEST, rank=4)
    bad = worker_pb2.LoRALoaded(error="ValueError: r 600 is above --max-lora-rank 16")
    assert registry.loaded_on_startup(loads[0], {0: ok, 1: ok})
    assert not registry.loaded_on_startup(loads[1], {0: ok, 1: bad})
    assert registry.resolve("s").version == DIGEST
    with pytest.raises(LoRAError, match="failed to load at start-up: .*max-lora-rank"):
        registry.resolve("t")
    # A re-forming group loads what is resident, under the same ids.
    assert [(ld.lora_name, ld.lora_id) for ld in registry.resident_loads()] == [("s", 1)]


def test_load_while_the_group_is_not_ready_is_unavailable_and_leaves_nothing():
    registry, backend = _registry()
    backend.unavailable = True
    assert _code(registry.load("a", "/a/a")) == "UNAVAILABLE"
    assert registry.names() == []


@pytest.mark.parametrize("items,match", [
    (["noequals"], "NAME=PATH"),
    (["a=rel/path"], "absolute"),
    (["a=/x", "a=/y"], "twice"),
    (["base=/x"], "served model"),
    (["a b=/x"], "letters, digits"),
    (["a=/x\x00y"], "NUL"),
    ([f"a{i}=/x" for i in range(5)], "at most 4"),
])
def test_lora_modules_flag_refusals(items, match):
    with pytest.raises(LoRANameError, match=match):
        parse_lora_modules(items, "base", 4)


def test_paths_are_bounded():
    with pytest.raises(LoRANameError, match="1 to 4096"):
        check_lora_path("/" + "a" * 5000, "lora_path")


def test_a_reply_without_a_valid_digest_or_rank_is_refused():
    registry, backend = _registry()
    backend.digests["x"] = ["not-hex", "not-hex"]
    with pytest.raises(LoRAError, match="no valid digest"):
        asyncio.run(registry.load("x", "/a/x"))
    assert registry.names() == []


def test_list_counts_each_adapters_running_and_waiting_requests():
    from controlplane.api.lora_service import LoRAService
    from controlplane.core.sched_stats import SchedulerStats

    registry, _ = _registry(max_loras=2)
    asyncio.run(registry.load("a", "/a/a"))
    asyncio.run(registry.load("b", "/a/b"))
    stats = SchedulerStats(max_loras=2, running_lora_adapters=(("a", 2),),
                           waiting_lora_adapters=(("a", 1), ("b", 4)))
    service = LoRAService(registry, lambda name: {"a": 5001}.get(name, 0), lambda: stats)
    listed = {a.lora_name: a for a in service.adapters()}
    assert (listed["a"].num_requests, listed["a"].vllm_engine_port) == (3, 5001)
    assert (listed["b"].num_requests, listed["b"].vllm_engine_port) == (4, 0)
    assert all(a.num_requests == 0 for a in LoRAService(registry).adapters())


@pytest.mark.parametrize("spec", ["x", "5-", "-5", "10-5", "0-10", "1-70000", "a-b"])
def test_hostile_engine_port_ranges_are_refused_naming_the_flag(spec):
    from controlplane.api.lora_endpoints import parse_port_range

    with pytest.raises(ValueError, match="--lora-engine-ports"):
        parse_port_range(spec)
    assert parse_port_range("") is None and parse_port_range("50100-50101") == range(50100, 50102)
