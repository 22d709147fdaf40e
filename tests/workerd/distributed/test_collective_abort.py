"""workerd.distributed.collective_abort: a rank blocked in a PP receive from a peer that
is alive but will never send (its own step failed) is released at once when
its own sockets of the failed group are shut down, and the same process can
then join a new group on a new port (real processes, gloo on loopback).

Without the abort the receive would block until the process-group timeout
(60 s here); the test's 20 s join bound would fail."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.multiprocessing as mp

from kvloom.common.ports import free_port
from workerd.distributed.collective_abort import abort_collectives
from workerd.distributed.parallel_state import (
    IntermediateTensors,
    destroy_parallel_state,
    init_parallel_state,
    recv_intermediate,
    send_intermediate,
)


def _rank(rank: int, ports: tuple[int, int], out_dir: str) -> None:
    torch.set_num_threads(1)

    def join(port: int):
        return init_parallel_state(rank=rank, world_size=2, tp_size=1, pp_size=2,
                                   master_addr="127.0.0.1", master_port=port, timeout_s=60,
                                   device=torch.device("cpu"))

    ps = join(ports[0])
    released = "no abort needed"
    if rank == 1:  # stage 1 waits for hidden states stage 0 never sends
        threading.Timer(1.0, abort_collectives, kwargs=dict(
            keep_remote_ports=set(), keep_local_ports=set())).start()
        t0 = time.monotonic()
        try:
            recv_intermediate(3, 8, torch.float32, ps)
            released = "received?!"
        except RuntimeError:
            released = f"released after {time.monotonic() - t0:.1f} s"
    else:
        time.sleep(2.0)  # alive, its "step failed": it sends nothing
    destroy_parallel_state(ps)
    ps = join(ports[1])  # the next group, as after Reset
    if rank == 0:
        x = torch.arange(24.0).view(3, 8)
        send_intermediate(IntermediateTensors(x, -x), ps)
        got = "sent"
    else:
        t = recv_intermediate(3, 8, torch.float32, ps)
        got = "ok" if torch.equal(t.hidden_states, torch.arange(24.0).view(3, 8)) else "bad"
    destroy_parallel_state(ps)
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{released}|{got}")


def test_a_blocked_receive_is_released_and_the_rank_rejoins(tmp_path):
    ports = (free_port(), free_port())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, ports, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(20)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    released, got = (tmp_path / "rank1").read_text().split("|")
    assert released.startswith("released after") and float(released.split()[2]) < 5, released
    assert got == "ok"
    assert (tmp_path / "rank0").read_text() == "no abort needed|sent"
