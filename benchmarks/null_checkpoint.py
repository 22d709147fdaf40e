"""The config-only checkpoint the null-worker benchmarks serve
(benchmarks/control_plane.py, token_path_cpu.py): the controlplane reads only
config.json and the tokenizer, and null ranks load nothing, so a directory
with those two is a model at any TP up to 8 and PP up to its layers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json")
SYNTHETIC_VOCAB = 1024


def _synthetic_tokenizer(path: Path) -> int:
    """A word-level tokenizer ("<unk>", "</s>", "w2" ...); its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, SYNTHETIC_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 4096,
    }))
    return len(vocab)


def write_null_checkpoint(path: Path, tokenizer_from: str | None = None) -> str:
    """A checkpoint directory the controlplane accepts at any TP up to 8 and PP
    up to its layers: config.json (32 attention heads, 8 KV heads) and a
    tokenizer, copied from `tokenizer_from` or, with None, a synthetic one.
    No weights: null workers load nothing."""
    path.mkdir(parents=True, exist_ok=True)
    config: dict = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                    "max_position_embeddings": 8192, "num_hidden_layers": 30, "eos_token_id": 1}
    if tokenizer_from:
        src = Path(tokenizer_from)
        config.update(json.loads((src / "config.json").read_text()))
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, path / name)
    else:
        config["vocab_size"] = _synthetic_tokenizer(path)
    config["num_attention_heads"] = 32
    config["num_key_value_heads"] = 8
    config["num_hidden_layers"] = max(2, int(config.get("num_hidden_layers", 2)))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)
