"""CUDA graphs for decode steps (vLLM's piecewise-free "full" decode graphs,
turned off with --enforce-eager).

A small model's decode step on a GPU is bound by kernel launches, not by
the kernels: a few hundred launches from Python per step. A CUDA graph
captured once per batch size replays the whole forward (embedding, every
layer, final norm) as one launch. The logits and sampling stay eager: they
run on the graph's output rows.

Captured at init_kv_cache (the graphs read the KV cache tensors), for the
batch sizes in capture_sizes(max_num_seqs); a decode-only step of n requests
runs the smallest graph of at least n rows. The extra rows are padding: token
0 at position 0 whose K/V goes to a block no request owns (the cache is
allocated one block larger for it) and whose attention reads only that
block, so the real rows' results do not depend on them.

Inputs reach a graph through static buffers: this step's token ids,
positions and slots are copied in, and the attention backend re-plans the
graph's page tables (FlashInfer's decode wrapper in CUDA-graph mode keeps
them in buffers the captured kernels read) before the replay. A model whose
layers attend in several ways (model.attention_kinds: a sliding window, a
soft cap, or neither; Gemma 2 alternates two) is captured with one graph
decode plan per kind, handed to its forward as {kind: plan}, and each kind
has page-table buffers of its own (a window trims each request's pages);
every kind is re-planned before each replay. The layers' shape comes from
model.attn_shape (heads, KV heads, head_dim, scale on this rank).

When graphs apply (graphs_unavailable gives the reason when not): a CUDA
device, an attention backend that declares cuda_graph_decode (FlashInfer;
the torch reference path builds its attention plan from the step's shapes
on the host, which a graph cannot replay), and one rank (TP=1, PP=1:
collectives inside a graph are the next step, not yet written). NOT YET RUN
ON A GPU; tests/workerd/runner/test_cuda_graphs.py checks the logic on CPU
with stand-ins for the graph and for FlashInfer, and its gpu-marked test
compares graphs against eager token by token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workerd.layers.attention.interface import AttentionBackend, AttentionLayerKind
from workerd.layers.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# vLLM's shape of the list (dense at small batches, where padding costs most
# relatively), sparser above 32: each size holds a graph and, per attention
# kind, a FlashInfer wrapper with its own 8 MiB integer workspace.
_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: the list up to max_num_seqs, plus
    max_num_seqs itself when it falls between two sizes (<= 256), so every
    decode batch the scheduler can form has a graph up to 256 requests."""
    sizes = [s for s in _CAPTURE_SIZES if s <= max_num_seqs]
    if max_num_seqs <= _CAPTURE_SIZES[-1] and sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


# Device memory the graphs take beyond the profiled forward, per captured
# size: FlashInfer's CUDA-graph decode wrapper allocates an 8 MiB integer
# workspace of its own (one wrapper per attention kind), and the graph pool
# keeps each size's activations (decode rows only: small next to it). The
# KV budget leaves this much free.
GRAPH_WRAPPER_BYTES = 8 << 20
GRAPH_ACTIVATION_BYTES = 8 << 20
GRAPH_BYTES_PER_SIZE = GRAPH_WRAPPER_BYTES + GRAPH_ACTIVATION_BYTES  # one kind


def graphs_memory_bytes(max_num_seqs: int, num_kinds: int = 1) -> int:
    """num_kinds: len(model.attention_kinds), one decode wrapper each per size."""
    per_size = GRAPH_ACTIVATION_BYTES + GRAPH_WRAPPER_BYTES * num_kinds
    return per_size * len(capture_sizes(max_num_seqs))


def graphs_unavailable(device: torch.device,
                       backend: AttentionBackend | type[AttentionBackend], world_size: int,
                       enforce_eager: bool) -> str | None:
    """None when decode steps run as CUDA graphs, else why they run eagerly.
    backend: the rank's attention backend (or its class: only what it
    declares is read)."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"no CUDA device ({device})"
    if not backend.capabilities.cuda_graph_decode:
        return (f"the {backend.name} attention backend is not graph-safe "
                f"(it does not declare cuda_graph_decode)")
    if world_size != 1:
        return "more than one rank (graphs are captured at TP=1, PP=1 only)"
    return None


class TorchCudaGraph:
    """Capture with torch.cuda.graph; all sizes share one memory pool (the
    largest is captured first, so the smaller ones fit in its memory)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # Warm-up on a side stream, as torch's docs require before capture
        # (lazy initialisation, autotuning, FlashInfer's JIT).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


