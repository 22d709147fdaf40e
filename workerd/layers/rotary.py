"""Rotary position embedding (NeoX / HF Llama layout: the two halves of each
head are rotated as a pair). Each forward gathers the RotaryTables of its
token positions, which in a paged batch are arbitrary (each request resumes
at its own num_computed_tokens), from a cache built once per dtype (cos and
sign-adjusted sin of every position up to MAX_CACHED_POSITIONS), and every
layer shares them: a layer then rotates its q and k heads in four
elementwise ops, with no per-layer casts or table copies.

Supports rope_type "default", "linear" and "llama3" (Llama 3.1 frequency
smoothing); other scalings are refused rather than silently mis-positioned.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from workerd.layers.direct_call import DirectCallModule


def rope_parameters(config) -> dict:
    """Normalise HF's two spellings: transformers 5 `rope_parameters` (theta inside)
    and transformers 4 `rope_theta` + optional `rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None)
                  or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict, max_pos: int) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings", max_pos)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band
    # between interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, params: dict, max_position_embeddings: int) -> torch.Tensor:
    base = params["rope_theta"]
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


# Positions below this many read their tables from a cache built once per
# dtype (vLLM's cos_sin_cache): two index_selects a step instead of a dozen
# ops. 32k positions of a 128-wide head in bfloat16 are 16 MiB; steps that
# reach further compute their tables as before.
MAX_CACHED_POSITIONS = 32768


class RotaryEmbedding(DirectCallModule):
    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int):
        super().__init__()
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        inv_freq = compute_inv_freq(head_dim, params, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Clamped both ways: a config claiming <= 0 positions caches none.
        self.cached_positions = max(0, min(max_position_embeddings, MAX_CACHED_POSITIONS))
        # (dtype, device) -> RotaryTables of positions [0, cached_positions).
        # Not buffers: derived, and no part of the checkpoint.
        self._cache: dict[tuple[torch.dtype, torch.device], RotaryTables] = {}

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] -> (cos, sin), each [n, head_dim] float32."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def tables(self, positions: torch.Tensor, max_seq_len: int,
               dtype: torch.dtype) -> RotaryTables:
        """The step's RotaryTables. max_seq_len bounds the positions from the
        host (every position is below it), so choosing the cache costs no
        device sync. Cached rows hold the values forward() computes for
        their positions: the same float32 products, cos and sin."""
        if max_seq_len > self.cached_positions:
            return rotary_tables(*self(positions), dtype)
        key = (dtype, self.inv_freq.device)
        cache = self._cache.get(key)
        if cache is None:
            every = torch.arange(self.cached_positions, device=self.inv_freq.device)
            cache = self._cache[key] = rotary_tables(*self(every), dtype)
        return RotaryTables(cache.cos.index_select(0, positions),
                            cache.signed_sin.index_select(0, positions))


class RotaryTables(NamedTuple):
    """One step's rotation, shared by all layers; [n, 1, head_dim] each, in the
    dtype of the activations they rotate."""

    cos: torch.Tensor
    # sin with its first half negated: rotate_half(x) * sin ==
    # swap_halves(x) * signed_sin exactly (negation is exact), one op fewer.
    signed_sin: torch.Tensor


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
    """cos/sin [n, head_dim] float32 (RotaryEmbedding's output) -> tables in
    `dtype`. Cast after computing in float32, as HF does, so values match."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return RotaryTables(cos.to(dtype).unsqueeze(1), signed.to(dtype).unsqueeze(1))


def apply_rotary_tables(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """x [n, heads, head_dim] (may be a strided view, e.g. q and k heads of a
    fused qkv output) -> a new rotated tensor, bitwise equal to HF's
    x * cos + rotate_half(x) * sin."""
    # roll by half a head swaps the halves: the same copy as cat of the two
    # slices, in one op instead of three.
    swapped = torch.roll(x, x.shape[-1] // 2, -1)
    out = x * tables.cos
    out += swapped.mul_(tables.signed_sin)
    return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, num_heads, head_dim]; cos/sin [n, head_dim]. One-off form of
    apply_rotary_tables (the model builds the tables once per step)."""
    return apply_rotary_tables(x, rotary_tables(cos, sin, x.dtype))
