"""One rank's Prometheus metrics, served on workerd's --metrics-port.

What only the rank itself knows: how long each forward pass took (every
rank, not just the output rank the controlplane hears from), how long the
output rank waited for a constrained step's grammar masks, how many KV
blocks it allocated and their bytes, its host tier's copies (blocks, bytes,
time), its model weights, and the memory it holds (process RSS on CPU,
torch.cuda.memory_allocated on CUDA). Series are
named kvloom_workerd_* so they never duplicate the controlplane's kvloom_*
series, and carry rank and model_name (the checkpoint directory's name).

The main thread reports after each command has been answered, so the reply
is never delayed by metrics; gauges are read at scrape time on the HTTP
thread. A dedicated CollectorRegistry keeps default collectors out.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from kvloom.common.metrics_http import MetricsEndpoint
from kvloom.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)

FORWARD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                   0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """Current RSS of this process (Linux /proc); 0 where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def model_name_of(model_path: str) -> str:
    # The controlplane's default served name is the same directory name.
    return os.path.basename(model_path.rstrip("/"))


class WorkerMetrics:
    def __init__(self) -> None:
        # _created samples would double every histogram for no reader.
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        self.rank: int | None = None
        self.model_name = ""
        self.device = None  # torch.device once the group is joined
        self.weights_bytes = 0
        self.kv_blocks = 0
        self.kv_block_bytes = 0
        self._endpoint = MetricsEndpoint(self.registry)
        self._forward = Histogram(
            "kvloom_workerd_forward_time_seconds",
            "This rank's execute_model time per step (inputs, forward, sampling).",
            ["model_name", "rank"], buckets=FORWARD_BUCKETS, registry=self.registry,
        )
        self._pipeline_wait = Histogram(
            "kvloom_workerd_pipeline_recv_wait_seconds",
            "Time this rank's step was blocked receiving the previous pipeline stage's hidden "
            "states (later PP stages only): the stage's bubble, not its work.",
            ["model_name", "rank"], buckets=FORWARD_BUCKETS, registry=self.registry,
        )
        self._grammar_wait = Histogram(
            "kvloom_workerd_grammar_wait_seconds",
            "Time the output rank's grammar-constrained step waited, after its forward, for "
            "the controlplane's grammar masks (structured outputs) before it could sample.",
            ["model_name", "rank"], buckets=FORWARD_BUCKETS, registry=self.registry,
        )
        # The prefix cache's host tier on this rank (workerd/runner/host_kv_tier.py).
        self._offload_blocks = Counter(
            "kvloom_workerd_kv_offload_blocks",
            "KV blocks this rank copied to (store) or from (load) its host tier.",
            ["model_name", "rank", "direction"], registry=self.registry,
        )
        self._offload_bytes = Counter(
            "kvloom_workerd_kv_offload_bytes",
            "Bytes this rank copied to (store) or from (load) its host tier.",
            ["model_name", "rank", "direction"], registry=self.registry,
        )
        self._offload_time = Histogram(
            "kvloom_workerd_kv_offload_time_seconds",
            "Time this rank's host-tier copies took: a step's stores (before its forward), "
            "or one load job (beside it).",
            ["model_name", "rank", "direction"], buckets=FORWARD_BUCKETS, registry=self.registry,
        )
        self.kv_offload_bytes = 0
        # reused="true": a survivor of a group failure kept its weights.
        self._loads = Counter(
            "kvloom_workerd_model_loads",
            "LoadModel commands answered, by whether the weights already loaded were reused.",
            ["model_name", "rank", "reused"], registry=self.registry,
        )
        self.registry.register(_StateCollector(self))

    def registered(self, rank: int) -> None:
        self.rank = rank

    def after_command(self, msg: worker_pb2.ControlMessage,
                      reply: worker_pb2.WorkerMessage | None, worker) -> None:
        """Record what the command just answered changed (main thread)."""
        if reply is not None and reply.WhichOneof("payload") == "error":
            return
        try:
            self._record(msg, reply, worker)
        except Exception:  # noqa: BLE001 - a metrics bug must never stop the rank
            logger.exception("recording metrics failed")

    def _record(self, msg, reply, worker) -> None:
        kind = msg.WhichOneof("command")
        if kind == "execute_model":
            self._forward.labels(self.model_name, str(self.rank)).observe(
                worker.last_forward_time_s)
            if worker.ps is not None and not worker.ps.is_first_pp_rank:
                self._pipeline_wait.labels(self.model_name, str(self.rank)).observe(
                    worker.runner.last_recv_wait_s)
            if worker.runner.kv_tier is not None:
                self._record_offload(worker.runner.kv_tier)
            if (msg.execute_model.constrained_req_ids and worker.ps is not None
                    and worker.ps.is_output_rank):
                self._grammar_wait.labels(self.model_name, str(self.rank)).observe(
                    worker.runner.grammar.last_wait_s)
        elif kind == "init_distributed" and worker.ps is not None:
            self.rank = worker.ps.rank
            self.device = worker.ps.device
        elif kind == "load_model" and worker.runner is not None:
            self.model_name = model_name_of(msg.load_model.model_path)
            self.weights_bytes = worker.runner.weights_bytes()
            reused = reply is not None and reply.model_loaded.reused
            self._loads.labels(self.model_name, str(self.rank), str(reused).lower()).inc()
        elif kind == "profile_memory" and reply is not None:
            self.kv_block_bytes = reply.memory_profile.bytes_per_block
        elif kind == "init_kv_cache":
            self.kv_blocks = msg.init_kv_cache.num_blocks
            tier = worker.runner.kv_tier
            self.kv_offload_bytes = tier.nbytes if tier is not None else 0

    def _record_offload(self, tier) -> None:
        """The copies the tier finished since the last call (its load thread
        appends as jobs end)."""
        labels = (self.model_name, str(self.rank))
        timings = tier.timings
        while timings:
            direction, blocks, seconds = timings.popleft()
            self._offload_blocks.labels(*labels, direction).inc(blocks)
            self._offload_bytes.labels(*labels, direction).inc(blocks * tier.block_bytes)
            self._offload_time.labels(*labels, direction).observe(seconds)

    def memory_in_use(self) -> tuple[str, int]:
        """(what was measured, bytes): CUDA allocations on a GPU rank, else RSS."""
        device = self.device
        if device is not None and device.type == "cuda":
            import torch

            return "cuda_allocated", torch.cuda.memory_allocated(device)
        return "rss", resident_bytes()

    def serve(self, host: str, port: int) -> None:
        self._endpoint.serve(host, port)

    def close(self) -> None:
        self._endpoint.close()


