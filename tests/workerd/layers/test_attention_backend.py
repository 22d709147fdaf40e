"""--attention-backend on the worker: which backend each request resolves to
on which device, the precise refusals (flashinfer where it cannot run, a
value outside the closed set from a hostile controlplane), and the model
hook (one plan per forward, every layer attends through the backend)."""

from __future__ import annotations

import sys

import pytest
import torch

from kvloom.common.ports import free_port
from kvloom.worker.v1 import worker_pb2
from kvloom_testing.attention import paged_step
from kvloom_testing.inprocess import limits_pb
from workerd.distributed.parallel_state import single_process_state
from workerd.layers.attention import backend as ab
from workerd.layers.attention.backend import (
    TorchAttentionBackend,
    resolve_attention_backend,
)
from workerd.layers.attention.cpu import CpuAttentionBackend
from workerd.layers.attention.interface import FULL_ATTENTION
from workerd.models.loader import load_model
from workerd.worker import Worker

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # CUDA: only a name here


@pytest.fixture
def flashinfer_missing(monkeypatch):
    """`import flashinfer` fails, whether or not this machine has it."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)


@pytest.fixture
def flashinfer_present(monkeypatch):
    monkeypatch.setattr(ab, "flashinfer_import_error", lambda: None)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """The cpu kernel cannot be built: no compiler and nothing cached."""
    from workerd.kernels import loader as cpu_kernels

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    cpu_kernels.load_kernels.cache_clear()
    yield
    cpu_kernels.load_kernels.cache_clear()


@pytest.mark.parametrize("requested", ["auto", "", "torch"])
def test_cpu_in_float16_resolves_to_torch(requested, flashinfer_present):
    assert resolve_attention_backend(requested, CPU, torch.float16) == "torch"


@pytest.mark.parametrize("requested", ["auto", ""])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_on_a_float32_or_bf16_cpu_takes_the_cpu_kernel(requested, dtype,
                                                            flashinfer_present):
    assert resolve_attention_backend(requested, CPU, dtype) == "cpu"
    assert resolve_attention_backend("torch", CPU, dtype) == "torch"
    assert resolve_attention_backend("cpu", CPU, dtype) == "cpu"


def test_auto_without_a_compiler_keeps_torch_and_says_why(no_compiler, caplog):
    with caplog.at_level("WARNING", logger=ab.__name__):
        assert resolve_attention_backend("auto", CPU, torch.float32) == "torch"
    assert any("cpu kernels unavailable (no C compiler" in r.getMessage() and
               "attention runs the torch backend" in r.getMessage() for r in caplog.records)


def test_cpu_without_a_compiler_says_what_to_install(no_compiler):
    with pytest.raises(ValueError) as err:
        resolve_attention_backend("cpu", CPU, torch.float32)
    message = str(err.value)
    assert message.startswith("attention backend 'cpu' requested but its kernel cannot be "
                              "built on this worker (no C compiler: ")
    assert "no-such-cc" in message and "--attention-backend torch" in message


@pytest.mark.parametrize("device,dtype,named", [
    (CPU, torch.float16, "cpu / float16"), (CUDA, torch.float32, "cuda / float32"),
    (CUDA, torch.bfloat16, "cuda / bfloat16")])
def test_cpu_backend_where_it_cannot_run_is_refused(device, dtype, named):
    with pytest.raises(ValueError) as err:
        resolve_attention_backend("cpu", device, dtype)
    assert str(err.value) == (
        f"attention backend 'cpu' runs on a CPU worker in float32 or bfloat16, not {named}; "
        f"use --dtype float32 or bfloat16, or --attention-backend torch (or auto)")


def test_auto_on_cuda_takes_flashinfer_only_where_it_runs(flashinfer_present):
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16) == "flashinfer"
    assert resolve_attention_backend("auto", CUDA, torch.float16) == "flashinfer"
    # FlashInfer has no float32 kernels: auto keeps the reference path.
    assert resolve_attention_backend("auto", CUDA, torch.float32) == "torch"
    assert resolve_attention_backend("torch", CUDA, torch.bfloat16) == "torch"


def test_auto_on_cuda_without_the_package_is_torch(flashinfer_missing):
    assert ab.flashinfer_import_error().startswith("ModuleNotFoundError")
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16) == "torch"


def test_flashinfer_on_cpu_says_it_needs_cuda(flashinfer_present):
    with pytest.raises(ValueError) as err:
        resolve_attention_backend("flashinfer", CPU, torch.bfloat16)
    assert str(err.value) == (
        "attention backend 'flashinfer' needs a CUDA device but this worker runs on cpu; "
        "start the controlplane with --attention-backend torch (or auto)")


def test_flashinfer_without_the_package_says_what_to_install(flashinfer_missing):
    with pytest.raises(ValueError) as err:
        resolve_attention_backend("flashinfer", CUDA, torch.bfloat16)
    message = str(err.value)
    assert message.startswith(
        "attention backend 'flashinfer' requested but the flashinfer package does not import "
        "on this worker (ModuleNotFoundError")
    assert "pip install flashinfer-python" in message and "--attention-backend torch" in message


def test_flashinfer_in_float32_is_refused(flashinfer_present):
    with pytest.raises(ValueError, match=r"takes float16 or bfloat16, not float32; use "
                                         r"--dtype bfloat16 or --attention-backend torch"):
        resolve_attention_backend("flashinfer", CUDA, torch.float32)


@pytest.mark.parametrize("hostile", ["FLASH_ATTN", "Torch", "flashinfer ", "x" * 4096, "\x00"])
def test_values_outside_the_closed_set_are_refused(hostile, flashinfer_present):
    with pytest.raises(ValueError) as err:
        resolve_attention_backend(hostile, CUDA, torch.bfloat16)
    assert str(err.value) == (
        f"unknown attention backend {hostile!r}; use one of auto, torch, cpu, flashinfer")


def _loaded_worker(model_dir: str, backend: str) -> tuple[Worker, worker_pb2.WorkerMessage]:
    worker = Worker("cpu")
    init = worker_pb2.InitDistributed(
        master_addr="127.0.0.1", master_port=free_port(), world_size=1, rank=0,
        tensor_parallel_size=1, pipeline_parallel_size=1, timeout_s=30)
    worker.handle(worker_pb2.ControlMessage(call_id=1, init_distributed=init))
    load = worker_pb2.LoadModel(model_path=model_dir, dtype="float32", limits=limits_pb(),
                                attention_backend=backend)
    return worker, worker.handle(worker_pb2.ControlMessage(call_id=2, load_model=load))


@pytest.mark.parametrize(("backend", "expected"), [
    ("bogus", "CommandError: unknown attention backend 'bogus'; use one of auto, torch, cpu, "
              "flashinfer"),
    ("flashinfer", "CommandError: attention backend 'flashinfer' needs a CUDA device but this "
                   "worker runs on cpu; start the controlplane with --attention-backend torch "
                   "(or auto)"),
])
def test_worker_refuses_before_loading(tiny_model_dir, backend, expected):
    worker, reply = _loaded_worker(tiny_model_dir, backend)
    try:
        assert reply.WhichOneof("payload") == "error", reply
        assert (reply.error.kind, reply.error.message) == ("load_model", expected)
        assert worker.runner is None
    finally:
        worker.close()


def test_worker_runs_the_cpu_kernel_on_cpu_and_auto_reuses_it(tiny_model_dir):
    worker, reply = _loaded_worker(tiny_model_dir, "")  # an older controlplane: auto
    try:
        assert reply.model_loaded.reused is False
        model = worker.runner.model
        assert isinstance(model.attn_backend, CpuAttentionBackend)
        assert all(layer.self_attn.attn_backend is model.attn_backend for layer in model.layers)
        # Explicit cpu resolves to what auto did here: the same model, kept;
        # torch is another backend, so another model.
        for call_id, (backend, reused) in enumerate([("cpu", True), ("torch", False)], 3):
            load = worker_pb2.LoadModel(model_path=tiny_model_dir, dtype="float32",
                                        limits=limits_pb(), attention_backend=backend)
            again = worker.handle(worker_pb2.ControlMessage(call_id=call_id, load_model=load))
            assert again.model_loaded.reused is reused
            assert (worker.runner.model is model) is reused
        assert isinstance(worker.runner.model.attn_backend, TorchAttentionBackend)
    finally:
        worker.close()


class _Recording(TorchAttentionBackend):
    def __init__(self):
        super().__init__()
        self.plans, self.layers_seen = [], []

    def build_plan(self, md, num_tokens, kind=FULL_ATTENTION):
        plan = super().build_plan(md, num_tokens, kind)
        self.plans.append(plan)
        return plan

    def forward(self, q, k, v, kv_cache, md, scale, plan):
        self.layers_seen.append((plan, kv_cache.data_ptr()))
        return super().forward(q, k, v, kv_cache, md, scale, plan)


@torch.inference_mode()
def test_every_layer_attends_through_the_backend_with_one_plan(tiny_model_dir):
    model = load_model(tiny_model_dir, single_process_state(), torch.float32)
    caches = [torch.zeros(model.kv_cache_shape(8, 4)) for _ in range(model.num_local_layers)]
    steps = [([5, 6, 7, 8, 9], 0, 5), ([3, 4], 0, 2)]
    reference = paged_step(model, [c.clone() for c in caches], steps, [[0, 1], [2]], 4)
    recording = _Recording()
    model.set_attention_backend(recording)
    logits = paged_step(model, caches, steps, [[0, 1], [2]], 4)
    assert torch.equal(logits, reference)
    (plan,) = recording.plans
    assert recording.layers_seen == [(plan, c.data_ptr()) for c in caches]
