"""Multi-LoRA on clusters of real processes through kvloom.v1: adapters from
--lora-modules and from LoadLoRAAdapter, base and adapter requests in one
batch with --max-loras below the adapters in flight, at TP=2, PP=2 and
TP=1, token-exact against transformers + PeftModel; the refusals over the
wire; unload and reload under load; a killed rank with adapters in flight.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from kvloom.v1 import generation_pb2 as pb
from kvloom_testing.lora import make_peft_adapter, peft_greedy
from tests.integration.api_helpers import assert_no_leaked_blocks, greedy_request, stub_for
from tests.integration.conftest import running_cluster
from tests.integration.test_recovery import _kill, _metric, supervised

pytestmark = pytest.mark.slow

PROMPTS = [[5 + i, 6, 7, 8 + i, 9, 10 + i] for i in range(6)]
MAX_TOKENS = [12, 9, 14, 10, 11, 13]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cluster_adapters")
    specs = {"a": (21, 8, "all-linear", False), "b": (22, 16, ["q_proj", "v_proj"], True),
             "c": (23, 4, ["gate_proj", "down_proj", "o_proj"], False)}
    return {name: str(make_peft_adapter(tiny_model_dir, root / name, seed=seed, r=r,
                                        target_modules=targets, use_rslora=rs))
            for name, (seed, r, targets, rs) in specs.items()}


def _args(adapters, *extra) -> tuple[str, ...]:
    return ("--enable-lora", "--max-loras", "1", "--max-cpu-loras", "3",
            "--allow-runtime-lora-updating", "--lora-modules", f"a={adapters['a']}", *extra)


async def _generate(stub, prompt, max_tokens, lora, request_id="") -> list[int]:
    request = greedy_request(prompt, max_tokens, request_id=request_id)
    request.lora_name = lora or ""
    return [t async for m in stub.Generate(request, timeout=180) for t in m.token_ids]


def _expected(model_dir, adapters, plan) -> list[list[int]]:
    return [peft_greedy(model_dir, adapters[lora] if lora else None, p, n)
            for p, n, lora in zip(PROMPTS, MAX_TOKENS, plan, strict=True)]


PLAN = [None, "a", "b", "c", "a", None]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_mixed_adapters_across_ranks_match_peft(tiny_model_dir, adapters, tp, pp):
    async def scenario(address):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = stub_for(channel)
            for name in ("b", "c"):
                await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
                    lora_name=name, lora_path=adapters[name]))
            tokens = await asyncio.gather(*(
                _generate(stub, p, n, lora, f"m{i}")
                for i, (p, n, lora) in enumerate(zip(PROMPTS, MAX_TOKENS, PLAN, strict=True))))
            await assert_no_leaked_blocks(stub)
            return tokens

    with running_cluster(tiny_model_dir, tp=tp, pp=pp, args=_args(adapters)) as cluster:
        tokens = asyncio.run(scenario(cluster.api_address))
    assert tokens == _expected(tiny_model_dir, adapters, PLAN)
    # The negative control: every adapter changes the reference's tokens.
    base = _expected(tiny_model_dir, adapters, [None] * len(PLAN))
    assert all(t != b for t, b, lora in zip(tokens, base, PLAN, strict=True) if lora)


def test_api_refusals_unload_and_reload(tiny_model_dir, adapters, tmp_path):
    bad = tmp_path / "dora"
    bad.mkdir()
    config = json.loads((Path(adapters["a"]) / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes(
        (Path(adapters["a"]) / "adapter_model.safetensors").read_bytes())

    async def code_of(coro) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await coro
        return info.value.code(), info.value.details()

    async def scenario(cluster):
        async with grpc.aio.insecure_channel(cluster.api_address) as channel:
            stub = stub_for(channel)
            listed = await stub.ListLoRAAdapters(pb.ListLoRAAdaptersRequest())
            assert [a.lora_name for a in listed.adapters] == ["a"]
            assert listed.adapters[0].rank == 8 and len(listed.adapters[0].version) == 64
            assert listed.adapters[0].vllm_engine_port > 0
            code, details = await code_of(_generate(stub, PROMPTS[0], 3, "nope"))
            assert code == grpc.StatusCode.NOT_FOUND and "nope" in details
            code, _ = await code_of(stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
                lora_name="a", lora_path=adapters["b"])))
            assert code == grpc.StatusCode.ALREADY_EXISTS
            code, details = await code_of(stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
                lora_name="d", lora_path=str(bad))))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "dora" in details.lower()
            code, _ = await code_of(stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
                lora_name="e", lora_path="relative/dir")))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            # Unloading an adapter in use is refused; its request is untouched.
            long = asyncio.create_task(_generate(stub, PROMPTS[1], 100, "a", "long"))
            while not (await stub.GetServerInfo(pb.GetServerInfoRequest())).num_requests_running:
                await asyncio.sleep(0.01)
            code, details = await code_of(stub.UnloadLoRAAdapter(
                pb.UnloadLoRAAdapterRequest(lora_name="a")))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "unfinished" in details
            # A load while it runs (100 tokens take far longer than a load):
            # served at once, the running request untouched.
            await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="b",
                                                                 lora_path=adapters["b"]))
            during = await _generate(stub, PROMPTS[3], 6, "b")
            assert during == peft_greedy(tiny_model_dir, adapters["b"], PROMPTS[3], 6)
            assert await long == peft_greedy(tiny_model_dir, adapters["a"], PROMPTS[1], 100)
            # Once it finished: unload, then reload other weights under the
            # same name; the prompt's cached blocks are the old weights'.
            first = await _generate(stub, PROMPTS[2], 5, "a")
            await stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="a"))
            code, _ = await code_of(_generate(stub, PROMPTS[2], 5, "a"))
            assert code == grpc.StatusCode.NOT_FOUND
            await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
                lora_name="a", lora_path=adapters["c"]))
            again = await _generate(stub, PROMPTS[2], 5, "a")
            await assert_no_leaked_blocks(stub)
            return first, again

    with running_cluster(tiny_model_dir, args=_args(adapters)) as cluster:
        first, again = asyncio.run(scenario(cluster))
        assert _metric(cluster, "kvloom_lora_requests_total") >= 3
    assert first == peft_greedy(tiny_model_dir, adapters["a"], PROMPTS[2], 5)
    assert again == peft_greedy(tiny_model_dir, adapters["c"], PROMPTS[2], 5)


def test_a_killed_rank_with_adapters_in_flight_recovers_exactly(tiny_model_dir, adapters):
    async def scenario(cluster):
        async with grpc.aio.insecure_channel(cluster.api_address) as channel:
            stub = stub_for(channel)
            await stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="b",
                                                                 lora_path=adapters["b"]))
            plan = ["a", "b", None]
            tokens: list[list[int]] = [[] for _ in plan]

            async def one(i, lora):
                request = greedy_request(PROMPTS[i], 40, request_id=f"k{i}")
                request.lora_name = lora or ""
                async for m in stub.Generate(request, timeout=240):
                    tokens[i].extend(m.token_ids)

            streams = [asyncio.create_task(one(i, lora)) for i, lora in enumerate(plan)]
            while min(len(t) for t in tokens) < 5:
                await asyncio.sleep(0.005)
            _kill(cluster, 1)  # the output rank of PP=2
            await asyncio.gather(*streams)
            await assert_no_leaked_blocks(stub)
            return plan, tokens

    with supervised(tiny_model_dir, pp=2, args=_args(adapters)) as cluster:
        plan, tokens = asyncio.run(scenario(cluster))
        assert _metric(cluster, "kvloom_recoveries_total") >= 1
    for i, lora in enumerate(plan):
        assert tokens[i] == peft_greedy(tiny_model_dir, adapters[lora] if lora else None,
                                        PROMPTS[i], 40)
