"""Tiny random checkpoints of every supported family, built with transformers'
own classes and saved with save_pretrained (the hub's tensor names), for
parity tests against the same transformers model.

Every tensor is redrawn from a seeded generator after construction, in
sorted-name order, so a checkpoint depends on the seed and the config only,
not on transformers' init code. The configs are chosen so each family's
feature changes the tokens (tests/workerd/models/test_families.py holds a
negative control per feature): a window of 5 keys with blocks of 4 (not
aligned), caps below the scores they cap, norms far from identity, routers
that send tokens to different experts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvloom_testing.checkpoints import _save_tokenizer

_BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "pad_token_id": 0}
_WINDOW = 5
_MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# family name -> (architecture, config fields beyond _BASE).
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    # Qwen2.5's long-context recipe: yarn (frequencies and cos/sin scaling).
    "qwen2": ("Qwen2ForCausalLM", {"model_type": "qwen2", "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "qwen3": ("Qwen3ForCausalLM", {"model_type": "qwen3"}),
    "mistral-window": ("MistralForCausalLM", {"model_type": "mistral",
                                              "sliding_window": _WINDOW}),
    "gemma2": ("Gemma2ForCausalLM", {
        "model_type": "gemma2", "sliding_window": _WINDOW, "layer_types": _MIXED,
        "attn_logit_softcapping": 1.0, "final_logit_softcapping": 0.5,
        "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True}),
    "gemma3": ("Gemma3ForCausalLM", {
        "model_type": "gemma3_text", "sliding_window": _WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        "query_pre_attn_scalar": 16, "tie_word_embeddings": True}),
    # Gemma 3 4B+'s layout: the text model under language_model, a (tiny)
    # vision tower beside it that kvloom never reads.
    "gemma3-multimodal": ("Gemma3ForConditionalGeneration", {
        "model_type": "gemma3", "mm_tokens_per_image": 4,
        "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        "text_config": {"sliding_window": _WINDOW, "query_pre_attn_scalar": 16,
                        "layer_types": ["sliding_attention", "full_attention",
                                        "sliding_attention", "sliding_attention"]}}),
    "phi3": ("Phi3ForCausalLM", {
        "model_type": "phi3",
        "original_max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
                            "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}}),
    "olmo2": ("Olmo2ForCausalLM", {"model_type": "olmo2", "num_key_value_heads": 1}),
    # Four layers: its default pattern slides the first three.
    "olmo3": ("Olmo3ForCausalLM", {"model_type": "olmo3", "sliding_window": _WINDOW}),
    "ministral": ("MinistralForCausalLM", {"model_type": "ministral", "sliding_window": _WINDOW,
                                           "layer_types": _MIXED}),
    "granite": ("GraniteForCausalLM", {
        "model_type": "granite", "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
        "attention_multiplier": 0.3, "logits_scaling": 4.0}),
    "smollm3": ("SmolLM3ForCausalLM", {"model_type": "smollm3",
                                       "no_rope_layers": [1, 1, 1, 0],
                                       "tie_word_embeddings": True}),
    "glm": ("GlmForCausalLM", {"model_type": "glm", "attention_bias": True,
                               "partial_rotary_factor": 0.5}),
    "glm4": ("Glm4ForCausalLM", {"model_type": "glm4", "attention_bias": True,
                                 "partial_rotary_factor": 0.5}),
    "mixtral": ("MixtralForCausalLM", {"model_type": "mixtral", "intermediate_size": 32,
                                       "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {
        "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", {
        "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
        "norm_topk_prob": False}),
}


def _std(name: str, gemma_norms: bool) -> tuple[float, float]:
    """(mean, std) a tensor is drawn with, by its role."""
    if name.endswith("norm.weight"):
        # Gemma stores w of (1 + w); elsewhere w itself multiplies.
        qk = "q_norm" in name or "k_norm" in name
        return (0.0, 0.3) if gemma_norms else (1.0, 0.5 if qk else 0.1)
    if name.endswith(".bias"):
        return 0.0, 0.2
    if "embed_tokens" in name:
        # Gemma scales embeddings by sqrt(hidden) = 8 and normalises every
        # sublayer output: a small draw keeps the stream from drowning them.
        return 0.0, 0.05 if gemma_norms else 1.0
    if gemma_norms and ("q_proj" in name or "k_proj" in name):
        return 0.0, 0.5  # scores past the soft-cap
    if name.endswith("gate.weight"):  # MoE routers: tokens pick different experts
        return 0.0, 1.0
    if "lm_head" in name:
        return 0.0, 0.3
    return 0.0, 0.2


def make_tiny_checkpoint(path, family: str, *, seed: int = 0, **overrides) -> Path:
    """Write a tiny `family` checkpoint (TINY_FAMILIES) loadable by both
    transformers and workerd; overrides replace config fields."""
    import transformers

    arch, fields = TINY_FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = _save_tokenizer(path)
    if "text_config" in fields:  # a multimodal wrapper: the text fields nest
        text = {**_BASE, **fields["text_config"], **overrides, "vocab_size": vocab,
                "bos_token_id": 0, "eos_token_id": 1}
        cfg_fields = {**fields, "text_config": text, "architectures": [arch]}
    else:
        cfg_fields = {**_BASE, **fields, **overrides, "vocab_size": vocab,
                      "architectures": [arch]}
    model_type = cfg_fields.pop("model_type")
    # The tokenizer's <s> and </s>.
    config = transformers.AutoConfig.for_model(model_type, bos_token_id=0, eos_token_id=1,
                                               **cfg_fields)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float()
    g = torch.Generator().manual_seed(seed)
    gemma = model_type.startswith("gemma")
    with torch.no_grad():
        state = model.state_dict()
        for name in sorted(state):
            mean, std = _std(name, gemma)
            t = state[name]
            if t.is_floating_point():
                t.copy_(mean + std * torch.randn(t.shape, generator=g))
    model.save_pretrained(str(path), safe_serialization=True)
    return path
