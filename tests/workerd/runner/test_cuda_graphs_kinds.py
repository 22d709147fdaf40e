"""Decode CUDA graphs of a model whose layers attend in several ways
(workerd/runner/cuda_graphs.py with model.attention_kinds): one graph decode
plan per kind, each with page-table buffers of its own, handed to the
forward as {kind: plan} and every one re-planned before each replay.

On CPU, with the stand-in graph of test_cuda_graphs.py and the stand-in
FlashInfer, over a stub model: its "layers" are attention alone (q, k, v
from a fixed per-token embedding), each of its kind, so the replayed
outputs must be the torch backend's eager ones for each kind, step by
step, as the batch shrinks through padded graph sizes."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from kvloom_testing.attention import build_attn_metadata
from tests.workerd.layers import fake_flashinfer
from tests.workerd.runner.test_cuda_graphs import ReplayingGraph
from workerd.layers.attention.backend import TorchAttentionBackend, make_attention_backend
from workerd.layers.attention.interface import FULL_ATTENTION, AttentionLayerKind
from workerd.runner.cuda_graphs import DecodeGraphs, graphs_memory_bytes

HEADS, KV_HEADS, HEAD_DIM, BLOCK, VOCAB = 4, 2, 16, 4, 50
SCALE = HEAD_DIM**-0.5
WINDOW = AttentionLayerKind(sliding_window=5)
CAPPED = AttentionLayerKind(sliding_window=6, logits_soft_cap=2.0)


class StubModel:
    """What DecodeGraphs reads of a model, and a forward that attends once
    per layer with the plan of that layer's kind."""

    def __init__(self, backend, layer_kinds: list[AttentionLayerKind]):
        self.attn_backend = backend
        self.layer_kinds = layer_kinds
        self.attention_kinds = tuple(dict.fromkeys(layer_kinds))
        self.attn_shape = (HEADS, KV_HEADS, HEAD_DIM, SCALE)
        self.rotary_emb = SimpleNamespace(cached_positions=1 << 16)
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(VOCAB, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen) * 2

    def forward(self, input_ids, positions, kv_caches, md, intermediate_tensors=None,
                attn_plan=None):
        n = input_ids.shape[0]
        plans = attn_plan
        if plans is None:
            plans = {kind: self.attn_backend.build_plan(md, n, kind)
                     for kind in self.attention_kinds}
        # A position-dependent input, so a slip in the positions buffer shows.
        x = self.embed[input_ids] + positions[:, None, None].float() * 0.01
        q, k, v = x.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        outs = [self.attn_backend.forward(q.contiguous(), k, v, kv_caches[i], md, SCALE,
                                          plans[kind])
                for i, kind in enumerate(self.layer_kinds)]
        return torch.cat(outs, dim=1)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    return make_attention_backend("flashinfer", torch.device("cpu"))


def _caches(num_layers: int, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
            for _ in range(num_layers)]


@pytest.mark.parametrize("layer_kinds", [[WINDOW, FULL_ATTENTION, CAPPED, WINDOW],
                                         [WINDOW, WINDOW]], ids=["three_kinds", "one_window"])
@torch.inference_mode()
def test_each_kind_is_planned_and_replayed_as_eager_attends(stand_in, layer_kinds):
    num_blocks = 40  # the controlplane's pool; the graphs' padding block is one more
    graph_model = StubModel(stand_in, layer_kinds)
    eager_model = StubModel(TorchAttentionBackend(), layer_kinds)
    graph_caches = _caches(len(layer_kinds), num_blocks + 1, seed=1)
    eager_caches = [c[:, :num_blocks].clone() for c in graph_caches]
    graphs = DecodeGraphs(graph_model, graph_caches, BLOCK, torch.float32,
                          torch.device("cpu"), [1, 2, 4], graph=ReplayingGraph())
    kinds = graph_model.attention_kinds
    assert graphs.kinds == kinds
    # Page tables per kind; the token inputs one set for all.
    tables = [graphs.kind_buffers[kind] for kind in kinds]
    assert len({id(b.indices) for b in tables}) == len({id(b.indptr) for b in tables}) == len(kinds)
    assert len({id(b.input_ids) for b in tables}) == 1
    for g in graphs.graphs.values():
        assert list(g.plans) == list(kinds)
    # Contexts far past the windows, blocks scattered; the batch shrinks 3 -> 1.
    computed = [21, 9, 30]
    block_tables = [list(range(0, 8)), list(range(8, 12)), list(range(12, 21))]
    gen = torch.Generator().manual_seed(2)
    for step, rows in enumerate([[0, 1, 2], [0, 1, 2], [0, 2], [2], [2]]):
        md, positions = build_attn_metadata([computed[r] for r in rows], [1] * len(rows),
                                            [block_tables[r] for r in rows], BLOCK)
        ids = torch.randint(0, VOCAB, (len(rows),), generator=gen)
        assert graphs.can_run(md)
        got = graphs.run(ids, positions, md).clone()
        want = eager_model.forward(ids, positions, eager_caches, md)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=f"step {step}")
        for r in rows:
            computed[r] += 1
    captured = graphs.graphs
    assert sorted(captured) == [1, 2, 4]
    for graph_cache, eager_cache in zip(graph_caches, eager_caches, strict=True):
        torch.testing.assert_close(graph_cache[:, :num_blocks], eager_cache)
    # Each kind's captured wrapper was re-planned before every replay of its
    # size (and once at capture): two steps of 3 rows ran the graph of 4,
    # one of 2 rows that of 2, two of 1 that of 1.
    for kind in kinds:
        planned = [len(captured[size].plans[kind].graph.wrapper.plans) for size in (4, 2, 1)]
        assert planned == [1 + 2, 1 + 1, 1 + 2]
        last = captured[4].plans[kind].graph.wrapper.plans[-1]
        assert last["window_left"] == (-1 if kind.sliding_window is None
                                       else kind.sliding_window - 1)


@torch.inference_mode()
def test_blocks_before_the_window_stay_unread_in_a_replay(stand_in):
    """An all-window model (the controlplane frees what leaves the window):
    the replayed graph's page tables start at each request's first needed
    block, so NaN before it never reaches the output."""
    num_blocks = 30
    model = StubModel(stand_in, [WINDOW, WINDOW])
    caches = _caches(2, num_blocks + 1, seed=3)
    graphs = DecodeGraphs(model, caches, BLOCK, torch.float32, torch.device("cpu"), [2],
                          graph=ReplayingGraph())
    computed, block_tables = [22, 13], [list(range(0, 6)), list(range(6, 10))]
    for cache in caches:
        for c, table in zip(computed, block_tables, strict=True):
            cache[:, table[: (c - WINDOW.sliding_window + 1) // BLOCK]] = float("nan")
    clean = [c.nan_to_num(0.0) for c in caches]
    md, positions = build_attn_metadata(computed, [1, 1], block_tables, BLOCK)
    ids = torch.tensor([3, 7])
    got = graphs.run(ids, positions, md)
    assert torch.isfinite(got).all()
    eager = StubModel(TorchAttentionBackend(), [WINDOW, WINDOW])
    torch.testing.assert_close(got, eager.forward(ids, positions, clean, md),
                               atol=2e-5, rtol=2e-5)


def test_the_graphs_reserve_a_wrapper_per_kind_and_size():
    one = graphs_memory_bytes(6)
    assert one == 4 * (16 << 20)  # sizes 1, 2, 4, 6
    assert graphs_memory_bytes(6, num_kinds=2) == one + 4 * (8 << 20)
