"""The declared attention-backend interface (workerd/layers/attention/interface.py):
each backend declares exactly what it does (the optional methods it has,
rotary inside its kernel giving what rotating first gives, graph decode
plans that re-plan, windows and soft-caps attending as the dense reference
does), a model that needs what its backend lacks is refused at load naming
both, and nothing in workerd asks a backend or a layer what it has instead
of reading the declaration."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import torch

from kvloom_testing.attention import build_attn_metadata
from kvloom_testing.inprocess import runner_limits
from tests.workerd.layers import fake_flashinfer
from tests.workerd.layers.test_attention_window import SCALE as WINDOW_SCALE
from tests.workerd.layers.test_attention_window import Requests as WindowRequests
from workerd.distributed.parallel_state import single_process_state
from workerd.layers.attention.backend import (
    ATTENTION_BACKENDS,
    TorchAttentionBackend,
    make_attention_backend,
)
from workerd.layers.attention.cpu import CpuAttentionBackend
from workerd.layers.attention.flashinfer import FlashInferBackend
from workerd.layers.attention.interface import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionCapabilities,
    AttentionLayerKind,
)
from workerd.layers.attention.torch_sdpa import paged_attention
from workerd.layers.rotary import RotaryEmbedding, apply_rotary_tables
from workerd.models.loader import load_model
from workerd.runner import model_runner as model_runner_module
from workerd.runner.cuda_graphs import GraphBuffers
from workerd.runner.model_runner import ModelRunner

WORKERD = Path(__file__).resolve().parents[3] / "workerd"
CLASSES = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend,
           "flashinfer": FlashInferBackend}
# What each really does beyond build_plan and forward. A change here comes
# with the test below that proves the new capability.
_KINDS = ["sliding_window", "logits_soft_cap"]
DECLARED = {"torch": _KINDS, "cpu": ["rotary_in_kernel", *_KINDS],
            "flashinfer": ["cuda_graph_decode", *_KINDS]}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
SCALE = HEAD_DIM**-0.5


@pytest.fixture
def backend(request, monkeypatch) -> AttentionBackend:
    """The backend named by the test's parameter, flashinfer as the stand-in."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    return make_attention_backend(request.param, torch.device("cpu"))


def test_every_backend_is_declared():
    assert set(CLASSES) == set(ATTENTION_BACKENDS) - {"auto"}
    for name, cls in CLASSES.items():
        assert issubclass(cls, AttentionBackend) and cls.name == name
        assert cls.capabilities.names() == DECLARED[name]


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_backend_has_the_optional_methods_it_declares_and_no_others(name):
    cls, caps = CLASSES[name], CLASSES[name].capabilities

    def own(method: str) -> bool:
        return getattr(cls, method) is not getattr(AttentionBackend, method)

    assert own("forward_rotary") == caps.rotary_in_kernel
    assert own("graph_decode_plan") == own("replan") == caps.cuda_graph_decode
    # A window or a cap is a kind build_plan takes, not a method: what
    # proves them is test_windows_and_caps_attend_as_the_reference.


# What each kind capability is checked with: a window not aligned to the
# blocks, a cap the scores exceed, and both.
_KIND_CHECKS = {
    "sliding_window": [AttentionLayerKind(sliding_window=5)],
    "logits_soft_cap": [AttentionLayerKind(logits_soft_cap=2.0),
                        AttentionLayerKind(sliding_window=5, logits_soft_cap=2.0)],
}


@pytest.mark.parametrize("backend", list(CLASSES), indirect=True)
@pytest.mark.parametrize("capability", list(_KIND_CHECKS))
@torch.inference_mode()
def test_windows_and_caps_attend_as_the_reference(backend, capability):
    """A backend declaring a window or a cap attends with it as the dense
    float64 reference does (decodes past the window, a chunk crossing its
    edge, a prompt longer than it, GQA); one that does not is refused at
    build_plan."""
    for kind in _KIND_CHECKS[capability]:
        steps = [(20, 1), (6, 7), (0, 11), (3, 1)]
        reqs = WindowRequests([c + n for c, n in steps], seed=3, spread=2.0)
        for r, (c, _) in enumerate(steps):
            reqs.prefill_cache(r, c)
        rows, scheduled = list(range(len(steps))), [n for _, n in steps]
        md, q, k, v = reqs.step(rows, scheduled)
        if capability not in backend.capabilities.names():
            with pytest.raises(ValueError, match=f"does not declare {capability}"):
                backend.build_plan(md, len(q), kind)
            continue
        out = backend.forward(q, k, v, reqs.cache, md, WINDOW_SCALE,
                              backend.build_plan(md, len(q), kind))
        torch.testing.assert_close(out.double(), reqs.expected(rows, scheduled, kind),
                                   atol=2e-5, rtol=2e-5, msg=str(kind))


