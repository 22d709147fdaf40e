"""--dtype auto: the dtype every rank loads the model in, decided once by
the controlplane from the checkpoint and what the ranks reported at
registration (RegisterRequest.native_bf16), so all ranks agree (pipeline
stages hand each other activations in it).

A 16-bit checkpoint is served in bf16 when every rank runs bf16 natively (a
CPU with AVX-512 BF16 or AMX, a CUDA device with bf16): there bf16 matmuls
run at twice float32's rate or more. Anywhere else, or for a float32
checkpoint (or one that states no dtype), float32: a CPU without native bf16
only emulates it, no faster and less exact. A float16 checkpoint becomes
bf16, as vLLM's CPU build serves it: CPUs have no fast float16 matmul. An
explicit --dtype always wins.
"""

from __future__ import annotations

from collections.abc import Mapping

DTYPES = ("float32", "bfloat16", "float16")
SIXTEEN_BIT = ("bfloat16", "float16")


def resolve_dtype(requested: str, checkpoint_dtype: str,
                  native_bf16: Mapping[int, bool]) -> tuple[str, str]:
    """(dtype, why) for --dtype `requested`; checkpoint_dtype is config.json's
    ("" when it states none or one kvloom does not load), native_bf16 each
    attached rank's report."""
    if requested != "auto":
        return requested, f"--dtype {requested}"
    stated = checkpoint_dtype or "of no stated dtype"
    if checkpoint_dtype not in SIXTEEN_BIT:
        return "float32", f"--dtype auto: the checkpoint is {stated}"
    lacking = sorted(rank for rank, native in native_bf16.items() if not native)
    if lacking:
        return "float32", (f"--dtype auto: the checkpoint is {checkpoint_dtype}, but rank(s) "
                           f"{lacking} do not run bf16 natively (a CPU needs AVX-512 BF16 or "
                           f"AMX); pass --dtype bfloat16 to use it anyway")
    return "bfloat16", (f"--dtype auto: the checkpoint is {checkpoint_dtype} and every rank runs "
                        f"bf16 natively")
