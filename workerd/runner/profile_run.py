"""The profile run: the activation peak a CUDA rank's KV budget is measured around.

ModelRunner.profile_num_blocks hands it to kv_cache.cuda_kv_cache_budget,
which runs it and gives the KV cache what is left of the memory share.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from workerd.distributed.parallel_state import IntermediateTensors, ParallelState
from workerd.layers.attention.metadata import AttentionMetadata
from workerd.limits import WorkerLimits
from workerd.runner.kv_cache import allocate_kv_caches


def profile_run(model: Any, ps: ParallelState, limits: WorkerLimits, block_size: int,
                dtype: torch.dtype, device: torch.device) -> None:
    """One forward of max_num_batched_tokens tokens, and logits for a full
    batch of sampled rows (one per request, at most max_num_seqs).

    No pipeline traffic: non-first stages feed zeros instead of receiving,
    so each rank can profile on its own.
    """
    n = limits.max_num_batched_tokens
    num_blocks = math.ceil(n / block_size)
    dev = device
    caches = allocate_kv_caches(model, num_blocks, block_size, dtype, dev)
    md = AttentionMetadata(
        num_reqs=1,
        num_actual_tokens=n,
        slot_mapping=torch.arange(n, device=dev),
        query_start_loc=torch.tensor([0, n], device=dev),
        seq_lens=torch.tensor([n], device=dev),
        block_table=torch.arange(num_blocks, device=dev).unsqueeze(0),
        max_query_len=n,
        max_seq_len=n,
        block_size=block_size,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
    )
    input_ids, intermediate = torch.zeros(n, dtype=torch.int64, device=dev), None
    if not ps.is_first_pp_rank:
        zeros = torch.zeros(n, model.hidden_size, dtype=dtype, device=dev)
        input_ids, intermediate = None, IntermediateTensors(zeros, zeros.clone())
    positions = torch.arange(n, device=dev)
    with torch.inference_mode():
        out = model.forward(input_ids, positions, caches, md, intermediate)
        if ps.is_last_pp_rank:
            model.compute_logits(out[-min(n, limits.max_num_seqs) :])
    del caches, out
