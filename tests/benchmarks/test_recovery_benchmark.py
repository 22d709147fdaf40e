"""benchmarks/recovery.py's namespace-host cases run and report what they
measured: a host cut and a controlplane kill on the tiny model, every
stream checked against an undisturbed run by the benchmark itself (it exits
otherwise). Its flags refuse hostile values before anything starts."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks import recovery
from kvloom_testing.netns import netns_unavailable
from tests.benchmarks.script_runner import read_json, run_script


@pytest.mark.slow
@pytest.mark.skipif(netns_unavailable() is not None, reason=netns_unavailable() or "")
def test_the_netns_cases_measure_a_cut_and_a_restart(tiny_model_dir, tmp_path):
    out = tmp_path / "recovery.json"
    done = run_script("recovery", "--model", tiny_model_dir, "--layouts", "", "--netns",
                      "host-cut,cp-kill", "--repeats", "1", "--cut-s", "4",
                      "--num-requests", "2", "--prompt-len", "6", "--json", str(out),
                      timeout=300)
    rows = {r["case"]: r for r in read_json(out)["netns"]}
    cut, kill = rows["host-cut"], rows["cp-kill"]
    # The pause covers the cut; the group failed and re-formed once in it.
    assert all(p >= 4.0 for p in cut["pause_s"]) and cut["reform_s"] > 0
    assert all(h < cut["cut_s"] for h in cut["heal_to_next_token_s"])
    assert kill["in_flight"] == ["UNAVAILABLE"] and kill["weights_reused"]
    assert 0 < kill["restart_to_first_token_s"] < 60
    table = done.stdout
    assert "host-cut" in table and "cp-kill" in table and "restart->token s" in table


@pytest.mark.parametrize("argv, words", [
    (["--cut-s", "nan"], "must be in 0.5..120"),
    (["--cut-s", "-1"], "must be in 0.5..120"),
    (["--cut-s", "1000"], "must be in 0.5..120"),
    (["--repeats", "0"], "invalid choice"),
    (["--ready-timeout-s", "inf"], "must be in 1..3600"),
    (["--ready-timeout-s", "0"], "must be in 1..3600"),
    (["--netns-layout", "1x1"], "2 to 4 ranks"),
    (["--netns-layout", "8x8"], "2 to 4 ranks"),
    (["--netns-layout", "two"], "expected TPxPP"),
    (["--placement", ""], "expected local and/or ray"),
    (["--placement", "kubernetes"], "expected local and/or ray"),
    (["--placement", "ray;ls"], "expected local and/or ray"),
])
def test_hostile_flags_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit):
        recovery.main(["--layouts", "", *argv])
    assert words in capsys.readouterr().err


def test_an_unknown_case_is_named(tiny_model_dir):
    if netns_unavailable() is not None:
        pytest.skip(netns_unavailable())
    with pytest.raises(SystemExit, match=r"unknown case\(s\) \['partition'\]"):
        recovery.main(["--model", tiny_model_dir, "--layouts", "", "--netns", "partition"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs kvloom[ray]")
def test_local_and_ray_restarts_are_measured_side_by_side(tiny_model_dir, tmp_path):
    # A process of its own: Ray reads its authentication settings (the test
    # head's token) once, when it is first imported.
    out = tmp_path / "recovery.json"
    done = run_script("recovery", "--model", tiny_model_dir, "--layouts", "2x1",
                      "--placement", "local,ray", "--kills", "1", "--num-requests", "2",
                      "--prompt-len", "6", "--max-tokens", "40", "--json", str(out),
                      timeout=600)
    rows = read_json(out)["kill"]
    assert [r["placement"] for r in rows] == ["local", "ray"]
    for row in rows:  # the benchmark itself exits when tokens differ
        assert row["tokens_match_undisturbed"] and row["recoveries"] == 1
        assert row["restarts"] == {"0": 1}  # rank 0, once (JSON keys are strings)
        assert 0 < row["kill_to_next_token_s"][0]["median"] < 60 and row["ready_s"] > 0
    assert "placement" in done.stdout and " ray " in done.stdout and " local " in done.stdout