def test_a_kind_beyond_the_declaration_is_refused_at_build_plan():
    class Plain(TorchAttentionBackend):
        capabilities = AttentionCapabilities()

    md, _ = build_attn_metadata([0], [3], [[1]], BLOCK)
    Plain().build_plan(md, 3, FULL_ATTENTION)
    with pytest.raises(ValueError, match="the 'torch' attention backend does not declare "
                                         "sliding_window, logits_soft_cap, which"):
        Plain().build_plan(md, 3, AttentionLayerKind(sliding_window=4, logits_soft_cap=30))


def _step(seed: int):
    """A decode over cached context, a prefill chunk and a fresh decode."""
    md, positions = build_attn_metadata([5, 0, 9], [1, 4, 1], [[2, 3], [1], [4, 5, 6]], BLOCK)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(md.num_actual_tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen)
    cache = torch.randn(2, 8, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    rotary = RotaryEmbedding(HEAD_DIM, {"rope_theta": 10000.0, "rope_type": "default"}, 64)
    return md, qkv, cache, rotary.tables(positions, md.max_seq_len, torch.float32)


@pytest.mark.parametrize("backend", list(CLASSES), indirect=True)
@pytest.mark.parametrize("kind", [FULL_ATTENTION, AttentionLayerKind(3, 1.0)], ids=str)
@torch.inference_mode()
def test_rotary_in_kernel_is_what_rotating_first_gives(backend, kind):
    md, qkv, cache, rope = _step(0)
    plan = backend.build_plan(md, md.num_actual_tokens, kind)
    if not backend.capabilities.rotary_in_kernel:
        with pytest.raises(NotImplementedError, match=f"the '{backend.name}' attention "
                                                      f"backend does not declare rotary_in_kernel"):
            backend.forward_rotary(qkv, HEADS, rope, cache, md, SCALE, plan)
        return
    ref_cache = cache.clone()
    qk, v = qkv.split([HEADS + KV_HEADS, KV_HEADS], dim=1)
    q, k = apply_rotary_tables(qk, rope).split([HEADS, KV_HEADS], dim=1)
    ref = backend.forward(q, k, v, ref_cache, md, SCALE, backend.build_plan(md, len(q), kind))
    out = backend.forward_rotary(qkv, HEADS, rope, cache, md, SCALE, plan)
    assert out is not None  # these tensors are ones its kernel takes
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cache, ref_cache, atol=1e-6, rtol=1e-6)


def _decode(computed: list[int], tables: list[list[int]], seed: int):
    md, _ = build_attn_metadata(computed, [1] * len(computed), tables, BLOCK)
    gen = torch.Generator().manual_seed(seed)
    n = len(computed)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    k, v = torch.randn(2, n, KV_HEADS, HEAD_DIM, generator=gen).unbind(0)
    return md, q, k, v


@pytest.mark.parametrize("backend", list(CLASSES), indirect=True)
@torch.inference_mode()
def test_graph_decode_plans_replan_to_each_step(backend):
    """A graph decode plan attends its own step, and after replan another's
    (same batch size), as the torch reference does."""
    num_blocks, batch = 9, 3
    buffers = GraphBuffers(
        input_ids=torch.zeros(batch, dtype=torch.int64),
        positions=torch.zeros(batch, dtype=torch.int64),
        slot_mapping=torch.zeros(batch, dtype=torch.int64),
        indptr=torch.zeros(batch + 1, dtype=torch.int32),
        indices=torch.zeros(num_blocks + batch, dtype=torch.int32),
        last_page_len=torch.zeros(batch, dtype=torch.int32))
    kwargs = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=SCALE,
                  dtype=torch.float32, kv_dtype=torch.float32, page_size=BLOCK)
    first = _decode([2, 5, 0], [[0], [1, 2], [3]], 1)
    if not backend.capabilities.cuda_graph_decode:
        with pytest.raises(NotImplementedError, match="does not declare cuda_graph_decode"):
            backend.graph_decode_plan(first[0], num_blocks - 1, buffers, **kwargs)
        with pytest.raises(NotImplementedError, match="does not declare cuda_graph_decode"):
            backend.replan(backend.build_plan(first[0], batch), first[0])
        return
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM,
                        generator=torch.Generator().manual_seed(3))
    plan = backend.graph_decode_plan(first[0], num_blocks - 1, buffers, **kwargs)
    for i, (md, q, k, v) in enumerate([first, _decode([7, 1, 3], [[4, 5], [6], [7]], 2)]):
        if i:
            backend.replan(plan, md)
        ref_cache = cache.clone()
        ref = paged_attention(q, k, v, ref_cache, md, SCALE)
        out = backend.forward(q, k, v, cache, md, SCALE, plan)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache, ref_cache)


# ---- what a model needs, checked at load -----------------------------------

