"""Negative controls for tests/workerd/models/test_families.py: for each
family feature, the same transformers model with that feature removed
predicts different tokens on the parity test's prompts, so the tiny
checkpoint truly exercises it (a parity test of a feature that changes
nothing would pass with the feature missing)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kvloom_testing.families import make_tiny_checkpoint
from tests.workerd.models.test_families import hf_model, schedule


def _layers(hf):
    return hf.model.layers


def _identity(hf, *names):
    for layer in _layers(hf):
        for name in names:
            owner, attr = (layer.self_attn, name[5:]) if name.startswith("attn.") else (layer, name)
            setattr(owner, attr, nn.Identity())


def _zero_qkv_bias(hf):
    for layer in _layers(hf):
        for proj in ("q_proj", "k_proj", "v_proj"):
            getattr(layer.self_attn, proj).bias.zero_()


def _no_window(hf):
    hf.config.sliding_window = 10**6


def _no_attn_cap(hf):
    for layer in _layers(hf):
        layer.self_attn.attn_logit_softcapping = None


def _no_final_cap(hf):
    hf.config.final_logit_softcapping = None


def _no_embed_scale(hf):
    hf.model.embed_tokens.embed_scale.fill_(1.0)


def _one_rope_table(hf):
    rope = hf.model.rotary_emb
    rope.sliding_attention_inv_freq.copy_(rope.full_attention_inv_freq)


def _plain_rope(factor: float):
    """Phi-3's rope replaced by plain (default) rope over `factor` of each head."""
    def apply(hf):
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

        config = type(hf.config).from_dict(hf.config.to_dict())
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": factor}
        hf.model.rotary_emb = Phi3RotaryEmbedding(config)
    return apply


def _plain_qwen2_rope(hf):
    """Qwen2's yarn replaced by default rope at the same theta."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    config = type(hf.config).from_dict(hf.config.to_dict())
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    hf.model.rotary_emb = Qwen2RotaryEmbedding(config)


def _neox_pairs(monkeypatch):
    """GLM's GPT-J pairs rotated as NeoX halves instead."""
    def neox_rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def apply(hf):
        import transformers.models.glm.modeling_glm as glm
        import transformers.models.glm4.modeling_glm4 as glm4

        monkeypatch.setattr(glm, "rotate_half", neox_rotate_half)
        monkeypatch.setattr(glm4, "rotate_half", neox_rotate_half)
    return apply


def _no_multipliers(hf):
    hf.model.embedding_multiplier = 1.0
    hf.config.logits_scaling = 1.0
    for layer in _layers(hf):
        layer.residual_multiplier = 1.0
        layer.self_attn.scaling = 1 / math.sqrt(layer.self_attn.head_dim)


def _rope_everywhere(hf):
    for layer in _layers(hf):
        layer.self_attn.use_rope = 1


def _uniform_router(hf):
    for layer in _layers(hf):
        moe = layer.mlp if hasattr(layer.mlp, "gate") else None
        if moe is not None:
            moe.gate.weight.zero_()


CONTROLS = {
    ("qwen2", "qkv bias"): _zero_qkv_bias,
    ("qwen2", "yarn"): _plain_qwen2_rope,
    ("qwen3", "per-head q/k norm"): lambda hf: _identity(hf, "attn.q_norm", "attn.k_norm"),
    ("mistral-window", "sliding window"): _no_window,
    ("gemma2", "alternating windows"): _no_window,
    ("gemma2", "attention soft-cap"): _no_attn_cap,
    ("gemma2", "embedding scale"): _no_embed_scale,
    ("gemma2", "sandwich norms"): lambda hf: _identity(hf, "post_attention_layernorm",
                                                        "post_feedforward_layernorm"),
    ("gemma3", "5:1 windows"): _no_window,
    ("gemma3", "two rope tables"): _one_rope_table,
    ("gemma3", "per-head q/k norm"): lambda hf: _identity(hf, "attn.q_norm", "attn.k_norm"),
    # Longrope's factors are sized for the partial width, so partial vs full
    # is compared on plain rope: (baseline, control).
    ("phi3", "partial rotary"): (_plain_rope(0.75), _plain_rope(1.0)),
    ("phi3", "longrope short factors"): _plain_rope(0.75),
    ("olmo2", "all-heads q/k norm"): lambda hf: _identity(hf, "attn.q_norm", "attn.k_norm"),
    ("olmo2", "post norms"): lambda hf: _identity(hf, "post_attention_layernorm",
                                                   "post_feedforward_layernorm"),
    ("olmo3", "3:1 windows"): _no_window,
    ("ministral", "alternating windows"): _no_window,
    ("granite", "multipliers"): _no_multipliers,
    ("smollm3", "NoPE layers"): _rope_everywhere,
    ("glm", "GPT-J rotary pairs"): "neox",
    ("glm4", "GPT-J rotary pairs"): "neox",
    ("glm4", "post sublayer norms"): lambda hf: _identity(hf, "post_self_attn_layernorm",
                                                          "post_mlp_layernorm"),
    ("mixtral", "router"): _uniform_router,
    ("qwen3-moe", "router"): _uniform_router,
}

_dirs: dict[str, str] = {}


def _model_dir(family, tmp_path_factory) -> str:
    if family not in _dirs:
        _dirs[family] = str(make_tiny_checkpoint(tmp_path_factory.mktemp(family), family,
                                                 seed=7))
    return _dirs[family]


def _tokens(hf, prompts) -> list[list[int]]:
    with torch.inference_mode():
        return [hf(torch.tensor([p])).logits[0].argmax(-1).tolist() for p in prompts]


@pytest.mark.parametrize(("family", "feature"), sorted(CONTROLS),
                         ids=[f"{f}-{x}" for f, x in sorted(CONTROLS)])
def test_removing_the_feature_changes_the_tokens(family, feature, tmp_path_factory,
                                                 monkeypatch):
    model_dir = _model_dir(family, tmp_path_factory)
    hf = hf_model(model_dir)
    _, prompts = schedule(hf.config.vocab_size)
    control = CONTROLS[(family, feature)]
    if control == "neox":
        control = _neox_pairs(monkeypatch)
    if isinstance(control, tuple):
        baseline, control = control
        with torch.no_grad():
            baseline(hf)
    with_feature = _tokens(hf, prompts)
    with torch.no_grad():
        control(hf)
    assert _tokens(hf, prompts) != with_feature, f"{family}: {feature} changes no token"


def test_the_final_soft_cap_changes_the_logits(tmp_path_factory):
    """tanh is monotonic, so Gemma 2's final cap never changes a greedy token;
    it changes the distribution sampling draws from."""
    hf = hf_model(_model_dir("gemma2", tmp_path_factory))
    _, prompts = schedule(hf.config.vocab_size)
    with torch.inference_mode():
        capped = hf(torch.tensor([prompts[0]])).logits
        _no_final_cap(hf)
        uncapped = hf(torch.tensor([prompts[0]])).logits
    assert capped.abs().max() <= 0.5 < uncapped.abs().max()
