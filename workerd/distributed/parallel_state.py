"""Process-group plumbing for one workerd rank: who this rank is in the TP x PP
grid, the collectives tensor-parallel layers use (all-reduce, all-gather), and
the point-to-point hand-off of hidden states between pipeline stages.

Rank layout follows vLLM: rank = pp_rank * tp_size + tp_rank, so the ranks of a
TP group are contiguous and TP rank 0 of the last PP stage is the output rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_ARRIVED_KEY = "kvloom/arrived/{}"


@dataclass
class ParallelState:
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    device: torch.device
    # None when tp_size == 1: no collective is ever issued then.
    tp_group: Any = None
    pp_prev_rank: int | None = None
    pp_next_rank: int | None = None
    # True only when this state called init_process_group (and so must destroy it).
    owns_process_group: bool = False

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        return self.tp_rank == 0 and self.is_last_pp_rank


@dataclass
class IntermediateTensors:
    """What a non-last PP stage hands to the next: the residual stream is kept
    separate because the next layer's RMSNorm fuses the residual add."""

    hidden_states: torch.Tensor
    residual: torch.Tensor


_CPU = torch.device("cpu")


def single_process_state(device: torch.device | str = _CPU) -> ParallelState:
    return ParallelState(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        tp_rank=0,
        pp_rank=0,
        device=torch.device(device),
    )


def _rendezvous(
    rank: int, world_size: int, master_addr: str, master_port: int, timeout: timedelta
) -> dist.TCPStore:
    """Connect to rank 0's TCPStore and wait for every rank to check in, so a
    missing rank is reported by number instead of as an opaque NCCL/gloo hang."""
    where = f"{master_addr}:{master_port}"
    try:
        store = dist.TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=(rank == 0),
            timeout=timeout,
            wait_for_workers=False,
        )
    except Exception as e:  # DistStoreError / RuntimeError / OSError depending on the failure
        who = "could not host" if rank == 0 else "could not reach rank 0's"
        raise RuntimeError(
            f"rank {rank}: {who} TCPStore at {where} within {timeout.total_seconds():.0f}s: {e}"
        ) from e
    store.set(_ARRIVED_KEY.format(rank), "1")
    keys = [_ARRIVED_KEY.format(r) for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except Exception as e:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(
            f"rank {rank}: ranks {missing} of world_size {world_size} did not arrive at "
            f"the rendezvous {where} within {timeout.total_seconds():.0f}s"
        ) from e
    return store


def init_parallel_state(
    rank: int,
    world_size: int,
    tp_size: int,
    pp_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    device: torch.device,
) -> ParallelState:
    """Join the worker group: rendezvous through rank 0's TCPStore, init the
    world process group (nccl on CUDA, gloo otherwise) and this rank's TP group.
    timeout_s bounds the rendezvous and, as the process-group timeout, every
    collective and PP send/recv afterwards, so a lost peer surfaces as an error
    instead of a hang. world_size 1 touches no torch.distributed state."""
    if tp_size * pp_size != world_size:
        raise ValueError(f"tp_size {tp_size} x pp_size {pp_size} != world_size {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    device = torch.device(device)
    if world_size == 1:
        return single_process_state(device)
    timeout = timedelta(seconds=timeout_s)
    store = _rendezvous(rank, world_size, master_addr, master_port, timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    if tp_size > 1:
        # new_group is collective over the world: every rank creates every group
        # in the same order and keeps only its own.
        for p in range(pp_size):
            ranks = list(range(p * tp_size, (p + 1) * tp_size))
            group = dist.new_group(ranks)
            if p == pp_rank:
                tp_group = group
    return ParallelState(
        rank=rank,
        world_size=world_size,
        tp_size=tp_size,
        pp_size=pp_size,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        device=device,
        tp_group=tp_group,
        pp_prev_rank=rank - tp_size if pp_rank > 0 else None,
        pp_next_rank=rank + tp_size if pp_rank < pp_size - 1 else None,
        owns_process_group=True,
    )


def rebind_parallel_state(ps: ParallelState, new: ParallelState) -> bool:
    """Point ps (which the loaded model's layers hold) at new's process groups,
    when both describe the same place in the same grid; False otherwise.

    This is how a surviving rank keeps its weights across a group failure:
    its shard is only valid at the same (rank, tp, pp) coordinates."""
    same = (ps.rank, ps.world_size, ps.tp_size, ps.pp_size, ps.device) == (
        new.rank, new.world_size, new.tp_size, new.pp_size, new.device)
    if same:
        ps.tp_group = new.tp_group
        ps.owns_process_group = new.owns_process_group
    return same


def destroy_parallel_state(ps: ParallelState) -> None:
    if ps.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    ps.owns_process_group = False
    ps.tp_group = None


def tp_all_reduce(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    if ps.tp_size == 1:
        return x
    dist.all_reduce(x, group=ps.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, ps: ParallelState, dim: int = -1) -> torch.Tensor:
    if ps.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ps.tp_size)]
    dist.all_gather(parts, x, group=ps.tp_group)
    return torch.cat(parts, dim=dim)


def send_intermediate(t: IntermediateTensors, ps: ParallelState) -> None:
    if ps.pp_next_rank is None:
        raise RuntimeError(f"rank {ps.rank} is the last PP stage; nothing to send to")
    dist.send(t.hidden_states.contiguous(), dst=ps.pp_next_rank)
    dist.send(t.residual.contiguous(), dst=ps.pp_next_rank)


def recv_intermediate(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, ps: ParallelState
) -> IntermediateTensors:
    if ps.pp_prev_rank is None:
        raise RuntimeError(f"rank {ps.rank} is the first PP stage; nothing to receive")
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=ps.device)
    residual = torch.empty_like(hidden)
    dist.recv(hidden, src=ps.pp_prev_rank)
    dist.recv(residual, src=ps.pp_prev_rank)
    return IntermediateTensors(hidden_states=hidden, residual=residual)
