"""One rank's LoRA adapters (vLLM's WorkerLoRAManager + LoRAModelManager):
attaches a LinearLoRA to every linear layer an adapter may target, loads and
frees adapters, and hands each step's segments to the layers.

Adapters are loaded off the step path (the controlplane's LoadLoRA, before
it admits a request naming one: vLLM reads a missing adapter from disk
inside the step). Every rank reads the same directory and keeps the slices
of its own layers: a PP stage binds its layers' modules only, a TP rank its
shard of each.

What an adapter targets is checked against the whole model, every stage's
layers, through a twin of the model built on the meta device (no memory):
a module no stage has, a layer of a mixture of experts, the embedding or
the LM head, or a factor whose shape is not the module's (an adapter for
another base) is refused on every rank alike, naming the tensor, rather
than loaded to change nothing (vLLM #34186) or the wrong thing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from workerd.distributed.parallel_state import single_process_state
from workerd.layers.checkpoint_mapped import CheckpointMapped
from workerd.lora.config import LoRAConfig
from workerd.lora.layers import LORA_LAYERS, LinearLoRA, LoRAStep
from workerd.lora.peft_checkpoint import LoRAAdapterError, LoRAModuleWeights, load_peft_lora

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HEAD_MODULES = ("lm_head", "embed_tokens")


@dataclass(frozen=True)
class LoadedAdapter:
    # sha256 of the adapter's files (peft_checkpoint.py): the prefix cache's key.
    digest: str
    # Bytes of the adapter's tensors this rank holds.
    num_bytes: int
    # Modules bound on this rank (a PP stage holds its layers' only).
    num_modules: int
    # The adapter's r (adapter_config.json).
    rank: int = 0
    # The adapter's rank r (adapter_config.json).
    rank: int = 0


@dataclass
class _Adapter:
    name: str
    loaded: LoadedAdapter
    layers: list[LinearLoRA]


def _lora_modules(model: nn.Module, first_layer: int):
    """(HF module path, its own name, layer) of every linear layer outside a
    mixture of experts, and the HF path prefixes of the mixtures."""
    layers, moe = [], []
    for path, module in model.named_modules():
        m = _LAYER.fullmatch(path)
        if m is None:
            continue
        hf = f"model.layers.{first_layer + int(m.group(1))}.{m.group(2)}"
        if any(hf.startswith(p) for p in moe):
            continue  # inside a mixture (its router, its shared expert)
        if isinstance(module, CheckpointMapped):
            moe.append(hf + ".")
            if "." not in m.group(2):
                # transformers 5 names every family's MLP `mlp` (Mixtral's
                # checkpoint keeps block_sparse_moe): PEFT keys follow the class.
                moe.append(f"{hf.rsplit('.', 1)[0]}.mlp.")
        elif isinstance(module, LORA_LAYERS):
            layers.append((hf, m.group(2).rsplit(".", 1)[-1], module))
    return layers, moe


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, kernels=None):
        """Attach a LinearLoRA to every supported linear of this rank's stage
        (replacing any attached before). kernels: the C kernels (CpuKernels)
        when this rank runs them (workerd/layers/custom_op.rank_kernels),
        else None: torch code."""
        self.model, self.config = model, config
        self.step = LoRAStep(model.ps.device)
        self.step.kernels = kernels
        self._aliases = self._path_aliases(model.checkpoint_prefix)
        # Every stage's modules: HF path -> (in, out) of the whole module.
        self._shapes: dict[str, tuple[int, int]] = {}
        with torch.device("meta"):
            twin = type(model)(model.config, single_process_state("meta"))
        twin_layers, self._moe = _lora_modules(twin, 0)
        for hf, name, layer in twin_layers:
            parent = hf.rsplit(".", 1)[0]
            for target_name, target in LinearLoRA(layer, LoRAStep("meta"), name).targets.items():
                self._shapes[f"{parent}.{target_name}"] = (target.in_features,
                                                          target.out_features)
        del twin
        # This rank's: HF path -> (its LinearLoRA, target name).
        self._bound: dict[str, tuple[LinearLoRA, str]] = {}
        self._layers: list[nn.Module] = []
        local, _ = _lora_modules(model, model.start_layer)
        for hf, name, layer in local:
            lora = LinearLoRA(layer, self.step, name)
            layer.lora = lora
            self._layers.append(layer)
            parent = hf.rsplit(".", 1)[0]
            for target_name in lora.targets:
                self._bound[f"{parent}.{target_name}"] = (lora, target_name)
        self.dtype = self._layers[0].weight.dtype if self._layers else torch.float32
        self._adapters: dict[int, _Adapter] = {}

    @staticmethod
    def _path_aliases(prefix: str) -> tuple[str, ...]:
        """Where PEFT keys may put the decoder layers: the causal LM's
        model.layers, and for a multimodal wrapper served text-only (its
        checkpoint_prefix) both of transformers' namings of its text model."""
        if not prefix:
            return ("model.layers.",)
        return ("model.layers.", f"{prefix}model.layers.", f"model.{prefix}layers.")

    def detach(self) -> None:
        """No layer adds any adapter any more (the adapters go with this)."""
        for layer in self._layers:
            layer.lora = None
        self._layers, self._bound, self._adapters = [], {}, {}
        self.step.clear()

    # ---- adapters ----------------------------------------------------------

    def adapter_ids(self) -> list[int]:
        return sorted(self._adapters)

    def add_adapter(self, lora_id: int, name: str, path: str) -> LoadedAdapter:
        """Load the PEFT adapter at `path` as lora_id; LoRAAdapterError
        (naming what) when it cannot be served, nothing held then."""
        if not isinstance(lora_id, int) or isinstance(lora_id, bool) or lora_id < 1:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_id must be a positive int, "
                                   f"got {lora_id!r}")
        if lora_id in self._adapters:
            raise LoRAAdapterError(f"LoRA adapter id {lora_id} is already loaded (as "
                                   f"{self._adapters[lora_id].name!r}); unload it first")
        if len(self._adapters) >= self.config.max_cpu_loras:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: this worker already holds {len(self._adapters)} "
                f"adapters, --max-cpu-loras {self.config.max_cpu_loras}; unload one first")
        peft = load_peft_lora(path, max_lora_rank=self.config.max_lora_rank, dtype=self.dtype)
        per_layer: dict[int, tuple[LinearLoRA, dict[str, LoRAModuleWeights]]] = {}
        for module, weights in self._resolve(peft.modules, path).items():
            if module in self._bound:  # else another stage's module
                lora, target = self._bound[module]
                per_layer.setdefault(id(lora), (lora, {}))[1][target] = weights
        adapter = _Adapter(name, LoadedAdapter(peft.digest, 0, 0, peft.rank), [])
        num_bytes = num_modules = 0
        try:
            for lora, modules in per_layer.values():
                num_bytes += lora.set_adapter(lora_id, modules)
                adapter.layers.append(lora)
                num_modules += len(modules)
        except BaseException:
            for lora in adapter.layers:
                lora.remove_adapter(lora_id)
            raise
        adapter.loaded = LoadedAdapter(peft.digest, num_bytes, num_modules, peft.rank)
        self._adapters[lora_id] = adapter
        return adapter.loaded

    def _resolve(self, modules: dict[str, LoRAModuleWeights],
                 path: str) -> dict[str, LoRAModuleWeights]:
        """The adapter's modules by the model's HF paths, each checked
        against the whole module's shape; LoRAAdapterError naming the first
        one that is not a module kvloom serves LoRA on."""
        out, unknown = {}, []
        for module, w in modules.items():
            hf = self._canonical(module)
            if hf is None or hf not in self._shapes:
                self._refuse_module(module, hf, path)
                unknown.append(module)
                continue
            n_in, n_out = self._shapes[hf]
            for which, got, want, what in (("A", w.lora_a.shape[1], n_in, "input"),
                                           ("B", w.lora_b.shape[0], n_out, "output")):
                if got != want:
                    raise LoRAAdapterError(
                        f"{path}: {module}.lora_{which}.weight has {got} {what} features but "
                        f"the model's {hf} has {want} (hidden size mismatch: an adapter "
                        f"trained for another base model?)")
            out[hf] = w
        if unknown:
            shown = ", ".join(unknown[:3]) + (" ..." if len(unknown) > 3 else "")
            matched = "none of the adapter's modules" if not out else \
                f"{len(unknown)} of the adapter's {len(modules)} modules"
            raise LoRAAdapterError(
                f"{path}: {matched} exist in this model ({shown}); LoRA targets are the "
                f"decoder layers' linear projections, e.g. model.layers.0.self_attn.q_proj")
        return out

    def _canonical(self, module: str) -> str | None:
        for alias in self._aliases:
            if module.startswith(alias):
                return "model.layers." + module[len(alias):]
        return None

    def _refuse_module(self, module: str, hf: str | None, path: str) -> None:
        """Refuse now with the specific reason, where there is one."""
        last = module.rsplit(".", 1)[-1]
        if last in _HEAD_MODULES:
            raise LoRAAdapterError(f"{path}: {module}: LoRA on the embedding or the LM head "
                                   f"is not supported; train without it in target_modules")
        if hf is not None and any(hf.startswith(p) for p in self._moe):
            raise LoRAAdapterError(
                f"{path}: {module} is inside a mixture-of-experts block: LoRA on experts "
                f"and routers is not supported (the attention projections may take one)")

    def remove_adapter(self, lora_id: int) -> None:
        """Free every tensor of lora_id (ValueError if not loaded); a step
        running it is over: the layers add nothing until set_active."""
        adapter = self._adapters.pop(lora_id, None)
        if adapter is None:
            raise ValueError(f"no LoRA adapter {lora_id} is loaded")
        for lora in adapter.layers:
            lora.remove_adapter(lora_id)
        if lora_id in self.step.active_ids:
            self.step.clear()
        self.step.adapters_changed()

    # ---- the step --------------------------------------------------------

    def set_active(self, segments: list[tuple[int, int, int]]) -> None:
        """This step's (row_start, row_end, lora_id) runs of rows; rows in
        none run the base model. ValueError for an id not loaded, more than
        max_loras distinct ids, or rows that are not disjoint ranges."""
        ids = set()
        for seg in segments:
            if len(seg) != 3:
                raise ValueError(f"LoRA segment {seg!r}: (row_start, row_end, lora_id)")
            lora_id = seg[2]
            if lora_id not in self._adapters:
                raise ValueError(f"LoRA segment {seg!r}: adapter {lora_id!r} is not loaded")
            ids.add(lora_id)
        if len(ids) > self.config.max_loras:
            raise ValueError(f"a step runs {len(ids)} LoRA adapters, more than --max-loras "
                             f"{self.config.max_loras}")
        # Sorted: a set of adapters gets the same slots whatever the batch
        # order, so the layers' bound weights and kernel tables stay valid.
        active = tuple(sorted(ids))
        slot = {lora_id: i for i, lora_id in enumerate(active)}
        self.step.set([(s, e, slot[i]) for s, e, i in segments], active)

    def clear_active(self) -> None:
        self.step.clear()