@torch.inference_mode()
def test_a_model_needing_an_undeclared_capability_is_refused(tiny_model_dir):
    class Unwindowed(CpuAttentionBackend):  # the cpu backend before it took windows
        capabilities = AttentionCapabilities(rotary_in_kernel=True)

    model = load_model(tiny_model_dir, single_process_state(), torch.float32)
    model.attention_needs = AttentionCapabilities(sliding_window=True, rotary_in_kernel=True)
    before = [model.attn_backend, *(layer.self_attn.attn_backend for layer in model.layers)]
    with pytest.raises(ValueError) as err:
        model.set_attention_backend(Unwindowed())
    assert str(err.value) == (
        "LlamaForCausalLM needs attention with sliding_window, which the 'cpu' attention "
        "backend does not declare (it declares: rotary_in_kernel)")
    after = [model.attn_backend, *(layer.self_attn.attn_backend for layer in model.layers)]
    assert all(a is b for a, b in zip(after, before, strict=True))  # nothing half-set
    model.attention_needs = AttentionCapabilities(rotary_in_kernel=True)
    with pytest.raises(ValueError, match="needs attention with rotary_in_kernel, which the "
                                         "'torch' attention backend does not declare "
                                         r"\(it declares: sliding_window, logits_soft_cap\)"):
        model.set_attention_backend(TorchAttentionBackend())
    cpu = CpuAttentionBackend()
    model.set_attention_backend(cpu)  # what it needs, declared
    assert all(layer.self_attn.rotary_in_kernel for layer in model.layers)


def test_the_runner_refuses_such_a_model_at_load(tiny_model_dir, monkeypatch):
    real = model_runner_module.load_model

    def needs_rotary_in_kernel(*args, **kwargs):
        model = real(*args, **kwargs)
        model.attention_needs = AttentionCapabilities(logits_soft_cap=True, rotary_in_kernel=True)
        return model

    monkeypatch.setattr(model_runner_module, "load_model", needs_rotary_in_kernel)
    runner = ModelRunner(single_process_state(), tiny_model_dir, torch.float32, 0,
                         limits=runner_limits(), attention_backend="torch")
    with pytest.raises(ValueError, match="LlamaForCausalLM needs attention with "
                                         "rotary_in_kernel, which the 'torch' attention backend"):
        runner.load_model()


@pytest.mark.parametrize(("backend", "in_kernel"), [("torch", False), ("cpu", True)],
                         indirect=["backend"])
def test_layers_rotate_in_the_kernel_exactly_where_it_is_declared(tiny_model_dir, backend,
                                                                  in_kernel):
    model = load_model(tiny_model_dir, single_process_state(), torch.float32)
    model.set_attention_backend(backend)
    assert [layer.self_attn.rotary_in_kernel for layer in model.layers] == (
        [in_kernel] * model.num_local_layers)


# ---- no probing ------------------------------------------------------------

# Names that hold an attention backend or a layer in workerd's code.
_HOLDERS = re.compile(r"backend|attn|layer|mlp|norm|^module$|^m$|^op$|^ops?_|_op$")
# Members only some backends or layers have.
_OPTIONAL = {"forward_rotary", "graph_decode_plan", "replan", "kernels", "capabilities",
             "forward_cpu", "forward_native", "use_kernels", "_views", "rotary_in_kernel"}
# Where a resolved backend name is read: the selection, and the rank's
# kernel rule it implies (workerd/layers/custom_op.py).
_NAME_READERS = {"layers/attention/backend.py", "layers/custom_op.py"}


def _dotted(node: ast.AST) -> list[str]:
    """a.b.c -> [a, b, c]; [] for anything else (a call's result, a subscript)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return inner + [node.attr] if inner else []
    return []


def _probes(tree: ast.AST, where: str) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        if node.func.id in ("getattr", "hasattr") and node.args:
            target = _dotted(node.args[0])
            attr = node.args[1] if len(node.args) > 1 else None
            named = attr.value if isinstance(attr, ast.Constant) else None
            if any(_HOLDERS.search(part) for part in target) or named in _OPTIONAL:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        if (node.func.id == "isinstance" and len(node.args) == 2
                and re.search(r"Backend\b", ast.unparse(node.args[1]))):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def _name_checks(tree: ast.AST, where: str) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [s for s in sides if isinstance(s, ast.Constant) and s.value in CLASSES]
            if names and any("backend" in ast.unparse(s) for s in sides):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_probes_are_caught():
    code = ("getattr(self.attn_backend, 'forward_rotary', None)\nhasattr(module, '_views')\n"
            "getattr(x, 'kernels', None)\nisinstance(b, CpuAttentionBackend)\n"
            "getattr(config, 'head_dim', None)\ngetattr(importlib.import_module(m), cls)\n")
    assert len(_probes(ast.parse(code), "x")) == 4
    assert len(_name_checks(ast.parse("backend != 'flashinfer'\nd.type == 'cpu'"), "x")) == 1


def test_nothing_in_workerd_probes_a_backend_or_a_layer():
    probes, names = [], []
    for path in sorted(WORKERD.rglob("*.py")):
        where = str(path.relative_to(WORKERD))
        tree = ast.parse(path.read_text())
        probes += _probes(tree, where)
        if where not in _NAME_READERS:
            names += _name_checks(tree, where)
    assert probes == [] and names == []
