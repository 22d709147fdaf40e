"""Rotary position embedding. Each forward gathers the RotaryTables of its
token positions, which in a paged batch are arbitrary (each request resumes
at its own num_computed_tokens), from a cache built once per dtype (cos and
sign-adjusted sin of every position up to MAX_CACHED_POSITIONS), and every
layer sharing the embedding shares them: a layer then rotates its q and k
heads in four elementwise ops, with no per-layer casts or table copies.

Variants, each HF's (workerd/layers/rope_scaling.py has the frequencies):
* style "neox" (HF Llama / Phi-3 layout): the two halves of the rotated dims
  form the pairs; "gptj" (HF GLM / GLM-4): adjacent dims (2i, 2i+1) do.
* partial rotary (Phi-3/Phi-4-mini 0.75, GLM 0.5): only the first
  rotary_dim dims of each head rotate, the rest pass through.
* attention_scaling (yarn's mscale, longrope's) multiplied into cos and sin.
* longrope: short factors below original_max_position_embeddings, long ones
  from it on (see RotaryEmbedding for how that compares with HF and vLLM).
A model with per-layer-type rope (Gemma 3) builds one RotaryEmbedding per
distinct params dict (rope_scaling.rope_parameters_by_layer_type).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from workerd.layers.direct_call import DirectCallModule
from workerd.layers.rope_scaling import normalize_rope_parameters, rope_frequencies, rotary_dim_of

STYLES = ("neox", "gptj")


def rope_parameters(config) -> dict:
    """Normalise HF's two spellings: transformers 5 `rope_parameters` (theta inside)
    and transformers 4 `rope_theta` + optional `rope_scaling`. Takes a
    ModelConfig or a transformers config (whose LlamaConfig has no rope_theta
    attribute, hence getattr); new code passes plain values to
    rope_scaling.normalize_rope_parameters instead."""
    return normalize_rope_parameters(getattr(config, "rope_parameters", None),
                                     rope_scaling=getattr(config, "rope_scaling", None),
                                     rope_theta=getattr(config, "rope_theta", None))


def compute_inv_freq(head_dim: int, params: dict, max_position_embeddings: int) -> torch.Tensor:
    """HF's inv_freq for a head of `head_dim` (sized by partial_rotary_factor)."""
    dim = rotary_dim_of(head_dim, params)
    return rope_frequencies(dim, params, max_position_embeddings).inv_freq


# Positions below this many read their tables from a cache built once per
# dtype (vLLM's cos_sin_cache): two index_selects a step instead of a dozen
# ops. 32k positions of a 128-wide head in bfloat16 are 16 MiB; steps that
# reach further compute their tables as before.
MAX_CACHED_POSITIONS = 32768


