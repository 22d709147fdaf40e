"""workerd's layers skip nn.Module's hook machinery (workerd/layers/direct_call.py):
calls still reach forward, every layer of a loaded model does it, and nothing
in workerd registers a hook that would silently not run."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from workerd.distributed.parallel_state import single_process_state
from workerd.layers.direct_call import DirectCallModule
from workerd.models.loader import load_model

WORKERD = Path(__file__).resolve().parents[3] / "workerd"


def test_every_layer_calls_forward_directly(tiny_model_dir):
    model = load_model(tiny_model_dir, single_process_state(), torch.float32)
    called = [m for m in model.modules()
              if type(m).forward is not nn.Module.forward and m is not model
              and not isinstance(m, nn.ModuleList)]
    assert called and all(isinstance(m, DirectCallModule) for m in called), [
        type(m).__name__ for m in called if not isinstance(m, DirectCallModule)]
    norm = model.layers[0].input_layernorm
    x = torch.randn(3, model.hidden_size)
    assert torch.equal(norm(x), norm.forward(x))


def test_no_hooks_in_workerd():
    offenders = [str(p.relative_to(WORKERD)) for p in WORKERD.rglob("*.py")
                 if "register_forward" in p.read_text() or "register_module_forward"
                 in p.read_text()]
    assert offenders == []
