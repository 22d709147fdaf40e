"""Null workers: ranks that speak worker.proto and have no model at all.

    python -m benchmarks.null_worker --controlplane 127.0.0.1:50052 \\
        --world-size 16 [--ranks 0-7,9-15] [--num-blocks 65536] [--token 42] \\
        [--step-ms 0] [--log steps.json]

(run from the repository root). Each NullRank dials the controlplane's worker
port as workerd does (RegisterRequest with PROTOCOL_VERSION_CURRENT and an
explicit rank), answers the start-up handshake (init_distributed,
init_kv_cache and ping -> ack, load_model -> model_loaded, profile_memory ->
memory_profile with --num-blocks, reset -> reset_done), sends heartbeats and,
on execute_model, does the least a worker must: the output rank (TP rank 0 of
the last PP stage, learnt from init_distributed) mirrors the requests from
the SchedulerOutput diffs (RequestMirror) to know which of them sample this
step, and answers with --token for each; every other rank parses the step
and stays silent. So a step costs the controlplane what it would with a real
group, minus the forward pass: what is left is the control path.

The output rank answers at once, or with --step-ms no sooner than that after
its previous reply, as a forward pass of that length would: a rank that
answers at once lets the engine outrun the controlplane's API loop, which
then merges queued tokens into one message and admits new streams only
between its turns, so of many concurrent requests the first stream far
ahead of the last (benchmarks/control_plane.py and token_path_cpu.py pace it).

Every rank records, per step, its arrival time (time.monotonic, comparable
across processes on Linux), step_id and the serialized ControlMessage's size;
the output rank also the number of scheduled requests, how many sampled, and
when it wrote its reply. --log writes those records as JSON when every
stream has ended (the controlplane shut down, or SIGTERM/SIGINT).

No torch and no model: many ranks (e.g. 16, TP=8 x PP=2) run on one asyncio
loop. benchmarks/control_plane.py and its test drive it; RequestMirror is also
the request mirror of the tests' ScriptedWorker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import grpc

from kvloom.worker.v1 import worker_pb2

CONNECT = "/kvloom.worker.v1.WorkerControl/Connect"
DEFAULT_TOKEN = 42
HEARTBEAT_S = 0.5
# --step-ms: at most a second a step (a 500-step window is then ~8 minutes).
MAX_STEP_MS = 1000.0
# Large enough for any step the benchmarks send.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]


class RequestMirror:
    """Each request's token count (prompt + output so far), kept from the
    diffs alone as a worker keeps it, so a step's sampling requests are known:
    those whose context is complete after the step (num_computed_tokens +
    num_scheduled_tokens == prompt + output length). A partial prefill
    samples nothing; a request that samples grows by one token, as every
    worker rank appends it itself (protocol 3)."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.num_tokens)

    def clear(self) -> None:
        self.num_tokens.clear()

    def sampling(self, so: worker_pb2.SchedulerOutput) -> list[str]:
        """Apply one step's diff; the ids that sample in it, in the step's order."""
        num_tokens = self.num_tokens
        for req_id in so.finished_req_ids:
            num_tokens.pop(req_id, None)
        sampling = []
        for new in so.scheduled_new_reqs:
            n = len(new.prompt_token_ids) + len(new.output_token_ids)
            num_tokens[new.req_id] = n
            if new.num_computed_tokens + new.num_scheduled_tokens == n:
                sampling.append(new.req_id)
        cached = so.scheduled_cached_reqs
        for req_id, computed, scheduled in zip(
            cached.req_ids, cached.num_computed_tokens, cached.num_scheduled_tokens, strict=True,
        ):
            if computed + scheduled == num_tokens[req_id]:
                sampling.append(req_id)
        for req_id in sampling:
            num_tokens[req_id] += 1
        return sampling


def startup_reply(
    msg: worker_pb2.ControlMessage, num_blocks: int, *, reused: bool = False
) -> worker_pb2.WorkerMessage:
    """The well-formed answer to a start-up or housekeeping command."""
    reply = worker_pb2.WorkerMessage(call_id=msg.call_id)
    kind = msg.WhichOneof("command")
    if kind == "profile_memory":
        reply.memory_profile.num_blocks = num_blocks
        reply.memory_profile.bytes_per_block = 1
    elif kind == "load_model":
        reply.model_loaded.reused = reused
    elif kind == "reset":
        reply.reset_done.dist_port = 2
    else:
        reply.ack.SetInParent()
    return reply


