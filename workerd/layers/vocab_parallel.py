"""Vocabulary-parallel embedding and LM head: the vocab rows are split across TP
ranks (padded up to a multiple of tp_size), so no rank holds the full
vocab x hidden matrix. The embedding all-reduces (each token's row lives on
exactly one rank); the LM head all-gathers the logit shards into the full
vocabulary and drops the padding columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workerd.distributed.parallel_state import ParallelState, tp_all_gather, tp_all_reduce
from workerd.layers.direct_call import DirectCallModule
from workerd.layers.linear import set_shard
from workerd.layers.packed_linear import Packable, linear


def pad_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(DirectCallModule):
    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState):
        super().__init__()
        self.ps = ps
        self.vocab_size = vocab_size
        self.num_embeddings_per_partition = pad_vocab(vocab_size, ps.tp_size) // ps.tp_size
        self.vocab_start = ps.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        # Zeros, not empty: padding rows (ids >= vocab_size) are never loaded.
        weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_partition, hidden_size), requires_grad=False
        )
        self.weight = set_shard(weight, 0, self.vocab_start, min(self.vocab_end, vocab_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight)
        out = out * in_shard.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out, self.ps)


class ParallelLMHead(Packable, VocabParallelEmbedding):
    """Same row split as the embedding, so tied checkpoints load into both the
    same way (and share the parameter when both live on one stage). Packed on
    CPU ranks like the linear layers; a tied head packs a copy, the embedding
    keeps the plain weight."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied through compute_logits, not forward")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] float32 on every TP rank."""
        logits = linear(hidden_states, self.weight, None, self.packed_weight)
        logits = tp_all_gather(logits, self.ps, dim=-1)
        return logits[:, : self.vocab_size].float()
