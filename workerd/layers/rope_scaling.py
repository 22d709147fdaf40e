"""Rope parameters and frequencies, from plain dicts and values: what
transformers' config standardisation (RotaryEmbeddingConfigMixin) and
ROPE_INIT_FUNCTIONS (transformers/modeling_rope_utils.py) compute, op for op
so the float32 frequencies are bitwise HF's.

Supported rope_type: default, linear, llama3, yarn, longrope. Others
(dynamic, proportional, ...) are refused by name rather than silently
mis-positioned. A checkpoint's config.json is untrusted input: a bad field is
named in a ValueError here, not found later as NaN logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvloom.common.model_config_fields import SUPPORTED_ROPE_TYPES

# transformers' RotaryEmbeddingConfigMixin.default_theta.
DEFAULT_ROPE_THETA = 10000.0
# Rope types whose tables depend on the pre-training context length; HF
# standardisation gives them original_max_position_embeddings.
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")


def normalize_rope_parameters(
    rope_parameters: dict | None,
    *,
    rope_scaling: dict | None = None,
    rope_theta: float | None = None,
    partial_rotary_factor: float | None = None,
    original_max_position_embeddings: int | None = None,
) -> dict:
    """One layer type's rope dict as HF standardises it: transformers 5's
    `rope_parameters` (theta inside) or transformers 4's `rope_scaling` plus
    top-level `rope_theta`; a top-level `partial_rotary_factor` (GLM) fills
    in; a top-level `original_max_position_embeddings` (Phi-3's config.json)
    wins over the dict's own, as HF gives it priority. The input is not
    modified."""
    params = dict(rope_parameters or rope_scaling or {})
    params.setdefault("rope_theta", rope_theta or DEFAULT_ROPE_THETA)
    params.setdefault("rope_type", params.get("type", "default"))
    if partial_rotary_factor is not None:
        params.setdefault("partial_rotary_factor", partial_rotary_factor)
    if original_max_position_embeddings is not None and params["rope_type"] in _NEEDS_ORIGINAL_MAX:
        params["original_max_position_embeddings"] = original_max_position_embeddings
    return params


def rope_parameters_by_layer_type(
    rope_parameters: dict | None,
    layer_types: Sequence[str],
    *,
    rope_scaling: dict | None = None,
    rope_theta: float | None = None,
    rope_local_base_freq: float | None = None,
    partial_rotary_factor: float | None = None,
    original_max_position_embeddings: int | None = None,
) -> dict[str, dict | None]:
    """Each distinct layer type -> its normalised rope dict (None: that layer
    type has no rope, as HF reads a None entry).

    * Nested `rope_parameters` (Gemma 3, OLMo 3: keyed by layer type; nested
      when any key is a layer type, HF's nested_rope_parameter_keys rule):
      every layer type must have an entry; a missing theta falls back to
      `rope_local_base_freq` for sliding_attention, else `rope_theta`.
    * Old-style Gemma 3 (`rope_local_base_freq` given, flat or no dict):
      full_attention gets the flat dict / rope_scaling with `rope_theta`,
      sliding_attention plain default rope at `rope_local_base_freq`
      (Gemma3TextConfig.convert_rope_params_to_dict).
    * Otherwise every layer type shares the one flat dict.
    The caller passes the family's defaults (Gemma 3: rope_theta 1e6,
    rope_local_base_freq 1e4) where config.json leaves them out."""
    kinds = list(dict.fromkeys(layer_types))
    extra = {"partial_rotary_factor": partial_rotary_factor,
             "original_max_position_embeddings": original_max_position_embeddings}
    nested = rope_parameters is not None and any(k in kinds for k in rope_parameters)
    if nested:
        missing = [k for k in kinds if k not in rope_parameters]
        if missing:
            raise ValueError(f"rope_parameters has no entry for layer type(s) {missing} "
                             f"(it has {sorted(rope_parameters)})")
        out: dict[str, dict | None] = {}
        for kind in kinds:
            entry = rope_parameters[kind]
            if entry is not None and not isinstance(entry, dict):
                raise ValueError(f"rope_parameters[{kind!r}] must be a dict or null, got {entry!r}")
            theta = rope_theta
            if kind == "sliding_attention" and rope_local_base_freq is not None:
                theta = rope_local_base_freq
            out[kind] = None if entry is None else normalize_rope_parameters(
                entry, rope_theta=theta, **extra)
        return out
    if rope_local_base_freq is not None:
        full = normalize_rope_parameters(rope_parameters or rope_scaling,
                                         rope_theta=rope_theta, **extra)
        local = normalize_rope_parameters({"rope_type": "default"},
                                          rope_theta=rope_local_base_freq, **extra)
        return {k: local if k == "sliding_attention" else full for k in kinds}
    shared = normalize_rope_parameters(rope_parameters, rope_scaling=rope_scaling,
                                       rope_theta=rope_theta, **extra)
    return {k: shared for k in kinds}


def rotary_dim_of(head_dim: int, params: dict, rotary_dim: int | None = None) -> int:
    """How many leading dims of each head rotate: `rotary_dim` when the model
    gives it, else int(head_dim * partial_rotary_factor) as HF computes it.
    Refused: a factor outside (0, 1], an odd or empty rotary_dim (HF would
    silently rotate one dim more than the factor says), or a rotary_dim that
    contradicts the params' factor."""
    factor = params.get("partial_rotary_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {factor!r}")
    from_factor = int(head_dim * factor)
    if rotary_dim is None:
        rotary_dim = from_factor
    elif "partial_rotary_factor" in params and rotary_dim != from_factor:
        raise ValueError(f"rotary_dim={rotary_dim} contradicts partial_rotary_factor={factor} "
                         f"(head_dim {head_dim} gives {from_factor})")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) \
            or not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even number in (0, head_dim={head_dim}], got "
                         f"{rotary_dim!r} (partial_rotary_factor={factor})")
    return rotary_dim


