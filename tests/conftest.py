"""Shared pytest fixtures: one-threaded torch (the CI box is shared) and the tiny
Llama checkpoint that every model/runner test loads."""

from __future__ import annotations

import pytest
import torch

from tests.factories import make_tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny LlamaForCausalLM checkpoint + tokenizer, built once per session."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))
