"""The worker's view of one step: plain dataclasses made from the protobuf
SchedulerOutput by workerd.wire, consumed by the model runner.

Mirrors controlplane.core.outputs on purpose: the two daemons share only the
protobuf contract, never Python modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1.0 = disabled
    top_k: int = 0  # 0 = disabled
    seed: int | None = None  # None = the worker's default generator
    min_p: float = 0.0  # 0 = disabled
    repetition_penalty: float = 1.0  # 1.0 = disabled; prompt + output tokens
    presence_penalty: float = 0.0  # 0 = disabled; output tokens only
    frequency_penalty: float = 0.0  # 0 = disabled; output tokens only
    # Top-N candidates per output / prompt token; None = not requested.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # While fewer than min_tokens outputs exist, these ids cannot be sampled.
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Non-empty only when a request is recomputed on a re-formed group.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The LoRA adapter (LoadLoRA.lora_id); 0 = the base model.
    lora_id: int = 0


@dataclass(slots=True)
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    # True: new_block_ids replaces the block list instead of extending it.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KVBlockCopies:
    """Pair i copies between block_ids[i] and tier_slots[i] (worker.proto)."""

    block_ids: list[int] = field(default_factory=list)
    tier_slots: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KVRemoteRead:
    """Read remote_block_ids[i] of producer engine_id into block_ids[i] here,
    with NIXL (worker.proto's KVRemoteRead)."""

    engine_id: str
    remote_block_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KVLoadJob:
    """One waiting request's load, reported done under job_id (worker.proto):
    from the host tier (copies) or from a producer (remote_read), never both."""

    job_id: int
    copies: KVBlockCopies
    remote_read: KVRemoteRead | None = None


@dataclass(frozen=True, slots=True)
class KVTransferAgent:
    """One rank's NIXL agent and where its KV lives (kv_transfer.proto): what
    this rank advertises after StartKVTransfer, and what a producer's ranks
    advertised to it."""

    rank: int
    tp_rank: int
    pp_rank: int
    agent_name: str
    agent_metadata: bytes
    # Global layers [start_layer, end_layer), and global KV heads
    # [kv_head_start, kv_head_start + num_local_kv_heads).
    start_layer: int
    end_layer: int
    kv_head_start: int
    num_local_kv_heads: int
    # Each local layer's [2, blocks, block_size, heads, head_dim] tensor.
    layer_addresses: tuple[int, ...]
    layer_bytes: int
    device_id: int


@dataclass(frozen=True, slots=True)
class KVEngineLayout:
    """A producer engine's KV layout and its ranks' agents (kv_transfer.proto)."""

    engine_id: str
    group_epoch: int
    model_architecture: str
    num_layers: int
    total_num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str  # torch's name: "float32", "bfloat16"
    block_size: int
    num_blocks: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    lease_s: float
    agents: tuple[KVTransferAgent, ...]


@dataclass(slots=True)
class KVConnectorMetadata:
    """A step's KV connector instructions: host-tier stores run before its
    forward, load jobs beside it (host_kv_tier.py, nixl_kv.py)."""

    stores: KVBlockCopies = field(default_factory=KVBlockCopies)
    load_jobs: list[KVLoadJob] = field(default_factory=list)
    # Producers this group had not been sent yet; every rank keeps them.
    remote_engines: list[KVEngineLayout] = field(default_factory=list)


@dataclass(slots=True)
class KVJobDone:
    """A load job finished on this rank (worker.proto's KVJobDone)."""

    job_id: int
    # Blocks this rank could not fill: their KV must be recomputed.
    failed_block_ids: list[int]
    bytes: int
    seconds: float


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Requests whose token this step is grammar-constrained, in the order of
    # the step's GrammarMasks: the output rank samples only once those are in.
    constrained_req_ids: list[str] = field(default_factory=list)
    # The step's KV connector instructions; None when nothing moves.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # req_id -> draft tokens to verify after its last known token
    # (speculative decoding); only requests with drafts appear.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class TokenLogprobs:
    """log_softmax of the raw logits at one position (see worker.proto)."""

    logprob: float
    rank: int  # 1-based
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobs:
    req_id: str
    # Prompt position of positions[0]; position 0 never has a logprob.
    start_position: int
    positions: list[TokenLogprobs]


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    # Concatenated: one token per request, or with drafts the accepted ones
    # and one more (num_sampled_tokens[i] for req_ids[i]).
    sampled_token_ids: list[int]
    forward_time_s: float = 0.0
    # Aligned with sampled_token_ids when any sampling request asked for
    # logprobs (None for tokens of those that did not), empty otherwise.
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Empty when every request emitted exactly one token.
    num_sampled_tokens: list[int] = field(default_factory=list)
    # A draft model's proposals for each request's next step, concatenated
    # (num_draft_tokens[i] for req_ids[i]); empty without a draft model.
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)
