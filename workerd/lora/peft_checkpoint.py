"""Reading one PEFT LoRA adapter directory (save_pretrained's layout).

Only two files are read: adapter_config.json (parsed with json, bounded in
size) and adapter_model.safetensors. adapter_model.bin and .pt are pickles,
which can run code when loaded: a directory holding only those is refused,
and they are never opened. The weights file is read once into memory, and
that one copy is both hashed and parsed, so the digest always names the
bytes being served (the controlplane keys its prefix cache on it: an adapter
reloaded with new weights under the same name gets new KV blocks, where
vLLM, keying on the name, serves stale ones).

Whatever a LoRA adapter can hold that kvloom would not apply exactly as
PEFT does (DoRA and the other variants, modules_to_save, biases, per-module
ranks, adapters meant for a base that PiSSA/OLoRA/CorDA init rewrote) is
refused with a LoRAAdapterError naming the field or tensor and what to do,
rather than served silently different. The scale (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA) is folded into B once here, in float32
before the cast to the serving dtype, so a step multiplies by nothing extra.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PICKLES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_CONFIG_BYTES = 1 << 20
# An adapter of rank 64 on every linear of a 70B model is ~1.6 GB in bf16.
DEFAULT_MAX_BYTES = 4 << 30
# Two tensors per module: 80 layers x 7 projections is 1120.
DEFAULT_MAX_TENSORS = 16384
_MAX_KEY_CHARS = 512
# PEFT's key for a module's factors, after save_pretrained dropped the
# adapter name: base_model.model.<module path>.lora_A.weight.
_KEY = re.compile(r"base_model\.model\.((?:[A-Za-z0-9_]+\.)*[A-Za-z0-9_]+)"
                  r"\.lora_([AB])\.weight")
_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                 "F64": torch.float64}
# PEFT LoRA variants whose forward is not y += B A x (peft/tuners/lora/layer.py
# lora_variants) and options that change what the adapter applies to.
_UNSERVED_OPTIONS = {
    "use_dora": "DoRA (use_dora) rescales the base weight per column",
    "lora_bias": "lora_bias gives lora_B a bias",
    "fan_in_fan_out": "fan_in_fan_out stores the weights transposed (GPT-2 Conv1D)",
    "use_qalora": "QA-LoRA (use_qalora) pools the input",
    "layer_replication": "layer_replication duplicates base layers",
    "trainable_token_indices": "trainable_token_indices trains embedding rows",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) applies after "
                               "its invocation tokens only",
    "target_parameters": "target_parameters adapts raw parameters (MoE experts)",
    "arrow_config": "Arrow routes among several LoRAs",
    "use_bdlora": "BD-LoRA is a LoRA variant",
    "velora_config": "VeLoRA is a LoRA variant",
    "monteclora_config": "MonteCLoRA is a LoRA variant",
    "kasa_config": "KaSA is a LoRA variant",
}
# init_lora_weights values whose saved adapter is plain LoRA on the original
# base. PiSSA, OLoRA, CorDA, LoRA-GA and LoftQ rewrite the base weights
# unless saved with path_initial_model_for_weight_conversion (which writes
# init_lora_weights: true); MiCA is a variant.
_PLAIN_INITS = {"gaussian", "eva", "orthogonal"}


class LoRAAdapterError(ValueError):
    """An adapter kvloom refuses to serve; the message names the field or
    tensor and what to change."""


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One module's factors, full size (unsharded): lora_a [r, in],
    lora_b [out, r] with the scale folded in, both in the serving dtype."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass(frozen=True)
class PeftLoRA:
    path: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    scaling: float
    # Module path as in the base model (base_model.model. stripped), e.g.
    # "model.layers.0.self_attn.q_proj".
    modules: dict[str, LoRAModuleWeights]
    digest: str
    # The two files' bytes.
    file_bytes: int


def load_peft_lora(path: str | Path, *, max_lora_rank: int, dtype: torch.dtype = torch.float32,
                   max_bytes: int = DEFAULT_MAX_BYTES,
                   max_tensors: int = DEFAULT_MAX_TENSORS) -> PeftLoRA:
    """Read and check the adapter in directory `path`; LoRAAdapterError if
    kvloom cannot serve it exactly. Tensors are returned on the CPU."""
    root = Path(path)
    if not root.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {root} is not a directory")
    weights_path = root / WEIGHTS_NAME
    if not weights_path.is_file():
        pickles = [n for n in _PICKLES if (root / n).exists()]
        if pickles:
            raise LoRAAdapterError(
                f"{root}: only {', '.join(pickles)} (a pickle, which kvloom never loads: "
                f"it can run code); save the adapter with safetensors "
                f"(save_pretrained(safe_serialization=True)) to get {WEIGHTS_NAME}")
        raise LoRAAdapterError(f"{root}: no {WEIGHTS_NAME}")
    config_bytes = _read_bounded(root / CONFIG_NAME, MAX_CONFIG_BYTES)
    rank, alpha, rslora = _check_config(_parse_json(config_bytes, root / CONFIG_NAME),
                                        max_lora_rank)
    weight_bytes = _read_bounded(weights_path, max(0, max_bytes - len(config_bytes)))
    digest = hashlib.sha256()
    for blob in (config_bytes, weight_bytes):  # length-prefixed: no two splits collide
        digest.update(struct.pack("<Q", len(blob)))
        digest.update(blob)
    _check_header(weight_bytes, weights_path, max_tensors)
    try:
        tensors = load_safetensors(weight_bytes)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise LoRAAdapterError(f"{weights_path}: not a valid safetensors file ({exc})") from None
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    modules = _pair_modules(tensors, rank, weights_path)
    folded = {name: LoRAModuleWeights(
        a.to(dtype).contiguous(),
        (b.to(torch.float32) * scaling).to(dtype).contiguous())
        for name, (a, b) in modules.items()}
    return PeftLoRA(path=str(root), rank=rank, lora_alpha=alpha, use_rslora=rslora,
                    scaling=scaling, modules=folded, digest=digest.hexdigest(),
                    file_bytes=len(config_bytes) + len(weight_bytes))


def _read_bounded(path: Path, limit: int) -> bytes:
    """The file's bytes, LoRAAdapterError past `limit` (read to limit + 1
    at most, so a file growing under us cannot push it over)."""
    if not path.is_file():
        raise LoRAAdapterError(f"no {path.name} in {path.parent}")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise LoRAAdapterError(f"{path}: larger than the {limit} bytes allowed")
    return data


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _parse_json(data: bytes, where: Path) -> dict:
    try:
        # NaN / Infinity are not JSON: refused rather than read as floats.
        value = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise LoRAAdapterError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise LoRAAdapterError(f"{where}: a JSON object expected, got {type(value).__name__}")
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_config(cfg: dict, max_lora_rank: int) -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora) of a config kvloom serves exactly."""
    where = CONFIG_NAME
    if cfg.get("peft_type") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type is {cfg.get('peft_type')!r}; only LoRA "
                               f"adapters (peft_type \"LORA\") are served")
    for key, what in _UNSERVED_OPTIONS.items():
        if cfg.get(key) not in (None, False, [], {}, ""):
            raise LoRAAdapterError(f"{where}: {key}={cfg[key]!r} is not supported ({what}); "
                                   f"train a plain LoRA adapter without it")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(
            f"{where}: modules_to_save={cfg['modules_to_save']!r} is not supported (it saves "
            f"full copies of those modules); train without modules_to_save")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise LoRAAdapterError(f"{where}: bias={bias!r} is not supported (the adapter trains "
                               f"biases); only bias=\"none\" adapters are served")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAAdapterError(f"{where}: {key} is not supported (per-module ranks or "
                                   f"alphas); train with one r and lora_alpha for all modules")
    init = cfg.get("init_lora_weights", True)
    if not (isinstance(init, bool) or (isinstance(init, str) and init.lower() in _PLAIN_INITS)):
        raise LoRAAdapterError(
            f"{where}: init_lora_weights={init!r}: such an adapter is meant for a base model "
            f"its initialisation rewrote (or is a LoRA variant); save it with "
            f"path_initial_model_for_weight_conversion to get a plain LoRA")
    r = cfg.get("r")
    if not _is_int(r) or r < 1:
        raise LoRAAdapterError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise LoRAAdapterError(f"{where}: r={r} is above --max-lora-rank {max_lora_rank}; "
                               f"restart with --max-lora-rank {r} or more, or use a "
                               f"lower-rank adapter")
    alpha = cfg.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) \
            or not math.isfinite(alpha):
        raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAAdapterError(f"{where}: use_rslora must be true or false, got {rslora!r}")
    return r, float(alpha), rslora


