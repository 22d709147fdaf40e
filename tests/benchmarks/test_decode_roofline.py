"""benchmarks/decode_roofline.py: its matmul floor must be exactly the model's
weight matmuls (a missed or extra projection would make the ratio lie), and
one tiny run must go end to end through the real ModelRunner."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.decode_roofline import count_dispatches, main, matmul_layers, matmul_shape
from workerd.distributed.parallel_state import single_process_state
from workerd.layers import packed_linear
from workerd.layers.packed_linear import pack_linear_weights, packing_unavailable
from workerd.models.loader import load_model
from workerd.runner.model_runner import ModelRunner


def test_matmul_layers_are_the_models_projections_and_lm_head(tiny_model_dir):
    model = load_model(tiny_model_dir, single_process_state(), torch.float32)
    cfg = model.config
    layers = matmul_layers(model)
    weights = [(n, m.weight) for n, m in layers]
    names = [n for n, _ in weights]
    assert len(weights) == 4 * cfg.num_hidden_layers + 1
    assert names[:4] == ["layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj",
                         "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"]
    assert names[-1] == "lm_head"
    d, h, kv = model.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    assert [tuple(w.shape) for _, w in weights[:4]] == [
        ((h + 2 * kv) * d, cfg.hidden_size), (cfg.hidden_size, h * d),
        (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]
    # Every parameter is either one of those weights, the embedding or a norm:
    # nothing that multiplies activations by a matrix is left out of the floor.
    ours = {w.data_ptr() for _, w in weights}
    others = {model.embed_tokens.weight.data_ptr()} | {
        p.data_ptr() for n, p in model.named_parameters() if n.endswith("norm.weight")}
    assert {p.data_ptr() for p in model.parameters()} == ours | others
    assert len(ours) == len(weights)
    # Packed, the floor keeps the same layers and shapes (now the packed ones').
    shapes = [matmul_shape(m) for _, m in layers]
    if packing_unavailable(torch.device("cpu"), torch.float32) is None:
        pack_linear_weights(model, 4, min_elements=0)
        assert [matmul_shape(m) for _, m in matmul_layers(model)] == shapes
        assert all(m.packed_weight is not None for _, m in matmul_layers(model))


def test_tiny_run_writes_the_table_as_json(tiny_model_dir, tmp_path, capsys, monkeypatch):
    # The tiny weights are below the packing threshold: pack them anyway.
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", 0)
    out = tmp_path / "roofline.json"
    payload = main(["--model", tiny_model_dir, "--batch-sizes", "1,3", "--context", "6",
                    "--steps", "2", "--warmup", "1", "--linear-kernels", "onednn,aten",
                    "--out", str(out)])
    assert json.loads(out.read_text()) == payload
    assert [(r["batch"], r["linear"]) for r in payload["results"]] == [
        (1, "onednn"), (1, "aten"), (3, "onednn"), (3, "aten")]
    layers = 4 * 4 + 1  # four decoder layers' projections and the LM head
    assert [r["packed_layers"] for r in payload["results"]] == [layers, 0, layers, 0]
    for row in payload["results"]:
        assert row["step_ms"] > 0 and row["matmul_ms"] > 0
        assert row["ratio"] == row["step_ms"] / row["matmul_ms"]
    assert "ratio" in capsys.readouterr().out
    # The step's torch ops are per layer and per step, none per request.
    counts = [r["dispatches"] for r in payload["results"]]
    assert counts[0] == counts[2] > 4 * 4  # four layers, several ops each
    assert counts[1] == counts[3]


def test_prepare_times_the_entry_execute_model_lays_steps_out_with(tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    """The benchmark's `prepare` is ModelRunner.prepare_inputs, public and the
    very call execute_model makes, timed again on a step execute_model ran."""
    real_prepare, real_execute = ModelRunner.prepare_inputs, ModelRunner.execute_model
    running: list[int] = []
    seen: list[tuple[str, int]] = []

    def prepare(self, so):
        seen.append(("execute_model" if running else "benchmark", so.step_id))
        return real_prepare(self, so)

    def execute(self, so):
        running.append(so.step_id)
        try:
            return real_execute(self, so)
        finally:
            running.pop()

    monkeypatch.setattr(ModelRunner, "prepare_inputs", prepare)
    monkeypatch.setattr(ModelRunner, "execute_model", execute)
    main(["--model", tiny_model_dir, "--batch-sizes", "2", "--context", "6", "--steps", "2",
          "--warmup", "0", "--out", str(tmp_path / "roofline.json")])
    timed = [step for who, step in seen if who == "benchmark"]
    assert len(timed) == 2 * 2  # the prepared inputs and the timed call, per step
    assert all(("execute_model", step) in seen for step in timed)


@pytest.mark.parametrize("kernels", ["", "onednn,onednn", "mkl", "onednn,"])
def test_hostile_linear_kernels_are_refused(kernels, capsys):
    with pytest.raises(SystemExit):
        main(["--linear-kernels", kernels])
    assert "give distinct kernels" in capsys.readouterr().err


def test_count_dispatches_counts_torch_ops():
    x = torch.ones(3)
    assert count_dispatches(lambda: (x + 1).mul_(2).sum()) == 3
    assert count_dispatches(lambda: None) == 0


def test_the_cpu_kernels_take_torch_ops_off_the_step(tiny_model_dir, tmp_path):
    """auto resolves as a worker does (the cpu kernels here); each decode
    step then calls fewer torch ops than with the torch backend."""
    counts = {}
    for backend in ("auto", "torch"):
        payload = main(["--model", tiny_model_dir, "--batch-sizes", "2", "--context", "6",
                        "--steps", "1", "--warmup", "1", "--attention-backend", backend,
                        "--out", str(tmp_path / f"{backend}.json")])
        counts[backend] = payload["results"][0]["dispatches"]
    assert 0 < counts["auto"] < counts["torch"]


@pytest.mark.parametrize("backend", ["flashinfer", "CPU", ""])
def test_attention_backends_it_cannot_measure_are_refused(backend, capsys):
    with pytest.raises(SystemExit):
        main(["--attention-backend", backend])
    assert "--attention-backend" in capsys.readouterr().err
