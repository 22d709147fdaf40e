"""Every family's TP=2 and PP=2 shards (separate processes, gloo on loopback)
against its own single process over tests/workerd/models/test_families.py's
schedule, which that file checks against transformers. PP=2 splits 1 + 3
layers, so a stage's local layer index differs from the global one that
picks its window, rotary table and MLP kind. The ranks pack their shards'
weights for oneDNN as CPU float32 workers do (the mixtures of experts' expert
slices too), against the unpacked single process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from kvloom.common.ports import free_port
from kvloom_testing.attention import pipeline_step
from kvloom_testing.families import TINY_FAMILIES, make_tiny_checkpoint
from tests.workerd.models.test_families import BLOCK_SIZE, NUM_BLOCKS, TABLES, schedule
from workerd.distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
    single_process_state,
)
from workerd.layers.moe import FusedMoE
from workerd.layers.packed_linear import pack_linear_weights, packing_unavailable
from workerd.models.loader import load_model

PARTITION = (1, 3)


def _run(model, ps: ParallelState) -> list[torch.Tensor]:
    steps, prompts = schedule(model.vocab_size)
    table_of = {id(p): TABLES[i] for i, p in enumerate(prompts)}
    caches = [torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)) for _ in model.layers]
    outputs = [pipeline_step(model, ps, caches, step,
                             [table_of[id(tokens)] for tokens, _, _ in step], BLOCK_SIZE)
               for step in steps]
    return outputs if ps.is_last_pp_rank else []


def _worker(rank, world_size, tp, pp, port, model_dir, out_dir):
    torch.set_num_threads(1)
    ps = init_parallel_state(rank, world_size, tp, pp, "127.0.0.1", port, 60.0,
                             torch.device("cpu"))
    try:
        model = load_model(model_dir, ps, torch.float32, PARTITION if pp > 1 else ())
        if packing_unavailable(torch.device(ps.device), torch.float32) is None:
            # Tiny weights: no size floor; 16 rows route 8 to each of 4 experts.
            assert pack_linear_weights(model, 16, min_elements=0) > 0
            assert all(m.packed_w13 is not None and m.packed_w2 is not None
                       for m in model.modules() if isinstance(m, FusedMoE))
        outputs = _run(model, ps)
        if ps.is_last_pp_rank:
            torch.save(outputs, os.path.join(out_dir, f"logits_tp{ps.tp_rank}.pt"))
    finally:
        destroy_parallel_state(ps)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_layout_matches_single_process(family, layout, tmp_path):
    model_dir = str(make_tiny_checkpoint(tmp_path / "ckpt", family, seed=7))
    tp, pp = (2, 1) if layout == "tp2" else (1, 2)
    ps = single_process_state()
    reference = _run(load_model(model_dir, ps, torch.float32), ps)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    mp.spawn(_worker, args=(tp * pp, tp, pp, free_port(), model_dir, str(out_dir)),
             nprocs=tp * pp, join=True)
    for tp_rank in range(tp):  # every TP rank of the last stage holds the full logits
        got = torch.load(out_dir / f"logits_tp{tp_rank}.pt")
        assert len(got) == len(reference)
        for g, r in zip(got, reference, strict=True):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=0, msg=lambda m: f"{family}: {m}")
