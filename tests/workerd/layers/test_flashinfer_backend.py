"""The FlashInfer backend: its page tables from AttentionMetadata, checked by
hand on a mixed batch; its wiring (which wrapper, planned once per step,
what it is given) through a stand-in flashinfer module on CPU; and, on CUDA
with flashinfer installed, its outputs against the torch backend's token by
token on a tiny model (prefill, chunked prefill over cached context, decodes)."""

from __future__ import annotations

import sys

import pytest
import torch

from kvloom_testing.attention import build_attn_metadata
from kvloom_testing.checkpoints import make_tiny_llama
from tests.workerd.layers import fake_flashinfer
from tests.workerd.layers.test_attention_window import SCALE as WINDOW_SCALE
from tests.workerd.layers.test_attention_window import Requests as WindowRequests
from workerd.distributed.parallel_state import single_process_state
from workerd.layers.attention.backend import TorchAttentionBackend, make_attention_backend
from workerd.layers.attention.flashinfer_index import paged_kv_index
from workerd.layers.attention.interface import FULL_ATTENTION, AttentionLayerKind
from workerd.layers.attention.metadata import AttentionMetadata
from workerd.layers.attention.torch_sdpa import paged_attention
from workerd.models.loader import load_model


def test_page_tables_of_a_mixed_batch():
    # block_size 4. Request: (cached, scheduled, blocks)
    #   0 decode           8 + 1 ->  9 tokens: 3 pages, 1 in the last
    #   1 chunk over cache 3 + 5 ->  8 tokens: 2 pages, full; its 3rd block is
    #                                allocated ahead and must not be attended
    #   2 whole prompt     0 + 3 ->  3 tokens: 1 page, 3 in it
    #   3 decode           3 + 1 ->  4 tokens: 1 page, full
    md, _ = build_attn_metadata(
        [8, 3, 0, 3], [1, 5, 3, 1], [[7, 2, 5], [1, 3, 8], [4], [9]], block_size=4)
    idx = paged_kv_index(md)
    assert idx.qo_indptr.tolist() == [0, 1, 6, 9, 10]
    assert idx.paged_kv_indptr.tolist() == [0, 3, 5, 6, 7]
    assert idx.paged_kv_indices.tolist() == [7, 2, 5, 1, 3, 4, 9]
    assert idx.paged_kv_last_page_len.tolist() == [1, 4, 3, 4]
    for t in (idx.qo_indptr, idx.paged_kv_indptr, idx.paged_kv_indices,
              idx.paged_kv_last_page_len):
        assert t.dtype == torch.int32
    assert idx.qo_indptr.device.type == "cpu"


def test_page_tables_under_a_window_start_at_the_first_needed_page():
    """The mixed batch above with a window of 5: request 0's query at 8
    sees 4..8 (pages 1 and 2 of its table), the chunk at 3..7 sees from 0;
    with a window of 1 request 0 keeps its last page only. The last page's
    length and the query pointers do not change."""
    md, _ = build_attn_metadata(
        [8, 3, 0, 3], [1, 5, 3, 1], [[7, 2, 5], [1, 3, 8], [4], [9]], block_size=4)
    full = paged_kv_index(md)
    for window, indptr, indices in [(5, [0, 2, 4, 5, 6], [2, 5, 1, 3, 4, 9]),
                                    (1, [0, 1, 3, 4, 5], [5, 1, 3, 4, 9]),
                                    (100, [0, 3, 5, 6, 7], [7, 2, 5, 1, 3, 4, 9])]:
        idx = paged_kv_index(md, window)
        assert idx.paged_kv_indptr.tolist() == indptr
        assert idx.paged_kv_indices.tolist() == indices
        assert idx.paged_kv_last_page_len.tolist() == full.paged_kv_last_page_len.tolist()
        assert idx.qo_indptr.tolist() == full.qo_indptr.tolist()


def test_page_tables_ignore_requests_past_num_reqs():
    md, _ = build_attn_metadata([0, 0], [5, 2], [[3, 1], [6]], block_size=4)
    md.num_reqs = 1  # a persistent batch may keep rows past this step's requests
    idx = paged_kv_index(md)
    assert (idx.qo_indptr.tolist(), idx.paged_kv_indices.tolist()) == ([0, 5], [3, 1])
    assert idx.paged_kv_last_page_len.tolist() == [1]


def _metadata(q_lens, seq_lens, table) -> AttentionMetadata:
    return AttentionMetadata(
        num_reqs=len(q_lens), num_actual_tokens=sum(q_lens),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),
        query_start_loc=torch.zeros(len(q_lens) + 1, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens), block_table=torch.tensor(table),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=4,
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens)


