"""SlotProbeModel: a stand-in model for tests that run thousands of steps
through a real worker (kvloom_testing/inprocess.py)."""

from __future__ import annotations

import torch


class SlotProbeModel:
    """A stand-in model for tests that run thousands of steps through a real worker.

    Its KV cache is one float per slot, and forward writes each input token id
    into its slot through the runner's real slot mapping, so a test can read
    back what attention would see. Every row predicts PROBE_TOKEN. It holds no
    request state: that is all the real ModelRunner's.
    """

    PROBE_TOKEN = 7
    hidden_size = 1
    num_local_layers = 1
    vocab_size = 64

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size)

    def parameters(self):
        return iter(())

    def modules(self):  # no layers, so no packed weights (ModelRunner.weights_bytes)
        return iter(())

    def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate=None):
        cache = kv_caches[0]
        cache.view(-1)[attn_metadata.slot_mapping] = input_ids.to(cache.dtype)
        return input_ids.to(torch.float32).unsqueeze(-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.full((hidden.shape[0], self.vocab_size), -1e9)
        logits[:, self.PROBE_TOKEN] = 0.0
        return logits
