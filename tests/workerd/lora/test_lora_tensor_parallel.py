"""LoRA under real TP / PP ranks (torch.multiprocessing spawn, gloo on
loopback): each rank loads the same adapters and keeps its slices, and a
mixed batch of two adapters and base rows gives the single process's
logits, with K/V heads replicated over the TP ranks (one KV head, TP=2)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from kvloom.common.ports import free_port
from kvloom_testing.attention import pipeline_step
from kvloom_testing.checkpoints import make_tiny_llama
from kvloom_testing.lora import make_peft_adapter
from workerd.distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
    single_process_state,
)
from workerd.lora.config import LoRAConfig
from workerd.lora.manager import LoRAManager
from workerd.models.loader import load_model

BLOCK_SIZE = 4
TABLES = [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10], [11, 12]]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _run(model, ps: ParallelState, adapter_dirs: list[str]) -> list[torch.Tensor]:
    """Prefill of four requests (adapter 1, base, adapter 2, adapter 1), then
    a decode step of each; the last stage's logits per step."""
    mgr = LoRAManager(model, LoRAConfig(2, 16, 2))
    for lora_id, path in enumerate(adapter_dirs, start=1):
        mgr.add_adapter(lora_id, f"a{lora_id}", path)
    g = torch.Generator().manual_seed(3)
    lens, ids = [9, 6, 11, 4], [1, 0, 2, 1]
    prompts = [torch.randint(2, model.vocab_size, (n + 1,), generator=g).tolist() for n in lens]
    caches = [torch.zeros(model.kv_cache_shape(13, BLOCK_SIZE)) for _ in model.layers]
    outputs = []
    for step in ([(p, 0, n) for p, n in zip(prompts, lens, strict=True)],
                 [(p, n, 1) for p, n in zip(prompts, lens, strict=True)]):
        segments, row = [], 0
        for (_, _, n), lora_id in zip(step, ids, strict=True):
            if lora_id:
                segments.append((row, row + n, lora_id))
            row += n
        mgr.set_active(segments)
        outputs.append(pipeline_step(model, ps, caches, step, TABLES, BLOCK_SIZE))
    return outputs if ps.is_last_pp_rank else []


def _worker(rank, world_size, tp, pp, port, model_dir, adapter_dirs, out_dir):
    torch.set_num_threads(1)
    ps = init_parallel_state(rank, world_size, tp, pp, "127.0.0.1", port, 60.0,
                             torch.device("cpu"))
    try:
        outputs = _run(load_model(model_dir, ps, torch.float32), ps, adapter_dirs)
        if ps.is_last_pp_rank:
            torch.save(outputs, os.path.join(out_dir, f"logits_tp{ps.tp_rank}.pt"))
    finally:
        destroy_parallel_state(ps)


@pytest.fixture(scope="module")
def mqa_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp")
    base = make_tiny_llama(root / "base", num_layers=2, num_kv_heads=1, seed=3)
    adapters = [str(make_peft_adapter(base, root / f"a{i}", seed=i, r=4 * i,
                                      target_modules=ALL_LINEAR)) for i in (1, 2)]
    return str(base), adapters


# Slow as the repo's other spawned-rank tests are (~8-10 s each here).
@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2-replicated-kv", "pp2"])
def test_parallel_layouts_match_single_process(tp, pp, mqa_setup, tmp_path):
    base, adapters = mqa_setup
    ps = single_process_state()
    reference = _run(load_model(base, ps, torch.float32), ps, adapters)
    mp.spawn(_worker, args=(tp * pp, tp, pp, free_port(), base, adapters, str(tmp_path)),
             nprocs=tp * pp, join=True)
    for tp_rank in range(tp):
        got = torch.load(tmp_path / f"logits_tp{tp_rank}.pt")
        for g, r in zip(got, reference, strict=True):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=0)
