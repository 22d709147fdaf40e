"""GetModelInfo, GetServerInfo and GetLoads answers, from what the server knows.

The gateway turns GetModelInfo into its model card and worker labels at
registration (smg-gateway.md section 2.2): `served_model_name` becomes the
model id clients send (every replica of one model must report the same name),
`is_generation` must be set (proto3 would say false, and the gateway would
treat the worker as an embedding model), and the sampling defaults are the
generation_config knobs the gateway fills into requests that leave them
unset. GetLoads feeds its load-aware routing and overload protection
(section 4.3), polled every few seconds.
"""

from __future__ import annotations

import datetime
import json
import time
from collections import deque

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from controlplane.config import ControlPlaneConfig
from controlplane.core.kv_connector import kv_connector_for
from controlplane.core.sched_stats import SchedulerStats
from controlplane.model_info import ModelInfo
from kvloom import __version__

# gen_throughput: tokens over about this window, sampled at each GetLoads.
THROUGHPUT_WINDOW_S = 10.0
_MIN_SPAN_S = 0.5


def model_info_response(config: ControlPlaneConfig, info: ModelInfo, tokenizer,
                        max_model_len: int) -> vpb.GetModelInfoResponse:
    defaults = dict(info.sampling_defaults)
    msg = vpb.GetModelInfoResponse(
        # The controlplane's own absolute path: a gateway on this host loads
        # it directly; one elsewhere fails to and asks GetTokenizer.
        model_path=info.model_path,
        tokenizer_path=info.model_path,
        is_generation=True,
        max_context_length=max_model_len,
        vocab_size=info.vocab_size,
        supports_vision=False,
        served_model_name=config.model.served_model_name,
        model_type=info.model_type,
        architectures=[info.architecture],
        eos_token_ids=sorted(info.eos_token_ids),
        max_req_input_len=max_model_len - 1,
        default_sampling_params_json=json.dumps(defaults, sort_keys=True) if defaults else "",
    )
    for name in ("bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)  # transformers sets both, often to None
        if isinstance(value, int):
            setattr(msg, name, value)
    return msg


def server_info_response(config: ControlPlaneConfig, stats: SchedulerStats | None,
                         started_at: float,
                         constrained_decoding_start: str = "",
                         model_dtype: str = "") -> vpb.GetServerInfoResponse:
    """constrained_decoding_start: "first_token" with a grammar backend, else
    "" (the gateway's `constrained_decoding_start` worker label: with
    first_token it leads a forced tool call's grammar with the thought).
    model_dtype: what the ranks run ("": --dtype as given, auto before the
    group's first start); the KV cache is kept in the same dtype."""
    model_dtype = model_dtype or config.model.dtype
    transfer = config.kv_transfer
    connector = kv_connector_for(config.cache.kv_offloading_size,
                                 transfer.kv_role if transfer is not None else "")
    return vpb.GetServerInfoResponse(
        active_requests=stats.num_running_reqs + stats.num_waiting_reqs if stats else 0,
        uptime_seconds=time.monotonic() - started_at,
        server_type="kvloom",
        data_parallel_size=1,
        kv_cache_dtype=model_dtype,
        model_dtype=model_dtype,
        block_size=config.cache.block_size,
        max_num_seqs=config.scheduler.max_num_seqs,
        constrained_decoding_start=constrained_decoding_start,
        kv_connector=connector.name if connector else "",
        kv_role=connector.role if connector else "",
        kv_engine_id=transfer.engine_id if transfer is not None else "",
    )


class ThroughputMeter:
    """Tokens per second over the last THROUGHPUT_WINDOW_S, from a running count
    (OutputRouter.num_tokens) sampled whenever a rate is asked for."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()
        self._rate = 0.0

    def rate(self, now: float, count: int) -> float:
        samples = self._samples
        samples.append((now, count))
        while len(samples) > 2 and now - samples[1][0] >= THROUGHPUT_WINDOW_S:
            samples.popleft()
        t0, c0 = samples[0]
        if now - t0 >= _MIN_SPAN_S:
            self._rate = max(0.0, (count - c0) / (now - t0))
        return self._rate


def loads_response(config: ControlPlaneConfig, stats: SchedulerStats | None,
                   gen_throughput: float) -> vpb.GetLoadsResponse:
    load = vpb.SchedulerLoad(dp_rank=0, max_running_requests=config.scheduler.max_num_seqs,
                             gen_throughput=gen_throughput)
    if stats is not None:
        block_size = config.cache.block_size
        load.num_running_reqs = stats.num_running_reqs
        load.num_waiting_reqs = stats.num_waiting_reqs
        load.num_total_reqs = stats.num_running_reqs + stats.num_waiting_reqs
        load.max_total_num_tokens = stats.num_total_blocks * block_size
        load.num_used_tokens = (stats.num_total_blocks - stats.num_free_blocks) * block_size
        load.token_usage = load.utilization = stats.kv_cache_usage
        if stats.prefix_cache_queries:
            load.cache_hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries
    return vpb.GetLoadsResponse(
        timestamp=datetime.datetime.now(datetime.UTC).isoformat(),
        version=__version__, dp_rank_count=1, loads=[load])
