from kvloom.kvtransfer.v1 import kv_transfer_pb2 as _kv_transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_2: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_3: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_4: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_5: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_6: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_7: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_CURRENT: _ClassVar[ProtocolVersion]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
PROTOCOL_VERSION_2: ProtocolVersion
PROTOCOL_VERSION_3: ProtocolVersion
PROTOCOL_VERSION_4: ProtocolVersion
PROTOCOL_VERSION_5: ProtocolVersion
PROTOCOL_VERSION_6: ProtocolVersion
PROTOCOL_VERSION_7: ProtocolVersion
PROTOCOL_VERSION_CURRENT: ProtocolVersion

class RegisterRequest(_message.Message):
    __slots__ = ("protocol_version", "rank", "host", "device", "auth_token", "pid", "dist_port", "instance_id", "node_id", "native_bf16")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DIST_PORT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NATIVE_BF16_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    rank: int
    host: str
    device: str
    auth_token: str
    pid: int
    dist_port: int
    instance_id: str
    node_id: str
    native_bf16: bool
    def __init__(self, protocol_version: _Optional[int] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., auth_token: _Optional[str] = ..., pid: _Optional[int] = ..., dist_port: _Optional[int] = ..., instance_id: _Optional[str] = ..., node_id: _Optional[str] = ..., native_bf16: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("rank", "world_size")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class InitDistributed(_message.Message):
    __slots__ = ("master_addr", "master_port", "world_size", "rank", "tensor_parallel_size", "pipeline_parallel_size", "timeout_s")
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    timeout_s: float
    def __init__(self, master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class LoadModel(_message.Message):
    __slots__ = ("model_path", "dtype", "pp_layer_partition", "seed", "limits", "attention_backend", "enforce_eager", "draft_model_path", "num_speculative_tokens", "lora")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PP_LAYER_PARTITION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENFORCE_EAGER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    dtype: str
    pp_layer_partition: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    limits: WorkerLimits
    attention_backend: str
    enforce_eager: bool
    draft_model_path: str
    num_speculative_tokens: int
    lora: LoRAConfig
    def __init__(self, model_path: _Optional[str] = ..., dtype: _Optional[str] = ..., pp_layer_partition: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., limits: _Optional[_Union[WorkerLimits, _Mapping]] = ..., attention_backend: _Optional[str] = ..., enforce_eager: _Optional[bool] = ..., draft_model_path: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., lora: _Optional[_Union[LoRAConfig, _Mapping]] = ...) -> None: ...

class LoRAConfig(_message.Message):
    __slots__ = ("max_loras", "max_lora_rank", "max_cpu_loras")
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    def __init__(self, max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ...) -> None: ...

class LoadLoRA(_message.Message):
    __slots__ = ("lora_id", "lora_name", "lora_path")
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    lora_name: str
    lora_path: str
    def __init__(self, lora_id: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoRALoaded(_message.Message):
    __slots__ = ("digest", "num_bytes", "num_modules", "rank", "error")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_MODULES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    digest: str
    num_bytes: int
    num_modules: int
    rank: int
    error: str
    def __init__(self, digest: _Optional[str] = ..., num_bytes: _Optional[int] = ..., num_modules: _Optional[int] = ..., rank: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class RemoveLoRA(_message.Message):
    __slots__ = ("lora_id",)
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    def __init__(self, lora_id: _Optional[int] = ...) -> None: ...

class WorkerLimits(_message.Message):
    __slots__ = ("max_num_batched_tokens", "max_num_seqs", "max_model_len")
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    def __init__(self, max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ProfileMemory(_message.Message):
    __slots__ = ("block_size", "kv_cache_memory_bytes", "gpu_memory_utilization")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    kv_cache_memory_bytes: int
    gpu_memory_utilization: float
    def __init__(self, block_size: _Optional[int] = ..., kv_cache_memory_bytes: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ...) -> None: ...

class MemoryProfile(_message.Message):
    __slots__ = ("num_blocks", "bytes_per_block", "weights_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    bytes_per_block: int
    weights_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., weights_bytes: _Optional[int] = ...) -> None: ...

class InitKVCache(_message.Message):
    __slots__ = ("num_blocks", "block_size", "num_offload_slots")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    num_offload_slots: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_offload_slots: _Optional[int] = ...) -> None: ...

class RequestSamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs", "min_tokens", "min_tokens_stop_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    prompt_logprobs: int
    min_tokens: int
    min_tokens_stop_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., min_tokens_stop_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "sampling_params", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "lora_id")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: RequestSamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_id: int
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[RequestSamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., lora_id: _Optional[int] = ...) -> None: ...

class CachedRequestData(_message.Message):
    __slots__ = ("req_ids", "resumed_from_preemption", "num_computed_tokens", "num_scheduled_tokens", "new_block_ids", "num_new_block_ids", "spec_token_ids", "num_spec_tokens")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_PREEMPTION_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    resumed_from_preemption: _containers.RepeatedScalarFieldContainer[bool]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    spec_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_spec_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., resumed_from_preemption: _Optional[_Iterable[bool]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_new_block_ids: _Optional[_Iterable[int]] = ..., spec_token_ids: _Optional[_Iterable[int]] = ..., num_spec_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerOutput(_message.Message):
    __slots__ = ("step_id", "scheduled_new_reqs", "scheduled_cached_reqs", "total_num_scheduled_tokens", "finished_req_ids", "preempted_req_ids", "constrained_req_ids", "kv_connector_metadata")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_NEW_REQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_CACHED_REQS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_METADATA_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    scheduled_new_reqs: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    total_num_scheduled_tokens: int
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    preempted_req_ids: _containers.RepeatedScalarFieldContainer[str]
    constrained_req_ids: _containers.RepeatedScalarFieldContainer[str]
    kv_connector_metadata: KVConnectorMetadata
    def __init__(self, step_id: _Optional[int] = ..., scheduled_new_reqs: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., scheduled_cached_reqs: _Optional[_Union[CachedRequestData, _Mapping]] = ..., total_num_scheduled_tokens: _Optional[int] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., preempted_req_ids: _Optional[_Iterable[str]] = ..., constrained_req_ids: _Optional[_Iterable[str]] = ..., kv_connector_metadata: _Optional[_Union[KVConnectorMetadata, _Mapping]] = ...) -> None: ...

class KVBlockCopies(_message.Message):
    __slots__ = ("block_ids", "tier_slots")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    tier_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., tier_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class KVConnectorMetadata(_message.Message):
    __slots__ = ("stores", "load_jobs", "remote_engines")
    STORES_FIELD_NUMBER: _ClassVar[int]
    LOAD_JOBS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINES_FIELD_NUMBER: _ClassVar[int]
    stores: KVBlockCopies
    load_jobs: _containers.RepeatedCompositeFieldContainer[KVLoadJob]
    remote_engines: _containers.RepeatedCompositeFieldContainer[_kv_transfer_pb2.KVEngineLayout]
    def __init__(self, stores: _Optional[_Union[KVBlockCopies, _Mapping]] = ..., load_jobs: _Optional[_Iterable[_Union[KVLoadJob, _Mapping]]] = ..., remote_engines: _Optional[_Iterable[_Union[_kv_transfer_pb2.KVEngineLayout, _Mapping]]] = ...) -> None: ...

class KVLoadJob(_message.Message):
    __slots__ = ("job_id", "copies", "remote_read")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_READ_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    copies: KVBlockCopies
    remote_read: KVRemoteRead
    def __init__(self, job_id: _Optional[int] = ..., copies: _Optional[_Union[KVBlockCopies, _Mapping]] = ..., remote_read: _Optional[_Union[KVRemoteRead, _Mapping]] = ...) -> None: ...

class KVRemoteRead(_message.Message):
    __slots__ = ("engine_id", "remote_block_ids", "block_ids")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StartKVTransfer(_message.Message):
    __slots__ = ("engine_id", "serve_reads")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SERVE_READS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    serve_reads: bool
    def __init__(self, engine_id: _Optional[str] = ..., serve_reads: _Optional[bool] = ...) -> None: ...

class KVTransferReport(_message.Message):
    __slots__ = ("loads_done",)
    LOADS_DONE_FIELD_NUMBER: _ClassVar[int]
    loads_done: _containers.RepeatedCompositeFieldContainer[KVJobDone]
    def __init__(self, loads_done: _Optional[_Iterable[_Union[KVJobDone, _Mapping]]] = ...) -> None: ...

class KVJobDone(_message.Message):
    __slots__ = ("job_id", "failed_block_ids", "bytes", "seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    failed_block_ids: _containers.RepeatedScalarFieldContainer[int]
    bytes: int
    seconds: float
    def __init__(self, job_id: _Optional[int] = ..., failed_block_ids: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GrammarMasks(_message.Message):
    __slots__ = ("step_id", "masks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    masks: _containers.RepeatedCompositeFieldContainer[TokenMask]
    def __init__(self, step_id: _Optional[int] = ..., masks: _Optional[_Iterable[_Union[TokenMask, _Mapping]]] = ...) -> None: ...

class TokenMask(_message.Message):
    __slots__ = ("bitmask", "allowed", "disallowed", "unconstrained")
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    DISALLOWED_FIELD_NUMBER: _ClassVar[int]
    UNCONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    bitmask: bytes
    allowed: TokenIdList
    disallowed: TokenIdList
    unconstrained: bool
    def __init__(self, bitmask: _Optional[bytes] = ..., allowed: _Optional[_Union[TokenIdList, _Mapping]] = ..., disallowed: _Optional[_Union[TokenIdList, _Mapping]] = ..., unconstrained: _Optional[bool] = ...) -> None: ...

class TokenIdList(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "rank", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("req_id", "start_position", "positions")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    start_position: int
    positions: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, req_id: _Optional[str] = ..., start_position: _Optional[int] = ..., positions: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ModelRunnerOutput(_message.Message):
    __slots__ = ("req_ids", "sampled_token_ids", "forward_time_s", "logprobs", "prompt_logprobs", "num_sampled_tokens", "draft_token_ids", "num_draft_tokens")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    forward_time_s: float
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    num_sampled_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., forward_time_s: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., num_sampled_tokens: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Reset(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ResetDone(_message.Message):
    __slots__ = ("dist_port",)
    DIST_PORT_FIELD_NUMBER: _ClassVar[int]
    dist_port: int
    def __init__(self, dist_port: _Optional[int] = ...) -> None: ...

class ModelLoaded(_message.Message):
    __slots__ = ("reused", "weights_bytes")
    REUSED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    reused: bool
    weights_bytes: int
    def __init__(self, reused: _Optional[bool] = ..., weights_bytes: _Optional[int] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("call_id", "registered", "init_distributed", "load_model", "profile_memory", "init_kv_cache", "execute_model", "ping", "shutdown", "reset", "grammar_masks", "start_kv_transfer", "load_lora", "remove_lora")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    INIT_DISTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    LOAD_MODEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    INIT_KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_MODEL_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_MASKS_FIELD_NUMBER: _ClassVar[int]
    START_KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LOAD_LORA_FIELD_NUMBER: _ClassVar[int]
    REMOVE_LORA_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    registered: RegisterReply
    init_distributed: InitDistributed
    load_model: LoadModel
    profile_memory: ProfileMemory
    init_kv_cache: InitKVCache
    execute_model: SchedulerOutput
    ping: Ping
    shutdown: Shutdown
    reset: Reset
    grammar_masks: GrammarMasks
    start_kv_transfer: StartKVTransfer
    load_lora: LoadLoRA
    remove_lora: RemoveLoRA
    def __init__(self, call_id: _Optional[int] = ..., registered: _Optional[_Union[RegisterReply, _Mapping]] = ..., init_distributed: _Optional[_Union[InitDistributed, _Mapping]] = ..., load_model: _Optional[_Union[LoadModel, _Mapping]] = ..., profile_memory: _Optional[_Union[ProfileMemory, _Mapping]] = ..., init_kv_cache: _Optional[_Union[InitKVCache, _Mapping]] = ..., execute_model: _Optional[_Union[SchedulerOutput, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., reset: _Optional[_Union[Reset, _Mapping]] = ..., grammar_masks: _Optional[_Union[GrammarMasks, _Mapping]] = ..., start_kv_transfer: _Optional[_Union[StartKVTransfer, _Mapping]] = ..., load_lora: _Optional[_Union[LoadLoRA, _Mapping]] = ..., remove_lora: _Optional[_Union[RemoveLoRA, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("last_forward_time_s",)
    LAST_FORWARD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    last_forward_time_s: float
    def __init__(self, last_forward_time_s: _Optional[float] = ...) -> None: ...

class WorkerError(_message.Message):
    __slots__ = ("kind", "message")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("call_id", "register", "ack", "memory_profile", "model_runner_output", "error", "heartbeat", "reset_done", "model_loaded", "kv_transfer_report", "kv_transfer_agent", "lora_loaded")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PROFILE_FIELD_NUMBER: _ClassVar[int]
    MODEL_RUNNER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RESET_DONE_FIELD_NUMBER: _ClassVar[int]
    MODEL_LOADED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_REPORT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_AGENT_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADED_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    register: RegisterRequest
    ack: Ack
    memory_profile: MemoryProfile
    model_runner_output: ModelRunnerOutput
    error: WorkerError
    heartbeat: Heartbeat
    reset_done: ResetDone
    model_loaded: ModelLoaded
    kv_transfer_report: KVTransferReport
    kv_transfer_agent: _kv_transfer_pb2.KVTransferAgent
    lora_loaded: LoRALoaded
    def __init__(self, call_id: _Optional[int] = ..., register: _Optional[_Union[RegisterRequest, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., memory_profile: _Optional[_Union[MemoryProfile, _Mapping]] = ..., model_runner_output: _Optional[_Union[ModelRunnerOutput, _Mapping]] = ..., error: _Optional[_Union[WorkerError, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., reset_done: _Optional[_Union[ResetDone, _Mapping]] = ..., model_loaded: _Optional[_Union[ModelLoaded, _Mapping]] = ..., kv_transfer_report: _Optional[_Union[KVTransferReport, _Mapping]] = ..., kv_transfer_agent: _Optional[_Union[_kv_transfer_pb2.KVTransferAgent, _Mapping]] = ..., lora_loaded: _Optional[_Union[LoRALoaded, _Mapping]] = ...) -> None: ...
