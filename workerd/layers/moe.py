"""The mixture-of-experts MLP of Mixtral, Qwen3-MoE and Qwen2-MoE, experts
tensor-parallel.

Data flow per layer: the router (`gate`, replicated) scores every token
against every expert; select_experts keeps each token's top_k; FusedMoE runs
each chosen expert's gated MLP, down(silu(gate(x)) * up(x)), on the tokens
that chose it and sums them weighted by the router; Qwen2-MoE adds an
always-on shared expert scaled by a sigmoid gate. One all-reduce over the TP
group ends the layer.

TP of experts (not expert parallelism): every rank holds every expert's
intermediate_size / tp slice, gate/up split by output rows (column parallel),
down by input columns (row parallel), exactly as a dense MLP is split. Each
rank's output is a partial sum of the same shape, so routed and shared
experts add up locally and one all-reduce finishes both. The router is
replicated, so every rank picks the same experts for a token. Expert
parallelism (experts split across ranks, tokens all-to-all) is a later
design (docs/design/model-families.md §3).

Weights are stacked per layer, as vLLM's FusedMoE: w13_weight [E, 2*I_local,
H] (expert e's gate rows, then its up rows) and w2_weight [E, H, I_local].
The hub checkpoint has one tensor per expert and projection, so each fills a
view of the stack through a LoadTarget (workerd/models/weight_targets.py).
On a CPU float32 rank pack_linear_weights may then pack each expert's slice
for oneDNN (FusedMoE is PackableExperts; workerd/layers/packed_linear.py),
freeing the stacks; the packed layer runs "sorted" on the packed slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workerd.distributed.parallel_state import ParallelState, tp_all_reduce
from workerd.layers.activation import SiluAndMul
from workerd.layers.checkpoint_mapped import CheckpointMapped
from workerd.layers.direct_call import DirectCallModule
from workerd.layers.linear import ColumnParallelLinear
from workerd.layers.packed_linear import PackableExperts, linear
from workerd.models.weight_targets import LoadTarget, narrow_index


@dataclass(frozen=True)
class ExpertWeightNames:
    """A family's checkpoint names for one expert's projections, under
    `<prefix>experts.<e>.`: gate (silu'd), up, down."""

    gate: str
    up: str
    down: str


MIXTRAL_EXPERT_NAMES = ExpertWeightNames(gate="w1", up="w3", down="w2")
QWEN_MOE_EXPERT_NAMES = ExpertWeightNames(gate="gate_proj", up="up_proj", down="down_proj")

# How fused_experts runs the experts (FusedMoE's `method`):
#   "sorted":     tokens sorted by expert once; per hit expert one matmul on
#                 its contiguous rows for gate/up, one silu-and-mul over all
#                 rows, then one matmul per hit expert for down (loops over at
#                 most E experts, never over tokens); with packed experts
#                 (pack_linear_weights) each matmul is a oneDNN call on the
#                 expert's packed slice;
#   "grouped_mm": the same sorted rows through torch's grouped GEMM: two calls
#                 per layer however many experts are hit;
#   "auto":       packed experts: sorted, the one method that reads them (the
#                 plain stacks are freed; expert_floor packs only where packed
#                 measured faster than both unpacked methods at the rows per
#                 expert of the batch hint, about 1.4x at 8; at 32 and more
#                 rows, as in prefill, the two are within a few %).
#                 Unpacked: grouped_mm when it applies and the step has on
#                 average at least one row per expert, sorted otherwise
#                 (below that grouped_mm's per-group cost, paid for empty
#                 groups too, loses: benchmarks/moe_layer.py);
#   "reference":  transformers' loop (per hit expert: a one-hot mask search,
#                 gather, matmuls, index_add), the parity reference for tests.
MOE_METHODS = ("auto", "sorted", "grouped_mm", "reference")
# The methods that can run packed experts; a layer built with another keeps
# its plain stacks.
PACKED_MOE_METHODS = ("auto", "sorted")
DEFAULT_MOE_METHOD = "auto"


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   float32_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k], topk_ids [T, k] int64).

    The softmax runs in float32 over all experts, as transformers' routers do
    (in bf16, near-equal probabilities would round together and top-k could
    pick a different expert than the reference does). Mixtral always
    renormalises the kept weights to sum to 1; Qwen-MoE iff norm_topk_prob.
    The weights stay float32 with float32_weights, as Mixtral's router
    (MixtralTopKRouter) returns them, so each expert's output is multiplied
    in float32 and rounded once; otherwise they are cast to the logits'
    dtype, as Qwen-MoE's routers do (in bf16 the two are a rounding apart)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if float32_weights:
        return topk_weights, topk_ids
    return topk_weights.to(router_logits.dtype), topk_ids


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            act_fn: SiluAndMul) -> torch.Tensor:
    """transformers' expert loop (MixtralExperts.forward), kept as the
    reference the grouped forms are tested against. Float32 weights (Mixtral's)
    promote each expert's output, rounded back once per (token, expert)."""
    num_experts = w13.shape[0]
    out = torch.zeros_like(x)
    # [E, k, T]: which (token, slot) pairs chose each expert.
    expert_mask = F.one_hot(topk_ids, num_classes=num_experts).permute(2, 1, 0)
    hit = (expert_mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist()
    for e in hit:
        slot, token = torch.where(expert_mask[e])
        h = F.linear(act_fn(F.linear(x[token], w13[e])), w2[e])
        out.index_add_(0, token, (h * topk_weights[token, slot, None]).to(out.dtype))
    return out


def _sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """The (token, slot) pairs reordered so each expert's are contiguous:
    (order into the flattened [T*k] pairs, the token of each sorted pair,
    per-expert counts [E])."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // topk_ids.shape[1], counts


def grouped_mm_applies(device: torch.device, hidden_size: int, local_intermediate: int) -> bool:
    """Whether "auto" may use torch's grouped GEMM: on CPU (where it was
    measured; CUDA's wants bf16 on sm90+ and is unmeasured), with row strides
    of whole 16 bytes, which it requires (multiples of 8 elements cover bf16
    and float32)."""
    return device.type == "cpu" and hidden_size % 8 == 0 and local_intermediate % 8 == 0


def _per_expert(rows, stack, packed, segments):
    """rows[a:b] times expert e's weight (transposed) for each segment
    (e, a, b): the plain stack's slice, or its packed copy when packed."""
    if packed is None:
        out = rows.new_empty(rows.shape[0], stack.shape[1])
        for e, a, b in segments:
            torch.mm(rows[a:b], stack[e].T, out=out[a:b])
        return out
    if not segments:
        return rows.new_empty(0, packed[0].shape[0])
    # oneDNN's linear has no out=: one cat instead of a copy per expert.
    return torch.cat([linear(rows[a:b], stack, None, packed[e]) for e, a, b in segments])


def _sorted_experts(xs, w13, w2, counts, act_fn, packed13=None, packed2=None):
    segments, start = [], 0
    # One host read of the counts; an expert no token chose costs one compare.
    for e, n in enumerate(counts.tolist()):
        if n:
            segments.append((e, start, start + n))
            start += n
    h = act_fn(_per_expert(xs, w13, packed13, segments))  # once over all rows: [gate | up]
    return _per_expert(h, w2, packed2, segments)


def _grouped_mm_experts(xs, w13, w2, counts, act_fn):
    # Rows offs[e-1]:offs[e] multiply expert e's matrix.
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = act_fn(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, act_fn: SiluAndMul,
                  method: str = DEFAULT_MOE_METHOD,
                  packed13: list[torch.Tensor] | None = None,
                  packed2: list[torch.Tensor] | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token
    t: [T, H], this rank's partial sum under TP (the caller all-reduces).
    topk_weights in x's dtype or float32 (each product then computed in
    float32 and rounded once into x's dtype, as Mixtral's loop does).
    packed13 / packed2: expert e's w13 / w2 slice packed for oneDNN at e
    (pack_stack), read in place of that stack; only PACKED_MOE_METHODS
    run them."""
    packed = packed13 is not None or packed2 is not None
    if packed and method not in PACKED_MOE_METHODS:
        raise ValueError(f"MoE method {method!r} reads the plain stacks, not packed experts")
    if method == "reference":
        return fused_experts_reference(x, w13, w2, topk_weights, topk_ids, act_fn)
    num_experts = len(w13) if packed13 is None else len(packed13)
    if method == "auto":
        dense = topk_ids.numel() >= num_experts
        fits = not packed and grouped_mm_applies(x.device, w13.shape[2], w2.shape[2])
        method = "grouped_mm" if dense and fits else "sorted"
    order, token, counts = _sort_by_expert(topk_ids, num_experts)
    xs = x[token]  # [T*k, H], grouped by expert
    if method == "sorted":
        ys = _sorted_experts(xs, w13, w2, counts, act_fn, packed13, packed2)
    elif method == "grouped_mm":
        ys = _grouped_mm_experts(xs, w13, w2, counts, act_fn)
    else:
        raise ValueError(f"unknown MoE method {method!r} (one of {MOE_METHODS})")
    ys.mul_(topk_weights.flatten()[order].unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, token, ys)


def _empty(*shape: int) -> nn.Parameter:
    # torch.empty: the checkpoint fills every element.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _freed(weight: nn.Parameter) -> nn.Parameter:
    """The empty parameter left in place of a weight once packed."""
    return nn.Parameter(weight.new_empty(0), requires_grad=False)


def _tp_slice(what: str, size: int, ps: ParallelState) -> tuple[int, int]:
    """(start, end) of this rank's rows of an intermediate dim of `size`."""
    if size % ps.tp_size:
        raise ValueError(f"{what}={size} is not divisible by tensor_parallel_size={ps.tp_size}")
    local = size // ps.tp_size
    return ps.tp_rank * local, (ps.tp_rank + 1) * local


def _gated_mlp_targets(w13: torch.Tensor, w2: torch.Tensor, start: int, end: int,
                       gate: str, up: str, down: str) -> dict[str, list[LoadTarget]]:
    """One gated MLP's three checkpoint tensors into its stacked views: the
    gate and up rows start:end into w13's two halves, down's columns
    start:end into w2."""
    local = end - start
    rows = narrow_index(0, start, end)
    return {
        gate: [LoadTarget(w13[:local], rows)],
        up: [LoadTarget(w13[local:], rows)],
        down: [LoadTarget(w2, narrow_index(1, start, end))],
    }


class FusedMoE(CheckpointMapped, PackableExperts, DirectCallModule):
    """The routed experts of one layer, stacked, this rank's TP slice of each.

    forward(hidden_states [T, H], router_logits [T, E]) -> [T, H]: routing,
    the experts, and (reduce_results) the TP all-reduce; a caller that adds
    more partial sums first (the shared expert) passes reduce_results=False
    and reduces once itself. expert_names: the family's checkpoint names;
    float32_weights: select_experts' (True for Mixtral). pack_linear_weights
    may replace each stack by its experts' packed slices (PackableExperts)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 ps: ParallelState, renormalize: bool, reduce_results: bool = True,
                 expert_names: ExpertWeightNames = QWEN_MOE_EXPERT_NAMES,
                 hidden_act: str = "silu", method: str = DEFAULT_MOE_METHOD,
                 float32_weights: bool = False):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts} must be >= 1")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        if hidden_act != "silu":
            raise ValueError(f"unsupported MoE hidden_act {hidden_act!r} (only silu)")
        if method not in MOE_METHODS:
            raise ValueError(f"unknown MoE method {method!r} (one of {MOE_METHODS})")
        self.start, self.end = _tp_slice("moe_intermediate_size", intermediate_size, ps)
        local = self.end - self.start
        if method == "grouped_mm" and not grouped_mm_applies(ps.device, hidden_size, local):
            # Refused at build, not mid-step ("auto" falls back by itself).
            raise ValueError(f"grouped_mm needs a CPU rank and hidden_size={hidden_size} and "
                             f"the per-rank intermediate size {local} multiples of 8")
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.reduce_results, self.method = renormalize, reduce_results, method
        self.float32_weights = float32_weights
        self.expert_names, self.ps = expert_names, ps
        self.w13_weight = _empty(num_experts, 2 * local, hidden_size)
        self.w2_weight = _empty(num_experts, hidden_size, local)
        self.act_fn = SiluAndMul()
        # Expert e's packed w13 / w2 slice at e, once packed (the stack freed).
        self.packed_w13: list[torch.Tensor] | None = None
        self.packed_w2: list[torch.Tensor] | None = None

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize,
                                                self.float32_weights)
        out = fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights,
                            topk_ids, self.act_fn, self.method, self.packed_w13, self.packed_w2)
        return tp_all_reduce(out, self.ps) if self.reduce_results else out

    def plain_stacks(self) -> dict[str, torch.Tensor]:
        if self.method not in PACKED_MOE_METHODS:
            return {}
        stacks = {"w13_weight": self.w13_weight, "w2_weight": self.w2_weight}
        packed = {"w13_weight": self.packed_w13, "w2_weight": self.packed_w2}
        return {name: w for name, w in stacks.items() if packed[name] is None}

    def rows_per_expert(self, batch_rows: int) -> float:
        return batch_rows * self.top_k / self.num_experts

    def use_packed(self, name: str, packed: list[torch.Tensor]) -> None:
        if len(packed) != self.num_experts:
            raise ValueError(f"{len(packed)} packed experts for {self.num_experts}")
        # The checkpoint views of checkpoint_targets() are made on demand, so
        # this drops the layer's last reference to the stack.
        if name == "w13_weight":
            self.packed_w13, self.w13_weight = packed, _freed(self.w13_weight)
        elif name == "w2_weight":
            self.packed_w2, self.w2_weight = packed, _freed(self.w2_weight)
        else:
            raise KeyError(f"FusedMoE has no stack {name!r}")

    def packed_weights(self) -> list[torch.Tensor]:
        return [*(self.packed_w13 or ()), *(self.packed_w2 or ())]

    def checkpoint_targets(self) -> dict[str, list[LoadTarget]]:
        """`<e>.<gate|up|down>.weight` (under the checkpoint's `experts.`) for
        every expert e -> its views of the stacks."""
        n = self.expert_names
        m: dict[str, list[LoadTarget]] = {}
        for e in range(self.num_experts):
            per = _gated_mlp_targets(self.w13_weight.data[e], self.w2_weight.data[e],
                                     self.start, self.end, n.gate, n.up, n.down)
            m.update({f"{e}.{name}.weight": t for name, t in per.items()})
        return m


class SharedExpert(PackableExperts, DirectCallModule):
    """Qwen2-MoE's always-on expert, a gated MLP split like the routed ones,
    scaled per token by sigmoid(shared_expert_gate(x)). The gate is
    replicated and its scale is per token, so scaling this rank's partial sum
    scales the reduced one: no collective of its own. For packing it is a
    stack of one expert that every token multiplies (the gate stays plain)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ps: ParallelState):
        super().__init__()
        self.start, self.end = _tp_slice("shared_expert_intermediate_size", intermediate_size, ps)
        local = self.end - self.start
        self.w13_weight = _empty(2 * local, hidden_size)
        self.w2_weight = _empty(hidden_size, local)
        self.gate_weight = _empty(1, hidden_size)
        self.act_fn = SiluAndMul()
        self.packed_w13: torch.Tensor | None = None
        self.packed_w2: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act_fn(linear(x, self.w13_weight, None, self.packed_w13))
        h = linear(h, self.w2_weight, None, self.packed_w2)
        return h.mul_(torch.sigmoid(F.linear(x, self.gate_weight)))

    def plain_stacks(self) -> dict[str, torch.Tensor]:
        stacks = {"w13_weight": (self.w13_weight, self.packed_w13),
                  "w2_weight": (self.w2_weight, self.packed_w2)}
        return {name: w.unsqueeze(0) for name, (w, packed) in stacks.items() if packed is None}

    def rows_per_expert(self, batch_rows: int) -> float:
        return float(batch_rows)

    def use_packed(self, name: str, packed: list[torch.Tensor]) -> None:
        (one,) = packed
        if name == "w13_weight":
            self.packed_w13, self.w13_weight = one, _freed(self.w13_weight)
        elif name == "w2_weight":
            self.packed_w2, self.w2_weight = one, _freed(self.w2_weight)
        else:
            raise KeyError(f"SharedExpert has no stack {name!r}")

    def packed_weights(self) -> list[torch.Tensor]:
        return [p for p in (self.packed_w13, self.packed_w2) if p is not None]

    def block_targets(self) -> dict[str, list[LoadTarget]]:
        """Under the block's prefix: `shared_expert.{gate,up,down}_proj.weight`
        and its sibling `shared_expert_gate.weight` (so not CheckpointMapped,
        whose names live under the module's own prefix)."""
        per = _gated_mlp_targets(self.w13_weight.data, self.w2_weight.data, self.start,
                                 self.end, "gate_proj", "up_proj", "down_proj")
        m = {f"shared_expert.{n}.weight": t for n, t in per.items()}
        m["shared_expert_gate.weight"] = [LoadTarget(self.gate_weight.data)]
        return m


class SparseMoeBlock(CheckpointMapped, DirectCallModule):
    """The MLP of a sparse decoder layer: router, routed experts, optional
    shared expert, one all-reduce. forward(hidden_states [T, H]) -> [T, H],
    reduced over the TP group.

    renormalize: True for Mixtral, norm_topk_prob for Qwen-MoE.
    shared_expert_intermediate_size: Qwen2-MoE's (0: no shared expert).
    expert_names: MIXTRAL_EXPERT_NAMES or QWEN_MOE_EXPERT_NAMES.
    method: MOE_METHODS ("auto": the measured fastest for the step).
    float32_weights: the routing weights kept in float32 (Mixtral's router)
    rather than cast to the activations' dtype (Qwen-MoE's)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 ps: ParallelState, renormalize: bool, shared_expert_intermediate_size: int = 0,
                 expert_names: ExpertWeightNames = QWEN_MOE_EXPERT_NAMES,
                 hidden_act: str = "silu", method: str = DEFAULT_MOE_METHOD,
                 float32_weights: bool = False):
        super().__init__()
        self.ps = ps
        # Replicated router: one shard that every rank holds.
        self.gate = ColumnParallelLinear(hidden_size, num_experts, ps, num_shards=1, shard_index=0)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, ps,
                                renormalize, reduce_results=False, expert_names=expert_names,
                                hidden_act=hidden_act, method=method,
                                float32_weights=float32_weights)
        self.shared_expert = (SharedExpert(hidden_size, shared_expert_intermediate_size, ps)
                              if shared_expert_intermediate_size else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            out += self.shared_expert(hidden_states)
        return tp_all_reduce(out, self.ps)

    def checkpoint_targets(self) -> dict[str, list[LoadTarget]]:
        """Every checkpoint tensor of this block, named under the block's own
        prefix ("model.layers.<global i>.block_sparse_moe." for Mixtral,
        "model.layers.<global i>.mlp." for Qwen-MoE) -> its LoadTargets."""
        m = {"gate.weight": [LoadTarget(self.gate.weight.data)]}
        m.update({f"experts.{k}": t for k, t in self.experts.checkpoint_targets().items()})
        if self.shared_expert is not None:
            m.update(self.shared_expert.block_targets())
        return m