def test_a_context_past_the_block_table_is_an_error():
    with pytest.raises(ValueError, match="block table has 2 columns but a context needs 3 "
                                         "blocks of 4"):
        paged_kv_index(_metadata([1], [9], [[1, 2]]))


@pytest.mark.parametrize(("q_len", "seq_len"), [(0, 4), (5, 4)])
def test_a_query_outside_its_context_is_an_error(q_len, seq_len):
    with pytest.raises(ValueError, match=rf"request 0: query length {q_len} not in "
                                         rf"1..seq_len {seq_len}"):
        paged_kv_index(_metadata([q_len], [seq_len], [[1, 2]]))


# ---- the backend around the kernels, on CPU --------------------------------

@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    return make_attention_backend("flashinfer", torch.device("cpu"))


@torch.inference_mode()
def test_wiring_matches_torch_with_a_stand_in_flashinfer(tiny_model_dir, stand_in):
    # float32 (which real FlashInfer refuses): the stand-in's naive attention
    # and SDPA then agree to rounding, so any wiring slip shows.
    cpu = torch.device("cpu")
    model = load_model(tiny_model_dir, single_process_state(), torch.float32)
    ref_tokens, ref_logits = _greedy(model, TorchAttentionBackend(), cpu, num_decodes=4)
    tokens, logits = _greedy(model, stand_in, cpu, num_decodes=4)
    for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    assert tokens == ref_tokens
    # Steps 1-2 hold multi-token queries: prefill; then decode-only steps.
    # One plan per step, one run per layer and step.
    wrappers = stand_in._wrappers[FULL_ATTENTION]
    prefill, decode = wrappers.prefill, wrappers.decode[False]
    layers = model.num_local_layers
    assert (len(prefill.plans), prefill.runs) == (2, 2 * layers)
    assert (len(decode.plans), decode.runs) == (4, 4 * layers)
    assert all(p["causal"] for p in prefill.plans)


@torch.inference_mode()
def test_padding_gets_zeros_and_the_profile_run_is_the_torch_path(stand_in):
    g = torch.Generator().manual_seed(0)
    md, _ = build_attn_metadata([0, 4], [3, 1], [[1], [2, 3]], block_size=4)
    # 4 real tokens and 2 of padding (num_tokens > num_actual_tokens).
    q = torch.randn(6, 4, 16, generator=g)
    k, v = (torch.randn(6, 2, 16, generator=g) for _ in range(2))
    cache, ref_cache = torch.zeros(2, 2, 4, 4, 2, 16)
    out = stand_in.forward(q, k, v, cache, md, 0.25, stand_in.build_plan(md, 6))
    ref = paged_attention(q, k, v, ref_cache, md, 0.25)
    assert torch.equal(cache, ref_cache)  # the same slots written
    torch.testing.assert_close(out[:4], ref[:4], atol=1e-5, rtol=1e-5)
    assert not out[4:].any()
    # Before the cache exists every request is a whole prompt, attended by
    # the torch path itself.
    md, _ = build_attn_metadata([0, 0], [3, 2], [[1], [2]], block_size=4)
    q, k, v = q[:5], k[:5], v[:5]
    plan = stand_in.build_plan(md, 5)
    assert torch.equal(stand_in.forward(q, k, v, None, md, 0.25, plan),
                       paged_attention(q, k, v, None, md, 0.25))
    full = stand_in._wrappers[FULL_ATTENTION]
    assert len(full.prefill.plans) == 1 and not plan.wrappers  # nothing planned


_WINDOW = AttentionLayerKind(sliding_window=5)
_CAPPED = AttentionLayerKind(sliding_window=5, logits_soft_cap=2.0)


def _window_step(steps, seed):
    reqs = WindowRequests([c + n for c, n in steps], seed=seed, spread=2.0)
    for r, (c, _) in enumerate(steps):
        reqs.prefill_cache(r, c)
    rows, scheduled = list(range(len(steps))), [n for _, n in steps]
    return (reqs, rows, scheduled, *reqs.step(rows, scheduled))


@pytest.mark.parametrize("steps", [[(20, 1), (6, 7), (0, 11), (3, 1)],  # prefill wrapper
                                   [(20, 1), (9, 1), (3, 1)]])  # decode wrapper
