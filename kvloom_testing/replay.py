"""A TP x PP group replaying what an InProcessExecutor sent its one worker.

Tests that check every layout answers the same steps the same way run a
scenario in process once (kvloom_testing.inprocess), then replay_layout
spawns a tp x pp group of real workers that each run the same handshake and
every broadcast step in order, saving their replies for replayed_outputs.
A step with grammar-constrained requests gets its GrammarMasks on the output
rank alone, filed just before the step (a worker that runs commands one at a
time could not take them while the step waits for them).
"""

from __future__ import annotations

import os

import torch

from controlplane.core.outputs import ModelRunnerOutput
from controlplane.executor.wire import model_runner_output_from_proto
from kvloom.common.ports import free_port
from kvloom.worker.v1 import worker_pb2
from kvloom_testing.inprocess import InProcessExecutor, call_worker, handshake
from workerd.worker import Worker


def replay_rank(
    rank: int,
    tp: int,
    pp: int,
    port: int,
    model_dir: str,
    num_blocks: int,
    sent: list[bytes],
    out_dir: str,
    sent_masks: dict[int, bytes] | None = None,
) -> None:
    """One spawned rank of a tp x pp group: the handshake, then every broadcast
    command in order (sent_masks[i]: the GrammarMasks of sent[i], for the output
    rank); saves the serialized replies (None where it stayed silent)."""
    torch.set_num_threads(1)
    worker = Worker("cpu")
    sent_masks = sent_masks or {}
    try:
        handshake(
            worker, model_dir, num_gpu_blocks=num_blocks, rank=rank, tp=tp, pp=pp,
            master_port=port,
        )
        replies = []
        for i, raw in enumerate(sent):
            if i in sent_masks and worker.ps.is_output_rank:
                call_worker(worker, worker_pb2.ControlMessage.FromString(sent_masks[i]), rank)
            reply = call_worker(worker, worker_pb2.ControlMessage.FromString(raw), rank)
            replies.append(None if reply is None else reply.SerializeToString())
        torch.save(replies, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        worker.close()


def replay_layout(executor: InProcessExecutor, model_dir: str, out_dir: str,
                  tp: int, pp: int) -> None:
    """Replay everything `executor` broadcast on a tp x pp group of spawned
    ranks (replay_rank each); their replies land in out_dir/rank<N>.pt."""
    import torch.multiprocessing as mp

    mp.spawn(
        replay_rank,
        args=(tp, pp, free_port(), model_dir, executor.num_gpu_blocks, executor.sent, out_dir,
              executor.sent_masks),
        nprocs=tp * pp,
        join=True,
    )


def replayed_outputs(path) -> list[ModelRunnerOutput | None]:
    """A replay_rank file, converted as the controlplane converts replies."""
    raws = torch.load(path, weights_only=False)
    return [
        None
        if raw is None
        else model_runner_output_from_proto(
            worker_pb2.WorkerMessage.FromString(raw).model_runner_output
        )
        for raw in raws
    ]
