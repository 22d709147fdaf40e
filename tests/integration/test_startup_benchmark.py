"""benchmarks/startup.py: each start of a real cluster is timed to readiness
and through its stop, every process it started is gone afterwards, its CPU is
counted, and every flag refuses a hostile value."""

from __future__ import annotations

import json

import pytest

from benchmarks import startup

pytestmark = pytest.mark.slow


def test_two_starts_are_timed_and_leave_nothing_running(tiny_model_dir, tmp_path, capsys,
                                                        monkeypatch):
    clusters = []
    real = startup.launcher.Cluster

    def tracked(*args, **kwargs):
        clusters.append(real(*args, **kwargs))
        return clusters[-1]

    monkeypatch.setattr(startup.launcher, "Cluster", tracked)
    out = tmp_path / "startup.json"
    assert startup.main(["--model", tiny_model_dir, "--layouts", "1x1", "--repeats", "2",
                         "--kv-cache-mib", "16", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["layout"] == "1x1" and len(row["runs"]) == 2 and len(clusters) == 2
    for run in row["runs"]:
        # Ready means the cluster answered SERVING: a TP=1 start is a
        # controlplane and a worker, each a Python process that imports.
        assert 0 < run["ready_s"] < 600 and run["stop_s"] >= 0 and run["children_cpu_s"] > 0.5
    assert all(p.popen.poll() is not None for c in clusters for p in c.processes)
    assert "1x1" in capsys.readouterr().out


@pytest.mark.parametrize(("flag", "hostile"), [
    ("--repeats", "0"), ("--repeats", "-1"), ("--repeats", "101"), ("--repeats", "many"),
    ("--layouts", "0x1"), ("--layouts", "2x"), ("--layouts", "1x1,-1x2"),
    ("--worker-threads", "0"), ("--kv-cache-mib", "-1"), ("--kv-cache-mib", str(1 << 40)),
    ("--ready-timeout", "-5"), ("--ready-timeout", "nan"),
])
def test_hostile_flags_are_refused(flag, hostile, capsys):
    with pytest.raises(SystemExit) as info:
        startup.main([flag, hostile])
    assert info.value.code == 2 and flag in capsys.readouterr().err
