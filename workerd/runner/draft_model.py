"""Draft-model proposals on the output rank (--speculative-config draft_model).

After a step's tokens are in, the output rank runs a small model that shares
the target's tokenizer over each request that sampled and proposes K tokens
greedily; they travel back in the step's reply and the controlplane schedules
them as the request's drafts next step, where the target verifies them like
n-gram drafts (workerd/runner/spec_verify.py). Greedy drafts are a one-hot
proposal, so the rejection sampler keeps the output exactly the target's.

The draft model is Hugging Face's implementation of the checkpoint, with one
KV cache per request (transformers' DynamicCache) kept across steps: each
proposal feeds only the tokens the cache has not seen, after cropping what
it holds of drafts the target rejected. It runs request by request on the
output rank alone (it is small; the target's other ranks have nothing to
wait for): exact and simple, not fast (docs/spec_decode.md, "Draft models").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workerd.runner.input_batch import CachedRequestState


@dataclass
class _DraftCache:
    """What the draft model has seen of one request, and its KV."""

    cache: object
    # Tokens whose KV the cache holds, in order.
    fed: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device,
                 num_speculative_tokens: int) -> None:
        from transformers import AutoModelForCausalLM

        # The path came in LoadModel, over the network: weights from
        # safetensors only (never a pickled .bin), no code from the checkpoint.
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, use_safetensors=True, trust_remote_code=False,
            local_files_only=True)
        self.model = model.to(device).train(False)  # inference: no dropout
        self.device = device
        self.k = num_speculative_tokens
        self._caches: dict[str, _DraftCache] = {}

    def propose(self, states: list[CachedRequestState]) -> list[list[int]]:
        """K greedy drafts after each state's tokens (prompt + output)."""
        with torch.inference_mode():
            return [self._propose_one(state) for state in states]

    def _propose_one(self, state: CachedRequestState) -> list[int]:
        from transformers import DynamicCache

        tokens = state.all_token_ids
        entry = self._caches.get(state.req_id)
        if entry is None:
            entry = self._caches[state.req_id] = _DraftCache(DynamicCache())
        # Keep the longest prefix of what it saw that is still the request's
        # (rejected drafts and a recomputed history fall away).
        fed = entry.fed
        keep = 0
        limit = min(len(fed), len(tokens) - 1)  # feed at least one token
        while keep < limit and fed[keep] == tokens[keep]:
            keep += 1
        if keep < len(fed):
            # Negative: the tokens to drop (what every transformers version reads alike).
            entry.cache.crop(keep - len(fed))
            del fed[keep:]
        new = tokens[keep:]
        drafts: list[int] = []
        for _ in range(self.k):
            ids = torch.tensor([new], dtype=torch.int64, device=self.device)
            out = self.model(input_ids=ids, past_key_values=entry.cache, use_cache=True)
            fed.extend(new)
            token = int(out.logits[0, -1].argmax())
            drafts.append(token)
            new = [token]
        # The last draft was never fed: the cache ends one token short of it.
        return drafts

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self._caches.pop(req_id, None)

    def reset(self) -> None:
        self._caches = {}