@dataclass(frozen=True)
class RopeFrequencies:
    """What HF's rope init function returns, for one params dict."""

    inv_freq: torch.Tensor  # [rotary_dim // 2] float32; longrope: the short factors'
    # HF's second return, multiplied into cos and sin (yarn's mscale, longrope's).
    attention_scaling: float = 1.0
    # longrope only: positions >= long_from rotate with long_inv_freq
    # (RotaryEmbedding's docstring says how that differs from HF and vLLM).
    long_inv_freq: torch.Tensor | None = None
    long_from: int | None = None


def _number(params: dict, name: str, *, default=None, positive: bool = True) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        kind = "a positive finite number" if positive else "a finite number"
        raise ValueError(f"rope_type {params['rope_type']!r}: {name} must be {kind}, got {value!r}")
    return value


def _original_max(params: dict, max_position_embeddings: int) -> int:
    # HF standardisation's fallback when the config names none.
    value = params.get("original_max_position_embeddings", max_position_embeddings)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"rope_type {params['rope_type']!r}: original_max_position_embeddings "
                         f"must be a positive integer, got {value!r}")
    return value


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict, max_pos: int) -> torch.Tensor:
    factor = _number(params, "factor")
    low_freq_factor = _number(params, "low_freq_factor")
    high_freq_factor = _number(params, "high_freq_factor")
    if high_freq_factor <= low_freq_factor:
        raise ValueError("rope_type 'llama3': high_freq_factor must exceed low_freq_factor, got "
                         f"{high_freq_factor} <= {low_freq_factor}")
    old_context_len = _original_max(params, max_pos)
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


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (paper eq. 21), as HF's yarn_get_mscale;
    DeepSeek also folds mscale(factor, mscale_all_dim)**2 into the softmax
    scale (HF's yarn_apply_mscale): the model's concern, not the tables'."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, params: dict, max_pos: int) -> RopeFrequencies:
    base = params["rope_theta"]
    if base <= 1:  # the correction range divides by log(base)
        raise ValueError(f"rope_type 'yarn': rope_theta must exceed 1, got {base!r}")
    original = _original_max(params, max_pos)
    factor = params.get("factor")
    # DeepSeek-V3 style configs may leave factor out: HF takes the ratio.
    factor = max_pos / original if factor is None else _number(params, "factor")
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    for name in ("mscale", "mscale_all_dim"):
        if params.get(name) is not None:
            _number(params, name, positive=False)
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale)
                                     / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    else:
        attention_factor = _number(params, "attention_factor")
    # HF's `or`: 0 / None mean the paper's defaults.
    beta_fast = _number({**params, "beta_fast": params.get("beta_fast") or 32}, "beta_fast")
    beta_slow = _number({**params, "beta_slow": params.get("beta_slow") or 1}, "beta_slow")

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevents a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    # Dims turning many times within the original context keep their
    # frequency (extrapolate), slow ones are interpolated by `factor`.
    extrapolation_factor = 1 - ramp
    inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                + inv_freq_extrapolation * extrapolation_factor)
    return RopeFrequencies(inv_freq, float(attention_factor))


def _longrope_factors(params: dict, name: str, dim: int) -> torch.Tensor:
    values = params.get(name)
    if not isinstance(values, (list, tuple)) or len(values) != dim // 2 or not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
            for v in values):
        shown = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(values)
        raise ValueError(f"rope_type 'longrope': {name} must be {dim // 2} positive numbers "
                         f"(rotary_dim {dim} / 2), got {shown}")
    return torch.tensor(values, dtype=torch.float32)


def _longrope(dim: int, params: dict, max_pos: int) -> RopeFrequencies:
    base = params["rope_theta"]
    original = _original_max(params, max_pos)
    short = _longrope_factors(params, "short_factor", dim)
    long = _longrope_factors(params, "long_factor", dim)
    factor = params.get("factor")
    # Phi-3 leaves factor out: HF takes max_position_embeddings / original.
    factor = max_pos / original if factor is None else _number(params, "factor")
    if params.get("attention_factor") is not None:
        attention_factor = _number(params, "attention_factor")
    elif factor <= 1.0:
        attention_factor = 1.0
    elif original == 1:  # HF's formula divides by log(original)
        raise ValueError("rope_type 'longrope': original_max_position_embeddings=1 leaves "
                         "attention_factor undefined; give attention_factor")
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return RopeFrequencies(1.0 / (short * base**shape), float(attention_factor),
                           long_inv_freq=1.0 / (long * base**shape), long_from=original)


def rope_frequencies(rotary_dim: int, params: dict,
                     max_position_embeddings: int) -> RopeFrequencies:
    """HF's ROPE_INIT_FUNCTIONS[rope_type] (or the default init) for a head
    rotating `rotary_dim` dims; params as normalize_rope_parameters gives."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r} "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    params = {**params, "rope_type": rope_type}
    _number(params, "rope_theta", default=DEFAULT_ROPE_THETA)
    params.setdefault("rope_theta", DEFAULT_ROPE_THETA)
    if rope_type == "yarn":
        return _yarn(rotary_dim, params, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope(rotary_dim, params, max_position_embeddings)
    inv_freq = _base_inv_freq(params["rope_theta"], rotary_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / _number(params, "factor")
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params, max_position_embeddings)
    return RopeFrequencies(inv_freq)
