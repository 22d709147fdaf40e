"""What a rank says its hardware does natively: the CPU flags that make bf16
fast, the one-word instruction-set summary benchmarks print, and the
native_bf16 a worker reports at registration (--dtype auto reads it)."""

from __future__ import annotations

import torch

from workerd.cpu_features import cpu_flags, isa_summary, native_bf16
from workerd.distributed.devices import device_native_bf16


def test_native_bf16_needs_avx512_bf16_or_amx():
    assert native_bf16(frozenset({"avx512_bf16", "avx512f"}))
    assert native_bf16(frozenset({"amx_bf16", "amx_tile"}))
    assert not native_bf16(frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert not native_bf16(frozenset())


def test_the_summary_names_the_widest_set_and_the_bf16_extras():
    assert isa_summary(frozenset({"avx2", "avx", "sse4_2"})) == "avx2"
    assert isa_summary(frozenset({"avx512f", "avx512_vnni", "avx2"})) == "avx512_vnni"
    assert isa_summary(frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})) == \
        "avx512_bf16+avx512_vnni"
    assert isa_summary(frozenset({"amx_bf16", "avx512_bf16"})) == "amx_bf16+avx512_bf16"


def test_a_rank_reports_what_its_device_does(monkeypatch):
    assert device_native_bf16("cpu") == native_bf16(cpu_flags())
    assert device_native_bf16("mps") is False
    if not torch.cuda.is_available():
        assert device_native_bf16("auto") == device_native_bf16("cpu")
        assert device_native_bf16("cuda") is False


def test_the_registration_carries_it():
    from workerd.__main__ import _register_request, build_config, build_parser

    config = build_config(build_parser().parse_args(["--controlplane", "127.0.0.1:1",
                                                     "--device", "cpu"]))
    request = _register_request(config.registration, 0)
    assert request.native_bf16 == native_bf16()
