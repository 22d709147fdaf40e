"""The controlplane's frozen configuration tree, built once from flags/env in __main__.

Each component receives only the piece it needs: the scheduler gets
SchedulerConfig and CacheConfig, the executor ParallelConfig and
WorkerGroupConfig, the API server ServerConfig. Every field is also a
command-line flag (config_args.option), so its default and help live here only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controlplane.spec_decode.config import SpeculativeConfig
from kvloom.common.config_args import option

if TYPE_CHECKING:
    from controlplane.core.kv_transfer_config import KVTransferConfig


@dataclass(frozen=True)
class ModelConfig:
    # The three paths/names are resolved by __main__ before the tree is built.
    model: str = option("", "checkpoint dir, or an embedded model's name (smollm2-135m, "
                            "gemma-3-270m), converted once; empty = smollm2-135m")
    served_model_name: str = option("", "name reported to clients; empty = the checkpoint dir's")
    # Differs from `model` when the workers mount the checkpoint elsewhere.
    worker_model_path: str = option(
        "", "the checkpoint path as the workers see it; empty = --model"
    )
    dtype: str = option(
        "auto", "weights, activations and KV cache; auto: the checkpoint's 16-bit dtype as "
        "bfloat16 when every rank runs bf16 natively (a CPU with AVX-512 BF16 or AMX, a CUDA "
        "device), else float32", choices=("auto", "float32", "bfloat16", "float16"))
    # Resolved from config.json: its dtype if kvloom loads it, else "".
    checkpoint_dtype: str = ""
    seed: int = option(0, "seed of the workers' default generator", ge=0)
    # Resolved by each worker (auto: flashinfer on a CUDA device where the
    # package imports and the dtype is 16-bit, cpu on a float32 or bfloat16
    # CPU worker whose kernel builds, else torch); see
    # workerd/layers/attention/backend.py.
    attention_backend: str = option(
        "auto", "workers' attention kernels: auto, torch (plain PyTorch, the reference), "
        "cpu (a C kernel built on the worker: CPU, float32 or bfloat16, needs a C compiler) or "
        "flashinfer (CUDA, float16/bfloat16, needs flashinfer-python)",
        choices=("auto", "torch", "cpu", "flashinfer"))
    # vLLM's flag. Graphs are captured only where they apply (a CUDA worker,
    # the flashinfer backend, TP=1, PP=1; workerd/runner/cuda_graphs.py).
    enforce_eager: bool = option(
        False, "run every step eagerly: no CUDA graphs for decode steps (which a CUDA worker "
        "with the flashinfer backend at TP=1, PP=1 otherwise captures)")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV block", ge=1)
    enable_prefix_caching: bool = option(True, "reuse the KV of cached prompt prefixes")
    # vLLM's name. Off, SubscribeKvEvents answers UNIMPLEMENTED and the gateway
    # routes on its approximate token tree instead (design/smg-gateway.md 4.1).
    enable_kv_cache_events: bool = option(
        True, "record prefix-cache block events (stored, removed, cleared) and stream them "
        "on vllm.grpc.engine's SubscribeKvEvents for the SMG gateway's cache-aware routing")
    num_gpu_blocks_override: int = option(
        0, "fixed KV pool size in blocks, overriding what the workers profile "
        "(tests, benchmarks); 0 = profile", ge=0)
    kv_cache_memory_bytes: int = option(
        0, "KV cache bytes per rank; 0 = derived from device memory", ge=0)
    gpu_memory_utilization: float = option(
        0.9, "share of device memory a rank may use (weights, activations, KV)", gt=0, le=1)
    # vLLM's flags (its OffloadingConnector, native backend): a host tier below
    # the prefix cache (controlplane/core/kv_offload.py).
    kv_offloading_size: float = option(
        0.0, "GiB of host memory, over all ranks, that keep KV blocks evicted from the "
        "prefix cache and load them back on a later hit instead of recomputing them; "
        "0 = no tier", ge=0, le=4096)
    kv_offloading_backend: str = option(
        "native", "where the host tier lives: native (host memory beside each rank's KV cache)",
        choices=("native",))
    # vLLM's flag (core/kv_transfer_config.py parses and bounds it at start-up).
    kv_transfer_config: str = option(
        "", "prefill/decode disaggregation, vLLM's JSON: {\"kv_connector\": \"NixlConnector\", "
        "\"kv_role\": \"kv_producer\" | \"kv_consumer\" | \"kv_both\"} (optional engine_id, "
        "kv_load_failure_policy recompute|fail, kv_connector_extra_config.kv_lease_duration); "
        "empty = none")
    # vLLM's CacheConfig.sliding_window. Not a flag: __main__ takes it from the
    # checkpoint (ModelInfo.sliding_window_all_layers), the window when every
    # layer slides, else None; with it the block pool frees blocks that left
    # the window (controlplane/core/kv_cache_manager.py).
    sliding_window: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(256, "most requests in one step", ge=1)
    max_num_batched_tokens: int = option(8192, "token budget of one step", ge=1)
    # Longest prompt + output. Not a flag of its own: __main__ resolves it from
    # --max-model-len and the checkpoint (0 = max_position_embeddings), so the
    # scheduler and the API edge always see a real limit.
    max_model_len: int = 2048
    enable_chunked_prefill: bool = option(
        True, "split long prefills across steps instead of refusing prompts over the budget")
    long_prefill_token_threshold: int = option(
        0, "most prefill tokens one request may take in a step; 0 = no cap", ge=0)
    policy: str = option("fcfs", "which waiting request goes first; priority: smaller "
                         "value first", flag="--scheduling-policy", choices=("fcfs", "priority"))
    async_scheduling: bool = option(
        True, "schedule and send the next step while the workers run this one (PP=1: "
        "two steps in flight; PP>1: one micro-batch per stage); --no-async-scheduling "
        "runs one step at a time")
    # vLLM's flag; spec_decode/config.py parses and bounds it at start-up into
    # `speculative`, which the scheduler reads (core/spec_decode.py).
    speculative_config: str = option(
        "", "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": K, \"prompt_lookup_min\": a, \"prompt_lookup_max\": b} "
        "(n-gram drafts proposed by the controlplane, verified by the workers), or "
        "{\"method\": \"draft_model\", \"model\": DIR, \"num_speculative_tokens\": K} (a "
        "small model with the same tokenizer on the output rank); empty = none")
    speculative: SpeculativeConfig | None = None
    # Distinct LoRA adapters in one step: LoRAConfig.max_loras with
    # --enable-lora, 0 without (core/lora_gate.py); resolved at start-up.
    max_loras: int = 0


# Bounds of the LoRA flags: far above what a CPU or one GPU serves, low
# enough that a typo cannot make every rank allocate for it.
MAX_LORAS = 64
MAX_LORA_RANK = 512
MAX_CPU_LORAS = 1024


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's flags; controlplane/lora/, workerd/lora/)."""

    enable_lora: bool = option(False, "serve LoRA adapters (PEFT's format) beside the base "
                                      "model; requests name one with lora_name")
    max_loras: int = option(1, "distinct LoRA adapters in one step; a waiting request whose "
                               "adapter would exceed it waits, later ones go first",
                            ge=1, le=MAX_LORAS)
    max_lora_rank: int = option(16, "largest adapter rank accepted", ge=1, le=MAX_LORA_RANK)
    max_cpu_loras: int = option(
        0, "adapters the workers hold loaded at once (LRU: an idle one is let go for a new "
           "one and loaded again when named); 0 = max(--max-loras, the --lora-modules)",
        ge=0, le=MAX_CPU_LORAS)
    allow_runtime_lora_updating: bool = option(
        False, "serve LoadLoRAAdapter and UnloadLoRAAdapter (vLLM's "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING): whoever may call the API may then make "
               "the workers read adapter directories")
    lora_engine_ports: str = option(
        "", "ports START-END for each adapter's own vllm.grpc.engine.VllmEngine listener (the "
            "SMG gateway's worker for that model id); empty = free ports picked at run time")
    # --lora-modules NAME=PATH ...: parsed by __main__ (controlplane/lora/names.py).
    lora_modules: tuple[tuple[str, str], ...] = ()

    @property
    def cpu_slots(self) -> int:
        """How many adapters the workers hold at once."""
        return self.max_cpu_loras or max(self.max_loras, len(self.lora_modules))


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = option(1, "ranks per pipeline stage", aliases=("-tp",), ge=1)
    pipeline_parallel_size: int = option(1, "pipeline stages", aliases=("-pp",), ge=1)
    pp_layer_partition: tuple[int, ...] = option(
        (), "comma-separated layers per pipeline stage, e.g. 16,14; empty = even split", ge=1)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """TP rank 0 of the last pipeline stage: the only rank that replies to steps."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


@dataclass(frozen=True)
class WorkerGroupConfig:
    auth_token: str = option(
        "", "shared secret workers must present; empty = not checked (prefer "
        "--auth-token-file: a flag's value shows in ps)")
    # __main__ reads the file into auth_token (worker_auth_token): the
    # executor only ever sees the token.
    auth_token_file: str = option(
        "", "file holding the workers' shared secret (surrounding whitespace stripped); "
        "excludes --auth-token")
    # The worker port's TLS (worker_plane.py). With the CA as well, a worker
    # must present a certificate that CA signed, or its handshake fails.
    worker_ssl_certfile: str = option(
        "", "PEM certificate of the worker port; empty = plaintext (with --worker-ssl-keyfile)")
    worker_ssl_keyfile: str = option("", "PEM private key of --worker-ssl-certfile")
    worker_ssl_ca_certs: str = option(
        "", "PEM CA bundle: workers must present a certificate it signed (mTLS); "
        "empty = no client certificate asked")
    step_timeout_s: float = option(
        60.0, "seconds before a step with no reply fails the worker group",
        flag="--step-timeout", gt=0)
    startup_timeout_s: float = option(
        600.0, "seconds each rank may take per start-up command (load, profile)",
        flag="--startup-timeout", gt=0)
    distributed_timeout_s: float = option(
        120.0, "rendezvous timeout handed to torch.distributed, seconds",
        flag="--distributed-timeout", gt=0)
    heartbeat_timeout_s: float = option(
        30.0, "seconds a worker may send nothing (reply or heartbeat) before it counts as "
        "dead", flag="--heartbeat-timeout", gt=0)
    # vLLM's fault-tolerance name. Requests outlive their worker group this
    # long: held as preempted-for-recompute until the group re-forms.
    engine_recovery_timeout_s: float = option(
        120.0, "seconds in-flight requests are held while the worker group re-forms after a "
        "failure; 0 = fail them at once with UNAVAILABLE (fail-fast)",
        flag="--engine-recovery-timeout", ge=0, le=86400)
    # A redeploy replaces the controlplane, not the ranks: released workers
    # re-register with its successor on the same address and keep their
    # weights (workerd's --reconnect-timeout bounds how long they wait).
    keep_workers_on_exit: bool = option(
        False, "on stop, release the workers instead of telling them to shut down: they "
        "keep their weights and re-register with the next controlplane at this address")


@dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address the gRPC ports and /metrics bind")
    port: int = option(50051, "client API port", ge=0, le=65535)
    worker_port: int = option(50052, "port workers dial", ge=0, le=65535)
    metrics_port: int = option(0, "Prometheus /metrics; 0 = off", ge=0, le=65535)
    max_message_bytes: int = option(
        64 * 1024 * 1024, "largest gRPC message accepted or sent", ge=1)
    max_waiting_requests: int = option(
        1024, "requests allowed to wait beyond --max-num-seqs before new ones get "
        "RESOURCE_EXHAUSTED", ge=0)
    # Below Kubernetes' default 30 s grace period (and compose's
    # stop_grace_period), so the orchestrator's SIGKILL never cuts it short.
    shutdown_timeout_s: float = option(
        20.0, "seconds from SIGTERM to exit: in-flight requests drain, then the "
        "servers and workers stop; keep it below the orchestrator's grace period "
        "(--drain-timeout is a deprecated alias)",
        flag="--shutdown-timeout", aliases=("--drain-timeout",), ge=0, le=3600)


@dataclass(frozen=True)
class ApiLimitsConfig:
    """Per-request bounds of the client API that are flags; the fixed and the
    derived ones (prompt characters, stop strings, logprob entries) are
    constants and rules in controlplane/api/validation.py."""

    max_logprobs: int = option(
        20, "most logprobs / prompt_logprobs one request may ask for (also capped at the "
        "vocabulary size)", ge=0, le=1024)
    max_n: int = option(16, "most samples (sampling.n) one request may ask for", ge=1, le=1024)
    stream_interval: int = option(
        1, "tokens per streamed message for requests that leave stream_interval unset (the "
        "first token always goes at once); more cuts the per-token cost of streaming to "
        "clients that do not need every token as it comes", ge=1, le=1024)


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Structured outputs (SamplingParams.constraint): the edge's bounds on a
    spec, and the engine's compile deadline and compiled-grammar cache. The
    spec checks themselves are controlplane/structured/validate.py's."""

    max_grammar_bytes: int = option(
        64 * 1024, "largest constraint one request may send: a JSON Schema, regex, grammar "
        "or structural tag, or all choices together, in UTF-8 bytes", ge=1, le=16 * 1024 * 1024)
    max_grammar_choices: int = option(
        1024, "most strings one choice constraint may list", ge=1, le=65536)
    # xgrammar's JSON compiles have no timeout of their own; the engine holds
    # the request while it compiles and fails it past this.
    grammar_compile_timeout_s: float = option(
        30.0, "seconds a constraint's grammar may take to compile before its request fails "
        "with DEADLINE_EXCEEDED", flag="--grammar-compile-timeout", gt=0, le=3600)
    # vLLM's disable_any_whitespace, inverted: small models given free
    # whitespace between JSON tokens can emit blanks until max_tokens.
    json_any_whitespace: bool = option(
        True, "JSON constraints that do not say (kvloom.v1's json_any_whitespace unset; every "
        "VllmEngine request, whose wire has no such field) allow any whitespace between JSON "
        "tokens; --no-json-any-whitespace makes them compact")
    grammar_cache_bytes: int = option(
        256 * 1024 * 1024, "bytes of compiled grammars kept for reuse by later requests with "
        "the same constraint (least recently used go first); 0 = no cache",
        ge=0, le=64 * 1024 * 1024 * 1024)


