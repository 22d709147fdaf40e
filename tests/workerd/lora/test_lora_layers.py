"""workerd/lora/layers.py on single layers: each row of a step gets exactly
its own adapter's (x A^T) B^T and base rows nothing; a TP rank's slices
(B's rows on column layers, A's columns on row layers, K/V heads replicated
over ranks) reassemble into the unsharded layer's result with no collective
of their own; the C kernel, where it builds, adds what torch adds, from
tables built once per set of active adapters."""

from __future__ import annotations

import pytest
import torch

import workerd.layers.linear as linear_mod
from workerd.distributed.parallel_state import ParallelState, single_process_state
from workerd.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from workerd.layers.packed_linear import pack_linear_weights, packing_unavailable
from workerd.lora.layers import LinearLoRA, LoRAStep
from workerd.lora.peft_checkpoint import LoRAModuleWeights
from workerd.models.decoder import tp_head_layout

torch.set_num_threads(1)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 4
ROWS = 11
# (row_start, row_end, lora_id): adapter 1 twice, base rows between.
SEGMENTS = [(0, 3, 1), (5, 8, 2), (9, 11, 1)]
BASE_ROWS = [3, 4, 8]


def _ps(tp_size: int, tp_rank: int) -> ParallelState:
    # No process group: tests that need the reduction do it themselves.
    return ParallelState(rank=tp_rank, world_size=tp_size, tp_size=tp_size, pp_size=1,
                         tp_rank=tp_rank, pp_rank=0, device=torch.device("cpu"))


def _randn(g, *shape):
    return torch.randn(*shape, generator=g) * 0.3


def _factors(g, targets: dict[str, tuple[int, int]], rank: int) -> dict[str, LoRAModuleWeights]:
    return {name: LoRAModuleWeights(_randn(g, rank, n_in), _randn(g, n_out, rank))
            for name, (n_in, n_out) in targets.items()}


