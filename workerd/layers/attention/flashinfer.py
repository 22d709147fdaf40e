"""Paged attention through FlashInfer's kernels (`--attention-backend flashinfer`).

Written against flashinfer-python 0.6.x (the API of the repository's 0.6.18
tag): BatchPrefillWithPagedKVCacheWrapper / BatchDecodeWithPagedKVCacheWrapper,
plan(...) with keyword options (0.6 deprecates passing them positionally),
run(q, paged_kv_cache). NOT YET RUN ON A GPU: tests/workerd/layers/
test_flashinfer_backend.py's gpu-marked parity test against the torch backend
is what proves it.

Per step (one plan object per forward and AttentionLayerKind, every layer of
that kind reuses it):
* a step whose every request decodes one token runs the decode wrapper, any
  multi-token query (prefill chunk) makes it the prefill wrapper, causal;
  FlashInfer aligns each request's queries to the end of its context, which
  is kvloom's layout (a request's queries are its last query_len positions);
* the wrapper is planned once, on the first layer that attends, per layer
  shape (heads, KV heads, head_dim, scale, dtypes), from the page tables of
  flashinfer_index.paged_kv_index;
* the kind's window and soft cap go to plan() as window_left (W - 1, -1 for
  none) and logits_soft_cap (0.0 for none), and with a window the page
  tables start at each request's first needed page (pages wholly before
  the window may have been freed and are never handed to the kernels);
  each kind has wrappers of its own, since a step plans every kind before
  its layers run them in turn (Gemma 2 alternates two), while the float
  workspace is shared: the kinds' kernels run one after another on one
  stream;
* each layer writes its new K/V with torch_sdpa.write_kv_cache and runs.

The cache is the torch backend's [2, num_blocks, block_size, num_kv_heads,
head_dim]: cache[0] and cache[1] are each a contiguous FlashInfer "NHD" page
pool [num_pages, page_size, num_kv_heads, head_dim], passed as the (k, v)
tuple the wrappers accept, so both backends share one layout and allocator.

A forward without a cache (kv_caches empty: the model run before
init_kv_cache) runs the torch path, which attends to the batch's own keys;
FlashInfer's paged kernels need pages. The memory profile is not such a
forward: it runs with a cache of its own, so through FlashInfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workerd.layers.attention.flashinfer_index import pad_decode_index, paged_kv_index
from workerd.layers.attention.interface import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionCapabilities,
    AttentionLayerKind,
)
from workerd.layers.attention.metadata import AttentionMetadata
from workerd.layers.attention.torch_sdpa import build_plan, paged_attention, write_kv_cache

# FlashInfer's recommended float workspace (split-KV partial results); one
# buffer shared by every wrapper: a step's kernels run one at a time, on one
# stream, and none needs another's partial results once it has returned.
_WORKSPACE_BYTES = 128 << 20
# vLLM's rule for the decode kernel: tensor cores pay off once enough query
# heads share a KV head.
_TENSOR_CORE_GQA_GROUP = 4


class FlashInferPlan:
    """One forward's page tables for the layers of one kind, plus the
    wrapper planned for each layer shape (from the kind's own wrappers)."""

    def __init__(self, md: AttentionMetadata, num_tokens: int,
                 kind: AttentionLayerKind = FULL_ATTENTION,
                 wrappers: KindWrappers | None = None) -> None:
        self.md = md
        self.num_tokens = num_tokens
        self.kind = kind
        self.kind_wrappers = wrappers
        self.decode_only = all(q == 1 for q in md.query_lens_cpu[: md.num_reqs])
        self.wrappers: dict[tuple, object] = {}
        self.torch_plan = None  # only a forward without a cache builds it
        # Set on the plan a CUDA graph was captured with (graph_decode_plan).
        self.graph: GraphDecode | None = None


@dataclass
class KindWrappers:
    """The eager wrappers of one kind: each holds the plan of the last step
    that planned it, so two kinds in one step cannot share one."""

    prefill: object
    decode: dict[bool, object]  # by use_tensor_cores


def _kind_args(kind: AttentionLayerKind) -> dict:
    """plan()'s keywords for a kind (flashinfer-python 0.6: window_left is
    the keys left of the query's own, -1 for none; a cap of 0.0 is none)."""
    w, cap = kind.sliding_window, kind.logits_soft_cap
    return dict(window_left=-1 if w is None else w - 1,
                logits_soft_cap=0.0 if cap is None else cap)


@dataclass
class GraphDecode:
    """What re-planning a captured decode graph's wrapper needs."""

    wrapper: object
    batch_size: int
    pad_block: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    common: dict


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    # Rotary stays outside (pos_encoding_mode="NONE"): the model's tables,
    # the same numbers every backend attends with.
    capabilities = AttentionCapabilities(cuda_graph_decode=True, sliding_window=True,
                                         logits_soft_cap=True)

    def __init__(self, device: torch.device) -> None:
        # "Must be initialized to 0 for its first use" (FlashInfer's docs).
        self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[AttentionLayerKind, KindWrappers] = {}
        # Built now, not at the first step: each allocates its own integer
        # workspace, which the memory profile (run next) must see. Other
        # kinds' are built when first planned, which the profile's forward
        # (planning every kind its model has) also counts.
        self._kind_wrappers(FULL_ATTENTION)

    def _kind_wrappers(self, kind: AttentionLayerKind) -> KindWrappers:
        wrappers = self._wrappers.get(kind)
        if wrappers is None:
            import flashinfer  # only here: the package is optional and CUDA-only

            wrappers = self._wrappers[kind] = KindWrappers(
                prefill=flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD"),
                decode={tensor_cores: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=tensor_cores)
                    for tensor_cores in (False, True)})
        return wrappers

    def build_plan(self, md: AttentionMetadata, num_tokens: int,
                   kind: AttentionLayerKind = FULL_ATTENTION) -> FlashInferPlan:
        self._check_kind(kind)
        return FlashInferPlan(md, num_tokens, kind, self._kind_wrappers(kind))

    # ---- CUDA graphs (workerd/runner/cuda_graphs.py) -------------------------------

    def graph_decode_plan(
        self, md: AttentionMetadata, pad_block: int, buffers, *, num_heads: int,
        num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype,
        kv_dtype: torch.dtype, page_size: int, kind: AttentionLayerKind = FULL_ATTENTION,
    ) -> FlashInferPlan:
        """The plan a decode graph of md.num_reqs rows is captured with for
        the layers of `kind`: its own FlashInfer decode wrapper in CUDA-graph
        mode, whose page tables live in `buffers` (indptr, indices,
        last_page_len tensors shared by every captured size, one graph
        running at a time, but not by two kinds: a window trims each
        request's pages) so that replan() can point a replay at another
        step's pages without re-capturing. Planned here for md (every row
        padding at capture time)."""
        import flashinfer

        self._check_kind(kind)
        batch_size = md.num_reqs
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=num_heads // num_kv_heads > _TENSOR_CORE_GQA_GROUP,
            paged_kv_indptr_buffer=buffers.indptr[: batch_size + 1],
            paged_kv_indices_buffer=buffers.indices,
            paged_kv_last_page_len_buffer=buffers.last_page_len[:batch_size],
        )
        plan = FlashInferPlan(md, batch_size, kind)
        plan.wrappers[(num_heads, num_kv_heads, head_dim, scale, dtype, kv_dtype)] = wrapper
        plan.graph = GraphDecode(
            wrapper, batch_size, pad_block, num_heads, num_kv_heads, head_dim, page_size,
            dict(sm_scale=scale, q_data_type=dtype, kv_data_type=kv_dtype, **_kind_args(kind)))
        self.replan(plan, md)
        return plan

    def replan(self, plan: FlashInferPlan, md: AttentionMetadata) -> None:
        """Before a replay, outside the graph: the captured wrapper planned for
        md's decodes (at most the graph's batch size), padded to it."""
        g = plan.graph
        idx = pad_decode_index(paged_kv_index(md, plan.kind.sliding_window), g.batch_size,
                               g.pad_block)
        _plan_decode(g.wrapper, idx, g.num_heads, g.num_kv_heads, g.head_dim, g.page_size,
                     g.common)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        md: AttentionMetadata,
        scale: float,
        plan: FlashInferPlan,
    ) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim]; k/v [num_tokens, num_kv_heads,
        head_dim]. Returns [num_tokens, num_heads * head_dim]; padding tokens
        past num_actual_tokens get zeros, as in the torch backend."""
        num_tokens, num_heads, head_dim = q.shape
        if md.num_reqs == 0:
            return q.new_zeros(num_tokens, num_heads * head_dim)
        if kv_cache is None or kv_cache.numel() == 0:
            if plan.torch_plan is None:
                plan.torch_plan = build_plan(md, num_tokens, kind=plan.kind)
            return paged_attention(q, k, v, None, md, scale, plan.torch_plan)
        n = md.num_actual_tokens
        write_kv_cache(k, v, kv_cache, md.slot_mapping, n)
        wrapper = self._planned(plan, num_heads, k.shape[1], head_dim, kv_cache, scale, q.dtype)
        # q is a strided view of the fused qkv output; the kernels get a
        # dense one rather than relying on every version taking strides.
        out = wrapper.run(q[:n].contiguous(), (kv_cache[0], kv_cache[1]))
        out = out.reshape(n, num_heads * head_dim)
        if n == num_tokens:
            return out
        padded = q.new_zeros(num_tokens, num_heads * head_dim)
        padded[:n] = out
        return padded

    def _planned(self, plan, num_heads, num_kv_heads, head_dim, kv_cache, scale, dtype):
        key = (num_heads, num_kv_heads, head_dim, scale, dtype, kv_cache.dtype)
        wrapper = plan.wrappers.get(key)
        if wrapper is not None:
            return wrapper
        if plan.wrappers:
            # A second layer shape within one kind: the kind's wrapper would
            # be re-planned under the first shape's feet (layers of other
            # kinds have plans and wrappers of their own).
            raise NotImplementedError("FlashInfer backend: one attention shape per layer kind")
        idx = paged_kv_index(plan.md, plan.kind.sliding_window)
        page_size = kv_cache.shape[2]
        common = dict(sm_scale=scale, q_data_type=dtype, kv_data_type=kv_cache.dtype,
                      **_kind_args(plan.kind))
        if plan.decode_only:
            wrapper = plan.kind_wrappers.decode[num_heads // num_kv_heads > _TENSOR_CORE_GQA_GROUP]
            _plan_decode(wrapper, idx, num_heads, num_kv_heads, head_dim, page_size, common)
        else:
            wrapper = plan.kind_wrappers.prefill
            wrapper.plan(
                idx.qo_indptr, idx.paged_kv_indptr, idx.paged_kv_indices,
                idx.paged_kv_last_page_len, num_heads, num_kv_heads, head_dim, page_size,
                causal=True, pos_encoding_mode="NONE", **common,
            )
        plan.wrappers[key] = wrapper
        return wrapper


def _plan_decode(wrapper, idx, num_heads, num_kv_heads, head_dim, page_size, common) -> None:
    """A decode wrapper planned for idx's page tables (eager or CUDA-graph mode alike)."""
    wrapper.plan(
        idx.paged_kv_indptr, idx.paged_kv_indices, idx.paged_kv_last_page_len,
        num_heads, num_kv_heads, head_dim, page_size,
        pos_encoding_mode="NONE", **common,
    )
