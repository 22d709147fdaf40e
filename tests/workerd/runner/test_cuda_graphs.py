"""Decode CUDA graphs (workerd/runner/cuda_graphs.py).

On CPU with two stand-ins: a "graph" that runs the captured forward again on
replay, writing into the output tensor captured the first time (what a CUDA
graph does for a region that reads only its static buffers), and FlashInfer
(tests/workerd/layers/fake_flashinfer.py) whose decode wrapper in CUDA-graph mode
reads its page tables from the buffers it was built with, refuses a plan()
inside a captured region and a batch size other than its own. What this
proves is the runner's side: static buffers, padding, re-planning before each
replay, the extra block. That real graphs replay the same is the gpu-marked
test's job.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

from controlplane.config import CacheConfig
from controlplane.core.scheduler import Scheduler
from controlplane.executor.wire import model_runner_output_from_proto, scheduler_output_to_proto
from kvloom_testing.inprocess import runner_limits
from kvloom_testing.scheduler import scheduler_config
from tests.controlplane.core.helpers import make_request
from tests.integration.reference import hf_greedy
from tests.workerd.layers import fake_flashinfer
from workerd.distributed.parallel_state import single_process_state
from workerd.layers.attention.backend import TorchAttentionBackend
from workerd.layers.attention.cpu import CpuAttentionBackend
from workerd.layers.attention.flashinfer import FlashInferBackend
from workerd.layers.attention.flashinfer_index import PagedKVIndex, pad_decode_index
from workerd.runner import model_runner as model_runner_module
from workerd.runner.cuda_graphs import capture_sizes, graphs_unavailable
from workerd.runner.model_runner import ModelRunner
from workerd.wire import model_runner_output_to_proto, scheduler_output_from_proto

BLOCK_SIZE, NUM_BLOCKS, MAX_NUM_SEQS = 4, 48, 6


def test_capture_sizes_cover_every_batch_up_to_256():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-1] == 256
    # Bigger decode batches than the largest graph run eagerly.
    assert capture_sizes(1024)[-1] == 256


# The backends' classes: graphs_unavailable reads only what they declare.
_BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend,
             "flashinfer": FlashInferBackend}


@pytest.mark.parametrize(("device", "backend", "world", "eager", "reason"), [
    ("cuda", "flashinfer", 1, True, "--enforce-eager"),
    ("cpu", "flashinfer", 1, False, "no CUDA device"),
    ("cuda", "torch", 1, False, "torch attention backend"),
    ("cuda", "cpu", 1, False, "cpu attention backend"),
    ("cuda", "flashinfer", 2, False, "more than one rank"),
    ("cuda", "flashinfer", 1, False, None),
])
def test_when_graphs_apply(device, backend, world, eager, reason):
    got = graphs_unavailable(torch.device(device), _BACKENDS[backend], world, eager)
    assert got == reason if reason is None else reason in got


def test_graphs_follow_the_declaration_not_the_name():
    """A backend that declares cuda_graph_decode gets graphs whatever it is
    called; one that does not is refused by name and capability."""
    from workerd.layers.attention.interface import AttentionCapabilities

    class Graphable(TorchAttentionBackend):
        name = "torch-graphs"
        capabilities = AttentionCapabilities(cuda_graph_decode=True)

    class Renamed(FlashInferBackend):
        name = "flashinfer-eager"
        capabilities = AttentionCapabilities()

    cuda = torch.device("cuda")
    assert graphs_unavailable(cuda, Graphable, 1, False) is None
    assert graphs_unavailable(cuda, Renamed, 1, False) == (
        "the flashinfer-eager attention backend is not graph-safe (it does not declare "
        "cuda_graph_decode)")


def test_padding_rows_are_one_token_contexts_in_the_pad_block():
    idx = PagedKVIndex(
        qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32),
        paged_kv_indptr=torch.tensor([0, 2, 3], dtype=torch.int32),
        paged_kv_last_page_len=torch.tensor([3, 1], dtype=torch.int32),
        paged_kv_indices=torch.tensor([7, 2, 5], dtype=torch.int32),
    )
    padded = pad_decode_index(idx, 4, pad_block=9)
    assert padded.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert padded.paged_kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert padded.paged_kv_indices.tolist() == [7, 2, 5, 9, 9]
    assert padded.paged_kv_last_page_len.tolist() == [3, 1, 1, 1]
    assert pad_decode_index(idx, 2, pad_block=9) is idx
    with pytest.raises(ValueError, match="3 requests do not fit a graph of batch size 2"):
        pad_decode_index(pad_decode_index(idx, 3, 9), 2, 9)


class ReplayingGraph:
    """The stand-in graph: capture runs fn once; replay runs it again into the
    captured output. Counts replays by batch size."""

    def __init__(self):
        self.replays: Counter = Counter()

    def capture(self, fn):
        out = self._run(fn)

        def replay():
            self.replays[out.shape[0]] += 1
            out.copy_(self._run(fn))

        return replay, out

    @staticmethod
    def _run(fn):
        fake_flashinfer.CAPTURING = True
        try:
            return fn()
        finally:
            fake_flashinfer.CAPTURING = False


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """The stand-in flashinfer, and graphs where a CUDA device would have them."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    real = graphs_unavailable

    def unavailable(device, backend, world_size, enforce_eager):
        return real(torch.device("cuda"), backend, world_size, enforce_eager)

    monkeypatch.setattr(model_runner_module, "graphs_unavailable", unavailable)


