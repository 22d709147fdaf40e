"""ModelRunner: executes one SchedulerOutput on this rank's model shard.

The worker hands every step's SchedulerOutput (already converted from
protobuf by workerd.wire) to execute_model, which
  1. folds the diff into per-request state and the persistent input batch
     (_update_states),
  2. lays the scheduled tokens out request by request and builds input ids,
     positions, slot mapping and AttentionMetadata (prepare_inputs),
  3. runs the shard: non-first pipeline stages receive hidden states from the
     previous stage, non-last stages send theirs on and stop there,
  4. on the last stage computes logits for requests whose context is complete
     (plus every prompt position of requests that asked for prompt logprobs)
     and, on the output rank only, samples one token each and takes the
     logprobs that were asked for (workerd.sample.logprobs); a step with
     grammar-constrained requests samples once their masks are in
     (workerd.runner.grammar_step).
  5. appends one token per sampling request on every rank
     (workerd.runner.sampled_tokens): the output rank its sampled ids, the first PP
     stage the same ids received from it, every other rank a placeholder.
The diff does not carry sampled tokens (the controlplane may schedule the next
step before it has seen them), so this is how all ranks stay identical.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from workerd.distributed import parallel_state as distributed
from workerd.distributed.parallel_state import ParallelState
from workerd.layers.attention.backend import backend_class, make_attention_backend
from workerd.layers.attention.metadata import AttentionMetadata
from workerd.layers.custom_op import rank_kernels, use_custom_op_kernels
from workerd.layers.packed_linear import pack_linear_weights, packed_bytes, packing_unavailable
from workerd.limits import WorkerLimits
from workerd.lora.config import LoRAConfig
from workerd.models.loader import load_model
from workerd.runner import kv_connector_worker as kv_connector
from workerd.runner.cuda_graphs import (
    DecodeGraphs,
    capture_sizes,
    graphs_memory_bytes,
    graphs_unavailable,
)
from workerd.runner.draft_model import DraftModelProposer
from workerd.runner.grammar_step import StepGrammar
from workerd.runner.host_kv_tier import HostKVTier, OnLoadsDone, close_tier
from workerd.runner.input_batch import CachedRequestState, InputBatch, apply_scheduler_output
from workerd.runner.kv_cache import (
    allocate_kv_caches,
    bytes_per_block,
    cpu_kv_cache_budget,
    cuda_kv_cache_budget,
    num_blocks_for_budget,
)
from workerd.runner.lora_step import RunnerLoRA, detach_lora, lora_segments
from workerd.runner.nixl_kv import NixlKVTransfer
from workerd.runner.profile_run import profile_run
from workerd.runner.sample_rows import sample_rows
from workerd.runner.sampled_tokens import SampledTokens
from workerd.runner.sched_output import KVTransferAgent, ModelRunnerOutput, SchedulerOutput
from workerd.runner.spec_verify import verify_drafts
from workerd.runner.step_inputs import StepInputs
from workerd.sample.grammar_masks import GrammarMaskBox
from workerd.sample.logprobs import (
    PromptLogprobsTarget,
    prompt_logprobs,
    prompt_target,
)
from workerd.sample.sampler import GrammarMetadata, Sampler

logger = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model shard, KV cache and request mirror.

    Life cycle, driven by the worker's command table: load_model ->
    profile_num_blocks -> init_kv_cache (with the group's minimum) -> one
    execute_model per step.
    """

    def __init__(
        self,
        ps: ParallelState,
        model_path: str,
        dtype: torch.dtype,
        seed: int,
        pp_layer_partition: tuple[int, ...] | list[int] = (),
        *,
        limits: WorkerLimits,
        attention_backend: str = "torch",
        enforce_eager: bool = False,
        pack_weights: bool = True,
        grammar_masks: GrammarMaskBox | None = None,
        draft_model_path: str = "",
        num_speculative_tokens: int = 0,
    ) -> None:
        self.ps = ps
        self.model_path = model_path
        self.dtype = dtype
        self.pp_layer_partition = tuple(pp_layer_partition)
        # The scheduler's limits: the profile run's worst case.
        self.limits = limits
        self.device = torch.device(ps.device)
        # Already resolved (torch, cpu or flashinfer) by the worker's load_model.
        self.attention_backend = attention_backend
        # --enforce-eager: no CUDA graphs (workerd/runner/cuda_graphs.py) even where
        # they apply. Read at init_kv_cache, which captures them.
        self.enforce_eager = enforce_eager
        # CPU float32 ranks pack their linear weights at load
        # (workerd/layers/packed_linear.py); False keeps F.linear, for
        # benchmarks that compare the two in one run.
        self.pack_weights = pack_weights
        self.graphs: DecodeGraphs | None = None
        # How graphs are captured (None: torch.cuda.graph); tests stand in.
        self.graph_capture = None
        # A private generator keeps unseeded sampling reproducible from
        # LoadModel.seed without touching torch's global RNG.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.sampler = Sampler(self.generator)
        self.model: Any = None
        self.kv_caches: list[torch.Tensor] = []
        # The prefix cache's host tier on this rank (host_kv_tier.py), and the
        # NIXL agent over its KV cache (nixl_kv.py); None: not set up.
        self.kv_tier: HostKVTier | None = None
        self.kv_transfer: NixlKVTransfer | None = None
        self.block_size = 0
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch()
        self.sampled_tokens = SampledTokens(ps)
        # Seconds the last step spent blocked receiving the previous stage's
        # hidden states (0 on the first stage). Not work: a stage waiting on
        # the one before it is a pipeline bubble, so it is kept out of
        # forward_time_s and reported on its own.
        self.last_recv_wait_s = 0.0
        # The output rank's wait for a step's grammar masks (the worker's
        # box); like the receive above, kept out of forward_time_s.
        self.grammar = StepGrammar(grammar_masks)
        # Speculative decoding with a draft model: the output rank's proposer
        # (draft_model.py), loaded by load_model; None elsewhere.
        self.draft_model_path = draft_model_path
        self.num_speculative_tokens = num_speculative_tokens
        self.drafter: DraftModelProposer | None = None
        # --enable-lora (lora_step.py, set by init_lora); None: no adapters.
        self.lora: RunnerLoRA | None = None

    # ---- start-up -------------------------------------------------------

    def load_model(self) -> None:
        self.model = load_model(self.model_path, self.ps, self.dtype, self.pp_layer_partition)
        if self.draft_model_path and self.ps.is_output_rank:
            self.drafter = DraftModelProposer(self.draft_model_path, self.dtype, self.device,
                                              self.num_speculative_tokens)
        self.model.set_attention_backend(make_attention_backend(
            self.attention_backend, self.device,
            kv_width=self.model.num_kv_heads * self.model.head_dim))
        kernels = rank_kernels(self.device, self.dtype, self.attention_backend)
        num_ops = use_custom_op_kernels(self.model, kernels)
        logger.info("%d norm and activation ops run %s", num_ops,
                    "kvloom's C kernels" if kernels is not None else "torch")
        reason = packing_unavailable(self.device, self.dtype) if self.pack_weights else "off"
        if reason is None:
            n = pack_linear_weights(self.model, self.limits.max_num_seqs)
            logger.info("packed %d linear weights into oneDNN's layout", n)
        else:
            logger.info("linear layers run F.linear (weights not packed: %s)", reason)

    def with_limits(self, limits: WorkerLimits, *, enforce_eager: bool) -> ModelRunner:
        """A runner over these loaded weights for a LoadModel that differs only
        in its limits or enforce_eager, which the weights do not depend on
        (packing's batch hint only tunes the layout). It starts without
        requests or KV cache, as a LoadModel is always followed by
        init_kv_cache, and draws from the random stream where this one left it."""
        runner = ModelRunner(
            self.ps, self.model_path, self.dtype, 0, self.pp_layer_partition, limits=limits,
            attention_backend=self.attention_backend, enforce_eager=enforce_eager,
            pack_weights=self.pack_weights, grammar_masks=self.grammar.box,
            draft_model_path=self.draft_model_path,
            num_speculative_tokens=self.num_speculative_tokens)
        runner.model = self.model  # in place of runner.load_model()
        runner.drafter = self.drafter
        if runner.drafter is not None:
            runner.drafter.reset()
        runner.generator.set_state(self.generator.get_state())
        runner.graph_capture = self.graph_capture
        return runner

    def weights_bytes(self) -> int:
        plain = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return plain + packed_bytes(self.model)

    def profile_num_blocks(
        self, block_size: int, kv_cache_memory_bytes: int, gpu_memory_utilization: float
    ) -> tuple[int, int]:
        """(num_blocks, bytes_per_block) this rank can hold."""
        block_bytes = bytes_per_block(self.model, block_size, self.dtype)
        if kv_cache_memory_bytes > 0:
            budget = kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = cuda_kv_cache_budget(
                self.device, gpu_memory_utilization, lambda: self._profile_run(block_size)
            )
            if self._graphs_unavailable() is None:
                # init_kv_cache captures them after the cache is allocated.
                budget -= graphs_memory_bytes(self.limits.max_num_seqs,
                                             len(self.model.attention_kinds))
        else:
            budget = cpu_kv_cache_budget()
        return num_blocks_for_budget(budget, block_bytes), block_bytes

    def init_kv_cache(self, num_blocks: int, block_size: int, num_offload_slots: int = 0,
                      on_loads_done: OnLoadsDone | None = None) -> None:
        """num_offload_slots: the host tier's size in blocks (0: none);
        on_loads_done hears of its finished load jobs (the rank's reports)."""
        self.graphs = None  # captured against the old cache, if any
        self.kv_tier = close_tier(self.kv_tier)
        self.kv_transfer = kv_connector.close_transfer(self.kv_transfer)  # over the old cache
        reason = self._graphs_unavailable()
        # Graphs pad decode batches; the padding's K/V goes to one extra
        # block past the controlplane's pool, which no request ever owns.
        extra = 1 if reason is None else 0
        self.kv_caches = allocate_kv_caches(
            self.model, num_blocks + extra, block_size, self.dtype, self.device
        )
        self.block_size = block_size
        if num_offload_slots:
            if on_loads_done is None:
                raise ValueError("a host tier needs a way to report its loads")
            self.kv_tier = HostKVTier(self.kv_caches, num_offload_slots, on_loads_done)
        if reason is None:
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, block_size, self.dtype, self.device,
                capture_sizes(self.limits.max_num_seqs), graph=self.graph_capture)
        else:
            logger.info("decode steps run eagerly (no CUDA graphs): %s", reason)

    def start_kv_transfer(self, engine_id: str, advertise_host: str,
                          on_loads_done: OnLoadsDone, serve_reads: bool = True
                          ) -> KVTransferAgent:
        """A NIXL agent over the allocated cache (replacing any), for PD."""
        if not self.kv_caches:
            raise RuntimeError("StartKVTransfer before init_kv_cache")
        layout = kv_connector.rank_kv_layout(self.model, self.ps, self.block_size)
        self.kv_transfer = kv_connector.start_kv_transfer(
            self.kv_transfer, self.kv_caches, layout, engine_id, on_loads_done, advertise_host,
            serve_reads)
        return self.kv_transfer.transfer_agent

    def init_lora(self, config: LoRAConfig | None) -> None:
        """After load_model (or on reused weights): a fresh adapter manager,
        holding none, or none at all; adapters come with LoadLoRA."""
        detach_lora(self.model)
        # The C kernel where the rank runs its other C kernels (custom_op.py).
        kernels = rank_kernels(self.device, self.dtype, self.attention_backend)
        self.lora = RunnerLoRA(self.model, config, kernels) if config is not None else None

    def _graphs_unavailable(self) -> str | None:
        if self.lora is not None:
            return "LoRA adapters are on (steps run eagerly)"
        return graphs_unavailable(self.device, backend_class(self.attention_backend),
                                  self.ps.world_size, self.enforce_eager)

    def reset_state(self) -> None:
        """The group failed: forget every request and the KV cache (its blocks
        mean nothing to the next group's scheduler); the weights stay."""
        self.requests = {}
        self.input_batch = InputBatch()
        self.sampled_tokens.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self.kv_tier = close_tier(self.kv_tier)  # a re-formed group's tier starts empty
        self.kv_transfer = kv_connector.close_transfer(self.kv_transfer)  # and its producers
        self.kv_caches = []
        self.graphs = None
        self.block_size = 0

    # ---- one step -------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self.last_recv_wait_s = self.grammar.last_wait_s = 0.0
        if self.drafter is not None:
            self.drafter.forget(scheduler_output.finished_req_ids)
        self._update_states(scheduler_output)
        kv_connector.run_kv_connector(self.kv_tier, self.kv_transfer,
                                      scheduler_output.kv_connector_metadata)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self._nothing_sampled(scheduler_output)
        if not self.kv_caches:
            raise RuntimeError("execute_model before init_kv_cache")
        self.sampled_tokens.resolve(self.input_batch.req_id_to_index)
        inputs = self.prepare_inputs(scheduler_output)
        # Every rank advances the same way, so all agree on next step's rows.
        for target in inputs.prompt_targets:
            state = self.requests[target.req_id]
            state.prompt_logprobs_from = target.start_position + len(target.token_ids)
        start = time.perf_counter()
        with torch.inference_mode():
            hidden = self._forward(inputs)
            drafts = inputs.num_draft_tokens
            if hidden is None:
                self.sampled_tokens.append(inputs.sample_states, None, drafts)
                return None
            num_sample = len(inputs.sample_states)
            if num_sample == 0 and not inputs.prompt_targets:
                # Only partial prefill chunks: nothing to sample, but every
                # last-stage rank takes the same branch, so no collective hangs.
                out = self._nothing_sampled(scheduler_output)
            else:
                indices = inputs.logits_indices
                if inputs.prompt_targets:
                    extra = torch.tensor(inputs.prompt_logits_indices, device=indices.device)
                    indices = torch.cat([indices, extra])
                # compute_logits may gather vocab shards: every last-stage TP rank calls it.
                logits = self.model.compute_logits(hidden[indices])
                if not self.ps.is_output_rank:
                    self.sampled_tokens.append(inputs.sample_states, None, drafts)
                    return None
                grammar = self.grammar.take(scheduler_output, inputs.sample_states,
                                            logits.shape[-1], self.device, drafts)
                num_rows = num_sample + len(inputs.draft_token_ids)
                if inputs.draft_token_ids:
                    out, tokens = verify_drafts(self.sampler, logits[:num_rows],
                                                inputs.sample_states, drafts,
                                                inputs.draft_token_ids, grammar)
                else:
                    out = self.sample(logits[:num_rows], inputs.sample_states, grammar)
                    tokens = [[t] for t in out.sampled_token_ids]
                self.sampled_tokens.append(inputs.sample_states, tokens, drafts)
                if self.drafter is not None:
                    proposals = self.drafter.propose(inputs.sample_states)
                    out.num_draft_tokens = [len(p) for p in proposals]
                    out.draft_token_ids = [t for p in proposals for t in p]
                if inputs.prompt_targets:
                    out.prompt_logprobs = prompt_logprobs(
                        logits[num_rows:], inputs.prompt_targets
                    )
        if out is not None:
            waits = self.last_recv_wait_s + self.grammar.last_wait_s
            out.forward_time_s = time.perf_counter() - start - waits
        return out

    def _nothing_sampled(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """The reply to a step in which no request samples."""
        if not self.ps.is_output_rank:
            return None
        self.grammar.take(so, [], 0, self.device)  # raises if it lists a constrained request
        return ModelRunnerOutput([], [])

    def sample(self, logits: torch.Tensor, states: list[CachedRequestState],
               grammar: GrammarMetadata | None = None) -> ModelRunnerOutput:
        """Step 4's sampling on the output rank: one token per row of logits
        (states in the same order; `grammar` restricts some rows) and the
        logprobs those requests asked for (of the raw logits). Public for
        benchmarks that time the step's parts (decode_roofline)."""
        return sample_rows(self.sampler, self.device, logits, states, grammar)

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Runs this stage; returns the last stage's hidden states, None elsewhere."""
        ps = self.ps
        if self.graphs is not None and self.graphs.can_run(inputs.attn_metadata):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        if self.lora is not None:
            self.lora.begin_step(inputs.lora_segments)
        intermediate = None
        if not ps.is_first_pp_rank:
            t0 = time.perf_counter()
            intermediate = distributed.recv_intermediate(
                inputs.positions.numel(), self.model.hidden_size, self.dtype, ps
            )
            self.last_recv_wait_s = time.perf_counter() - t0
        out = self.model.forward(
            inputs.input_ids if ps.is_first_pp_rank else None,
            inputs.positions,
            self.kv_caches,
            inputs.attn_metadata,
            intermediate,
        )
        if not ps.is_last_pp_rank:
            distributed.send_intermediate(out, ps)
            return None
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        apply_scheduler_output(so, self.requests, self.input_batch, self.device)

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Step 2: the model inputs of the step `so` schedules, laid out from
        the persistent batch after _update_states has folded `so` in. Reads
        the runner's state and changes none of it, so benchmarks
        (decode_roofline) time it again on a step execute_model has run."""
        states = self.input_batch.states()
        num_reqs = len(states)
        block_size = self.block_size
        query_lens = [so.num_scheduled_tokens[s.req_id] for s in states]
        starts = [s.num_computed_tokens for s in states]
        spec = so.scheduled_spec_decode_tokens
        num_draft_tokens: list[int] = []
        draft_token_ids: list[int] = []

        input_ids: list[int] = []
        logits_indices: list[int] = []
        sample_states: list[CachedRequestState] = []
        prompt_indices: list[int] = []
        prompt_targets: list[PromptLogprobsTarget] = []
        num_tokens = 0
        for state, start, n in zip(states, starts, query_lens, strict=True):
            end = start + n
            drafts = spec.get(state.req_id, ()) if spec else ()
            # Drafts follow the last known token: a step verifying them
            # computes exactly up to the last one.
            known = state.num_tokens
            if end > known + len(drafts) or (drafts and end != known + len(drafts)):
                raise ValueError(
                    f"request {state.req_id!r}: {n} tokens scheduled from {start} "
                    f"but it holds {known} and {len(drafts)} draft(s)"
                )
            input_ids.extend(state.all_token_ids[start:min(end, known)])
            input_ids.extend(drafts)
            if state.sampling_params.prompt_logprobs is not None:
                target = prompt_target(state, start, end)
                if target is not None:
                    # The logits at position p - 1 predict prompt token p.
                    first = num_tokens + target.start_position - 1 - start
                    prompt_indices.extend(range(first, first + len(target.token_ids)))
                    prompt_targets.append(target)
            num_tokens += n
            # A partial prefill chunk ends before the context does: no sample.
            # With drafts, the logits of the last known token and of each
            # draft are verified (the rows of verify_drafts).
            if end == known + len(drafts):
                logits_indices.extend(range(num_tokens - 1 - len(drafts), num_tokens))
                sample_states.append(state)
                num_draft_tokens.append(len(drafts))
                draft_token_ids.extend(drafts)

        # The index arithmetic runs in numpy: a dozen small ops each step,
        # each far cheaper than a torch dispatch on tensors this small
        # (docs/cpu_worker.md, "Fewer dispatches per step"); the results are
        # shared with torch, not copied.
        q = np.array(query_lens, dtype=np.int64)
        start_np = np.array(starts, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q, out=query_start_loc[1:])
        req_idx = np.repeat(np.arange(num_reqs), q)
        # Each token's position: its request's first position plus its offset.
        positions = np.repeat(start_np - query_start_loc[:-1], q) + np.arange(num_tokens)
        block_table = self.input_batch.block_table.view(num_reqs)
        block_idx = positions // block_size
        num_blocks = np.array(self.input_batch.block_table.num_blocks[:num_reqs], dtype=np.int64)
        missing = block_idx >= num_blocks[req_idx]
        if missing.any():
            bad = states[int(req_idx[missing][0])].req_id
            raise ValueError(f"request {bad!r} has no KV block for a scheduled position")
        slot_mapping = block_table.numpy()[req_idx, block_idx] * block_size + positions % block_size
        seq_lens_cpu = [s + n for s, n in zip(starts, query_lens, strict=True)]

        dev = self.device
        attn_metadata = AttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens=torch.from_numpy(start_np + q).to(dev),
            block_table=block_table.to(dev),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens_cpu, default=0),
            block_size=block_size,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens_cpu,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            attn_metadata=attn_metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            sample_states=sample_states,
            prompt_logits_indices=prompt_indices,
            prompt_targets=prompt_targets,
            num_draft_tokens=num_draft_tokens,
            draft_token_ids=draft_token_ids,
            lora_segments=lora_segments(states, query_lens) if self.lora is not None else [],
        )

    # ---- profiling --------------------------------------------------------

    def _profile_run(self, block_size: int) -> None:
        """The activation peak the CUDA KV budget is measured around."""
        profile_run(self.model, self.ps, self.limits, block_size, self.dtype, self.device)
