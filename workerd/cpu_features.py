"""What this CPU can do natively, read once from the kernel's flags: the
instruction sets that decide how fast a dtype runs here.

bf16 is native where the CPU has AVX-512 BF16 (dot products of bf16 pairs
into float32) or AMX (bf16 tile matmuls): oneDNN's bf16 matmuls then run at
twice float32's rate or more. Elsewhere (AVX2 only, or AVX-512 without BF16)
oneDNN emulates bf16 through float32 conversions, so a bf16 model is no
faster than float32 and loses precision: the worker packs bf16 weights only
where bf16 is native (workerd/layers/packed_linear.py), and benchmarks name
the instruction set beside every figure (isa_summary).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# Flags that make bf16 matmuls native, in /proc/cpuinfo's spelling.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# The widest vector instruction sets, widest first, for a one-word summary.
_ISA_STEPS = ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx2", "avx", "sse4_2")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether bf16 matmuls run natively here (AVX-512 BF16 or AMX)."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def isa_summary(flags: frozenset[str] | None = None) -> str:
    """The instruction sets that matter for speed, e.g. "avx512_bf16+avx512_vnni"
    or "avx2" (the machine's architecture where no x86 flag is known)."""
    flags = cpu_flags() if flags is None else flags
    present = [f for f in _ISA_STEPS if f in flags]
    if not present:
        return platform.machine() or "unknown"
    widest = present[0]
    extras = [f for f in ("avx512_bf16", "avx512_vnni") if f in present and f != widest]
    return "+".join([widest, *extras])


def cpu_model_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), for benchmark records; ""
    where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""
