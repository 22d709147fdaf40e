"""kvloom's C kernels for CPU ranks: built on the worker, loaded with ctypes.

workerd/kernels/*.c (paged attention, the fused residual-add + RMSNorm
and SiLU-and-mul around the matmuls, batched multi-LoRA) are plain C with
no torch headers, so the machine's own compiler (`$CC`, else `cc`) builds
them quickly, for this very CPU (-march=native), the first time a worker
needs them. The library is cached under the kvloom cache directory, keyed
by the sources, the flags, the compiler's version and the CPU's feature
flags, so a cache on shared storage or an image moved between hosts never
runs code built for another CPU. Without a compiler they are unavailable,
and the caller says what that means (workerd/layers/attention/backend.py:
`auto` keeps the torch backend, an explicit `cpu` is refused with the
reason).

Nothing here is ever handed a pointer it has not checked the shape of; the
attention kernel also checks every index of the step's metadata itself.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: F401  (loaded first: its libgomp is the one the kernels bind to)

from kvloom.common.default_model import cache_root

KERNELS_DIR = Path(__file__).resolve().parent
SOURCES = tuple(KERNELS_DIR / name for name in (
    "cpu_paged_attention.c", "cpu_elementwise.c", "cpu_lora.c"))
HEADERS = tuple(KERNELS_DIR / name for name in (
    "cpu_math.h", "cpu_bf16.h", "cpu_parallel.h", "cpu_attend_avx512bf16.h",
    "cpu_lora_vec.h", "cpu_lora_shrink.h", "cpu_lora_expand.h"))
# No -ffast-math: a shared object built with it may switch the whole process
# to flush-to-zero when loaded (GCC 12 links crtfastmath.o), changing
# torch's own results.
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
# The attention kernel shares a call's work among OpenMP threads. The library
# needs libgomp.so.1, and the one already in the process is torch's (imported
# above, before any kernel is loaded), so both use one pool of threads: the
# kernel's never spin against torch's for the same cores. A compiler without
# OpenMP builds the kernels single-threaded instead.
OPENMP_FLAGS = ("-fopenmp",)
COMPILE_TIMEOUT_S = 120.0
LIBRARY_NAME = "kvloom_cpu_kernels"
logger = logging.getLogger(__name__)

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# name -> (restype, argtypes), as declared in the sources. Each takes last the
# threads it may use (torch.get_num_threads() at the call).
_SIGNATURES = {
    "kvloom_paged_attention_f32": (ctypes.c_int, [
        _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR,
        _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _F32, _PTR, _PTR, _PTR, _I64]),
    # The same arguments, the arrays bfloat16.
    "kvloom_paged_attention_bf16": (ctypes.c_int, [
        _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR,
        _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _F32, _PTR, _PTR, _PTR, _I64]),
    "kvloom_rms_norm_f32": (None, [
        _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _F32, _PTR, _PTR, _I64]),
    "kvloom_silu_and_mul_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _I64]),
    "kvloom_gelu_tanh_and_mul_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _I64]),
    # The elementwise kernels again with bfloat16 arrays (the last norm's weight float32).
    "kvloom_rms_norm_bf16": (None, [
        _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _F32, _PTR, _PTR, _I64]),
    "kvloom_rms_norm_bf16_f32_weight": (None, [
        _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _F32, _PTR, _PTR, _I64]),
    "kvloom_silu_and_mul_bf16": (None, [_PTR, _I64, _I64, _I64, _PTR, _I64]),
    "kvloom_gelu_tanh_and_mul_bf16": (None, [_PTR, _I64, _I64, _I64, _PTR, _I64]),
    # Batched multi-LoRA (cpu_lora.c): x, x_stride, n_rows, n_in, y, y_stride, n_y,
    # segments, num_segments, table, num_adapters, num_parts; 0 or an error code.
    "kvloom_lora_add_f32": (ctypes.c_int, [
        _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64]),
    "kvloom_lora_add_bf16": (ctypes.c_int, [
        _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64]),
}


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here; the message says why."""


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library's entry points (ctypes functions with their types)."""

    paged_attention: ctypes._CFuncPtr
    paged_attention_bf16: ctypes._CFuncPtr
    rms_norm: ctypes._CFuncPtr
    silu_and_mul: ctypes._CFuncPtr
    gelu_tanh_and_mul: ctypes._CFuncPtr
    rms_norm_bf16: ctypes._CFuncPtr
    rms_norm_bf16_f32_weight: ctypes._CFuncPtr
    silu_and_mul_bf16: ctypes._CFuncPtr
    gelu_tanh_and_mul_bf16: ctypes._CFuncPtr
    lora_add: ctypes._CFuncPtr
    lora_add_bf16: ctypes._CFuncPtr


def _cpu_flags() -> str:
    # -march=native code must not be reused on a CPU with other features.
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
        for extra in (OPENMP_FLAGS, ()):
            done = subprocess.run([compiler, *CFLAGS, *extra, "-o", tmp, *map(str, SOURCES),
                                   "-lm"], capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S)
            if done.returncode == 0:
                if not extra:
                    logger.warning("%s cannot build with %s; the attention kernel runs on "
                                   "one thread", compiler, " ".join(OPENMP_FLAGS))
                break
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed to build {LIBRARY_NAME}: "
                                    f"{done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"cannot build {LIBRARY_NAME} with {compiler}: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_kernels() -> CpuKernels:
    """The kernels (built on first use, then cached on disk).
    KernelUnavailable when there is no working C compiler."""
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
        *(p.read_text() for p in (*SOURCES, *HEADERS)), " ".join(CFLAGS + OPENMP_FLAGS), path,
        *version,
        platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{LIBRARY_NAME}-{key}.so"
    if not target.exists():
        t0 = time.monotonic()
        _compile(path, target)
        logger.info("built %s with %s in %.1f s", target, compiler, time.monotonic() - t0)
    try:
        lib = ctypes.CDLL(str(target))
        fns = {}
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            fns[name.removeprefix("kvloom_").removesuffix("_f32")] = fn
    except (OSError, AttributeError) as exc:
        raise KernelUnavailable(f"cannot load {target}: {exc}") from None
    return CpuKernels(**fns)


def kernels_unavailable() -> str | None:
    """None when the kernels build and load here, else why not."""
    try:
        load_kernels()
    except KernelUnavailable as exc:
        return str(exc)
    return None
