"""Which device a rank computes on, and a guard that two ranks of one host
never share a GPU by accident.

`--device cuda` picks the GPU from LOCAL_RANK when the launcher sets it
(torchrun, the Helm chart, `kvloom up`), else from the global rank modulo the
GPUs visible here, which is right only when ranks are numbered per host. A
rank then holds an exclusive lock on its GPU (an flock on a file named after
the GPU's UUID in the lock directory) for as long as the process lives: a
second rank that resolves to the same GPU fails its start-up with both
ranks named, instead of silently halving the memory each one profiled.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import torch

from workerd.cpu_features import native_bf16

# Locks live as long as their process: the kernel drops an flock when the
# file descriptor closes, also on SIGKILL, so a restarted rank can claim again.
_held: dict[str, int] = {}


def resolve_device(spec: str, rank: int, env: dict[str, str] | None = None) -> torch.device:
    env = os.environ if env is None else env
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec != "cuda":
        return torch.device(spec)
    count = max(1, torch.cuda.device_count())
    local = env.get("LOCAL_RANK", "")
    if local.isdigit():
        if int(local) >= count:
            raise ValueError(f"LOCAL_RANK={local} but only {count} GPU(s) are visible "
                             f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        return torch.device("cuda", int(local))
    return torch.device("cuda", rank % count)


def device_native_bf16(spec: str) -> bool:
    """Whether the device `spec` (--device) names runs bf16 matmuls natively:
    what this rank reports at registration (RegisterRequest.native_bf16),
    which the controlplane's --dtype auto reads."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return spec == "cpu" and native_bf16()


def claim_device(device: torch.device, rank: int, lock_dir: Path | None = None,
                 gpu_id: str | None = None) -> None:
    """Hold this process's exclusive lock on a CUDA device; ValueError naming
    the holder when another live rank has it. CPU devices are not claimed."""
    if device.type != "cuda":
        return
    gpu_id = gpu_id or _gpu_uuid(device)
    if gpu_id in _held:
        return  # this process claimed it already (a re-formed group)
    lock_dir = lock_dir or Path(tempfile.gettempdir())
    path = lock_dir / f"kvloom-gpu-{gpu_id}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ValueError(f"rank {rank}: {device} (GPU {gpu_id}) is already used by {holder}; "
                         f"give each rank its own GPU (--device cuda:N or LOCAL_RANK)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"rank {rank} (pid {os.getpid()})".encode(), 0)
    _held[gpu_id] = fd


def _gpu_uuid(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid else f"index{device.index}"
