"""The controlplane's frozen configuration tree, built once from flags/env in __main__.

Each component receives only the piece it needs: the scheduler gets
SchedulerConfig and CacheConfig, the executor ParallelConfig and
WorkerGroupConfig, the API server ServerConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    # Checkpoint directory (config.json, *.safetensors, tokenizer files).
    model: str
    served_model_name: str
    # Path the workers load from; differs from `model` when they mount it elsewhere.
    worker_model_path: str
    dtype: str = "float32"
    # Longest prompt + output accepted; 0 = the model's max_position_embeddings.
    max_model_len: int = 0
    seed: int = 0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Fixed pool size, overriding what the workers profile (tests, benchmarks).
    num_gpu_blocks_override: int | None = None
    # Bytes each rank may spend on KV cache; 0 = derive from device memory.
    kv_cache_memory_bytes: int = 0
    gpu_memory_utilization: float = 0.9


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Cap on prefill tokens one request may take in a step; 0 = no cap.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # or "priority"


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Layers per pipeline stage; empty = even split.
    pp_layer_partition: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """TP rank 0 of the last pipeline stage: the only rank that replies to steps."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


@dataclass(frozen=True)
class WorkerGroupConfig:
    # Shared secret workers must present; empty = not checked.
    auth_token: str = ""
    # A step with no reply from the output rank for this long fails the group.
    step_timeout_s: float = 60.0
    # Start-up commands (load, profile) may take this long per rank.
    startup_timeout_s: float = 600.0
    # Rendezvous timeout handed to torch.distributed.
    distributed_timeout_s: float = 120.0
    # A worker that has sent nothing (reply or heartbeat) for this long is dead.
    heartbeat_timeout_s: float = 30.0


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    worker_port: int = 50052
    metrics_port: int = 0
    # Largest gRPC message accepted or sent, bytes.
    max_message_bytes: int = 64 * 1024 * 1024
    # Requests beyond max_num_seqs that may wait; more get RESOURCE_EXHAUSTED.
    max_waiting_requests: int = 1024
    # On SIGTERM, in-flight requests get this long to finish before shutdown.
    drain_timeout_s: float = 30.0


@dataclass(frozen=True)
class ControlPlaneConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    workers: WorkerGroupConfig = field(default_factory=WorkerGroupConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
