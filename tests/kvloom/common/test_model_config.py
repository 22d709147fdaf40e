"""Both daemons read config.json themselves (kvloom/common/model_config.py):
every field the model code uses must equal what transformers' AutoConfig
makes of the same file, family by family, defaults included, and a hostile
file is refused with the field's name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvloom.common.model_config import (
    SLIDING_ATTENTION,
    load_model_config,
    parse_model_config,
)
from kvloom.common.model_config_fields import FAMILIES, MAX_CONFIG_BYTES
from tests.imports import modules_imported
from workerd.layers.rope_scaling import rope_parameters_by_layer_type
from workerd.layers.rotary import rope_parameters

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
SMOLLM2 = {**LLAMA, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000,
           "rope_scaling": None, "tie_word_embeddings": True, "head_dim": 64}
LLAMA31_ROPE = {"rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}}

CONFIGS = {
    "llama-all-defaults": LLAMA,
    "mistral-all-defaults": MISTRAL,
    "smollm2": SMOLLM2,
    "llama3.1-rope": {**LLAMA, "hidden_size": 256, "num_attention_heads": 4, **LLAMA31_ROPE},
    "linear-rope-legacy-type-key": {**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "transformers5-rope-parameters": {**LLAMA, "rope_parameters": {
        "rope_type": "default", "rope_theta": 123456.0}},
    "rope-parameters-without-theta": {**LLAMA, "rope_parameters": {"rope_type": "default"}},
    "explicit-head-dim-and-biases": {**LLAMA, "hidden_size": 512, "num_attention_heads": 8,
                                     "head_dim": 128, "attention_bias": True, "mlp_bias": True},
    "mistral-no-window-null-head-dim": {**MISTRAL, "sliding_window": None, "head_dim": None},
    "mistral-with-attention-bias": {**MISTRAL, "attention_bias": True},
}

ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
        "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
        "ministral": "MinistralForCausalLM",
        "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM",
        "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM", "mixtral": "MixtralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def _family(model_type: str, **fields) -> dict:
    return {"architectures": [ARCH[model_type]], "model_type": model_type, **fields}


CONFIGS.update({f"{t}-all-defaults": _family(t) for t in FAMILIES if t not in ("llama", "mistral")})
CONFIGS.update({
    # Qwen2.5's release configs: a window that use_sliding_window switches off.
    "qwen2.5-window-off": _family("qwen2", sliding_window=32768, use_sliding_window=False,
                                  max_window_layers=21, num_hidden_layers=24),
    "qwen2-window-on": _family("qwen2", sliding_window=64, use_sliding_window=True,
                               max_window_layers=2, num_hidden_layers=4),
    "qwen3-explicit-layer-types": _family("qwen3", sliding_window=64, use_sliding_window=True,
                                          num_hidden_layers=3, layer_types=[
                                              "sliding_attention", "full_attention",
                                              "sliding_attention"]),
    "mistral-v0.1-window": {**MISTRAL, "sliding_window": 4096, "num_hidden_layers": 3},
    "gemma2-four-layers": _family("gemma2", num_hidden_layers=4, sliding_window=5,
                                  query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                  final_logit_softcapping=3.0),
    "gemma3-270m-like": _family("gemma3_text", num_hidden_layers=18, sliding_window=512,
                                rope_local_base_freq=10000.0, rope_theta=1e6),
    "gemma3-explicit-layer-types": _family("gemma3_text", num_hidden_layers=2,
                                           layer_types=["sliding_attention", "full_attention"]),
    "phi3-mini-4k-window": _family("phi3", sliding_window=2047, num_hidden_layers=2),
    "phi4-mini-partial": _family("phi3", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
    # Phi-3-128k's first configs: rope type "su" (transformers reads longrope).
    "phi3-legacy-su-rope": _family("phi3", hidden_size=256, num_attention_heads=4,
                                   rope_scaling={"type": "su", "short_factor": [1.0] * 32,
                                                 "long_factor": [2.0] * 32}),
    "granite-multipliers": _family("granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                                   attention_multiplier=0.0078125, logits_scaling=8.0),
    "smollm3-nope": _family("smollm3", num_hidden_layers=8, no_rope_layer_interval=4),
    "smollm3-nope-window": _family("smollm3", num_hidden_layers=4, use_sliding_window=True,
                                   sliding_window=7, no_rope_layers=[1, 1, 0, 0]),
    "qwen3-moe-sparse-step": _family("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
                                     mlp_only_layers=[3], num_experts=4, norm_topk_prob=True,
                                     num_experts_per_tok=2),
    "mixtral-window": _family("mixtral", sliding_window=8, num_hidden_layers=2,
                              num_local_experts=4, num_experts_per_tok=2),
})


def _head_dim(hf) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def _hf_layer_types(hf) -> list[str]:
    # Families without layer_types (Mistral, Phi-3, Mixtral) slide every layer
    # once sliding_window is set (their modeling files' create_sliding_window_causal_mask).
    types = getattr(hf, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if getattr(hf, "sliding_window", None)
                 else "full_attention"] * \
            hf.num_hidden_layers
    return list(types)


def _hf_window(hf):
    return getattr(hf, "sliding_window", None) if SLIDING_ATTENTION in _hf_layer_types(hf) \
        else None


def _hf_scale(hf) -> float:
    # The modeling files' `self.scaling` (gemma2 L221, granite L124, llama).
    if hf.model_type.startswith("gemma"):
        return hf.query_pre_attn_scalar**-0.5
    if hf.model_type == "granite":
        return hf.attention_multiplier
    return _head_dim(hf) ** -0.5


def _hf_rope_layers(hf) -> list[bool]:
    return [bool(v) for v in getattr(hf, "no_rope_layers", None) or [1] * hf.num_hidden_layers]


def _hf_act(hf) -> str:
    return getattr(hf, "hidden_activation", None) or hf.hidden_act


DIRECT = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
          "rms_norm_eps", "tie_word_embeddings")
DERIVED = {
    "head_dim": _head_dim, "hidden_act": _hf_act, "layer_types": _hf_layer_types,
    "sliding_window": _hf_window, "attention_scale": _hf_scale, "rope_layers": _hf_rope_layers,
    "attn_logit_softcapping": lambda hf: getattr(hf, "attn_logit_softcapping", None),
    "final_logit_softcapping": lambda hf: getattr(hf, "final_logit_softcapping", None),
    "embedding_multiplier": lambda hf: getattr(hf, "embedding_multiplier", 1.0),
    "residual_multiplier": lambda hf: getattr(hf, "residual_multiplier", 1.0),
    "logits_scaling": lambda hf: getattr(hf, "logits_scaling", 1.0),
}


def _ours(config, name):
    value = getattr(config, name)
    return list(value) if isinstance(value, tuple) else value


def _hf_moe(hf) -> tuple | None:
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    if not experts:
        return None
    # Qwen*MoeSparseMoeBlock vs dense MLP per layer (qwen3_moe modeling L310).
    only = getattr(hf, "mlp_only_layers", [])
    step = getattr(hf, "decoder_sparse_step", 1)
    sparse = [i not in only and (i + 1) % step == 0 for i in range(hf.num_hidden_layers)]
    inter = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    return (experts, hf.num_experts_per_tok, inter, getattr(hf, "norm_topk_prob", True), sparse)


def _write(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_field_equals_autoconfig(name, tmp_path):
    from transformers import AutoConfig

    path = _write(tmp_path, CONFIGS[name])
    ours, hf = load_model_config(path), AutoConfig.from_pretrained(path)
    _assert_reads_like(ours, hf)


def _assert_reads_like(ours, hf) -> None:
    for f in DIRECT:
        assert _ours(ours, f) == getattr(hf, f), f
    for f, read in DERIVED.items():
        assert _ours(ours, f) == read(hf), f
    assert list(ours.architectures) == hf.architectures
    if any(t in hf.rope_parameters for t in ("sliding_attention", "full_attention")):
        # A table per layer type (Gemma 3, OLMo 3): each as the model builds it.
        ours_by_type = rope_parameters_by_layer_type(
            ours.rope_parameters, ours.layer_types, rope_scaling=ours.rope_scaling,
            rope_theta=ours.rope_theta, rope_local_base_freq=ours.rope_local_base_freq)
        for layer_type, params in ours_by_type.items():
            assert params == hf.rope_parameters[layer_type], layer_type
    else:
        hf_rope = rope_parameters(hf)
        assert ours.partial_rotary_factor == hf_rope.pop("partial_rotary_factor", 1.0)
        # The model passes the top-level switch length itself (rope_scaling.py's
        # normalize_rope_parameters); HF folds it into the dict.
        ours_rope = rope_parameters(ours)
        hf_max = hf_rope.pop("original_max_position_embeddings", None)
        if hf_max is not None:
            assert hf_max == (ours.original_max_position_embeddings
                              or ours_rope.pop("original_max_position_embeddings"))
        assert ours_rope | {"partial_rotary_factor": 0} == hf_rope | {"partial_rotary_factor": 0}
    moe = ours.moe and (ours.moe.num_experts, ours.moe.num_experts_per_tok,
                        ours.moe.moe_intermediate_size, ours.moe.norm_topk_prob,
                        list(ours.moe.sparse_layers))
    assert moe == _hf_moe(hf)


def test_the_tiny_test_checkpoint_reads_like_autoconfig(tiny_model_dir):
    from transformers import AutoConfig

    _assert_reads_like(load_model_config(tiny_model_dir),
                       AutoConfig.from_pretrained(tiny_model_dir))


@pytest.mark.parametrize(("key", "value", "message"), [
    ("vocab_size", 0, r"vocab_size=0 is outside"),
    ("vocab_size", -1, r"vocab_size=-1 is outside"),
    ("hidden_size", 1 << 40, r"hidden_size=\d+ is outside"),
    ("num_hidden_layers", "32", r"num_hidden_layers must be an integer"),
    ("num_attention_heads", True, r"num_attention_heads must be an integer"),
    ("num_key_value_heads", 1.5, r"num_key_value_heads must be an integer"),
    ("max_position_embeddings", 10**30, r"max_position_embeddings=\d+ is outside"),
    ("rms_norm_eps", 0, r"rms_norm_eps must be a number"),
    ("rms_norm_eps", float("nan"), r"rms_norm_eps must be a number"),
    ("rope_theta", -1.0, r"rope_theta must be a number"),
    ("tie_word_embeddings", "yes", r"tie_word_embeddings must be true or false"),
    ("hidden_act", 3, r"hidden_act 3 is not supported"),
    ("hidden_act", "relu2", r"hidden_act 'relu2' is not supported \(supported: silu"),
    ("num_key_value_heads", 5, r"not a multiple of num_key_value_heads=5"),
    ("rope_scaling", [1, 2], r"rope_scaling must be an object"),
    ("architectures", "LlamaForCausalLM", r"architectures must be a list"),
    ("model_type", "gpt2", r"model_type 'gpt2' is not one kvloom reads"),
    ("hidden_size", 100, r"hidden_size=100 is not divisible by num_attention_heads=32"),
])
def test_hostile_fields_are_named(key, value, message):
    with pytest.raises(ValueError, match=message):
        parse_model_config({**LLAMA, key: value})


def test_hostile_files_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"{\xff")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ValueError, match="over"):
        load_model_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model_config(tmp_path / "missing")


def test_loading_a_model_never_imports_transformers(tiny_model_dir):
    """The point of reading config.json ourselves: a rank's start skips
    transformers' import (and the torch.distributed.tensor it pulls in)."""
    code = ("import torch\n"
            "from workerd.distributed.parallel_state import ParallelState\n"
            "from workerd.models.loader import load_model\n"
            "ps = ParallelState(0, 1, 1, 1, 0, 0, torch.device('cpu'))\n"
            f"load_model({str(tiny_model_dir)!r}, ps, torch.float32)\n")
    assert modules_imported(code, "transformers") == []


