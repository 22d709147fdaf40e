"""Attention metadata of one forward pass: where each new token's K/V goes and
which cached blocks every request attends to.

Built by the model runner from the persistent batch, read by every attention
layer. Tokens are laid out request by request (each request's scheduled
tokens contiguous, positions increasing); request i's queries are the last
(query_start_loc[i+1] - query_start_loc[i]) positions of its seq_lens[i]
context tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_actual_tokens: int
    # [num_tokens] int64: flat slot (block_id * block_size + offset) that
    # receives the K/V of each scheduled token.
    slot_mapping: torch.Tensor
    # [num_reqs + 1] int64: cumulative query lengths; request i owns tokens
    # query_start_loc[i]:query_start_loc[i+1].
    query_start_loc: torch.Tensor
    # [num_reqs] int64: context length after this step (computed + scheduled).
    seq_lens: torch.Tensor
    # [num_reqs, max_blocks] int64: block ids of each request, padded with 0.
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Python copies of query lens / seq lens, so layers need no device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