@torch.inference_mode()
def test_kinds_plan_their_own_wrappers_with_their_window_and_cap(stand_in, steps):
    """Two kinds and full attention planned for one step, their layers
    interleaved (as Gemma 2's alternate): each kind's wrapper is its own,
    planned once with its window_left and logits_soft_cap, and every layer
    attends as the torch backend does for its kind (so no layer ran with
    another kind's plan)."""
    reqs, rows, scheduled, md, q, k, v = _window_step(steps, seed=4)
    kinds = [_WINDOW, _CAPPED, FULL_ATTENTION]
    plans = {kind: stand_in.build_plan(md, len(q), kind) for kind in kinds}
    torch_backend = TorchAttentionBackend()
    for kind in kinds * 2:  # two "layers" of each kind, interleaved
        cache, ref_cache = reqs.cache.clone(), reqs.cache.clone()
        out = stand_in.forward(q, k, v, cache, md, WINDOW_SCALE, plans[kind])
        ref = torch_backend.forward(q, k, v, ref_cache, md, WINDOW_SCALE,
                                    torch_backend.build_plan(md, len(q), kind))
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5, msg=str(kind))
        assert torch.equal(cache, ref_cache)
    decode = len(steps) == 3
    wrappers = [stand_in._wrappers[kind] for kind in kinds]
    used = [w.decode[False] if decode else w.prefill for w in wrappers]
    assert len({id(w) for w in used}) == 3
    for wrapper, (window_left, cap) in zip(used, [(4, 0.0), (4, 2.0), (-1, 0.0)], strict=True):
        (planned,) = wrapper.plans
        assert (planned["window_left"], planned["logits_soft_cap"]) == (window_left, cap)
        assert wrapper.runs == 2


@torch.inference_mode()
def test_pages_before_the_window_never_reach_the_kernels(stand_in):
    """The stand-in reads every page it is handed: with the pages wholly
    before each request's window NaN, the outputs are finite and equal."""
    steps = [(22, 1), (14, 6), (3, 1)]
    reqs, rows, scheduled, md, q, k, v = _window_step(steps, seed=6)
    clean = stand_in.forward(q, k, v, reqs.cache.clone(), md, WINDOW_SCALE,
                             stand_in.build_plan(md, len(q), _CAPPED))
    poisoned = reqs.cache.clone()
    for (c, _), table in zip(steps, reqs.tables, strict=True):
        for block in table[: max(c - 5 + 1, 0) // 4]:
            poisoned[:, block] = float("nan")
    assert poisoned.isnan().any()
    out = stand_in.forward(q, k, v, poisoned, md, WINDOW_SCALE,
                           stand_in.build_plan(md, len(q), _CAPPED))
    assert torch.isfinite(out).all() and torch.equal(out, clean)
    torch.testing.assert_close(out.double(), reqs.expected(rows, scheduled, _CAPPED),
                               atol=2e-5, rtol=2e-5)


def test_the_runner_builds_it_and_profiles_through_it(tiny_model_dir, stand_in):
    """ModelRunner(attention_backend="flashinfer") hands the model the backend;
    the memory profile's forward (a cache of its own) runs its prefill."""
    from controlplane.config import SchedulerConfig
    from kvloom_testing.inprocess import runner_limits
    from workerd.layers.attention.flashinfer import FlashInferBackend
    from workerd.runner.model_runner import ModelRunner

    limits = runner_limits(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4,
                                           max_model_len=64))
    runner = ModelRunner(single_process_state(), tiny_model_dir, torch.float32, 0,
                         limits=limits, attention_backend="flashinfer")
    runner.load_model()
    backend = runner.model.attn_backend
    assert isinstance(backend, FlashInferBackend)
    assert all(layer.self_attn.attn_backend is backend for layer in runner.model.layers)
    runner._profile_run(block_size=4)
    prefill = backend._wrappers[FULL_ATTENTION].prefill
    (planned,) = prefill.plans
    assert planned["qo_indptr"].tolist() == [0, 24]
    assert planned["last_page_len"].tolist() == [4]
    assert prefill.runs == runner.model.num_local_layers


# ---- on a GPU ------------------------------------------------------------

# (prompt, steps): each step schedules that many tokens of the request, the
# first of them the prompt's (chunked), then greedy decodes.
_PROMPTS = [[1, 450, 496, 310, 20, 21, 22, 23, 24], [1, 306, 163], [1, 5, 6, 7, 8, 9, 10, 11]]
# Scattered block ids, block 0 among them (it is no padding marker).
_TABLES = [[11, 3, 7, 0, 13], [5, 1, 15, 12], [9, 2, 14, 4, 6]]
_BLOCK_SIZE, _NUM_BLOCKS = 4, 16


