"""Set-up for tests that run torch in this process: one intra-op thread (the CI
box is shared) and the tiny Llama checkpoint that model, runner and daemon tests
load.

Only the conftests of the directories that run torch import this module (by
importing `tiny_model_dir` into their namespace), so the torch-free tests
(controlplane core, the kvloom client) run in an install without torch.
Directories that need only the checkpoint's files (a tokenizer, a model path
for daemons) call tiny_model_path from a fixture instead, importing it lazily.
"""

from __future__ import annotations

import pytest
import torch

from kvloom_testing.checkpoints import make_tiny_llama

torch.set_num_threads(1)

# Each conftest that imports the fixture defines its own session fixture; this
# keeps the checkpoint built once per session all the same.
_built: dict[str, str] = {}


def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    key = str(tmp_path_factory.getbasetemp())
    if key not in _built:
        _built[key] = str(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))
    return _built[key]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny LlamaForCausalLM checkpoint + tokenizer, built once per session."""
    return tiny_model_path(tmp_path_factory)