class NullRank:
    """One null rank on one gRPC stream. Run it with run(); stop it with close()."""

    def __init__(
        self,
        address: str,
        rank: int | None = None,
        *,
        num_blocks: int = 1 << 16,
        token: int = DEFAULT_TOKEN,
        record: bool = True,
        options: list | None = None,
        pace_s: float = 0.0,
    ):
        self.address = address
        self.rank = rank
        self.num_blocks = num_blocks
        self.token = token
        self.record = record
        self.options = GRPC_OPTIONS if options is None else options
        self.pace_s = pace_s
        self.next_reply = 0.0
        self.mirror = RequestMirror()
        self.is_output = False
        self.world_size = 0
        self.num_loads = 0
        self.tokens_sent = 0
        self.shutdown_reason: str | None = None
        self.error: grpc.StatusCode | None = None
        # (step_id, arrival, nbytes); the output rank's also carry
        # (num_scheduled_reqs, num_sampling, reply_written).
        self.steps: list[tuple] = []
        self.registered = asyncio.Event()
        self.kv_ready = asyncio.Event()
        self.ended = asyncio.Event()
        self._call = None
        self._write_lock = asyncio.Lock()
        self._done_writing = False

    # ---- the stream --------------------------------------------------------

    async def run(self) -> None:
        """Until the controlplane ends the stream, or close()."""
        heartbeats = None
        try:
            async with grpc.aio.insecure_channel(self.address, options=self.options) as channel:
                connect = channel.stream_stream(
                    CONNECT,
                    request_serializer=worker_pb2.WorkerMessage.SerializeToString,
                    response_deserializer=None,  # bytes: their size is the step's
                )
                # As workerd, it waits for a controlplane that is not up yet.
                self._call = call = connect(wait_for_ready=True)
                register = worker_pb2.RegisterRequest(
                    protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
                    host="127.0.0.1", device="null", dist_port=1, pid=os.getpid(),
                )
                if self.rank is not None:
                    register.rank = self.rank
                await self._write(worker_pb2.WorkerMessage(register=register))
                heartbeats = asyncio.get_running_loop().create_task(self._heartbeats())
                try:
                    while (raw := await call.read()) is not grpc.aio.EOF:
                        await self._on(raw, time.monotonic())
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.CANCELLED:
                        self.error = exc.code()
        finally:
            if heartbeats is not None:
                heartbeats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeats
            self.ended.set()

    async def close(self) -> None:
        """Leave the group: cancel the stream."""
        if self._call is not None:
            self._call.cancel()

    async def _write(self, msg: worker_pb2.WorkerMessage) -> None:
        if self._done_writing:
            return
        async with self._write_lock:
            # The stream may be ending under us; run() sees how it ended.
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError,
                                     asyncio.InvalidStateError):
                await self._call.write(msg)

    async def _heartbeats(self) -> None:
        beat = worker_pb2.WorkerMessage(heartbeat=worker_pb2.Heartbeat())
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self._write(beat)

    async def _on(self, raw: bytes, arrival: float) -> None:
        msg = worker_pb2.ControlMessage.FromString(raw)
        kind = msg.WhichOneof("command")
        if kind == "execute_model":
            await self._step(msg, len(raw), arrival)
            return
        if kind == "registered":
            self.rank = msg.registered.rank
            self.world_size = msg.registered.world_size
            self.registered.set()
            return
        if kind == "shutdown":
            self.shutdown_reason = msg.shutdown.reason
            async with self._write_lock:
                self._done_writing = True
                with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError,
                                         asyncio.InvalidStateError):
                    await self._call.done_writing()
            return
        if kind == "init_distributed":
            init = msg.init_distributed
            tp, pp = init.tensor_parallel_size, init.pipeline_parallel_size
            # As workerd: TP rank 0 of the last pipeline stage samples.
            self.is_output = init.rank == (pp - 1) * tp
        elif kind == "load_model":
            self.num_loads += 1
        elif kind == "reset":
            self.mirror.clear()
        reply = startup_reply(msg, self.num_blocks, reused=self.num_loads > 1)
        await self._write(reply)
        if kind == "init_kv_cache":
            self.kv_ready.set()

    # ---- steps -------------------------------------------------------------

    async def _step(self, msg: worker_pb2.ControlMessage, nbytes: int, arrival: float) -> None:
        so = msg.execute_model
        if not self.is_output:
            if self.record:
                self.steps.append((so.step_id, arrival, nbytes))
            return
        if self.pace_s:
            await self._pace()
        sampling = self.mirror.sampling(so)
        reply = worker_pb2.WorkerMessage(call_id=msg.call_id)
        out = reply.model_runner_output
        out.req_ids.extend(sampling)
        out.sampled_token_ids.extend([self.token] * len(sampling))
        written = time.monotonic()
        out.forward_time_s = written - arrival
        await self._write(reply)
        self.tokens_sent += len(sampling)
        if self.record:
            num_reqs = len(so.scheduled_new_reqs) + len(so.scheduled_cached_reqs.req_ids)
            self.steps.append((so.step_id, arrival, nbytes, num_reqs, len(sampling), written))

    async def _pace(self) -> None:
        """Until pace_s after the previous reply, as a forward pass of that
        length would space them (the reply latency recorded includes it)."""
        now = time.monotonic()
        if self.next_reply > now:
            await asyncio.sleep(self.next_reply - now)
        # No catching up after a late step: replies never come in bursts.
        self.next_reply = max(now, self.next_reply) + self.pace_s

    def log(self) -> dict:
        return {"rank": self.rank, "output": self.is_output, "steps": self.steps,
                "tokens_sent": self.tokens_sent, "error": self.error and self.error.name}