def _qkv_parts(ps: ParallelState):
    """DecoderAttention's q/k/v parts for this rank (KV heads replicated at tp 4)."""
    _, kv_local, kv_shard = tp_head_layout(HEADS, KV_HEADS, ps.tp_size, ps.tp_rank)
    kv_out = KV_HEADS * HEAD_DIM
    return [("q_proj", HEADS * HEAD_DIM, None, None),
            ("k_proj", kv_out, KV_HEADS // kv_local, kv_shard),
            ("v_proj", kv_out, KV_HEADS // kv_local, kv_shard)]


# kind -> (make(ps) -> layer, full weights {name: [out, in]}, targets {name: (in, out)})
KINDS = {
    "column": (lambda ps: ColumnParallelLinear(HIDDEN, 24, ps, bias=True),
               {"up_proj": (24, HIDDEN)}),
    "row": (lambda ps: RowParallelLinear(24, HIDDEN, ps), {"down_proj": (HIDDEN, 24)}),
    "merged_qkv": (lambda ps: MergedColumnParallelLinear(HIDDEN, _qkv_parts(ps), ps, bias=True),
                   {"q_proj": (16, HIDDEN), "k_proj": (8, HIDDEN), "v_proj": (8, HIDDEN)}),
    "merged_gate_up": (lambda ps: MergedColumnParallelLinear(
        HIDDEN, [("gate_proj", 24, None, None), ("up_proj", 24, None, None)], ps),
        {"gate_proj": (24, HIDDEN), "up_proj": (24, HIDDEN)}),
    # Phi-3: one PEFT module (qkv_proj) spanning the three parts.
    "fused_qkv": (lambda ps: MergedColumnParallelLinear(HIDDEN, _qkv_parts(ps), ps,
                                                        fused_name="qkv_proj"),
                  {"q_proj": (16, HIDDEN), "k_proj": (8, HIDDEN), "v_proj": (8, HIDDEN)}),
}


def _load(layer, weights: dict[str, torch.Tensor], bias: dict[str, torch.Tensor]) -> None:
    """Fill this rank's slices the way the loader does (each weight's `shard`)."""
    if isinstance(layer, MergedColumnParallelLinear):
        for name, view in layer.checkpoint_params().items():
            part, kind = name.split(".")
            dim, start, end = view.shard
            view.data.copy_((weights if kind == "weight" else bias)[part].narrow(dim, start,
                                                                                 end - start))
        return
    (w,), (b,) = weights.values(), bias.values()
    dim, start, end = layer.weight.shard
    layer.weight.data.copy_(w.narrow(dim, start, end - start))
    if layer.bias is not None:
        layer.bias.data.copy_(b.narrow(0, start, end - start) if dim == 0 else b)


def _targets(lora: LinearLoRA) -> dict[str, tuple[int, int]]:
    return {n: (t.in_features, t.out_features) for n, t in lora.targets.items()}


def _attach(kind: str, ps: ParallelState, weights, bias, adapters, step):
    make, _ = KINDS[kind]
    layer = make(ps)
    _load(layer, weights, bias)
    name = next(iter(KINDS[kind][1]))
    layer.lora = LinearLoRA(layer, step, name)
    for lora_id, modules in adapters.items():
        layer.lora.set_adapter(lora_id, modules)
    return layer


def _setup(kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    _, shapes = KINDS[kind]
    weights = {n: _randn(g, *s) for n, s in shapes.items()}
    bias = {n: _randn(g, s[0]) for n, s in shapes.items()}
    probe = _attach(kind, single_process_state(), weights, bias, {}, LoRAStep("cpu"))
    targets = _targets(probe.lora)
    adapters = {1: _factors(g, targets, 4), 2: _factors(g, targets, 8)}
    x = _randn(g, ROWS, probe.lora.in_features)
    return weights, bias, adapters, x


def _reference(kind, weights, bias, adapters, x) -> torch.Tensor:
    """The unsharded layer's output with each row's delta, by hand."""
    names = list(KINDS[kind][1])
    offsets = {n: sum(weights[m].shape[0] for m in names[:i]) for i, n in enumerate(names)}
    y = x @ torch.cat([weights[n] for n in names]).T
    if kind in ("column", "merged_qkv"):  # the kinds built with a bias
        y = y + torch.cat([bias[n] for n in names])
    for start, end, lora_id in SEGMENTS:
        for target, w in adapters[lora_id].items():
            off = offsets.get(target, 0)  # a fused qkv_proj spans every column
            y[start:end, off:off + w.lora_b.shape[0]] += (x[start:end] @ w.lora_a.T) @ w.lora_b.T
    return y


def _step(segments=SEGMENTS) -> LoRAStep:
    step = LoRAStep("cpu")
    active = tuple(sorted({s[2] for s in segments}))
    step.set([(s, e, active.index(i)) for s, e, i in segments], active)
    return step


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_row_gets_its_adapter_and_base_rows_nothing(kind):
    weights, bias, adapters, x = _setup(kind)
    step = _step()
    layer = _attach(kind, single_process_state(), weights, bias, adapters, step)
    with torch.inference_mode():
        y = layer(x)
        step.clear()
        base = layer(x)
    torch.testing.assert_close(y, _reference(kind, weights, bias, adapters, x),
                               atol=1e-5, rtol=1e-5)
    # Not close: equal. vLLM's CPU path adds the last slot's delta to these.
    assert torch.equal(y[BASE_ROWS], base[BASE_ROWS])
    assert not torch.allclose(y[0], base[0])


@pytest.mark.parametrize("kind", list(KINDS))
def test_tp4_slices_reassemble_into_the_unsharded_layer(kind, monkeypatch):
    """4 query heads / 2 KV heads at TP=4: ranks 0,1 and 2,3 replicate a KV
    head each, and take the same rows of k's and v's B. Row layers' partial
    sums are added here (the all-reduce the layer would do)."""
    monkeypatch.setattr(linear_mod, "tp_all_reduce", lambda y, ps: y)
    weights, bias, adapters, x = _setup(kind, seed=1)
    want = _reference(kind, weights, bias, adapters, x)
    names = list(KINDS[kind][1])
    offsets = dict(zip(names, [sum(weights[n].shape[0] for n in names[:i])
                               for i in range(len(names))], strict=True))
    partial_sum = 0
    for rank in range(4):
        ps = _ps(4, rank)
        layer = _attach(kind, ps, weights, bias, adapters, _step())
        x_local = x
        if kind == "row":  # the rank's input columns (a column layer's output)
            _, start, end = layer.input_shard
            x_local = x[:, start:end]
        with torch.inference_mode():
            y = layer(x_local)
        if kind == "row":
            partial_sum = partial_sum + y
            continue
        col = 0
        for name, _, start, end in layer.output_parts:
            offset = offsets[name or names[0]]
            torch.testing.assert_close(y[:, col:col + end - start],
                                       want[:, offset + start:offset + end],
                                       atol=1e-5, rtol=1e-5)
            col += end - start
        assert col == y.shape[1]
    if kind == "row":
        torch.testing.assert_close(partial_sum, want, atol=1e-5, rtol=1e-5)


def test_an_adapter_without_a_part_leaves_its_columns_alone():
    weights, bias, adapters, x = _setup("merged_qkv")
    only_qv = {1: {k: v for k, v in adapters[1].items() if k != "k_proj"}}
    step = _step([(0, ROWS, 1)])
    layer = _attach("merged_qkv", single_process_state(), weights, bias, only_qv, step)
    with torch.inference_mode():
        y = layer(x)
        step.clear()
        base = layer(x)
    assert torch.equal(y[:, 16:24], base[:, 16:24])
    assert not torch.allclose(y[:, :16], base[:, :16])


@pytest.mark.skipif(packing_unavailable(torch.device("cpu"), torch.float32) is not None,
                    reason="this torch build has no oneDNN linear ops")
@pytest.mark.parametrize("kind", ["row", "merged_qkv"])
def test_attaching_after_packing_reads_the_recorded_shards(kind):
    """A worker packs its weights at load and may attach LoRA later: the
    plain weight (and the views carrying `shard`) are gone by then."""
    weights, bias, adapters, x = _setup(kind)
    step = _step()
    layer = KINDS[kind][0](single_process_state())
    _load(layer, weights, bias)
    assert pack_linear_weights(torch.nn.ModuleList([layer]), 4, min_elements=0) == 1
    assert layer.weight.numel() == 0
    layer.lora = LinearLoRA(layer, step, next(iter(KINDS[kind][1])))
    for lora_id, modules in adapters.items():
        layer.lora.set_adapter(lora_id, modules)
    with torch.inference_mode():
        y = layer(x)
    torch.testing.assert_close(y, _reference(kind, weights, bias, adapters, x),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("segments", [
    [(0, 3, 0), (2, 5, 0)],  # overlap
    [(-1, 3, 0)],
    [(4, 3, 0)],
    [(0, 3, 1)],  # slot past the active ids
    [(0, 3.0, 0)],
])
def test_step_refuses_rows_that_are_not_disjoint_ranges(segments):
    with pytest.raises(ValueError, match="LoRA segment"):
        LoRAStep("cpu").set(segments, (7,))


def test_segments_past_the_batch_are_refused_not_truncated():
    weights, bias, adapters, x = _setup("column")
    step = _step([(0, ROWS + 1, 1)])
    layer = _attach("column", single_process_state(), weights, bias, adapters, step)
    with pytest.raises(ValueError, match="reach row 12 of a 11-row batch"):
        layer(x)


def test_remove_adapter_drops_every_reference():
    import gc
    import weakref

    weights, bias, adapters, x = _setup("merged_qkv")
    step = _step()
    layer = _attach("merged_qkv", single_process_state(), weights, bias, adapters, step)
    with torch.inference_mode():
        layer(x)  # binds the slots
    held = layer.lora.adapters[2]
    refs = [weakref.ref(held.lora_a)] + [weakref.ref(p[2]) for p in held.parts if p]
    del held
    layer.lora.remove_adapter(2)
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.fixture(scope="module")
def kernel_lora():
    return pytest.importorskip("workerd.kernels.lora")


@pytest.fixture(scope="module")
def kernels(kernel_lora):
    k = kernel_lora.lora_kernels()
    if k is None or not hasattr(k, "lora_add"):
        pytest.skip("the C kernels do not build here")
    return k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["merged_qkv", "row", "fused_qkv"])
def test_the_kernel_adds_what_torch_adds(kernel_lora, kernels, kind, dtype, monkeypatch):
    weights, bias, adapters, x = _setup(kind)
    adapters = {i: {n: LoRAModuleWeights(w.lora_a.to(dtype), w.lora_b.to(dtype))
                    for n, w in m.items()} for i, m in adapters.items()}
    step = _step()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = KINDS[kind][0](single_process_state())
    finally:
        torch.set_default_dtype(old)
    _load(layer, {k: v.to(dtype) for k, v in weights.items()},
          {k: v.to(dtype) for k, v in bias.items()})
    layer.lora = LinearLoRA(layer, step, next(iter(KINDS[kind][1])))
    for lora_id, modules in adapters.items():
        layer.lora.set_adapter(lora_id, modules)
    x = x.to(dtype)
    built = []
    real_table = kernel_lora.lora_table
    monkeypatch.setattr(kernel_lora, "lora_table", lambda *a: built.append(1) or real_table(*a))
    with torch.inference_mode():
        want = layer(x)
        step.kernels = kernels
        got = layer(x)
        layer(x)
        # Another step over the same adapters, in another order: same table.
        step.set([(0, 2, 1), (4, 6, 0)], step.active_ids)
        layer(x)
        assert len(built) == 1
        step.set([(0, 2, 0)], (2,))
        layer(x)
        assert len(built) == 2
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
