"""TP / PP shards in real separate processes (torch.multiprocessing spawn, gloo
on loopback): every layout's logits must equal the single-process model's over
a chunked-prefill + mixed prefill/decode + decode schedule."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from kvloom.common.ports import free_port
from kvloom_testing.attention import pipeline_step
from kvloom_testing.checkpoints import make_tiny_llama
from workerd.distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
    single_process_state,
)
from workerd.layers.packed_linear import pack_linear_weights, packing_unavailable
from workerd.models.decoder import tp_head_layout
from workerd.models.loader import load_model

BLOCK_SIZE = 4
TABLES = [[7, 2, 9, 0, 5], [3, 8, 1, 6]]


def _run_schedule(model, ps: ParallelState) -> list[torch.Tensor]:
    """Three steps over two requests; returns per-step logits on the last PP stage."""
    g = torch.Generator().manual_seed(5)
    a = torch.randint(2, model.vocab_size, (14,), generator=g).tolist()
    b = torch.randint(2, model.vocab_size, (10,), generator=g).tolist()
    schedule = [[(a, 0, 6), (b, 0, 9)], [(a, 6, 7), (b, 9, 1)], [(a, 13, 1)]]
    caches = [torch.zeros(model.kv_cache_shape(10, BLOCK_SIZE)) for _ in model.layers]
    outputs = [pipeline_step(model, ps, caches, step, TABLES[: len(step)], BLOCK_SIZE)
               for step in schedule]
    return outputs if ps.is_last_pp_rank else []


def _worker(rank, world_size, tp, pp, port, model_dir, out_dir):
    torch.set_num_threads(1)
    ps = init_parallel_state(rank, world_size, tp, pp, "127.0.0.1", port, 60.0, torch.device("cpu"))
    try:
        model = load_model(model_dir, ps, torch.float32)
        # Ranks run as big models' workers do: their shards' weights packed
        # for oneDNN (tiny ones too here), checked against the unpacked
        # single process.
        if packing_unavailable(torch.device(ps.device), torch.float32) is None:
            pack_linear_weights(model, 4, min_elements=0)
        outputs = _run_schedule(model, ps)
        if ps.is_last_pp_rank:
            torch.save(outputs, os.path.join(out_dir, f"logits_tp{ps.tp_rank}.pt"))
    finally:
        destroy_parallel_state(ps)
        destroy_parallel_state(ps)  # idempotent


@pytest.fixture(scope="module")
def mqa_model_dir(tmp_path_factory) -> str:
    """One KV head: at TP=2 both ranks hold (replicate) it."""
    return str(
        make_tiny_llama(
            tmp_path_factory.mktemp("tiny_mqa"),
            num_layers=2,
            num_kv_heads=1,
            tie_word_embeddings=True,
            seed=3,
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,model",
    [(2, 1, "gqa"), (1, 2, "gqa"), (2, 2, "gqa"), (2, 1, "mqa")],
    ids=["tp2", "pp2", "tp2xpp2", "tp2-replicated-kv"],
)
def test_parallel_layout_matches_single_process(
    tp, pp, model, tiny_model_dir, mqa_model_dir, tmp_path
):
    model_dir = tiny_model_dir if model == "gqa" else mqa_model_dir
    ps = single_process_state()
    reference = _run_schedule(load_model(model_dir, ps, torch.float32), ps)
    mp.spawn(
        _worker,
        args=(tp * pp, tp, pp, free_port(), model_dir, str(tmp_path)),
        nprocs=tp * pp,
        join=True,
    )
    for tp_rank in range(tp):  # every TP rank of the last stage holds the full logits
        got = torch.load(tmp_path / f"logits_tp{tp_rank}.pt")
        assert len(got) == len(reference)
        for g, r in zip(got, reference, strict=True):
            assert g.shape == r.shape
            torch.testing.assert_close(g, r, atol=1e-4, rtol=0)


def test_head_layouts():
    assert tp_head_layout(9, 3, 3, 2) == (3, 1, 2)  # SmolLM2-135M at TP=3
    assert tp_head_layout(4, 2, 4, 3) == (1, 1, 1)  # KV head 1 replicated on ranks 2, 3
    with pytest.raises(ValueError, match="num_attention_heads=9 .* tensor_parallel_size=2"):
        tp_head_layout(9, 3, 2, 0)
    with pytest.raises(ValueError, match="num_key_value_heads=3 .* tensor_parallel_size=2"):
        tp_head_layout(6, 3, 2, 0)


def test_indivisible_layout_refused_by_load_model(tmp_path):
    path = make_tiny_llama(tmp_path, num_layers=1, hidden_size=48, num_heads=6, num_kv_heads=3)
    ps = ParallelState(
        rank=0, world_size=4, tp_size=4, pp_size=1, tp_rank=0, pp_rank=0, device=torch.device("cpu")
    )
    with pytest.raises(
        ValueError, match="num_attention_heads=6 is not divisible by tensor_parallel_size=4"
    ):
        load_model(str(path), ps, torch.float32)


def test_rendezvous_timeout_names_missing_ranks():
    with pytest.raises(RuntimeError, match=r"ranks \[1, 2\] of world_size 3 did not arrive"):
        init_parallel_state(0, 3, 3, 1, "127.0.0.1", free_port(), 1.0, torch.device("cpu"))


def test_world_size_one_needs_no_process_group():
    import torch.distributed as dist

    ps = init_parallel_state(0, 1, 1, 1, "127.0.0.1", 1, 1.0, torch.device("cpu"))
    assert ps.is_output_rank and ps.is_first_pp_rank and not dist.is_initialized()
    destroy_parallel_state(ps)
