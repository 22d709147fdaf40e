"""The draft model's directory arrives in LoadModel, over the network: it is
read from safetensors only, never from a pickled checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kvloom_testing.checkpoints import make_tiny_llama
from workerd.runner.draft_model import DraftModelProposer


def test_a_pickled_checkpoint_is_never_loaded(tmp_path):
    path = make_tiny_llama(tmp_path / "draft", num_layers=1)
    DraftModelProposer(str(path), torch.float32, torch.device("cpu"), 2)  # safetensors: fine
    weights = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    torch.save(weights, path / "pytorch_model.bin")
    with pytest.raises(OSError):
        DraftModelProposer(str(path), torch.float32, torch.device("cpu"), 2)
