"""--dtype auto's rule (controlplane/executor/model_dtype.py) and the
checkpoint dtype it reads (controlplane/model_info.py)."""

from __future__ import annotations

import pytest

from controlplane.executor.model_dtype import resolve_dtype
from controlplane.model_info import checkpoint_dtype


def test_auto_is_bf16_only_for_a_16_bit_checkpoint_on_native_ranks():
    assert resolve_dtype("auto", "bfloat16", {0: True})[0] == "bfloat16"
    dtype, why = resolve_dtype("auto", "bfloat16", {0: True, 1: False, 2: False})
    assert dtype == "float32"
    assert "rank(s) [1, 2] do not run bf16 natively" in why and "--dtype bfloat16" in why
    assert resolve_dtype("auto", "float32", {0: True}) == (
        "float32", "--dtype auto: the checkpoint is float32")
    assert resolve_dtype("auto", "", {0: True})[1].endswith("of no stated dtype")


@pytest.mark.parametrize("explicit", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_always_wins(explicit):
    for checkpoint in ("", "float32", "bfloat16"):
        for native in ({0: False}, {0: True}):
            assert resolve_dtype(explicit, checkpoint, native) == (explicit, f"--dtype {explicit}")


@pytest.mark.parametrize(("config", "stated"), [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),  # transformers before 5
    ({"dtype": "float32", "torch_dtype": "bfloat16"}, "float32"),  # the newer key wins
    ({"text_config": {"dtype": "bfloat16"}}, "bfloat16"),  # a multimodal wrapper's text model
    ({}, ""),
    ({"dtype": "float64"}, ""),  # not one the workers load
    ({"dtype": "int8"}, ""),
    ({"dtype": ["bfloat16"]}, ""),
    ({"dtype": None, "torch_dtype": None}, ""),
    ({"dtype": "b" * 10_000}, ""),
])
def test_the_checkpoint_dtype_is_read_strictly(config, stated):
    assert checkpoint_dtype(config) == stated