@dataclass
class GraphBuffers:
    """Static inputs every captured graph reads (sized for the largest), as
    one attention kind's plans see them: the token inputs are the same
    tensors for every kind, the page tables its own."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64
    # FlashInfer's page tables in CUDA-graph mode.
    indptr: torch.Tensor  # [max_batch + 1] int32
    indices: torch.Tensor  # [num_blocks + max_batch] int32
    last_page_len: torch.Tensor  # [max_batch] int32


@dataclass
class _Graph:
    replay: Callable[[], None]
    output: torch.Tensor  # [batch_size, hidden]: the replay writes here
    # The backend's plan per attention kind the forward was captured with.
    plans: dict[AttentionLayerKind, object]


class DecodeGraphs:
    """One captured forward per batch size; run() replays a decode step."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int,
                 dtype: torch.dtype, device: torch.device, sizes: list[int],
                 graph=None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        # The block allocated past the controlplane's pool (init_kv_cache).
        self.pad_block = kv_caches[0].shape[1] - 1
        self.pad_slot = self.pad_block * block_size
        backend = model.attn_backend
        if not backend.capabilities.cuda_graph_decode:
            raise ValueError(f"the {backend.name!r} attention backend does not declare "
                             f"cuda_graph_decode; decode steps must run eagerly")
        num_heads, num_kv_heads, head_dim, scale = model.attn_shape
        self._plan_kwargs = dict(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
            dtype=dtype, kv_dtype=kv_caches[0].dtype, page_size=block_size)
        self.kinds: tuple[AttentionLayerKind, ...] = tuple(model.attention_kinds)
        n = self.max_batch

        def i64(fill: int) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.int64, device=device)

        tokens = dict(input_ids=i64(0), positions=i64(0), slot_mapping=i64(self.pad_slot))
        # Page tables per kind: replanning one must not move another's
        # under its captured kernels.
        self.kind_buffers = {
            kind: GraphBuffers(
                **tokens,
                indptr=torch.zeros(n + 1, dtype=torch.int32, device=device),
                indices=torch.zeros(self.pad_block + 1 + n, dtype=torch.int32, device=device),
                last_page_len=torch.zeros(n, dtype=torch.int32, device=device))
            for kind in self.kinds
        }
        self.buffers = self.kind_buffers[self.kinds[0]]  # the token inputs, shared
        self.backend = backend
        graph = graph or TorchCudaGraph()
        t0 = time.monotonic()
        self.graphs: dict[int, _Graph] = {}
        with torch.inference_mode():  # as every eager step runs
            for size in reversed(self.sizes):
                self.graphs[size] = self._capture(size, graph)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.sizes), self.sizes, time.monotonic() - t0)

    def _padding_metadata(self, size: int) -> AttentionMetadata:
        """Every row a padding token: what the graph of `size` is captured with."""
        dev = self.device
        return AttentionMetadata(
            num_reqs=size, num_actual_tokens=size,
            slot_mapping=self.buffers.slot_mapping[:size],
            query_start_loc=torch.arange(size + 1, device=dev),
            seq_lens=torch.ones(size, dtype=torch.int64, device=dev),
            block_table=torch.full((size, 1), self.pad_block, dtype=torch.int64, device=dev),
            max_query_len=1, max_seq_len=1, block_size=self.block_size,
            query_lens_cpu=[1] * size, seq_lens_cpu=[1] * size,
        )

    def _capture(self, size: int, graph) -> _Graph:
        md = self._padding_metadata(size)
        plans = {kind: self.backend.graph_decode_plan(md, self.pad_block, self.kind_buffers[kind],
                                                      kind=kind, **self._plan_kwargs)
                 for kind in self.kinds}
        b = self.buffers
        model, caches = self.model, self.kv_caches

        def forward() -> torch.Tensor:
            return model.forward(b.input_ids[:size], b.positions[:size], caches, md, None,
                                 attn_plan=plans)

        replay, output = graph.capture(forward)
        return _Graph(replay, output, plans)

    def can_run(self, md: AttentionMetadata) -> bool:
        """A decode-only step (one query token per request, no padding tokens
        of its own) small enough for a captured size, whose positions are all
        in the rotary cache: the graphs were captured reading it, and a step
        beyond it computes its tables eagerly instead."""
        n = md.num_reqs
        return (0 < n <= self.max_batch and md.num_actual_tokens == n
                and md.max_query_len == 1
                and md.max_seq_len <= self.model.rotary_emb.cached_positions)

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            md: AttentionMetadata) -> torch.Tensor:
        """The step's last hidden states [n, hidden] (a view of the graph's
        output: valid until the next replay)."""
        n = md.num_reqs
        size = self.size_for(n)
        g = self.graphs[size]
        b = self.buffers
        b.input_ids[:n].copy_(input_ids[:n])
        b.positions[:n].copy_(positions[:n])
        b.slot_mapping[:n].copy_(md.slot_mapping[:n])
        if size > n:
            b.input_ids[n:size].zero_()
            b.positions[n:size].zero_()
            b.slot_mapping[n:size].fill_(self.pad_slot)
        for plan in g.plans.values():
            self.backend.replan(plan, md)
        g.replay()
        return g.output[:n]
