"""The MoE block against transformers' own: Mixtral, Qwen3-MoE and Qwen2-MoE
(shared expert) blocks with redrawn weights, saved by save_pretrained (so in
the hub's per-expert layout, named by transformers, not by us), loaded into
SparseMoeBlock through its LoadTargets, equal to HF's output at TP=1 for
every method and at TP=2 after the all-reduce, in real gloo processes; with
each expert's slices packed for oneDNN, equal to the unpacked block."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kvloom.common.ports import free_port
from tests.factories import layout_state
from workerd.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from workerd.layers.activation import SiluAndMul
from workerd.layers.moe import (
    MIXTRAL_EXPERT_NAMES,
    MOE_METHODS,
    PACKED_MOE_METHODS,
    QWEN_MOE_EXPERT_NAMES,
    ExpertWeightNames,
    FusedMoE,
    SparseMoeBlock,
    fused_experts,
    select_experts,
)
from workerd.layers.packed_linear import pack_linear_weights, pack_stack, packing_unavailable
from workerd.models import moe_models
from workerd.models.loader import load_weight_map

HIDDEN, EXPERTS, TOP_K, INTER, SHARED_INTER = 32, 4, 2, 16, 24
ATOL = 1e-5
CAN_PACK = packing_unavailable(torch.device("cpu"), torch.float32) is None
needs_packing = pytest.mark.skipif(not CAN_PACK, reason="this torch build has no oneDNN linear ops")


@dataclass(frozen=True)
class Case:
    """One family's tiny checkpoint and how SparseMoeBlock is built for it."""

    name: str
    path: str
    prefix: str
    names: ExpertWeightNames
    renormalize: bool
    shared: int


def _tiny_config(family: str, norm_topk_prob: bool):
    common = dict(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=64, num_experts_per_tok=TOP_K,
                  experts_implementation="eager")
    if family == "mixtral":
        return MixtralForCausalLM, MixtralConfig(
            **common, intermediate_size=INTER, num_local_experts=EXPERTS)
    qwen = dict(common, moe_intermediate_size=INTER, intermediate_size=48, num_experts=EXPERTS,
                norm_topk_prob=norm_topk_prob)
    if family == "qwen3_moe":
        return Qwen3MoeForCausalLM, Qwen3MoeConfig(**qwen)
    return Qwen2MoeForCausalLM, Qwen2MoeConfig(
        **qwen, shared_expert_intermediate_size=SHARED_INTER)