def _runner(model_dir, backend, enforce_eager=False, device="cpu",
            dtype=torch.float32) -> ModelRunner:
    limits = runner_limits(scheduler_config(max_num_seqs=MAX_NUM_SEQS))
    runner = ModelRunner(single_process_state(device), model_dir, dtype, 0, limits=limits,
                         attention_backend=backend, enforce_eager=enforce_eager)
    if device == "cpu":
        runner.graph_capture = ReplayingGraph()
    runner.load_model()
    runner.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    return runner


# Prompt lengths and max_tokens: the decode batch shrinks 5 -> 1 as they
# finish, so steps run graphs of 6 (padded), 4, 2 and 1.
_REQUESTS = [(9, 12), (3, 9), (14, 7), (6, 5), (2, 3)]


@torch.inference_mode()
def _serve(runner: ModelRunner) -> dict[str, list[int]]:
    """The requests through a real scheduler and this runner, as the worker
    gets them (protobuf both ways); every request's output tokens."""
    scheduler = Scheduler(scheduler_config(max_num_seqs=MAX_NUM_SEQS),
                          _cache_config(), NUM_BLOCKS)
    requests = [make_request(list(range(5, 5 + n)), max_tokens=m, req_id=f"q{i}",
                             ignore_eos=True, temperature=0.0)
                for i, (n, m) in enumerate(_REQUESTS)]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        out = runner.execute_model(scheduler_output_from_proto(scheduler_output_to_proto(so)))
        scheduler.update_from_output(
            so, model_runner_output_from_proto(model_runner_output_to_proto(out)))
    return {r.request_id: list(r.output_token_ids) for r in requests}


def _cache_config():
    return CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)


def test_decode_graphs_give_the_eager_tokens_and_transformers(tiny_model_dir, graphs_on_cpu):
    runner = _runner(tiny_model_dir, "flashinfer")
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 6]
    # One block past the controlplane's pool holds the padding's K/V.
    assert runner.kv_caches[0].shape[1] == NUM_BLOCKS + 1
    before = [c[:, :NUM_BLOCKS].clone() for c in runner.kv_caches]
    got = _serve(runner)

    eager = _runner(tiny_model_dir, "torch")
    assert eager.graphs is None and eager.kv_caches[0].shape[1] == NUM_BLOCKS
    assert got == _serve(eager)
    for i, (n, m) in enumerate(_REQUESTS):
        assert got[f"q{i}"] == hf_greedy(tiny_model_dir, list(range(5, 5 + n)), m)
    replays = runner.graph_capture.replays
    # Decode steps of 5, 4 and 3 requests ran padded graphs of 6 and 4.
    assert replays[6] > 0 and replays[4] > 0 and replays[2] > 0 and replays[1] > 0
    # The real blocks hold what the eager runner wrote (the padding wrote
    # only the extra block).
    for graph_cache, eager_cache, old in zip(runner.kv_caches, eager.kv_caches, before,
                                             strict=True):
        assert not torch.equal(graph_cache[:, :NUM_BLOCKS], old)
        torch.testing.assert_close(graph_cache[:, :NUM_BLOCKS], eager_cache,
                                   atol=1e-5, rtol=1e-5)