def _check_header(data: bytes, where: Path, max_tensors: int) -> None:
    """The safetensors header's count, dtypes and shapes, before any tensor
    is materialised (an 8-byte little-endian length, then JSON)."""
    if len(data) < 8:
        raise LoRAAdapterError(f"{where}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise LoRAAdapterError(f"{where}: not a safetensors file (header past the end)")
    header = _parse_json(data[8:8 + n], where)
    header.pop("__metadata__", None)
    if len(header) > max_tensors:
        raise LoRAAdapterError(f"{where}: {len(header)} tensors, more than the "
                               f"{max_tensors} allowed")
    for key, info in header.items():
        name = key if len(key) <= _MAX_KEY_CHARS else key[:_MAX_KEY_CHARS] + "..."
        if not isinstance(info, dict) or info.get("dtype") not in _FLOAT_DTYPES:
            dtype = info.get("dtype") if isinstance(info, dict) else None
            raise LoRAAdapterError(f"{where}: tensor {name} has dtype {dtype!r}; LoRA "
                                   f"weights must be floating point "
                                   f"({', '.join(_FLOAT_DTYPES)})")
        shape = info.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2 and all(map(_is_int, shape))):
            raise LoRAAdapterError(f"{where}: tensor {name} has shape {shape!r}; LoRA "
                                   f"weights are 2-D ([r, in] and [out, r])")


