"""GGUF file -> Hugging Face checkpoint directory, for the embedded models.

kvloom.common.embedded_models decides when and where (cache, lock, atomic
rename); this module does the conversion itself: the model in float32 from
transformers' own GGUF reader, safetensors, generation_config.json, the
tokenizer with its chat template, then a check of the written directory
against what the model's registry entry expects.

float32 because that is what the GGUF reader yields: it dequantizes every
block (Q4_K, Q5_0, Q6_K, ...) to float32 exactly, whereas rounding to bf16
would change weights and break the bit-for-bit parity with transformers that
the tests check. Daemons can still serve it in bf16 (--dtype).

A conversion's last file is its marker (MARKER_FILE): the cache trusts a
directory only when is_complete finds the marker with the entry's
conversion_version, so the marker's format is written and read here alone.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

from kvloom.common.embedded_model_spec import EmbeddedModel, EmbeddedModelError

MARKER_FILE = "kvloom-conversion.json"


def stage(message: str) -> None:
    """One progress line on stderr, so a first run is never silent."""
    print(f"kvloom: embedded model: {message}", file=sys.stderr, flush=True)


def load_gguf_model(source: Path | str):
    """Build the float32 model straight from the GGUF file.

    Uses transformers' own GGUF reader (config, name mapping, dequantization,
    Gemma's norm offset) but not `from_pretrained(gguf_file=...)`, which
    insists on `accelerate` only to place weights on devices, and marks the
    model GGUF-quantized so that save_pretrained refuses it. For the Gemma 3
    GGUF both routes give bit-identical tensors (checked with transformers 5.25).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source = Path(source)
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    # lm_head is absent from the GGUF because it is tied to the embedding.
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise EmbeddedModelError(
            f"GGUF tensors do not match the model: missing={missing} "
            f"unexpected={result.unexpected_keys}"
        )
    model.tie_weights()
    return model.eval()


def load_gguf_tokenizer(source: Path | str, chat_template: str):
    from transformers import AutoTokenizer

    source = Path(source)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def convert_gguf(spec: EmbeddedModel, source: Path, out_dir: Path) -> None:
    """Write the GGUF model as a safetensors Hugging Face directory into out_dir."""
    from transformers import GenerationConfig

    stage("1/4 reading and dequantizing GGUF weights")
    model = load_gguf_model(source)
    model.config.architectures = [type(model).__name__]
    # The GGUF's general.name is a training-run label; name the checkpoint instead.
    model.config._name_or_path = spec.dir_name
    stage("2/4 writing safetensors")
    # save_pretrained drops the tied lm_head.weight; the model was built from a
    # plain config, so no quantization_config reaches config.json.
    model.save_pretrained(out_dir, safe_serialization=True)
    generation = GenerationConfig.from_model_config(model.config)
    generation.update(**spec.generation)
    generation.save_pretrained(out_dir)
    stage("3/4 writing the tokenizer")
    tokenizer = load_gguf_tokenizer(source, spec.chat_template)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    stage("4/4 verifying the checkpoint")
    verify_model_dir(spec, out_dir)
    write_marker(spec, out_dir, dtype="float32")
    _make_readable(out_dir)


def _make_readable(out_dir: Path) -> None:
    # mkdtemp creates a private directory; daemons may run as another user
    # sharing the cache (a mounted volume), so open it up like a normal download.
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def verify_model_dir(spec: EmbeddedModel, model_dir: Path | str) -> None:
    """Check the config shape and that the chat template survived the round trip."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    wrong = {k: config.get(k) for k, v in spec.expected_config.items() if config.get(k) != v}
    if wrong:
        raise EmbeddedModelError(f"converted config differs from {spec.name}: {wrong}")
    if "quantization_config" in config:
        # transformers would try to load the directory as a quantized model.
        raise EmbeddedModelError(f"quantization_config left in {model_dir}/config.json")
    if not (model_dir / "model.safetensors").is_file():
        raise EmbeddedModelError(f"no model.safetensors written in {model_dir}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template or spec.chat_marker not in tokenizer.chat_template:
        raise EmbeddedModelError(f"chat template lost in {model_dir}")


def write_marker(spec: EmbeddedModel, out_dir: Path, dtype: str) -> None:
    """The last file of a conversion: its presence with this version means done."""
    try:
        source = f"{spec.distribution} {importlib.metadata.version(spec.distribution)}"
    except importlib.metadata.PackageNotFoundError:
        source = spec.distribution
    marker = {"version": spec.conversion_version, "model": spec.name, "source": source,
              "dtype": dtype}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def is_complete(spec: EmbeddedModel, target: Path) -> bool:
    """Whether target holds a finished conversion of spec's current version."""
    try:
        marker = json.loads((target / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("version") == spec.conversion_version
