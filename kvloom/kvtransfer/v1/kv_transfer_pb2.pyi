from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetEngineLayoutRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class KVEngineLayout(_message.Message):
    __slots__ = ("engine_id", "group_epoch", "model_architecture", "num_layers", "total_num_kv_heads", "head_dim", "kv_cache_dtype", "block_size", "num_blocks", "tensor_parallel_size", "pipeline_parallel_size", "lease_s", "agents")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    group_epoch: int
    model_architecture: str
    num_layers: int
    total_num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str
    block_size: int
    num_blocks: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    lease_s: float
    agents: _containers.RepeatedCompositeFieldContainer[KVTransferAgent]
    def __init__(self, engine_id: _Optional[str] = ..., group_epoch: _Optional[int] = ..., model_architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., total_num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., lease_s: _Optional[float] = ..., agents: _Optional[_Iterable[_Union[KVTransferAgent, _Mapping]]] = ...) -> None: ...

class KVTransferAgent(_message.Message):
    __slots__ = ("rank", "tp_rank", "pp_rank", "agent_name", "agent_metadata", "start_layer", "end_layer", "kv_head_start", "num_local_kv_heads", "layer_addresses", "layer_bytes", "device_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    LAYER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    tp_rank: int
    pp_rank: int
    agent_name: str
    agent_metadata: bytes
    start_layer: int
    end_layer: int
    kv_head_start: int
    num_local_kv_heads: int
    layer_addresses: _containers.RepeatedScalarFieldContainer[int]
    layer_bytes: int
    device_id: int
    def __init__(self, rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., num_local_kv_heads: _Optional[int] = ..., layer_addresses: _Optional[_Iterable[int]] = ..., layer_bytes: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class LeasesRequest(_message.Message):
    __slots__ = ("engine_id", "lease_ids")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LeasesReply(_message.Message):
    __slots__ = ("held", "lease_s", "leases", "group_epoch")
    HELD_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedScalarFieldContainer[bool]
    lease_s: float
    leases: _containers.RepeatedCompositeFieldContainer[LeaseBlocks]
    group_epoch: int
    def __init__(self, held: _Optional[_Iterable[bool]] = ..., lease_s: _Optional[float] = ..., leases: _Optional[_Iterable[_Union[LeaseBlocks, _Mapping]]] = ..., group_epoch: _Optional[int] = ...) -> None: ...

class LeaseBlocks(_message.Message):
    __slots__ = ("block_ids", "num_tokens")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...