class RotaryEmbedding(DirectCallModule):
    """One rope: frequencies, rotated width, pairing style.

    longrope: HF (dynamic_rope_update) picks long factors for a whole forward
    when its sequence (max position + 1) exceeds original_max_position_embeddings
    k, and keeps what it cached before; vLLM/SGLang switch the whole batch
    to long when any position > k. Here each position has one table: short
    below k, long from k on. That is HF's rotation of every token HF decodes
    one at a time and of every sequence of at most k tokens, exactly; it
    differs only for positions < k sharing a forward with positions >= k (a
    prompt longer than k prefilled at once: HF rotates all of it long). In
    exchange a token's rotation never depends on which requests share its
    step or how its prompt was chunked. Across k, q.k is then not a function
    of the relative position alone; neither is it in HF or vLLM once keys
    cached short meet queries rotated long."""

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int, *,
                 rotary_dim: int | None = None, style: str = "neox"):
        super().__init__()
        if style not in STYLES:
            raise ValueError(f"rotary style must be one of {STYLES}, got {style!r}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(head_dim, params, rotary_dim)
        self.style = style
        freqs = rope_frequencies(self.rotary_dim, params, max_position_embeddings)
        self.attention_scaling = freqs.attention_scaling
        self.register_buffer("inv_freq", freqs.inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", freqs.long_inv_freq, persistent=False)
        self.long_from = freqs.long_from
        # The tables' rotary_dim: None when the whole head rotates.
        self._tables_rotary_dim = None if self.rotary_dim == head_dim else self.rotary_dim
        # Clamped both ways: a config claiming <= 0 positions caches none.
        self.cached_positions = max(0, min(max_position_embeddings, MAX_CACHED_POSITIONS))
        # (dtype, device) -> RotaryTables of positions [0, cached_positions).
        # Not buffers: derived, and no part of the checkpoint.
        self._cache: dict[tuple[torch.dtype, torch.device], RotaryTables] = {}

    @property
    def full_neox(self) -> bool:
        """Full-width NeoX tables of plain cos/sin: the only ones the cpu C
        kernel is asked to rotate with (forward_rotary)."""
        return (self.style == "neox" and self.rotary_dim == self.head_dim
                and self.attention_scaling == 1.0)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] -> (cos, sin), each [n, rotary_dim] float32: what HF's
        rotary embedding returns before its cast (cat(freqs, freqs), times
        attention_scaling), in either style."""
        inv_freq = self.inv_freq.float()[None, :]
        if self.long_inv_freq is not None:
            long = (positions >= self.long_from)[:, None]
            inv_freq = torch.where(long, self.long_inv_freq.float()[None, :], inv_freq)
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # x * 1.0 is exact: skipping it changes nothing
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin

    def tables(self, positions: torch.Tensor, max_seq_len: int,
               dtype: torch.dtype) -> RotaryTables:
        """The step's RotaryTables. max_seq_len bounds the positions from the
        host (every position is below it), so choosing the cache costs no
        device sync. Cached rows hold the values forward() computes for
        their positions: the same float32 products, cos and sin."""
        if max_seq_len > self.cached_positions:
            return self._tables_of(*self(positions), dtype)
        key = (dtype, self.inv_freq.device)
        cache = self._cache.get(key)
        if cache is None:
            every = torch.arange(self.cached_positions, device=self.inv_freq.device)
            cache = self._cache[key] = self._tables_of(*self(every), dtype)
        return RotaryTables(cache.cos.index_select(0, positions),
                            cache.signed_sin.index_select(0, positions),
                            cache.rotary_dim, cache.style)

    def _tables_of(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        return rotary_tables(cos, sin, dtype, style=self.style, rotary_dim=self._tables_rotary_dim)


class RotaryTables(NamedTuple):
    """One step's rotation, shared by the layers of one rope, in the dtype of
    the activations they rotate.

    neox: cos / signed_sin [n, 1, rotated width]; for the whole head these are
    what the cpu C kernel reads (workerd/kernels), so their layout is fixed.
    gptj: [n, 1, rotated width / 2, 2], matching the head viewed as pairs
    (a shape the C kernel's (n, 1, head_dim) check refuses)."""

    cos: torch.Tensor
    # sin with the first member of each pair negated: rotate_half(x) * sin ==
    # swap_pairs(x) * signed_sin exactly (negation is exact), one op fewer.
    signed_sin: torch.Tensor
    # None: the whole head rotates; else the leading dims that do.
    rotary_dim: int | None = None
    style: str = "neox"


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, *,
                  style: str = "neox", rotary_dim: int | None = None) -> RotaryTables:
    """cos/sin [n, width] float32 (RotaryEmbedding's output) -> tables in
    `dtype`. Cast after computing in float32, as HF does, so values match.
    rotary_dim: None when `width` is the whole head."""
    half = sin.shape[-1] // 2
    if style == "neox":
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return RotaryTables(cos.to(dtype).unsqueeze(1), signed.to(dtype).unsqueeze(1),
                            rotary_dim, style)
    # HF GLM repeat_interleaves the first half (one value per frequency) over
    # each pair: pair i is (x[2i], x[2i+1]) rotated by frequency i.
    c, s = cos[:, :half], sin[:, :half]
    pair_cos = torch.stack((c, c), dim=-1)
    pair_sin = torch.stack((-s, s), dim=-1)
    return RotaryTables(pair_cos.to(dtype).unsqueeze(1), pair_sin.to(dtype).unsqueeze(1),
                        rotary_dim, style)


def apply_rotary_tables(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """x [n, heads, head_dim] (may be a strided view, e.g. q and k heads of a
    fused qkv output) -> a new rotated tensor, bitwise equal to HF's
    x * cos + rotate_half(x) * sin (on the rotated dims; the rest copied)."""
    if tables.rotary_dim is None and tables.style == "neox":
        # The hot path. roll by half a head swaps the halves: the same copy
        # as cat of the two slices, in one op instead of three.
        swapped = torch.roll(x, x.shape[-1] // 2, -1)
        out = x * tables.cos
        out += swapped.mul_(tables.signed_sin)
        return out
    return _apply_variant(x, tables)


def _apply_variant(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    rot = x if tables.rotary_dim is None else x[..., : tables.rotary_dim]
    if tables.style == "neox":
        swapped = torch.roll(rot, rot.shape[-1] // 2, -1)
        out = rot * tables.cos
        out += swapped.mul_(tables.signed_sin)
    else:
        # The head as pairs [..., width / 2, 2]; flip swaps each pair's members.
        pairs = rot.unflatten(-1, (rot.shape[-1] // 2, 2))
        out = pairs * tables.cos
        out += pairs.flip(-1).mul_(tables.signed_sin)
        out = out.flatten(-2)
    if tables.rotary_dim is None:
        return out
    return torch.cat((out, x[..., tables.rotary_dim:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, num_heads, head_dim]; cos/sin [n, head_dim]. One-off form of
    apply_rotary_tables for full-width NeoX (the model builds the tables
    once per step)."""
    return apply_rotary_tables(x, rotary_tables(cos, sin, x.dtype))
