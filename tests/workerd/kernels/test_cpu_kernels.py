"""The CPU kernels' build: cached on disk per source, compiler and CPU, never
left half-written, and a compiler that fails is reported with its output."""

from __future__ import annotations

import os

from workerd.kernels import loader as cpu_kernels


def test_the_build_is_cached_on_disk_per_source_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    cpu_kernels.load_kernels.cache_clear()
    try:
        cpu_kernels.load_kernels()
        built = sorted((tmp_path / "kernels").iterdir())
        assert [p.suffix for p in built] == [".so"]  # no temporary file left behind
        stamp = built[0].stat().st_mtime_ns
        cpu_kernels.load_kernels.cache_clear()
        cpu_kernels.load_kernels()
        assert sorted((tmp_path / "kernels").iterdir()) == built
        assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
        # Another CPU (other feature flags) gets its own build.
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : sse2")
        cpu_kernels.load_kernels.cache_clear()
        cpu_kernels.load_kernels()
        assert len(list((tmp_path / "kernels").iterdir())) == 2
    finally:
        cpu_kernels.load_kernels.cache_clear()


def test_a_compiler_that_fails_is_reported_with_its_output(tmp_path, monkeypatch):
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake-cc 1.0 && exit 0\n"
                    "echo 'fake-cc: error: no target' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    cpu_kernels.load_kernels.cache_clear()
    try:
        reason = cpu_kernels.kernels_unavailable()
    finally:
        cpu_kernels.load_kernels.cache_clear()
    assert reason is not None and reason.startswith(
        f"{fake} failed to build kvloom_cpu_kernels: fake-cc: error: no target")
    assert os.listdir(tmp_path / "kernels") == []  # the failed build left nothing
