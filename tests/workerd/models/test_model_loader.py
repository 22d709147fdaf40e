"""The checkpoint loader: every rank reads only its slice (get_slice, never a
whole tensor), sharded checkpoints load like single-file ones, missing
tensors are reported by name, and LoadTargets fill views of parameters from
their own slices of one checkpoint tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

import workerd.models.loader as model_loader
from kvloom.common.model_config import parse_model_config
from kvloom_testing.attention import paged_step
from kvloom_testing.checkpoints import make_tiny_llama
from tests.factories import layout_state
from workerd.models.loader import load_model, load_weight_map
from workerd.models.weight_targets import LoadTarget, narrow_index


def _full(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in model_loader.checkpoint_files(path):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})  # noqa: SIM118
    return out


class _SpySlice:
    def __init__(self, inner, name, calls):
        self._inner, self._name, self._calls = inner, name, calls

    def get_shape(self):
        return self._inner.get_shape()

    def __getitem__(self, index):
        out = self._inner[index]
        self._calls.append(("read", self._name, out.numel()))
        return out


class _SpyHandle:
    def __init__(self, inner, calls):
        self._inner, self._calls = inner, calls

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def keys(self):
        return self._inner.keys()

    def get_slice(self, name):
        self._calls.append(("get_slice", name, 0))
        return _SpySlice(self._inner.get_slice(name), name, self._calls)

    def get_tensor(self, name):
        self._calls.append(("get_tensor", name, 0))
        return self._inner.get_tensor(name)


def test_tp_rank_reads_only_its_slices(tiny_model_dir, monkeypatch):
    calls = []
    real = model_loader.safe_open
    monkeypatch.setattr(model_loader, "safe_open", lambda *a, **k: _SpyHandle(real(*a, **k), calls))
    model = load_model(tiny_model_dir, layout_state(tp_size=2, tp_rank=1), torch.float32)
    assert calls and {kind for kind, _, _ in calls} == {"get_slice", "read"}
    full = _full(tiny_model_dir)
    # Only this rank's half of every split tensor ever left the file.
    read = {name: n for kind, name, n in calls if kind == "read"}
    assert read["model.layers.3.self_attn.q_proj.weight"] == 32 * 64
    assert read["model.layers.3.mlp.down_proj.weight"] == 64 * 64
    assert sum(read.values()) < 0.55 * sum(t.numel() for t in full.values())
    layer = model.layers[3]
    p = "model.layers.3."
    attn = layer.self_attn
    qkv = attn.qkv_proj.checkpoint_params()
    torch.testing.assert_close(qkv["q_proj.weight"], full[p + "self_attn.q_proj.weight"][32:])
    torch.testing.assert_close(qkv["k_proj.weight"], full[p + "self_attn.k_proj.weight"][16:])
    torch.testing.assert_close(
        layer.self_attn.o_proj.weight, full[p + "self_attn.o_proj.weight"][:, 32:]
    )
    torch.testing.assert_close(layer.mlp.down_proj.weight, full[p + "mlp.down_proj.weight"][:, 64:])
    torch.testing.assert_close(layer.input_layernorm.weight, full[p + "input_layernorm.weight"])
    # vocab 511 over 2 ranks: 256 rows each; rank 1 holds 255 real rows + 1 zero pad row.
    emb = model.embed_tokens.weight
    assert emb.shape[0] == 256
    torch.testing.assert_close(emb[:255], full["model.embed_tokens.weight"][256:])
    assert emb[255].abs().sum() == 0
    torch.testing.assert_close(model.lm_head.weight[:255], full["lm_head.weight"][256:])


def test_replicated_kv_heads_when_tp_exceeds_kv_heads(tiny_model_dir):
    full = _full(tiny_model_dir)["model.layers.0.self_attn.k_proj.weight"]  # 2 KV heads x 16
    for tp_rank, kv_head in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        model = load_model(tiny_model_dir, layout_state(tp_size=4, tp_rank=tp_rank), torch.float32)
        assert model.num_kv_heads == 1
        k = model.layers[0].self_attn.qkv_proj.checkpoint_params()["k_proj.weight"]
        torch.testing.assert_close(k, full[kv_head * 16 : (kv_head + 1) * 16])


def test_pp_stage_loads_only_its_layers(tmp_path, monkeypatch):
    path = make_tiny_llama(tmp_path, tie_word_embeddings=True, num_shards=3)
    calls = []
    real = model_loader.safe_open
    monkeypatch.setattr(model_loader, "safe_open", lambda *a, **k: _SpyHandle(real(*a, **k), calls))
    model = load_model(str(path), layout_state(pp_size=2, pp_rank=1), torch.float32, (1, 3))
    assert (model.start_layer, model.end_layer, model.num_local_layers) == (1, 4, 3)
    assert model.embed_tokens is None
    read = {name for _, name, _ in calls}
    assert not any(n.startswith("model.layers.0.") for n in read)
    full = _full(path)
    torch.testing.assert_close(
        model.layers[0].mlp.gate_up_proj.checkpoint_params()["up_proj.weight"],
        full["model.layers.1.mlp.up_proj.weight"],
    )
    # Tied: the last stage's LM head comes from the embedding tensor.
    torch.testing.assert_close(model.lm_head.weight, full["model.embed_tokens.weight"])


def test_sharded_checkpoint_equals_single_file(tmp_path):
    one = load_model(str(make_tiny_llama(tmp_path / "one")), layout_state(), torch.float32)
    many = load_model(
        str(make_tiny_llama(tmp_path / "many", num_shards=4)), layout_state(), torch.float32
    )
    a, b = dict(one.named_parameters()), dict(many.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name])


def test_bfloat16_load(tiny_model_dir):
    model = load_model(tiny_model_dir, layout_state(), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary_emb.inv_freq.dtype == torch.float32


def test_missing_tensor_is_named(tmp_path):
    path = make_tiny_llama(tmp_path)
    full = _full(path)
    del full["model.layers.2.mlp.gate_proj.weight"]
    from safetensors.torch import save_file

    save_file(full, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors: model\.layers\.2\.mlp\.gate_proj"):
        load_model(str(path), layout_state(), torch.float32)


def test_fused_projections_are_one_weight_filled_through_their_views(tiny_model_dir):
    """q/k/v and gate/up each run as one matmul: the fused weight is the
    checkpoint tensors stacked, its views share its storage, and the weights
    are counted once."""
    model = load_model(tiny_model_dir, layout_state(), torch.float32)
    full = _full(tiny_model_dir)
    p = "model.layers.0."
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    torch.testing.assert_close(attn.qkv_proj.weight, torch.cat(
        [full[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
    torch.testing.assert_close(mlp.gate_up_proj.weight, torch.cat(
        [full[p + "mlp.gate_proj.weight"], full[p + "mlp.up_proj.weight"]]))
    view = attn.qkv_proj.checkpoint_params()["k_proj.weight"]
    assert view.untyped_storage().data_ptr() == attn.qkv_proj.weight.untyped_storage().data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    assert sum(t.numel() for t in model.parameters()) == sum(t.numel() for t in full.values())


# LoadTarget: one checkpoint tensor -> several views, each with its own slice
# (Phi-3's fused qkv_proj, MoE experts stacked into one weight).


def _spied(monkeypatch) -> list:
    calls = []
    real = model_loader.safe_open
    monkeypatch.setattr(model_loader, "safe_open", lambda *a, **k: _SpyHandle(real(*a, **k), calls))
    return calls


def _save(tmp_path, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_load_targets_read_each_views_own_slice(tmp_path, monkeypatch):
    """A fused [q; k; v] tensor (6 + 2 + 2 rows) into TP rank 1's fused weight:
    q rows 3:6, k row 7, v row 9, each read alone, none of the rest."""
    fused = torch.arange(40.0).view(10, 4)
    path = _save(tmp_path, {"qkv.weight": fused})
    calls = _spied(monkeypatch)
    weight = torch.zeros(5, 4)
    wanted = {"qkv.weight": [
        LoadTarget(weight[0:3], narrow_index(0, 3, 6)),
        LoadTarget(weight[3:4], narrow_index(0, 7, 8)),
        LoadTarget(weight[4:5], (slice(9, 10),)),
    ]}
    load_weight_map(wanted, path)
    torch.testing.assert_close(weight, fused[[3, 4, 5, 7, 9]])
    reads = [n for kind, _, n in calls if kind == "read"]
    assert reads == [12, 4, 4]
    assert not any(kind == "get_tensor" for kind, _, _ in calls)


def test_load_targets_int_index_and_mixed_entries(tmp_path, monkeypatch):
    """An int picks one expert of a stacked tensor; a parameter entry (old
    contract, its `shard`) and a target asking the same slice share a read."""
    stacked = torch.randn(3, 4, 2)
    table = torch.randn(6, 2)
    path = _save(tmp_path, {"experts.w": stacked, "table": table})
    calls = _spied(monkeypatch)
    expert = torch.zeros(2, 4, 2)
    head = nn.Parameter(torch.zeros(4, 2), requires_grad=False)
    head.shard = (0, 2, 5)  # 3 real rows + 1 pad row, as a vocab shard
    copy = torch.zeros(3, 2)
    load_weight_map({
        "experts.w": [LoadTarget(expert[0], (2,)), LoadTarget(expert[1], (0, slice(None)))],
        "table": [head, LoadTarget(copy, narrow_index(0, 2, 5))],
    }, path)
    torch.testing.assert_close(expert, stacked[[2, 0]])
    torch.testing.assert_close(head[:3], table[2:5])
    assert head[3].abs().sum() == 0
    torch.testing.assert_close(copy, table[2:5])
    assert [name for kind, name, _ in calls if kind == "read"].count("table") == 1


@pytest.mark.parametrize("src_index", [narrow_index(0, 0, 3), narrow_index(0, 8, 12)],
                         ids=["short-view", "slice-past-the-end"])
def test_load_target_shape_mismatch_names_the_tensor(tmp_path, src_index):
    path = _save(tmp_path, {"model.layers.0.mlp.experts.1.w1.weight": torch.zeros(10, 4)})
    dest = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.1\.w1\.weight: "
                                         r"checkpoint slice \(\d+, 4\) does not fit"):
        load_weight_map({"model.layers.0.mlp.experts.1.w1.weight": [LoadTarget(dest, src_index)]},
                        path)
    assert dest.abs().sum() == 0


def test_load_target_missing_tensor_is_named(tmp_path):
    path = _save(tmp_path, {"a": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"lacks 1 tensors: experts\.0\.w2\.weight"):
        load_weight_map({"a": [LoadTarget(torch.zeros(2))],
                         "experts.0.w2.weight": [LoadTarget(torch.zeros(2))]}, path)


def test_load_target_refuses_what_get_slice_cannot_read():
    with pytest.raises(ValueError, match="has a step"):
        LoadTarget(torch.zeros(2), (slice(0, 4, 2),))
    with pytest.raises(TypeError, match="slices or ints"):
        LoadTarget(torch.zeros(2), ("0",))
    with pytest.raises(TypeError, match="slices or ints"):
        LoadTarget(torch.zeros(2), (True,))
    with pytest.raises(ValueError, match="bad slice"):
        narrow_index(0, 3, 2)


def _without_architectures(path, **fields):
    """config.json as transformers saves a config read from a GGUF file: no architectures."""
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    return path


@torch.inference_mode()
def test_a_config_without_architectures_loads_its_model_types_class(tmp_path):
    """AutoModelForCausalLM builds LlamaForCausalLM from model_type alone; so
    does the loader (the controlplane's start-up check reads it with the same
    parser), and its logits are transformers' on the same weights."""
    from transformers import AutoModelForCausalLM

    path = _without_architectures(make_tiny_llama(tmp_path))
    model = load_model(str(path), layout_state(), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert type(model).__name__ == type(hf).__name__ == "LlamaForCausalLM"
    prompt = [5, 17, 3, 99, 42, 8, 61]
    ours = paged_step(model, [], [(prompt, 0, len(prompt))], [[0, 1]], 4)
    torch.testing.assert_close(ours, hf(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ["foo", "x" * 10_000])
def test_a_config_without_architectures_or_a_known_model_type_is_refused(tmp_path, model_type):
    """Refused before any tensor is allocated, with the controlplane's line."""
    path = _without_architectures(make_tiny_llama(tmp_path), model_type=model_type)
    with pytest.raises(ValueError, match="names no architectures and its model_type") as refused:
        load_model(str(path), layout_state(), torch.float32)
    with pytest.raises(ValueError) as controlplane_refused:
        parse_model_config(json.loads((path / "config.json").read_text()))
    assert str(refused.value) == str(controlplane_refused.value)