class _StateCollector:
    """Gauges of the rank's state, read at scrape time (HTTP thread)."""

    def __init__(self, metrics: WorkerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self.metrics
        if m.rank is None:
            return  # not registered yet: no rank to label anything with
        labels = [m.model_name, str(m.rank)]
        kind, used = m.memory_in_use()
        memory = GaugeMetricFamily(
            "kvloom_workerd_memory_used_bytes",
            "Memory this rank holds: process RSS (kind=rss) or torch CUDA allocations "
            "(kind=cuda_allocated).", labels=["model_name", "rank", "kind"])
        memory.add_metric([*labels, kind], used)
        yield memory
        for name, doc, value in (
            ("kvloom_workerd_model_weights_bytes", "Bytes of this rank's model shard.",
             m.weights_bytes),
            ("kvloom_workerd_kv_cache_blocks", "KV cache blocks allocated on this rank.",
             m.kv_blocks),
            ("kvloom_workerd_kv_cache_bytes", "Bytes of this rank's KV cache tensors.",
             m.kv_blocks * m.kv_block_bytes),
            ("kvloom_workerd_kv_offload_tier_bytes", "Bytes of this rank's host tier "
             "(0: none; committed as its slots are first written).", m.kv_offload_bytes),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name", "rank"])
            g.add_metric(labels, value)
            yield g
