"""workerd/lora/peft_checkpoint.py: a PEFT LoRA directory is read from its
JSON config and safetensors weights only, every feature kvloom would not
apply exactly as PEFT does is refused naming the field or tensor, and the
scale is folded into B (alpha / r, or alpha / sqrt(r) with rsLoRA)."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from safetensors.torch import save_file

from workerd.lora.peft_checkpoint import LoRAAdapterError, load_peft_lora

torch.set_num_threads(1)
PREFIX = "base_model.model.model.layers.0.self_attn"
R, IN, OUT = 4, 8, 6


def _config(**overrides) -> dict:
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": 8, "target_modules": ["q_proj"],
           "bias": "none", "use_dora": False, "use_rslora": False, "modules_to_save": None,
           "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True,
           "lora_bias": False, "fan_in_fan_out": False, "task_type": "CAUSAL_LM"}
    cfg.update(overrides)
    return cfg


def _tensors(seed=0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{PREFIX}.q_proj.lora_A.weight": torch.randn(R, IN, generator=g).to(dtype),
            f"{PREFIX}.q_proj.lora_B.weight": torch.randn(OUT, R, generator=g).to(dtype)}


def _write(path, config=None, tensors=None, *, raw_config: bytes | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_bytes(
        raw_config if raw_config is not None else json.dumps(
            _config() if config is None else config).encode())
    save_file(_tensors() if tensors is None else tensors,
              str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def _load(path, **kw):
    kw.setdefault("max_lora_rank", 16)
    return load_peft_lora(path, **kw)


def test_reads_the_factors_and_folds_the_scale_into_b(tmp_path):
    t = _tensors()
    lora = _load(_write(tmp_path / "a"))
    (name, w), = lora.modules.items()
    assert name == "model.layers.0.self_attn.q_proj"
    assert (lora.rank, lora.lora_alpha, lora.scaling) == (R, 8.0, 2.0)
    torch.testing.assert_close(w.lora_a, t[f"{PREFIX}.q_proj.lora_A.weight"], rtol=0, atol=0)
    torch.testing.assert_close(w.lora_b, 2.0 * t[f"{PREFIX}.q_proj.lora_B.weight"],
                               rtol=0, atol=0)
    assert len(lora.digest) == 64 and lora.file_bytes > 0


def test_rslora_scales_by_alpha_over_sqrt_r(tmp_path):
    t = _tensors()
    lora = _load(_write(tmp_path / "a", _config(use_rslora=True, lora_alpha=3)))
    assert lora.scaling == pytest.approx(3 / math.sqrt(R))
    (w,) = lora.modules.values()
    torch.testing.assert_close(w.lora_b, t[f"{PREFIX}.q_proj.lora_B.weight"] * 3 / math.sqrt(R))


def test_scale_is_folded_in_float32_then_cast(tmp_path):
    t = _tensors(dtype=torch.bfloat16)
    lora = _load(_write(tmp_path / "a", _config(lora_alpha=3), t), dtype=torch.bfloat16)
    (w,) = lora.modules.values()
    b = t[f"{PREFIX}.q_proj.lora_B.weight"]
    assert w.lora_a.dtype == w.lora_b.dtype == torch.bfloat16
    assert torch.equal(w.lora_b, (b.float() * 0.75).to(torch.bfloat16))


def test_digest_changes_with_either_file(tmp_path):
    d0 = _load(_write(tmp_path / "a")).digest
    assert _load(_write(tmp_path / "b")).digest == d0  # same bytes, same digest
    assert _load(_write(tmp_path / "c", tensors=_tensors(seed=1))).digest != d0
    assert _load(_write(tmp_path / "d", _config(lora_alpha=9))).digest != d0


def test_a_pickle_only_directory_is_refused_unread(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(_config()))
    # Not even a valid pickle: it must never be opened.
    (d / "adapter_model.bin").write_bytes(b"\x80\x04 not read")
    with pytest.raises(LoRAAdapterError, match="adapter_model.bin .a pickle.*safetensors"):
        _load(d)


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_missing_file_is_named(tmp_path, missing):
    d = _write(tmp_path / "a")
    (d / missing).unlink()
    with pytest.raises(LoRAAdapterError, match=missing):
        _load(d)
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        _load(tmp_path / "nope")


@pytest.mark.parametrize("overrides,match", [
    ({"peft_type": "IA3"}, "peft_type"),
    ({"peft_type": None}, "peft_type"),
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all'"),
    ({"bias": "lora_only"}, "bias="),
    ({"r": 17}, "r=17 is above --max-lora-rank 16"),
    ({"r": 10**12}, "above --max-lora-rank"),
    ({"r": 0}, "r must be a positive integer"),
    ({"r": -4}, "r must be a positive integer"),
    ({"r": True}, "r must be a positive integer"),
    ({"r": 4.0}, "r must be a positive integer"),
    ({"r": "4"}, "r must be a positive integer"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is not supported"),
    ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern is not supported"),
    ({"lora_alpha": "8"}, "lora_alpha must be a number"),
    ({"lora_alpha": None}, "lora_alpha must be a number"),
    ({"lora_alpha": False}, "lora_alpha must be a number"),
    ({"use_rslora": "yes"}, "use_rslora"),
    ({"lora_bias": True}, "lora_bias"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"layer_replication": [[0, 2]]}, "layer_replication"),
    ({"trainable_token_indices": [3]}, "trainable_token_indices"),
    ({"alora_invocation_tokens": [1, 2]}, "alora"),
    ({"target_parameters": ["experts.gate_up_proj"]}, "target_parameters"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'.*"
                                     "path_initial_model_for_weight_conversion"),
    ({"init_lora_weights": "mica"}, "init_lora_weights"),
])
def test_config_refusals_name_the_field(tmp_path, overrides, match):
    with pytest.raises(LoRAAdapterError, match=match):
        _load(_write(tmp_path / "a", _config(**overrides)))


@pytest.mark.parametrize("raw,match", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object expected"),
    (b'{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}', "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
])
def test_hostile_config_json(tmp_path, raw, match):
    with pytest.raises(LoRAAdapterError, match=match):
        _load(_write(tmp_path / "a", raw_config=raw))


def test_config_larger_than_a_mebibyte_is_refused(tmp_path):
    raw = json.dumps({**_config(), "pad": "x" * (1 << 20)}).encode()
    with pytest.raises(LoRAAdapterError, match="larger than"):
        _load(_write(tmp_path / "a", raw_config=raw))


def test_weights_past_max_bytes_or_max_tensors_are_refused(tmp_path):
    d = _write(tmp_path / "a")
    with pytest.raises(LoRAAdapterError, match="larger than"):
        _load(d, max_bytes=200)
    with pytest.raises(LoRAAdapterError, match="2 tensors, more than the 1 allowed"):
        _load(d, max_tensors=1)


@pytest.mark.parametrize("key,match", [
    ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding adapter"),
    (f"{PREFIX}.q_proj.lora_B.bias", "a bias"),
    ("base_model.model.lm_head.modules_to_save.default.weight", "modules_to_save"),
    (f"{PREFIX}.q_proj.lora_A.default.weight", "lora_A.weight / lora_B.weight"),
    (f"{PREFIX}.q_proj.lora_magnitude_vector", "not a LoRA factor"),
    ("model.layers.0.self_attn.q_proj.lora_A.weight", "base_model.model."),
    ("base_model.model." + "a." * 400 + "lora_A.weight", "not a LoRA factor"),
])
def test_unexpected_tensor_keys_are_refused_by_name(tmp_path, key, match):
    tensors = {**_tensors(), key: torch.zeros(R, IN)}
    with pytest.raises(LoRAAdapterError, match=match):
        _load(_write(tmp_path / "a", tensors=tensors))


@pytest.mark.parametrize("a_shape,b_shape,match", [
    ((R + 1, IN), (OUT, R), "do not fit r=4"),
    ((R, IN), (OUT, R + 1), "do not fit r=4"),
    ((R, IN), (OUT, R, 1), "2-D"),
    ((R,), (OUT, R), "2-D"),
])
def test_shapes_must_fit_r(tmp_path, a_shape, b_shape, match):
    tensors = {f"{PREFIX}.q_proj.lora_A.weight": torch.zeros(a_shape),
               f"{PREFIX}.q_proj.lora_B.weight": torch.zeros(b_shape)}
    with pytest.raises(LoRAAdapterError, match=match):
        _load(_write(tmp_path / "a", tensors=tensors))


def test_a_factor_without_its_pair_is_refused(tmp_path):
    tensors = {f"{PREFIX}.q_proj.lora_A.weight": torch.zeros(R, IN)}
    with pytest.raises(LoRAAdapterError, match="q_proj has no lora_B.weight"):
        _load(_write(tmp_path / "a", tensors=tensors))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_non_float_weights_are_refused(tmp_path, dtype):
    tensors = {k: v.to(dtype) for k, v in _tensors().items()}
    with pytest.raises(LoRAAdapterError, match="must be floating point"):
        _load(_write(tmp_path / "a", tensors=tensors))


def test_non_finite_weights_are_refused(tmp_path):
    tensors = _tensors()
    tensors[f"{PREFIX}.q_proj.lora_B.weight"][0, 0] = float("nan")
    with pytest.raises(LoRAAdapterError, match="NaN or infinite"):
        _load(_write(tmp_path / "a", tensors=tensors))


def _header_only(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


@pytest.mark.parametrize("blob", [
    b"",
    b"\x01\x00",
    struct.pack("<Q", 1 << 40) + b"{}",
    struct.pack("<Q", 2) + b"{}",  # a header with no tensors
    struct.pack("<Q", 7) + b"garbage",
    _header_only(b'{"x": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 99]}}'),
])
def test_corrupt_safetensors_are_refused(tmp_path, blob):
    d = _write(tmp_path / "a")
    (d / "adapter_model.safetensors").write_bytes(blob)
    with pytest.raises(LoRAAdapterError, match="safetensors|JSON|no LoRA weights"):
        _load(d)
