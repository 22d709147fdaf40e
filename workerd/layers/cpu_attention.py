"""The `cpu` attention backend: paged attention in one C call per layer.

The torch backend (workerd/layers/attention.py) spends a dozen dispatches a
layer on what is one loop: gather each group's context blocks into a padded
copy, build masks, call SDPA, copy the output back. On a SmolLM2 served step
that was ~16 % of the worker's time for ~3 % of its arithmetic. The kernel
(workerd/kernels/cpu_paged_attention.c) writes the step's K/V into their
slots and attends every query straight from the cache blocks, with no copy,
mask or padding: 3.3x faster than the torch backend's attention on a mixed
step of 12 decodes and 2 prefill chunks (benchmarks/attention_kernels.py).

It is plain C built with the machine's own compiler (`$CC`, else `cc`) the
first time a worker needs it, for this very CPU (-march=native), and cached
under the kvloom cache directory keyed by the source, the flags, the
compiler's version and the CPU's feature flags; no torch headers, so it
builds in about a second. Without a compiler `auto` keeps the torch backend;
an explicit `--attention-backend cpu` is refused with the reason.

float32 only (the cache, q, k and v), head_dim a multiple of 8; anything else
(the memory-profiling forward without a cache, say) runs the torch backend's
code for that call. The kernel checks every index it is given (slots, block
ids, lengths against the block table) before it writes anything, and a step
that fails the check is refused with ValueError rather than read out of
bounds.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvloom.server.default_model import cache_root
from workerd.attn_metadata import AttentionMetadata
from workerd.layers.attention import build_plan, paged_attention

KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "cpu_paged_attention.c"
# No -ffast-math: a shared object built with it may switch the whole process
# to flush-to-zero when loaded (GCC 12 links crtfastmath.o), changing
# torch's own results.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
COMPILE_TIMEOUT_S = 120.0
# The kernel's return codes (cpu_paged_attention.c) -> what was wrong.
_ERRORS = {
    1: "sizes or strides the kernel does not take",
    2: "query_start_loc does not run from 0 to num_actual_tokens in non-decreasing steps",
    3: "a request's seq_len is shorter than its query or longer than its block table",
    4: "a block id outside the KV cache",
    5: "a slot outside the KV cache",
    6: "out of memory",
}
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ARGTYPES = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR,
             _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _PTR]


class KernelUnavailable(RuntimeError):
    """The C kernel cannot be built or loaded here; the message says why."""


def _cpu_flags() -> str:
    # -march=native code must not be reused on a CPU with other features
    # (a cache directory on shared storage, an image moved between hosts).
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed into place: ranks starting
    # together never load a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=out.stem, suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *CFLAGS, "-o", tmp, str(KERNEL_SOURCE), "-lm"],
                              capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed to build {KERNEL_SOURCE.name}: "
                                    f"{done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"cannot build {KERNEL_SOURCE.name} with {compiler}: {exc}") \
            from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_kernel():
    """The compiled kernel's entry point (built on first use, then cached on
    disk). KernelUnavailable when there is no working C compiler."""
    compiler = os.environ.get("CC") or "cc"
    path = shutil.which(compiler)
    if path is None:
        raise KernelUnavailable(f"no C compiler: {compiler!r} is not on PATH "
                                f"(install gcc, or set CC)")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"{compiler} --version failed: {exc}") from None
    key = hashlib.sha256("\0".join([
        KERNEL_SOURCE.read_text(), " ".join(CFLAGS), path, *version, platform.machine(),
        _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"cpu_paged_attention-{key}.so"
    if not target.exists():
        _compile(path, target)
    try:
        fn = ctypes.CDLL(str(target)).kvloom_paged_attention_f32
    except (OSError, AttributeError) as exc:
        raise KernelUnavailable(f"cannot load {target}: {exc}") from None
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    return fn


def kernel_unavailable() -> str | None:
    """None when the kernel builds and loads here, else why not."""
    try:
        load_kernel()
    except KernelUnavailable as exc:
        return str(exc)
    return None


def _int64_table(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int64 or t.device.type != "cpu" or (t.dim() and t.stride(-1) != 1):
        t = t.to(device="cpu", dtype=torch.int64).contiguous()
    return t


class CpuAttentionPlan:
    """One step's metadata as the kernel reads it (int64 arrays on the host,
    kept alive here), and the torch backend's plan, built only if a call
    falls back to it."""

    def __init__(self, md: AttentionMetadata, num_tokens: int, kv_width: int | None):
        self.md, self.num_tokens, self._kv_width = md, num_tokens, kv_width
        self._torch_plan = None
        self.slot_mapping = _int64_table(md.slot_mapping)
        self.query_start_loc = _int64_table(md.query_start_loc)
        self.seq_lens = _int64_table(md.seq_lens)
        table = md.block_table
        if table.dim() != 2:
            raise ValueError(f"block_table must be 2-D, got shape {tuple(table.shape)}")
        self.block_table = _int64_table(table)
        n, reqs = md.num_actual_tokens, md.num_reqs
        # The kernel indexes these up to num_reqs / num_actual_tokens.
        if (self.query_start_loc.numel() < reqs + 1 or self.seq_lens.numel() < reqs
                or self.block_table.shape[0] < reqs or self.slot_mapping.numel() < n
                or n > num_tokens):
            raise ValueError(
                f"attention metadata too short for {reqs} requests and {n} tokens: "
                f"query_start_loc {self.query_start_loc.numel()}, seq_lens "
                f"{self.seq_lens.numel()}, block_table rows {self.block_table.shape[0]}, "
                f"slot_mapping {self.slot_mapping.numel()}, num_tokens {num_tokens}")
        self.args = (self.slot_mapping.data_ptr(), num_tokens, n,
                     self.query_start_loc.data_ptr(), self.seq_lens.data_ptr(), reqs,
                     self.block_table.data_ptr(), self.block_table.stride(0),
                     self.block_table.shape[1])

    def torch_plan(self):
        if self._torch_plan is None:
            self._torch_plan = build_plan(self.md, self.num_tokens, self._kv_width)
        return self._torch_plan


def _rows(t: torch.Tensor, head_dim: int) -> bool:
    """[tokens, heads, head_dim] float32 on the host with heads contiguous."""
    return (t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 3
            and t.stride(2) == 1 and t.stride(1) == head_dim)


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, kv_width: int | None = None) -> None:
        self._kernel = load_kernel()  # KernelUnavailable here, not mid-step
        self.kv_width = kv_width

    def build_plan(self, md: AttentionMetadata, num_tokens: int) -> CpuAttentionPlan:
        return CpuAttentionPlan(md, num_tokens, self.kv_width)

    def forward(self, q, k, v, kv_cache, md, scale, plan: CpuAttentionPlan):
        num_tokens, num_heads, head_dim = q.shape
        if not (kv_cache is not None and kv_cache.numel() > 0 and md.num_reqs > 0
                and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous()
                and kv_cache.device.type == "cpu" and head_dim % 8 == 0
                and _rows(q, head_dim) and _rows(k, head_dim) and _rows(v, head_dim)
                and k.shape == v.shape == (num_tokens, *kv_cache.shape[3:])
                and num_tokens == plan.num_tokens):
            return paged_attention(q, k, v, kv_cache, md, scale, plan.torch_plan())
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        out = torch.empty(num_tokens, num_heads * head_dim)
        rc = self._kernel(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                          v.stride(0), kv_cache.data_ptr(), num_blocks, block_size, *plan.args,
                          num_heads, num_kv_heads, head_dim, scale, out.data_ptr())
        if rc:
            raise ValueError(f"cpu attention refused the step: {_ERRORS.get(rc, rc)}")
        return out
