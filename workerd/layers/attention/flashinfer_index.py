"""AttentionMetadata -> the CSR page tables FlashInfer's paged-KV wrappers plan
with. Pure and free of flashinfer imports, so it is tested on CPU.

FlashInfer describes a batch's cache as (its "page table layout" tutorial;
flashinfer-python 0.6 API):
  qo_indptr [num_reqs + 1]: request i's queries are q[qo_indptr[i]:qo_indptr[i+1]];
  paged_kv_indptr [num_reqs + 1]: request i's pages are
      paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i+1]];
  paged_kv_indices [paged_kv_indptr[-1]]: block ids, in context order;
  paged_kv_last_page_len [num_reqs]: tokens used in each request's last page,
      in 1..page_size.
kvloom's block = FlashInfer's page, so these come straight from the block
table (the first ceil(seq_len / block_size) entries of each row) and seq_lens
(which already count this step's tokens: their K/V is written before the
kernels run).

With a sliding window W a request's pages start at the one holding its
earliest query's first visible key (position q0 - W + 1): pages wholly
before it may have been freed and reused, and a kernel handed a page may
read all of it. FlashInfer aligns queries to the end of the pages it is
given, so dropping whole leading pages shifts every position alike; the
causal mask and window_left, both relative, are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workerd.layers.attention.metadata import AttentionMetadata


@dataclass
class PagedKVIndex:
    # int32 on the CPU: plan() reads them on the host to schedule the work.
    qo_indptr: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    # int32 on the block table's device: only the kernels read it.
    paged_kv_indices: torch.Tensor


def paged_kv_index(md: AttentionMetadata, window: int | None = None) -> PagedKVIndex:
    """Built from the metadata's Python lists, so no device sync; the block
    ids are one gather from the device block table. window: the layers'
    sliding window (None: the whole context)."""
    n, bs = md.num_reqs, md.block_size
    q_lens, seq_lens = md.query_lens_cpu[:n], md.seq_lens_cpu[:n]
    qo_indptr, kv_indptr, last_page_len = [0], [0], []
    rows, cols = [], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if not 1 <= q_len <= seq_len:
            # FlashInfer's causal mask aligns queries to the context's end; a
            # query longer than its context has nothing to align to.
            raise ValueError(f"request {i}: query length {q_len} not in 1..seq_len {seq_len}")
        end = -(-seq_len // bs)
        first = 0 if window is None else max(seq_len - q_len - window + 1, 0) // bs
        qo_indptr.append(qo_indptr[-1] + q_len)
        kv_indptr.append(kv_indptr[-1] + end - first)
        last_page_len.append(seq_len - (end - 1) * bs)
        rows.extend([i] * (end - first))
        cols.extend(range(first, end))
    device = md.block_table.device
    if cols and max(cols) >= md.block_table.shape[1]:
        raise ValueError(
            f"block table has {md.block_table.shape[1]} columns but a context needs "
            f"{max(cols) + 1} blocks of {bs}"
        )
    rows_t = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    cols_t = torch.tensor(cols, dtype=torch.int64).to(device, non_blocking=True)
    return PagedKVIndex(
        qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32),
        paged_kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32),
        paged_kv_last_page_len=torch.tensor(last_page_len, dtype=torch.int32),
        paged_kv_indices=md.block_table[rows_t, cols_t].to(torch.int32),
    )


def pad_decode_index(idx: PagedKVIndex, batch_size: int, pad_block: int) -> PagedKVIndex:
    """A decode batch's page tables padded to batch_size rows, for a CUDA
    graph captured at that size: every padding row is a one-token context in
    pad_block (a block no request owns; the padding tokens' K/V is written
    there too), so the kernels see batch_size well-formed requests and the
    real rows' results do not depend on the padding."""
    num_reqs = len(idx.paged_kv_last_page_len)
    pad = batch_size - num_reqs
    if pad < 0:
        raise ValueError(f"{num_reqs} requests do not fit a graph of batch size {batch_size}")
    if pad == 0:
        return idx
    last = int(idx.paged_kv_indptr[-1])
    device = idx.paged_kv_indices.device
    return PagedKVIndex(
        qo_indptr=torch.arange(batch_size + 1, dtype=torch.int32),
        paged_kv_indptr=torch.cat([
            idx.paged_kv_indptr,
            torch.arange(last + 1, last + pad + 1, dtype=torch.int32)]),
        paged_kv_last_page_len=torch.cat([
            idx.paged_kv_last_page_len, torch.ones(pad, dtype=torch.int32)]),
        paged_kv_indices=torch.cat([
            idx.paged_kv_indices,
            torch.full((pad,), pad_block, dtype=torch.int32, device=device)]),
    )
