"""Which attention implementation a worker runs, behind one small interface.

vLLM's `--attention-backend` names the kernel family; kvloom has three:

* `torch`: workerd/layers/attention/torch_sdpa.py, plain PyTorch (SDPA over gathered
  blocks). Runs everywhere and is the reference the others are checked against.
* `cpu`: workerd/layers/attention/cpu.py, a C kernel that attends straight
  from the cache blocks, built with the machine's C compiler on first use.
  CPU, float32 or bfloat16; calls it cannot take run the torch code.
* `flashinfer`: workerd/layers/attention/flashinfer.py, FlashInfer's paged-KV
  kernels. CUDA only, float16/bfloat16 only, and the package is optional,
  so it is imported only once selected.

`auto` picks flashinfer where it can run (a CUDA device, the package imports,
a dtype its kernels take), cpu on a CPU rank in float32 or bfloat16 whose
kernel builds,
and torch everywhere else. An explicit request that
cannot be honoured is refused rather than quietly downgraded: whoever asked
for flashinfer is measuring it.

Every backend is an AttentionBackend (workerd/layers/attention/interface.py):
it builds plans per forward from the step's AttentionMetadata (build_plan,
one per AttentionLayerKind the model's layers use), every layer runs with
its kind's (forward), and what it can do beyond that (rotary inside its
kernel, CUDA-graph decode, sliding windows, logit soft-caps) is declared in
its class's `capabilities`. All three read and write the same KV cache
layout, model.kv_cache_shape's [2, num_blocks, block_size, num_kv_heads,
head_dim].
"""

from __future__ import annotations

import logging

import torch

from workerd.layers.attention.interface import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionCapabilities,
    AttentionLayerKind,
)
from workerd.layers.attention.metadata import AttentionMetadata
from workerd.layers.attention.torch_sdpa import build_plan, paged_attention

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flashinfer")
# What the cpu kernel takes for q and the cache (cpu_paged_attention.c's entry points).
_CPU_DTYPES = (torch.float32, torch.bfloat16)
# What FlashInfer's kernels take for q and the cache.
_FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


class TorchAttentionBackend(AttentionBackend):
    """The plain-PyTorch paged attention; stateless but for the cache's width.
    Declares sliding windows and logit soft-caps (its plan's masks and its
    explicit soft-capped path), nothing else: q and k arrive rotated, and
    its plan is built on the host from each step's shapes, which a CUDA
    graph cannot replay."""

    name = "torch"
    capabilities = AttentionCapabilities(sliding_window=True, logits_soft_cap=True)

    def __init__(self, kv_width: int | None = None) -> None:
        # K elements per cached token on this rank (kv heads x head_dim); lets
        # the plan split decodes by what padding costs (torch_sdpa._group_rows).
        self.kv_width = kv_width

    def build_plan(self, md: AttentionMetadata, num_tokens: int,
                   kind: AttentionLayerKind = FULL_ATTENTION):
        self._check_kind(kind)
        return build_plan(md, num_tokens, self.kv_width, kind)

    def forward(self, q, k, v, kv_cache, md, scale, plan):
        return paged_attention(q, k, v, kv_cache, md, scale, plan)


def flashinfer_import_error() -> str | None:
    """None when `import flashinfer` works here, else why not (for the error
    that explains a refused request)."""
    try:
        import flashinfer  # noqa: F401 (availability probe)
    except Exception as exc:  # a broken build raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend this worker runs for a LoadModel's attention_backend: torch,
    cpu or flashinfer. ValueError, naming what to change, when the request is not
    one of ATTENTION_BACKENDS or asks for flashinfer where it cannot run.
    Empty means auto (a controlplane from before the field)."""
    requested = requested or "auto"
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {requested!r}; use one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if requested == "torch":
        return "torch"
    if requested == "cpu" or (requested == "auto" and device.type == "cpu"):
        return _resolve_cpu(requested == "cpu", device, dtype)
    explicit = requested == "flashinfer"
    if device.type != "cuda":
        if explicit:
            raise ValueError(
                f"attention backend 'flashinfer' needs a CUDA device but this worker runs on "
                f"{device}; start the controlplane with --attention-backend torch (or auto)"
            )
        return "torch"
    if dtype not in _FLASHINFER_DTYPES:
        if explicit:
            raise ValueError(
                f"attention backend 'flashinfer' takes float16 or bfloat16, not "
                f"{str(dtype).removeprefix('torch.')}; use --dtype bfloat16 or "
                f"--attention-backend torch"
            )
        return "torch"
    error = flashinfer_import_error()
    if error is not None:
        if explicit:
            raise ValueError(
                f"attention backend 'flashinfer' requested but the flashinfer package does not "
                f"import on this worker ({error}); install flashinfer-python built for this "
                f"torch and CUDA (pip install flashinfer-python), or use --attention-backend torch"
            )
        return "torch"
    return "flashinfer"


def _resolve_cpu(explicit: bool, device: torch.device, dtype: torch.dtype) -> str:
    # Imported here: the module compiles nothing at import, but keeps the
    # kernels' loader off CUDA ranks' start-up path.
    from workerd.kernels.loader import kernels_unavailable

    if device.type != "cpu" or dtype not in _CPU_DTYPES:
        if explicit:
            raise ValueError(
                f"attention backend 'cpu' runs on a CPU worker in float32 or bfloat16, not "
                f"{device.type} / {str(dtype).removeprefix('torch.')}; use --dtype float32 "
                f"or bfloat16, or --attention-backend torch (or auto)")
        return "torch"
    error = kernels_unavailable()
    if error is not None:
        if explicit:
            raise ValueError(
                f"attention backend 'cpu' requested but its kernel cannot be built on this "
                f"worker ({error}); install a C compiler (gcc) or use --attention-backend torch")
        # Slower, not wrong: said at load so an operator can see why.
        logger.warning("cpu kernels unavailable (%s); attention runs the torch backend", error)
        return "torch"
    return "cpu"


def backend_class(name: str) -> type[AttentionBackend]:
    """The class of a resolved backend name: what it declares, before (or
    without) building one. Importing it builds nothing (no kernel, no
    flashinfer import)."""
    if name == "torch":
        return TorchAttentionBackend
    if name == "cpu":
        from workerd.layers.attention.cpu import CpuAttentionBackend

        return CpuAttentionBackend
    if name == "flashinfer":
        from workerd.layers.attention.flashinfer import FlashInferBackend

        return FlashInferBackend
    raise ValueError(f"no attention backend {name!r}; resolve_attention_backend names one")


def make_attention_backend(name: str, device: torch.device,
                           kv_width: int | None = None) -> AttentionBackend:
    """The backend object for a resolved name (resolve_attention_backend's);
    kv_width: K elements per cached token on this rank."""
    cls = backend_class(name)
    # FlashInfer's workspace lives on the device; the others plan by the cache's width.
    return cls(device) if name == "flashinfer" else cls(kv_width)