@dataclass(frozen=True)
class ApiSecurityConfig:
    """The client API's TLS, API keys and tenants (docs/security.md, "Client
    API"). The keys themselves are no field: api/auth.py's ApiKeys holds them
    (from --api-key-file and the KVLOOM_API_KEY variable) as digests."""

    ssl_certfile: str = option(
        "", "PEM certificate of the client API port; empty = plaintext (with --ssl-keyfile)")
    ssl_keyfile: str = option("", "PEM private key of --ssl-certfile")
    ssl_ca_certs: str = option(
        "", "PEM CA bundle: clients must present a certificate it signed (mTLS); "
        "empty = no client certificate asked")
    api_key_file: str = option(
        "", "file of accepted API keys, one a line ('#' comments); re-read on SIGHUP. "
        "KVLOOM_API_KEY adds one key. With keys, every kvloom.v1.Generation call needs "
        "'authorization: Bearer <key>'; empty and no KVLOOM_API_KEY = no keys")
    prefix_cache_scope: str = option(
        "key", "with API keys, whose requests share cached prompt prefixes: key = only "
        "requests with the same key (cached_tokens reveals nothing across keys), "
        "global = everyone's", choices=("key", "global"))
    max_requests_per_key: int = option(
        0, "with API keys, most samples one key may have in flight (RESOURCE_EXHAUSTED "
        "beyond); 0 = unlimited", ge=0)
    # The SMG gateway (1.13) sends no API key to its gRPC workers: behind it,
    # its own --api-key guards clients, and the engine hop is guarded by the
    # gateway's client certificate instead.
    vllm_engine_auth: str = option(
        "api-key", "with API keys, what admits a vllm.grpc.engine.VllmEngine call: api-key "
        "(the same keys as kvloom.v1) or client-certificate (mTLS alone, for the SMG "
        "gateway, which sends no key; needs --ssl-ca-certs)",
        choices=("api-key", "client-certificate"))


@dataclass(frozen=True)
class ControlPlaneConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    workers: WorkerGroupConfig = field(default_factory=WorkerGroupConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    api_limits: ApiLimitsConfig = field(default_factory=ApiLimitsConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    api_security: ApiSecurityConfig = field(default_factory=ApiSecurityConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # --kv-transfer-config parsed (and its engine id drawn) once at start-up;
    # None: no disaggregation.
    kv_transfer: KVTransferConfig | None = None
