"""StepInputs: what ModelRunner.prepare_inputs lays out for one step's
forward (input ids, positions, attention metadata) and which rows of its
hidden states are sampled or scored for prompt logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workerd.layers.attention.metadata import AttentionMetadata
from workerd.runner.input_batch import CachedRequestState
from workerd.sample.logprobs import PromptLogprobsTarget


@dataclass
class StepInputs:
    """Model inputs of one step, on the runner's device."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    # Rows of the hidden states whose logits are sampled: one per sampling
    # request, or 1 + its drafts for one that verifies drafts.
    logits_indices: torch.Tensor
    # Requests that sample this step, in logits_indices order.
    sample_states: list[CachedRequestState]
    # Hidden-state rows whose logits predict prompt_targets' tokens, in order;
    # empty unless a request asked for prompt logprobs.
    prompt_logits_indices: list[int] = field(default_factory=list)
    prompt_targets: list[PromptLogprobsTarget] = field(default_factory=list)
    # Drafts each of sample_states verifies (speculative decoding), and the
    # drafts themselves, concatenated; all zero / empty without drafts.
    num_draft_tokens: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)
    # (row_start, row_end, lora_id) runs of rows with an adapter
    # (runner/lora_step.py); empty without --enable-lora or adapters.
    lora_segments: list[tuple[int, int, int]] = field(default_factory=list)