def _pair_modules(tensors: dict[str, torch.Tensor], rank: int,
                  where: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (A [r, in], B [out, r]), every key accounted for."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(tensors):
        m = _KEY.fullmatch(key) if len(key) <= _MAX_KEY_CHARS else None
        if m is None:
            raise LoRAAdapterError(f"{where}: tensor {key[:_MAX_KEY_CHARS]!r} is not a "
                                   f"LoRA factor ({_unsupported_key(key)})")
        module, which = m.groups()
        pairs.setdefault(module, {})[which] = tensors[key]
    if not pairs:
        raise LoRAAdapterError(f"{where}: no LoRA weights in the file")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in pairs.items():
        for which in "AB":
            if which not in ab:
                raise LoRAAdapterError(f"{where}: {module} has no lora_{which}.weight; "
                                       f"each module needs both factors")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != rank or b.shape[1] != rank or a.shape[1] < 1 or b.shape[0] < 1:
            raise LoRAAdapterError(
                f"{where}: {module}: lora_A.weight {tuple(a.shape)} and lora_B.weight "
                f"{tuple(b.shape)} do not fit r={rank} (A is [r, in], B is [out, r])")
        for which, t in (("A", a), ("B", b)):
            if not bool(torch.isfinite(t).all()):
                raise LoRAAdapterError(f"{where}: {module}.lora_{which}.weight holds NaN "
                                       f"or infinite values")
        out[module] = (a, b)
    return out


def _unsupported_key(key: str) -> str:
    """What a key that is not <module>.lora_A/B.weight most likely is."""
    if "lora_embedding_" in key:
        return "an embedding adapter (lora_embedding_A/B): LoRA on embeddings is not supported"
    if "modules_to_save" in key or "original_module" in key:
        return "a modules_to_save copy: not supported"
    if ".base_layer." in key:
        return ("a full copy of a base weight, which PEFT saves for an adapted embedding or "
                "LM head (save_embedding_layers): LoRA on the embedding or the LM head is "
                "not supported")
    if key.endswith(".bias"):
        return "a bias: adapters with biases are not supported"
    if not key.startswith("base_model.model."):
        return "PEFT keys start with base_model.model."
    if ".lora_A." in key or ".lora_B." in key:
        return "expected <module>.lora_A.weight / lora_B.weight, as save_pretrained writes"
    return "expected <module>.lora_A.weight / lora_B.weight"
