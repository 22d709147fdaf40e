"""A tiny, deterministic Llama checkpoint (config + safetensors + tokenizer)
written to disk with no download, for tests and benchmarks.

The checkpoint is a real Hugging Face directory, so the same files feed
transformers' reference LlamaForCausalLM and workerd's own implementation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# A fixed corpus makes the trained BPE merges (and so token ids) identical on
# every run; keep it plain English so prompts in tests tokenize into real merges.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A scheduler decides which requests run in the next step of the engine.",
    "Every worker holds a shard of the model weights and a slice of the cache.",
    "Blocks of keys and values are stored in a paged cache, one block at a time.",
    "The river flows past the old mill, and the children play on the green hill.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    "Once upon a time there was a little robot who wanted to learn how to paint.",
    "The weather today is sunny with a gentle breeze from the west.",
    "Numbers like one, two, three, four, five, six, seven, eight, nine and ten.",
    "In the morning we drink coffee, in the evening we read books by the fire.",
    "Tensor parallel layers split matrices by rows or columns across ranks.",
    "Pipeline stages pass hidden states from one group of layers to the next.",
    "Hello world! How are you doing today? I am doing well, thank you very much.",
    "The cat sat on the mat while the dog slept under the kitchen table.",
    "Large language models predict the next token given all previous tokens.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.",
    "Red, orange, yellow, green, blue, indigo and violet are colors of the rainbow.",
    "def forward(self, input_ids, positions): return self.model(input_ids, positions)",
]

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
# Odd on purpose: with TP=2 the vocab-parallel layers must pad the vocabulary.
TOKENIZER_VOCAB_SIZE = 511


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def _save_tokenizer(path: Path) -> int:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(), bos_token=BOS_TOKEN, eos_token=EOS_TOKEN
    )
    fast.save_pretrained(str(path))
    return len(fast)


def _init_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 weights. Scales are larger than a real init so a 4-layer
    random model still produces peaked, varied next-token distributions."""
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def randn(*shape, std):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    def norm_weight():
        return (1.0 + randn(h, std=0.1)).contiguous()

    w = {"model.embed_tokens.weight": randn(cfg["vocab_size"], h, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "self_attn.q_proj.weight"] = randn(nq * hd, h, std=0.25)
        w[p + "self_attn.k_proj.weight"] = randn(nkv * hd, h, std=0.25)
        w[p + "self_attn.v_proj.weight"] = randn(nkv * hd, h, std=0.15)
        w[p + "self_attn.o_proj.weight"] = randn(h, nq * hd, std=0.15)
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        w[p + "mlp.gate_proj.weight"] = randn(inter, h, std=0.15)
        w[p + "mlp.up_proj.weight"] = randn(inter, h, std=0.15)
        w[p + "mlp.down_proj.weight"] = randn(h, inter, std=0.1)
    w["model.norm.weight"] = norm_weight()
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = randn(cfg["vocab_size"], h, std=0.3)
    return w


def _save_weights(path: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    if num_shards <= 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    weight_map = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::num_shards]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_tiny_llama(
    path,
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 512,
    num_shards: int = 1,
) -> Path:
    """Write a tiny LlamaForCausalLM checkpoint dir loadable by both
    transformers and workerd. vocab_size defaults to the tokenizer's size and
    may only be larger (extra rows are never produced by the tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok_size = _save_tokenizer(path)
    if vocab_size is None:
        vocab_size = tok_size
    if vocab_size < tok_size:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {tok_size}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        # transformers 4.x reads rope_scaling; 5.x reads rope_parameters.
        "rope_scaling": rope if rope_scaling else None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "vocab_size": vocab_size,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "dtype": "float32",
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    _save_weights(path, _init_weights(cfg, seed), num_shards)
    return path
