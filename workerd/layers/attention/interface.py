"""What an attention backend is: the methods every one has, the ones only
some have, and which those are, declared as data.

Every backend builds one plan per forward (build_plan) and attends every
layer with it (forward). Beyond that a backend may:

* rotate q and k inside its kernel (rotary_in_kernel: forward_rotary takes
  the un-rotated qkv projection and the step's rotary tables);
* replay decode steps as CUDA graphs (cuda_graph_decode: graph_decode_plan
  builds the plan a graph is captured with, replan points it at a later
  step's pages before each replay);
* attend within a sliding window, or soft-cap the attention logits
  (sliding_window, logits_soft_cap; all three backends declare both): the
  layer's AttentionLayerKind, handed to build_plan, says which window and
  cap a plan attends with. A model builds one plan per distinct kind per
  step (Gemma 2 alternates two) and hands each layer its kind's; a model
  that needs a capability its backend does not declare is refused at load
  instead of attending to the whole context. With a window no backend reads
  a block that lies wholly before every query's window: the controlplane may
  have freed it, and another request's K/V (or NaN) in it must not reach the
  output even masked (0 * NaN is NaN).

A backend states these in its class's `capabilities`; the optional methods
of one it does not declare raise NotImplementedError. Callers read the
declaration once, at load (the model when it is handed the backend, the
runner when it decides on graphs), and never ask the object what it has.
tests/workerd/layers/test_attention_capabilities.py holds each backend to
what it declares.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from workerd.layers.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend can do beyond build_plan and forward, or, from a model,
    what it needs of the one it attends through."""

    rotary_in_kernel: bool = False
    cuda_graph_decode: bool = False
    sliding_window: bool = False
    logits_soft_cap: bool = False

    def lacking(self, needed: AttentionCapabilities) -> list[str]:
        """The capabilities `needed` asks for that these do not include."""
        have = asdict(self)
        return [name for name, wanted in asdict(needed).items() if wanted and not have[name]]

    def names(self) -> list[str]:
        return [name for name, on in asdict(self).items() if on]


# Far beyond any model's window (Mistral's is 4,096, Gemma's 4,096 or 1,024),
# and small enough that positions minus it stay well inside int64 and float32.
MAX_SLIDING_WINDOW = 1 << 26


@dataclass(frozen=True)
class AttentionLayerKind:
    """How one layer attends, beyond causal: what its plan is built for.

    sliding_window W: a query at position p sees keys p - W < k <= p (W keys,
    its own included: transformers' sliding_window_overlay; FlashInfer's
    window_left is W - 1). logits_soft_cap c: scores become c * tanh(s / c)
    after the scale, before the mask (Gemma 2's attn_logit_softcapping).

    Built from a checkpoint's config, so its values are checked here, once:
    a window of 1..MAX_SLIDING_WINDOW tokens, a cap finite and > 0. (A
    config's window of 0 or a null cap mean "none": the model maps them to
    None before building the kind.)"""

    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def __post_init__(self) -> None:
        w, c = self.sliding_window, self.logits_soft_cap
        # bool is an int to Python; a window of True is a config error.
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)
                              or not 1 <= w <= MAX_SLIDING_WINDOW):
            raise ValueError(f"sliding_window must be an int in 1..{MAX_SLIDING_WINDOW} "
                             f"or None, not {w!r}")
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not math.isfinite(c) or c <= 0):
            raise ValueError(f"logits_soft_cap must be a finite number > 0 or None, not {c!r}")
        if c is not None:  # 50 and 50.0 are one kind, and the C kernel takes a float
            object.__setattr__(self, "logits_soft_cap", float(c))

    def needs(self) -> AttentionCapabilities:
        """The backend capabilities attending this way takes."""
        return AttentionCapabilities(sliding_window=self.sliding_window is not None,
                                     logits_soft_cap=self.logits_soft_cap is not None)


FULL_ATTENTION = AttentionLayerKind()


class AttentionBackend(ABC):
    """One worker's attention implementation (workerd/layers/attention/backend.py
    picks which)."""

    name: ClassVar[str]
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities()

    @abstractmethod
    def build_plan(self, md: AttentionMetadata, num_tokens: int,
                   kind: AttentionLayerKind = FULL_ATTENTION) -> Any:
        """What every layer of `kind` in one forward reuses (index tables,
        planned kernels). A kind whose window or cap the backend does not
        declare is a ValueError (the model checked at load)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, md: AttentionMetadata, scale: float,
                plan: Any) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads,
        head_dim], already rotated; writes k/v into the cache and returns
        [num_tokens, num_heads * head_dim]."""

    # ---- rotary_in_kernel ----------------------------------------------

    def forward_rotary(self, qkv: torch.Tensor, num_heads: int, rope,
                       kv_cache: torch.Tensor | None, md: AttentionMetadata, scale: float,
                       plan: Any) -> torch.Tensor | None:
        """forward over the un-rotated [num_tokens, heads + 2 kv_heads,
        head_dim] projection, rotating q and k (k on its way into the cache)
        with `rope`'s tables. None when this call's tensors are not ones the
        kernel takes: the caller then rotates them and calls forward."""
        raise self._undeclared("rotary_in_kernel")

    # ---- cuda_graph_decode ---------------------------------------------

    def graph_decode_plan(self, md: AttentionMetadata, pad_block: int, buffers, *,
                          num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                          dtype: torch.dtype, kv_dtype: torch.dtype, page_size: int,
                          kind: AttentionLayerKind = FULL_ATTENTION) -> Any:
        """The plan a decode graph of md.num_reqs rows is captured with for
        the layers of `kind`, its page tables in `buffers`
        (workerd/runner/cuda_graphs.py's GraphBuffers; one set per kind, since
        a window trims each request's pages)."""
        raise self._undeclared("cuda_graph_decode")

    def replan(self, plan: Any, md: AttentionMetadata) -> None:
        """Before a replay, outside the graph: `plan` (graph_decode_plan's)
        re-pointed at md's decodes."""
        raise self._undeclared("cuda_graph_decode")

    def _check_kind(self, kind: AttentionLayerKind) -> None:
        """build_plan's refusal of a kind this backend does not declare."""
        lacking = self.capabilities.lacking(kind.needs())
        if lacking:
            raise ValueError(f"the {self.name!r} attention backend does not declare "
                             f"{', '.join(lacking)}, which {kind} needs")

    def _undeclared(self, capability: str) -> NotImplementedError:
        return NotImplementedError(
            f"the {self.name!r} attention backend does not declare {capability}")


def check_capabilities(backend: AttentionBackend, needed: AttentionCapabilities,
                       model: str) -> None:
    """At load: ValueError, naming the backend and what it lacks, when `model`
    needs a capability `backend` does not declare."""
    lacking = backend.capabilities.lacking(needed)
    if lacking:
        declared = ", ".join(backend.capabilities.names()) or "none"
        raise ValueError(
            f"{model} needs attention with {', '.join(lacking)}, which the "
            f"{backend.name!r} attention backend does not declare (it declares: {declared})")
