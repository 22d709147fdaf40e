"""Custom ops (workerd/layers/custom_op.py): which implementation the norms
and the MLP activation run is chosen once per rank at load, and it is the
choice the model made before the ops had their own rule: the C kernels
exactly on the ranks whose attention resolved to the cpu backend (they used
to be lent by that backend object), torch code everywhere else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom_testing.inprocess import runner_limits
from workerd.distributed.parallel_state import single_process_state
from workerd.kernels.loader import load_kernels
from workerd.layers.activation import SiluAndMul
from workerd.layers.attention import backend as ab
from workerd.layers.attention.backend import resolve_attention_backend
from workerd.layers.custom_op import CustomOp, rank_kernels
from workerd.layers.layernorm import RMSNorm
from workerd.runner.model_runner import ModelRunner

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # CUDA: only a name here


@pytest.fixture
def flashinfer_present(monkeypatch):
    monkeypatch.setattr(ab, "flashinfer_import_error", lambda: None)


@pytest.mark.parametrize(("device", "dtype", "requested", "c_kernels"), [
    (CPU, torch.float32, "auto", True),
    (CPU, torch.float32, "", True),
    (CPU, torch.float32, "cpu", True),
    (CPU, torch.float32, "torch", False),  # the pure-torch reference, end to end
    (CPU, torch.bfloat16, "auto", True),
    (CPU, torch.bfloat16, "cpu", True),
    (CPU, torch.bfloat16, "torch", False),
    (CPU, torch.float16, "auto", False),  # torch: the kernels read float32 and bfloat16
    (CPU, torch.float16, "torch", False),
    (CUDA, torch.bfloat16, "auto", False),  # flashinfer
    (CUDA, torch.float16, "flashinfer", False),
    (CUDA, torch.float32, "auto", False),  # torch
    (CUDA, torch.bfloat16, "torch", False),
])
def test_the_c_kernels_run_where_the_cpu_backend_did_before(device, dtype, requested,
                                                           c_kernels, flashinfer_present):
    resolved = resolve_attention_backend(requested, device, dtype)
    kernels = rank_kernels(device, dtype, resolved)
    assert (kernels is not None) == c_kernels == (resolved == "cpu")
    if c_kernels:
        assert kernels is load_kernels()


def test_without_a_compiler_no_op_runs_c(monkeypatch, tmp_path):
    from workerd.kernels import loader

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    loader.load_kernels.cache_clear()
    try:
        resolved = resolve_attention_backend("auto", CPU, torch.float32)
        assert resolved == "torch" and rank_kernels(CPU, torch.float32, resolved) is None
    finally:
        loader.load_kernels.cache_clear()


def _bound(op: CustomOp) -> str:
    return op._forward_method.__func__.__name__


@pytest.mark.parametrize(("backend", "impl"), [("cpu", "forward_cpu"),
                                               ("torch", "forward_native")])
def test_the_runner_binds_every_op_once_at_load(tiny_model_dir, backend, impl):
    runner = ModelRunner(single_process_state(), tiny_model_dir, torch.float32, 0,
                         limits=runner_limits(), attention_backend=backend)
    runner.load_model()
    model = runner.model
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    # Two norms and one activation per layer, and the final norm.
    assert len(ops) == 3 * model.num_local_layers + 1
    assert {type(op) for op in ops} == {RMSNorm, SiluAndMul}
    assert {_bound(op) for op in ops} == {impl}
    kernels = load_kernels() if backend == "cpu" else None
    assert all(op.kernels is kernels for op in ops)


def test_both_implementations_agree_and_the_cpu_one_falls_back(tmp_path):
    g = torch.Generator().manual_seed(0)
    act, norm = SiluAndMul(), RMSNorm(24, 1e-5)
    norm.weight.data.copy_(torch.randn(24, generator=g))
    x, res = torch.randn(5, 48, generator=g), torch.randn(5, 24, generator=g)
    gate, up = x.chunk(2, dim=-1)
    native_act, native_norm = act(x), norm(x[:, :24], res)
    assert torch.equal(native_act, F.silu(gate) * up)
    for op in (act, norm):
        op.use_kernels(load_kernels())
    torch.testing.assert_close(act(x), native_act, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(norm(x[:, :24], res), native_norm, rtol=2e-6, atol=2e-6)
    # Tensors the C code does not take (bf16) run the torch code, bitwise.
    bf = x.bfloat16()
    assert torch.equal(act(bf), SiluAndMul()(bf))
    act.use_kernels(None)
    assert _bound(act) == "forward_native" and act.kernels is None