def _greedy(model, backend, device, num_decodes):
    """Logits of every step and the greedy tokens; step 1 prefills request 0
    whole and request 2's first 3 tokens, step 2 mixes decodes with request
    2's remaining 5 (a chunk over cached context), then decode-only steps."""
    model.set_attention_backend(backend)
    dtype = next(model.parameters()).dtype
    caches = [torch.zeros(model.kv_cache_shape(_NUM_BLOCKS, _BLOCK_SIZE), device=device,
                          dtype=dtype) for _ in range(model.num_local_layers)]
    tokens = [list(p) for p in _PROMPTS]
    computed = [0, 0, 0]
    schedule = [[9, 3, 3], [1, 1, 5]] + [[1, 1, 1]] * num_decodes
    all_logits = []
    for step in schedule:
        rows = [i for i, n in enumerate(step) if n]
        md, positions = build_attn_metadata(
            [computed[i] for i in rows], [step[i] for i in rows], [_TABLES[i] for i in rows],
            _BLOCK_SIZE, device=device)
        ids = [t for i in rows for t in tokens[i][computed[i]:computed[i] + step[i]]]
        hidden = model(torch.tensor(ids, device=device), positions, caches, md)
        last = md.query_start_loc[1:] - 1
        logits = model.compute_logits(hidden[last]).float()
        all_logits.append(logits)
        for row, i in enumerate(rows):
            computed[i] += step[i]
            if computed[i] == len(tokens[i]):  # the prompt is done: sample
                tokens[i].append(int(logits[row].argmax()))
    return tokens, all_logits


@pytest.mark.gpu
@torch.inference_mode()
def test_flashinfer_matches_torch_token_by_token(tmp_path):
    pytest.importorskip("flashinfer")
    device = torch.device("cuda", 0)
    # head_dim 64: FlashInfer's prebuilt kernels cover 64/128/256, not the
    # default tiny model's 16. GQA: 4 query heads over 2 KV heads.
    path = make_tiny_llama(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2,
                           intermediate_size=512, num_layers=2)
    model = load_model(path, single_process_state(device), torch.bfloat16)
    ref_tokens, ref_logits = _greedy(model, TorchAttentionBackend(), device, num_decodes=8)
    fi_tokens, fi_logits = _greedy(model, make_attention_backend("flashinfer", device), device,
                                   num_decodes=8)
    for step, (a, b) in enumerate(zip(fi_logits, ref_logits, strict=True)):
        # bf16 kernels round differently; the sampled tokens must agree.
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2, msg=f"step {step}")
    assert fi_tokens == ref_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [AttentionLayerKind(sliding_window=5),
                                  AttentionLayerKind(logits_soft_cap=2.0),
                                  AttentionLayerKind(sliding_window=7, logits_soft_cap=2.0)],
                         ids=str)
@torch.inference_mode()
def test_flashinfer_windows_and_caps_match_torch(kind):
    """FlashInfer's own kernels with window_left and logits_soft_cap, against
    the torch backend for the same kind: a prefill step (chunks crossing the
    window, prompts longer than it) and a decode step, bf16, GQA 4 over 2,
    head_dim 64; the pages before each window are NaN, so a kernel reading
    them shows."""
    pytest.importorskip("flashinfer")
    device = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, bs, num_blocks = 4, 2, 64, 4, 40
    fi = make_attention_backend("flashinfer", device)
    ref_backend = TorchAttentionBackend()
    for computed, scheduled in [([6, 0, 17], [7, 13, 5]), ([22, 9, 30], [1, 1, 1])]:
        tables, used = [], 0
        for c, n in zip(computed, scheduled, strict=True):
            nb = -(-(c + n) // bs)
            tables.append(list(range(used, used + nb)))
            used += nb
        md, _ = build_attn_metadata(computed, scheduled, tables, bs, device=device)
        t = sum(scheduled)
        q = (torch.randn(t, heads, head_dim, generator=gen) * 2).to(device, torch.bfloat16)
        k = (torch.randn(t, kv_heads, head_dim, generator=gen) * 2).to(device, torch.bfloat16)
        v = torch.randn(t, kv_heads, head_dim, generator=gen).to(device, torch.bfloat16)
        cache = torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=gen) * 2
        cache = cache.to(device, torch.bfloat16)
        if kind.sliding_window is not None:
            for c, table in zip(computed, tables, strict=True):
                for block in table[: max(c - kind.sliding_window + 1, 0) // bs]:
                    cache[:, block] = float("nan")
        ref_cache = cache.clone()
        scale = head_dim**-0.5
        out = fi.forward(q, k, v, cache, md, scale, fi.build_plan(md, t, kind))
        ref = ref_backend.forward(q, k, v, ref_cache, md, scale,
                                  ref_backend.build_plan(md, t, kind))
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