def test_steps_past_the_rotary_cache_run_eagerly(tiny_model_dir, graphs_on_cpu, monkeypatch):
    """The graphs index the rotary cache with their positions buffer: a decode
    step whose context reaches past the cache runs eagerly (computing its
    tables) instead of reading past the cache's end."""
    runner = _runner(tiny_model_dir, "flashinfer")
    monkeypatch.setattr(runner.model.rotary_emb, "cached_positions", 16)
    seen = []
    real = runner.graphs.can_run

    def can_run(md):
        ok = real(md)
        seen.append((md.max_query_len, md.max_seq_len, ok))
        return ok

    monkeypatch.setattr(runner.graphs, "can_run", can_run)
    got = _serve(runner)
    for i, (n, m) in enumerate(_REQUESTS):
        assert got[f"q{i}"] == hf_greedy(tiny_model_dir, list(range(5, 5 + n)), m)
    decodes = [(seq, ok) for q, seq, ok in seen if q == 1]
    assert any(ok for _, ok in decodes) and any(seq > 16 for seq, _ in decodes)
    assert not any(ok for seq, ok in decodes if seq > 16)


def test_enforce_eager_and_a_new_cache(tiny_model_dir, graphs_on_cpu):
    eager = _runner(tiny_model_dir, "flashinfer", enforce_eager=True)
    assert eager.graphs is None and eager.kv_caches[0].shape[1] == NUM_BLOCKS
    tokens = _serve(eager)
    assert not eager.graph_capture.replays
    runner = _runner(tiny_model_dir, "flashinfer")
    first = runner.graphs
    runner.reset_state()  # a failed group: the graphs read the old cache
    assert runner.graphs is None
    runner.init_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    assert runner.graphs is not None and runner.graphs is not first
    assert _serve(runner) == tokens


@pytest.mark.gpu
def test_real_graphs_replay_what_eager_computes(tmp_path):
    """On a CUDA device with flashinfer-python: torch.cuda graphs around
    FlashInfer's CUDA-graph decode wrapper give the eager run's tokens."""
    pytest.importorskip("flashinfer")
    from kvloom_testing.checkpoints import make_tiny_llama

    # head_dim 64: FlashInfer's prebuilt kernels cover 64/128/256.
    path = make_tiny_llama(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2,
                           intermediate_size=512, num_layers=2)
    graphs = _runner(path, "flashinfer", device="cuda", dtype=torch.bfloat16)
    assert graphs.graphs is not None
    eager = _runner(path, "flashinfer", enforce_eager=True, device="cuda", dtype=torch.bfloat16)
    assert eager.graphs is None
    assert _serve(graphs) == _serve(eager)


def test_the_kv_budget_leaves_room_for_the_graphs(tiny_model_dir, graphs_on_cpu, monkeypatch):
    """On a CUDA rank the profiled KV budget loses graphs_memory_bytes when
    init_kv_cache will capture graphs, and nothing under --enforce-eager."""
    from workerd.runner.cuda_graphs import graphs_memory_bytes

    budget = 1 << 30
    monkeypatch.setattr(model_runner_module, "cuda_kv_cache_budget", lambda *a: budget)
    blocks = {}
    for eager in (False, True):
        runner = _runner(tiny_model_dir, "flashinfer", enforce_eager=eager)
        runner.device = torch.device("cuda")  # only its type is read here
        blocks[eager], per_block = runner.profile_num_blocks(BLOCK_SIZE, 0, 0.9)
    assert blocks[True] == budget // per_block
    reserve = graphs_memory_bytes(MAX_NUM_SEQS)
    assert reserve == 4 * (16 << 20)  # sizes 1, 2, 4, 6
    assert blocks[False] == (budget - reserve) // per_block
