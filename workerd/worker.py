"""The worker: executes the controlplane's commands on this rank.

Commands arrive as a closed protobuf oneof and are dispatched through an
explicit table; there is no getattr on names that came over the network.
Each handler returns the reply to send, or None when this rank stays silent
(execute_model on every rank but the output rank).

A worker outlives the group it serves: when another rank dies the
controlplane sends Reset, and this rank leaves its process groups and drops
every request's state and its KV cache but keeps the loaded weights; the
next InitDistributed re-binds the same ParallelState object (the model's
layers hold it) to the new process groups, and a LoadModel for the same
weights answers reused=True without reading the checkpoint again (with other
limits or enforce_eager, a new runner over those weights).

GrammarMasks (structured outputs, output rank only) is the one command with
no reply that the main thread does not run: the stream reader files it in
the worker's GrammarMaskBox at once (workerd/connection.py), since the main
thread may be blocked in a step that waits for it. The table's entry files it
the same way for callers that hand every command to handle() (in-process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kvloom.common.ports import PortReservation
from kvloom.worker.v1 import worker_pb2
from workerd.distributed.devices import claim_device, resolve_device
from workerd.layers.attention.backend import resolve_attention_backend
from workerd.limits import WorkerLimits
from workerd.runner.sched_output import KVJobDone
from workerd.sample.grammar_masks import GrammarMaskBox
from workerd.wire import (
    MAX_SPEC_TOKENS,
    kv_transfer_agent_to_proto,
    kv_transfer_report_to_proto,
    lora_config_from_proto,
    model_runner_output_to_proto,
    scheduler_output_from_proto,
)

logger = logging.getLogger(__name__)

# This process's rendezvous port (RegisterRequest / ResetDone.dist_port), held
# bound until InitDistributed: rank 0's TCPStore binds it there, and a port
# merely picked free could be taken by then (kvloom/common/ports.py).
RENDEZVOUS_PORT = PortReservation()

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A refused adapter's reason, as sent back (it ends up in a client's status).
MAX_LORA_ERROR_CHARS = 2000


class CommandError(Exception):
    """A command that cannot be carried out; reported to the controlplane."""


class Worker:
    def __init__(self, device_spec: str = "auto", advertise_host: str = "127.0.0.1"):
        self.device_spec = device_spec
        # The address peers reach this rank's process group at (what it registered with).
        self.advertise_host = advertise_host
        self.ps = None
        self.runner = None
        self.last_forward_time_s = 0.0
        # The process group's timeout: a blocked collective raises by then.
        self.collective_timeout_s = 0.0
        # What the runner's weights were loaded from (LoadModel's arguments).
        self._loaded: tuple | None = None
        # Each constrained step's masks, for whichever runner samples it.
        self.grammar_masks = GrammarMaskBox()
        # Where messages outside any call go (the stream's send, thread-safe):
        # the host tier's load reports, from its load thread.
        self.send_report: Callable[[worker_pb2.WorkerMessage], None] | None = None
        self._handlers: dict[str, Callable] = {
            "init_distributed": self.init_distributed,
            "load_model": self.load_model,
            "profile_memory": self.profile_memory,
            "init_kv_cache": self.init_kv_cache,
            "execute_model": self.execute_model,
            "ping": self.ping,
            "reset": self.reset,
            "grammar_masks": self.file_grammar_masks,
            "start_kv_transfer": self.start_kv_transfer,
            "load_lora": self.load_lora,
            "remove_lora": self.remove_lora,
        }

    def handle(self, msg: worker_pb2.ControlMessage) -> worker_pb2.WorkerMessage | None:
        kind = msg.WhichOneof("command")
        handler = self._handlers.get(kind or "")
        if handler is None:
            return _error(msg.call_id, "dispatch", f"unknown command {kind!r}")
        try:
            reply = handler(getattr(msg, kind))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the controlplane
            logger.exception("%s failed", kind)
            return _error(msg.call_id, kind, f"{type(exc).__name__}: {exc}")
        if reply is None:
            return None
        reply.call_id = msg.call_id
        return reply

    # ---- handlers --------------------------------------------------------

    def init_distributed(self, cmd: worker_pb2.InitDistributed) -> worker_pb2.WorkerMessage:
        from workerd.distributed.gloo_interface import pin_gloo_interface
        from workerd.distributed.parallel_state import init_parallel_state, rebind_parallel_state

        try:
            device = resolve_device(self.device_spec, cmd.rank)
            claim_device(device, cmd.rank)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if cmd.world_size > 1 and device.type != "cuda":
            try:
                pin_gloo_interface(self.advertise_host)
            except ValueError as exc:
                raise CommandError(str(exc)) from None
        t0 = time.monotonic()
        self.collective_timeout_s = cmd.timeout_s
        RENDEZVOUS_PORT.release()  # rank 0's TCPStore binds it now
        ps = init_parallel_state(
            rank=cmd.rank,
            world_size=cmd.world_size,
            tp_size=cmd.tensor_parallel_size,
            pp_size=cmd.pipeline_parallel_size,
            master_addr=cmd.master_addr,
            master_port=cmd.master_port,
            timeout_s=cmd.timeout_s,
            device=device,
        )
        if self.ps is not None and self.runner is not None and rebind_parallel_state(self.ps, ps):
            pass  # same place in the same grid: the loaded shard stays valid
        else:
            if self.runner is not None:
                logger.info("new rank layout; the loaded weights will be dropped")
            self.runner = None
            self.ps = ps
        ps = self.ps
        logger.info(
            "joined group: rank %d/%d (tp %d/%d, pp %d/%d) on %s in %.1f s",
            ps.rank, ps.world_size, ps.tp_rank, ps.tp_size,
            ps.pp_rank, ps.pp_size, device, time.monotonic() - t0,
        )
        return _ack()

    def load_model(self, cmd: worker_pb2.LoadModel) -> worker_pb2.WorkerMessage:
        from workerd.runner.model_runner import ModelRunner

        if self.ps is None:
            raise CommandError("load_model before init_distributed")
        if cmd.dtype not in _DTYPES:
            raise CommandError(f"unsupported dtype {cmd.dtype!r}; use one of {sorted(_DTYPES)}")
        try:
            limits = WorkerLimits.from_proto(cmd.limits)
            lora = lora_config_from_proto(cmd.lora) if cmd.HasField("lora") else None
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        try:
            # Resolved here, against this rank's device and packages: ranks
            # of one group agree on the request, not necessarily on auto.
            backend = resolve_attention_backend(
                cmd.attention_backend, torch.device(self.ps.device), _DTYPES[cmd.dtype])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        # The model object carries its attention backend, so a different one
        # is a different model (the same weights, loaded again).
        key = (cmd.model_path, cmd.dtype, cmd.seed, tuple(cmd.pp_layer_partition), backend,
               cmd.draft_model_path, cmd.num_speculative_tokens)
        if cmd.draft_model_path and not 1 <= cmd.num_speculative_tokens <= MAX_SPEC_TOKENS:
            raise CommandError(f"num_speculative_tokens must be in 1..{MAX_SPEC_TOKENS} with "
                               f"a draft model, got {cmd.num_speculative_tokens}")
        if self.runner is not None and self._loaded == key:
            if (self.runner.limits, self.runner.enforce_eager) != (limits, cmd.enforce_eager):
                # The weights depend on neither: a runner built for the new
                # values takes them over (a runner's limits never change).
                self.runner = self.runner.with_limits(limits, enforce_eager=cmd.enforce_eager)
            logger.info("reusing the weights loaded from %s (%.1f MiB on this rank)",
                        cmd.model_path, self.runner.weights_bytes() / 2**20)
            # The old group's adapters go: the controlplane loads the ones it serves.
            self.runner.init_lora(lora)
            return _model_loaded(True, self.runner.weights_bytes())
        self.runner = None  # a different model: let the old one go first
        t0 = time.monotonic()
        runner = ModelRunner(
            self.ps, cmd.model_path, _DTYPES[cmd.dtype], cmd.seed, tuple(cmd.pp_layer_partition),
            limits=limits, attention_backend=backend, enforce_eager=cmd.enforce_eager,
            grammar_masks=self.grammar_masks, draft_model_path=cmd.draft_model_path,
            num_speculative_tokens=cmd.num_speculative_tokens,
        )
        runner.load_model()
        runner.init_lora(lora)
        self.runner, self._loaded = runner, key
        logger.info(
            "model loaded from %s: %.1f MiB of weights on this rank in %.1f s; %s attention",
            cmd.model_path, runner.weights_bytes() / 2**20, time.monotonic() - t0, backend,
        )
        return _model_loaded(False, runner.weights_bytes())

    def profile_memory(self, cmd: worker_pb2.ProfileMemory) -> worker_pb2.WorkerMessage:
        runner = self._require_runner()
        num_blocks, bytes_per_block = runner.profile_num_blocks(
            cmd.block_size, cmd.kv_cache_memory_bytes, cmd.gpu_memory_utilization
        )
        logger.info("KV capacity: %d blocks of %d bytes", num_blocks, bytes_per_block)
        return worker_pb2.WorkerMessage(
            memory_profile=worker_pb2.MemoryProfile(
                num_blocks=num_blocks,
                bytes_per_block=bytes_per_block,
                weights_bytes=runner.weights_bytes(),
            )
        )

    def init_kv_cache(self, cmd: worker_pb2.InitKVCache) -> worker_pb2.WorkerMessage:
        self._require_runner().init_kv_cache(cmd.num_blocks, cmd.block_size,
                                             cmd.num_offload_slots, self._report_loads)
        logger.info("KV cache allocated: %d blocks x %d tokens%s", cmd.num_blocks,
                    cmd.block_size, f"; host tier {cmd.num_offload_slots} blocks"
                    if cmd.num_offload_slots else "")
        return _ack()

    def execute_model(self, cmd: worker_pb2.SchedulerOutput) -> worker_pb2.WorkerMessage | None:
        runner = self._require_runner()
        t0 = time.perf_counter()
        output = runner.execute_model(scheduler_output_from_proto(cmd))
        self.last_forward_time_s = time.perf_counter() - t0
        if output is None:
            return None
        return worker_pb2.WorkerMessage(model_runner_output=model_runner_output_to_proto(output))

    def start_kv_transfer(self, cmd: worker_pb2.StartKVTransfer) -> worker_pb2.WorkerMessage:
        """This rank's NIXL agent over its KV cache (prefill/decode
        disaggregation), answered with where producers and readers find it."""
        runner = self._require_runner()
        agent = runner.start_kv_transfer(cmd.engine_id, self.advertise_host, self._report_loads,
                                         cmd.serve_reads)
        logger.info("KV transfer started: NIXL agent %s", agent.agent_name)
        return worker_pb2.WorkerMessage(kv_transfer_agent=kv_transfer_agent_to_proto(agent))

    def load_lora(self, cmd: worker_pb2.LoadLoRA) -> worker_pb2.WorkerMessage:
        """Read an adapter into this rank's memory, off any step. An adapter
        this rank cannot serve is a refusal in the reply (LoRALoaded.error),
        not a failure: the group serves on."""
        runner = self._require_runner()
        if runner.lora is None:
            raise CommandError("LoadLoRA without LoRA enabled in LoadModel")
        t0 = time.monotonic()
        try:
            loaded = runner.lora.add(cmd.lora_id, cmd.lora_name, cmd.lora_path)
        except Exception as exc:  # noqa: BLE001 - the adapter's fault, told to the controlplane
            logger.warning("LoRA adapter %s (%s) refused: %s", cmd.lora_name, cmd.lora_path,
                           exc)
            return worker_pb2.WorkerMessage(lora_loaded=worker_pb2.LoRALoaded(
                error=f"{type(exc).__name__}: {exc}"[:MAX_LORA_ERROR_CHARS]))
        logger.info("LoRA adapter %s loaded as %d: %d modules, %.2f MiB on this rank in %.2f s",
                    cmd.lora_name, cmd.lora_id, loaded.num_modules, loaded.num_bytes / 2**20,
                    time.monotonic() - t0)
        return worker_pb2.WorkerMessage(lora_loaded=worker_pb2.LoRALoaded(
            digest=loaded.digest, num_bytes=loaded.num_bytes, num_modules=loaded.num_modules,
            rank=loaded.rank))

    def remove_lora(self, cmd: worker_pb2.RemoveLoRA) -> worker_pb2.WorkerMessage:
        runner = self._require_runner()
        if runner.lora is not None:
            runner.lora.remove(cmd.lora_id)
        return _ack()

    def _report_loads(self, done: list[KVJobDone]) -> None:
        """Finished load jobs (host tier or NIXL), to the controlplane (call_id 0)."""
        if self.send_report is None:
            raise RuntimeError("no stream to report KV loads on")
        self.send_report(worker_pb2.WorkerMessage(kv_transfer_report=kv_transfer_report_to_proto(
            done)))

    def file_grammar_masks(self, cmd: worker_pb2.GrammarMasks) -> None:
        """No reply: a step's masks wait in the box for its sampling."""
        self.grammar_masks.put(cmd)

    def ping(self, cmd: worker_pb2.Ping) -> worker_pb2.WorkerMessage:
        return _ack()

    def reset(self, cmd: worker_pb2.Reset) -> worker_pb2.WorkerMessage:
        """Leave the failed group; keep the weights for the next one."""
        self.leave_group()
        port = RENDEZVOUS_PORT.take("")  # every interface: peers on other hosts dial it
        logger.info("left the worker group (%s); weights kept, rendezvous port %d next",
                    cmd.reason or "no reason given", port)
        return worker_pb2.WorkerMessage(reset_done=worker_pb2.ResetDone(dist_port=port))

    def leave_group(self) -> None:
        """Leave the process groups and drop every request's state and the KV
        cache; the weights (and the ParallelState the layers hold) stay for
        the next group, which a Reset or a re-registration leads to."""
        from workerd.distributed.parallel_state import destroy_parallel_state

        if self.ps is not None:
            destroy_parallel_state(self.ps)
        if self.runner is not None:
            self.runner.reset_state()
        self.grammar_masks.clear()  # the failed group's; the next group's steps count afresh

    def _require_runner(self):
        if self.runner is None:
            raise CommandError("the model is not loaded yet")
        return self.runner

    def close(self) -> None:
        if self.ps is not None:
            from workerd.distributed.parallel_state import destroy_parallel_state

            destroy_parallel_state(self.ps)
            self.ps = None


def _ack() -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(ack=worker_pb2.Ack())


def _model_loaded(reused: bool, weights_bytes: int) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(
        model_loaded=worker_pb2.ModelLoaded(reused=reused, weights_bytes=weights_bytes)
    )


def _error(call_id: int, kind: str, message: str) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(
        call_id=call_id, error=worker_pb2.WorkerError(kind=kind, message=message)
    )