@pytest.mark.parametrize(("config", "message"), [
    (_family("gemma2", layer_types=["sliding_attention"]), r"layer_types must list one of"),
    (_family("gemma2", num_hidden_layers=2, layer_types=["sliding", "full_attention"]),
     r"layer_types must list"),
    (_family("gemma2", sliding_window=None), r"sliding_attention layers but sliding_window"),
    (_family("gemma2", sliding_window=0), r"sliding_attention layers but sliding_window"),
    (_family("mistral", sliding_window=-3), r"sliding_window=-3 is outside"),
    (_family("gemma2", attn_logit_softcapping=float("inf")), r"attn_logit_softcapping must be"),
    (_family("gemma2", query_pre_attn_scalar=-4), r"query_pre_attn_scalar must be"),
    (_family("gemma3_text", use_bidirectional_attention=True), r"use_bidirectional_attention"),
    (_family("smollm3", num_hidden_layers=2, no_rope_layers=[1, 2]), r"no_rope_layers must"),
    (_family("qwen3_moe", num_experts=4, num_experts_per_tok=5), r"num_experts_per_tok=5 exceeds"),
    (_family("qwen3_moe", mlp_only_layers="all"), r"mlp_only_layers must list"),
    (_family("phi3", partial_rotary_factor=1.5), r"partial_rotary_factor must be"),
    (_family("granite", residual_multiplier=0), r"residual_multiplier must be"),
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     r"needs a text_config object"),
])
def test_hostile_family_fields_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        parse_model_config(config)


