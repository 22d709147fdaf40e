"""A stand-in `flashinfer` module for CPU tests of the FlashInfer backend's
wiring: the two paged-KV wrappers with the 0.6 plan/run calling convention
the backend uses, computing attention naively from exactly what they were
planned with (page tables, causal, scale, dtypes, window_left,
logits_soft_cap). Like a kernel it reads every page it is handed, whole: a
NaN in a page the backend should have left out reaches the output. What it
proves is that the backend hands FlashInfer a correct problem; that
FlashInfer solves it is the gpu-marked test's job."""

from __future__ import annotations

import types

import torch


def _attend(q, k_cache, v_cache, qo_indptr, kv_indptr, indices, last_page_len, causal, scale,
            window_left, soft_cap):
    """q [nnz, Hq, D]; caches NHD [pages, page_size, Hkv, D]. FlashInfer's
    semantics: queries aligned to the end of the pages given, key j visible
    to the query at pos when j >= pos - window_left (window_left >= 0), and
    scores capped as soft_cap * tanh(s / soft_cap) (soft_cap > 0)."""
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.empty_like(q)
    for i in range(len(kv_indptr) - 1):
        pages = indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(last_page_len[i])
        rep = q.shape[1] // num_kv_heads
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qs = q[qo_indptr[i]:qo_indptr[i + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        pos = kv_len - qs.shape[0] + torch.arange(qs.shape[0])  # aligned to the end
        j = torch.arange(kv_len)[None, :]
        if causal:
            scores.masked_fill_(j > pos[:, None], float("-inf"))
        if window_left >= 0:
            scores.masked_fill_(j < pos[:, None] - window_left, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        out[qo_indptr[i]:qo_indptr[i + 1]] = o.to(q.dtype)
    return out


class _Wrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_tensor_cores=False):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.plans: list[dict] = []
        self.runs = 0

    def run(self, q, paged_kv_cache):
        p = self.plans[-1]
        k_cache, v_cache = paged_kv_cache
        assert q.is_contiguous() and q.dtype == p["q_data_type"]
        assert k_cache.dtype == v_cache.dtype == p["kv_data_type"]
        assert q.shape[1:] == (p["num_qo_heads"], p["head_dim"])
        assert k_cache.shape[1:] == (p["page_size"], p["num_kv_heads"], p["head_dim"])
        assert q.shape[0] == int(p["qo_indptr"][-1])
        self.runs += 1
        return _attend(q, k_cache, v_cache, p["qo_indptr"], p["kv_indptr"], p["indices"],
                       p["last_page_len"], p["causal"], p["sm_scale"], p["window_left"],
                       p["logits_soft_cap"])


def _kind_args(window_left, logits_soft_cap) -> dict:
    """FlashInfer's types for the two: an int >= -1, a float >= 0 (None is 0)."""
    soft_cap = 0.0 if logits_soft_cap is None else logits_soft_cap
    assert isinstance(window_left, int) and window_left >= -1, window_left
    assert isinstance(soft_cap, float) and soft_cap >= 0, soft_cap
    return dict(window_left=window_left, logits_soft_cap=soft_cap)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False,
             pos_encoding_mode="NONE", sm_scale=None, window_left=-1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None):
        assert pos_encoding_mode == "NONE"  # rotary is applied before attention
        self.plans.append(dict(
            qo_indptr=qo_indptr, kv_indptr=paged_kv_indptr, indices=paged_kv_indices,
            last_page_len=paged_kv_last_page_len, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim_qk, page_size=page_size,
            causal=causal, sm_scale=sm_scale, q_data_type=q_data_type,
            kv_data_type=kv_data_type, **_kind_args(window_left, logits_soft_cap)))


# Set by tests' stand-in CUDA graph while it runs a captured forward: FlashInfer
# plans on the host, so a plan() there would not be part of any replay.
CAPTURING = False


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        super().__init__(float_workspace_buffer, kv_layout, use_tensor_cores)
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:  # FlashInfer's own checks of the buffers
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                            paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, pos_encoding_mode="NONE", sm_scale=None, window_left=-1,
             logits_soft_cap=None, q_data_type="float16", kv_data_type=None):
        assert pos_encoding_mode == "NONE"
        if self.use_cuda_graph:
            assert not CAPTURING, "plan() inside a captured region"
            # As FlashInfer in CUDA-graph mode: a fixed batch size, and the
            # page tables copied into the buffers the captured kernels read;
            # run() below reads them from there, not from these arguments.
            indptr_buf, indices_buf, last_buf = self.buffers
            assert len(last_page_len) == len(last_buf), "batch size fixed at construction"
            assert len(indices) <= len(indices_buf), "indices exceed the buffer"
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last_page_len)
            indptr, indices, last_page_len = indptr_buf, indices_buf, last_buf
        self.plans.append(dict(
            qo_indptr=torch.arange(len(indptr), dtype=torch.int32), kv_indptr=indptr,
            indices=indices, last_page_len=last_page_len, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, causal=False,
            sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type,
            **_kind_args(window_left, logits_soft_cap)))


def module() -> types.ModuleType:
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    fake.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    return fake