async def serve_ranks(
    address: str, ranks: int | list[int], stop: asyncio.Event | None = None, **kwargs
) -> list[NullRank]:
    """Null ranks (an int n: ranks 0..n-1) until every stream ends or `stop`
    is set; the ranks, with their records."""
    ids = list(range(ranks)) if isinstance(ranks, int) else ranks
    ranks = [NullRank(address, r, **kwargs) for r in ids]
    tasks = [asyncio.create_task(r.run()) for r in ranks]
    stopper = asyncio.create_task(stop.wait()) if stop is not None else None
    try:
        pending = set(tasks)
        while pending:
            waiting = pending | ({stopper} if stopper else set())
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
            if stopper in done:
                break
    finally:
        for r in ranks:
            await r.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        if stopper is not None:
            stopper.cancel()
    return ranks


def parse_ranks(text: str) -> list[int]:
    """ "0-7,9-15" -> [0, ..., 7, 9, ..., 15]."""
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def parse_step_ms(text: str) -> float:
    """--step-ms of every script that paces a null rank: 0 (answer at once)
    to MAX_STEP_MS; NaN, infinities and negatives are refused."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= MAX_STEP_MS:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(
            f"bad --step-ms {text!r}: must be in 0..{MAX_STEP_MS:g} (ms)")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--controlplane", required=True, help="the worker port, host:port")
    p.add_argument("--world-size", type=int, required=True, help="ranks 0..N-1, one stream each")
    p.add_argument("--ranks", type=parse_ranks, help="serve only these ranks, e.g. 0-7,9-15 "
                   "(the others run elsewhere, e.g. the output rank in a process of its own)")
    p.add_argument("--num-blocks", type=int, default=1 << 16, help="KV blocks each rank reports")
    p.add_argument("--token", type=int, default=DEFAULT_TOKEN, help="the token every step samples")
    p.add_argument("--step-ms", type=parse_step_ms, default=0.0,
                   help="the output rank's least time between two replies, a forward "
                        f"pass (0: at once; at most {MAX_STEP_MS:g})")
    p.add_argument("--log", type=Path, help="write every rank's step records here (JSON); "
                   "without it no records are kept")
    args = p.parse_args(argv)

    async def run() -> list[NullRank]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ranks = args.ranks if args.ranks is not None else args.world_size
        return await serve_ranks(args.controlplane, ranks, stop,
                                 num_blocks=args.num_blocks, token=args.token,
                                 record=args.log is not None, pace_s=args.step_ms / 1e3)

    ranks = asyncio.run(run())
    for r in ranks:
        if r.error is not None:
            print(f"null rank {r.rank}: stream ended with {r.error.name}", file=sys.stderr)
    if args.log:
        tmp = args.log.with_name(args.log.name + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "ranks": [r.log() for r in ranks]}))
        os.replace(tmp, args.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
