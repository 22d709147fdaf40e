"""workerd/layers/packed_linear.py: CPU float32 ranks multiply through weights
packed once into oneDNN's layout. The packed layers must compute what F.linear
computes on the plain weights (every layer kind, bias, odd row counts, strided
inputs), hold each weight once (a tied LM head excepted), and the packed
runner must still generate transformers' greedy tokens, a mixture of experts'
too (its experts' slices packed one by one: workerd/layers/moe.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from kvloom_testing.checkpoints import make_tiny_llama
from kvloom_testing.families import make_tiny_checkpoint
from kvloom_testing.inprocess import runner_limits
from tests.integration.reference import hf_greedy
from workerd.cpu_features import isa_summary, native_bf16
from workerd.distributed.parallel_state import single_process_state
from workerd.layers import packed_linear
from workerd.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from workerd.layers.moe import FusedMoE, SharedExpert
from workerd.layers.packed_linear import (
    MIN_PACKED_EXPERT_ROWS,
    pack_linear_weights,
    packed_bytes,
    packing_unavailable,
)
from workerd.layers.vocab_parallel import ParallelLMHead
from workerd.runner.model_runner import ModelRunner
from workerd.runner.sched_output import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

torch.set_num_threads(1)
CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(packing_unavailable(CPU, torch.float32) is not None,
                                   reason="this torch build has no oneDNN linear ops")


def test_packing_is_a_cpu_path_in_float32_and_native_bf16():
    assert "cuda" in packing_unavailable(torch.device("cuda", 0), torch.float32)
    assert "float16" in packing_unavailable(CPU, torch.float16)
    # bf16 is packed only where the CPU does bf16 natively: oneDNN emulates it elsewhere.
    why = packing_unavailable(CPU, torch.bfloat16, frozenset({"avx2", "avx512f"}))
    assert "without native bf16 (avx512f;" in why
    for native in ({"avx512_bf16"}, {"amx_bf16"}):
        assert packing_unavailable(CPU, torch.bfloat16, frozenset(native)) == \
            packing_unavailable(CPU, torch.float32)


NATIVE_BF16 = native_bf16()
needs_native_bf16 = pytest.mark.skipif(
    not NATIVE_BF16 or packing_unavailable(CPU, torch.bfloat16) is not None,
    reason=f"packed bf16 needs AVX-512 BF16 or AMX; this CPU: {isa_summary()}")


@needs_native_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_packed_bf16_layers_compute_what_bf16_f_linear_computes(bias, rows):
    layers = _layers(bias)
    g = torch.Generator().manual_seed(rows)
    with torch.inference_mode():
        for name, module in layers.items():
            module.to(torch.bfloat16)
            in_features = 40 if name == "row" else 24
            x = torch.randn(rows, 2 * in_features, generator=g)[:, ::2].bfloat16()
            exact = F.linear(x.float(), module.weight.float(),
                             None if getattr(module, "bias", None) is None else module.bias.float())
            plain = _apply(name, module, x).float()
            pack_linear_weights(module, rows, min_elements=0)
            assert module.packed_weight is not None and module.packed_weight.dtype == torch.bfloat16
            got = _apply(name, module, x).float()
            want = exact[:, :37] if name == "lm_head" else exact
            # Both round a float32 sum to bf16 once: within a bf16 ulp or two of
            # the exact product, as plain bf16 F.linear is.
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-2)
            torch.testing.assert_close(got, plain, rtol=2 ** -7, atol=1e-2)
            # The tolerance catches a wrong weight: one output row's weights
            # off by a quarter give a product outside it.
            off = want.clone()
            off[:, 0] += 0.25 * x.float()[:, : (24 if name == "lm_head" else in_features)].sum(1)
            with pytest.raises(AssertionError):
                torch.testing.assert_close(got, off, rtol=2 ** -7, atol=1e-2)


def _layers(bias: bool):
    ps = single_process_state()
    g = torch.Generator().manual_seed(0)
    col = ColumnParallelLinear(24, 40, ps, bias=bias)
    row = RowParallelLinear(40, 24, ps, bias=bias)
    merged = MergedColumnParallelLinear(24, [("q", 16, None, None), ("k", 8, None, None)], ps,
                                        bias=bias)
    head = ParallelLMHead(37, 24, ps)  # a vocab no kernel block divides
    for m in (col, row, merged, head):
        for p in m.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))
    return {"column": col, "row": row, "merged": merged, "lm_head": head}


def _apply(name, module, x):
    return module.compute_logits(x) if name == "lm_head" else module(x)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 5, 33])
def test_packed_layers_compute_what_f_linear_computes(bias, rows):
    layers = _layers(bias)
    g = torch.Generator().manual_seed(rows)
    with torch.inference_mode():
        for name, module in layers.items():
            in_features = 40 if name == "row" else 24
            # Strided: every other column of a wider tensor.
            x = torch.randn(rows, 2 * in_features, generator=g)[:, ::2]
            want = F.linear(x, module.weight, getattr(module, "bias", None))
            want = want[:, :37].float() if name == "lm_head" else want
            plain = _apply(name, module, x)
            torch.testing.assert_close(plain, want, rtol=0, atol=0)
            pack_linear_weights(module, rows, min_elements=0)
            assert module.packed_weight is not None and module.weight.numel() == 0
            got = _apply(name, module, x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_packing
def test_packing_twice_is_a_no_op_and_views_are_dropped():
    merged = _layers(False)["merged"]
    assert merged.checkpoint_params()
    assert pack_linear_weights(merged, 4, min_elements=0) == 1
    first = merged.packed_weight
    # The checkpoint views shared the fused weight's storage: dropped with it.
    assert merged.checkpoint_params() == {}
    assert pack_linear_weights(merged, 4, min_elements=0) == 0
    assert merged.packed_weight is first


@needs_packing
def test_only_weights_past_the_threshold_are_packed():
    ps = single_process_state()
    # 1 << 18 elements is the default floor: 512x512 is packed, 511x512 not.
    at, below = ColumnParallelLinear(512, 512, ps), ColumnParallelLinear(512, 511, ps)
    model = torch.nn.ModuleList([at, below])
    assert pack_linear_weights(model, 16) == 1
    assert at.packed_weight is not None and below.packed_weight is None
    assert below.weight.shape == (511, 512)


def _checkpoint_bytes(model_dir: str) -> dict[str, int]:
    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as f:
        return {k: math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()}  # noqa: SIM118


@pytest.fixture
def pack_tiny_weights(monkeypatch):
    # Every tiny weight is below the packing threshold: lower it to 0 so the
    # runner tests exercise the packed path.
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", 0)


def test_the_tiny_model_keeps_f_linear_by_default(tiny_model_dir):
    assert packed_bytes(_runner(tiny_model_dir, pack=True).model) == 0


def _runner(model_dir: str, pack: bool) -> ModelRunner:
    runner = ModelRunner(single_process_state(), model_dir, torch.float32, seed=0,
                         limits=runner_limits(), pack_weights=pack)
    runner.load_model()
    return runner


@needs_packing
@pytest.mark.parametrize("tied", [False, True])
def test_a_packed_runner_holds_each_weight_once(tied, tiny_model_dir, tmp_path,
                                               pack_tiny_weights):
    model_dir = str(make_tiny_llama(tmp_path, tie_word_embeddings=True)) if tied \
        else tiny_model_dir
    runner = _runner(model_dir, pack=True)
    model = runner.model
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    sizes = _checkpoint_bytes(model_dir)
    # Every linear weight lives only in its packed form. A tied LM head is the
    # one packed copy of a weight that also stays plain (for the embedding).
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    packed = {k for k in sizes if "proj" in k} | {head}
    extra = sizes[head] if tied else 0
    assert runner.weights_bytes() == sum(sizes.values()) + extra
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plain == sum(v for k, v in sizes.items() if k not in packed) + extra
    assert packed_bytes(model) == sum(sizes[k] for k in packed)

    unpacked = _runner(model_dir, pack=False)
    assert packed_bytes(unpacked.model) == 0
    assert unpacked.weights_bytes() == sum(sizes.values())


def _greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    runner.init_kv_cache(8, 16)
    greedy = SamplingParams(temperature=0.0)
    new = [NewRequestData("r", prompt, [], greedy, list(range(8)), 0)]
    step, out_tokens, computed = 0, [], 0
    so = SchedulerOutput(step, new, CachedRequestData(), {"r": len(prompt)}, len(prompt),
                         set(), set())
    while len(out_tokens) < n:
        out = runner.execute_model(so)
        out_tokens.append(out.sampled_token_ids[0])
        computed += so.total_num_scheduled_tokens
        step += 1
        cached = CachedRequestData()
        cached.req_ids.append("r")
        cached.resumed_from_preemption.append(False)
        cached.new_block_ids.append([])
        cached.num_computed_tokens.append(computed)
        so = SchedulerOutput(step, [], cached, {"r": 1}, 1, set(), set())
    return out_tokens


@needs_packing
def test_a_packed_runner_generates_transformers_greedy_tokens(tiny_model_dir,
                                                             pack_tiny_weights):
    prompt = list(range(3, 40, 3))
    runner = _runner(tiny_model_dir, pack=True)
    assert packed_bytes(runner.model) > 0
    assert _greedy(runner, prompt, 24) == hf_greedy(tiny_model_dir, prompt, 24)


@needs_packing
@pytest.mark.parametrize("family,num_moe", [("mixtral", 4), ("qwen2-moe", 8), ("qwen3-moe", 3)])
def test_a_packed_moe_runner_holds_each_weight_once_and_generates_greedy_tokens(
        family, num_moe, tmp_path, pack_tiny_weights):
    """4 layers: Qwen2-MoE's each with a shared expert beside the routed
    ones, Qwen3-MoE's layer 1 a dense MLP."""
    model_dir = str(make_tiny_checkpoint(tmp_path, family, seed=3))
    runner = _runner(model_dir, pack=True)
    # runner_limits' 16 sequences route 8 rows to each of 4 experts (top 2).
    assert runner.limits.max_num_seqs * 2 / 4 >= MIN_PACKED_EXPERT_ROWS
    moe = [m for m in runner.model.modules() if isinstance(m, (FusedMoE, SharedExpert))]
    assert len(moe) == num_moe
    for m in moe:
        assert m.w13_weight.numel() == m.w2_weight.numel() == 0
        assert m.packed_w13 is not None and m.packed_w2 is not None
    sizes = _checkpoint_bytes(model_dir)
    assert runner.weights_bytes() == sum(sizes.values())
    experts = sum(v for k, v in sizes.items() if ".experts." in k or "shared_expert." in k)
    assert packed_bytes(runner.model) > experts
    prompt = list(range(3, 40, 3))
    assert _greedy(runner, prompt, 16) == hf_greedy(model_dir, prompt, 16)