def _redraw(model, seed: int) -> None:
    """Every tensor from a seeded generator (independent of HF's init); the
    router's std makes tokens pick different experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            std = 0.3 if name.endswith("mlp.gate.weight") else 0.2
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _hf_model(family: str, norm_topk_prob: bool, seed: int = 0):
    cls, cfg = _tiny_config(family, norm_topk_prob)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    _redraw(model, seed)
    return model


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    """family -> its checkpoint (norm_topk_prob True for the Qwens; the
    False runs flip HF's router flag on the same weights)."""
    out = {}
    for family, prefix, names, shared in [
        ("mixtral", "model.layers.0.block_sparse_moe.", MIXTRAL_EXPERT_NAMES, 0),
        ("qwen3_moe", "model.layers.0.mlp.", QWEN_MOE_EXPERT_NAMES, 0),
        ("qwen2_moe", "model.layers.0.mlp.", QWEN_MOE_EXPERT_NAMES, SHARED_INTER),
    ]:
        path = tmp_path_factory.mktemp(family)
        _hf_model(family, True).save_pretrained(path)
        out[family] = Case(family, str(path), prefix, names, True, shared)
    return out


def _hf_block(family: str, norm_topk_prob: bool):
    return _hf_model(family, norm_topk_prob).model.layers[0].mlp


def _x(seed: int = 1, tokens: int = 24) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _block(case: Case, ps, renormalize: bool = True, method: str = "auto",
           float32_weights: bool = False) -> SparseMoeBlock:
    return SparseMoeBlock(EXPERTS, TOP_K, HIDDEN, INTER, ps, renormalize,
                          shared_expert_intermediate_size=case.shared, expert_names=case.names,
                          method=method, float32_weights=float32_weights)


def _ours(case: Case, ps, renormalize: bool, method: str = "auto",
          float32_weights: bool = False) -> SparseMoeBlock:
    """Loaded as a model loads it: the block's targets under its prefix."""
    block = _block(case, ps, renormalize, method, float32_weights)
    wanted = {case.prefix + k: t for k, t in block.checkpoint_targets().items()}
    load_weight_map(wanted, case.path)
    return block.eval()


def _hf_out(family: str, norm_topk_prob: bool, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _hf_block(family, norm_topk_prob)(x.unsqueeze(0))[0]


def test_checkpoint_is_in_the_hub_layout(cases):
    """save_pretrained wrote one tensor per expert; every name the block
    asks for exists, and the block asks for all of the layer's MLP tensors."""
    from safetensors import safe_open

    for case in cases.values():
        with safe_open(str(Path(case.path) / "model.safetensors"), "pt") as f:
            on_disk = {k for k in f.keys() if k.startswith(case.prefix)}  # noqa: SIM118
        targets = _block(case, layout_state()).checkpoint_targets()
        assert {case.prefix + k for k in targets} == on_disk
        assert f"{case.prefix}experts.3.{case.names.down}.weight" in on_disk


def test_router_spreads_tokens_over_experts():
    for family in ("mixtral", "qwen3_moe"):
        hf = _hf_block(family, True)
        with torch.no_grad():
            _, _, ids = hf.gate(_x())
        assert ids.unique().numel() >= 3, family


@pytest.mark.parametrize("method", MOE_METHODS)
@pytest.mark.parametrize("family,norm_topk_prob", [
    ("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False),
    ("qwen2_moe", True), ("qwen2_moe", False)])
def test_tp1_matches_hf_block(cases, family, norm_topk_prob, method):
    x = _x()
    block = _ours(cases[family], layout_state(), norm_topk_prob, method)
    with torch.no_grad():
        got = block(x)
    torch.testing.assert_close(got, _hf_out(family, norm_topk_prob, x), atol=ATOL, rtol=0)


# Each family's model class, which declares how its router rounds.
MODEL_CLASS = {"mixtral": moe_models.MixtralForCausalLM,
               "qwen3_moe": moe_models.Qwen3MoeForCausalLM,
               "qwen2_moe": moe_models.Qwen2MoeForCausalLM}


def _bf16_pair(cases, family: str, method: str, float32_weights: bool):
    """(ours, HF's) block outputs in bf16 on the same bf16 weights and input."""
    x = _x(tokens=64).to(torch.bfloat16)
    hf = _hf_block(family, True).to(torch.bfloat16)
    ours = _ours(cases[family], layout_state(), True, method, float32_weights)
    with torch.no_grad():
        return ours.to(torch.bfloat16)(x), hf(x.unsqueeze(0))[0]


@pytest.mark.parametrize("method", MOE_METHODS)
@pytest.mark.parametrize("family", sorted(MODEL_CLASS))
def test_bf16_matches_hf_block_bit_for_bit(cases, family, method):
    """In bf16 each family rounds as its transformers code does: Mixtral's
    router keeps the weights float32 (MixtralTopKRouter), so each expert's
    output is scaled in float32 and rounded once; Qwen-MoE's casts them to
    bf16 first. With the flag its model class declares, every method equals
    HF's block exactly."""
    got, want = _bf16_pair(cases, family, method, MODEL_CLASS[family].float32_routing_weights)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("family", sorted(MODEL_CLASS))
def test_bf16_the_other_routing_rounding_differs(cases, family):
    """Negative control: the other family's rounding is off HF's by whole bf16
    ulps on many elements, so the exact test above tells the two apart."""
    got, want = _bf16_pair(cases, family, "reference",
                           not MODEL_CLASS[family].float32_routing_weights)
    assert (got != want).sum() > got.numel() // 10


@pytest.mark.parametrize("method", MOE_METHODS)
def test_tp1_matches_hf_with_c_kernels_bound(cases, method):
    """As a float32 CPU rank runs it: silu-and-mul in kvloom's C kernel."""
    from workerd.kernels.loader import load_kernels
    from workerd.layers.custom_op import use_custom_op_kernels

    x = _x()
    block = _ours(cases["qwen2_moe"], layout_state(), True, method)
    assert use_custom_op_kernels(block, load_kernels()) == 2  # routed + shared
    with torch.no_grad():
        got = block(x)
    torch.testing.assert_close(got, _hf_out("qwen2_moe", True, x), atol=ATOL, rtol=0)


def test_renormalisation_changes_the_output(cases):
    """Negative control: norm_topk_prob (and Mixtral's fixed renorm) matter at
    this router, so the parity runs above can tell the settings apart."""
    x = _x()
    for family in ("qwen3_moe", "qwen2_moe"):
        diff = (_hf_out(family, True, x) - _hf_out(family, False, x)).abs().max()
        assert diff > 100 * ATOL, family
    mixtral = _hf_out("mixtral", True, x)
    with torch.no_grad():
        unnormalised = _ours(cases["mixtral"], layout_state(), False)(x)
    assert (unnormalised - mixtral).abs().max() > 100 * ATOL


def test_methods_agree_on_uneven_routing():
    """More experts than tokens pick (some never hit), k=3, odd token counts,
    no tokens at all: every method equals the reference loop."""
    g = torch.Generator().manual_seed(7)
    e, k, h, i = 8, 3, 16, 24
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.3
    w2 = torch.randn(e, h, i, generator=g) * 0.3
    router = torch.randn(e, h, generator=g)
    act = SiluAndMul()
    for tokens in (0, 1, 2, 37):
        x = torch.randn(tokens, h, generator=g)
        logits = x @ router.T
        logits[:, 5] = -1e4  # no token picks expert 5
        weights, ids = select_experts(logits, k, renormalize=False)
        assert not (ids == 5).any()
        ref = fused_experts(x, w13, w2, weights, ids, act, "reference")
        assert ref.shape == (tokens, h)
        for method in MOE_METHODS:
            got = fused_experts(x, w13, w2, weights, ids, act, method)
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0, msg=f"{method} {tokens}")


def test_select_experts_float32_softmax_and_renorm():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.bfloat16)
    w, ids = select_experts(logits, 2, renormalize=False)
    assert w.dtype == torch.bfloat16 and ids.tolist() == [[0, 1]]
    p = torch.softmax(logits.float(), -1)[0, :2]
    torch.testing.assert_close(w.float()[0], p.to(torch.bfloat16).float())
    w, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(w.float()[0], (p / p.sum()).to(torch.bfloat16).float())
    w, _ = select_experts(logits, 2, renormalize=True, float32_weights=True)  # Mixtral's
    assert w.dtype == torch.float32
    torch.testing.assert_close(w[0], p / p.sum())


def test_tp_rank_holds_its_slice_and_partials_sum_to_tp1(cases):
    """Each rank's stacked weights are its rows/columns of every expert's
    tensors; the ranks' partial outputs (what the all-reduce sums) add up to
    the TP=1 output, routed and shared alike."""
    case = cases["qwen2_moe"]
    x = _x()
    full = _ours(case, layout_state(), True)
    with torch.no_grad():
        want = full(x)
        partials = []
        for rank in range(2):
            block = _ours(case, layout_state(tp_size=2, tp_rank=rank), True)
            rows = slice(rank * 8, (rank + 1) * 8)
            torch.testing.assert_close(block.experts.w13_weight[2, :8],
                                       full.experts.w13_weight[2, :16][rows])
            torch.testing.assert_close(block.experts.w13_weight[2, 8:],
                                       full.experts.w13_weight[2, 16:][rows])
            torch.testing.assert_close(block.experts.w2_weight[2],
                                       full.experts.w2_weight[2][:, rows])
            torch.testing.assert_close(block.gate.weight, full.gate.weight)
            partials.append(block.experts(x, block.gate(x)) + block.shared_expert(x))
    torch.testing.assert_close(partials[0] + partials[1], want, atol=ATOL, rtol=0)
    assert (partials[0] - want).abs().max() > 100 * ATOL  # one rank alone is not the answer


def _pack(block, batch_hint: int = 16, min_elements: int = 0) -> int:
    # Tiny weights: no size floor; 16 rows route 8 to each of 4 experts.
    return pack_linear_weights(block, batch_hint, min_elements=min_elements)


def _all_packed(case: Case) -> int:
    """Every expert's two slices, the router, and a shared expert's two."""
    return 2 * EXPERTS + 1 + (2 if case.shared else 0)


def _tp_worker(rank, port, cases, out_dir):
    torch.set_num_threads(1)
    ps = init_parallel_state(rank, 2, 2, 1, "127.0.0.1", port, 60.0, torch.device("cpu"))
    try:
        outs = {}
        with torch.no_grad():
            for case in cases:
                for method in ("sorted", "grouped_mm"):
                    outs[case.name, method] = _ours(case, ps, case.renormalize, method)(_x())
                if CAN_PACK:  # as a CPU float32 rank runs it: experts packed
                    block = _ours(case, ps, case.renormalize)
                    assert _pack(block) == _all_packed(case)
                    outs[case.name, "packed"] = block(_x())
        torch.save(outs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_parallel_state(ps)


@pytest.mark.slow
def test_tp2_after_all_reduce_equals_tp1(cases, tmp_path):
    cs = list(cases.values())
    mp.spawn(_tp_worker, args=(free_port(), cs, str(tmp_path)), nprocs=2, join=True)
    x = _x()
    methods = ("sorted", "grouped_mm", "packed") if CAN_PACK else ("sorted", "grouped_mm")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(got) == len(methods) * len(cs)
        for case in cs:
            with torch.no_grad():
                want = _ours(case, layout_state(), case.renormalize)(x)
            torch.testing.assert_close(want, _hf_out(case.name, True, x), atol=ATOL, rtol=0)
            for method in methods:
                torch.testing.assert_close(got[case.name, method], want, atol=ATOL, rtol=0,
                                           msg=f"rank {rank} {case.name} {method}")


def test_hostile_sizes_are_refused_by_number():
    tp2 = layout_state(tp_size=2)
    with pytest.raises(ValueError, match=r"moe_intermediate_size=15 .* tensor_parallel_size=2"):
        FusedMoE(4, 2, 32, 15, tp2, True)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size=9 .* "
                                         r"tensor_parallel_size=2"):
        SparseMoeBlock(4, 2, 32, 16, tp2, True, shared_expert_intermediate_size=9)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in 1\.\.num_experts=4"):
        FusedMoE(4, 5, 32, 16, layout_state(), True)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=0"):
        FusedMoE(4, 0, 32, 16, layout_state(), True)
    with pytest.raises(ValueError, match=r"num_experts=0"):
        FusedMoE(0, 1, 32, 16, layout_state(), True)
    with pytest.raises(ValueError, match=r"hidden_act 'gelu'"):
        FusedMoE(4, 2, 32, 16, layout_state(), True, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"unknown MoE method 'fast'"):
        FusedMoE(4, 2, 32, 16, layout_state(), True, method="fast")
    # grouped_mm's 16-byte strides: refused at build; "auto" falls back to sorted.
    with pytest.raises(ValueError, match=r"hidden_size=30 .* intermediate size 16"):
        FusedMoE(4, 2, 30, 16, layout_state(), True, method="grouped_mm")
    FusedMoE(4, 2, 30, 16, layout_state(), True, method="auto")


@needs_packing
@pytest.mark.parametrize("method", PACKED_MOE_METHODS)
@pytest.mark.parametrize("family", sorted(MODEL_CLASS))
def test_packed_experts_equal_unpacked(cases, family, method):
    """Each expert's w13 and w2 slice packed for oneDNN, the stacks freed
    (Qwen2-MoE's shared expert packed too): the block computes what it
    computed unpacked (and HF's), for no tokens, one, and tokens spread over
    every expert."""
    block = _ours(cases[family], layout_state(), True, method)
    xs = [_x(tokens=n) for n in (0, 1, 24)]
    with torch.no_grad():
        want = [block(x) for x in xs]
        stack = weakref.ref(block.experts.w13_weight)
        assert _pack(block) == _all_packed(cases[family])
        assert stack() is None  # the plain stack is gone, not kept beside the packed one
        experts = block.experts
        assert experts.w13_weight.numel() == experts.w2_weight.numel() == 0
        assert len(experts.packed_w13) == len(experts.packed_w2) == EXPERTS
        if block.shared_expert is not None:
            assert block.shared_expert.w13_weight.numel() == 0
            assert block.shared_expert.packed_w2 is not None
        for x, w in zip(xs, want, strict=True):
            got = block(x)
            assert got.shape == w.shape
            torch.testing.assert_close(got, w, atol=ATOL, rtol=0)
        torch.testing.assert_close(got, _hf_out(family, True, xs[-1]), atol=ATOL, rtol=0)


@needs_packing
@pytest.mark.parametrize("stack", ["packed_w13", "packed_w2"])
def test_packed_experts_in_the_wrong_order_differ(cases, stack):
    """Negative control: the packed list indexed by expert id, so two experts
    swapped in it (the weights themselves intact) change the output."""
    block = _ours(cases["qwen3_moe"], layout_state(), True, "sorted")
    x = _x()
    with torch.no_grad():
        want = block(x)
        _pack(block)
        torch.testing.assert_close(block(x), want, atol=ATOL, rtol=0)
        packed = getattr(block.experts, stack)
        packed[0], packed[2] = packed[2], packed[0]
        assert (block(x) - want).abs().max() > 100 * ATOL


@needs_packing
def test_packing_applies_by_size_and_by_rows_per_expert(cases):
    """An expert slice is packed past the dense size floor raised by
    EXPERT_FLOOR_ROWS / rows per expert (hint * top_k / E) below 12 rows, and
    none under 4 rows. Mixtral's w13 slice is 2 * 16 * 32 = 1024 elements,
    its w2 512, its router 128."""
    case = cases["mixtral"]
    x = _x()
    want = _hf_out("mixtral", True, x)
    for hint, floor, packed13, packed2 in [
            (16, 600, True, False),  # 8 rows: floor 900
            (16, 700, False, False),  # floor 1050: w13 would pass a dense floor of 700
            (24, 1024, True, False),  # 12 rows: the floor itself
            (48, 512, True, True),  # 24 rows
            (8, 0, True, True), (7, 0, False, False)]:  # 4 rows, 3.5
        block = _ours(case, layout_state(), True)
        n = _pack(block, hint, floor)
        experts = block.experts
        assert (experts.packed_w13 is not None, experts.packed_w2 is not None) == (
            packed13, packed2), (hint, floor)
        assert experts.w13_weight.numel() == (0 if packed13 else EXPERTS * 2 * INTER * HIDDEN)
        assert n == EXPERTS * (packed13 + packed2) + (floor <= EXPERTS * HIDDEN)
        with torch.no_grad():
            torch.testing.assert_close(block(x), want, atol=ATOL, rtol=0)
        assert _pack(block, hint, floor) == 0  # packing twice is a no-op


@needs_packing
@pytest.mark.parametrize("method", ["grouped_mm", "reference"])
def test_methods_reading_the_plain_stacks_keep_them(cases, method):
    block = _ours(cases["mixtral"], layout_state(), True, method)
    assert _pack(block) == 1  # the router only
    assert block.experts.packed_w13 is None and block.experts.w13_weight.numel() > 0
    w13, w2 = block.experts.w13_weight, block.experts.w2_weight
    packed = pack_stack(w13, 16)
    with pytest.raises(ValueError, match=f"MoE method '{method}' reads the plain stacks"):
        fused_experts(_x(), w13, w2, *select_experts(torch.randn(24, EXPERTS), TOP_K, True),
                      SiluAndMul(), method, packed13=packed)