def test_a_wrapper_reads_its_text_config():
    """Gemma 3 4B+ checkpoints nest the language model's fields; the wrapper's
    own tie_word_embeddings decides the LM head (kvloom serves its text path)."""
    text = {"model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 64,
            "tie_word_embeddings": False}
    nested = parse_model_config({"architectures": ["Gemma3ForConditionalGeneration"],
                                 "model_type": "gemma3", "text_config": text,
                                 "tie_word_embeddings": True})
    assert (nested.model_type, nested.num_hidden_layers, nested.hidden_size) == \
        ("gemma3_text", 6, 64)
    assert nested.tie_word_embeddings is True
    assert nested.layer_types[-1] == "full_attention" and nested.every_layer_slides is False


@pytest.mark.parametrize(("config", "message"), [
    ({**LLAMA, "architectures": ["GPT2LMHeadModel"]}, r"'GPT2LMHeadModel' is not one kvloom"),
    ({**LLAMA, "architectures": ["Qwen3ForCausalLM"]},
     r"Qwen3ForCausalLM reads model_type qwen3, not 'llama'"),
    ({**LLAMA, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     r"rope_parameters rope_type 'dynamic' is not supported"),
    ({**LLAMA, "rope_scaling": {"type": "ntk"}}, r"rope_scaling rope_type 'ntk'"),
    (_family("gemma3_text", rope_parameters={
        "sliding_attention": {"rope_type": "default"},
        "full_attention": {"rope_type": "proportional"}}), r"rope_type 'proportional'"),
])
def test_what_kvloom_cannot_serve_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        parse_model_config(config)


def test_a_field_the_family_does_not_read_changes_nothing():
    """transformers' Qwen2 ignores mlp_bias; so do we (and GLM's o_proj never has a bias)."""
    assert parse_model_config(_family("qwen2", mlp_bias=True)).mlp_bias is False
    glm = parse_model_config(_family("glm"))
    assert (glm.attention_bias, glm.attention_out_bias) == (True, False)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize(("step", "only"), [(1, []), (2, [3]), (3, [0, 5]),
                                             (1, [0, 1, 2, 3, 4, 5])])
def test_sparse_layers_are_transformers_decoder_layers(family, step, only):
    """config.moe.sparse_layers is the one rule for which layers get the sparse
    block (workerd's MoE models build by it): by the global index, as
    transformers' Qwen*MoeDecoderLayer decides it (mlp_only_layers,
    decoder_sparse_step), checked against the layers HF builds."""
    import importlib

    import transformers

    name = {"qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe"}[family]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    fields = dict(hidden_size=32, num_hidden_layers=6, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=64, moe_intermediate_size=16,
                  intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                  decoder_sparse_step=step, mlp_only_layers=only)
    cfg = getattr(transformers, f"{name}Config")(**fields)
    sparse_block = getattr(modeling, f"{name}SparseMoeBlock")
    hf = [isinstance(getattr(modeling, f"{name}DecoderLayer")(cfg, i).mlp, sparse_block)
          for i in range(6)]
    ours = list(parse_model_config(_family(family, **fields)).moe.sparse_layers)
    assert ours == hf
    if (step, only) == (2, [3]):
        assert ours == [False, True, False, False, False, True]


def test_sparse_layer_rule_refuses_what_it_cannot_place():
    """decoder_sparse_step 0 (a modulo by zero in transformers) and zero
    experts (an MoE family without experts) are refused by name."""
    with pytest.raises(ValueError, match=r"decoder_sparse_step=0 is outside"):
        parse_model_config(_family("qwen3_moe", decoder_sparse_step=0))
    with pytest.raises(ValueError, match=r"num_experts=0 is outside"):
        parse_model_config(_family("qwen2_moe", num_experts=0))
